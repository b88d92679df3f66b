"""Draining the model instances before tritonserver is signalled, through a folder of files.

Once tritonserver has received SIGTERM, the Python backend stubs' `send`, `is_model_ready` and
logging calls block (Triton 2.51), so a request still running then never gets its final response
and its model never finalizes. The launcher therefore drains first: it passes a folder in
$LOOKAHEAD_DRAIN_DIR, every instance registers there (`<pid>.serving`) and polls for the `drain`
file; on it the instance ends its requests with a final response, saves its snapshot and
acknowledges (`<pid>.drained`). Only then is the signal forwarded, and tritonserver unloads idle
models. Files need no signal handler in the stub, whose main thread is in C++. Without the
variable (tritonserver started directly) no watch runs.

A registration names the instance's model and its stub's shared-memory region, so that the
launcher's supervisor (launcher/supervisor.py) can restart the model of a stub that died without
finalizing or draining (Drain.dead), and remove what it left. It counts those restarts in the
folder (`restarts/<model>`), which the model's new instances publish as a metric.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from lookahead.contract import DRAIN_ENV

REQUEST_FILE = "drain"
RESTARTS_FOLDER = "restarts"
POLL_S = 0.2
SHM_PREFIX = "triton_python_backend_shm_region"  # the Python backend's region of one stub
SHM_FOLDER = Path("/dev/shm")


class DrainableLog:
    """The instance's logger: through the server (pb_utils.Logger) until the instance has drained,
    then straight to the stub's stderr (the server's log), since a signalled server stops relaying
    log calls and the call would block finalize."""

    def __init__(self, server_log: object):
        self.server_log = server_log
        self.direct = False

    def log_info(self, message: str) -> None:
        self._log("log_info", "I", message)

    def log_warn(self, message: str) -> None:
        self._log("log_warn", "W", message)

    def log_error(self, message: str) -> None:
        self._log("log_error", "E", message)

    def _log(self, method: str, level: str, message: str) -> None:
        if self.direct:
            print(f"{level} [pid {os.getpid()}] {message}", file=sys.stderr, flush=True)
        else:
            getattr(self.server_log, method)(message)


def _pid_file(folder: Path, pid: int, state: str) -> Path:
    return folder / f"{pid}.{state}"


def _alive(pid: int) -> bool:
    """Whether pid runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stub_shm_region() -> str:
    """This stub's shared-memory region (an argument tritonserver starts it with); "" elsewhere."""
    try:
        arguments = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    found = [a.decode(errors="replace") for a in arguments if SHM_PREFIX.encode() in a]
    return found[0] if found else ""


def remove_region(name: str, folder: Path | None = None) -> None:
    """Unlink a stub's shared-memory region whose owner cannot: a dead stub's (tritonserver still maps
    it while the requests that stub held stay open; the memory goes with the last mapping), or an
    orphaned stub's own (its tritonserver is gone)."""
    base = os.path.basename(name)
    if base.startswith(SHM_PREFIX):
        with contextlib.suppress(OSError):
            ((folder or SHM_FOLDER) / base).unlink()


@dataclass(frozen=True)
class DeadInstance:
    """An instance whose process ended without finalizing or draining."""

    pid: int
    model: str
    shm_region: str


