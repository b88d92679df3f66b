"""Lean decoder layers: taken only where they give the model's own bits, on every kind of forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache

from lookahead import lean_layers
from lookahead.decoder import LookaheadDecoder
from lookahead.draft import Draft
from lookahead.kv_pool import KVPool
from lookahead.packed_linear import cpu_has_avx512, pack_linear_layers
from tests.conftest import build_tiny_model
from tests.test_attention import tree_logits

pytestmark = pytest.mark.skipif(not cpu_has_avx512(), reason="lean layers run on the packed kernel")


def is_lean(model: Any) -> list[bool]:
    return ["forward" in layer.__dict__ for layer in model.model.layers]


def forwards(model: Any) -> list[torch.Tensor]:
    """A prefill, a one-token step after it, a draft tree and a padded batch of two."""
    prompt = [5, 17, 33, 2, 250, 9, 41, 7]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        prefill = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits
        step = model(input_ids=torch.tensor([[3]]), cache=cache, use_cache=True).logits
        tree = tree_logits(model, prompt, [7, 8, 9, 10, 11], [-1, 0, 1, 0, 3])
        batch = model(
            input_ids=torch.tensor([prompt, [0, 0] + prompt[:6]]),
            attention_mask=torch.tensor([[1] * 8, [0, 0] + [1] * 6]),
        ).logits
    return [prefill, step, tree, batch]


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "mistral"])
def test_lean_layers_give_the_bits_of_transformers_layers(architecture: str) -> None:
    model = build_tiny_model(architecture, "packed")
    assert all(is_lean(model))
    lean = forwards(model)
    for module in [*model.model.layers, model]:
        module.__dict__.pop("forward", None)  # back to transformers' forwards
    for actual, expected in zip(lean, forwards(model)):
        assert torch.equal(actual, expected)


def test_other_layer_shapes_keep_transformers_layers() -> None:
    assert not any(is_lean(build_tiny_model("gemma", "packed")))


def test_a_lean_forward_that_changes_any_bit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_tiny_model("llama")  # stock linear layers: pack them here, with a skewed lean forward
    original = lean_layers._lean_forward

    def skewed(lean: Any, index: int) -> Any:
        forward = original(lean, index)
        return lambda *args, **kwargs: forward(*args, **kwargs) * (1 + 1e-6)

    monkeypatch.setattr(lean_layers, "_lean_forward", skewed)
    pack_linear_layers(model)
    assert not lean_layers.use_lean_layers(model)
    assert not any(is_lean(model))


def test_the_default_model_runs_lean_layers_and_a_lean_model_forward(default_model: Any) -> None:
    assert all(is_lean(default_model.model)) and "forward" in default_model.model.__dict__


def test_a_llama_gets_a_lean_model_forward_that_hands_other_calls_to_transformers() -> None:
    model = build_tiny_model("llama", "packed")
    assert "forward" in model.__dict__
    ids = torch.tensor([[5, 17, 33, 2]])
    with torch.inference_mode():
        plain = model(input_ids=ids)
        with_hidden = model(input_ids=ids, output_hidden_states=True)  # not a lean call: stock forward
    assert with_hidden.hidden_states is not None and len(with_hidden.hidden_states) == 3
    assert torch.equal(plain.logits, with_hidden.logits)


def test_a_step_on_the_kv_pool_runs_every_layer_in_one_call_with_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Any, byte_tokenizer: Any
) -> None:
    decoder = LookaheadDecoder(tiny_model("llama", linear_kernel="packed"), byte_tokenizer)
    gen = decoder.start([5, 6, 7, 8, 9])
    decoder.step([gen])  # the prefill puts the prompt in the pool
    draft = Draft([gen.ids[-1], 1, 2, 3], [-1, 0, 1, 1])
    layer_calls: list[int] = []
    write_and_read = KVPool.write_and_read

    def counted(pool: KVPool, layer: int, *args: Any) -> Any:
        layer_calls.append(layer)
        return write_and_read(pool, layer, *args)

    monkeypatch.setattr(KVPool, "write_and_read", counted)
    with torch.inference_mode():
        (stacked,) = decoder.forward_drafts([draft], [len(gen.ids) - 1])
        assert layer_calls == []  # the pool was written from C++
        monkeypatch.setattr(lean_layers, "StepCache", type("NotAStepCache", (), {}))
        (layered,) = decoder.forward_drafts([draft], [len(gen.ids) - 1])
    assert layer_calls == list(range(decoder.model.config.num_hidden_layers))
    assert torch.equal(stacked, layered)
