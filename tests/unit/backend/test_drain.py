"""The drain channel between the launcher and the model instances (backend/drain.py), and the
launcher's stop: drain first, then the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from backend.drain import Drain, restart_count, watch_drain
from launcher import TritonServer
from launcher.tritonserver import REPO_ROOT
from lookahead.contract import DRAIN_ENV
from tests.helpers import wait_until

# An instance's stand-in: drains (writes a marker) when asked, then lives until it gets SIGTERM.
INSTANCE = """
import signal, sys, time
from pathlib import Path
from backend.drain import watch_drain
marker = Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0 if marker.exists() else 3))
watch_drain(lambda: marker.write_text("drained"), poll_s=0.02)
time.sleep(600)
"""


def test_without_the_variable_no_watch_runs(tmp_path):
    assert watch_drain(lambda: None, env={}) is None
    assert watch_drain(lambda: None, env={DRAIN_ENV: str(tmp_path / "gone")}) is None


def test_an_instance_drains_once_and_acknowledges(tmp_path):
    drain = Drain(tmp_path)
    calls: list[int] = []
    started = threading.Event()

    def on_drain() -> None:
        started.set()
        time.sleep(0.3)  # the wait covers the instance's own work
        calls.append(1)

    watch = watch_drain(on_drain, env=drain.env, poll_s=0.02)
    assert watch is not None and drain.pending() == {os.getpid()}
    assert drain.run(timeout_s=5) == set()
    assert calls == [1] and drain.pending() == set()
    watch.thread.join(1)
    assert not watch.thread.is_alive() and calls == [1]
    watch.stop()
    assert not (tmp_path / f"{os.getpid()}.serving").exists()


def test_an_instance_that_never_acknowledges_is_reported_after_the_timeout(tmp_path):
    drain = Drain(tmp_path)
    watch = watch_drain(lambda: time.sleep(5), env=drain.env, poll_s=0.02)
    begun = time.monotonic()
    assert drain.run(timeout_s=0.3) == {os.getpid()}
    assert time.monotonic() - begun < 2
    watch.stop()


def test_a_dead_instance_is_not_waited_for(tmp_path):
    (tmp_path / "999999999.serving").touch()  # above any pid_max
    assert Drain(tmp_path).run(timeout_s=5) == set()


def test_stop_drains_the_instances_before_it_signals_the_server(tmp_path):
    """A process that exits 0 on SIGTERM only if it had drained by then."""
    drain = Drain.create()
    marker = tmp_path / "drained"
    process = subprocess.Popen(
        [sys.executable, "-c", INSTANCE, str(marker)],
        env={**os.environ, **drain.env, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert wait_until(lambda: drain.pending() == {process.pid}, 30)
    server = TritonServer(
        process, http_port=0, grpc_port=0, metrics_port=0, log_file=tmp_path / "log", drain=drain
    )
    assert server.stop(timeout_s=30, signum=signal.SIGTERM) == 0
    assert marker.read_text() == "drained"
    assert not drain.folder.exists()  # removed once the server and its instances are gone


def test_the_last_instance_to_leave_an_orphaned_drain_folder_removes_it(tmp_path):
    folder = tmp_path / "lookahead-drain-x"
    folder.mkdir()
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (folder / f"{sibling.pid}.serving").touch()  # a sibling instance, still running
        (folder / "999999999.serving").touch()  # one that was killed without leaving
        watch = watch_drain(lambda: None, env={DRAIN_ENV: str(folder)})
        watch.leave()
        assert folder.is_dir() and not (folder / f"{os.getpid()}.serving").exists()
    finally:
        sibling.kill()
        sibling.wait()
    watch = watch_drain(lambda: None, env={DRAIN_ENV: str(folder)})
    watch.leave()  # the last one: nobody else registered is alive
    assert not folder.exists()


def test_an_instance_killed_while_serving_is_reported_once_with_its_model_and_region(tmp_path):
    drain = Drain(tmp_path)
    # A stand-in stub: tritonserver passes its shared-memory region as an argument.
    region = "/triton_python_backend_shm_region_test"
    script = "import sys, time; from backend.drain import watch_drain; "
    script += "watch_drain(lambda: None, model='lookahead', poll_s=0.02); print(flush=True); time.sleep(600)"
    killed = subprocess.Popen(
        [sys.executable, "-c", script, region],
        stdout=subprocess.PIPE,
        env={**os.environ, **drain.env, "PYTHONPATH": str(REPO_ROOT)},
    )
    finalized = watch_drain(lambda: None, env=drain.env, model="baseline")
    assert killed.stdout.readline()  # registered
    assert drain.dead() == []
    killed.kill()
    killed.wait()
    finalized.stop()  # an instance that finalizes unregisters: it did not die
    (tmp_path / "999999998.serving").touch()
    (tmp_path / "999999998.drained").touch()  # one that drained before it ended: a stop, not a death
    [dead] = drain.dead()
    assert (dead.pid, dead.model, dead.shm_region) == (killed.pid, "lookahead", region)
    assert drain.dead() == []


def test_restarts_are_counted_per_model_in_the_folder(tmp_path):
    drain = Drain(tmp_path)
    assert restart_count("lookahead", drain.env) == 0
    assert [drain.count_restart("lookahead"), drain.count_restart("lookahead")] == [1, 2]
    assert (restart_count("lookahead", drain.env), restart_count("baseline", drain.env)) == (2, 0)
    assert restart_count("lookahead", {}) == 0  # no launcher