class DrainWatch:
    """The instance's side: registered while it serves; calls on_drain() once when asked."""

    def __init__(self, folder: Path, on_drain: Callable[[], None], poll_s: float = POLL_S, model: str = ""):
        self.folder, self.on_drain, self.poll_s = folder, on_drain, poll_s
        self.pid = os.getpid()
        self.stopped = threading.Event()
        registration = {"model": model, "shm_region": stub_shm_region()}
        _pid_file(folder, self.pid, "serving").write_text(json.dumps(registration))
        self.thread = threading.Thread(target=self._run, name="lookahead-drain-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            if (self.folder / REQUEST_FILE).exists():
                try:
                    self.on_drain()
                finally:
                    _pid_file(self.folder, self.pid, "drained").touch()
                return

    def stop(self) -> None:
        """The instance is finalizing: stop watching and unregister."""
        self.stopped.set()
        _pid_file(self.folder, self.pid, "serving").unlink(missing_ok=True)

    def leave(self) -> None:
        """The server is gone without a drain (killed, its launcher with it, which will not remove the
        folder): unregister, and the last instance to leave removes the folder."""
        self.stop()
        _pid_file(self.folder, self.pid, "drained").unlink(missing_ok=True)
        registered = {int(p.stem) for p in self.folder.glob("*.*") if p.stem.isdigit()}
        if not any(_alive(pid) for pid in registered):
            shutil.rmtree(self.folder, ignore_errors=True)


def watch_drain(
    on_drain: Callable[[], None], env: Mapping[str, str] = os.environ, poll_s: float = POLL_S, model: str = ""
) -> DrainWatch | None:
    """Watch the launcher's drain folder, registered as an instance of `model`; None when there is
    none or it is gone."""
    folder = env.get(DRAIN_ENV)
    if not folder or not Path(folder).is_dir():
        return None
    return DrainWatch(Path(folder), on_drain, poll_s, model)


def restart_count(model: str, env: Mapping[str, str] = os.environ) -> int:
    """How often the launcher has restarted `model` after a stub of it died (0 without a launcher)."""
    folder = env.get(DRAIN_ENV)
    try:
        return int((Path(folder) / RESTARTS_FOLDER / model).read_text()) if folder else 0
    except (OSError, ValueError):
        return 0


class Drain:
    """The launcher's side: a private folder, its environment variable, the request and the wait."""

    def __init__(self, folder: Path):
        self.folder = folder

    @classmethod
    def create(cls) -> Drain:
        return cls(Path(tempfile.mkdtemp(prefix="lookahead-drain-")))

    @property
    def env(self) -> dict[str, str]:
        return {DRAIN_ENV: str(self.folder)}

    def _running(self, *states: str) -> set[int]:
        """The live pids with a file in one of these states."""
        pids = {int(p.stem) for state in states for p in self.folder.glob(f"*.{state}") if p.stem.isdigit()}
        return {pid for pid in pids if _alive(pid)}

    def pending(self) -> set[int]:
        """Serving instances that have not acknowledged the drain."""
        drained = self._running("drained")
        return self._running("serving") - drained

    def dead(self) -> list[DeadInstance]:
        """Instances whose process ended while serving: killed (SIGKILL, the OOM killer) or crashed,
        since one that finalizes, drains or leaves unregisters first. Each is reported once."""
        found = []
        for path in self.folder.glob("*.serving"):
            if not path.stem.isdigit():
                continue
            pid = int(path.stem)
            if _alive(pid) or _pid_file(self.folder, pid, "drained").exists():
                continue
            try:
                registration = json.loads(path.read_text() or "{}")
            except (OSError, ValueError):
                registration = {}
            path.unlink(missing_ok=True)
            model, region = registration.get("model", ""), registration.get("shm_region", "")
            found.append(DeadInstance(pid, str(model), str(region)))
        return found

    def count_restart(self, model: str) -> int:
        """Count one more restart of `model` (the count its new instances publish); the new count."""
        path = self.folder / RESTARTS_FOLDER / model
        path.parent.mkdir(exist_ok=True)
        count = restart_count(model, self.env) + 1
        path.write_text(str(count))
        return count

    def run(self, timeout_s: float) -> set[int]:
        """Ask every instance to drain and wait for them (at most timeout_s); the ones still pending."""
        (self.folder / REQUEST_FILE).touch()
        return self._wait(self.pending, timeout_s)

    def wait_gone(self, timeout_s: float) -> set[int]:
        """Wait until every instance that serves or drained has exited; the ones still running."""
        return self._wait(lambda: self._running("serving", "drained"), timeout_s)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    @staticmethod
    def _wait(left: Callable[[], set[int]], timeout_s: float) -> set[int]:
        deadline = time.monotonic() + timeout_s
        while (pids := left()) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return pids
