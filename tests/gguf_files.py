"""Tiny random GGUF files written with gguf's own writer, as llama.cpp lays them out, for the loader's tests.

Block types gguf can quantise (Q4_0 ... Q8_0, F16, BF16) are quantised from a tiny random model's
weights by gguf.quants; the K types, which gguf-py only dequantises, get random blocks with sane
fp16 super-block scales (any bits of their integer fields are valid). The tokenizer is GPT-2's
byte-level one over the 256 bytes (no merges), with a chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_ARCH_NAMES,
    GGMLQuantizationType,
    GGUFValueType,
    GGUFWriter,
    get_tensor_name_map,
)
from gguf.quants import quantize
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

Q = GGMLQuantizationType
QUANTISABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.F16, Q.BF16)
K_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Types gguf-py does not quantise, written as random blocks; the bytes of each block holding fp16
# scales (d, dmin), set to sane values.
RANDOM_BLOCKS = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.Q8_K: (),  # gguf cannot dequantise it: only its size matters
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
EOS = 10  # the byte "\n" ends a turn
# Large enough rows for K blocks (256 inputs), small enough to load in a blink.
TINY = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=EOS,
    pad_token_id=0,
)
ARCHITECTURE = {  # general.architecture and, for Mistral, the name that tells transformers so
    "llama": ("llama", "tiny-llama"),
    "mistral": ("llama", "tiny-mistral"),
    "qwen2": ("qwen2", "tiny-qwen2"),
    "qwen3": ("qwen3", "tiny-qwen3"),
    "phi3": ("phi3", "tiny-phi3"),
    "gemma2": ("gemma2", "tiny-gemma2"),
    "gemma3": ("gemma3", "tiny-gemma3"),
}


# transformers reads no head size from a qwen3 file: its default, 128, is what the file must hold.
_ARCHITECTURE_CONFIG = {"qwen3": dict(head_dim=128)}


def tiny_config(model_type: str, **overrides: Any) -> Any:
    config_type = "gemma3_text" if model_type == "gemma3" else model_type
    settings = {**TINY, "tie_word_embeddings": True, **_ARCHITECTURE_CONFIG.get(model_type, {}), **overrides}
    return CONFIG_MAPPING[config_type](**settings)


def random_blocks(qtype: GGMLQuantizationType, rows: int, inputs: int, seed: int) -> np.ndarray:
    """Blocks [rows, bytes per row] of a RANDOM_BLOCKS type: random bits, fp16 scales of small
    normal values (some negative, some zero)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, inputs // block_size * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for start in RANDOM_BLOCKS[qtype]:
        scales = (np.abs(rng.standard_normal(len(blocks))) * 0.02).astype(np.float16)
        scales[::5] *= -1
        scales[::13] = 0
        blocks[:, start : start + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


def encoded(weights: np.ndarray, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """A matrix in `qtype`: quantised by gguf, or random blocks; F32 as it is."""
    if qtype == Q.F32:
        return weights.astype(np.float32)
    if qtype in RANDOM_BLOCKS:
        return random_blocks(qtype, weights.shape[0], weights.shape[1], seed)
    return quantize(weights.astype(np.float32), qtype)


def write_gguf(
    path: Path,
    model_type: str = "llama",
    qtype: GGMLQuantizationType = Q.Q8_0,
    embedding_type: GGMLQuantizationType | None = None,
    tokenizer: bool = True,
    overrides: dict[str, GGMLQuantizationType] | None = None,
    architecture: str | None = None,
    metadata: dict[str, tuple[Any, GGUFValueType] | None] | None = None,
    **config: Any,
) -> Path:
    """A tiny random `model_type` model's GGUF file: every matrix in `qtype` (the token embedding in
    `embedding_type`, default `qtype`; `overrides`: tensor name -> its type), norms and biases F32.
    architecture: the general.architecture written, if not the model type's. metadata: key ->
    (value, type) written instead of what the model gives it, or None to leave the key out."""
    written_architecture, name = ARCHITECTURE[model_type]
    architecture = architecture or written_architecture
    hf_config = tiny_config(model_type, **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    writer = GGUFWriter(str(path), architecture)
    writer.add_name(name)
    for key, attribute in GGUF_CONFIG_MAPPING[written_architecture].items():
        value = getattr(hf_config, attribute, None) if attribute else None
        if value is None:
            continue
        field = f"{architecture}.{key}"
        if isinstance(value, float):
            writer.add_float32(field, value)
        else:
            writer.add_uint32(field, int(value))
    if tokenizer:
        _add_tokenizer(writer)
    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == written_architecture)
    names = get_tensor_name_map(arch, hf_config.num_hidden_layers)
    written = set()
    for index, (parameter, tensor) in enumerate(model.state_dict().items()):
        base, _, suffix = parameter.rpartition(".")
        if base == "lm_head" and hf_config.tie_word_embeddings:
            continue  # the token embedding serves as the output layer
        found = names.get_name(base)
        if found is None:
            raise ValueError(f"no GGUF name for {parameter}")
        gguf_name = f"{found}.{suffix}"
        if gguf_name in written:
            continue
        written.add(gguf_name)
        weights = tensor.numpy()
        if weights.ndim == 1:
            writer.add_tensor(gguf_name, weights.astype(np.float32))
            continue
        kind = (overrides or {}).get(gguf_name, embedding_type if found == "token_embd" else None) or qtype
        data = encoded(weights, kind, seed=index)
        writer.add_tensor(gguf_name, data, raw_dtype=None if kind == Q.F32 else kind)
    for key, entry in (metadata or {}).items():
        if entry is None:
            writer.kv_data[0].pop(key, None)
        else:
            value, kind = entry
            sub_type = GGUFValueType.get_type(value[0]) if kind == GGUFValueType.ARRAY else None
            writer.kv_data[0].pop(key, None)
            writer.add_key_value(key, value, kind, sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: GGUFWriter) -> None:
    spelling = bytes_to_unicode()
    tokens = [spelling[byte] for byte in range(256)]  # token id = byte value
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(TINY["bos_token_id"])
    writer.add_eos_token_id(EOS)
    writer.add_pad_token_id(TINY["pad_token_id"])
    writer.add_chat_template(CHAT_TEMPLATE)
