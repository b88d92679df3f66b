"""The backend inside a real tritonserver, serving the default model over gRPC and HTTP.

One server (lookahead + baseline) is shared by most tests; the persistence test starts its own
two-instance server twice. Every generation is greedy and short, so the file stays within a few
minutes on two cores.
"""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from launcher import TritonServer
from lookahead.algorithm.trie import NGramTrie
from lookahead.config import LookaheadConfig, SamplingParams, TrieConfig
from lookahead.models.loading import LoadedModel
from lookahead.runtime.decoder import LookaheadDecoder
from lookahead.state.persistence import load_trie
from tests.helpers import plain_greedy
from tests.integration.servers import MAX_PROMPT_TOKENS, copy_repository, launch

PROMPT = "def fibonacci(n):"
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def expected(default_model: LoadedModel) -> dict[str, Any]:
    """The library's streamed text and token ids for PROMPT, and plain greedy decoding's ids on the
    same execution path (transformers' generate, or the decoder without lookahead on fused layers)."""
    tokenizer, model = default_model.tokenizer, default_model.model
    prompt_ids = tokenizer.encode(PROMPT)
    config = LookaheadConfig()
    decoder = LookaheadDecoder(
        model,
        tokenizer,
        NGramTrie(capacity=10_000),  # the server's default trie_depth
        config,
        default_model.eos_token_ids,
    )
    generation = decoder.start(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS))
    text = ""
    while not generation.finished:
        text += generation.step().text
    with torch.inference_mode():
        plain = plain_greedy(model, prompt_ids, MAX_TOKENS)
    return {"prompt_ids": prompt_ids, "text": text, "ids": generation.output_ids, "plain_ids": plain}


# Clients


def grpc_inputs(prompt: str | None, *, stream: bool = True, **tensors: Any) -> list[grpcclient.InferInput]:
    """One-element tensors: bools BOOL, strings BYTES, dicts JSON strings in BYTES."""
    values: dict[str, Any] = {"stream": stream, **tensors}
    if prompt is not None:
        values["text_input"] = prompt
    inputs = []
    for name, value in values.items():
        if isinstance(value, bool):
            tensor = grpcclient.InferInput(name, [1], "BOOL")
            tensor.set_data_from_numpy(np.array([value]))
        else:
            text = json.dumps(value) if isinstance(value, dict) else value
            tensor = grpcclient.InferInput(name, [1], "BYTES")
            tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        inputs.append(tensor)
    return inputs


class GrpcStream:
    """A gRPC bidirectional stream collecting (result, error) pairs."""

    def __init__(self, server: TritonServer):
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def send(self, model: str, inputs: list[grpcclient.InferInput], request_id: str) -> None:
        self.client.async_stream_infer(model, inputs, request_id=request_id)

    def collect(self, timeout_s: float = 120) -> list[Any]:
        """Responses of one request up to and including its final one; raises its error."""
        results = []
        while True:
            result, error = self.responses.get(timeout=timeout_s)
            if error is not None:
                raise error
            results.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return results

    def close(self, cancel_requests: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel_requests)
        self.client.close()


def post(server: TritonServer, path: str, body: dict[str, Any]) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://{server.http_url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def generate(server: TritonServer, model: str, body: dict[str, Any]) -> dict[str, Any]:
    status, text = post(server, f"/v2/models/{model}/generate", body)
    assert status == 200, text
    return json.loads(text)


def generate_stream(server: TritonServer, model: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, text = post(server, f"/v2/models/{model}/generate_stream", body)
    assert status == 200, text
    return [json.loads(line[len("data:") :]) for line in text.splitlines() if line.startswith("data:")]


def is_ready(server: TritonServer) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=5) as reply:
            return reply.status == 200
    except urllib.error.URLError:
        return False


