"""A launcher that dies, however it dies, leaves nothing behind; a model whose backend stub dies ends
its streams and comes back; a tritonserver that aborts is started again; its stop fits
STOP_TIMEOUT_S even when a client holds its stream open; it notices its endpoint dying; two
launchers racing for one port never both claim it. Real processes: `python -m launcher`,
tritonserver, its backend stubs and the OpenAI endpoint."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest

from backend.drain import SHM_PREFIX
from launcher import free_port
from launcher.tritonserver import STOP_TIMEOUT_S
from lookahead.contract import ADMIN_KEY_HEADER
from tests.helpers import write_toy_repository
from tests.integration.servers import READY_TIMEOUT_S, copy_repository, set_parameter
from tests.integration.test_server import GrpcStream, grpc_inputs, wait_for

GONE_S = 5.0  # every process of a SIGKILLed launcher is gone within it, whatever its stubs were doing
STREAM_END_S = 5.0  # a stream in flight on a model whose stub died ends within it
BACK_S = 60.0  # and the model serves again within it


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


def shm_region(pid: int) -> str:
    """The shared-memory region a backend stub was started with."""
    arguments = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    [region] = [os.path.basename(a) for a in arguments if SHM_PREFIX in a]
    return region


def stubs_of(processes: set[int], model: str) -> list[int]:
    """The backend stubs among processes that serve an instance of model."""
    found = []
    for pid in processes:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"triton_python_backend_stub" in command and f"{model}_0_0".encode() in command:
            found.append(pid)
    return found


def http(url: str, data: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, dict, str]:
    request = urllib.request.Request(url, data=data, headers=headers or {}, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, dict(reply.headers), reply.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode(errors="replace")
    except OSError as error:
        return 0, {}, str(error)


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

    def stop_cleanly(self) -> None:
        """SIGTERM: it exits with 0 within its stop's bound, and nothing it started outlives it."""
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=STOP_TIMEOUT_S + 10) == 0, self.text()[-3000:]
        assert not any(alive(pid) for pid in descendants(self.process.pid) | self.processes)

    def kill_everything(self) -> None:
        """After a failed test: nothing of it may outlive the test (orphans included)."""
        for pid in descendants(self.process.pid) | self.processes | {self.process.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:  # a failed test: nothing of it may outlive it
            self.kill_everything()


@contextmanager
def grpc_stream(launcher: Launcher) -> Iterator[GrpcStream]:
    """A gRPC stream to the launcher's tritonserver, closed (its requests cancelled) at the end."""
    stream = GrpcStream(SimpleNamespace(grpc_url=f"localhost:{launcher.ports['grpc']}"))
    try:
        yield stream
    finally:
        stream.close(cancel_requests=True)


def endpoint_client(launcher: Launcher) -> openai.OpenAI:
    """The `openai` SDK on the launcher's endpoint, without its retries (the tests count statuses)."""
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{launcher.ports['openai']}/v1", api_key="none", max_retries=0, timeout=300
    )


UPSTREAM_ABORT = "boost::interprocess::lock_exception"  # tritonserver 2.51, a stub killed mid-IPC


def started_again(launcher: Launcher, client: openai.OpenAI, prompt: list[dict[str, str]]) -> str:
    """After tritonserver aborted: the launcher started it again on the same ports, the lookahead
    model's trie loaded warm, and the endpoint, which stayed up, answers through it (its gRPC
    channel reconnects; errors meanwhile). The answer's text."""
    assert wait_for(
        lambda: "tritonserver ready again" in launcher.text() or launcher.process.poll() is not None,
        READY_TIMEOUT_S,
    )
    assert launcher.process.poll() is None, launcher.text()[-3000:]
    assert "error: tritonserver ended by SIGABRT; starting it again" in launcher.text()
    loads = re.findall(r"Trie for lookahead_0_0: \S+ \((\d+) nodes\)", launcher.text())
    assert len(loads) >= 2 and int(loads[-1]) > 0, loads  # warm from its snapshot
    failures = []
    while True:
        try:
            answer = client.chat.completions.create(model="lookahead", messages=prompt, max_tokens=12)
            return answer.choices[0].message.content
        except openai.APIError as error:
            failures.append(getattr(error, "status_code", type(error).__name__))
            assert len(failures) < 20, failures
            time.sleep(0.5)


