"""The client CLI and Python API against a real server: streamed text, stats, errors verbatim."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import Completion, LookaheadClient
from launcher import TritonServer
from tests.integration.servers import launch

REPO_ROOT = Path(__file__).resolve().parents[2]


def set_parameter(config: str, key: str, value: str) -> str:
    """Replace one config.pbtxt `parameters` value; fails loudly if the key is not there."""
    pattern = re.compile(rf'(key: "{key}", value: {{ string_value: )"[^"]*"')
    updated, count = pattern.subn(rf'\g<1>"{value}"', config)
    assert count == 1, f"config.pbtxt has no parameter {key!r}"
    return updated


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """The real model repository, copied so that the trie snapshots stay in the temporary folder."""
    root = tmp_path_factory.mktemp("triton")
    repository = shutil.copytree(REPO_ROOT / "model_repository", root / "model_repository")
    # One torch thread per model: the two models share the machine's cores.
    overrides = {
        "lookahead": {"threads": "1", "trie_state_dir": str(root / "state")},
        "baseline": {"threads": "1"},
    }
    for model, values in overrides.items():
        config_path = repository / model / "config.pbtxt"
        config = config_path.read_text()
        for key, value in values.items():
            config = set_parameter(config, key, value)
        config_path.write_text(config)
    with launch(repository, root / "server.log", ready_timeout_s=300.0) as server:
        yield server


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "client", *args], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )


def test_cli_streams_text_and_prints_stats(triton: TritonServer) -> None:
    finished = run_cli(
        "def fibonacci(n):", "--stream", "--stats", "--url", triton.grpc_url, "--max-tokens", "12"
    )
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.strip()
    stats = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in finished.stderr.strip().splitlines())
    assert stats["output tokens"] == "12"
    assert float(stats["tokens/s"]) > 0
    assert float(stats["time to first token"].removesuffix(" s")) > 0
    assert float(stats["accepted draft tokens per step"]) >= 0


def test_http_and_grpc_give_the_same_greedy_text(triton: TritonServer) -> None:
    prompt = "Write a Python function that checks whether a number is prime."
    grpc_client = LookaheadClient(url=triton.grpc_url, protocol="grpc")
    http_client = LookaheadClient(url=triton.http_url, protocol="http")
    streamed = Completion.from_chunks(grpc_client.stream(prompt, max_tokens=16, temperature=0))
    assert streamed.num_output_tokens == 16
    assert streamed.text
    assert http_client.generate(prompt, max_tokens=16, temperature=0).text == streamed.text
    assert (
        Completion.from_chunks(http_client.stream(prompt, max_tokens=16, temperature=0)).text == streamed.text
    )


def test_server_side_errors_surface_verbatim(triton: TritonServer) -> None:
    finished = run_cli("hi", "--url", triton.grpc_url, "--max-tokens", "0")
    assert finished.returncode == 1
    assert finished.stderr == "error: max_tokens must be >= 1, got 0\n"
    finished = run_cli("hi", "--url", triton.http_url, "--protocol", "http", "--model", "missing")
    assert finished.returncode == 1
    assert finished.stderr.startswith(f"error: model 'missing' is not ready on Triton at {triton.http_url}: ")