def wait_for(condition: Any, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


# Tests


def test_library_matches_plain_greedy(expected, default_model):
    assert expected["ids"] == expected["plain_ids"]
    assert expected["text"] == default_model.tokenizer.decode(expected["ids"], skip_special_tokens=True)


@pytest.mark.parametrize("model", ["lookahead", "baseline"])
def test_grpc_streaming_matches_the_library(server, expected, model):
    stream = GrpcStream(server)
    try:
        options = {"max_tokens": MAX_TOKENS, "temperature": 0}
        flags = {f"return_{name}": True for name in ("finish_reason", "num_output_tokens", "perf_metrics")}
        stream.send(
            model, grpc_inputs(PROMPT, sampling_parameters=options, **flags), request_id=f"grpc-{model}"
        )
        responses = stream.collect()
    finally:
        stream.close()
    texts = [r.as_numpy("text_output")[0].decode() for r in responses]
    assert len(responses) >= 2 and all(texts[:-1])  # only steps that made text; only the final may be empty
    assert "".join(texts) == expected["text"]
    assert (
        sum(int(r.as_numpy("num_output_tokens")[0]) for r in responses) == len(expected["ids"]) == MAX_TOKENS
    )
    final = responses[-1]
    reasons = [r.as_numpy("finish_reason")[0].decode() for r in responses]
    assert reasons == ["None"] * (len(responses) - 1) + ["length"]  # as the vLLM backend sends them
    steps, drafted, accepted = (
        int(final.as_numpy(name)[0])
        for name in ("num_decoding_steps", "total_draft_tokens", "total_accepted_draft_tokens")
    )
    # The prefill emits one token, every decoding step one plus the draft tokens it accepted.
    assert steps + 1 + accepted == MAX_TOKENS
    assert final.as_numpy("acceptance_rate")[0] == pytest.approx(accepted / drafted if drafted else 0.0)
    if model == "baseline":
        assert (drafted, accepted) == (0, 0)


def test_stream_each_token_sends_a_response_per_token_with_the_same_text(server, expected):
    """The lookahead model accepts several tokens per step here; each goes out in its own response."""
    stream = GrpcStream(server)
    try:
        options = {"max_tokens": MAX_TOKENS, "temperature": 0, "stream_each_token": True}
        flags = {f"return_{name}": True for name in ("finish_reason", "num_output_tokens", "perf_metrics")}
        stream.send("lookahead", grpc_inputs(PROMPT, sampling_parameters=options, **flags), request_id="each")
        responses = stream.collect()
    finally:
        stream.close()
    assert [int(r.as_numpy("num_output_tokens")[0]) for r in responses] == [1] * MAX_TOKENS
    assert "".join(r.as_numpy("text_output")[0].decode() for r in responses) == expected["text"]
    reasons = [r.as_numpy("finish_reason")[0].decode() for r in responses]
    assert reasons == ["None"] * (MAX_TOKENS - 1) + ["length"]
    assert int(responses[-1].as_numpy("num_decoding_steps")[0]) < MAX_TOKENS - 1  # steps held several


def test_http_generate_stream_and_generate_match_the_library(server, expected):
    body = {"text_input": PROMPT, "stream": True, "parameters": {"max_tokens": MAX_TOKENS, "temperature": 0}}
    events = generate_stream(server, "lookahead", body)
    assert len(events) >= 2
    assert "".join(event["text_output"] for event in events) == expected["text"]

    body = {"text_input": PROMPT, "return_num_input_tokens": True, "parameters": {"max_tokens": MAX_TOKENS}}
    reply = generate(server, "lookahead", body)
    assert reply["text_output"] == PROMPT + expected["text"]  # the prompt is echoed when not streaming
    assert reply["num_input_tokens"] == len(expected["prompt_ids"])
    excluded = generate(server, "lookahead", {**body, "exclude_input_in_output": True})
    assert excluded["text_output"] == expected["text"]


CONCURRENT = [("def add(a, b):", 40), ("The capital of France is", 12), ("import numpy as np\n", 28)]


def test_concurrent_requests_are_batched_and_match_running_alone(server, default_model):
    tokenizer = default_model.tokenizer
    alone = []
    for prompt, max_tokens in CONCURRENT:
        decoder = LookaheadDecoder(
            default_model.model, tokenizer, NGramTrie(10_000, 16), eos_token_ids=default_model.eos_token_ids
        )
        ids, _ = decoder.generate(tokenizer.encode(prompt), SamplingParams(max_tokens=max_tokens))
        alone.append(tokenizer.decode(ids, skip_special_tokens=True))
    streams = [GrpcStream(server) for _ in CONCURRENT]
    try:
        for i, (stream, (prompt, max_tokens)) in enumerate(zip(streams, CONCURRENT)):
            options = {"max_tokens": max_tokens}
            stream.send("lookahead", grpc_inputs(prompt, sampling_parameters=options), f"c{i}")
        together = ["".join(r.as_numpy("text_output")[0].decode() for r in s.collect()) for s in streams]
    finally:
        for stream in streams:
            stream.close()
    assert together == alone


BAD_REQUESTS = [
    ({"stream": False, "parameters": {"max_tokens": 4}}, "text_input is required"),
    ({"text_input": "hi", "sampling_parameters": "{oops"}, "sampling_parameters is not valid JSON"),
    ({"text_input": "hi", "parameters": {"max_tokens": 0}}, "max_tokens must be >= 1, got 0"),
    (
        {"text_input": "hi", "parameters": {"max_tokens": 9000}},
        "and max_tokens (9000) exceed the model's context length (8192 tokens)",
    ),
    ({"text_input": "hi", "parameters": {"temperature": -1}}, "temperature must be >= 0"),
    (
        {"text_input": "hi", "sampling_parameters": '{"decoding_mode": "beam"}'},
        "decoding_mode must be one of",
    ),
    ({"text_input": "hi", "sampling_parameters": '{"decoding_length": 65}'}, "decoding_length must be <= 64"),
    ({"text_input": "hello " * MAX_PROMPT_TOKENS}, f"more than max_prompt_tokens ({MAX_PROMPT_TOKENS})"),
    (
        {"text_input": "hi", "stream": True, "exclude_input_in_output": False},
        "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed.",
    ),
]


@pytest.mark.parametrize(("body", "message"), BAD_REQUESTS)
def test_bad_requests_get_an_error_and_the_server_stays_ready(server, body, message):
    status, text = post(server, "/v2/models/lookahead/generate", body)
    assert status == 400, text
    assert message in json.loads(text)["error"]
    assert is_ready(server)


def test_wrong_tensor_types_and_shapes_are_rejected_over_grpc(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        numbers = grpcclient.InferInput("text_input", [1], "INT32")
        numbers.set_data_from_numpy(np.array([7], dtype=np.int32))
        two = grpcclient.InferInput("text_input", [2], "BYTES")
        two.set_data_from_numpy(np.array([b"a", b"b"], dtype=np.object_))
        for inputs, message in (
            ([numbers], "input 'text_input' data-type is 'INT32', but model 'lookahead' expects 'BYTES'"),
            ([two], "unexpected shape for input 'text_input' for model 'lookahead'. Expected [1], got [2]"),
        ):
            stream = GrpcStream(server)
            try:
                stream.send("lookahead", inputs, request_id="bad-tensor")
                with pytest.raises(Exception) as raised:
                    stream.collect(timeout_s=30)
                assert message in str(raised.value)
            finally:
                stream.close()
        assert client.is_model_ready("lookahead")
    finally:
        client.close()
    stream = GrpcStream(server)
    try:
        stream.send(
            "baseline", grpc_inputs("x", sampling_parameters={"use_lookahead": True}), request_id="on"
        )
        with pytest.raises(Exception, match="use_lookahead cannot be enabled"):
            stream.collect(timeout_s=30)
    finally:
        stream.close()


def test_the_warmup_corpus_fills_the_empty_trie_at_load(server):
    loaded = re.search(
        r"Trie for lookahead_0_0: (\S+) \((\d+) nodes\)", server.log_file.read_text(errors="replace")
    )
    assert loaded, "no trie line in the server log"
    assert Path(loaded.group(1)).name == "lookahead_0_0.trie"
    assert int(loaded.group(2)) > 0


def test_cancelling_a_stream_stops_its_generation(server):
    stream = GrpcStream(server)
    options = {"max_tokens": 512, "ignore_eos": True}
    stream.send(
        "lookahead",
        grpc_inputs("Write a long story about a robot.", sampling_parameters=options),
        "cancel-me",
    )
    first, error = stream.responses.get(timeout=60)
    assert error is None and first.as_numpy("text_output")[0]
    stream.close(cancel_requests=True)
    cancelled = "[vllm] Successfully cancelled the request cancel-me"
    assert wait_for(lambda: cancelled in server.log_file.read_text(errors="replace"))
    reply = generate(server, "lookahead", {"text_input": "Hi", "parameters": {"max_tokens": 2}})
    assert reply["text_output"].startswith("Hi")


def test_custom_metrics_count_the_work(server):
    for _ in range(2):  # the second prefill finds the first prompt in the prefix cache
        generate(server, "lookahead", {"text_input": PROMPT, "parameters": {"max_tokens": 8}})

    def values() -> dict[str, float]:
        with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        found = re.findall(
            r'^(lookahead_\w+)\{instance="lookahead_0_0",model="lookahead",pid="\d+",version="1"\} (\S+)$',
            text,
            re.MULTILINE,
        )
        return {name: float(value) for name, value in found}

    names = [
        "lookahead_prompt_tokens_total",
        "lookahead_cached_prompt_tokens_total",
        "lookahead_generation_tokens_total",
        "lookahead_draft_tokens_total",
        "lookahead_accepted_draft_tokens_total",
        "lookahead_trie_nodes",
        "lookahead_trie_bytes",
        "lookahead_time_to_first_token_seconds_count",
        "lookahead_time_per_output_token_seconds_count",
        "lookahead_e2e_request_latency_seconds_count",
    ]
    metrics = wait_for(
        lambda: (found := values()) and all(found.get(name, 0) > 0 for name in names) and found
    )
    assert metrics, values()


def test_the_trie_survives_a_restart(tmp_path, default_model):
    """Two instances keep two files; after a restart a repeated prompt is drafted from them."""
    state = tmp_path / "state"
    repository = copy_repository(tmp_path / "repository", state, ("lookahead",), instances=2)
    prompt = "def quicksort(items):"
    body = {"text_input": prompt, "return_perf_metrics": True, "parameters": {"max_tokens": 32}}

    with launch(repository, tmp_path / "cold.log") as cold_server:
        # Triton hands sequential requests to the instances in turn: each sees the prompt once, cold.
        cold = [generate(cold_server, "lookahead", body) for _ in range(2)]
    files = sorted(path.name for path in state.glob("*.trie"))
    assert files == ["lookahead_0_0.trie", "lookahead_0_1.trie"]  # beside them, the servers' claims
    for path in state.glob("*.trie"):
        trie = load_trie(
            path, capacity=200_000, max_depth=TrieConfig.depth, fingerprint=default_model.fingerprint
        )
        assert trie.node_count > 0, f"{path.name} learned nothing"

    with launch(repository, tmp_path / "warm.log") as warm_server:
        warm = generate(warm_server, "lookahead", body)
    assert warm["text_output"] == cold[0]["text_output"] == cold[1]["text_output"]
    assert warm["total_accepted_draft_tokens"] > max(reply["total_accepted_draft_tokens"] for reply in cold)


def test_a_request_chooses_its_drafter_and_the_output_stays_the_same(server, expected):
    """Per request, `drafter` in sampling_parameters: both the tries and the model's recycled
    candidates, those candidates alone (warm: the verified rows of the request before, whose drafter
    reads them too, taught the table), or the tries and copies alone; each drafts, and every output
    is the library's. An unknown drafter is refused by name."""
    for drafter in ("hybrid", "recycled", "trie"):
        reply = generate(
            server,
            "lookahead",
            {
                "text_input": PROMPT,
                "return_perf_metrics": True,
                "parameters": {"max_tokens": MAX_TOKENS, "temperature": 0, "drafter": drafter},
            },
        )
        assert reply["text_output"] == PROMPT + expected["text"], drafter
        assert reply["total_draft_tokens"] > 0 and reply["total_accepted_draft_tokens"] > 0, drafter
    status, text = post(
        server,
        "/v2/models/lookahead/generate",
        {"text_input": PROMPT, "parameters": {"max_tokens": 4, "drafter": "oracle"}},
    )
    assert status == 400 and "drafter must be one of trie, hybrid, recycled, got 'oracle'" in text
