"""Load test: perf_analyzer against the served `lookahead` and `baseline` models.

For each model and each concurrency, perf_analyzer streams requests built from a bundled prompt
set over gRPC (`--streaming`, the only way it drives decoupled models) and exports the send time
of every request and the arrival time and outputs of every response. Those give what its own
summary lacks for streaming LLMs: time to first token, and output tokens/s from the
`num_output_tokens` deltas. The server applies no chat template, so the prompts of a chat set
(code editing, MT-Bench, GSM8K) are sent as a chat client sends them: one user turn in the served
model's chat template (--tokenizer; --raw-prompts sends them unformatted). Every request
generates exactly --max-tokens tokens (ignore_eos), so both models do equal work.
Each concurrency level sends its own slice of the prompt set, to each model in turn (the first
one alternating between levels), so that a compared pair is measured minutes, not a run, apart.
A server started by this script (--start-server) keeps its trie snapshots under
--out/trie_state, emptied first, so every run starts from an empty trie unless --warm-trie keeps
the last run's; a running server (--url) keeps whatever its trie learned before.

    python -m bench load_test                     # against a server on localhost:8001
    python -m bench load_test --start-server      # start one on free ports for the run
    python -m bench load_test --quick             # a short smoke run (used by the tests)

Writes load_test.md (the table), load_test.csv, load_test.png and the raw profile exports
into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.prompt_sets import PROMPT_SET_NAMES, load_prompt_set
from bench.report import figure, markdown_table, write_csv
from bench.servers import (
    MODELS,
    REPO_ROOT,
    BenchmarkError,
    add_server_arguments,
    parse_concurrency,
    server_url,
)
from launcher import TritonServerError
from lookahead.models.chat import chat_prompt
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import load_tokenizer

PERF_ANALYZER = REPO_ROOT / "scripts" / "perf_analyzer.sh"
# --quick: enough to see every model answer under concurrent load, short enough for a test.
QUICK = {"concurrency": (1, 2), "prompts": 4, "max_tokens": 8, "request_count": 2}
NS_PER_S = 1e9


@dataclass(frozen=True)
class LoadPoint:
    """One model at one concurrency, summarised from perf_analyzer's per-response timestamps."""

    model: str
    concurrency: int
    requests: int
    seconds: float  # first request sent -> last response received
    output_tokens: int
    requests_per_second: float
    output_tokens_per_second: float
    latency_p50_ms: float
    latency_p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    # The first `concurrency` requests are sent at once, so the last of them waits for all their
    # prefills; this p99 leaves that opening burst out (nan when no request came after it).
    ttft_p99_after_burst_ms: float


def summarize_experiment(model: str, experiment: dict[str, Any]) -> LoadPoint:
    """Summarise one entry of a profile export's `experiments` (a concurrency level)."""
    concurrency = int(experiment["experiment"]["value"])
    requests = [r for r in experiment["requests"] if r["response_timestamps"]]
    if not requests:
        raise BenchmarkError(f"{model} at concurrency {concurrency}: no request received a response")
    sent = np.array([r["timestamp"] for r in requests], dtype=np.int64)
    first = np.array([r["response_timestamps"][0] for r in requests], dtype=np.int64)
    last = np.array([r["response_timestamps"][-1] for r in requests], dtype=np.int64)
    output_tokens = sum(_output_tokens(request, model) for request in requests)
    seconds = float(last.max() - sent.min()) / NS_PER_S
    latency_ms = (last - sent) / 1e6
    ttft_ms = (first - sent) / 1e6
    after_burst = ttft_ms[np.argsort(sent, kind="stable")][concurrency:]
    return LoadPoint(
        model=model,
        concurrency=concurrency,
        requests=len(requests),
        seconds=seconds,
        output_tokens=output_tokens,
        requests_per_second=len(requests) / seconds,
        output_tokens_per_second=output_tokens / seconds,
        latency_p50_ms=float(np.percentile(latency_ms, 50)),
        latency_p99_ms=float(np.percentile(latency_ms, 99)),
        ttft_p50_ms=float(np.percentile(ttft_ms, 50)),
        ttft_p99_ms=float(np.percentile(ttft_ms, 99)),
        ttft_p99_after_burst_ms=float(np.percentile(after_burst, 99)) if len(after_burst) else float("nan"),
    )


def _output_tokens(request: dict[str, Any], model: str) -> int:
    # perf_analyzer exports every output the model declares, with garbage for those a response
    # lacks, so the count is trusted only when the request asked for it.
    if not request["request_inputs"].get("return_num_output_tokens"):
        raise BenchmarkError(
            f"{model}: requests did not set return_num_output_tokens, so responses carry no token counts"
        )
    return int(sum(output["num_output_tokens"] for output in request["response_outputs"]))


def summarize_profile(model: str, profile: dict[str, Any]) -> list[LoadPoint]:
    return [summarize_experiment(model, experiment) for experiment in profile["experiments"]]


