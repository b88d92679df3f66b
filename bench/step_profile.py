"""Where a step goes, through the server: each engine step's wall time split into its parts, per
concurrency.

A tritonserver is started (or --url / --metrics-url name a running one). At each concurrency c,
c clients each stream --rounds completions one after another (greedy, --max-tokens tokens, prompts
from --set in the served model's chat template), and the model's step counters on the metrics
port are read before and after (backend/metrics.py: lookahead_step_seconds_total by part,
lookahead_steps_total, ...). Per level the table shows milliseconds per step in each part: the
decoder's (schedule: pool slots, budgets, the plan; draft: retrieval; forward; verify: sampling
and acceptance; commit: detokenising, stop words, tries), the engine thread's (admit; respond:
building the updates; keeper: the global trie; wait: the rest of the step's wall time, mostly the
GIL held by the other threads), the host share (wall time outside the forward), and the response
thread's building and sending through Triton per step (send, beside the steps, not in them). Then
the planner's cost curve: per width, the step cost measured at load (predicted) and the latest
steps' (measured).

    python -m bench step_profile --concurrency 1,2,4,8
    python -m bench step_profile --quick      # a short run that prints the table
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import urllib.request
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.genai_perf import served_tokenizer
from bench.prompt_sets import PROMPT_SET_NAMES
from bench.report import markdown_table, write_csv
from bench.servers import REPO_ROOT, parse_concurrency, started_server
from bench.speedup import complete, prompts_of
from launcher import TritonServerError

PARTS = ("schedule", "draft", "forward", "verify", "commit", "admit", "respond", "keeper", "wait")
QUICK = {"concurrency": (1, 2), "rounds": 1, "max_tokens": 16}
_SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(url: str, model: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The lookahead_step* and cost samples of `model` on a metrics page, summed over instances:
    (family, labels other than the instance's) -> value."""
    with urllib.request.urlopen(url, timeout=30) as response:
        return parse_samples(response.read().decode(), model)


def parse_samples(text: str, model: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """`scrape` on a metrics page's text."""
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or not match.group(1).startswith(("lookahead_step", "lookahead_response")):
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        if labels.get("model") != model:
            continue
        kept = tuple(sorted((k, v) for k, v in labels.items() if k in ("part", "width", "source")))
        samples[match.group(1), kept] += float(match.group(3))
    return samples


@dataclass(frozen=True)
class Level:
    """One concurrency level: ms per step in each part, from the counters' deltas."""

    concurrency: int
    steps: int
    requests_per_step: float
    tokens_per_step: float
    ms_per_step: float  # the steps' wall time
    schedule: float
    draft: float
    forward: float
    verify: float
    commit: float
    admit: float
    respond: float
    keeper: float
    wait: float
    host_share: float  # wall time outside the forward, over the wall time
    send: float  # the response thread's, per step, beside the steps


def level_of(concurrency: int, before: dict, after: dict) -> Level:
    def delta(family: str, **labels: str) -> float:
        key = (family, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    steps = delta("lookahead_steps_total")
    per = 1000 / steps if steps else 0.0
    parts = {part: delta("lookahead_step_seconds_total", part=part) * per for part in PARTS}
    wall = sum(parts.values())
    return Level(
        concurrency,
        int(steps),
        delta("lookahead_step_requests_total") / steps if steps else 0.0,
        delta("lookahead_step_tokens_total") / steps if steps else 0.0,
        wall,
        **parts,
        host_share=(wall - parts["forward"]) / wall if wall else 0.0,
        send=delta("lookahead_response_send_seconds_total") * per,
    )


def cost_rows(samples: dict) -> list[tuple[int, str, str]]:
    """(width, predicted ms, measured ms) from the lookahead_step_cost_seconds gauges."""
    found: dict[int, dict[str, float]] = {}
    for (family, labels), value in samples.items():
        if family == "lookahead_step_cost_seconds" and value > 0:  # a gauge never set reads 0
            named = dict(labels)
            found.setdefault(int(named["width"]), {})[named["source"]] = value
    return [
        (width, *(f"{1000 * sources[s]:.2f}" if s in sources else "-" for s in ("predicted", "measured")))
        for width, sources in sorted(found.items())
        if sources
    ]


def run_level(
    url: str, model: str, prompts: Sequence[str], concurrency: int, args: argparse.Namespace
) -> None:
    """c clients, each streaming `rounds` completions one after another (prompts taken in turn)."""
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            for round_ in range(args.rounds):
                prompt = prompts[(index + round_ * concurrency) % len(prompts)]
                complete(url, model, prompt, args.max_tokens, {"ignore_eos": True})
        except BaseException as error:  # reported on the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


@contextmanager
def server_urls(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(gRPC URL, metrics URL): the running server's, or those of one started for the run."""
    if args.url is not None:
        yield args.url, args.metrics_url
        return
    with started_server(args.model_repository, args.out) as server:
        yield server.grpc_url, server.metrics_url


def format_tables(levels: Sequence[Level], costs: list[tuple[int, str, str]]) -> str:
    header = ["c", "steps", "req/step", "tok/step", "ms/step", *PARTS, "host %", "send"]
    rows = [
        [
            p.concurrency,
            p.steps,
            f"{p.requests_per_step:.2f}",
            f"{p.tokens_per_step:.1f}",
            f"{p.ms_per_step:.2f}",
            *(f"{getattr(p, part):.2f}" for part in PARTS),
            f"{100 * p.host_share:.1f}",
            f"{p.send:.2f}",
        ]
        for p in levels
    ]
    steps = markdown_table(header, rows)
    curve = markdown_table(["width (tokens fed)", "predicted ms", "measured ms"], costs)
    return f"Milliseconds per step, by part\n\n{steps}\n\nThe planner's step cost\n\n{curve}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url", default=None, help="gRPC host:port of a running server (else one is started)"
    )
    parser.add_argument("--metrics-url", default="http://localhost:8002/metrics", help="with --url")
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--model", default="lookahead")
    parser.add_argument("--set", default="code_edit", choices=PROMPT_SET_NAMES)
    parser.add_argument("--concurrency", type=parse_concurrency, default=(1, 2, 4, 8))
    parser.add_argument("--rounds", type=int, default=4, help="completions each client streams per level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="a short run: " + str(QUICK))
    parser.add_argument("--out", type=Path, default=Path("results/step_profile"))
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = str(served_tokenizer(args.model_repository, args.model))
    prompts = prompts_of(args.set, tokenizer)
    levels = []
    try:
        with server_urls(args) as (url, metrics_url):
            complete(url, args.model, "Hello", 4, {})  # loaded and warm
            for concurrency in args.concurrency:
                before = scrape(metrics_url, args.model)
                run_level(url, args.model, prompts, concurrency, args)
                after = scrape(metrics_url, args.model)
                levels.append(level_of(concurrency, before, after))
                print(f"c={concurrency}: {levels[-1].steps} steps", flush=True)
            costs = cost_rows(scrape(metrics_url, args.model))
    except (TritonServerError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    tables = format_tables(levels, costs)
    print(tables)
    (args.out / "step_profile.md").write_text(f"# Where a step goes\n\n{tables}\n", encoding="utf-8")
    write_csv(levels, Level, args.out / "step_profile.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
