"""The OpenAI endpoint's HTTP edge, as a real `python -m frontend` process whose tritonserver is
not there: malformed and hostile bodies get JSON 4xx naming the problem (never a text/plain 500),
a server that cannot answer gets 503 with Retry-After."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher import free_port


class Endpoint:
    def __init__(self, port: int, log: Path):
        self.port, self.log = port, log

    def post(self, path: str, body: bytes | dict) -> tuple[int, dict[str, str], bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return reply.status, dict(reply.headers), reply.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()


def start(tmp_path: Path, *options: str, grpc_url: str | None = None) -> tuple[subprocess.Popen, Endpoint]:
    """`python -m frontend` with these options, for the tritonserver at grpc_url (default: a port
    nothing listens on); returns once it listens."""
    port, log = free_port(), tmp_path / f"frontend-{time.monotonic_ns()}.log"
    grpc_url = grpc_url or f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "frontend", "--grpc-url", grpc_url, "--port", str(port)]
    with open(log, "wb") as output:
        process = subprocess.Popen([*command, *options], stdout=output, stderr=subprocess.STDOUT)
    endpoint = Endpoint(port, log)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return process, endpoint
        except urllib.error.HTTPError:
            return process, endpoint  # 503: listening, tritonserver not ready
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    options = ("--header-timeout-s", "1", "--max-body-bytes", str(MAX_BODY))
    process, endpoint = start(tmp_path_factory.mktemp("frontend"), *options)
    try:
        yield endpoint
    finally:
        process.terminate()
        process.wait(30)


def error_of(status: int, headers: dict[str, str], body: bytes) -> dict:
    assert headers.get("content-type", headers.get("Content-Type")) == "application/json", (
        status,
        body[:300],
    )
    return json.loads(body)["error"]


CHAT = {"model": "lookahead", "messages": [{"role": "user", "content": "hi"}]}
MAX_BODY = 1024**2


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b"[" * 100_000, None, "nested too deeply"),
        (
            json.dumps(CHAT).encode()[:-1] + b', "tools": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            None,
            "nested too deeply",
        ),
        (b'{"model": "m", "prompt": "\\ud800"}', "prompt", "lone surrogate"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "a\\udfffb"}]}',
            "messages.0.content",
            "lone surrogate",
        ),
        (b'{"model": "m", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}", None, "not valid JSON"),
    ],
)
def test_hostile_bodies_get_a_json_400_naming_the_problem(endpoint, body, param, words):
    path = "/v1/chat/completions" if b"messages" in body or body.startswith(b"[") else "/v1/completions"
    status, headers, reply = endpoint.post(path, body)
    error = error_of(status, headers, reply)
    assert status == 400 and words in error["message"] and error["param"] == param, error
    assert len(reply) < 1000


def test_a_server_that_cannot_answer_gets_503_with_retry_after(endpoint):
    status, headers, reply = endpoint.post("/v1/completions", {"model": "lookahead", "prompt": "hi"})
    error = error_of(status, headers, reply)
    assert status == 503 and error["type"] == "server_error", error
    assert int(headers["retry-after"]) >= 1
    assert "Traceback" not in endpoint.log.read_text()


def test_a_body_over_the_limit_gets_413_naming_it(endpoint):
    """As curl sends a large body (`Expect: 100-continue`): the endpoint answers from Content-Length
    alone, before the body. (A client that sends the body anyway can find the connection closed
    under it before it reads the answer.)"""
    body = json.dumps({"model": "m", "prompt": "x" * MAX_BODY}).encode()
    connection = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=60)
    try:
        connection.putrequest("POST", "/v1/completions")
        for name, value in (
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Expect", "100-continue"),
        ):
            connection.putheader(name, value)
        connection.endheaders()
        reply = connection.getresponse()
        status, headers, data = reply.status, dict(reply.headers), reply.read()
    finally:
        connection.close()
    assert status == 413 and "--max-body-bytes" in error_of(status, headers, data)["message"]


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("logit_bias", {str(i): 1 for i in range(5000)}, "at most 4096 logit_bias entries, got 5000"),
        ("stop", ["x"] * 65, "at most 64 stop strings, got 65"),
        ("stop", "x" * 257, "at most 256 characters"),
        ("stop_token_ids", list(range(5000)), "at most 4096 stop_token_ids"),
    ],
)
def test_lists_over_the_models_bounds_get_a_400_naming_the_field(endpoint, field, value, words):
    status, headers, reply = endpoint.post("/v1/completions", {"model": "m", "prompt": "x", field: value})
    error = error_of(status, headers, reply)
    assert status == 400 and error["param"] == field and words in error["message"], error


def test_a_connection_that_sends_half_a_request_line_is_closed(endpoint):
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HT")
        started = time.monotonic()
        assert sock.recv(1) == b""  # closed by the endpoint, not by our timeout
        assert time.monotonic() - started < 5
