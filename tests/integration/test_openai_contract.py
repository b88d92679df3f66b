"""The requests Triton's OpenAI frontend (`--backend vllm`) sends, against a real tritonserver.

The frontend itself needs the official container's in-process server; the requests are built
here exactly as it builds them (tests/integration/openai_frontend.py) and its reading of the
responses is applied: 1 or 2 responses for a non-streaming request, usage from the token counts,
logprobs from the JSON. Each text is checked against the library's own decoding.
"""

from __future__ import annotations

import queue
from typing import Any

import pytest
import tritonclient.grpc as grpcclient

from backend.request import STREAMING_ECHO_ERROR
from lookahead.config import SamplingParams
from lookahead.runtime.decoder import LookaheadDecoder
from tests.integration.openai_frontend import (
    chat_logprobs,
    check_non_streaming,
    grpc_tensors,
    usage,
    vllm_inputs,
)

MESSAGES = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


def infer(server: Any, model: str, inputs: dict[str, Any], request_id: str) -> list[Any]:
    """Every response of one request, as the frontend receives them; raises the request's error."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, grpc_tensors(inputs), request_id=request_id)
        results = []
        while True:
            result, error = responses.get(timeout=180)
            if error is not None:
                raise error
            results.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return results
    finally:
        client.stop_stream()
        client.close()


def text_of(responses: list[Any]) -> str:
    return "".join(r.as_numpy("text_output")[0].decode() for r in responses)


def library_text(default_model, prompt: str, params: SamplingParams) -> tuple[str, int, int]:
    """(text, prompt tokens, output tokens) of the library decoding `prompt` as the server does."""
    tokenizer = default_model.tokenizer
    decoder = LookaheadDecoder(default_model.model, tokenizer, eos_token_ids=default_model.eos_token_ids)
    prompt_ids = tokenizer.encode(prompt)
    gen = decoder.start(prompt_ids, params)
    text = ""
    while not gen.finished:
        text += gen.step().text
    return text, len(prompt_ids), len(gen.output_ids)


@pytest.mark.parametrize("logprobs_aware", [True, False], ids=["frontend-with-logprobs", "older-frontend"])
@pytest.mark.parametrize("model", ["lookahead", "baseline"])
def test_a_greedy_chat_completion(server, default_model, model, logprobs_aware):
    body = {"model": model, "messages": MESSAGES, "temperature": 0, "max_completion_tokens": 24}
    inputs = vllm_inputs(body, chat=True, tokenizer=default_model.tokenizer, logprobs_aware=logprobs_aware)
    responses = infer(server, model, inputs, f"chat-{model}")
    check_non_streaming(responses)
    expected, prompt_tokens, output_tokens = library_text(
        default_model, inputs["text_input"], SamplingParams(max_tokens=24, temperature=0)
    )
    assert text_of(responses) == expected  # exclude_input_in_output: no echo
    assert usage(responses) == (prompt_tokens, output_tokens)


def test_a_sampled_streaming_chat_with_penalties_stop_strings_and_logprobs(server, default_model):
    body = {
        "model": "lookahead",
        "messages": MESSAGES,
        "stream": True,
        "temperature": 0.8,
        "top_p": 0.95,
        "seed": 1234,
        "presence_penalty": 0.6,
        "frequency_penalty": 0.4,
        "stop": ["\n\n", "return"],
        "max_tokens": 48,
        "logprobs": True,
        "top_logprobs": 2,
    }
    inputs = vllm_inputs(body, chat=True, tokenizer=default_model.tokenizer)
    responses = infer(server, "lookahead", inputs, "chat-sampled")
    params = SamplingParams(
        max_tokens=48, temperature=0.8, top_p=0.95, seed=1234, presence_penalty=0.6, frequency_penalty=0.4,
        stop=("\n\n", "return"), logprobs=2, ignore_eos=False,
    )  # fmt: skip
    expected, prompt_tokens, output_tokens = library_text(default_model, inputs["text_input"], params)
    assert text_of(responses) == expected
    assert "return" not in expected and "\n\n" not in expected
    assert usage(responses) == (prompt_tokens, output_tokens)
    entries = [entry for r in responses for entry in (chat_logprobs(r) or [])]
    assert len(entries) == output_tokens
    assert all(len(e["top_logprobs"]) in (2, 3) and e["logprob"] <= 0 for e in entries)


def test_a_completion_with_echo_and_one_with_echo_while_streaming(server, default_model):
    body = {
        "model": "lookahead",
        "prompt": "def add(a, b):",
        "echo": True,
        "temperature": 0,
        "max_tokens": 12,
    }
    inputs = vllm_inputs(body, chat=False, tokenizer=default_model.tokenizer)
    responses = infer(server, "lookahead", inputs, "completion-echo")
    check_non_streaming(responses)
    expected, _, _ = library_text(default_model, body["prompt"], SamplingParams(max_tokens=12, temperature=0))
    assert text_of(responses) == body["prompt"] + expected
    streaming = vllm_inputs({**body, "stream": True}, chat=False, tokenizer=default_model.tokenizer)
    with pytest.raises(Exception, match=STREAMING_ECHO_ERROR.replace("`", ".")):
        infer(server, "lookahead", streaming, "completion-echo-stream")


def test_a_completion_asking_for_n_2_gets_two_samples(server, default_model):
    """The frontend's completion default is temperature 1: two seeded samples, an element each."""
    body = {"model": "lookahead", "prompt": "Hello", "n": 2, "max_tokens": 4, "seed": 5, "ignore_eos": True}
    responses = infer(
        server, "lookahead", vllm_inputs(body, chat=False, tokenizer=default_model.tokenizer), "n2"
    )
    check_non_streaming(responses)
    texts = [text.decode() for text in responses[-1].as_numpy("text_output")]
    assert len(texts) == 2 and all(texts)
    assert responses[-1].as_numpy("num_output_tokens").tolist() == [4, 4]
