"""Lookahead decoding is lossless: greedy output equals plain greedy generate(), whatever the drafts.

Drafts are steered through the shared trie: filled with random sequences (wrong drafts), with
the true continuation (right drafts) or with the true continuation corrupted every few tokens
(partially right, which exercises the scattered KV gather). Adaptive trimming is switched off so
that every retrieved draft is really fed.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.algorithm.trie import NO_NODE
from tests.helpers import LINEAR_KERNELS, TINY_ARCHITECTURES, model_eos_ids, plain_greedy, repetitive_prompt

MAX_TOKENS = 24


def make_decoder(model, tokenizer, trie: NGramTrie, mode: str) -> LookaheadDecoder:
    config = LookaheadConfig(decoding_length=12, branch_length=5, decoding_mode=mode, adaptive=False)
    return LookaheadDecoder(model, tokenizer, trie, config, eos_token_ids=model_eos_ids(model))


@pytest.mark.parametrize("kernel", LINEAR_KERNELS)
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_greedy_is_lossless_for_wrong_right_and_partial_drafts(
    arch: str, kernel: str, tiny_model, byte_tokenizer
) -> None:
    model = tiny_model(arch, linear_kernel=kernel)
    vocab = model.config.vocab_size
    rng = random.Random(arch)
    for case in range(6):
        prompt = repetitive_prompt(rng, vocab)
        expected = plain_greedy(model, prompt, MAX_TOKENS)
        trie = NGramTrie(capacity=10_000, max_depth=9)
        kind = ("wrong", "right", "partial")[case % 3]
        if kind == "wrong":
            for _ in range(20):
                trie.insert([rng.randrange(vocab) for _ in range(30)])
        else:
            truth = prompt[-3:] + expected
            if kind == "partial":
                truth = [t if i % 4 else (t + 1) % vocab for i, t in enumerate(truth)]
            trie.insert(truth)
        mode = ("hier", "par", "one")[case % 3]
        ids, stats = make_decoder(model, byte_tokenizer, trie, mode).generate(
            prompt, SamplingParams(max_tokens=MAX_TOKENS)
        )
        assert ids == expected, f"{arch} {kind} drafts in {mode} mode changed the output"
        assert stats.draft_tokens > 0
        if kind == "right":
            assert stats.accepted_draft_tokens >= MAX_TOKENS // 2
            assert stats.steps < MAX_TOKENS - 1


def test_the_prefill_verifies_a_draft_and_keeps_only_the_accepted_branch(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    vocab = model.config.vocab_size
    prompt = [5, 6, 7, 8]
    expected = plain_greedy(model, prompt, 12)
    wrong = expected[:1] + [(t + 1) % vocab for t in expected[1:8]]
    trie = NGramTrie(capacity=1000, max_depth=9)
    for _ in range(2):  # the wrong branch is the more frequent one, so it is fed first
        trie.insert(prompt[-3:] + wrong)
    trie.insert(prompt[-3:] + expected[:8])
    gen = make_decoder(model, byte_tokenizer, trie, "hier").start(prompt, SamplingParams(max_tokens=12))
    first = gen.step()
    assert gen.stats.steps == 0 and gen.stats.draft_tokens > 4
    assert first.token_ids == expected[: len(first.token_ids)] and len(first.token_ids) > 2
    while not gen.finished:
        gen.step()
    assert gen.output_ids == expected  # the KV of the accepted (second) branch was moved behind the prompt


def test_real_model_greedy_is_lossless_and_learns_across_requests(default_model) -> None:
    model, tokenizer = default_model.model, default_model.tokenizer
    trie = NGramTrie(capacity=100_000, max_depth=16)
    decoder = LookaheadDecoder(
        model, tokenizer, trie, LookaheadConfig(adaptive=False), default_model.eos_token_ids
    )
    prompts = [
        "def fibonacci(n):\n    if n < 2:\n        return n\n"
        "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        "Rewrite the function above with a loop:\n",
        "The capital of France is",
    ]
    for prompt in prompts:
        prompt_ids = tokenizer.encode(prompt)
        expected = plain_greedy(model, prompt_ids, 32)
        ids, first = decoder.generate(prompt_ids, SamplingParams(max_tokens=32))
        assert ids == expected
        ids, again = decoder.generate(prompt_ids, SamplingParams(max_tokens=32))
        assert ids == expected
        assert again.accepted_draft_tokens > first.accepted_draft_tokens  # the shared trie learned the answer
        assert again.steps < first.steps


def test_streamed_steps_add_up_to_the_output(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    prompt = repetitive_prompt(random.Random(1), model.config.vocab_size)
    decoder = make_decoder(model, byte_tokenizer, NGramTrie(capacity=1000, max_depth=9), "hier")
    steps = list(decoder.stream(prompt, SamplingParams(max_tokens=MAX_TOKENS)))
    assert [t for s in steps for t in s.token_ids] == plain_greedy(model, prompt, MAX_TOKENS)
    assert [s.finish_reason for s in steps[:-1]] == [None] * (len(steps) - 1)
    assert steps[-1].finish_reason == "length"
    assert all(s.token_ids for s in steps)


def test_max_tokens_caps_an_accepted_draft(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    prompt = [5, 6, 7, 8]
    expected = plain_greedy(model, prompt, 30)
    trie = NGramTrie(capacity=1000, max_depth=9)
    trie.insert(prompt[-3:] + expected)
    for max_tokens in (1, 2, 5, 9):
        ids, _ = make_decoder(model, byte_tokenizer, trie, "hier").generate(
            prompt, SamplingParams(max_tokens=max_tokens)
        )
        assert ids == expected[:max_tokens]


def test_eos_stops_generation_unless_ignored_and_min_tokens_suppresses_it(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    prompt = [3, 1, 4, 1, 5]
    expected = plain_greedy(model, prompt, 20)
    eos = expected[4]
    first_eos = expected.index(eos)
    decoder = LookaheadDecoder(
        model, byte_tokenizer, NGramTrie(capacity=1000, max_depth=9), eos_token_ids=(eos,)
    )
    gen = decoder.start(prompt, SamplingParams(max_tokens=20))
    while not gen.finished:
        gen.step()
    assert gen.output_ids == expected[: first_eos + 1]
    assert gen.finish_reason == "stop"
    ids, _ = decoder.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    assert ids == expected
    ids, _ = decoder.generate(prompt, SamplingParams(max_tokens=20, min_tokens=first_eos + 3))
    assert eos not in ids[: first_eos + 3]
    assert len(ids) >= first_eos + 3


def test_stop_string_ends_generation_and_is_not_returned(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    prompt = [72, 105, 33, 32]
    decoder = LookaheadDecoder(model, byte_tokenizer)
    full = list(decoder.stream(prompt, SamplingParams(max_tokens=20)))
    text = "".join(s.text for s in full)
    stop = text[6:8]
    assert len(stop) == 2
    cut = list(decoder.stream(prompt, SamplingParams(max_tokens=20, stop=(stop,))))
    assert "".join(s.text for s in cut) == text[: text.index(stop)]
    assert cut[-1].finish_reason == "stop"


@pytest.mark.parametrize("with_shared_trie", [True, False])
def test_the_output_is_learned_by_one_trie(with_shared_trie: bool, tiny_model, byte_tokenizer) -> None:
    """The shared trie learns the output when there is one; the request's own trie only otherwise."""
    prompt = [5, 6, 7, 8, 9]
    shared = NGramTrie(capacity=1000, max_depth=9) if with_shared_trie else None
    decoder = LookaheadDecoder(tiny_model("llama"), byte_tokenizer, shared)
    gen = decoder.start(prompt, SamplingParams(max_tokens=12))
    while len(gen.output_ids) < 3:
        gen.step()
    assert not gen.finished
    output = gen.output_ids
    prompt_only = NGramTrie(capacity=1000, max_depth=decoder.trie_depth)
    prompt_only.insert(prompt)
    if with_shared_trie:
        assert gen.drafter.local.node_count == prompt_only.node_count
        assert shared.match(output[-3:]) != NO_NODE
    else:
        assert gen.drafter.local.node_count > prompt_only.node_count
        assert gen.drafter.local.match(prompt[-2:] + output[:2]) != NO_NODE


