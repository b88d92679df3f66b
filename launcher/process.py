"""A server process the launcher owns: started in its own session, ready once its health URL
answers 200 from its own port (not another server's on it), stopped with a signal (SIGKILL if it
outlives the wait), stopped on leaving a `with`. It ends with the process that started it from the
main thread, however that ends (parent_death_signal, lookahead/parent_death.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import ClassVar, TypeVar

P = TypeVar("P", bound="ManagedProcess")
_LISTEN = "0A"  # a listening socket's state in /proc/net/tcp


class ProcessError(RuntimeError):
    """A managed process exited or did not become ready."""


class ManagedProcess:
    """`process`, whose output goes to `log_file` (None: the launcher's own), healthy when
    `health_url` answers 200. Subclasses name it and the error they raise."""

    name: ClassVar[str] = "the process"
    error: ClassVar[type[RuntimeError]] = ProcessError
    stop_timeout_s: ClassVar[float] = 15.0
    # What it gets when the process that started it ends: it must not outlive it.
    parent_death_signal: ClassVar[int] = signal.SIGKILL

    def __init__(self, process: subprocess.Popen, log_file: Path | None, health_url: str):
        self.process = process
        self.log_file = log_file
        self.health_url = health_url
        self.port = urllib.parse.urlsplit(health_url).port

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        """Block until ready, its health answered by itself; on death or timeout stop it and raise
        `error` with its log's tail."""
        deadline = time.monotonic() + timeout_s
        while not (self.is_ready() and listens(self.process.pid, self.port)):
            if self.process.poll() is not None:
                held = "" if port_free(self.port) else f" (port {self.port} is held by another process)"
                raise self.error(
                    f"{self.name} exited with code {self.process.returncode} before it was ready{held}"
                    f"{self._log()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise self.error(f"{self.name} was not ready after {timeout_s:.0f} s{self._log()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_file.read_text(errors="replace") if self.log_file else ""
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _log(self) -> str:
        return f"; log {self.log_file}:\n{self.log_tail()}" if self.log_file else ""

    def stop(self, timeout_s: float | None = None, signum: int = signal.SIGTERM) -> int:
        """Signal it and wait (stop_timeout_s by default); SIGKILL if it outlives the wait."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(self.stop_timeout_s if timeout_s is None else timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self: P) -> P:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def listens(pid: int, port: int) -> bool:
    """Whether process `pid` listens on TCP `port` (Linux's /proc; True where it cannot tell), so
    that a readiness probe answered by another server on that port is not taken for ours."""
    sockets = set()
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        try:
            rows = table.read_text().splitlines()[1:]
        except OSError:
            return True
        for row in rows:
            fields = row.split()
            if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                sockets.add(f"socket:[{fields[9]}]")
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in sockets:
                return True
        except OSError:
            continue
    return False


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port that was free a moment ago and that this process was not given before (for tests
    and benchmarks that start their own servers: the kernel may offer a port it just offered, and
    one server's ports must differ)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def refuse_busy_ports(ports: dict[str, int], error: type[RuntimeError] = ProcessError) -> None:
    """Fail clearly on a busy port (`ports`: flag -> port): another server there would otherwise
    answer the readiness probe."""
    for flag, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", port))
            except OSError as err:
                raise error(f"port {port} is already in use ({err.strerror}): pass another --{flag}") from err
