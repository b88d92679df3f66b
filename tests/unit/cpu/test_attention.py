"""grouped_sdpa: the same logits as transformers' sdpa, bit for bit, without repeating K/V heads."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.integrations import sdpa_attention

from lookahead.cpu.attention import GROUPED_SDPA, use_grouped_sdpa
from tests.helpers import TINY_ARCHITECTURES, build_tiny_model, tree_logits

# Gemma 2 attends eagerly (its attention logits are soft-capped), so grouped_sdpa never replaces it.
SDPA_ARCHITECTURES = tuple(a for a in TINY_ARCHITECTURES if a != "gemma2")


@pytest.mark.parametrize("architecture", SDPA_ARCHITECTURES)
def test_grouped_sdpa_matches_sdpa_bit_for_bit_on_a_tree(
    architecture: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # transformers' layers (packed models of most architectures run lean_layers.py instead)
    grouped = build_tiny_model(architecture)
    assert grouped.config._attn_implementation == GROUPED_SDPA
    stock = build_tiny_model(architecture)
    stock.set_attn_implementation("sdpa")
    repeats = []
    original = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: repeats.append(n) or original(x, n))
    prefix = [5, 17, 33, 2, 250, 9, 41]
    tree, parents = [7, 8, 9, 10, 11, 12], [-1, 0, 1, 0, 3, 2]
    with torch.inference_mode():
        expected = tree_logits(stock, prefix, tree, parents)
        stock_repeats = len(repeats)
        actual = tree_logits(grouped, prefix, tree, parents)
    assert stock_repeats > 0, "the stock path should repeat the key/value heads"
    assert len(repeats) == stock_repeats, "grouped_sdpa repeated key/value heads"
    assert torch.equal(actual, expected)


def test_grouped_sdpa_is_only_taken_over_from_sdpa() -> None:
    model = build_tiny_model("llama")
    model.set_attn_implementation("eager")
    assert not use_grouped_sdpa(model)
    assert model.config._attn_implementation == "eager"


def test_the_default_model_loads_with_grouped_sdpa(default_model: Any) -> None:
    assert default_model.model.config._attn_implementation == GROUPED_SDPA
