"""`python -m launcher`: serve a model repository with tritonserver (and, on request, the
OpenAI-compatible endpoint beside it) until Ctrl-C or SIGTERM, which drain the models first.

    python -m launcher --model-repository model_repository --http-port 8000
    python -m launcher --model qwen2.5-coder-0.5b-instruct   # every model serves the Qwen model
    python -m launcher --openai-port 9000   # and the OpenAI-compatible endpoint (frontend/)

`--model` (or $LOOKAHEAD_MODEL) replaces the `model` parameter of every model in the repository
(a GGUF file or a folder as an absolute path); it is prepared here before tritonserver starts (an
embedded one installed, a GGUF file's tokenizer converted, a folder's integer forms searched;
progress on the terminal).

A stop ends everything within tritonserver.STOP_TIMEOUT_S, a client's open stream notwithstanding;
whatever ends the launcher (SIGKILL included) ends the processes it started; an endpoint that
dies, or cannot serve its port, stops it with exit code 1. A model whose backend stub dies is
restarted (launcher/supervisor.py), unless the arguments after -- choose a --model-control-mode;
a tritonserver that a signal ends (an abort, the OOM killer) is started again, its models warm from
their trie snapshots, up to CRASH_RESTARTS times an hour.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from lookahead.contract import ADMIN_KEY_ENV, MODEL_ENV, SYNC_ENV

from .frontend import Frontend, FrontendError, start_frontend
from .process import refuse_busy_ports
from .supervisor import Supervisor
from .tritonserver import REPO_ROOT, TritonServer, TritonServerError, start_server

LOGS_DIR = REPO_ROOT / ".cache" / "logs"
CRASH_RESTARTS = 3  # tritonserver is started again after a crash at most this often ...
CRASH_WINDOW_S = 3600.0  # ... within this many seconds


def model_override(value: str) -> str:
    """The LOOKAHEAD_MODEL value for `--model`: an embedded model's name, or a GGUF file's or a
    folder's absolute path (the server's processes run elsewhere), prepared before any server
    starts. TritonServerError when it is none of them, or a GGUF file that cannot be served."""
    from lookahead.models.embedded import EMBEDDED_MODELS
    from lookahead.models.gguf_file import is_gguf_path, open_gguf

    model = value
    if is_gguf_path(value):
        try:
            model = str(open_gguf(value).path.resolve())
        except (ValueError, FileNotFoundError) as error:
            raise TritonServerError(f"--model: {error}") from None
    elif value not in EMBEDDED_MODELS:
        folder = Path(value).expanduser()
        if not (folder / "config.json").is_file():
            raise TritonServerError(
                f"--model {value!r} is neither an embedded model ({', '.join(EMBEDDED_MODELS)}), "
                "nor a .gguf file, nor a local folder with a config.json"
            )
        model = str(folder.resolve())
    prepare_model(model)
    return model


def prepare_model(model: str) -> None:
    """`python -m lookahead prepare MODEL`, progress on the terminal: the download, the tokenizer's
    conversion and the integer-form search done once, so that every instance finds them cached and
    the readiness wait covers only loading. In a process of its own, whose memory is freed before
    the server's."""
    done = subprocess.run([sys.executable, "-m", "lookahead", "prepare", model], stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise TritonServerError(f"preparing {model} failed (python -m lookahead prepare: {done.returncode})")


def _follow(path: Path, offset: int, stop: threading.Event) -> None:
    """Copy a growing log file from offset to stdout until stop is set and the file is drained."""
    with open(path, "rb") as log:
        log.seek(offset)
        while True:
            chunk = log.read(65536)
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            elif stop.is_set():
                return
            else:
                time.sleep(0.2)


def restart_after_crash(code: int | None, crashes: list[float], now: float | None = None) -> bool:
    """Whether to start tritonserver again after it ended with `code`: yes when a signal ended it
    (an abort in native code, the OOM killer), at most CRASH_RESTARTS times within CRASH_WINDOW_S;
    `crashes` keeps the times. An exit of its own (a bad argument, a port taken) ends the launcher."""
    if code is None or code >= 0:
        return False
    now = time.monotonic() if now is None else now
    crashes[:] = [t for t in crashes if now - t < CRASH_WINDOW_S]
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if len(crashes) >= CRASH_RESTARTS:
        print(
            f"error: tritonserver ended by {name}, {CRASH_RESTARTS + 1} crashes within {CRASH_WINDOW_S:g} s; "
            "stopping",
            file=sys.stderr,
            flush=True,
        )
        return False
    crashes.append(now)
    print(
        f"error: tritonserver ended by {name}; starting it again (the log says why)",
        file=sys.stderr,
        flush=True,
    )
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher",
        description="Serve a model repository with tritonserver (the Python backend included).",
        epilog="Arguments after -- go to tritonserver unchanged, e.g. -- --log-verbose=1",
    )
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument(
        "--address",
        help="the interface tritonserver's HTTP, gRPC and metrics ports listen on (default: every one); "
        "127.0.0.1 behind a proxy, see docs/OPERATIONS.md#security",
    )
    parser.add_argument(
        "--log-file",
        type=Path,
        help="appended to (default: .cache/logs/tritonserver-<http port>.log)",
    )
    parser.add_argument(
        "--openai-port",
        type=int,
        default=0,
        help="also serve the OpenAI-compatible endpoint (python -m frontend) on this port; 0: off",
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    parser.add_argument(
        "--model",
        default=os.environ.get(MODEL_ENV) or None,
        help="serve every model of the repository on this embedded model, .gguf file or folder "
        f"(default: ${MODEL_ENV}, else each config.pbtxt's model parameter)",
    )
    parser.add_argument(
        "--trie-sync",
        metavar="URL",
        help=f"every model's trie_sync: the Redis URL its replicas learn through (default: ${SYNC_ENV}, "
        "else each config.pbtxt's trie_sync parameter)",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:split]), argv[split + 1 :]
    extra_env = {}
    ports = {"http-port": args.http_port, "grpc-port": args.grpc_port, "metrics-port": args.metrics_port}
    if args.openai_port:
        ports["openai-port"] = args.openai_port
    try:  # before anything is touched: the log of a server already on these ports is its own
        refuse_busy_ports(ports, TritonServerError)
    except TritonServerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.model:
        try:
            extra_env[MODEL_ENV] = model_override(args.model)
        except (TritonServerError, OSError, RuntimeError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"every model of {args.model_repository} serves {extra_env[MODEL_ENV]}", flush=True)
    if args.trie_sync:
        extra_env[SYNC_ENV] = args.trie_sync
    log_path = args.log_file or LOGS_DIR / f"tritonserver-{args.http_port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.open("ab").close()
    stop_following = threading.Event()
    start_offset = log_path.stat().st_size  # the log is appended to: show only this run
    follower = threading.Thread(target=_follow, args=(log_path, start_offset, stop_following), daemon=True)
    follower.start()

    # The model-control key: the supervisor's (and the endpoint's, to list models), no client's.
    own_control = any(argument.startswith("--model-control-mode") for argument in extra)
    admin_key = None if own_control else secrets.token_urlsafe(32)
    server: TritonServer | None = None
    supervisor: Supervisor | None = None
    openai: Frontend | None = None
    endpoint_died = False
    stop_signal: list[int] = []  # the first SIGINT/SIGTERM once serving: the main thread stops the server
    stop_requested = threading.Event()
    restarting: list[bool] = []  # non-empty while a crashed tritonserver is started again

    def serve() -> tuple[TritonServer, Supervisor | None]:
        started = start_server(
            args.model_repository,
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            metrics_port=args.metrics_port,
            log_file=log_path,
            extra_args=extra,
            extra_env=extra_env,
            ready_timeout_s=args.ready_timeout,
            admin_key=admin_key,
            address=args.address,
        )
        if admin_key is None or started.drain is None:
            return started, None
        return started, Supervisor(started.drain, started.http_url, admin_key, args.ready_timeout).start()

    def forward(signum: int, frame: FrameType | None) -> None:
        starting = server is None or bool(restarting) or (args.openai_port and openai is None)
        if starting or stop_signal:  # a second signal: no more draining
            if server is not None and server.process.poll() is None:
                server.process.send_signal(signum)
            if starting:
                raise KeyboardInterrupt  # abort the readiness wait, which stops it
            return
        stop_signal.append(signum)
        stop_requested.set()

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        server, supervisor = serve()
        if args.openai_port:
            endpoint_env = {**os.environ, **extra_env, **({ADMIN_KEY_ENV: admin_key} if admin_key else {})}
            openai = start_frontend(server.grpc_url, args.openai_port, env=endpoint_env)
        endpoint = f"  OpenAI {openai.url}" if openai else ""
        print(
            f"\ntritonserver ready: HTTP {server.http_url}  gRPC {server.grpc_url}  "
            f"metrics {server.metrics_url}{endpoint}\nlog: {log_path}   stop with Ctrl-C\n",
            flush=True,
        )
        crashes: list[float] = []
        while not stop_requested.wait(0.5):
            if server.process.poll() is not None:
                if not restart_after_crash(server.process.returncode, crashes):
                    break
                restarting.append(True)
                if supervisor is not None:
                    supervisor.stop()
                server.stop()  # its stubs gone, its drain folder removed
                server, supervisor = serve()
                restarting.clear()
                print(f"tritonserver ready again: HTTP {server.http_url}  gRPC {server.grpc_url}", flush=True)
                continue
            if openai is not None and openai.process.poll() is not None:
                print(
                    f"error: the OpenAI endpoint exited with code {openai.process.returncode}; stopping",
                    file=sys.stderr,
                    flush=True,
                )
                endpoint_died = True
                break
        if supervisor is not None:
            supervisor.stop()
        if openai is not None and openai.process.poll() is None:
            openai.process.send_signal(signal.SIGTERM)  # it winds down (5 s) while the models drain
        # After a crash too: it waits for the stubs and removes the drain folder.
        code = server.stop(signum=stop_signal[0] if stop_signal else signal.SIGTERM)
    except KeyboardInterrupt:
        if supervisor is not None:
            supervisor.stop()
        if server is not None:
            server.stop()
        code = 130
    except (TritonServerError, FrontendError) as err:
        if supervisor is not None:
            supervisor.stop()
        if server is not None:
            server.stop()
        stop_following.set()
        follower.join()
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        if openai is not None:
            openai.stop()
    stop_following.set()
    follower.join()
    if endpoint_died:
        return 1
    return 0 if stop_signal else code