@pytest.fixture
def baseline(tmp_path: Path) -> Path:
    return copy_repository(tmp_path / "repository", tmp_path / "state", ("baseline",))


@pytest.fixture
def shipped(tmp_path: Path) -> Path:
    """The shipped repository, its lookahead model saving its trie every second, on transformers'
    layers (what a crash does is the same on every execution path, and they need no kernel build)."""
    repository = copy_repository(tmp_path / "repository", tmp_path / "state", ("lookahead", "baseline"))
    for model in ("lookahead", "baseline"):
        config = repository / model / "config.pbtxt"
        config.write_text(set_parameter(config.read_text(), "linear_kernel", "stock"))
    config = repository / "lookahead" / "config.pbtxt"
    config.write_text(set_parameter(config.read_text(), "snapshot_interval_s", "1"))
    return repository


def test_a_sigkilled_launcher_leaves_nothing_within_5_s_while_a_stub_with_a_trie_decodes(shipped, tmp_path):
    with Launcher(shipped, tmp_path) as launcher:
        assert launcher.wait_ready(), launcher.text()[-3000:]
        processes = launcher.processes
        stubs = stubs_of(processes, "lookahead") + stubs_of(processes, "baseline")
        assert len(stubs) == 2, processes
        regions = [shm_region(pid) for pid in stubs]
        with grpc_stream(launcher) as stream:
            stream.send("lookahead", grpc_inputs("Hi", sampling_parameters={"max_tokens": 8}), "short")
            stream.collect()  # the trie learned it, and the snapshot is saved within a second
            options = {"max_tokens": 4096, "ignore_eos": True}
            stream.send("lookahead", grpc_inputs("Write a long story.", sampling_parameters=options), "long")
            assert stream.responses.get(timeout=120)[1] is None  # decoding
            drains = {drain_folder(pid) for pid in processes} - {None}
            killed = time.monotonic()
            launcher.process.kill()  # as the OOM killer does: no handler runs
            launcher.process.wait()
            wait_for(lambda: not any(alive(pid) for pid in processes), 30)
            took = time.monotonic() - killed
            print(f"every process gone {took:.1f} s after the SIGKILL")
            assert not [pid for pid in processes if alive(pid)]
            assert took < GONE_S
            assert all(port_free(port) for port in launcher.ports.values())
            assert not any(folder.exists() for folder in drains)
            assert not [region for region in regions if (Path("/dev/shm") / region).exists()]


