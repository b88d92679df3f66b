"""SIGTERM to `python -m launcher` (as scripts/serve.sh runs it) while a long stream runs:
the stream gets a final response at once, the trie snapshot is written after the signal, and no
process of the server is left once the launcher exits, within tritonserver's exit timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from launcher import free_port
from lookahead.algorithm.trie import NO_NODE
from lookahead.state.persistence import MAGIC, load_trie
from tests.integration.servers import READY_TIMEOUT_S, copy_repository, set_parameter
from tests.integration.test_server import GrpcStream, grpc_inputs, wait_for

EXIT_TIMEOUT_S = 30.0  # tritonserver's default --exit-timeout-secs


def server_processes(repository: Path) -> dict[int, str]:
    """Live processes whose command line names the repository: the launcher, tritonserver, stubs."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(repository) in command and state != "Z":
            found[int(entry.name)] = command
    return found


def test_sigterm_to_the_launcher_mid_stream_answers_saves_and_leaves_no_process(tmp_path, default_model):
    state = tmp_path / "state"
    repository = copy_repository(tmp_path / "repository", state, ("lookahead",))
    config = repository / "lookahead" / "config.pbtxt"
    config.write_text(set_parameter(config.read_text(), "snapshot_interval_s", "0"))  # saved at stop only
    grpc_port = free_port()
    command = [sys.executable, "-m", "launcher", "--model-repository", str(repository)]
    command += ["--log-file", str(tmp_path / "server.log"), "--grpc-port", str(grpc_port)]
    command += ["--http-port", str(free_port()), "--metrics-port", str(free_port())]
    output = tmp_path / "launcher.out"
    with open(output, "wb") as out:
        launcher = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    stream = None
    try:
        ready = wait_for(
            lambda: "tritonserver ready" in output.read_text() or launcher.poll() is not None, READY_TIMEOUT_S
        )
        assert ready and launcher.poll() is None, output.read_text()[-3000:]
        processes = server_processes(repository)
        assert any("triton_python_backend_stub" in c for c in processes.values()), processes
        assert any("tritonserver" in c for c in processes.values()), processes

        stream = GrpcStream(SimpleNamespace(grpc_url=f"localhost:{grpc_port}"))
        options = {"max_tokens": 1024, "ignore_eos": True}
        stream.send("lookahead", grpc_inputs("Write a long story.", sampling_parameters=options), "long")
        text = ""
        while len(default_model.tokenizer.encode(text)) < 24:  # a few n-grams for the trie to learn
            result, error = stream.responses.get(timeout=120)
            assert error is None, error
            text += result.as_numpy("text_output")[0].decode()
        signalled, signalled_ns = time.monotonic(), time.time_ns()
        launcher.send_signal(signal.SIGTERM)

        while True:  # (a) the stream's final response: the error that says why
            result, error = stream.responses.get(timeout=EXIT_TIMEOUT_S)
            if error is not None:
                assert "the server is shutting down" in str(error), (error, error.status())
                break
            assert not result.get_response().parameters["triton_final_response"].bool_param
            text += result.as_numpy("text_output")[0].decode()
        assert time.monotonic() - signalled < 10
        stream.close()  # Triton's gRPC stream holds the model (it cannot unload) until it closes
        stream = None
        assert launcher.wait(timeout=EXIT_TIMEOUT_S) == 0
        assert time.monotonic() - signalled < EXIT_TIMEOUT_S
    except BaseException:  # a failed run leaves no server behind
        for pid in server_processes(repository):
            os.kill(pid, signal.SIGKILL)
        raise
    finally:
        if stream is not None:
            stream.close()
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()

    # (c) no process of the server is left
    assert not server_processes(repository)
    assert not any(_alive(pid) for pid in processes)
    log = (tmp_path / "server.log").read_text(errors="replace")
    for failure in ("Exit timeout expired", "Signal (6)", "Signal (11)"):
        assert failure not in log, log[-3000:]

    # (b) the snapshot was written after the signal and holds what the stream taught the trie
    snapshot = state / "lookahead_0_0.trie"
    assert snapshot.stat().st_mtime_ns >= signalled_ns
    assert snapshot.read_bytes().startswith(MAGIC)
    trie = load_trie(snapshot, capacity=1_000_000, max_depth=16, fingerprint=default_model.fingerprint)
    assert trie.node_count > 0
    ids = default_model.tokenizer.encode(text)[2:-2]  # the ends may tokenize apart from the stream's
    learned = [ids[i : i + 4] for i in range(len(ids) - 3) if trie.match(ids[i : i + 4]) != NO_NODE]
    assert len(learned) >= (len(ids) - 3) // 2, (len(learned), len(ids))


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
