"""What the vLLM backend's own client tests (its ci/L0_backend_vllm, L0_additional_outputs_vllm and
L0_check_health_vllm) check, held against this backend in a real tritonserver: additional outputs
on every streamed response, the refusal of an echoed stream in its words, cancellation and its log
lines, max_tokens bounded by the context only, the vllm:* metrics with their values, health, and
unknown config.pbtxt parameters failing the load. Comparisons with vLLM's own engine become
comparisons with this backend's own greedy text.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import time
import urllib.request
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from launcher import TritonServer
from lookahead.models.loading import LoadedModel
from tests.integration.servers import REPOSITORY, launch, set_parameter

# Prompts on which the default model writes 16 tokens before any end of text.
PROMPT = "The future of AI is"
# The vLLM backend's bucket bounds (src/utils/metrics.py); token counts: 1-2-5 steps up to the
# model's context, 8192 tokens here.
BUCKETS = {
    "time_to_first_token_seconds": [
        0.001,
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.25,
        0.5,
        0.75,
        1,
        2.5,
        5,
        7.5,
        10,
    ],
    "time_per_output_token_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5],
    "e2e_request_latency_seconds": [1, 2.5, 5, 10, 15, 20, 30, 40, 50, 60],
    "request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000],
    "request_generation_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000],
    "request_params_n": [1, 2, 5, 10, 20],
}
GREEDY = {"temperature": "0", "top_p": "1", "max_tokens": "16"}


def tensors(prompt: str, **values: Any) -> list[grpcclient.InferInput]:
    """The vLLM backend's request tensors: BYTES text_input and sampling_parameters, BOOL flags."""
    inputs = []
    for name, value in {"text_input": prompt, **values}.items():
        if isinstance(value, bool):
            tensor = grpcclient.InferInput(name, [1], "BOOL")
            tensor.set_data_from_numpy(np.array([value], dtype=bool))
        else:
            text = json.dumps(value) if isinstance(value, dict) else value
            tensor = grpcclient.InferInput(name, [1], "BYTES")
            tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        inputs.append(tensor)
    return inputs


