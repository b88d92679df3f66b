"""Rests from looking for drafts: they start after a run of misses, double up to a cap, and the
first accepted token ends them; a resting request still decodes exactly as plain decoding."""

from __future__ import annotations

import random

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.algorithm.backoff import MAX_REST, MISSES_BEFORE_REST, DraftBackoff
from lookahead.algorithm.draft import Draft
from lookahead.algorithm.drafters import DraftQuery
from tests.helpers import plain_greedy, repetitive_prompt


def looks_over(backoff: DraftBackoff, outcomes: list[int]) -> list[bool]:
    """Whether each step looked; each look's outcome comes from `outcomes` in turn."""
    looked, pending = [], list(outcomes)
    while pending:
        look = backoff.looks()
        looked.append(look)
        if look:
            backoff.observe(pending.pop(0))
    return looked


def test_rests_double_after_each_miss_up_to_the_cap_and_a_hit_ends_them() -> None:
    backoff = DraftBackoff()
    looked = looks_over(backoff, [0] * (MISSES_BEFORE_REST + 5))
    rests, run = [], 0
    for look in looked[MISSES_BEFORE_REST:]:
        if look:
            rests.append(run)
            run = 0
        else:
            run += 1
    assert looked[:MISSES_BEFORE_REST] == [True] * MISSES_BEFORE_REST
    assert rests == [1, 2, 4, 8, MAX_REST][: len(rests)] and len(rests) == 5
    backoff.resting = 0
    backoff.observe(3)
    assert (backoff.misses, backoff.rest) == (0, 0)
    assert looks_over(backoff, [0] * (MISSES_BEFORE_REST - 1)) == [True] * (MISSES_BEFORE_REST - 1)


def test_a_request_whose_drafts_never_pay_rests_and_its_output_is_plain_decodings(
    tiny_model, byte_tokenizer
) -> None:
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    prompt = repetitive_prompt(random.Random(5), model.config.vocab_size)
    expected = plain_greedy(model, prompt, 48)
    never = next(token for token in range(3, model.config.vocab_size) if token not in expected)
    decoder = LookaheadDecoder(model, byte_tokenizer, NGramTrie(10_000, 8), LookaheadConfig())
    gen = decoder.start(prompt, SamplingParams(max_tokens=48))
    looks = []

    def always_wrong(query: DraftQuery) -> Draft:  # a certain-looking draft the model never takes
        looks.append(len(query.context))
        return Draft([query.context[-1], never], [-1, 0], [1.0, 0.99])

    gen.drafter.retrieve = always_wrong  # type: ignore[union-attr, method-assign]
    while not gen.finished:
        gen.step()
    assert gen.output_ids == expected
    steps = gen.stats.steps + 1  # the prompt's last chunk drafts too
    assert gen.backoff is not None and gen.backoff.rest == MAX_REST
    assert len(looks) < steps / 3  # most steps rested


def test_a_request_that_does_not_adapt_never_rests(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    decoder = LookaheadDecoder(model, byte_tokenizer, NGramTrie(10_000, 8), LookaheadConfig(adaptive=False))
    gen = decoder.start(
        repetitive_prompt(random.Random(1), model.config.vocab_size), SamplingParams(max_tokens=8)
    )
    assert gen.backoff is None
