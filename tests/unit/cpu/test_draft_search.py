"""The fast CPU path's draft search: retrieval's Python best-first search, node for node and bit for bit."""

from __future__ import annotations

import random
from array import array
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lookahead.algorithm import retrieval
from lookahead.algorithm.draft import FROM_COPY, FROM_RECYCLED, FROM_REQUEST_TRIE, FROM_SHARED_TRIE, Draft
from lookahead.algorithm.recycling import PrivateRecycles, RecycleTable
from lookahead.algorithm.retrieval import retrieve_draft
from lookahead.algorithm.spans import Copy
from lookahead.algorithm.trie import NGramTrie
from lookahead.cpu.extension import load_extension
from tests.helpers import CPU_VARIANTS


@pytest.fixture(params=CPU_VARIANTS)
def extension(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The variant's extension, with retrieval's own search restored afterwards."""
    before = retrieval._native_search
    yield load_extension(request.param)
    retrieval.use_native_search(before)


def both_searches(extension: Any, *args: Any, **kwargs: Any) -> tuple[Draft, Draft]:
    """retrieve_draft's result with the Python search and with the extension's."""
    retrieval.use_native_search(None)
    python = retrieve_draft(*args, **kwargs)
    retrieval.use_native_search(extension.best_first_draft)
    return python, retrieve_draft(*args, **kwargs)


def random_trie(rng: random.Random, vocab: int, streams: int, capacity: int) -> NGramTrie:
    """A trie taught through writers, small enough to evict (so counts decay to fractions)."""
    trie = NGramTrie(capacity=capacity, max_depth=rng.choice([4, 8, 16]))
    for _ in range(streams):
        writer = trie.writer(weight=rng.choice([1.0, 0.5, 2.0]))
        for _ in range(rng.randrange(1, 6)):
            writer.feed([rng.randrange(vocab) for _ in range(rng.randrange(1, 40))])
    return trie


def random_recycles(rng: random.Random, vocab: int, k: int | None = None) -> RecycleTable:
    """A recycle table with some rows written: distinct candidates, float16 probabilities, -1 tails."""
    table = RecycleTable(vocab, k=k or rng.choice([2, 4, 8]))
    rows = rng.sample(range(vocab), k=rng.randrange(1, vocab + 1))
    candidates = np.full((len(rows), table.k), -1, dtype=np.int32)
    probs = np.zeros((len(rows), table.k), dtype=np.float16)
    for i in range(len(rows)):
        known = rng.randrange(0, min(table.k, vocab) + 1)
        candidates[i, :known] = rng.sample(range(vocab), k=known)
        probs[i, :known] = sorted((rng.random() for _ in range(known)), reverse=True)
    table.update(np.array(rows), candidates, probs)
    return table


def random_copy(rng: random.Random, vocab: int) -> Copy:
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
    replayed = rng.sample(range(len(tokens)), k=min(rng.randrange(0, 3), len(tokens)))
    edits = {i: rng.randrange(1, 5) for i in replayed}
    return Copy(tokens, rng.randrange(1, 9), rng.randrange(0, len(tokens) + 1), edits)


def test_the_extensions_search_drafts_what_retrievals_own_search_drafts(extension: Any) -> None:
    """Random tries, copies, recycle tables, stop tokens and bounds: identical drafts, probabilities
    and evidence included, and the cases reach every source of evidence the search merges."""
    rng = random.Random(1)
    origins: Counter[int] = Counter()
    capped = 0
    for case in range(400):
        vocab = rng.choice([3, 12, 40])
        local = random_trie(rng, vocab, 1, 10_000) if rng.random() < 0.8 else None
        shared = random_trie(rng, vocab, rng.randrange(1, 8), rng.choice([60, 400, 10_000]))
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 7))]
        kwargs = dict(
            decoding_length=rng.randrange(1, 48),
            branch_length=rng.randrange(0, 12),
            mode=rng.choice(["hier", "par"]),
            max_query_length=rng.randrange(1, 5),
            copy=random_copy(rng, vocab) if rng.random() < 0.4 else None,
            stop_tokens=frozenset(rng.sample(range(vocab), k=rng.randrange(0, 2))),
            min_prob=rng.choice([0.0, 0.0, 0.05, 0.3]),
            recycled=random_recycles(rng, vocab) if rng.random() < 0.5 else None,
        )
        python, native = both_searches(extension, context, local, shared, **kwargs)
        assert native == python, f"case {case}"
        origins.update(origin & ~0b10000 for origin in python.origins[1:])
        capped += any(len(kids) > retrieval.CHILD_LIMIT for kids in python.children())
    for source in (FROM_COPY, FROM_REQUEST_TRIE, FROM_SHARED_TRIE, FROM_RECYCLED):
        assert sum(n for origin, n in origins.items() if origin & source) > 50, (source, origins)
    assert origins[FROM_REQUEST_TRIE | FROM_SHARED_TRIE | FROM_RECYCLED] > 0  # all three agree on a token
    assert capped > 0  # some node had more children than one trie lists


def test_a_requests_private_recycled_rows_are_searched_in_python(extension: Any) -> None:
    """The extension reads the instance's table only; a request with `learn` off drafts from its own rows."""
    private = PrivateRecycles(RecycleTable(12, k=4))
    rows = np.array([[7, 2, -1, -1], [9, -1, -1, -1]], dtype=np.int32)
    private.update(np.array([5, 7]), rows, np.full((2, 4), 0.5, np.float16))
    python, native = both_searches(
        extension, [1, 5], None, None, decoding_length=4, branch_length=4, recycled=private
    )
    assert native == python and native.tokens == [5, 7, 9, 2]


def test_a_malformed_search_view_is_refused_by_name(extension: Any) -> None:
    trie = NGramTrie()
    trie.insert([1, 2, 3])
    token, *rest = trie.search_view()
    wrong = (array("q", token), *rest)
    with pytest.raises(RuntimeError, match="search view column 0 holds format q, expected i"):
        extension.best_first_draft(wrong, None, None, None, 1, 1, -1, -1, 1, 8, 4, 0.0, frozenset())
