"""The recycle table: exact rows from verified logits, bounded; drafts from it stay lossless."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.algorithm.draft import FROM_RECYCLED, Draft
from lookahead.algorithm.recycling import RecycleTable
from lookahead.algorithm.retrieval import retrieve_draft
from lookahead.runtime.recycling import recycle
from tests.helpers import TINY_ARCHITECTURES, plain_greedy, repetitive_prompt

VOCAB = 50


def test_rows_are_the_top_candidates_of_the_latest_verified_row_the_accepted_path_last() -> None:
    torch.manual_seed(0)
    table = RecycleTable(VOCAB, k=4)
    # root 7, two children 3 (accepted) and 9; 3's child 7 again (accepted): token 7 is read twice
    draft = Draft([7, 3, 7, 9], [-1, 0, 1, 0])
    logits = torch.randn(4, VOCAB)
    recycle(table, draft, logits, accepted_nodes=[1, 2])
    probs = torch.softmax(logits, dim=-1)
    for node, token in ((1, 3), (2, 7), (3, 9)):  # token 7's row comes from node 2, the later on the path
        expected = torch.topk(probs[node], 4)
        assert table.candidates[token].tolist() == expected.indices.tolist()
        np.testing.assert_allclose(table.probs[token], expected.values.numpy(), rtol=1e-3)
        assert table.age(token) == 0
    assert table.candidates[5].tolist() == [-1] * 4 and table.age(5) == -1
    assert table.next_tokens(3, 2) == [
        (int(c), float(p)) for c, p in zip(table.candidates[3, :2], table.probs[3, :2])
    ]
    recycle(table, Draft([3], [-1]), torch.randn(1, VOCAB), accepted_nodes=[])
    assert table.age(3) == 0 and table.age(9) == 1  # a later step rewrote 3's row only


def test_memory_is_bounded_by_the_vocabulary() -> None:
    table = RecycleTable(151_936)
    before = table.byte_size
    assert before == 151_936 * (8 * 4 + 8 * 2 + 8) < 9_000_000
    rng = np.random.default_rng(0)
    for _ in range(50):
        tokens = rng.integers(0, 151_936, 64)
        table.update(tokens, rng.integers(0, 151_936, (64, 8)).astype(np.int32), np.ones((64, 8), np.float16))
    assert table.byte_size == before
    with pytest.raises(ValueError, match="expected \\[2, 8\\]"):
        table.update(np.array([1, 2]), np.zeros((2, 4), np.int32), np.zeros((2, 4), np.float16))


def test_recycled_candidates_fill_what_the_tries_leave_open() -> None:
    table = RecycleTable(VOCAB, k=4)
    candidates = np.array([[11, 12, 13, 14], [21, 22, -1, -1]], dtype=np.int32)
    table.update(
        np.array([5, 11]), candidates, np.array([[0.5, 0.2, 0.1, 0.1], [0.9, 0.05, 0, 0]], np.float16)
    )
    alone = retrieve_draft([5], None, None, decoding_length=8, branch_length=3, recycled=table)
    assert alone.tokens[:3] == [5, 11, 21]  # the most likely chain first
    assert set(alone.tokens) == {5, 11, 12, 13, 14, 21, 22}
    assert all(origin == FROM_RECYCLED for origin in alone.origins[1:])
    assert alone.probs[1] == pytest.approx(0.5, rel=1e-3) and alone.probs[2] == pytest.approx(0.45, rel=1e-2)
    shared = NGramTrie(capacity=100, max_depth=4)
    for _ in range(9):
        shared.insert([5, 12, 30])  # the text says 12 after 5, nine times out of nine
    merged = retrieve_draft([5], None, shared, decoding_length=8, branch_length=2, recycled=table)
    by_token = dict(zip(merged.tokens[1:], merged.probs[1:]))
    # 12: the trie's 9 / (9 + 1) plus the recycled 0.2 of what it leaves; 11 gets 0.5 of that 0.1
    assert by_token[12] == pytest.approx(0.9 + 0.1 * 0.2, rel=1e-2)
    assert by_token[11] == pytest.approx(0.1 * 0.5, rel=1e-2)
    assert merged.tokens[1] == 12


@pytest.mark.parametrize("drafter", ["hybrid", "recycled"])
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES[:3])
def test_greedy_with_recycled_drafts_is_lossless(drafter: str, arch: str, tiny_model, byte_tokenizer) -> None:
    model = tiny_model(arch)
    model.generation_config.eos_token_id = None  # the decoder knows no EOS either
    rng = random.Random(drafter + arch)
    config = LookaheadConfig(drafter=drafter, decoding_length=12, branch_length=5, adaptive=False)
    decoder = LookaheadDecoder(model, byte_tokenizer, NGramTrie(capacity=10_000, max_depth=9), config)
    accepted = 0
    for _ in range(4):  # the table warms up over the requests
        prompt = repetitive_prompt(rng, model.config.vocab_size)
        ids, stats = decoder.generate(prompt, SamplingParams(max_tokens=24))
        assert ids == plain_greedy(model, prompt, 24)
        accepted += stats.accepted_draft_tokens
    assert accepted > 0


def test_seeded_sampling_with_recycled_drafts_emits_the_plain_samples(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)  # sharp distributions, so recycled drafts get accepted
    decoder = LookaheadDecoder(
        model,
        byte_tokenizer,
        NGramTrie(capacity=10_000, max_depth=9),
        LookaheadConfig(drafter="recycled", decoding_length=8, branch_length=4, adaptive=False),
    )
    prompt = [10, 20, 30, 40, 10, 20]
    accepted = 0
    for seed in range(8):
        sampling = SamplingParams(max_tokens=16, seed=seed, temperature=0.8)
        plain, _ = decoder.generate(prompt, sampling, LookaheadConfig(use_lookahead=False))
        drafted, stats = decoder.generate(prompt, sampling)
        assert drafted == plain, f"seed {seed}"
        accepted += stats.accepted_draft_tokens
    assert accepted > 0


def test_only_requests_whose_drafter_reads_the_table_write_it(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    decoder = LookaheadDecoder(
        model, byte_tokenizer, NGramTrie(capacity=10_000, max_depth=9), LookaheadConfig()
    )
    prompt = repetitive_prompt(random.Random(3), model.config.vocab_size)
    decoder.generate(prompt, SamplingParams(max_tokens=16))  # the default drafter, "trie"
    assert decoder.recycled is not None and decoder.recycled.updates == 0
    hybrid = LookaheadConfig(drafter="hybrid")
    decoder.generate(prompt, SamplingParams(max_tokens=16), hybrid)
    assert decoder.recycled.updates > 0 and (decoder.recycled.written >= 0).any()
