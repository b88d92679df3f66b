"""The launcher against a real tritonserver serving a toy decoupled model."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from launcher import TritonServerError, free_port, start_server
from launcher.tritonserver import REPO_ROOT
from tests.helpers import stream_once, write_toy_repository


def test_server_streams_from_a_decoupled_model_and_finalizes_on_stop(tmp_path: Path) -> None:
    marker = tmp_path / "finalized"
    repository = write_toy_repository(tmp_path, marker)
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    with start_server(repository, log_file=tmp_path / "server.log", ready_timeout_s=120, **ports) as server:
        assert server.is_ready()
        assert stream_once(server.grpc_url, "hello") == ["hello", "from", str(REPO_ROOT)]
        assert not marker.exists()
    assert server.process.returncode == 0
    assert marker.read_text() == "finalized"
    assert not server.is_ready()


def test_a_model_that_fails_to_load_is_reported_with_the_log_tail(tmp_path: Path) -> None:
    repository = write_toy_repository(tmp_path, tmp_path / "marker", 'raise ValueError("toy failure")')
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    with pytest.raises(TritonServerError, match=r"(?s)exited with code \d+ before it was ready.*toy failure"):
        start_server(repository, log_file=tmp_path / "server.log", ready_timeout_s=120, **ports)


def test_the_launcher_serves_the_openai_endpoint_beside_tritonserver_and_stops_both(tmp_path: Path) -> None:
    repository = write_toy_repository(tmp_path, tmp_path / "finalized")
    openai_port = free_port()
    command = [sys.executable, "-m", "launcher", "--model-repository", str(repository)]
    command += ["--log-file", str(tmp_path / "server.log"), "--openai-port", str(openai_port)]
    for flag in ("--http-port", "--grpc-port", "--metrics-port"):
        command += [flag, str(free_port())]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in process.stdout:
            if "tritonserver ready" in line or process.poll() is not None:
                break
        assert f"OpenAI http://localhost:{openai_port}/v1" in line
        with urllib.request.urlopen(f"http://localhost:{openai_port}/v1/models", timeout=30) as reply:
            assert [model["id"] for model in json.load(reply)["data"]] == ["toy"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert (tmp_path / "finalized").read_text() == "finalized"
    with pytest.raises(OSError):  # the endpoint stopped with the server
        urllib.request.urlopen(f"http://localhost:{openai_port}/health", timeout=5)
