"""The agreement report: lookahead on one execution path against transformers greedy on another."""

from __future__ import annotations

import random

import torch

from bench.agreement import Agreement, compare, lookahead_generate, summary
from lookahead.models.loading import LoadedModel
from tests.helpers import ByteTokenizer, build_tiny_model, repetitive_prompt


def loaded(model) -> LoadedModel:
    return LoadedModel(
        model=model, tokenizer=ByteTokenizer(), name="tiny", fingerprint="0" * 16, eos_token_ids=(1,)
    )


def test_the_same_layers_agree_on_every_prompt() -> None:
    model = build_tiny_model("qwen2")
    prompts = [repetitive_prompt(random.Random(seed), 256) for seed in range(3)]
    results = compare({"lookahead": lookahead_generate(loaded(model))}, loaded(model), prompts, 16)
    assert results == {"lookahead": [Agreement(i, 16, None, None) for i in range(3)]}
    assert summary(results["lookahead"]) == "3/3 prompts identical"


def test_a_differing_prompt_reports_its_first_token_and_the_top2_gap() -> None:
    model, other = build_tiny_model("qwen2"), build_tiny_model("qwen2")
    with torch.no_grad():
        other.lm_head.weight[7] += 5.0  # token 7 now wins somewhere
    prompt = repetitive_prompt(random.Random(1), 256)
    ((result,),) = compare(
        {"lookahead": lookahead_generate(loaded(model))}, loaded(other), [prompt], 16
    ).values()
    assert result.first_difference is not None and result.top2_gap is not None and result.top2_gap >= 0
    assert summary([result]).startswith(
        f"0/1 prompts identical; first differences: #0 at {result.first_difference}"
    )
