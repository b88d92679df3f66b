"""The OpenAI endpoint's bounds against a real tritonserver: oversized bodies, prompts and lists
are refused before they cost memory or block the event loop (/health keeps answering at once),
half-sent requests are dropped after the header timeout, completions beyond the concurrency limit
get 503 with Retry-After."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher import TritonServer
from tests.integration.servers import MAX_PROMPT_TOKENS
from tests.unit.test_frontend_http import Endpoint, start

HEADER_TIMEOUT_S = 2.0
MAX_CONCURRENT = 2
MAX_BODY = 4 * 1024**2  # the default


@pytest.fixture(scope="module")
def bounded(server: TritonServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Endpoint, int]]:
    options = ("--header-timeout-s", str(HEADER_TIMEOUT_S), "--max-concurrent-requests", str(MAX_CONCURRENT))
    process, endpoint = start(tmp_path_factory.mktemp("limits"), *options, grpc_url=server.grpc_url)
    try:
        yield endpoint, process.pid
    finally:
        process.terminate()
        process.wait(30)


class HealthWatch:
    """Polls /health over and over; `longest` is the slowest answer (how long the loop was blocked)."""

    def __init__(self, endpoint: Endpoint):
        self.url = f"http://127.0.0.1:{endpoint.port}/health"
        self.longest, self.count = 0.0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            with urllib.request.urlopen(self.url, timeout=120) as reply:
                assert reply.status == 200
            self.longest = max(self.longest, time.monotonic() - started)
            self.count += 1
            time.sleep(0.05)

    def __enter__(self) -> HealthWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(130)


def rss_mib(pid: int) -> float:
    for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def post_large(endpoint: Endpoint, body: bytes) -> tuple[int, bytes]:
    """POST a body the endpoint may refuse from its head alone: the head, then the body only if no
    answer came within a few seconds, then the answer."""
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=120) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode())
        if not select.select([sock], [], [], 5)[0]:
            sock.sendall(body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status = int(reply.split(b" ", 2)[1])
    return status, reply.split(b"\r\n\r\n", 1)[1]


def test_oversized_bodies_prompts_and_lists_are_refused_while_health_answers(bounded):
    endpoint, pid = bounded
    rss_before = rss_mib(pid)
    echo = {"model": "lookahead", "echo": True, "logprobs": 1}
    prompt_18mb = json.dumps({**echo, "prompt": "word " * 3_600_000}).encode()
    prompt_4mb = {**echo, "prompt": "word " * 800_000}
    bias = {"model": "lookahead", "prompt": "hi", "logit_bias": {str(i): 1 for i in range(150_000)}}
    bias_21mb = json.dumps(
        {"model": "lookahead", "prompt": "hi", "logit_bias": {str(i): 1 for i in range(2_000_000)}}
    )
    body_50mb = json.dumps({"model": "lookahead", "prompt": "x" * 50 * 1024**2}).encode()
    results: dict[str, tuple[int, bytes]] = {}
    with HealthWatch(endpoint) as health:
        results["18 MB echo+logprobs prompt"] = post_large(endpoint, prompt_18mb)
        results["21 MB logit_bias"] = post_large(endpoint, bias_21mb.encode())
        status, _, body = endpoint.post("/v1/completions", prompt_4mb)
        results["4 MB echo+logprobs prompt"] = status, body
        status, _, body = endpoint.post("/v1/completions", bias)
        results["150,000-key logit_bias"] = status, body
        threads = [
            threading.Thread(
                target=lambda i=i: results.__setitem__(f"50 MB body {i}", post_large(endpoint, body_50mb))
            )
            for i in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    for name, (status, body) in results.items():
        print(f"{name}: {status} {body[:200]!r}")
    rss = f"RSS {rss_before:.0f} -> {rss_mib(pid):.0f} MiB"
    print(f"/health: {health.count} answers, the slowest {health.longest:.3f} s; {rss}")
    for name in ("18 MB echo+logprobs prompt", "21 MB logit_bias", *(f"50 MB body {i}" for i in range(4))):
        assert results[name][0] == 413 and b"--max-body-bytes" in results[name][1], results[name]
    status, body = results["4 MB echo+logprobs prompt"]
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "prompt", (status, body[:300])
    assert f"max_prompt_tokens ({MAX_PROMPT_TOKENS})" in error["message"]
    status, body = results["150,000-key logit_bias"]
    assert status == 400 and "at most 4096 logit_bias entries" in json.loads(body)["error"]["message"]
    assert health.longest < 2.0  # a few ms when idle; seconds before the bounds (46.9 s at 18 MB)
    assert rss_mib(pid) < rss_before + 300


def test_connections_that_send_half_a_request_are_closed_after_the_header_timeout(bounded):
    endpoint, _ = bounded
    sockets = []
    for _ in range(300):
        sock = socket.create_connection(("127.0.0.1", endpoint.port), timeout=30)
        sock.sendall(b"GET /health HT")
        sockets.append(sock)
    started = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/health", timeout=30) as reply:
        assert reply.status == 200  # served meanwhile
    closed = 0
    for sock in sockets:
        sock.settimeout(max(0.1, started + HEADER_TIMEOUT_S + 5 - time.monotonic()))
        try:
            closed += sock.recv(1) == b""
        except (TimeoutError, ConnectionResetError):
            pass
        finally:
            sock.close()
    print(f"{closed} of 300 half-sent requests closed within {time.monotonic() - started:.1f} s")
    assert closed == 300


def test_completions_beyond_the_concurrency_limit_get_503_with_retry_after(bounded):
    endpoint, _ = bounded
    long = {
        "model": "lookahead",
        "prompt": "Write a story.",
        "max_tokens": 512,
        "ignore_eos": True,
        "stream": True,
    }
    streams = []
    try:
        for _ in range(MAX_CONCURRENT):
            request = urllib.request.Request(
                f"http://127.0.0.1:{endpoint.port}/v1/completions",
                data=json.dumps(long).encode(),
                headers={"Content-Type": "application/json"},
            )
            reply = urllib.request.urlopen(request, timeout=120)
            assert reply.readline()  # streaming
            streams.append(reply)
        status, headers, body = endpoint.post(
            "/v1/completions", {"model": "lookahead", "prompt": "hi", "max_tokens": 2}
        )
        error = json.loads(body)["error"]
        assert status == 503 and headers["retry-after"] == "1", (status, body)
        assert "--max-concurrent-requests" in error["message"]
    finally:
        for reply in streams:
            reply.close()
    deadline = time.monotonic() + 60
    while (
        status := endpoint.post("/v1/completions", {"model": "lookahead", "prompt": "hi", "max_tokens": 2})[0]
    ) == 503:
        assert time.monotonic() < deadline, "the closed streams never gave their places back"
        time.sleep(0.5)
    assert status == 200
