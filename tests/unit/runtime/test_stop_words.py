"""stop_words as in the reference implementation, and the per-step debug log."""

from __future__ import annotations

import random

import pytest

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.algorithm.draft import FROM_COPY, FROM_OWN_OUTPUT, FROM_SHARED_TRIE
from lookahead.algorithm.retrieval import retrieve_draft
from lookahead.algorithm.spans import Copy
from lookahead.algorithm.trie import NO_NODE
from lookahead.runtime.decoder import STOP_WORDS_CACHED
from tests.helpers import plain_greedy, repetitive_prompt


def test_a_writer_starts_no_ngram_at_a_stop_word_but_learns_it_inside_others() -> None:
    trie = NGramTrie(capacity=1000, max_depth=4)
    writer = trie.writer()
    writer.feed([1, 2], frozenset({9}))
    writer.feed([9, 3, 9], frozenset({9}))
    assert trie.match([9]) == NO_NODE
    assert trie.match([1, 2, 9, 3]) != NO_NODE and trie.match([3, 9]) != NO_NODE
    assert trie.match([2, 9, 3, 9]) != NO_NODE


def test_a_stop_word_root_drafts_nothing_from_a_one_token_context() -> None:
    shared = NGramTrie(capacity=1000, max_depth=6)
    shared.insert([44, 5, 6, 7])  # what once followed ","
    shared.insert([8, 44, 10, 11])  # what followed "8,"
    options = dict(decoding_length=8, branch_length=3, max_query_length=2)
    assert set(retrieve_draft([1, 44], None, shared, **options).tokens) == {44, 5, 6, 7, 10, 11}
    assert retrieve_draft([1, 44], None, shared, stop_words=frozenset({44}), **options).tokens == [44]
    longer = retrieve_draft([8, 44], None, shared, stop_words=frozenset({44}), **options)
    assert longer.tokens == [44, 10, 11]


def test_draft_nodes_say_where_they_came_from() -> None:
    shared = NGramTrie(capacity=1000, max_depth=6)
    shared.insert([3, 4, 5])
    copy = Copy([4, 9, 9], matched=8, from_prompt=1)  # 4 from the prompt, then the request's output
    draft = retrieve_draft([3], None, shared, decoding_length=8, branch_length=3, copy=copy)
    by_token = dict(zip(draft.tokens[1:], draft.origins[1:]))
    assert by_token[4] == FROM_COPY | FROM_SHARED_TRIE
    assert by_token[9] == FROM_COPY | FROM_OWN_OUTPUT
    assert by_token[5] == FROM_SHARED_TRIE
    assert draft.origin_counts() == {
        "copy": 3,
        "request trie": 0,
        "shared trie": 2,
        "grammar": 0,
        "own output": 2,
        "fleet": 0,
        "recycled": 0,
    }
    # what a node's estimate rests on: the copy's agreement so far, the n-gram's count and age
    evidence = dict(zip(draft.tokens[1:], draft.evidence[1:]))
    assert evidence[4].matched == 8 and evidence[4].count == 1.0 and evidence[4].age >= 0
    assert evidence[5] == (2, 1.0, shared.age(shared.match([3, 4, 5])), 1)  # below the copy's 9


def test_decoding_with_stop_words_is_lossless_and_learns_no_output_ngram_at_them(
    tiny_model, byte_tokenizer
) -> None:
    model = tiny_model("qwen2")
    rng = random.Random(5)
    prompt = repetitive_prompt(rng, 256)
    expected = plain_greedy(model, prompt, 24)
    k = next(k for k in range(1, len(expected)) if expected[k] != expected[k - 1])
    stop = expected[k]
    trie = NGramTrie(capacity=10_000)
    config = LookaheadConfig(stop_words=(stop,), adaptive=False)
    decoder = LookaheadDecoder(model, byte_tokenizer, trie, config)
    ids, _ = decoder.generate(prompt, SamplingParams(max_tokens=24))
    assert ids == expected
    assert trie.match([stop]) == NO_NODE
    assert trie.match(expected[k - 1 : k + 1]) != NO_NODE  # learned inside the n-gram before it


def test_stop_words_are_ids_or_one_token_strings(tiny_model, byte_tokenizer) -> None:
    decoder = LookaheadDecoder(
        tiny_model("llama"), byte_tokenizer, None, LookaheadConfig(stop_words=(",", 32))
    )
    assert decoder.stop_word_ids((",", 32)) == frozenset({44, 32})
    with pytest.raises(ValueError, match=r"stop_words entry 'ab' is 2 tokens \[97, 98\], not one"):
        decoder.stop_word_ids(("ab",))
    with pytest.raises(ValueError, match=r"stop_words entry 256 is outside the vocabulary \(0..255\)"):
        LookaheadDecoder(tiny_model("llama"), byte_tokenizer, None, LookaheadConfig(stop_words=(256,)))
    with pytest.raises(ValueError, match="stop_words must hold token ids >= 0 and non-empty strings"):
        LookaheadConfig(stop_words=("",))


def test_debug_logs_every_step_of_the_request(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    prompt = repetitive_prompt(random.Random(2), 256)
    decoder = LookaheadDecoder(
        model, byte_tokenizer, NGramTrie(capacity=10_000), LookaheadConfig(adaptive=False)
    )
    lines: list[str] = []
    decoder.debug_log = lines.append
    generation = decoder.start(
        prompt, SamplingParams(max_tokens=12), LookaheadConfig(debug=True), request_id="r7"
    )
    while not generation.finished:
        generation.step()
    assert len(lines) == generation.stats.steps + 1  # the prefill and every decoding step
    assert lines[0].startswith("lookahead request r7 prefill: draft ")
    assert [line.split(":")[0] for line in lines[1:3]] == [
        "lookahead request r7 step 1",
        "lookahead request r7 step 2",
    ]
    for line in lines:
        assert " tokens (copy " in line and ", request trie " in line and ", shared trie " in line
        assert ", accepted " in line
    accepted = sum(int(line.rsplit("accepted ", 1)[1]) for line in lines)
    assert accepted == generation.stats.accepted_draft_tokens
    decoder.generate(prompt, SamplingParams(max_tokens=4))  # debug off: nothing more
    assert len(lines) == generation.stats.steps + 1


def test_the_stop_words_cache_keeps_a_bounded_number_of_lists(tiny_model, byte_tokenizer) -> None:
    decoder = LookaheadDecoder(tiny_model("llama"), byte_tokenizer, None, LookaheadConfig())
    for count in range(3 * STOP_WORDS_CACHED):
        assert decoder.stop_word_ids((count % 256, "x")) == frozenset({count % 256, ord("x")})
    assert len(decoder._stop_words) == STOP_WORDS_CACHED
