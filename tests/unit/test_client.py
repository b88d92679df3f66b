"""The client API and CLI: request building, stats, error messages; then against a real server."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from client import Chunk, Completion, LookaheadClient, ModelNotReadyError, ServerError
from client.__main__ import format_stats, main, parse_args, sampling_options
from client.api import request_inputs
from launcher import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_request_inputs_follow_the_vllm_contract() -> None:
    inputs = request_inputs("def f():", stream=True, sampling={"max_tokens": 8, "stop": "\n\n", "seed": None})
    assert inputs["text_input"] == "def f():"
    assert inputs["stream"] is True
    assert json.loads(inputs["sampling_parameters"]) == {"max_tokens": 8, "stop": ["\n\n"]}
    assert inputs["exclude_input_in_output"] is True
    for flag in ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens"):
        assert inputs[flag] is True
    assert inputs["return_perf_metrics"] is True


def test_unknown_sampling_parameter_is_refused_before_sending() -> None:
    client = LookaheadClient(url="localhost:1")  # nothing listens there; it must not be contacted
    with pytest.raises(TypeError, match="unknown sampling parameter.*max_new_tokens"):
        client.stream("x", max_new_tokens=3)


def test_completion_from_chunks_sums_deltas_and_keeps_final_fields() -> None:
    chunks = [
        Chunk("Hello", 0.25, num_output_tokens=1, num_input_tokens=4),
        Chunk(" wor", 0.5, num_output_tokens=3, num_input_tokens=4),
        Chunk(
            "ld",
            1.0,
            num_output_tokens=2,
            finish_reason="length",
            perf={"num_decoding_steps": 3, "total_accepted_draft_tokens": 3, "total_draft_tokens": 12},
        ),
    ]
    completion = Completion.from_chunks(chunks)
    assert completion.text == "Hello world"
    assert completion.num_output_tokens == 6
    assert completion.num_input_tokens == 4
    assert completion.finish_reason == "length"
    assert completion.time_to_first_token == 0.25
    assert completion.tokens_per_second == 6.0
    assert completion.accepted_draft_tokens_per_step == 1.0


def test_format_stats_reports_throughput_ttft_and_acceptance() -> None:
    completion = Completion(
        text="x",
        finish_reason="stop",
        num_input_tokens=5,
        num_output_tokens=40,
        perf={
            "num_decoding_steps": 16,
            "total_accepted_draft_tokens": 24,
            "total_draft_tokens": 96,
            "acceptance_rate": 0.25,
        },
        chunk_seconds=(0.125, 1.0, 2.0),
    )
    stats = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in format_stats(completion).splitlines())
    assert stats["tokens/s"] == "20.0"
    assert stats["time to first token"] == "0.125 s"
    assert stats["accepted draft tokens per step"] == "1.50"
    assert stats["draft tokens accepted"] == "24 of 96 (25.0%)"


def test_cli_options_become_sampling_parameters() -> None:
    args = parse_args(
        ["p", "--max-tokens", "9", "--stop", "a", "--stop", "b", "--no-lookahead", "--top-k", "0"]
    )
    assert sampling_options(args) == {"max_tokens": 9, "stop": ["a", "b"], "use_lookahead": False, "top_k": 0}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cli_says_how_to_start_a_server_that_is_down(
    protocol: str, capsys: pytest.CaptureFixture[str], unused_port: int
) -> None:
    status = main(["hello", "--protocol", protocol, "--url", f"localhost:{unused_port}"])
    err = capsys.readouterr().err
    assert status == 1
    assert err.count("\n") == 1
    assert err.startswith(
        f"error: cannot reach Triton at localhost:{unused_port}: is the server running? "
        "start it with ./scripts/serve.sh"
    )


@pytest.fixture
def unused_port() -> int:
    return free_port()


class _FakeGenerateHandler(BaseHTTPRequestHandler):
    """Triton's generate extension as seen on the wire, for one served model named "m"."""

    def do_GET(self) -> None:  # /v2/models/<m>/ready
        self.send_response(200 if self.path == "/v2/models/m/ready" else 400)
        self.end_headers()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not self.path.startswith("/v2/models/m/"):
            self._reply(400, {"error": "Request for unknown model: 'other' is not found"})
        elif self.path.endswith("/generate"):
            self._reply(
                200,
                {"model_name": "m", "model_version": "1", "text_output": "whole", "finish_reason": "stop"},
            )
        elif body["text_input"] == "reject":  # a first response that is an error fixes the status
            self._reply(400, {"error": "max_tokens must be >= 1, got 0"}, prefix=b"data: ")
        elif body["text_input"] == "fail":
            self._events(
                [{"text_output": "a", "num_output_tokens": 1}, {"error": "engine failed: out of memory"}]
            )
        else:
            self._events(
                [
                    {
                        "model_name": "m",
                        "text_output": "Hel",
                        "num_output_tokens": 2,
                        "num_input_tokens": 3,
                        "finish_reason": "None",
                    },
                    {
                        "text_output": "lo",
                        "num_output_tokens": 1,
                        "finish_reason": "length",
                        "num_decoding_steps": 2,
                    },
                ]
            )

    def _reply(self, status: int, payload: dict, prefix: bytes = b"") -> None:
        data = prefix + json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _events(self, payloads: list[dict]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for payload in payloads:
            self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_http_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeGenerateHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_http_stream_parses_server_sent_events(fake_http_server: str) -> None:
    chunks = list(LookaheadClient(url=fake_http_server, protocol="http", model="m").stream("hi"))
    assert [chunk.text for chunk in chunks] == ["Hel", "lo"]
    assert chunks[0].num_input_tokens == 3
    assert [chunk.finish_reason for chunk in chunks] == [None, "length"]  # "None" (vLLM's) is no reason
    assert chunks[-1].perf == {"num_decoding_steps": 2}
    assert 0 < chunks[0].seconds <= chunks[1].seconds


def test_http_generate_uses_one_json_response(fake_http_server: str) -> None:
    completion = LookaheadClient(url=fake_http_server, protocol="http", model="m").generate("hi")
    assert (completion.text, completion.finish_reason) == ("whole", "stop")


def test_http_error_inside_the_stream_is_raised_verbatim(fake_http_server: str) -> None:
    stream = LookaheadClient(url=f"http://{fake_http_server}", protocol="http", model="m").stream("fail")
    with pytest.raises(ServerError) as raised:
        list(stream)
    assert str(raised.value) == "engine failed: out of memory"


def test_http_rejected_stream_is_raised_verbatim(fake_http_server: str) -> None:
    with pytest.raises(ServerError) as raised:
        list(LookaheadClient(url=fake_http_server, protocol="http", model="m").stream("reject"))
    assert str(raised.value) == "max_tokens must be >= 1, got 0"


def test_unknown_model_is_reported_as_not_ready(fake_http_server: str) -> None:
    with pytest.raises(ModelNotReadyError) as raised:
        LookaheadClient(url=fake_http_server, protocol="http", model="other").generate("hi")
    assert str(raised.value) == (
        f"model 'other' is not ready on Triton at {fake_http_server}: "
        "Request for unknown model: 'other' is not found"
    )


# ---------------------------------------------------------------- against a real tritonserver
