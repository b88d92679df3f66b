"""A real tritonserver unloading the model: on SIGTERM mid-stream, and reloaded again and again."""

from __future__ import annotations

import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import tritonclient.grpc as grpcclient

from backend.launcher import TritonServer, free_port, start_server
from lookahead.state.persistence import MAGIC
from tests.integration.servers import READY_TIMEOUT_S, copy_repository, set_parameter
from tests.integration.test_server import GrpcStream, generate, grpc_inputs, wait_for

EXIT_TIMEOUT_S = 30  # tritonserver's default --exit-timeout-secs
PROMPT = "def fibonacci(n):"


def descendants(pid: int) -> set[int]:
    """Every live process below pid."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def launch_with(repository: Path, log: Path, *args: str) -> TritonServer:
    return start_server(
        repository,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        log_file=log,
        extra_args=args,
        ready_timeout_s=READY_TIMEOUT_S,
    )


def test_sigterm_mid_stream_ends_the_stream_saves_the_trie_and_leaves_no_process(tmp_path):
    state = tmp_path / "state"
    repository = copy_repository(tmp_path / "repository", state, ("lookahead",))
    config = repository / "lookahead" / "config.pbtxt"
    config.write_text(set_parameter(config.read_text(), "snapshot_interval_s", "0"))  # saved at unload only
    server = launch_with(repository, tmp_path / "server.log")
    stream = GrpcStream(server)
    try:
        options = {"max_tokens": 1024, "ignore_eos": True}
        stream.send("lookahead", grpc_inputs("Write a long story.", sampling_parameters=options), "long")
        first, error = stream.responses.get(timeout=120)
        assert error is None and first.as_numpy("text_output")[0]
        processes = descendants(server.process.pid)
        assert processes, "no backend stub below tritonserver"
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        while True:  # the stream ends with a final response: an error saying the model unloads
            result, error = stream.responses.get(timeout=EXIT_TIMEOUT_S)
            if error is not None:
                assert "the model is being unloaded" in str(error)
                break
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        assert time.monotonic() - signalled < 10
        server.process.wait(EXIT_TIMEOUT_S + 10)
        assert wait_for(lambda: not any(alive(pid) for pid in processes), timeout_s=10), [
            pid for pid in processes if alive(pid)
        ]
    finally:
        stream.close()
        server.stop()
    log = server.log_file.read_text(errors="replace")
    assert "Exit timeout expired" not in log
    snapshot = state / "lookahead_0_0.trie"
    saved = re.search(rf"Saved {re.escape(str(snapshot))} \((\d+) trie nodes\)", log)
    assert saved and int(saved.group(1)) > 0, log[-3000:]  # the prompt and the streamed tokens
    assert snapshot.read_bytes().startswith(MAGIC)


RELOADS = 10


def test_ten_reloads_idle_and_ten_under_load_with_metrics_on_keep_the_answers(tmp_path):
    """Reloading `lookahead` (metrics on, the default) used to free the new instance's metric series."""
    repository = copy_repository(tmp_path / "repository", tmp_path / "state", ("lookahead",))
    assert (
        '"REPORT_CUSTOM_METRICS", value: { string_value: "true" }'
        in (repository / "lookahead" / "config.pbtxt").read_text()
    )
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 16}}
    server = launch_with(
        repository, tmp_path / "server.log", "--model-control-mode=explicit", "--load-model=lookahead"
    )
    client = grpcclient.InferenceServerClient(server.grpc_url)
    failures: list[str] = []
    stop_load = threading.Event()

    def load() -> None:  # streams one request after another; each must end, well or UNAVAILABLE
        while not stop_load.is_set():
            stream = GrpcStream(server)
            try:
                options = {"max_tokens": 24, "ignore_eos": True}
                stream.send("lookahead", grpc_inputs("Count to ten:", sampling_parameters=options), "load")
                stream.collect(timeout_s=120)
            except Exception as error:
                if "UNAVAILABLE" not in str(error).upper():
                    failures.append(repr(error))
            finally:
                stream.close()

    try:
        expected = generate(server, "lookahead", body)["text_output"]
        for _ in range(RELOADS):
            client.load_model("lookahead")
            assert generate(server, "lookahead", body)["text_output"] == expected
        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        for _ in range(RELOADS):
            client.load_model("lookahead")
            assert generate(server, "lookahead", body)["text_output"] == expected
            assert server.process.poll() is None
        stop_load.set()
        loader.join(180)
        assert not failures, failures
        assert wait_for(lambda: "lookahead_e2e_request_latency_seconds_count" in metrics_text(server))
    finally:
        stop_load.set()
        client.close()
        code = server.stop()
    log = server.log_file.read_text(errors="replace")
    assert "Signal (11)" not in log and "Signal (6)" not in log and "tcache" not in log
    assert code == 0, log[-3000:]


def metrics_text(server: TritonServer) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        return reply.read().decode()
