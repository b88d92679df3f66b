"""Trie and retrieval micro-benchmark: build a ~1M-node global trie, then time draft queries.

Token streams imitate generated text: Zipf-distributed tokens over a 49,152-token vocabulary
mixed with phrases drawn (Zipf-popular) from a fixed phrase bank, so that n-grams repeat the
way boilerplate and common phrasing do. Documents stream into the global trie through one
writer each, as the decoder feeds outputs. Queries come from held-out documents of the same
process, each with its own local trie (its first half, the "prompt"), and time
`retrieve_draft` end to end (query match + draft build), after the trie was kept full (evicting)
for a while. Single thread, no GPU.

    python -m bench retrieval_cost --capacity 1000000 --queries 2000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lookahead.algorithm.retrieval import retrieve_draft
from lookahead.algorithm.trie import NGramTrie
from lookahead.config import DECODING_MODES
from lookahead.state.persistence import load_trie, save_trie

VOCAB = 49_152


class TextLikeStream:
    """Documents of Zipf tokens interleaved with popular phrases."""

    def __init__(self, seed: int, phrases: int = 5_000) -> None:
        self.rng = np.random.default_rng(seed)
        bank = np.random.default_rng(0)  # the same phrase bank for every stream
        self.phrases = [self._zipf_tokens(bank, int(bank.integers(4, 24))) for _ in range(phrases)]

    @staticmethod
    def _zipf_tokens(rng: np.random.Generator, n: int) -> list[int]:
        return ((rng.zipf(1.15, n) - 1) % VOCAB).tolist()

    def document(self, length: int) -> list[int]:
        tokens: list[int] = []
        while len(tokens) < length:
            if self.rng.random() < 0.6:
                tokens += self.phrases[(int(self.rng.zipf(1.3)) - 1) % len(self.phrases)]
            else:
                tokens += self._zipf_tokens(self.rng, int(self.rng.integers(1, 12)))
        return tokens[:length]


def build_shared(capacity: int, depth: int, doc_length: int) -> tuple[NGramTrie, float, int]:
    trie = NGramTrie(capacity=capacity, max_depth=depth)
    stream = TextLikeStream(seed=1)
    started, tokens = time.perf_counter(), 0
    while trie.node_count + doc_length * depth <= capacity:
        trie.writer().feed(stream.document(doc_length))
        tokens += doc_length
    return trie, time.perf_counter() - started, tokens


def churn(trie: NGramTrie, tokens: int, doc_length: int) -> tuple[float, int]:
    """Keep feeding past the capacity: the steady state of a full trie, evictions included."""
    stream = TextLikeStream(seed=3)
    epoch, started = trie.epoch, time.perf_counter()
    for _ in range(tokens // doc_length):
        trie.writer().feed(stream.document(doc_length))
        if trie.node_count > trie.capacity:
            raise AssertionError(f"{trie.node_count} nodes exceed the capacity {trie.capacity}")
    return time.perf_counter() - started, trie.epoch - epoch


def time_snapshot(trie: NGramTrie) -> tuple[float, float, int]:
    """Seconds to save and to load the trie, and the file size."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trie.bin"
        started = time.perf_counter()
        save_trie(trie, path, "bench")
        saved = time.perf_counter()
        loaded = load_trie(path, capacity=trie.capacity, max_depth=trie.max_depth, fingerprint="bench")
        if loaded.node_count != trie.node_count:
            raise AssertionError("the snapshot lost nodes")
        return saved - started, time.perf_counter() - saved, path.stat().st_size


def time_queries(shared: NGramTrie, args: argparse.Namespace, mode: str) -> tuple[list[float], list[int]]:
    stream = TextLikeStream(seed=2)
    depth = shared.max_depth
    seconds, sizes = [], []
    per_document = 50
    for _ in range(max(1, args.queries // per_document)):
        document = stream.document(2 * args.doc_length)
        local = NGramTrie(capacity=args.doc_length * depth + 1, max_depth=depth)
        local.writer().feed(document[: args.doc_length])
        for position in stream.rng.integers(args.doc_length, len(document), per_document).tolist():
            context = document[position - args.max_query_length : position]
            started = time.perf_counter()
            draft = retrieve_draft(
                context,
                local,
                shared,
                decoding_length=args.decoding_length,
                branch_length=args.branch_length,
                mode=mode,
                max_query_length=args.max_query_length,
            )
            seconds.append(time.perf_counter() - started)
            sizes.append(len(draft))
    return seconds, sizes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--max-depth", type=int, default=16)
    parser.add_argument("--doc-length", type=int, default=300)
    parser.add_argument("--queries", type=int, default=2_000)
    parser.add_argument("--churn-tokens", type=int, default=150_000, help="tokens fed past the capacity")
    parser.add_argument("--decoding-length", type=int, default=64)
    parser.add_argument("--branch-length", type=int, default=12)
    parser.add_argument("--max-query-length", type=int, default=4)
    args = parser.parse_args(argv)

    shared, build_seconds, tokens = build_shared(args.capacity, args.max_depth, args.doc_length)
    print(f"nodes: {shared.node_count:,} (capacity {args.capacity:,}, depth {args.max_depth})")
    print(f"bytes/node: {shared.byte_estimate / shared.node_count:.1f}")
    print(f"build: {build_seconds:.1f} s for {tokens:,} tokens ({1e6 * build_seconds / tokens:.1f} us/token)")
    if args.churn_tokens:
        churn_seconds, evictions = churn(shared, args.churn_tokens, args.doc_length)
        print(
            f"full trie: {1e6 * churn_seconds / args.churn_tokens:.1f} us/token over {args.churn_tokens:,} "
            f"tokens, {evictions} evictions, {shared.node_count:,} nodes, "
            f"{shared.byte_estimate / shared.node_count:.1f} bytes/node"
        )
    save_seconds, load_seconds, size = time_snapshot(shared)
    print(f"snapshot: {size / 2**20:.1f} MiB, save {save_seconds:.2f} s, load {load_seconds:.2f} s")
    for mode in DECODING_MODES:
        seconds, sizes = time_queries(shared, args, mode)
        p50, p99 = np.percentile(seconds, [50, 99]) * 1e3
        print(
            f"{mode}: median {p50:.3f} ms, p99 {p99:.3f} ms, mean draft {statistics.mean(sizes):.1f} nodes "
            f"over {len(seconds)} queries"
        )
    return 0
