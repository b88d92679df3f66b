"""A real tritonserver in explicit model control: the model reloaded again and again, then
unloaded mid-stream."""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from launcher import TritonServer
from lookahead.state.persistence import MAGIC
from tests.integration.servers import copy_repository, launch, set_parameter
from tests.integration.test_server import GrpcStream, generate, grpc_inputs, wait_for

PROMPT = "def fibonacci(n):"
RELOADS = 10


@pytest.fixture(scope="module")
def explicit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TritonServer, Path, Path]]:
    """`lookahead` (metrics on, snapshots only at unload) under --model-control-mode=explicit."""
    root = tmp_path_factory.mktemp("explicit")
    state = root / "state"
    repository = copy_repository(root / "repository", state, ("lookahead",))
    config = repository / "lookahead" / "config.pbtxt"
    text = set_parameter(config.read_text(), "snapshot_interval_s", "0")
    assert '"REPORT_CUSTOM_METRICS", value: { string_value: "true" }' in text
    config.write_text(text)
    server = launch(
        repository,
        root / "server.log",
        extra_args=("--model-control-mode=explicit", "--load-model=lookahead"),
    )
    with server:
        yield server, state, config


def reload(client: grpcclient.InferenceServerClient, config: Path) -> None:
    """Load the model again: Triton starts new instances only when the version folder changed."""
    os.utime(config.parent / "1" / "model.py", ns=(time.time_ns(), time.time_ns()))
    client.load_model("lookahead")


def stub_pids(server: TritonServer) -> set[int]:
    """The live processes whose parent is the server (its backend stubs)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == server.process.pid and fields[0] != "Z":
                pids.add(int(entry.name))
    return pids


def metrics_text(server: TritonServer) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        return reply.read().decode()


def test_ten_reloads_idle_and_ten_under_load_with_metrics_on_keep_the_answers(explicit):
    """A reload's old instance used to free the Prometheus series the new one writes to."""
    server, _, config = explicit
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 16}}
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
            reload(client, config)
            assert generate(server, "lookahead", body)["text_output"] == expected
        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        for _ in range(RELOADS):
            reload(client, config)
            assert generate(server, "lookahead", body)["text_output"] == expected
            assert server.process.poll() is None
        stop_load.set()
        loader.join(180)
        assert not failures, failures
    finally:
        stop_load.set()
        client.close()
    assert wait_for(lambda: "lookahead_e2e_request_latency_seconds_count{" in metrics_text(server))
    unloads = "successfully unloaded 'lookahead' version 1"
    assert wait_for(lambda: server.log_file.read_text(errors="replace").count(unloads) == 2 * RELOADS)
    log = server.log_file.read_text(errors="replace")
    assert "Signal (11)" not in log and "Signal (6)" not in log and "tcache" not in log


def test_unloading_mid_stream_ends_the_stream_saves_the_trie_and_ends_the_stub(explicit):
    server, state, _ = explicit
    stubs = stub_pids(server)
    assert len(stubs) == 1, stubs
    stream = GrpcStream(server)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        options = {"max_tokens": 1024, "ignore_eos": True}
        stream.send("lookahead", grpc_inputs("Write a long story.", sampling_parameters=options), "long")
        first, error = stream.responses.get(timeout=120)
        assert error is None and first.as_numpy("text_output")[0]
        asked = time.monotonic()
        threading.Thread(target=client.unload_model, args=("lookahead",), daemon=True).start()
        while True:
            result, error = stream.responses.get(timeout=60)
            if error is not None:
                assert "the model is being unloaded" in str(error)
                break
            assert not result.get_response().parameters["triton_final_response"].bool_param
        assert time.monotonic() - asked < 15
    finally:
        stream.close()  # Triton's gRPC stream holds the model until it closes
        client.close()
    assert wait_for(lambda: not (stubs & stub_pids(server)), timeout_s=60), "the stub outlived the unload"
    snapshot = state / "lookahead_0_0.trie"
    log = server.log_file.read_text(errors="replace")
    saved = re.search(rf"Saved {re.escape(str(snapshot))} \((\d+) trie nodes\)", log)
    assert saved and int(saved.group(1)) > 0, log[-3000:]  # the prompt and the streamed tokens
    assert snapshot.read_bytes().startswith(MAGIC)
