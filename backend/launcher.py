"""Find or assemble a tritonserver with the Python backend, start it and wait until it is ready.

A `tritonserver` on the PATH (the official container) is used with its own backends. Otherwise
the binary shipped inside the nvidia-pytriton wheel is used, with a backend directory assembled
under <repo>/.cache/triton_backends holding the Python backend and the stub for this interpreter.

Either way the stub must run this virtual environment's Python. The stub embeds libpython and
starts an isolated interpreter (PYTHONPATH is ignored) whose sys.prefix comes from the first
`python3` on the PATH: so this environment's bin/ goes first on the PATH, and the project itself
reaches the stub through the environment's site-packages (scripts/bootstrap.sh installs it there).

    python -m backend.launcher --model-repository model_repository --http-port 8000
    python -m backend.launcher --model qwen2.5-coder-0.5b-instruct   # every model serves the Qwen model
    python -m backend.launcher --openai-port 9000   # and the OpenAI-compatible endpoint (frontend/)

`--model` (or $LOOKAHEAD_MODEL) replaces the `model` parameter of every model in the repository
(a GGUF file or a folder as an absolute path); it is prepared here before tritonserver starts (an
embedded one installed, a GGUF file's tokenizer converted, a folder's integer forms searched;
progress on the terminal).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

from backend.drain import Drain
from frontend.process import Frontend, FrontendError, start_frontend

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_ENV = "LOOKAHEAD_MODEL"  # read by backend/config.py in every model instance
SYNC_ENV = "LOOKAHEAD_TRIE_SYNC"  # likewise: every model's trie_sync
BACKENDS_CACHE = REPO_ROOT / ".cache" / "triton_backends"
LOGS_DIR = REPO_ROOT / ".cache" / "logs"
_STUB = "triton_python_backend_stub"
_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
DRAIN_TIMEOUT_S = 10.0  # how long a stop waits for the instances to drain before it signals tritonserver
STUBS_GONE_S = 15.0  # how long a stop waits, once tritonserver exited, for its backend stubs to end


class TritonServerError(RuntimeError):
    """tritonserver could not be found, or it did not become ready."""


@dataclass(frozen=True)
class ServerInstallation:
    """How to run one tritonserver: the binary, its backend directory (None: its own) and environment."""

    binary: Path
    backend_directory: Path | None
    env: dict[str, str]


def find_tritonserver() -> ServerInstallation:
    """Prefer a tritonserver on the PATH; fall back to the nvidia-pytriton wheel's binary."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return ServerInstallation(Path(on_path), None, _stub_env())
    spec = importlib.util.find_spec("pytriton")  # locate only: importing pytriton is slow and unneeded
    if spec is None or not spec.submodule_search_locations:
        raise TritonServerError(
            "no tritonserver on the PATH and the nvidia-pytriton wheel is not installed: "
            "run scripts/bootstrap.sh (or pip install --no-deps nvidia-pytriton==0.7.0)"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    libs = package.parent / "nvidia_pytriton.libs"
    return ServerInstallation(
        binary=package / "tritonserver" / "bin" / "tritonserver",
        backend_directory=assemble_backend_directory(package / "tritonserver", BACKENDS_CACHE),
        env=_stub_env(library_dirs=[libs, Path(sysconfig.get_config_var("LIBDIR"))]),
    )


def assemble_backend_directory(wheel_server: Path, target: Path) -> Path:
    """Copy the wheel's Python backend and this interpreter's stub into target/python.

    The wheel keeps one stub per Python version apart from the backend; tritonserver expects the
    stub next to libtriton_python.so. Files are replaced atomically, so concurrent launchers agree.
    """
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = wheel_server / "python_backend_stubs" / version / _STUB
    if not stub.is_file():
        raise TritonServerError(f"nvidia-pytriton ships no Python backend stub for Python {version} ({stub})")
    sources = [wheel_server / "backends" / "python" / name for name in _BACKEND_FILES] + [stub]
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for source in sources:
        _copy_if_changed(source, python_dir / source.name)
    return target


def _copy_if_changed(source: Path, destination: Path) -> None:
    if destination.is_file():
        src, dst = source.stat(), destination.stat()
        if (src.st_size, src.st_mtime_ns) == (dst.st_size, dst.st_mtime_ns):
            return
    handle, staging = tempfile.mkstemp(prefix=f".{destination.name}-", dir=destination.parent)
    os.close(handle)
    try:
        shutil.copy2(source, staging)
        os.replace(staging, destination)
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def _stub_env(library_dirs: Sequence[Path] = ()) -> dict[str, str]:
    """Environment in which a Python backend stub runs this interpreter's environment.

    library_dirs go first on LD_LIBRARY_PATH: the wheel's bundled libraries (libcudart, which the
    copied stub no longer finds through its RPATH) and this Python's libpython. PYTHONPATH gets the
    repo root for stubs whose interpreter does read the environment.
    """
    env = dict(os.environ)
    bin_dir = Path(sys.executable).parent
    if (bin_dir / "python3").exists():
        env["PATH"] = _join_unique([str(bin_dir), *env.get("PATH", "").split(os.pathsep)])
    env["PYTHONPATH"] = _join_unique([str(REPO_ROOT), *env.get("PYTHONPATH", "").split(os.pathsep)])
    if library_dirs:
        library_path = [str(d) for d in library_dirs] + env.get("LD_LIBRARY_PATH", "").split(os.pathsep)
        env["LD_LIBRARY_PATH"] = _join_unique(library_path)
    return env


def _join_unique(entries: Iterable[str]) -> str:
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))


