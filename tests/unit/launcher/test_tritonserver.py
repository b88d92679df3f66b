"""The launcher: backend directory assembly, and a real tritonserver serving a toy decoupled model."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher import TritonServerError, cli, free_port, process, start_server, tritonserver
from launcher.tritonserver import assemble_backend_directory
from lookahead.contract import MODEL_ENV
from tests.gguf_files import Q, write_gguf
from tests.helpers import write_toy_repository


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
    monkeypatch.setattr(tritonserver.shutil, "which", lambda name: None)
    monkeypatch.setenv("LD_LIBRARY_PATH", "/already/there")
    installation = tritonserver.find_tritonserver()
    assert installation.binary.name == "tritonserver" and installation.binary.is_file()
    assert (installation.backend_directory / "python" / "triton_python_backend_stub").is_file()
    library_path = installation.env["LD_LIBRARY_PATH"].split(":")
    assert library_path[0].endswith("nvidia_pytriton.libs")
    assert library_path[-1] == "/already/there"
    assert installation.env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert installation.env["PYTHONPATH"].split(":")[0] == str(tritonserver.REPO_ROOT)


def test_tritonserver_on_the_path_keeps_its_own_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tritonserver.shutil, "which", lambda name: "/opt/tritonserver/bin/tritonserver")
    installation = tritonserver.find_tritonserver()
    assert installation.binary == Path("/opt/tritonserver/bin/tritonserver")
    assert installation.backend_directory is None


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_free_port_never_gives_a_port_twice_when_the_kernel_offers_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server's metrics port once came out equal to the OpenAI endpoint's: bind(0) may offer a
    port it just offered."""
    offered = iter([1, 1, 1, 2])

    class OfferingSocket:
        def __init__(self, *_: object) -> None:
            self.port = next(offered)

        def __enter__(self) -> OfferingSocket:
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def bind(self, _: object) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return "127.0.0.1", self.port

    monkeypatch.setattr(process.socket, "socket", OfferingSocket)
    assert [free_port(), free_port()] == [1, 2]


def test_model_override_passes_an_embedded_name_or_a_folder_as_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared: list[str] = []
    monkeypatch.setattr(cli, "prepare_model", prepared.append)
    assert cli.model_override("qwen2.5-coder-0.5b-instruct") == "qwen2.5-coder-0.5b-instruct"
    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-model" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert cli.model_override("my-model") == str(tmp_path / "my-model")
    # Prepared before any instance starts, by the absolute path the instances get.
    assert prepared == ["qwen2.5-coder-0.5b-instruct", str(tmp_path / "my-model")]
    with pytest.raises(TritonServerError, match="'no-such-model' is neither an embedded model"):
        cli.model_override("no-such-model")


def test_model_override_takes_a_gguf_file_by_its_absolute_path_and_refuses_a_bad_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared: list[str] = []
    monkeypatch.setattr(cli, "prepare_model", prepared.append)
    monkeypatch.chdir(tmp_path)
    write_gguf(tmp_path / "tiny.gguf", "qwen2", Q.Q8_0)
    assert cli.model_override("tiny.gguf") == str(tmp_path / "tiny.gguf")
    assert prepared == [str(tmp_path / "tiny.gguf")]
    (tmp_path / "notes.gguf").write_text("not a model")
    refused = r"^--model: notes.gguf is not a GGUF file \(it starts with b'not '"
    with pytest.raises(TritonServerError, match=refused):
        cli.model_override("notes.gguf")
    with pytest.raises(TritonServerError, match=r"^--model: missing.gguf: no such GGUF file$"):
        cli.model_override("missing.gguf")
    assert len(prepared) == 1


def test_an_unknown_model_stops_the_launcher_before_any_server_starts(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "start_server", lambda *a, **k: pytest.fail("a server was started"))
    monkeypatch.setenv(MODEL_ENV, "no-such-model")
    assert cli.main(["--http-port", str(free_port())]) == 2
    assert "error: --model 'no-such-model' is neither an embedded model" in capsys.readouterr().err


def test_a_busy_port_is_refused_before_the_running_servers_log_is_touched(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "LOGS_DIR", tmp_path)
    monkeypatch.setattr(cli, "start_server", lambda *a, **k: pytest.fail("a server was started"))
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        log = tmp_path / f"tritonserver-{port}.log"  # the default log of a server on that HTTP port
        log.write_text("the running server's log\n")
        assert cli.main(["--http-port", str(port), "--grpc-port", str(free_port())]) == 2
    assert f"port {port} is already in use" in capsys.readouterr().err
    assert log.read_text() == "the running server's log\n"


def test_the_default_log_is_appended_to(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "LOGS_DIR", tmp_path)
    started: list[Path] = []

    def start_server(*args, log_file, **kwargs):
        started.append(log_file)
        raise TritonServerError("not this time")

    monkeypatch.setattr(cli, "start_server", start_server)
    port = free_port()
    (tmp_path / f"tritonserver-{port}.log").write_text("an earlier run\n")
    assert cli.main(["--http-port", str(port)]) == 1
    assert started == [tmp_path / f"tritonserver-{port}.log"]
    assert started[0].read_text() == "an earlier run\n"