def infer(url: str, model: str, inputs: list[grpcclient.InferInput], request_id: str) -> list[Any]:
    """Every (result, error) of one request over a gRPC stream, up to its final response."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, request_id=request_id)
        collected = []
        while True:
            result, error = responses.get(timeout=180)
            collected.append((result, error))
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                return collected
    finally:
        client.stop_stream()
        client.close()


def texts(responses: list[Any]) -> list[str]:
    return [result.as_numpy("text_output")[0].decode() for result, _ in responses]


def scrape(server: TritonServer) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        return reply.read().decode()


def vllm_values(text: str, model: str) -> dict[str, float]:
    """vllm:* samples of one model, histogram buckets keyed by their `le`."""
    values = {}
    for name, labels, value in re.findall(r"^(vllm:\w+)\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        found = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if found.pop("model", None) == model and found.pop("version", None) == "1":
            values[name + (f"[{found['le']}]" if "le" in found else "")] = float(value)
    return values


def wait_for(condition: Any, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


# additional_outputs_test


@pytest.mark.parametrize("stream", [True, False])
def test_additional_outputs_are_on_every_response_as_the_vllm_backend_sends_them(server, stream):
    inputs = tensors(
        PROMPT,
        stream=stream,
        sampling_parameters={**GREEDY, "logprobs": 2},
        return_finish_reason=True,
        return_cumulative_logprob=True,
        return_logprobs=True,
        return_num_input_tokens=True,
        return_num_output_tokens=True,
    )
    responses = infer(server.grpc_url, "lookahead", inputs, f"outputs-{stream}")
    assert all(error is None for _, error in responses)
    results = [result for result, _ in responses]
    if stream:  # each response: the step's text, and a finish_reason of "None" until the last
        assert len(results) > 2
    reasons = [r.as_numpy("finish_reason")[0].decode() for r in results]
    assert reasons == ["None"] * (len(results) - 1) + ["length"]
    cumulative = [float(r.as_numpy("cumulative_logprob")[0]) for r in results]
    assert all(value < 0 for value in cumulative) and len(set(cumulative)) == len(cumulative)
    output_tokens = 0
    for result, text in zip(results, texts(responses)):
        logprobs = json.loads(result.as_numpy("logprobs")[0])
        assert len(logprobs) == int(result.as_numpy("num_output_tokens")[0])
        output_tokens += len(logprobs)
        chosen = ""
        for position in logprobs:
            assert 1 <= len(position) <= 3  # the chosen token and the top 2
            assert all(set(entry) == {"logprob", "rank", "decoded_token"} for entry in position.values())
            (top,) = [entry for entry in position.values() if entry["rank"] == 1]
            chosen += top["decoded_token"]
        assert (chosen if stream else PROMPT + chosen) == text  # not streaming: the prompt is echoed
        assert 0 < int(result.as_numpy("num_input_tokens")[0]) <= len(PROMPT)
    assert output_tokens == 16


def test_outputs_not_asked_for_are_absent(server):
    responses = infer(
        server.grpc_url, "lookahead", tensors(PROMPT, stream=True, sampling_parameters=GREEDY), "bare"
    )
    for result, error in responses:
        assert error is None
        for name in (
            "finish_reason",
            "cumulative_logprob",
            "logprobs",
            "num_input_tokens",
            "num_output_tokens",
        ):
            assert result.as_numpy(name) is None
    assert "".join(texts(responses)).count(" ") > 4  # a sentence


# enabled_stream_test and vllm_backend_test: exclude_input_in_output


def test_an_echoed_stream_is_refused_in_the_vllm_backends_words(server):
    inputs = tensors(PROMPT, stream=True, sampling_parameters=GREEDY, exclude_input_in_output=False)
    [(result, error)] = infer(server.grpc_url, "lookahead", inputs, "echoed-stream")
    assert result is None and isinstance(error, InferenceServerException)
    assert error.message() == (
        "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
    )


def test_exclude_input_in_output_default_false_and_true_and_the_stream_agree(server):
    streamed = "".join(
        texts(
            infer(server.grpc_url, "lookahead", tensors(PROMPT, stream=True, sampling_parameters=GREEDY), "s")
        )
    )
    whole = {}
    for exclude in (None, False, True):
        flags = {} if exclude is None else {"exclude_input_in_output": exclude}
        inputs = tensors(PROMPT, stream=False, sampling_parameters=GREEDY, **flags)
        [text] = texts(infer(server.grpc_url, "lookahead", inputs, f"exclude-{exclude}"))
        whole[exclude] = text
    assert whole[None] == whole[False] == PROMPT + streamed
    assert whole[True] == streamed


# request_cancellation_test


def test_a_cancelled_request_is_cancelled_and_logged_as_the_vllm_backend_does(server):
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    # max_tokens 1500: only the model's context (8192 tokens) bounds it, as in vLLM.
    options = {"temperature": "0", "top_p": "1", "max_tokens": "1500", "ignore_eos": "true"}
    inputs = tensors(
        "Write an original and creative poem of at least 200 words.",
        stream=False,
        sampling_parameters=options,
    )
    client.async_stream_infer("baseline", inputs, request_id="poem")
    time.sleep(1)
    client.stop_stream(cancel_requests=True)
    cancelled = time.monotonic()
    client.close()
    result, error = responses.get(timeout=30)
    assert result is None and error.status() == "StatusCode.CANCELLED"
    assert responses.empty()
    # The vLLM backend's test reads the log one second after cancelling; the engine may still be
    # in its step then (seconds, on a loaded machine), so the response thread answers and logs it.
    lines = ("[vllm] Cancelling the request poem", "[vllm] Successfully cancelled the request poem")
    assert wait_for(lambda: all(line in server.log_file.read_text(errors="replace") for line in lines), 5)
    assert time.monotonic() - cancelled < 1.0 + 0.2  # the test's second, and the 0.2 s of this wait's polls


# vllm_metrics_test


def test_vllm_metrics_count_real_requests_with_vllms_names_labels_and_buckets(
    server, default_model: LoadedModel
):
    # As the vLLM backend's test does: whole (not streamed) requests together on one gRPC stream,
    # and a scrape as soon as the last one returned, with no wait for the metrics to settle.
    prompts = ["The most dangerous animal is", "The capital of France is", "The future of AI is"]
    start = before = vllm_values(scrape(server), "lookahead")
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    for index, prompt in enumerate(prompts):
        inputs = tensors(
            prompt,
            stream=False,
            sampling_parameters=GREEDY,
            return_num_output_tokens=True,
            return_perf_metrics=True,
        )
        client.async_stream_infer("lookahead", inputs, request_id=f"metrics-{index}")
    finals = []
    for _ in prompts:
        result, error = responses.get(timeout=180)
        assert error is None, error
        finals.append(result)
    changes = {
        name: value - before.get(name, 0.0)
        for name, value in vllm_values(scrape(server), "lookahead").items()
    }
    client.stop_stream()
    client.close()
    requests = len(prompts)
    prompt_tokens = sum(len(default_model.tokenizer.encode(p)) for p in prompts)
    generated = sum(int(final.as_numpy("num_output_tokens")[0]) for final in finals)
    drafted = sum(int(final.as_numpy("total_draft_tokens")[0]) for final in finals)
    accepted = sum(int(final.as_numpy("total_accepted_draft_tokens")[0]) for final in finals)
    assert generated == 16 * requests
    expected = {
        "vllm:prompt_tokens_total": prompt_tokens,
        "vllm:generation_tokens_total": generated,
        "vllm:time_to_first_token_seconds_count": requests,
        "vllm:time_per_output_token_seconds_count": generated - requests,  # each token after the first
        "vllm:e2e_request_latency_seconds_count": requests,
        "vllm:request_prompt_tokens_count": requests,
        "vllm:request_prompt_tokens_sum": prompt_tokens,
        "vllm:request_generation_tokens_count": requests,
        "vllm:request_generation_tokens_sum": generated,
        "vllm:request_params_n_count": requests,
        "vllm:request_params_n_sum": requests,  # n is 1
        "vllm:spec_decode_num_draft_tokens_total": drafted,
        "vllm:spec_decode_num_accepted_tokens_total": accepted,
    }
    assert {k: changes.get(k) for k in expected} == expected
    assert changes.get("vllm:spec_decode_num_drafts_total", 0) <= drafted
    # A streamed request alone drafts (three together may not: drafts shrink as the batch grows).
    before = vllm_values(scrape(server), "lookahead")
    inputs = tensors(PROMPT, stream=True, sampling_parameters=GREEDY, return_perf_metrics=True)
    final = infer(server.grpc_url, "lookahead", inputs, "metrics-alone")[-1][0]
    alone = {
        name: value - before.get(name, 0.0)
        for name, value in vllm_values(scrape(server), "lookahead").items()
    }
    drafted_alone = int(final.as_numpy("total_draft_tokens")[0])
    assert drafted_alone > 0 and 0 < alone["vllm:spec_decode_num_drafts_total"] <= drafted_alone
    assert alone["vllm:spec_decode_num_draft_tokens_total"] == drafted_alone
    assert alone["vllm:spec_decode_num_accepted_tokens_total"] == int(
        final.as_numpy("total_accepted_draft_tokens")[0]
    )
    assert alone["vllm:time_per_output_token_seconds_count"] == alone["vllm:generation_tokens_total"] - 1
    for name in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    ):
        assert changes[f"vllm:{name}_sum"] > 0
    after = vllm_values(scrape(server), "lookahead")
    for family, bounds in BUCKETS.items():
        found = [key[key.index("[") + 1 : -1] for key in after if key.startswith(f"vllm:{family}_bucket[")]
        assert [float(le) for le in found] == [*bounds, float("inf")], family
    first_n_bucket = next(key for key in after if key.startswith("vllm:request_params_n_bucket["))
    ones = after[first_n_bucket] - start.get(first_n_bucket, 0.0)  # earlier tests may have sent n > 1
    assert (
        ones
        == after["vllm:request_params_n_count"] - start.get("vllm:request_params_n_count", 0.0)
        == requests + 1
    )


def test_custom_sampling_params_n_returns_every_sample_and_counts_request_params_n(server):
    """As the vLLM backend's test_custom_sampling_params (n 2, temperature 1): an element per sample
    in each output, sample i the lone request's sample of seed + i, vllm:request_params_n its n."""
    options = {"n": "2", "temperature": "1", "max_tokens": "8", "seed": "11", "ignore_eos": "true"}
    flags = {"return_finish_reason": True, "return_num_output_tokens": True, "exclude_input_in_output": True}
    before = vllm_values(scrape(server), "lookahead")
    [(whole, error)] = infer(
        server.grpc_url,
        "lookahead",
        tensors(PROMPT, stream=False, sampling_parameters=options, **flags),
        "n2",
    )
    assert error is None, error
    samples = [text.decode() for text in whole.as_numpy("text_output")]
    assert whole.as_numpy("num_output_tokens").tolist() == [8, 8]
    assert [reason.decode() for reason in whole.as_numpy("finish_reason")] == ["length", "length"]
    after = vllm_values(scrape(server), "lookahead")  # applied before the final response was sent
    assert after["vllm:request_params_n_count"] - before.get("vllm:request_params_n_count", 0) == 1
    assert after["vllm:request_params_n_sum"] - before.get("vllm:request_params_n_sum", 0) == 2
    for index, sample in enumerate(samples):
        lone = {**options, "n": "1", "seed": str(11 + index)}
        [(result, _)] = infer(
            server.grpc_url,
            "lookahead",
            tensors(PROMPT, stream=False, sampling_parameters=lone, **flags),
            f"n1-{index}",
        )
        assert result.as_numpy("text_output")[0].decode() == sample
    streamed = infer(
        server.grpc_url,
        "lookahead",
        tensors(PROMPT, stream=True, sampling_parameters=options, **flags),
        "n2-stream",
    )
    assert all(result.as_numpy("text_output").shape == (2,) for result, _ in streamed)
    assert ["".join(r.as_numpy("text_output")[i].decode() for r, _ in streamed) for i in (0, 1)] == samples
    assert [reason.decode() for reason in streamed[-1][0].as_numpy("finish_reason")] == ["length", "length"]


