"""Shared fixtures: tiny random-weight models of each supported architecture, and the real default model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from lookahead.attention import use_grouped_sdpa
from lookahead.models import DEFAULT_MODEL, LoadedModel, load_model
from lookahead.packed_linear import apply_linear_kernel, cpu_has_avx512

TINY_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma")

_TINY_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


# Both linear kernels, for tests that must hold on each execution path.
LINEAR_KERNELS = (
    "stock",
    pytest.param(
        "packed",
        marks=pytest.mark.skipif(not cpu_has_avx512(), reason="the packed kernel needs AVX-512"),
    ),
)


def build_tiny_model(
    architecture: str = "llama", linear_kernel: str = "stock", **config_overrides: Any
) -> Any:
    """A float32 model in eval mode whose weights depend only on the architecture and config, set
    up as load_model sets up a real one."""
    if architecture not in TINY_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {', '.join(TINY_ARCHITECTURES)}, got {architecture!r}")
    config = CONFIG_MAPPING[architecture](**{**_TINY_CONFIG, **config_overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    use_grouped_sdpa(model)
    apply_linear_kernel(model, linear_kernel)
    return model


@pytest.fixture
def tiny_model() -> Callable[..., Any]:
    """Factory: tiny_model("qwen2", vocab_size=49152) -> a seeded random-weight model."""
    return build_tiny_model


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """SmolLM2-135M-Instruct in float32 on the CPU, loaded once per test session."""
    return load_model(DEFAULT_MODEL)


class ByteTokenizer:
    """Token id = one byte (vocab 256), so multi-byte UTF-8 characters span several tokens."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


@pytest.fixture
def byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()
