"""NGramTrie: exact n-gram counts, streaming, MRU children, the hard capacity bound, honest bytes."""

from __future__ import annotations

import random
import tracemalloc
from collections import Counter

import numpy as np
import pytest

from lookahead.algorithm.trie import INDEX_FANOUT, NO_NODE, ROOT, NGramTrie


def contents(trie: NGramTrie) -> dict[tuple[int, ...], float]:
    """Every path from the root with its count."""
    found, stack = {}, [(ROOT, ())]
    while stack:
        node, path = stack.pop()
        for token, child, count in trie.children(node, limit=1 << 30):
            found[path + (token,)] = count
            stack.append((child, path + (token,)))
    return found


def child_orders(trie: NGramTrie) -> dict[tuple[int, ...], list[int]]:
    """Every path from the root with its children's tokens, most recently used first."""
    found, stack = {}, [(ROOT, ())]
    while stack:
        node, path = stack.pop()
        found[path] = [token for token, _, _ in trie.children(node, limit=1 << 30)]
        stack.extend((child, path + (token,)) for token, child, _ in trie.children(node, limit=1 << 30))
    return found


def assert_consistent(trie: NGramTrie) -> None:
    """Lookups agree with enumeration, counts never grow downwards, node_count counts reachable nodes."""
    reachable, stack = 0, [ROOT]
    while stack:
        node = stack.pop()
        for token, child, count in trie.children(node, limit=1 << 30):
            assert trie.child(node, token) == child
            assert node == ROOT or count <= trie.count(node)
            reachable += 1
            stack.append(child)
    assert reachable == trie.node_count <= trie.capacity


def ngram_counts(tokens: list[int], max_depth: int) -> dict[tuple[int, ...], float]:
    """Brute force: occurrences of every n-gram of up to max_depth tokens."""
    counts = Counter(
        tuple(tokens[i : i + n]) for n in range(1, max_depth + 1) for i in range(len(tokens) - n + 1)
    )
    return {gram: float(count) for gram, count in counts.items()}


def test_insert_counts_every_occurrence_of_every_ngram_up_to_max_depth():
    trie = NGramTrie(capacity=100, max_depth=3)
    trie.insert([1, 2, 1, 2, 3])
    assert contents(trie) == {
        (1,): 2, (1, 2): 2, (1, 2, 1): 1, (1, 2, 3): 1,
        (2,): 2, (2, 1): 1, (2, 1, 2): 1, (2, 3): 1,
        (3,): 1,
    }  # fmt: skip
    assert trie.node_count == 9
    assert trie.count(trie.match([1, 2])) == 2
    assert trie.match([1, 2, 1, 2]) == NO_NODE  # longer than max_depth
    assert trie.match([]) == ROOT


def test_weight_scales_counts_and_separate_inserts_share_no_ngram():
    trie = NGramTrie(capacity=100, max_depth=3)
    trie.insert([1, 2], weight=0.5)
    trie.insert([3, 4], weight=2.0)
    assert contents(trie) == {(1,): 0.5, (1, 2): 0.5, (2,): 0.5, (3,): 2.0, (3, 4): 2.0, (4,): 2.0}


@pytest.mark.parametrize("seed", range(4))
def test_streamed_tokens_count_exactly_like_one_insert_whatever_the_chunking(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(300)]
    expected = ngram_counts(tokens, max_depth=5)

    inserted = NGramTrie(capacity=10_000, max_depth=5)
    inserted.insert(tokens)  # empty trie: numpy bulk fill
    streamed = NGramTrie(capacity=10_000, max_depth=5)
    writer, position = streamed.writer(), 0
    while position < len(tokens):  # random chunks, the first one token long: token-by-token path
        size = 1 if position == 0 else rng.randrange(1, 9)
        writer.feed(tokens[position : position + size])
        position += size
    bulk_then_stream = NGramTrie(capacity=10_000, max_depth=5)
    writer = bulk_then_stream.writer()
    writer.feed(tokens[:100])  # bulk fill, then the open windows continue token by token
    writer.feed(tokens[100:])

    assert contents(inserted) == expected
    assert contents(streamed) == expected
    assert contents(bulk_then_stream) == expected


def test_an_ngram_is_visible_the_moment_its_last_token_arrives():
    trie = NGramTrie(capacity=100, max_depth=4)
    writer = trie.writer()
    stream = [7, 8, 9, 10, 11]
    for i, token in enumerate(stream):
        writer.feed([token])
        for start in range(max(0, i - 3), i + 1):
            assert trie.match(stream[start : i + 1]) != NO_NODE, stream[start : i + 1]


@pytest.mark.parametrize("chunk", [8, 1], ids=["bulk fill", "token by token"])
def test_children_come_most_recently_used_first_and_are_capped(chunk):
    trie = NGramTrie(capacity=100, max_depth=2)
    writer = trie.writer()
    stream = [1, 2, 1, 3, 1, 4, 1, 2]  # under 1: 2 then 3 then 4, then 2 again
    for start in range(0, len(stream), chunk):
        writer.feed(stream[start : start + chunk])
    assert [token for token, _, _ in trie.children(trie.match([1]), limit=10)] == [2, 4, 3]
    assert [(token, count) for token, _, count in trie.children(trie.match([1]), limit=2)] == [
        (2, 2.0),
        (4, 1.0),
    ]


