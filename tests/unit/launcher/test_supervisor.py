"""The supervisor restarts the model of a dead instance through the keyed model-control API, removes
the region the stub left, counts the restart, and gives up after a bounded number of tries.
tritonserver's model-control API is played by a local HTTP server that records the calls."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from backend import drain as draining
from backend.drain import Drain, remove_region, restart_count
from launcher import supervisor as supervision
from launcher.supervisor import Supervisor, model_control_args
from lookahead.contract import ADMIN_KEY_HEADER
from tests.helpers import wait_until

KEY = "launcher-only"


class ModelControl:
    """Answers POST /v2/repository/models/<model>/<action>: 403 without the key, else the next of
    `load_statuses` for a load (200 once they run out), 200 for an unload."""

    def __init__(self, load_statuses: list[int]):
        self.calls: list[tuple[str, str | None]] = []
        self.load_statuses = load_statuses
        control = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                control.calls.append((self.path, self.headers.get(ADMIN_KEY_HEADER)))
                status = 200
                if self.headers.get(ADMIN_KEY_HEADER) != KEY:
                    status = 403
                elif self.path.endswith("/load") and control.load_statuses:
                    status = control.load_statuses.pop(0)
                body = json.dumps({} if status == 200 else {"error": "failed to load"}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def control_factory() -> Iterator:
    servers: list[ModelControl] = []

    def make(load_statuses: list[int]) -> ModelControl:
        servers.append(ModelControl(load_statuses))
        return servers[-1]

    yield make
    for control in servers:
        control.server.shutdown()


def test_the_model_control_api_is_restricted_to_the_key():
    assert model_control_args("k") == [
        "--model-control-mode=explicit",
        "--load-model=*",
        f"--http-restricted-api=model-repository:{ADMIN_KEY_HEADER}=k",
        f"--grpc-restricted-protocol=model-repository:{ADMIN_KEY_HEADER}=k",
    ]


def test_a_dead_stub_gets_its_model_unloaded_its_region_removed_and_its_model_loaded(
    tmp_path, control_factory, monkeypatch
):
    shm = tmp_path / "shm"
    shm.mkdir()
    region = shm / "triton_python_backend_shm_region_dead"
    region.write_bytes(b"\0" * 16)
    monkeypatch.setattr(draining, "SHM_FOLDER", shm)
    drain = Drain(tmp_path / "drain")
    drain.folder.mkdir()
    registration = {"model": "lookahead", "shm_region": f"/{region.name}"}
    (drain.folder / "999999997.serving").write_text(json.dumps(registration))  # no such process
    control = control_factory([])
    lines: list[str] = []
    supervisor = Supervisor(
        drain, f"127.0.0.1:{control.port}", KEY, load_timeout_s=10, log=lines.append
    ).start()
    try:
        assert wait_until(lambda: len(control.calls) == 2)
    finally:
        supervisor.stop()
    assert control.calls == [
        ("/v2/repository/models/lookahead/unload", KEY),
        ("/v2/repository/models/lookahead/load", KEY),
    ]
    assert not region.exists()
    assert restart_count("lookahead", drain.env) == 1
    assert "model lookahead serves again" in lines[-1], lines
    assert drain.dead() == []  # reported once


def test_loads_are_tried_a_bounded_number_of_times(tmp_path, control_factory, monkeypatch):
    monkeypatch.setattr(supervision, "BACKOFF_S", 0.01)
    drain = Drain(tmp_path)
    control = control_factory([500] * 10)
    lines: list[str] = []
    supervisor = Supervisor(drain, f"127.0.0.1:{control.port}", KEY, load_timeout_s=10, log=lines.append)
    assert not supervisor.restart("lookahead", [999999997], [""])
    loads = [path for path, _ in control.calls if path.endswith("/load")]
    assert len(loads) == supervision.TRIES
    assert "stays unloaded after 3 tries" in lines[-1], lines


def test_a_wrong_key_is_refused_by_the_api_it_restricts(tmp_path, control_factory, monkeypatch):
    monkeypatch.setattr(supervision, "BACKOFF_S", 0.01)
    control = control_factory([])
    supervisor = Supervisor(
        Drain(tmp_path), f"127.0.0.1:{control.port}", "not-the-key", 10, log=lambda line: None
    )
    assert not supervisor.restart("lookahead", [1], [""])
    assert {key for _, key in control.calls} == {"not-the-key"}


def test_only_triton_regions_are_removed(tmp_path):
    other, region = tmp_path / "someone-elses", tmp_path / "triton_python_backend_shm_region_x"
    other.write_text("x")
    region.write_text("x")
    remove_region("/someone-elses", tmp_path)
    remove_region("/triton_python_backend_shm_region_x", tmp_path)
    assert other.exists() and not region.exists()


def test_a_tritonserver_ended_by_a_signal_is_started_again_a_bounded_number_of_times_an_hour(capsys):
    from launcher.cli import CRASH_RESTARTS, CRASH_WINDOW_S, restart_after_crash

    crashes: list[float] = []
    assert not restart_after_crash(0, crashes, now=10.0)  # it stopped as asked
    assert not restart_after_crash(2, crashes, now=10.0)  # it refused to start: a bad argument, a port
    assert crashes == []
    assert [restart_after_crash(-6, crashes, now=100.0 + t) for t in range(CRASH_RESTARTS + 1)] == [
        *[True] * CRASH_RESTARTS,
        False,
    ]
    err = capsys.readouterr().err
    assert err.count("tritonserver ended by SIGABRT; starting it again") == CRASH_RESTARTS
    assert f"{CRASH_RESTARTS + 1} crashes within {CRASH_WINDOW_S:g} s; stopping" in err
    assert restart_after_crash(-9, crashes, now=100.0 + CRASH_WINDOW_S)  # the first crash has aged out
    assert "ended by SIGKILL" in capsys.readouterr().err
