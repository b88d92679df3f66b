"""Does a long prompt stall the streams already running? Measured through the server.

For each model: one request streams --stream-tokens tokens; once it has sent a few responses, a
second request arrives with a prompt of about --long-tokens tokens (HumanEval prompts end to
end, within the default max_prompt_tokens). The streaming request's gaps between responses are
timed: their median before the long prompt arrived, and the longest one until the long prompt's
answer came back, which is what a user of the running stream sees while the new prompt is read.

    python -m bench stall_test --start-server --models lookahead baseline
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.prompt_sets import load_prompt_set
from bench.report import markdown_table
from bench.servers import add_server_arguments, server_url
from client.api import LookaheadClient

CHARS_PER_TOKEN = 3.3  # HumanEval text under the embedded models' tokenizers, about
OPENING_RESPONSES = 8  # responses of the stream before the long prompt is sent


@dataclass(frozen=True)
class StallPoint:
    model: str
    long_prompt_tokens: int
    median_gap_ms: float  # between the stream's responses before the long prompt arrived
    longest_gap_ms: float  # while the long prompt was read and answered
    long_prompt_seconds: float  # from sending the long prompt to its answer


def long_prompt(tokens: int) -> str:
    texts = load_prompt_set("humaneval").prompts
    text, i = "", 0
    while len(text) < tokens * CHARS_PER_TOKEN:
        text += texts[i % len(texts)] + "\n\n"
        i += 1
    return text[: int(tokens * CHARS_PER_TOKEN)]


def measure(url: str, model: str, args: argparse.Namespace) -> StallPoint:
    client = LookaheadClient(url, model=model)
    arrivals: list[float] = []
    opened = threading.Event()

    def stream() -> None:
        for _ in client.stream("def fibonacci(n):", max_tokens=args.stream_tokens, ignore_eos=True):
            arrivals.append(time.perf_counter())
            if len(arrivals) == OPENING_RESPONSES:
                opened.set()
        opened.set()

    streaming = threading.Thread(target=stream)
    streaming.start()
    opened.wait()
    sent = time.perf_counter()
    answer = client.generate(long_prompt(args.long_tokens), max_tokens=8, ignore_eos=True)
    answered = time.perf_counter()
    streaming.join()
    before = [b - a for a, b in zip(arrivals, arrivals[1:]) if b <= sent]
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > sent and a < answered]
    if not before or not during:
        raise RuntimeError(f"{model}: the stream ended too soon (raise --stream-tokens)")
    return StallPoint(
        model,
        int(answer.num_input_tokens or 0),
        1000 * statistics.median(before),
        1000 * max(during),
        answered - sent,
    )


def format_table(points: Sequence[StallPoint]) -> str:
    header = (
        "model",
        "long prompt (tokens)",
        "stream's median gap (ms)",
        "longest gap while it is read (ms)",
        "longest / median",
        "long prompt answered after (s)",
    )
    rows = [
        (
            p.model,
            p.long_prompt_tokens,
            f"{p.median_gap_ms:.0f}",
            f"{p.longest_gap_ms:.0f}",
            f"{p.longest_gap_ms / p.median_gap_ms:.1f}",
            f"{p.long_prompt_seconds:.1f}",
        )
        for p in points
    ]
    return markdown_table(header, rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_arguments(parser, warm_trie=False)
    parser.add_argument("--models", nargs="+", default=["lookahead", "baseline"])
    parser.add_argument("--long-tokens", type=int, default=3600, help="about this many prompt tokens")
    parser.add_argument("--stream-tokens", type=int, default=512, help="tokens the running stream asks for")
    parser.add_argument("--out", type=Path, default=Path("results/stall_test"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with server_url(args) as url:
        points = [measure(url, model, args) for model in args.models]
    table = format_table(points)
    print(table)
    (args.out / "stall_test.md").write_text(table + "\n", encoding="utf-8")
    return 0