def test_close_frees_the_request_state(tiny_model, byte_tokenizer) -> None:
    decoder = LookaheadDecoder(tiny_model("llama"), byte_tokenizer, NGramTrie(capacity=1000, max_depth=9))
    gen = decoder.start([1, 2, 3], SamplingParams(max_tokens=10))
    gen.step()
    gen.close()
    assert gen.finished and gen.finish_reason == "cancelled"
    assert gen.drafter is None and gen not in decoder.runner.pool.owners
    with pytest.raises(RuntimeError, match="finished or closed"):
        gen.step()


def test_adaptive_decoder_stays_lossless(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("qwen2")
    rng = random.Random(7)
    decoder = LookaheadDecoder(model, byte_tokenizer, NGramTrie(capacity=10_000, max_depth=16))
    for _ in range(4):
        prompt = repetitive_prompt(rng, model.config.vocab_size)
        ids, _ = decoder.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS))
        assert ids == plain_greedy(model, prompt, MAX_TOKENS)


def started(model, tokenizer, prompt: list[int], **params) -> object:
    """A generation that was never stepped: its commits are fed by the test."""
    decoder = LookaheadDecoder(model, tokenizer, NGramTrie(capacity=10_000, max_depth=9))
    return decoder.start(prompt, SamplingParams(**params))


