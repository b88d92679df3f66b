"""genai-perf against the served `lookahead` and `baseline` models: TTFT, inter-token latency and
output tokens/s side by side.

genai-perf 0.0.16 (its own environment, .venv-genai-perf, made by scripts/bootstrap.sh) drives
each model at each concurrency, streaming, through Triton's gRPC (`--endpoint-type kserve --backend
vllm`) or through the OpenAI-compatible endpoint (`--endpoint-type chat`, frontend/): synthetic
prompts of --input-tokens tokens, exactly --output-tokens tokens generated (min_tokens = max_tokens
and, for chat, ignore_eos, so EOS cannot end a request early and both models do equal work). Its
tokenizer is the served model's own converted folder, so nothing reaches for a model hub.
genai-perf runs `perf_analyzer` from the PATH: a one-line script in --out that execs
scripts/perf_analyzer.sh.

    python -m bench genai_perf                     # against a server on localhost:8001
    python -m bench genai_perf --start-server      # start one on free ports for the run
    python -m bench genai_perf --quick --start-server
    python -m bench genai_perf --endpoint-type chat --start-server   # tritonserver + the OpenAI endpoint

Writes genai_perf.md (the table), genai_perf.csv, genai_perf.png and genai-perf's own artifacts
(one folder per model and concurrency) into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import figure, markdown_table, write_csv
from bench.servers import (
    MODELS,
    REPO_ROOT,
    BenchmarkError,
    add_server_arguments,
    parse_concurrency,
    server_url,
)
from launcher import FrontendError, TritonServerError, free_port, start_frontend
from lookahead.config import LookaheadConfig

GENAI_PERF = REPO_ROOT / ".venv-genai-perf" / "bin" / "genai-perf"
PERF_ANALYZER = REPO_ROOT / "scripts" / "perf_analyzer.sh"
# --quick: enough to see both models answer through genai-perf, short enough for a test. Each request
# wants more tokens than two lookahead steps can make (a step makes at most branch_length + 1), so
# every request streams at least three responses and has inter-token latencies to report.
QUICK = {
    "concurrency": (1,),
    "request_count": 4,
    "input_tokens": 32,
    "output_tokens": 2 * (LookaheadConfig().branch_length + 1) + 1,
}
_MODEL_PARAMETER = re.compile(r'\{\s*key:\s*"model",\s*value:\s*\{\s*string_value:\s*"([^"]*)"')


@dataclass(frozen=True)
class GenaiPerfPoint:
    """One model at one concurrency, from genai-perf's profile_export_genai_perf.json."""

    model: str
    concurrency: int
    requests: int
    ttft_avg_ms: float
    ttft_p99_ms: float
    inter_token_latency_avg_ms: float
    inter_token_latency_p99_ms: float
    output_tokens_per_second: float
    requests_per_second: float


def summarize(model: str, concurrency: int, export: dict[str, Any]) -> GenaiPerfPoint:
    def stat(name: str, key: str = "avg") -> float:
        try:
            return float(export[name][key])
        except (KeyError, TypeError, ValueError):
            raise BenchmarkError(
                f"{model} at concurrency {concurrency}: genai-perf reported no {name} {key}"
            ) from None

    return GenaiPerfPoint(
        model=model,
        concurrency=concurrency,
        requests=int(stat("request_count")),
        ttft_avg_ms=stat("time_to_first_token"),
        ttft_p99_ms=stat("time_to_first_token", "p99"),
        inter_token_latency_avg_ms=stat("inter_token_latency"),
        inter_token_latency_p99_ms=stat("inter_token_latency", "p99"),
        output_tokens_per_second=stat("output_token_throughput"),
        requests_per_second=stat("request_throughput"),
    )


def failed_requests(raw_export: dict[str, Any]) -> int:
    """Requests perf_analyzer sent that got no response (perf_analyzer's own profile export)."""
    return sum(
        1
        for experiment in raw_export.get("experiments", [])
        for request in experiment.get("requests", [])
        if not request.get("response_timestamps")
    )


def served_tokenizer(model_repository: Path, model: str) -> Path:
    """The local folder holding the tokenizer `model` serves with (converted from its embedded model
    or GGUF file, or the folder named by its config.pbtxt `model` parameter, or by $LOOKAHEAD_MODEL,
    which replaces it in the server as well)."""
    from lookahead.contract import MODEL_ENV
    from lookahead.models.loading import tokenizer_folder

    name = os.environ.get(MODEL_ENV, "").strip()
    if not name:
        config = (model_repository / model / "config.pbtxt").read_text(encoding="utf-8")
        match = _MODEL_PARAMETER.search(config)
        if match is None:
            raise BenchmarkError(f"{model}/config.pbtxt sets no model parameter")
        name = match.group(1)
    path = Path(name).expanduser()
    if not path.is_absolute() and (model_repository / path).is_dir():
        path = model_repository / path
    return tokenizer_folder(str(path) if path.is_dir() else name)


