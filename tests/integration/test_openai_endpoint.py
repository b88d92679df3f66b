"""The OpenAI-compatible endpoint (frontend/) through the official `openai` SDK, against a real
tritonserver: every answer is checked against the same request sent to the model over gRPC."""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from launcher import Frontend, TritonServer, free_port, start_frontend
from lookahead.models.chat import chat_prompt
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import load_tokenizer

MESSAGES = [
    {"role": "system", "content": "You are a helpful programmer."},
    {"role": "user", "content": "Write a Python function that adds two numbers."},
]
CODE = "def fibonacci(n):"


@dataclass(frozen=True)
class Reference:
    """One request's answer straight from the model over gRPC."""

    text: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str


@pytest.fixture(scope="module")
def endpoint(server: TritonServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    log = tmp_path_factory.mktemp("openai") / "frontend.log"
    with start_frontend(server.grpc_url, free_port(), log_file=log) as frontend:
        yield frontend


@pytest.fixture(scope="module")
def client(endpoint: Frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.url, api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(DEFAULT_MODEL)


def grpc_reference(server: TritonServer, model: str, prompt: str, sampling: dict[str, Any]) -> Reference:
    """The model's own answer to `prompt` over gRPC streaming (no echo)."""
    responses: queue.Queue = queue.Queue()
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    tensors = []
    for name, value in {
        "text_input": prompt,
        "sampling_parameters": json.dumps(sampling),
        "exclude_input_in_output": True,
        "return_finish_reason": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
    }.items():
        kind = "BOOL" if isinstance(value, bool) else "BYTES"
        tensor = grpcclient.InferInput(name, [1], kind)
        data = [value] if isinstance(value, bool) else [value.encode()]
        tensor.set_data_from_numpy(np.array(data, dtype=bool if kind == "BOOL" else np.object_))
        tensors.append(tensor)
    grpc.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        grpc.async_stream_infer(model, tensors)
        text, output_tokens = "", 0
        while True:
            result, error = responses.get(timeout=300)
            assert error is None, error
            text += result.as_numpy("text_output")[0].decode()
            output_tokens += int(result.as_numpy("num_output_tokens")[0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                return Reference(
                    text,
                    int(result.as_numpy("num_input_tokens")[0]),
                    output_tokens,
                    result.as_numpy("finish_reason")[0].decode(),
                )
    finally:
        grpc.stop_stream()
        grpc.close()


def test_the_models_and_health(client: openai.OpenAI, endpoint: Frontend) -> None:
    assert {"lookahead", "baseline"} <= {model.id for model in client.models.list()}
    assert client.models.retrieve("lookahead").id == "lookahead"
    with urllib.request.urlopen(f"http://localhost:{endpoint.port}/health", timeout=10) as reply:
        assert reply.status == 200


@pytest.mark.parametrize("model", ["lookahead", "baseline"])
def test_a_greedy_chat_completion_is_the_models_own_answer(server, client, tokenizer, model):
    answer = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=24)
    prompt = chat_prompt(tokenizer, MESSAGES)
    reference = grpc_reference(server, "lookahead", prompt, {"temperature": 0, "max_tokens": 24})
    choice = answer.choices[0]
    assert answer.object == "chat.completion" and answer.model == model
    assert choice.message.role == "assistant"
    assert choice.message.content == reference.text
    assert choice.finish_reason == reference.finish_reason
    assert answer.usage.prompt_tokens == len(tokenizer.encode(prompt)) == reference.prompt_tokens
    assert answer.usage.completion_tokens == reference.output_tokens
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_a_streamed_chat_completion_with_usage_last(client):
    whole = client.chat.completions.create(model="lookahead", messages=MESSAGES, temperature=0, max_tokens=32)
    chunks = list(
        client.chat.completions.create(
            model="lookahead",
            messages=MESSAGES,
            temperature=0,
            max_completion_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id for chunk in chunks)
    *content_chunks, usage_chunk = chunks
    assert (
        "".join(c.choices[0].delta.content or "" for c in content_chunks) == whole.choices[0].message.content
    )
    assert [c.choices[0].finish_reason for c in content_chunks[-1:]] == [whole.choices[0].finish_reason]
    assert all(c.choices[0].finish_reason is None and c.usage is None for c in content_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage


def test_n_samples_are_n_choices_whole_and_streamed(client):
    options = dict(model="lookahead", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=3, n=2)
    whole = client.chat.completions.create(**options)
    assert [choice.index for choice in whole.choices] == [0, 1]
    assert all(choice.message.content for choice in whole.choices)
    chunks = list(
        client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True})
    )
    *content_chunks, usage_chunk = chunks
    streamed = ["", ""]
    finished = [None, None]
    for chunk in content_chunks:
        (choice,) = chunk.choices
        streamed[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert streamed == [choice.message.content for choice in whole.choices]  # seeded: the same samples
    assert finished == [choice.finish_reason for choice in whole.choices]
    assert usage_chunk.usage == whole.usage


def test_max_tokens_with_ignore_eos_ends_by_length(client):
    answer = client.chat.completions.create(
        model="lookahead", messages=MESSAGES, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 40


def test_text_completions_whole_streamed_and_echoed(server, client, tokenizer):
    reference = grpc_reference(server, "lookahead", CODE, {"temperature": 0, "max_tokens": 16})
    whole = client.completions.create(model="lookahead", prompt=CODE, temperature=0, max_tokens=16)
    assert whole.object == "text_completion" and whole.choices[0].text == reference.text
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        len(tokenizer.encode(CODE)),
        reference.output_tokens,
    )
    echoed = client.completions.create(
        model="lookahead", prompt=[CODE], temperature=0, max_tokens=16, echo=True
    )
    assert echoed.choices[0].text == CODE + reference.text
    streamed = client.completions.create(
        model="lookahead", prompt=CODE, temperature=0, max_tokens=16, echo=True, stream=True
    )
    chunks = list(streamed)
    assert "".join(chunk.choices[0].text for chunk in chunks) == CODE + reference.text
    assert chunks[-1].choices[0].finish_reason == reference.finish_reason
    assert all(chunk.usage is None for chunk in chunks)


def test_the_sampling_parameters_reach_the_model(server, client, tokenizer):
    sampling = {
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 11,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
        "stop": ["\n\n"],
        "logit_bias": {str(tokenizer.encode(" def")[0]): -100.0},
        "max_tokens": 40,
    }
    reference = grpc_reference(server, "lookahead", chat_prompt(tokenizer, MESSAGES), sampling)
    answers = [
        client.chat.completions.create(model="lookahead", messages=MESSAGES, **sampling)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert answers == [reference.text, reference.text]
    greedy = client.chat.completions.create(
        model="lookahead", messages=MESSAGES, temperature=0, max_tokens=40
    )
    assert greedy.choices[0].message.content != reference.text  # the sampling really changed the answer


def test_logprobs_have_one_entry_per_token(client):
    answer = client.chat.completions.create(
        model="lookahead", messages=MESSAGES, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 8
    assert "".join(entry.token for entry in content) == answer.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode())
    streamed = client.chat.completions.create(
        model="lookahead", messages=MESSAGES, temperature=0, max_tokens=8, logprobs=True, stream=True
    )
    entries = [
        e
        for chunk in streamed
        for e in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])
    ]
    assert [e.token for e in entries] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in entries)

    text = client.completions.create(model="lookahead", prompt=CODE, temperature=0, max_tokens=8, logprobs=2)
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == text.usage.completion_tokens == 8
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]


def test_echo_with_logprobs_scores_the_prompts_tokens_first(client, tokenizer):
    plain = client.completions.create(model="lookahead", prompt=CODE, temperature=0, max_tokens=8, logprobs=2)
    echoed = client.completions.create(
        model="lookahead", prompt=CODE, temperature=0, max_tokens=8, logprobs=2, echo=True
    )
    prompt_ids = tokenizer.encode(CODE)
    count = len(prompt_ids)
    logprobs = echoed.choices[0].logprobs
    assert echoed.choices[0].text == CODE + plain.choices[0].text
    assert logprobs.tokens == [tokenizer.decode([i]) for i in prompt_ids] + plain.choices[0].logprobs.tokens
    assert "".join(logprobs.tokens) == echoed.choices[0].text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing precedes it
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:count])
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs[1:count])  # the token and the top 2
    # the same tokens, their logprobs from other forwards (a scored prompt, or one from the prefix cache)
    assert logprobs.token_logprobs[count:] == pytest.approx(
        plain.choices[0].logprobs.token_logprobs, abs=1e-4
    )
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(count + 8)]
    streamed = client.completions.create(
        model="lookahead", prompt=CODE, temperature=0, max_tokens=8, logprobs=2, echo=True, stream=True
    )
    chunks = [chunk.choices[0].logprobs for chunk in streamed if chunk.choices[0].logprobs]
    assert [t for chunk in chunks for t in chunk.tokens] == logprobs.tokens
    assert [o for chunk in chunks for o in chunk.text_offset] == logprobs.text_offset


