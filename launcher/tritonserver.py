"""Find or assemble a tritonserver with the Python backend, start it and wait until it is ready.

A `tritonserver` on the PATH (the official container) is used with its own backends. Otherwise
the binary shipped inside the nvidia-pytriton wheel is used, with a backend directory assembled
under <repo>/.cache/triton_backends holding the Python backend and the stub for this interpreter.

Either way the stub must run this virtual environment's Python. The stub embeds libpython and
starts an isolated interpreter (PYTHONPATH is ignored) whose sys.prefix comes from the first
`python3` on the PATH: so this environment's bin/ goes first on the PATH, and the project itself
reaches the stub through the environment's site-packages (scripts/bootstrap.sh installs it there).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from backend.drain import Drain
from lookahead.parent_death import ending_with_this_process

from .process import ManagedProcess, ProcessError, refuse_busy_ports
from .supervisor import model_control_args

REPO_ROOT = Path(__file__).resolve().parents[1]
BACKENDS_CACHE = REPO_ROOT / ".cache" / "triton_backends"
_STUB = "triton_python_backend_stub"
_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
# A stop, at most STOP_TIMEOUT_S in all (within Kubernetes' default 30 s grace period):
DRAIN_TIMEOUT_S = 10.0  # the instances drain (answer every request, save their tries), then
EXIT_WAIT_S = 10.0  # tritonserver gets the signal and this long to exit (SIGKILL after), then
STUBS_GONE_S = 3.0  # its backend stubs get this long to end (SIGKILL after: they saved at the drain)
STOP_TIMEOUT_S = DRAIN_TIMEOUT_S + EXIT_WAIT_S + STUBS_GONE_S


class TritonServerError(ProcessError):
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


class TritonServer(ManagedProcess):
    """A running tritonserver process; use as a context manager to stop it on exit."""

    name = "tritonserver"
    error = TritonServerError
    stop_timeout_s = EXIT_WAIT_S

    def __init__(
        self,
        process: subprocess.Popen,
        *,
        http_port: int,
        grpc_port: int,
        metrics_port: int,
        log_file: Path,
        drain: Drain | None = None,
        admin_key: str | None = None,
        host: str = "127.0.0.1",
    ):
        super().__init__(process, log_file, f"http://{host}:{http_port}/v2/health/ready")
        self.host = host
        self.drain = drain
        self.admin_key = admin_key
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.metrics_port = metrics_port

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def stop(self, timeout_s: float | None = None, signum: int = signal.SIGTERM) -> int:
        """Drain the model instances (their requests answered, their snapshots saved) while the server
        still relays responses, then signal it so that every model's finalize() runs; SIGKILL if it
        outlives timeout_s (EXIT_WAIT_S). Returns once its backend stubs have ended too (those left
        after STUBS_GONE_S are killed): at most STOP_TIMEOUT_S in all."""
        if self.process.poll() is None and self.drain is not None:
            late = self.drain.run(DRAIN_TIMEOUT_S)
            if late:
                print(f"instances {sorted(late)} did not drain in {DRAIN_TIMEOUT_S:g} s", file=sys.stderr)
        code = super().stop(timeout_s, signum)
        if self.drain is not None:
            left = self.drain.wait_gone(STUBS_GONE_S)
            for pid in sorted(left):
                print(
                    f"backend stub {pid} still ran {STUBS_GONE_S:g} s after tritonserver: killed",
                    file=sys.stderr,
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.drain.remove()
            self.drain = None
        return code


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
    admin_key: str | None = None,
    address: str | None = None,
) -> TritonServer:
    """Start tritonserver on model_repository and return once it reports ready.

    With admin_key, models are loaded and unloaded through the model-control API, which only
    requests carrying that key may call (launcher/supervisor.py). Output goes to log_file (a new
    temporary file when None). address: the interface its three ports listen on (None:
    tritonserver's default, every interface). The server runs in its own session
    so that a Ctrl-C in the terminal reaches only the launcher, which then stops it gracefully:
    its instances drain through a private folder (backend/drain.py), then it gets the signal.
    """
    repository = Path(model_repository).resolve()
    if not repository.is_dir():
        raise TritonServerError(f"model repository {repository} does not exist")
    refuse_busy_ports(
        {"http-port": http_port, "grpc-port": grpc_port, "metrics-port": metrics_port}, TritonServerError
    )
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
        *(f"--{port}-address={address}" for port in ("http", "grpc", "metrics") if address),
        *(model_control_args(admin_key) if admin_key else ()),
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
                preexec_fn=ending_with_this_process(TritonServer.parent_death_signal),
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
        admin_key=admin_key,
        host=local_host(address),
    )
    try:
        server.wait_ready(ready_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def local_host(address: str | None) -> str:
    """Where this machine reaches a server listening on `address`."""
    if address in (None, "", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{address}]" if ":" in address else address


def _temporary_log() -> Path:
    handle, path = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
    os.close(handle)
    return Path(path)