# check_health_test


def test_the_model_is_healthy_and_ready_between_requests(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for attempt in range(3):
            assert client.is_model_ready("lookahead")
            states = {m.name: m.state for m in client.get_model_repository_index().models}
            assert states["lookahead"] == "READY"
            responses = infer(
                server.grpc_url,
                "lookahead",
                tensors(PROMPT, stream=True, sampling_parameters=GREEDY),
                f"health-{attempt}",
            )
            assert all(error is None for _, error in responses)
    finally:
        client.close()


# vllm_backend_test (model control) and metrics_test (metrics off)


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory: pytest.TempPathFactory):
    """A server loading nothing at start: `typo` (a misspelt parameter) and `quiet` (metrics off,
    the vLLM backend's health-check switch set) are loaded by the tests."""
    root = tmp_path_factory.mktemp("explicit")
    repository = root / "repository"
    for name, extra in (
        ("typo", '  { key: "decoding_lenght", value: { string_value: "8" } },\n'),
        ("quiet", '  { key: "ENABLE_VLLM_HEALTH_CHECK", value: { string_value: "true" } },\n'),
    ):
        shutil.copytree(REPOSITORY / "baseline", repository / name)
        config = repository / name / "config.pbtxt"
        text = set_parameter(
            config.read_text(), "REPORT_CUSTOM_METRICS", "false" if name == "quiet" else "true"
        )
        config.write_text(text.replace("parameters [\n", "parameters [\n" + extra, 1))
    with launch(repository, root / "server.log", extra_args=["--model-control-mode=explicit"]) as running:
        yield running


def test_an_unknown_parameter_fails_the_load_naming_it(explicit_server: TritonServer):
    client = grpcclient.InferenceServerClient(explicit_server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as raised:
            client.load_model("typo")
        assert "unknown config.pbtxt parameters: 'decoding_lenght' (did you mean 'decoding_length'?)" in str(
            raised.value
        )
        assert not client.is_model_ready("typo")
    finally:
        client.close()


def test_with_custom_metrics_off_no_vllm_metric_is_exported(explicit_server: TritonServer):
    client = grpcclient.InferenceServerClient(explicit_server.grpc_url)
    try:
        client.load_model("quiet")  # ENABLE_VLLM_HEALTH_CHECK is accepted
        assert client.is_model_ready("quiet")
    finally:
        client.close()
    responses = infer(
        explicit_server.grpc_url, "quiet", tensors(PROMPT, stream=True, sampling_parameters=GREEDY), "quiet"
    )
    assert all(error is None for _, error in responses)
    text = scrape(explicit_server)
    assert "nv_inference_request_success" in text
    assert not re.search(r"^(vllm:|lookahead_)", text, re.MULTILINE)