def test_refusals_name_the_field(client):
    def refused(error: type[openai.APIStatusError], **request: Any) -> openai.APIStatusError:
        with pytest.raises(error) as caught:
            client.chat.completions.create(**{"model": "lookahead", "messages": MESSAGES, **request})
        return caught.value

    n = refused(openai.BadRequestError, n=2)  # greedy without a temperature: vLLM's refusal
    assert n.status_code == 400 and "n must be 1 when using greedy sampling, got 2" in n.body["message"]
    unknown = refused(openai.NotFoundError, model="gpt-4o")
    assert unknown.body["code"] == "model_not_found" and "gpt-4o" in unknown.body["message"]
    tools = refused(openai.BadRequestError, tools=[{"type": "function", "function": {"name": "f"}}])
    assert tools.body["param"] == "tools" and "model `lookahead` has no tools" in tools.body["message"]
    unknown_field = refused(openai.BadRequestError, extra_body={"best_of_luck": 1})
    assert unknown_field.body["param"] == "best_of_luck"
    # refused by the server (INVALID_ARG), streaming or not: a 400 before any event
    mode = refused(openai.BadRequestError, stream=True, extra_body={"decoding_mode": "diagonal"})
    assert "decoding_mode" in mode.body["message"]
    too_long = refused(openai.BadRequestError, max_tokens=100000)
    assert "max_tokens" in too_long.body["message"]
    # the endpoint and the server still answer
    assert client.chat.completions.create(
        model="lookahead", messages=MESSAGES, max_tokens=2
    ).usage.completion_tokens