def _refuse_busy_ports(ports: dict[str, int]) -> None:
    """Fail clearly on a busy port: another server there would otherwise answer the readiness probe."""
    for flag, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", port))
            except OSError as err:
                raise TritonServerError(
                    f"port {port} is already in use ({err.strerror}): pass another --{flag}"
                ) from err


def free_port() -> int:
    """A TCP port that was free a moment ago (for tests that start their own server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TritonServer:
    """A running tritonserver process; use as a context manager to stop it on exit."""

    def __init__(
        self,
        process: subprocess.Popen,
        *,
        http_port: int,
        grpc_port: int,
        metrics_port: int,
        log_file: Path,
        drain: Drain | None = None,
    ):
        self.process = process
        self.drain = drain
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.metrics_port = metrics_port
        self.log_file = log_file

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout=2
            ) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        """Block until /v2/health/ready answers 200; on death or timeout stop and raise with the log tail."""
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            if self.process.poll() is not None:
                raise TritonServerError(
                    f"tritonserver exited with code {self.process.returncode} before it was ready; "
                    f"log {self.log_file}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TritonServerError(
                    f"tritonserver was not ready after {timeout_s:.0f} s; "
                    f"log {self.log_file}:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 60.0, signum: int = signal.SIGTERM) -> int:
        """Drain the model instances (their requests answered, their snapshots saved) while the server
        still relays responses, then signal it so that every model's finalize() runs; SIGKILL only
        if it outlives timeout_s. Returns once its backend stubs have ended too (or STUBS_GONE_S)."""
        if self.process.poll() is None:
            if self.drain is not None:
                late = self.drain.run(DRAIN_TIMEOUT_S)
                if late:
                    print(f"instances {sorted(late)} did not drain in {DRAIN_TIMEOUT_S:g} s", file=sys.stderr)
            self.process.send_signal(signum)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.drain is not None:
            left = self.drain.wait_gone(STUBS_GONE_S)
            if left:
                print(f"backend stubs {sorted(left)} still run after tritonserver exited", file=sys.stderr)
            self.drain.remove()
            self.drain = None
        return self.process.returncode

    def __enter__(self) -> TritonServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_server(
    model_repository: str | Path,
    *,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    log_file: str | Path | None = None,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 300.0,
) -> TritonServer:
    """Start tritonserver on model_repository and return once it reports ready.

    Output goes to log_file (a new temporary file when None). The server runs in its own session
    so that a Ctrl-C in the terminal reaches only the launcher, which then stops it gracefully:
    its instances drain through a private folder (backend/drain.py), then it gets the signal.
    """
    repository = Path(model_repository).resolve()
    if not repository.is_dir():
        raise TritonServerError(f"model repository {repository} does not exist")
    _refuse_busy_ports({"http-port": http_port, "grpc-port": grpc_port, "metrics-port": metrics_port})
    installation = find_tritonserver()
    log_path = Path(log_file) if log_file else _temporary_log()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [str(installation.binary), f"--model-repository={repository}"]
    if installation.backend_directory is not None:
        command.append(f"--backend-directory={installation.backend_directory}")
    command += [
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        *extra_args,
    ]
    drain = Drain.create()
    try:
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**installation.env, **drain.env, **(extra_env or {})},
                start_new_session=True,
            )
    except BaseException:
        drain.remove()
        raise
    server = TritonServer(
        process,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        log_file=log_path,
        drain=drain,
    )
    try:
        server.wait_ready(ready_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


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


def _temporary_log() -> Path:
    handle, path = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
    os.close(handle)
    return Path(path)


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m backend.launcher",
        description="Serve a model repository with tritonserver (the Python backend included).",
        epilog="Arguments after -- go to tritonserver unchanged, e.g. -- --log-verbose=1",
    )
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument(
        "--log-file",
        type=Path,
        help="appended to (default: .cache/logs/tritonserver-<http port>.log, rewritten)",
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
    if args.openai_port:
        try:
            _refuse_busy_ports({"openai-port": args.openai_port})
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
    log_path.open("ab" if args.log_file else "wb").close()
    stop_following = threading.Event()
    start_offset = log_path.stat().st_size  # an existing --log-file is appended to: show only this run
    follower = threading.Thread(target=_follow, args=(log_path, start_offset, stop_following), daemon=True)
    follower.start()

    server: TritonServer | None = None
    openai: Frontend | None = None
    stop_signal: list[int] = []  # the first SIGINT/SIGTERM once serving: the main thread stops the server
    stop_requested = threading.Event()

    def forward(signum: int, frame: FrameType | None) -> None:
        starting = server is None or (args.openai_port and openai is None)
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
        server = start_server(
            args.model_repository,
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            metrics_port=args.metrics_port,
            log_file=log_path,
            extra_args=extra,
            extra_env=extra_env,
            ready_timeout_s=args.ready_timeout,
        )
        if args.openai_port:
            openai = start_frontend(server.grpc_url, args.openai_port, env={**os.environ, **extra_env})
        endpoint = f"  OpenAI {openai.url}" if openai else ""
        print(
            f"\ntritonserver ready: HTTP {server.http_url}  gRPC {server.grpc_url}  "
            f"metrics {server.metrics_url}{endpoint}\nlog: {log_path}   stop with Ctrl-C\n",
            flush=True,
        )
        while server.process.poll() is None and not stop_requested.wait(0.5):
            pass
        # After a crash too: it waits for the stubs and removes the drain folder.
        code = server.stop(signum=stop_signal[0] if stop_signal else signal.SIGTERM)
    except KeyboardInterrupt:
        if server is not None:
            server.stop()
        code = 130
    except (TritonServerError, FrontendError) as err:
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
    return 0 if stop_signal and code in (0, -signal.SIGTERM, -signal.SIGINT) else code


if __name__ == "__main__":
    raise SystemExit(main())