def test_children_of_a_high_fanout_node_are_found_through_the_index():
    trie = NGramTrie(capacity=1_000, max_depth=2)
    writer = trie.writer()
    for token in range(10, 10 + 5 * INDEX_FANOUT):
        writer.feed([1, token])
    assert trie._indexed[trie.match([1])] and not trie._indexed[trie.match([10])]
    assert_consistent(trie)
    assert trie.child(trie.match([1]), 9) == NO_NODE


def test_node_count_never_exceeds_capacity_and_eviction_keeps_frequent_ngrams():
    trie = NGramTrie(capacity=200, max_depth=4)
    frequent = [1, 2, 3, 4]
    rng = random.Random(0)
    writer = trie.writer()
    for _ in range(300):
        writer.feed(frequent + [rng.randrange(100, 10_000) for _ in range(6)])
        assert trie.node_count <= 200
        assert trie.match(frequent) != NO_NODE
    assert trie.epoch > 50  # evicted many times
    assert_consistent(trie)


def test_eviction_halves_counts_and_keeps_the_trie_prefix_closed():
    trie = NGramTrie(capacity=20, max_depth=2)
    trie.insert([1, 2] * 5)  # 4 nodes: 1, 1-2, 2, 2-1
    before = contents(trie)
    trie.insert(list(range(100, 118)))  # needs 35 more nodes: evicts
    after = contents(trie)
    assert trie.node_count <= 20
    for gram, count in after.items():
        assert gram[:-1] == () or gram[:-1] in after  # prefix-closed
        if gram in before:
            assert count <= before[gram] / 2
    assert (1,) in after and (1, 2) in after  # the counted ones outlive the new count-1 leaves
    assert_consistent(trie)


def test_writer_cursors_survive_evictions():
    trie = NGramTrie(capacity=100, max_depth=4)
    writer = trie.writer()
    rng = random.Random(1)
    stream = []
    for _ in range(2_000):
        stream.append(rng.randrange(1_000_000))
        writer.feed(stream[-1:])
        assert trie.node_count <= 100
        for start in range(max(0, len(stream) - 4), len(stream)):
            assert trie.match(stream[start:]) != NO_NODE
    assert trie.epoch > 10  # many evictions happened


def test_clear_empties_the_trie_and_open_writers_restart():
    trie = NGramTrie(capacity=100, max_depth=3)
    writer = trie.writer()
    writer.feed([1, 2])
    trie.clear()
    assert trie.node_count == 0 and contents(trie) == {}
    writer.feed([3])
    assert contents(trie) == {(3,): 1.0}  # no stale cursor extends a dropped window


@pytest.mark.parametrize(
    ("tokens", "error"), [([-1], ValueError), ([1 << 31], ValueError), ([1.5], TypeError), (["a"], TypeError)]
)
def test_invalid_token_ids_are_refused(tokens, error):
    trie = NGramTrie(capacity=100, max_depth=3)
    with pytest.raises(error):
        trie.insert(tokens)
    with pytest.raises(error):
        trie.writer().feed([0, *tokens])
    assert trie.node_count == 0


def test_out_of_range_queries_match_nothing():
    trie = NGramTrie(capacity=100, max_depth=3)
    trie.insert([0, 1])
    assert trie.match([0, 1]) != NO_NODE
    assert trie.match([-1]) == trie.match([(1 << 32) + 1]) == trie.match([0, (1 << 33) | 1]) == NO_NODE


def test_numpy_token_ids_are_accepted():
    trie = NGramTrie(capacity=100, max_depth=3)
    trie.insert(np.array([4, 5, 6], dtype=np.int64))
    assert trie.count(trie.match([4, 5, 6])) == 1.0


@pytest.mark.parametrize(("capacity", "max_depth"), [(100, 0), (3, 4), (1 << 31, 4)])
def test_invalid_sizes_are_refused(capacity, max_depth):
    with pytest.raises(ValueError, match="capacity|max_depth"):
        NGramTrie(capacity=capacity, max_depth=max_depth)


def test_byte_estimate_matches_traced_memory_and_stays_small():
    rng = np.random.default_rng(0)
    tokens = ((rng.zipf(1.2, 6_000) - 1) % 49_152).tolist()
    tracemalloc.start()
    try:
        trie = NGramTrie(capacity=200_000, max_depth=16)
        writer = trie.writer()
        writer.feed(tokens[:1])
        writer.feed(tokens[1:])  # the token-by-token path, which over-allocates as it grows
        traced, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert trie.node_count > 50_000
    assert 0.9 < trie.byte_estimate / traced < 1.1
    assert trie.byte_estimate / trie.node_count < 80


def test_columns_round_trip_and_shrink_to_a_smaller_capacity():
    trie = NGramTrie(capacity=1_000, max_depth=3)
    trie.writer().feed([1, 2, 3, 1, 2, 4, 5, 6, 7, 1, 2, 3])
    copy = NGramTrie.from_columns(trie.to_columns(), capacity=1_000, max_depth=3)
    assert contents(copy) == contents(trie)
    assert child_orders(copy) == child_orders(trie)
    small = NGramTrie.from_columns(trie.to_columns(), capacity=5, max_depth=3)
    assert small.node_count <= 5 and len(small._token) <= 6  # the arrays shrink too
    assert small.match([1, 2]) != NO_NODE  # the most frequent n-grams stay
    assert_consistent(small)
