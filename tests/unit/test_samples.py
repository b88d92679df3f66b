"""Several samples of one prompt (n, best_of): each exactly the plain seeded sample, the prompt read
once, and every sample a draft source for the others."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.runtime.generation import Generation
from tests.helpers import repetitive_prompt

PROMPT = repetitive_prompt(random.Random(5), 256)


def run(decoder: LookaheadDecoder, generations: list[Generation]) -> list[list[int]]:
    """Step the generations together until every one finished; their outputs."""
    while running := [gen for gen in generations if not gen.finished]:
        decoder.step(running)
    return [gen.output_ids for gen in generations]


@pytest.fixture
def model(tiny_model):
    return tiny_model("llama")


def test_each_sample_is_the_plain_sample_of_its_seed(model, byte_tokenizer) -> None:
    """vLLM's parallel sampling: sample i samples with seed + i."""
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=7, n=3)
    decoder = LookaheadDecoder(model, byte_tokenizer, NGramTrie(capacity=10_000, max_depth=16))
    outputs = run(decoder, decoder.start_samples(PROMPT, params))
    alone = LookaheadDecoder(model, byte_tokenizer, NGramTrie(capacity=10_000, max_depth=16))
    expected = [alone.generate(PROMPT, replace(params, n=1, seed=seed))[0] for seed in (7, 8, 9)]
    assert outputs == expected
    assert len({tuple(output) for output in outputs}) > 1


@pytest.mark.parametrize("prefix_cache_tokens", [0, 2048])
def test_the_prompt_is_read_once_and_its_kv_given_to_the_other_samples(
    model, byte_tokenizer, prefix_cache_tokens: int
) -> None:
    decoder = LookaheadDecoder(model, byte_tokenizer, prefix_cache_tokens=prefix_cache_tokens)
    fed: list[int] = []
    forward = decoder.runner.forward_segments

    def counting(works):
        fed.append(sum(len(work.segment.prompt) for work in works))
        return forward(works)

    decoder.runner.forward_segments = counting
    samples = decoder.start_samples(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, n=3))
    run(decoder, samples)
    assert sum(fed) == len(PROMPT) - 1  # every prompt token but the root, once
    assert [gen.stats.cached_prompt_tokens for gen in samples] == [0] + [len(PROMPT) - 1] * 2
    assert all(len(gen.output_ids) == 6 for gen in samples)


def test_a_sample_whose_leader_ended_reads_the_prompt_itself(model, byte_tokenizer) -> None:
    decoder = LookaheadDecoder(model, byte_tokenizer)
    leader, follower = decoder.start_samples(PROMPT, SamplingParams(max_tokens=4, temperature=1.0, n=2))
    leader.close()  # cancelled before the follower was admitted
    decoder.step([follower])
    assert follower.fed is not None and follower.stats.cached_prompt_tokens == 0


@pytest.mark.parametrize("learn_globally", [False, True])
def test_a_sample_drafts_from_the_others_outputs(model, byte_tokenizer, learn_globally: bool) -> None:
    """top_k 1 samples the argmax, so every sample writes the same text: once the first one has
    written it, the second drafts it (from the samples' own trie, or, where the instance's trie
    learns outputs, from that one) and the model accepts nearly all of it."""
    config = LookaheadConfig(decoding_length=12, branch_length=6, adaptive=False, learn=learn_globally)
    trie = NGramTrie(capacity=10_000, max_depth=9) if learn_globally else None
    decoder = LookaheadDecoder(model, byte_tokenizer, trie, config)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_k=1, seed=1, ignore_eos=True, n=2)
    first, second = decoder.start_samples(PROMPT, params)
    run(decoder, [first])
    run(decoder, [second])
    assert second.output_ids == first.output_ids
    assert second.stats.accepted_draft_tokens >= first.stats.accepted_draft_tokens + 5


def test_several_samples_need_start_samples_and_sampling(model, byte_tokenizer) -> None:
    decoder = LookaheadDecoder(model, byte_tokenizer)
    with pytest.raises(ValueError, match="3 samples are several generations: use start_samples"):
        decoder.start(PROMPT, SamplingParams(temperature=1.0, n=3))
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling, got 2"):
        SamplingParams(n=2)
    with pytest.raises(ValueError, match="best_of must be between n \\(2\\) and 16, got 1"):
        SamplingParams(n=2, best_of=1, temperature=1.0)


def test_the_kv_bound_counts_every_sample(model, byte_tokenizer) -> None:
    decoder = LookaheadDecoder(model, byte_tokenizer)
    longest = decoder.longest(len(PROMPT), SamplingParams(max_tokens=64), decoder.config)
    one = decoder.runner.kv_bytes([longest])
    decoder = LookaheadDecoder(model, byte_tokenizer, kv_cache_bytes=int(one * 1.5))
    decoder.start_samples(PROMPT, SamplingParams(max_tokens=64, temperature=1.0))
    with pytest.raises(ValueError, match="need \\d+ bytes of KV cache, more than kv_cache_bytes"):
        decoder.start_samples(PROMPT, SamplingParams(max_tokens=64, temperature=1.0, n=2))