def perf_analyzer_shim(folder: Path, perf_analyzer: Path) -> Path:
    """A folder whose `perf_analyzer` execs the project's launcher (a symlink would not do: the
    launcher finds its environment from its own path)."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "perf_analyzer"
    shim.write_text(f'#!/usr/bin/env bash\nexec "{perf_analyzer.resolve()}" "$@"\n', encoding="utf-8")
    shim.chmod(0o755)
    return folder


def genai_perf_command(
    genai_perf: Path,
    model: str,
    url: str,
    tokenizer: Path,
    concurrency: int,
    args: argparse.Namespace,
    out: Path,
) -> list[str]:
    if args.endpoint_type == "chat":  # min_tokens rides along in the body, as vLLM's OpenAI server takes it
        endpoint = ["--endpoint-type", "chat", "--extra-inputs", f"min_tokens:{args.output_tokens}"]
        endpoint += ["--extra-inputs", "ignore_eos:true"]
    else:
        endpoint = ["--endpoint-type", "kserve", "--backend", "vllm", "--output-tokens-mean-deterministic"]
    return [
        str(genai_perf),
        "profile",
        "-m",
        model,
        *endpoint,
        "--streaming",
        "-u",
        url,
        "--tokenizer",
        str(tokenizer),
        "--synthetic-input-tokens-mean",
        str(args.input_tokens),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(args.output_tokens),
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(max(args.request_count, 2 * concurrency)),
        "--warmup-request-count",
        "0",
        "--random-seed",
        str(args.seed + concurrency),
        "--artifact-dir",
        str(out),
    ]


# perf_analyzer 2.50 now and then exits 0 leaving its export empty, and genai-perf then fails to
# read it with this error; such a point is measured again, on the same requests.
EMPTY_EXPORT = "Input is a zero-length, empty document"
EXPORT_ATTEMPTS = 3


def run_point(args: argparse.Namespace, model: str, url: str, concurrency: int, shim: Path) -> GenaiPerfPoint:
    out = args.out / f"{model}_c{concurrency}"
    tokenizer = served_tokenizer(args.model_repository, model)
    command = genai_perf_command(args.genai_perf, model, url, tokenizer, concurrency, args, out)
    print(f"{model}, concurrency {concurrency}", flush=True)
    env = {
        **os.environ,
        "PATH": f"{shim}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    log = args.out / f"genai_perf_{model}_c{concurrency}.log"
    for attempt in range(1, EXPORT_ATTEMPTS + 1):
        finished = subprocess.run(command, capture_output=True, text=True, env=env, cwd=args.out)
        log.write_text(" ".join(command) + "\n" + finished.stdout + finished.stderr, encoding="utf-8")
        if finished.returncode == 0 or EMPTY_EXPORT not in finished.stdout + finished.stderr:
            break
        if attempt < EXPORT_ATTEMPTS:
            print(
                f"perf_analyzer left its export empty; {model} at concurrency {concurrency} again", flush=True
            )
            shutil.rmtree(out, ignore_errors=True)
    if finished.returncode != 0:
        tail = "\n".join((finished.stdout + finished.stderr).splitlines()[-15:])
        raise BenchmarkError(f"genai-perf exited with {finished.returncode} (log {log}):\n{tail}")
    try:  # genai-perf writes into <artifact dir>/<model>-<service kind>-<backend>-concurrency<N>/
        summary = next(out.rglob("profile_export_genai_perf.json"))
        export = json.loads(summary.read_text(encoding="utf-8"))
        raw = json.loads((summary.parent / "profile_export.json").read_text(encoding="utf-8"))
    except (StopIteration, FileNotFoundError, json.JSONDecodeError) as error:
        raise BenchmarkError(f"genai-perf left no usable export in {out} ({error}); log {log}") from None
    failed = failed_requests(raw)
    if failed:
        raise BenchmarkError(
            f"{model} at concurrency {concurrency}: {failed} requests got no response (log {log})"
        )
    return summarize(model, concurrency, export)


@contextmanager
def endpoint_url(args: argparse.Namespace) -> Iterator[str]:
    """The URL genai-perf loads: Triton's gRPC port, or the OpenAI endpoint's host:port (the given
    one, or one started beside the run's tritonserver)."""
    if args.endpoint_type == "kserve":
        with server_url(args) as url:
            yield url
        return
    if not args.start_server:
        yield args.openai_url
        return
    with server_url(args) as grpc_url:
        port = free_port()
        print(f"starting the OpenAI endpoint on port {port} (log {args.out / 'openai.log'})", flush=True)
        with start_frontend(grpc_url, port, log_file=args.out / "openai.log"):
            yield f"localhost:{port}"


def format_table(points: Sequence[GenaiPerfPoint]) -> str:
    header = (
        "model",
        "concurrency",
        "requests",
        "output tokens/s",
        "TTFT avg (ms)",
        "TTFT p99 (ms)",
        "inter-token latency avg (ms)",
        "inter-token latency p99 (ms)",
        "requests/s",
    )
    rows = [
        (
            p.model,
            p.concurrency,
            p.requests,
            f"{p.output_tokens_per_second:.1f}",
            f"{p.ttft_avg_ms:.0f}",
            f"{p.ttft_p99_ms:.0f}",
            f"{p.inter_token_latency_avg_ms:.1f}",
            f"{p.inter_token_latency_p99_ms:.1f}",
            f"{p.requests_per_second:.2f}",
        )
        for p in points
    ]
    return markdown_table(header, rows)


def plot(points: Sequence[GenaiPerfPoint], path: Path, title: str) -> None:
    """Output tokens/s, TTFT and inter-token latency against concurrency, the models side by side."""
    levels = sorted({p.concurrency for p in points})
    models = list(dict.fromkeys(p.model for p in points))
    panels = [
        ("output_tokens_per_second", "output tokens/s"),
        ("ttft_avg_ms", "time to first token, avg (ms)"),
        ("inter_token_latency_avg_ms", "inter-token latency, avg (ms)"),
    ]
    width = 0.8 / len(models)
    with figure(path, title, panels=len(panels), size=(13, 4)) as axes:
        for ax, (attribute, label) in zip(axes, panels):
            for i, model in enumerate(models):
                values = {p.concurrency: getattr(p, attribute) for p in points if p.model == model}
                positions = [j + (i - (len(models) - 1) / 2) * width for j in range(len(levels))]
                ax.bar(positions, [values.get(level, 0.0) for level in levels], width, label=model)
            ax.set_xticks(range(len(levels)), [str(level) for level in levels])
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(label)
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=8)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_arguments(parser)
    parser.add_argument(
        "--endpoint-type",
        choices=("kserve", "chat"),
        default="kserve",
        help="kserve: Triton's gRPC streaming; chat: the OpenAI-compatible endpoint's /v1/chat/completions",
    )
    parser.add_argument(
        "--openai-url", default="localhost:9000", help="host:port of a running OpenAI endpoint (chat)"
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--concurrency", type=parse_concurrency, default=(1, 2, 4, 8), help="e.g. 1,2,4,8")
    parser.add_argument("--input-tokens", type=int, default=200, help="synthetic prompt length")
    parser.add_argument("--output-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument(
        "--request-count", type=int, default=16, help="requests per point (at least 2 x concurrency)"
    )
    parser.add_argument("--seed", type=int, default=7, help="genai-perf's prompt seed (plus the concurrency)")
    parser.add_argument("--genai-perf", type=Path, default=GENAI_PERF, help="genai-perf to run")
    parser.add_argument("--perf-analyzer", type=Path, default=PERF_ANALYZER, help="perf_analyzer launcher")
    parser.add_argument("--quick", action="store_true", help=", ".join(f"{k} {v}" for k, v in QUICK.items()))
    parser.add_argument("--out", type=Path, default=Path("results/genai_perf"))
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    args.out = args.out.resolve()
    args.model_repository = args.model_repository.resolve()
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.genai_perf.exists():
        print(f"error: {args.genai_perf} is missing: run scripts/bootstrap.sh", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    shim = perf_analyzer_shim(args.out / "bin", args.perf_analyzer)
    points: list[GenaiPerfPoint] = []
    try:
        with endpoint_url(args) as url:
            for level, concurrency in enumerate(args.concurrency):
                # the first model alternates between levels, as in the load test
                for model in args.models if level % 2 == 0 else args.models[::-1]:
                    points.append(run_point(args, model, url, concurrency, shim))
    except (BenchmarkError, TritonServerError, FrontendError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    points.sort(key=lambda point: (args.models.index(point.model), point.concurrency))
    table = format_table(points)
    print(table)
    endpoint = "OpenAI chat" if args.endpoint_type == "chat" else "kserve/vllm"
    title = (
        f"genai-perf 0.0.16, {endpoint} streaming, {args.input_tokens} prompt tokens, "
        f"{args.output_tokens} output tokens per request"
    )
    (args.out / "genai_perf.md").write_text(f"# {title}\n\n{table}\n", encoding="utf-8")
    write_csv(points, GenaiPerfPoint, args.out / "genai_perf.csv")
    plot(points, args.out / "genai_perf.png", title)
    print(f"wrote {args.out / 'genai_perf.md'}, genai_perf.csv and genai_perf.png")
    return 0