def _generated_tokens(server: TritonServer) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    pattern = r'^lookahead_generation_tokens_total\{[^}]*model="lookahead"[^}]*\} (\S+)$'
    return sum(float(value) for value in re.findall(pattern, text, flags=re.MULTILINE))


def _settled_tokens(server: TritonServer) -> float:
    """The counter once earlier requests' updates have landed (metrics are applied asynchronously)."""
    value = _generated_tokens(server)
    while True:
        time.sleep(1.0)
        value, previous = _generated_tokens(server), value
        if value == previous:
            return value


def _wait_for_change(server: TritonServer, before: float, timeout_s: float = 240) -> float:
    deadline = time.monotonic() + timeout_s
    while (after := _generated_tokens(server)) == before:
        assert time.monotonic() < deadline, "the request never finished"
        time.sleep(0.5)
    return after - before


def test_a_client_that_goes_away_cancels_the_request(server, client):
    long = {
        "model": "lookahead",
        "messages": MESSAGES,
        "max_tokens": 1000,
        "extra_body": {"ignore_eos": True},
    }
    before = _settled_tokens(server)
    stream = client.chat.completions.create(stream=True, **long)
    for _, _chunk in zip(range(3), stream):
        pass
    stream.close()
    assert _wait_for_change(server, before) < 1000

    before = _settled_tokens(server)
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=3).chat.completions.create(**long)
    assert _wait_for_change(server, before) < 1000
