"""A launcher that dies, however it dies, leaves nothing behind; its stop fits STOP_TIMEOUT_S even
when a client holds its stream open; it notices its endpoint dying; two launchers racing for one
port never both claim it. Real processes: `python -m launcher`, tritonserver, its backend stubs and
the OpenAI endpoint."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from launcher import free_port
from launcher.tritonserver import STOP_TIMEOUT_S
from tests.helpers import write_toy_repository
from tests.integration.servers import READY_TIMEOUT_S, copy_repository
from tests.integration.test_server import GrpcStream, grpc_inputs, wait_for


def descendants(pid: int) -> set[int]:
    """The live processes below pid."""
    found, pending = set(), [pid]
    while pending:
        parent = pending.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = {int(child) for child in (task / "children").read_text().split()}
            except OSError:
                continue
            children = {child for child in children if alive(child)}
            pending.extend(children - found)
            found |= children
    return found


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def drain_folder(pid: int) -> Path | None:
    """The drain folder a process was given (tritonserver and its stubs)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [entry.split(b"=", 1)[1] for entry in environ if entry.startswith(b"LOOKAHEAD_DRAIN_DIR=")]
    return Path(found[0].decode()) if found else None


def running_with(text: str) -> list[int]:
    """Live processes whose command line holds text."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in command and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class Launcher:
    """`python -m launcher` on its own ports, its output in a file."""

    def __init__(
        self, repository: Path, folder: Path, ports: dict[str, int] | None = None, openai: bool = True
    ):
        self.ports = ports or {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
        if not openai:
            self.ports["openai"] = 0
        self.output = folder / f"launcher-{self.ports['http']}-{time.monotonic_ns()}.out"
        command = [sys.executable, "-m", "launcher", "--model-repository", str(repository)]
        command += ["--log-file", str(folder / f"server-{time.monotonic_ns()}.log")]
        for name, port in self.ports.items():
            command += [f"--{name}-port", str(port)]
        self.processes: set[int] = set()
        with open(self.output, "wb") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def wait_ready(self) -> bool:
        """True once it serves (its processes noted), False once it exited."""
        assert wait_for(
            lambda: "tritonserver ready" in self.text() or self.process.poll() is not None, READY_TIMEOUT_S
        )
        self.processes = descendants(self.process.pid)
        return self.process.poll() is None

    def kill_everything(self) -> None:
        """After a failed test: nothing of it may outlive the test (orphans included)."""
        for pid in descendants(self.process.pid) | self.processes | {self.process.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()


@pytest.fixture
def baseline(tmp_path: Path) -> Path:
    return copy_repository(tmp_path / "repository", tmp_path / "state", ("baseline",))


def test_a_sigkilled_launcher_takes_tritonserver_its_stubs_and_the_endpoint_with_it(baseline, tmp_path):
    launcher = Launcher(baseline, tmp_path)
    stream = None
    try:
        assert launcher.wait_ready(), launcher.text()[-3000:]
        processes = launcher.processes
        assert len(processes) >= 3, processes  # tritonserver, a backend stub, the endpoint
        stream = GrpcStream(SimpleNamespace(grpc_url=f"localhost:{launcher.ports['grpc']}"))
        options = {"max_tokens": 1024, "ignore_eos": True}
        stream.send("baseline", grpc_inputs("Write a long story.", sampling_parameters=options), "long")
        assert stream.responses.get(timeout=120)[1] is None  # streaming
        drains = {drain_folder(pid) for pid in processes} - {None}
        assert drains
        killed = time.monotonic()
        launcher.process.kill()  # as the OOM killer does: no handler runs
        launcher.process.wait()
        assert wait_for(lambda: not any(alive(pid) for pid in processes), 30), [
            p for p in processes if alive(p)
        ]
        print(f"every process gone {time.monotonic() - killed:.1f} s after the SIGKILL")
        assert all(port_free(port) for port in launcher.ports.values())
        assert wait_for(lambda: not any(folder.exists() for folder in drains), 10)  # the last stub removes it
    except BaseException:
        launcher.kill_everything()
        raise
    finally:
        if stream is not None:
            stream.close(cancel_requests=True)


def test_a_client_that_never_closes_its_stream_cannot_hold_the_stop_past_its_bound(tmp_path):
    # An open gRPC stream holds tritonserver until its exit timeout, whatever the model (the toy's).
    launcher = Launcher(write_toy_repository(tmp_path, tmp_path / "finalized"), tmp_path, openai=False)
    stream = None
    try:
        assert launcher.wait_ready(), launcher.text()[-3000:]
        processes = launcher.processes
        stream = GrpcStream(SimpleNamespace(grpc_url=f"localhost:{launcher.ports['grpc']}"))
        text = grpcclient.InferInput("text", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
        stream.send("toy", [text], "short")
        stream.collect()  # answered; the stream stays open, holding the model
        signalled = time.monotonic()
        launcher.process.send_signal(signal.SIGTERM)
        assert launcher.process.wait(timeout=STOP_TIMEOUT_S + 10) == 0, launcher.text()[-3000:]
        took = time.monotonic() - signalled
        print(f"the launcher stopped in {took:.1f} s with the stream still open")
        assert took < STOP_TIMEOUT_S + 2
        assert not any(alive(pid) for pid in processes)
    except BaseException:
        launcher.kill_everything()
        raise
    finally:
        if stream is not None:
            stream.close(cancel_requests=True)


def test_the_launcher_stops_everything_when_its_endpoint_dies(tmp_path):
    launcher = Launcher(write_toy_repository(tmp_path, tmp_path / "finalized"), tmp_path)
    try:
        assert launcher.wait_ready(), launcher.text()[-3000:]
        processes = launcher.processes
        [endpoint] = [pid for pid in processes if b"frontend" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(endpoint, signal.SIGKILL)
        assert launcher.process.wait(timeout=STOP_TIMEOUT_S + 10) != 0
        assert "the OpenAI endpoint exited" in launcher.text()
        assert not any(alive(pid) for pid in processes)
    except BaseException:
        launcher.kill_everything()
        raise


def test_two_launchers_racing_for_one_port_never_both_claim_it(tmp_path):
    repository = write_toy_repository(tmp_path, tmp_path / "finalized")
    first = Launcher(repository, tmp_path)
    # Distinct Triton ports, the same endpoint port, started together: both see it free.
    second = Launcher(
        repository,
        tmp_path,
        ports={**{n: free_port() for n in ("http", "grpc", "metrics")}, "openai": first.ports["openai"]},
    )
    launchers = [first, second]
    try:
        ready = [launcher.wait_ready() for launcher in launchers]
        assert ready.count(True) == 1, [launcher.text()[-2000:] for launcher in launchers]
        [winner] = [launcher for launcher, up in zip(launchers, ready) if up]
        [loser] = [launcher for launcher, up in zip(launchers, ready) if not up]
        assert loser.process.wait(timeout=60) != 0
        assert f"port {first.ports['openai']}" in loser.text(), loser.text()[-2000:]
        assert "tritonserver ready" not in loser.text()
        assert f"OpenAI http://localhost:{first.ports['openai']}/v1" in winner.text()
        assert wait_for(lambda: not running_with(f"--http-port={loser.ports['http']}"), 30)
        winner.process.send_signal(signal.SIGTERM)
        assert winner.process.wait(timeout=STOP_TIMEOUT_S + 10) == 0
    except BaseException:
        for launcher in launchers:
            launcher.kill_everything()
        raise