def test_a_step_ending_inside_a_character_at_max_tokens_keeps_its_text(tiny_model, byte_tokenizer) -> None:
    gen = started(tiny_model("llama"), byte_tokenizer, [1, 2, 3], max_tokens=4)
    out = gen.commit(list(b"abc") + [0xC3])  # the last token is half of "é"
    assert (out.text, out.finish_reason) == ("abc", "length")


def test_a_stop_string_inside_a_step_ending_inside_a_character_is_found(tiny_model, byte_tokenizer) -> None:
    gen = started(tiny_model("llama"), byte_tokenizer, [1, 2, 3], max_tokens=4, stop=("bc",))
    out = gen.commit(list(b"abc") + [0xC3])
    assert (out.text, out.finish_reason, out.token_ids) == ("a", "stop", list(b"abc"))


def test_tokens_accepted_after_a_stop_string_are_not_counted_nor_learned(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    gen = started(model, byte_tokenizer, [1, 2, 3], max_tokens=16, stop=("STOP",))
    trie = gen.shared.trie
    out = gen.commit(list(b"xSTOPyz"))
    assert (out.text, out.finish_reason) == ("x", "stop")
    assert out.token_ids == gen.output_ids == list(b"xSTOP")
    assert gen.stats.output_tokens == 5
    assert trie.match(list(b"OPy")) == NO_NODE  # "y" was never output, so never learned
    assert trie.match(list(b"TOP")) != NO_NODE


@pytest.mark.parametrize("with_stop", [False, True])
def test_each_tokens_text_is_what_plain_decoding_streams_for_it(
    tiny_model, byte_tokenizer, with_stop
) -> None:
    """Byte tokens, so a character may span tokens; drafts that the model accepts, so steps hold several."""
    model = tiny_model("llama")
    prompt = list("héllo wörld, héllo wörld, ".encode())
    plain = LookaheadDecoder(model, byte_tokenizer, None, LookaheadConfig(use_lookahead=False))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    if with_stop:  # a stop string that the output holds: the stream ends inside a step
        text = "".join(out.text for out in plain.stream(prompt, params))
        params = replace(params, stop=(text[len(text) // 2 : len(text) // 2 + 2],))
    streamed = [(out.token_ids, out.text) for out in plain.stream(prompt, params)]
    assert all(len(ids) == 1 for ids, _ in streamed)  # plain decoding: a token per step
    trie = NGramTrie(capacity=10_000, max_depth=9)
    trie.insert(prompt[-3:] + [token for ids, _ in streamed for token in ids])
    outputs = list(make_decoder(model, byte_tokenizer, trie, "hier").stream(prompt, params))
    assert any(len(out.token_ids) > 1 for out in outputs)
    assert all(len(out.token_texts) == len(out.token_ids) for out in outputs)
    assert all("".join(out.token_texts) == out.text for out in outputs)
    assert [text for out in outputs for text in out.token_texts] == [text for _, text in streamed]
    assert outputs[-1].finish_reason == ("stop" if with_stop else "length")
