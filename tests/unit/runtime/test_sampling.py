"""Sampling with drafts is exact: the plain samples for a seed, the distribution of generate()."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.runtime.sampling import greedy_choices

SAMPLES = 400
NEW_TOKENS = 3


@pytest.fixture
def peaky_model(tiny_model):
    """A tiny model with sharp next-token distributions, so drafts of its likely tokens get accepted."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    return model


def likely_continuation(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def drafting_decoder(model, tokenizer, prompt: list[int]) -> LookaheadDecoder:
    trie = NGramTrie(capacity=10_000, max_depth=9)
    trie.insert(prompt[-3:] + likely_continuation(model, prompt, 12))
    return LookaheadDecoder(
        model, tokenizer, trie, LookaheadConfig(decoding_length=8, branch_length=4, adaptive=False)
    )


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.8),
        dict(temperature=1.3, top_k=5),
        dict(temperature=0.7, top_p=0.8, repetition_penalty=1.3),
    ],
)
def test_seeded_lookahead_sampling_emits_exactly_the_plain_samples(
    peaky_model, byte_tokenizer, params
) -> None:
    prompt = [10, 20, 30, 40, 10, 20]
    decoder = drafting_decoder(peaky_model, byte_tokenizer, prompt)
    accepted = 0
    for seed in range(8):
        sampling = SamplingParams(max_tokens=16, seed=seed, **params)
        plain, _ = decoder.generate(prompt, sampling, LookaheadConfig(use_lookahead=False))
        drafted, stats = decoder.generate(prompt, sampling)
        assert drafted == plain, f"seed {seed}"
        accepted += stats.accepted_draft_tokens
    assert accepted > 0


def chi_square_p_value(a: Counter, b: Counter) -> float:
    """Two-sample homogeneity test on categorical counts (rare categories pooled)."""
    n_a, n_b = sum(a.values()), sum(b.values())
    rows: dict = {}
    for key in set(a) | set(b):
        row = rows.setdefault(key if a[key] + b[key] >= 10 else "rare", [0, 0])
        row[0] += a[key]
        row[1] += b[key]
    stat = 0.0
    for count_a, count_b in rows.values():
        total = count_a + count_b
        for count, n in ((count_a, n_a), (count_b, n_b)):
            expected = total * n / (n_a + n_b)
            stat += (count - expected) ** 2 / expected
    dof = max(len(rows) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def hf_samples(model, prompt: list[int], temperature: float, top_p: float) -> list[Counter]:
    counters = [Counter() for _ in range(NEW_TOKENS)]
    for seed in range(SAMPLES):
        torch.manual_seed(10_000 + seed)
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=top_p,
            pad_token_id=0,
            eos_token_id=None,
        )
        for i, token in enumerate(out[0, len(prompt) :].tolist()):
            counters[i][token] += 1
    return counters


def test_sampled_distribution_matches_plain_sampling(peaky_model, byte_tokenizer) -> None:
    prompt = [10, 20, 30, 40, 10, 20]
    peaky_model.generation_config.eos_token_id = None
    decoder = drafting_decoder(peaky_model, byte_tokenizer, prompt)
    ours = [Counter() for _ in range(NEW_TOKENS)]
    accepted = 0
    for seed in range(SAMPLES):
        ids, stats = decoder.generate(
            prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.7, top_p=0.9, seed=seed)
        )
        accepted += stats.accepted_draft_tokens
        for i, token in enumerate(ids):
            ours[i][token] += 1
    assert accepted > SAMPLES // 4, "the drafts must really be accepted for this test to mean anything"
    reference = hf_samples(peaky_model, prompt, temperature=0.7, top_p=0.9)
    for position in range(NEW_TOKENS):
        assert chi_square_p_value(ours[position], reference[position]) > 1e-3, f"token {position} differs"
    # The test has power: a sampler with the wrong temperature is detected.
    wrong = hf_samples(peaky_model, prompt, temperature=1.0, top_p=0.9)
    assert min(chi_square_p_value(ours[p], wrong[p]) for p in range(NEW_TOKENS)) < 1e-3


def test_greedy_choices_are_torch_argmax_including_ties() -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 49152)
    logits[2, 100] = logits[2, 40_000] = logits[2].max() + 1  # a tie: the first index wins
    logits[5] = 0.0
    choose = greedy_choices(logits)
    assert [choose(k) for k in range(7)] == logits.argmax(-1).tolist()
    assert choose(2) == 100 and choose(5) == 0
    for rows in (logits, logits[1:4, ::2], logits.bfloat16()):  # row by row, as verification asks
        choose = greedy_choices(rows)
        assert [choose(k) for k in reversed(range(len(rows)))] == rows.argmax(-1).tolist()[::-1]