def test_a_model_whose_stub_is_sigkilled_under_load_ends_its_streams_and_comes_back_warm(shipped, tmp_path):
    with Launcher(shipped, tmp_path) as launcher:
        triton = f"http://127.0.0.1:{launcher.ports['http']}"
        assert launcher.wait_ready(), launcher.text()[-3000:]
        processes = launcher.processes
        [stub] = stubs_of(processes, "lookahead")
        region = shm_region(stub)
        # Clients may not load or unload models: only the launcher holds the key.
        assert http(f"{triton}/v2/repository/models/lookahead/unload", b"{}")[0] != 200
        bad_key = {ADMIN_KEY_HEADER: "guess"}
        assert http(f"{triton}/v2/repository/models/lookahead/unload", b"{}", bad_key)[0] != 200
        client = endpoint_client(launcher)
        prompt = [{"role": "user", "content": "Write a long story."}]
        taught = client.chat.completions.create(model="lookahead", messages=prompt, max_tokens=16)
        assert taught.choices[0].message.content
        time.sleep(2)  # the trie's snapshot (every second)
        # In flight: a Triton gRPC stream and an OpenAI stream, both decoding.
        with grpc_stream(launcher) as stream:
            options = {"max_tokens": 4096, "ignore_eos": True}
            stream.send("lookahead", grpc_inputs("Write a long story.", sampling_parameters=options), "long")
            assert stream.responses.get(timeout=120)[1] is None
            openai_events: queue.Queue = queue.Queue()

            def read_openai_stream() -> None:
                try:
                    chunks = client.chat.completions.create(
                        model="lookahead",
                        messages=prompt,
                        max_tokens=4096,
                        stream=True,
                        extra_body={"ignore_eos": True},
                    )
                    for _ in chunks:
                        openai_events.put(("chunk", time.monotonic()))
                    openai_events.put(("end", time.monotonic()))
                except openai.APIError as error:
                    openai_events.put((f"error: {error}", time.monotonic()))

            threading.Thread(target=read_openai_stream, daemon=True).start()
            assert openai_events.get(timeout=120)[0] == "chunk"

            os.kill(stub, signal.SIGKILL)  # as the OOM killer does
            killed = time.monotonic()
            try:  # the model's own restart
                # The OpenAI stream ends with an error event; the Triton stream with an error response.
                while (event := openai_events.get(timeout=30))[0] == "chunk":
                    pass
                print(f"the OpenAI stream ended {event[1] - killed:.1f} s after the SIGKILL: {event[0]}")
                assert event[0].startswith("error:") and "restarting" in event[0], event
                assert event[1] - killed < STREAM_END_S

                # Meanwhile: 503 with Retry-After, and readiness says not ready.
                statuses = []
                readiness: list[tuple[int, float]] = []  # (Triton's model readiness, when) after each 503
                while len(statuses) < 3 or statuses[-1][0] != 200:
                    try:
                        client.chat.completions.create(model="lookahead", messages=prompt, max_tokens=4)
                        statuses.append((200, None, time.monotonic() - killed))
                    except openai.APIStatusError as error:
                        statuses.append(
                            (
                                error.status_code,
                                error.response.headers.get("retry-after"),
                                time.monotonic() - killed,
                            )
                        )
                        assert (
                            error.status_code == 503 and error.response.headers.get("retry-after") == "1"
                        ), statuses
                        readiness.append((http(f"{triton}/v2/models/lookahead/ready")[0], statuses[-1][2]))
                        time.sleep(0.5)
                    assert time.monotonic() - killed < BACK_S, statuses
                # At once Triton still says ready; and the model may turn ready between the last 503 and
                # its probe. Between the two, Triton agrees that it is not ready.
                assert all(ready != 200 or at < 1 for ready, at in readiness[:-1]), (statuses, readiness)
                back = time.monotonic() - killed
                meanwhile = statuses[:-1]
                print(
                    f"the model served again {back:.1f} s after the SIGKILL; requests meanwhile: {meanwhile}"
                )
                assert meanwhile and [status for status, _, _ in meanwhile] == [503] * len(meanwhile)
                # A raw Triton stream held by the dead stub gets no final response (documented): reported.
                triton_end = None
                while time.monotonic() < killed + 30 and triton_end is None:
                    try:
                        result, error = stream.responses.get(timeout=1)
                    except queue.Empty:
                        continue
                    if (
                        error is not None
                        or result.get_response().parameters["triton_final_response"].bool_param
                    ):
                        triton_end = (time.monotonic() - killed, error)
                print(f"the Triton stream: {triton_end}")
                assert http(f"{triton}/v2/models/lookahead/ready")[0] == 200

                # Warm from its snapshot; the restart counted; nothing of the dead stub left.
                loads = re.findall(r"Trie for lookahead_0_0: \S+ \((\d+) nodes\)", launcher.text())
                assert len(loads) == 2 and int(loads[1]) > 0, loads
                metrics = http(f"http://127.0.0.1:{launcher.ports['metrics']}/metrics")[2]
                assert re.search(
                    r'lookahead_model_restarts_total\{[^}]*model="lookahead"[^}]*\} 1\b', metrics
                ), [line for line in metrics.splitlines() if "restarts" in line]
                assert not (Path("/dev/shm") / region).exists()
                assert len(stubs_of(descendants(launcher.process.pid), "lookahead")) == 1

            except (AssertionError, openai.APIError, queue.Empty):
                if UPSTREAM_ABORT not in launcher.text():
                    raise
                # tritonserver itself aborted on the dead stub's lock: the launcher's restart instead.
                print("tritonserver aborted (upstream lock_exception); checking that it was started again")
                assert started_again(launcher, client, prompt)
            launcher.stop_cleanly()


