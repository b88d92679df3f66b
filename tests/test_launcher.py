"""The launcher: backend directory assembly, and a real tritonserver serving a toy decoupled model."""

from __future__ import annotations

import queue
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from backend import launcher
from backend.launcher import TritonServerError, assemble_backend_directory, free_port, start_server

TOY_CONFIG = """
name: "toy"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
parameters { key: "finalize_marker" value: { string_value: "%s" } }
"""

# Streams three responses per request. Importing numpy and backend.launcher checks that the stub
# sees this virtual environment and the repository root; finalize() leaves a marker on disk.
TOY_MODEL = """
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.launcher import REPO_ROOT


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        self.marker = Path(parameters["finalize_marker"]["string_value"])
        %s

    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text").as_numpy()[0].decode()
            sender = request.get_response_sender()
            for part in (text, "from", str(REPO_ROOT)):
                output = pb_utils.Tensor("text_output", np.array([part.encode()], dtype=np.object_))
                sender.send(pb_utils.InferenceResponse(output_tensors=[output]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self):
        self.marker.write_text("finalized")
"""


def write_toy_repository(root: Path, marker: Path, initialize_extra: str = "pass") -> Path:
    model_dir = root / "models" / "toy"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(TOY_CONFIG % marker)
    (model_dir / "1" / "model.py").write_text(TOY_MODEL % initialize_extra)
    return root / "models"


def stream_once(grpc_url: str, text: str) -> list[str]:
    """Send one request on a gRPC stream and collect every response until the final flag."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    text_input = grpcclient.InferInput("text", [1], "BYTES")
    text_input.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    client.async_stream_infer("toy", [text_input], enable_empty_final_response=True)
    parts: list[str] = []
    while True:
        result, error = responses.get(timeout=30)
        assert error is None, error
        output = result.as_numpy("text_output")
        if output is not None:
            parts.append(output[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return parts


@pytest.mark.integration
def test_server_streams_from_a_decoupled_model_and_finalizes_on_stop(tmp_path: Path) -> None:
    marker = tmp_path / "finalized"
    repository = write_toy_repository(tmp_path, marker)
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    with start_server(repository, log_file=tmp_path / "server.log", ready_timeout_s=120, **ports) as server:
        assert server.is_ready()
        assert stream_once(server.grpc_url, "hello") == ["hello", "from", str(launcher.REPO_ROOT)]
        assert not marker.exists()
    assert server.process.returncode == 0
    assert marker.read_text() == "finalized"
    assert not server.is_ready()


@pytest.mark.integration
def test_a_model_that_fails_to_load_is_reported_with_the_log_tail(tmp_path: Path) -> None:
    repository = write_toy_repository(tmp_path, tmp_path / "marker", 'raise ValueError("toy failure")')
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    with pytest.raises(TritonServerError, match=r"(?s)exited with code \d+ before it was ready.*toy failure"):
        start_server(repository, log_file=tmp_path / "server.log", ready_timeout_s=120, **ports)


def test_missing_model_repository_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TritonServerError, match="model repository .*missing-repo does not exist"):
        start_server(tmp_path / "missing-repo", http_port=1, grpc_port=2, metrics_port=3)


def test_a_busy_port_is_refused_before_starting(tmp_path: Path) -> None:
    repository = write_toy_repository(tmp_path, tmp_path / "marker")
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(
            TritonServerError, match=f"port {port} is already in use .*pass another --grpc-port"
        ):
            start_server(repository, http_port=free_port(), grpc_port=port, metrics_port=free_port())


def fake_wheel(root: Path) -> Path:
    """The nvidia-pytriton layout: backend files apart from one stub folder per Python version."""
    server = root / "tritonserver"
    (server / "backends" / "python").mkdir(parents=True)
    (server / "backends" / "python" / "libtriton_python.so").write_bytes(b"backend")
    (server / "backends" / "python" / "triton_python_backend_utils.py").write_text("utils")
    for version in (f"{sys.version_info.major}.{sys.version_info.minor}", "3.8"):
        (server / "python_backend_stubs" / version).mkdir(parents=True)
        (server / "python_backend_stubs" / version / "triton_python_backend_stub").write_text(
            f"stub {version}"
        )
    return server


def test_backend_directory_holds_the_backend_and_this_pythons_stub(tmp_path: Path) -> None:
    server = fake_wheel(tmp_path / "wheel")
    backends = assemble_backend_directory(server, tmp_path / "backends")
    python_dir = backends / "python"
    assert sorted(p.name for p in python_dir.iterdir()) == [
        "libtriton_python.so",
        "triton_python_backend_stub",
        "triton_python_backend_utils.py",
    ]
    assert (
        python_dir / "triton_python_backend_stub"
    ).read_text() == f"stub {sys.version_info[0]}.{sys.version_info[1]}"
    assert (python_dir / "libtriton_python.so").read_bytes() == b"backend"


def test_backend_directory_follows_an_updated_wheel(tmp_path: Path) -> None:
    server = fake_wheel(tmp_path / "wheel")
    assemble_backend_directory(server, tmp_path / "backends")
    (server / "backends" / "python" / "triton_python_backend_utils.py").write_text("utils v2")
    assemble_backend_directory(server, tmp_path / "backends")
    assert (tmp_path / "backends" / "python" / "triton_python_backend_utils.py").read_text() == "utils v2"


def test_a_python_without_stub_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = fake_wheel(tmp_path / "wheel")
    monkeypatch.setattr(sys, "version_info", SimpleNamespace(major=3, minor=99))
    with pytest.raises(TritonServerError, match="no Python backend stub for Python 3.99"):
        assemble_backend_directory(server, tmp_path / "backends")


def test_wheel_installation_runs_stubs_on_this_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher.shutil, "which", lambda name: None)
    monkeypatch.setenv("LD_LIBRARY_PATH", "/already/there")
    installation = launcher.find_tritonserver()
    assert installation.binary.name == "tritonserver" and installation.binary.is_file()
    assert (installation.backend_directory / "python" / "triton_python_backend_stub").is_file()
    library_path = installation.env["LD_LIBRARY_PATH"].split(":")
    assert library_path[0].endswith("nvidia_pytriton.libs")
    assert library_path[-1] == "/already/there"
    assert installation.env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert installation.env["PYTHONPATH"].split(":")[0] == str(launcher.REPO_ROOT)


def test_tritonserver_on_the_path_keeps_its_own_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher.shutil, "which", lambda name: "/opt/tritonserver/bin/tritonserver")
    installation = launcher.find_tritonserver()
    assert installation.binary == Path("/opt/tritonserver/bin/tritonserver")
    assert installation.backend_directory is None


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