def write_perf_analyzer_input(
    prompts: Iterable[str], path: str | Path, max_tokens: int, *, ignore_eos: bool = True
) -> Path:
    """Write perf_analyzer `--input-data` JSON for the vLLM-style streaming contract.

    `ignore_eos` defaults to True so that every request generates exactly `max_tokens`, which
    keeps load-test throughput comparable across prompts and runs.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sampling_parameters = json.dumps({"max_tokens": max_tokens, "ignore_eos": ignore_eos})
    data = [
        {"text_input": [prompt], "stream": [True], "sampling_parameters": [sampling_parameters]}
        for prompt in prompts
    ]
    if not data:
        raise ValueError("perf_analyzer input needs at least one prompt")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"data": data}, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def write_input_data(prompts: Sequence[str], max_tokens: int, path: Path) -> Path:
    """perf_analyzer --input-data for these prompts, asking for per-response token counts."""
    write_perf_analyzer_input(prompts, path, max_tokens)
    data = json.loads(path.read_text(encoding="utf-8"))
    for entry in data["data"]:
        entry["return_num_output_tokens"] = [True]
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def perf_analyzer_command(
    perf_analyzer: Path, model: str, url: str, concurrency: int, input_data: Path, export: Path, requests: int
) -> list[str]:
    """Exactly `requests` requests in one count window: a long generation can never fall outside a
    time window (server#4530), and there is no stability loop to re-run a slow model for."""
    return [
        str(perf_analyzer),
        "-m",
        model,
        "-i",
        "grpc",
        "--streaming",
        "-u",
        url,
        f"--concurrency-range={concurrency}:{concurrency}",
        f"--input-data={input_data}",
        "--measurement-mode=count_windows",
        f"--request-count={requests}",
        f"--profile-export-file={export}",
    ]


def request_count(concurrency: int, minimum: int) -> int:
    """At least two requests per concurrent slot, so the load is held for a while."""
    return max(minimum, 2 * concurrency)


class PromptSlices:
    """Disjoint slices of a prompt set as perf_analyzer input files, one per measured level (and per
    level measured again), so that the lookahead model's trie never drafts a request from its own
    earlier answer to the very same prompt; both models of a level share its slice."""

    def __init__(self, prompts: Sequence[str], size: int, max_tokens: int, out: Path) -> None:
        self.prompts, self.size, self.max_tokens, self.out = prompts, size, max_tokens, out
        self.used = 0

    def next_file(self, concurrency: int) -> Path:
        if self.used + self.size > len(self.prompts):
            raise BenchmarkError(
                f"the prompt set has {len(self.prompts)} prompts: not enough for another {self.size} "
                f"unseen ones (lower --prompts)"
            )
        chunk = self.prompts[self.used : self.used + self.size]
        self.used += self.size
        return write_input_data(
            chunk, self.max_tokens, self.out / f"input_data_c{concurrency}_{self.used}.json"
        )


def run_point(
    args: argparse.Namespace, model: str, url: str, concurrency: int, input_data: Path
) -> LoadPoint | None:
    """One model at one level; None when perf_analyzer exited 0 but left its export empty or cut
    short, which perf_analyzer 2.50 now and then does."""
    export = args.out / f"profile_{model}_c{concurrency}.json"
    requests = request_count(concurrency, args.request_count)
    print(f"{model}, concurrency {concurrency}, {requests} requests", flush=True)
    log = args.out / f"perf_analyzer_{model}_c{concurrency}.log"
    command = perf_analyzer_command(args.perf_analyzer, model, url, concurrency, input_data, export, requests)
    export.unlink(missing_ok=True)
    finished = subprocess.run(command, capture_output=True, text=True)
    log.write_text(" ".join(command) + "\n" + finished.stdout + finished.stderr, encoding="utf-8")
    if finished.returncode != 0:
        tail = "\n".join((finished.stdout + finished.stderr).splitlines()[-15:])
        raise BenchmarkError(f"perf_analyzer exited with {finished.returncode} (log {log}):\n{tail}")
    profile = _read_export(export)
    if profile is None:
        print(f"perf_analyzer left {export} empty or cut short", flush=True)
        return None
    (point,) = summarize_profile(model, profile)
    return point


def run_level(args: argparse.Namespace, url: str, level: int, slices: PromptSlices) -> list[LoadPoint]:
    """Every model at one level, taking turns, the first one alternating between levels: this
    machine's speed drifts by 10% over minutes, and a pair measured minutes apart shows the drift.
    When a point is lost, the whole level is measured again on new prompts: the lookahead model's
    trie has learned its answers to the first ones, and a pair must share its prompts."""
    concurrency = args.concurrency[level]
    turn = args.models if level % 2 == 0 else args.models[::-1]
    for _ in range(2):
        input_data = slices.next_file(concurrency)
        points = []
        for model in turn:
            point = run_point(args, model, url, concurrency, input_data)
            if point is None:
                break
            points.append(point)
        else:
            return points
        print(f"measuring concurrency {concurrency} again on new prompts", flush=True)
    raise BenchmarkError(f"perf_analyzer left an unusable export twice at concurrency {concurrency}")


def _read_export(path: Path) -> dict[str, Any] | None:
    """The profile export, or None when perf_analyzer left it missing, empty or truncated."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def format_table(points: Sequence[LoadPoint]) -> str:
    header = (
        "model",
        "concurrency",
        "requests",
        "requests/s",
        "output tokens/s",
        "latency p50 (ms)",
        "latency p99 (ms)",
        "TTFT p50 (ms)",
        "TTFT p99 (ms)",
        "TTFT p99 after the opening burst (ms)",
    )
    rows = [
        (
            p.model,
            p.concurrency,
            p.requests,
            f"{p.requests_per_second:.2f}",
            f"{p.output_tokens_per_second:.1f}",
            f"{p.latency_p50_ms:.0f}",
            f"{p.latency_p99_ms:.0f}",
            f"{p.ttft_p50_ms:.0f}",
            f"{p.ttft_p99_ms:.0f}",
            f"{p.ttft_p99_after_burst_ms:.0f}",
        )
        for p in points
    ]
    return markdown_table(header, rows)


def plot(points: Sequence[LoadPoint], path: Path, title: str) -> None:
    """Throughput and latency against concurrency, one line per model."""
    levels = sorted({p.concurrency for p in points})
    with figure(path, title, panels=2) as (throughput, latency):
        for model in dict.fromkeys(p.model for p in points):
            mine = sorted((p for p in points if p.model == model), key=lambda p: p.concurrency)
            x = [p.concurrency for p in mine]
            throughput.plot(x, [p.output_tokens_per_second for p in mine], marker="o", label=model)
            line = latency.plot(x, [p.latency_p50_ms for p in mine], marker="o", label=f"{model} latency p50")
            latency.plot(
                x,
                [p.ttft_p50_ms for p in mine],
                marker="s",
                linestyle="--",
                color=line[0].get_color(),
                label=f"{model} TTFT p50",
            )
        for axes in (throughput, latency):
            axes.set_xlabel("concurrent requests")
            axes.set_xscale("log", base=2)
            axes.set_xticks(levels, [str(level) for level in levels])
            axes.set_ylim(bottom=0)
            axes.legend(fontsize=8)
            axes.grid(alpha=0.3)
        throughput.set_ylabel("output tokens/s")
        latency.set_ylabel("ms")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_arguments(parser)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--concurrency", type=parse_concurrency, default=(1, 2, 4, 8), help="e.g. 1,2,4,8")
    parser.add_argument("--prompt-set", default="humaneval", choices=PROMPT_SET_NAMES)
    parser.add_argument(
        "--prompts", type=int, default=16, help="prompts per level, each level its own (HumanEval has 82)"
    )
    parser.add_argument(
        "--tokenizer",
        default=os.environ.get("LOOKAHEAD_MODEL") or DEFAULT_MODEL,
        help="the served model (embedded name or folder) whose chat template formats a chat set's prompts "
        "(default: $LOOKAHEAD_MODEL, else the embedded default model)",
    )
    parser.add_argument(
        "--raw-prompts", action="store_true", help="send a chat set's prompts without the chat template"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument(
        "--request-count", type=int, default=16, help="requests per point (at least 2 x concurrency)"
    )
    parser.add_argument("--perf-analyzer", type=Path, default=PERF_ANALYZER, help="perf_analyzer to run")
    parser.add_argument("--quick", action="store_true", help=", ".join(f"{k} {v}" for k, v in QUICK.items()))
    parser.add_argument("--out", type=Path, default=Path("results/load_test"))
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    return args


def request_prompts(args: argparse.Namespace) -> list[str]:
    """The prompt set's prompts as a client sends them to a server that applies no template."""
    prompt_set = load_prompt_set(args.prompt_set)
    if not prompt_set.use_chat_template or args.raw_prompts:
        return list(prompt_set.prompts)
    tokenizer = load_tokenizer(args.tokenizer)
    return [chat_prompt(tokenizer, [{"role": "user", "content": prompt}]) for prompt in prompt_set.prompts]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    slices = PromptSlices(request_prompts(args), args.prompts, args.max_tokens, args.out)
    points: list[LoadPoint] = []
    try:
        with server_url(args) as url:
            for level in range(len(args.concurrency)):
                points.extend(run_level(args, url, level, slices))
    except (BenchmarkError, TritonServerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    points.sort(key=lambda point: args.models.index(point.model))  # the table lists one model, then the next
    table = format_table(points)
    print(table)
    title = f"{args.prompt_set}, {args.prompts} prompts, {args.max_tokens} tokens per request"
    (args.out / "load_test.md").write_text(f"# Load test: {title}\n\n{table}\n", encoding="utf-8")
    write_csv(points, LoadPoint, args.out / "load_test.csv")
    plot(points, args.out / "load_test.png", title)
    print(f"wrote {args.out / 'load_test.md'}, load_test.csv and load_test.png")
    return 0