def test_a_tritonserver_that_aborts_is_started_again_and_the_endpoint_serves_through_it(shipped, tmp_path):
    """An abort in native code (SIGABRT, as an upstream lock error raises) ends tritonserver and its
    stubs; the launcher starts it again on the same ports, the models warm from their snapshots,
    and the OpenAI endpoint, which stayed up, answers through the new server."""
    with Launcher(shipped, tmp_path) as launcher:
        assert launcher.wait_ready(), launcher.text()[-3000:]
        processes = launcher.processes
        [server] = [
            pid for pid in processes if Path(f"/proc/{pid}/comm").read_text().strip() == "tritonserver"
        ]
        [endpoint] = [pid for pid in processes if b"frontend" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        stubs = stubs_of(processes, "lookahead") + stubs_of(processes, "baseline")
        regions = [shm_region(pid) for pid in stubs]
        client = endpoint_client(launcher)
        prompt = [{"role": "user", "content": "Name three colours."}]
        before = client.chat.completions.create(model="lookahead", messages=prompt, max_tokens=12)
        time.sleep(2)  # the trie's snapshot (every second)

        os.kill(server, signal.SIGABRT)
        assert started_again(launcher, client, prompt) == before.choices[0].message.content
        assert len(re.findall(r"Trie for lookahead_0_0: ", launcher.text())) == 2
        assert not alive(server) and not any(alive(pid) for pid in stubs) and alive(endpoint)
        assert not [region for region in regions if (Path("/dev/shm") / region).exists()]

        launcher.stop_cleanly()


def test_a_sigkilled_launcher_takes_tritonserver_its_stubs_and_the_endpoint_with_it(baseline, tmp_path):
    with Launcher(baseline, tmp_path) as launcher:
        assert launcher.wait_ready(), launcher.text()[-3000:]
        processes = launcher.processes
        assert len(processes) >= 3, processes  # tritonserver, a backend stub, the endpoint
        with grpc_stream(launcher) as stream:
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
            assert wait_for(
                lambda: not any(folder.exists() for folder in drains), 10
            )  # the last stub removes it


def test_a_client_that_never_closes_its_stream_cannot_hold_the_stop_past_its_bound(baseline, tmp_path):
    with Launcher(baseline, tmp_path, openai=False) as launcher:
        assert launcher.wait_ready(), launcher.text()[-3000:]
        processes = launcher.processes
        with grpc_stream(launcher) as stream:
            stream.send("baseline", grpc_inputs("Hi", sampling_parameters={"max_tokens": 2}), "short")
            stream.collect()  # answered; the stream stays open, holding the model
            signalled = time.monotonic()
            launcher.process.send_signal(signal.SIGTERM)
            assert launcher.process.wait(timeout=STOP_TIMEOUT_S + 10) == 0, launcher.text()[-3000:]
            took = time.monotonic() - signalled
            print(f"the launcher stopped in {took:.1f} s with the stream still open")
            assert took < STOP_TIMEOUT_S + 2
            assert not any(alive(pid) for pid in processes)


def test_the_launcher_stops_everything_when_its_endpoint_dies(tmp_path):
    with Launcher(write_toy_repository(tmp_path, tmp_path / "finalized"), tmp_path) as launcher:
        assert launcher.wait_ready(), launcher.text()[-3000:]
        processes = launcher.processes
        [endpoint] = [pid for pid in processes if b"frontend" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(endpoint, signal.SIGKILL)
        assert launcher.process.wait(timeout=STOP_TIMEOUT_S + 10) != 0
        assert "the OpenAI endpoint exited" in launcher.text()
        assert not any(alive(pid) for pid in processes)


def test_two_launchers_racing_for_one_port_never_both_claim_it(tmp_path):
    repository = write_toy_repository(tmp_path, tmp_path / "finalized")
    openai_port = free_port()
    # Distinct Triton ports, the same endpoint port, started together: both see it free.
    ports = [
        {**{n: free_port() for n in ("http", "grpc", "metrics")}, "openai": openai_port} for _ in range(2)
    ]
    with (
        Launcher(repository, tmp_path, ports[0]) as first,
        Launcher(repository, tmp_path, ports[1]) as second,
    ):
        launchers = [first, second]
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
