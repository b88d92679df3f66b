"""The servers a benchmark measures: a tritonserver started for the run, with tries of its own,
or one already running; and the arguments that choose between them."""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.ab_repository import SHARED_CACHE_ENV
from launcher import TritonServer, free_port, start_server
from lookahead.contract import STATE_DIR_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS = ("lookahead", "baseline")
SERVER_READY_TIMEOUT_S = 600.0  # as `python -m launcher`: a busy machine loads slowly


class BenchmarkError(RuntimeError):
    """A measuring tool (perf_analyzer, genai-perf) failed or left no usable result."""


def add_server_arguments(parser: argparse.ArgumentParser, warm_trie: bool = True) -> None:
    """--url, --start-server, --model-repository (and --warm-trie where a run may keep its tries)."""
    parser.add_argument("--url", default="localhost:8001", help="gRPC host:port of a running server")
    parser.add_argument("--start-server", action="store_true", help="start tritonserver for the run")
    if warm_trie:
        parser.add_argument(
            "--warm-trie",
            action="store_true",
            help="with --start-server: keep the trie of the last run in --out",
        )
    else:
        parser.set_defaults(warm_trie=False)
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")


def add_comparison_arguments(parser: argparse.ArgumentParser) -> None:
    """The server and the models a comparison through it (speedup, multi_turn) runs: a running
    server's --url, else one started on --model-repository; --models, each against --baseline."""
    parser.add_argument(
        "--url", default=None, help="gRPC host:port of a running server (else one is started)"
    )
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument(
        "--models",
        nargs="+",
        default=["lookahead", "baseline"],
        help="served models; NAME:DRAFTER is NAME with that drafter, served as a model of its own",
    )
    parser.add_argument("--baseline", default="baseline", help="the model every ratio and text is against")


def check_comparison_arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.Namespace:
    """The parsed arguments of add_comparison_arguments, checked (--baseline among --models), with a
    cold server started for the run where no --url is given.

    Each NAME:DRAFTER of --models must be a model of its own: two entries served by one model
    would share its trie and prefix cache, and whichever ran second would draft from (and skip
    reading) what the first was just asked. On a server started for the run it is served as
    NAME_DRAFTER, a copy of NAME with that `drafter` (drafter_repository); a running --url must
    serve each such entry apart already."""
    if args.baseline not in args.models:
        parser.error(f"--baseline {args.baseline} must be one of --models")
    served = [model.partition(":")[0] for model in args.models]
    args.start_server = args.url is None
    args.warm_trie = False
    if args.start_server and any(":" in model for model in args.models):
        args.model_repository = drafter_repository(args.model_repository, args.models, args.out)
        args.models = [model.replace(":", "_") for model in args.models]
        args.baseline = args.baseline.replace(":", "_")
    elif len(set(served)) < len(served):
        parser.error(
            f"--models {' '.join(args.models)} serve one model twice: it would learn one entry's "
            "prompts for the other; serve each drafter as a model of its own"
        )
    return args


def drafter_repository(repository: Path, models: list[str], out: Path) -> Path:
    """A repository in out/model_repository serving repository's models and, for each NAME:DRAFTER,
    NAME_DRAFTER: NAME's folder with that `drafter` in its config.pbtxt."""
    from bench.fleet import set_parameter

    served = out.resolve() / "model_repository"
    shutil.rmtree(served, ignore_errors=True)
    served.mkdir(parents=True)
    for folder in repository.resolve().iterdir():
        if (folder / "config.pbtxt").exists():
            (served / folder.name).symlink_to(folder, target_is_directory=True)
    for model in models:
        name, _, drafter = model.partition(":")
        if not drafter:
            continue
        source, target = repository.resolve() / name, served / f"{name}_{drafter}"
        target.mkdir()
        for entry in source.iterdir():
            if entry.name != "config.pbtxt":
                (target / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
        config = set_parameter((source / "config.pbtxt").read_text(), "drafter", drafter)
        (target / "config.pbtxt").write_text(config)
    return served


@contextmanager
def launcher_as_shipped(out: Path, model: str | None = None) -> Iterator[str]:
    """The server as scripts/serve.sh starts it (`python -m launcher` on the repository as it ships,
    `--model` where given), with no LOOKAHEAD_* variable but a fresh trie folder in `out`; yields
    its gRPC URL and stops it (SIGTERM: it drains) afterwards."""
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    state = out / "trie_state"
    shutil.rmtree(state, ignore_errors=True)
    env = {name: value for name, value in os.environ.items() if not name.startswith("LOOKAHEAD_")}
    env[STATE_DIR_ENV] = str(state.resolve())
    http, grpc, metrics = free_port(), free_port(), free_port()
    command = [sys.executable, "-m", "launcher", "--model-repository", str(REPO_ROOT / "model_repository")]
    command += ["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    command += ["--model", model] if model else []
    print(f"starting {' '.join(command[1:])} (log {out / 'launcher.log'})", flush=True)
    with open(out / "launcher.log", "ab") as log:
        launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
        while True:
            if launcher.poll() is not None:
                log_path = out / "launcher.log"
                raise BenchmarkError(f"the launcher exited ({launcher.returncode}): see {log_path}")
            try:
                ready = f"http://localhost:{http}/v2/health/ready"
                with urllib.request.urlopen(ready, timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise BenchmarkError(f"the launcher was not ready in {SERVER_READY_TIMEOUT_S:.0f} s")
            time.sleep(1.0)
        yield f"localhost:{grpc}"
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()


@contextmanager
def tritonserver_for_run(repository: Path, out: Path, warm_trie: bool = False) -> Iterator[str]:
    """A tritonserver on free ports serving `repository`, its log and its trie snapshots in `out`
    (emptied first unless warm_trie); yields its gRPC URL and stops it afterwards."""
    with started_server(repository, out, warm_trie) as server:
        yield server.grpc_url


@contextmanager
def started_server(repository: Path, out: Path, warm_trie: bool = False) -> Iterator[TritonServer]:
    """tritonserver_for_run's server itself (its metrics URL too)."""
    print(f"starting tritonserver on {repository} (log {out / 'server.log'})", flush=True)
    state = out / "trie_state"
    if not warm_trie:
        shutil.rmtree(state, ignore_errors=True)
    with start_server(
        repository,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        log_file=out / "server.log",
        extra_env={
            STATE_DIR_ENV: str(state.resolve()),
            **{name: value for name, value in SHARED_CACHE_ENV.items() if name not in os.environ},
        },
        ready_timeout_s=SERVER_READY_TIMEOUT_S,
    ) as server:
        yield server


@contextmanager
def server_url(args: argparse.Namespace) -> Iterator[str]:
    """The gRPC URL to measure: --url, or that of a server started for this run (--start-server)."""
    if not args.start_server:
        yield args.url
        return
    with tritonserver_for_run(args.model_repository, args.out, args.warm_trie) as url:
        yield url


def parse_concurrency(text: str) -> tuple[int, ...]:
    """--concurrency: positive integers separated by commas, e.g. 1,2,4,8."""
    levels = tuple(int(part) for part in text.split(",") if part.strip())
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return levels
