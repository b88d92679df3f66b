"""A busy neighbour: plain and lookahead decoding through the server, quiet and beside processes
that keep cores busy (`while True: pass`, unpinned), with `adaptive_threads` on and off.

CPU servers share their machine with editors, compilers and other services. A forward's threads
meet at a barrier after every matrix, so a thread that shares its core with a busy process stalls
the whole team at each one. Each configuration gets a server of its own (the repository as it
ships, and a copy with adaptive_threads false); within a server, each model is timed quiet, then
busy, then quiet again, and the busy speed is compared with the mean of the two quiet ones.

    python -m bench busy_neighbour --prompts 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from bench.fleet import set_parameter
from bench.peer_llama_cpp import ask_triton, chat_prompts
from bench.servers import REPO_ROOT, tritonserver_for_run


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """`count` processes spinning on whatever core the scheduler gives them."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    time.sleep(1.0)  # their interpreters are up and spinning
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def tokens_per_second(url: str, model: str, prompts: Sequence[str], max_tokens: int) -> float:
    """Output tokens per second over the prompts, one request at a time."""
    tokens = seconds = 0.0
    for prompt in prompts:
        count, elapsed = ask_triton(url, model, prompt, max_tokens)
        tokens += count
        seconds += elapsed
    return tokens / seconds


def repository_with(root: Path, adaptive: bool) -> Path:
    """The shipped repository, or a copy whose models keep every thread whatever the machine does."""
    if adaptive:
        return REPO_ROOT / "model_repository"
    copy = root / "repository-fixed-threads"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(REPO_ROOT / "model_repository", copy)
    for config in copy.glob("*/config.pbtxt"):
        config.write_text(set_parameter(config.read_text(), "adaptive_threads", "false"))
    return copy


def measure(args: argparse.Namespace, adaptive: bool, prompts: Sequence[str]) -> list[dict]:
    rows = []
    label = "adaptive" if adaptive else "fixed"
    repository = repository_with(args.out, adaptive)
    with tritonserver_for_run(repository, args.out / label) as url:
        for model in args.models:
            tokens_per_second(url, model, prompts[:1], args.max_tokens)  # warm
            quiet = [tokens_per_second(url, model, prompts, args.max_tokens)]
            with busy_processes(args.busy):
                busy = tokens_per_second(url, model, prompts, args.max_tokens)
            quiet.append(tokens_per_second(url, model, prompts, args.max_tokens))
            row = {
                "threads": label,
                "model": model,
                "quiet_tok_s": statistics.mean(quiet),
                "busy_tok_s": busy,
                "kept": busy / statistics.mean(quiet),
            }
            print(
                f"{label:>8} {model:>10}: quiet {row['quiet_tok_s']:.1f} tok/s, beside {args.busy} busy "
                f"{busy:.1f} tok/s = {row['kept']:.0%} kept",
                flush=True,
            )
            rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=4, help="held-out code-editing prompts per timing")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--busy", type=int, default=1, help="busy processes beside the server")
    parser.add_argument("--models", nargs="+", default=["baseline", "lookahead"])
    parser.add_argument(
        "--threads",
        choices=("adaptive", "fixed", "both"),
        default="both",
        help="adaptive_threads on, off, or both",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "busy_neighbour")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = chat_prompts(args.prompts)
    rows = []
    for adaptive in {"adaptive": (True,), "fixed": (False,), "both": (True, False)}[args.threads]:
        rows += measure(args, adaptive, prompts)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))
    print(f"\n| threads | model | quiet tok/s | beside {args.busy} busy | kept |\n|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['threads']} | {row['model']} | {row['quiet_tok_s']:.1f} | {row['busy_tok_s']:.1f} "
            f"| {row['kept']:.0%} |"
        )
    return 0
