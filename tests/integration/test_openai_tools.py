"""Tool calling through the OpenAI endpoint with the official `openai` SDK, on the real
Qwen2.5-Coder-0.5B-Instruct (whose chat template renders tools, Hermes-style): each tool_choice,
a stream reassembled by the SDK's own helper, a whole agent loop, refusals naming the field; the
model's answers with lookahead equal its answers without (`use_lookahead` off), one instance
serving both so that the model loads once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from launcher import Frontend, TritonServer, free_port, start_frontend
from lookahead.models.embedded import prepare_embedded_model
from lookahead.models.loading import load_tokenizer
from tests.integration.servers import copy_repository, launch, set_parameter

MODEL = "qwen2.5-coder-0.5b-instruct"
MAX_TOKENS = 40
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    load_tokenizer(MODEL)  # the GGUF and its tokenizer, made once before the two instances look for them
    prepare_embedded_model(MODEL)
    root = tmp_path_factory.mktemp("tools")
    repository = copy_repository(root / "repository", root / "state", ("lookahead",))
    config = repository / "lookahead" / "config.pbtxt"
    text = set_parameter(config.read_text(), "model", MODEL)
    config.write_text(set_parameter(text, "max_prompt_tokens", "0"))  # the model's context length
    with launch(repository, root / "server.log", ready_timeout_s=1200) as running:
        yield running


@pytest.fixture(scope="module")
def endpoint(server: TritonServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    log: Path = tmp_path_factory.mktemp("tools-openai") / "frontend.log"
    with start_frontend(server.grpc_url, free_port(), log_file=log) as frontend:
        yield frontend


@pytest.fixture(scope="module")
def client(endpoint: Frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.url, api_key="none", max_retries=0, timeout=600)


def ask(client: openai.OpenAI, lookahead: bool = True, **request: Any) -> Any:
    extra = {} if lookahead else {"extra_body": {"use_lookahead": False}}
    return client.chat.completions.create(
        **{
            "model": "lookahead",
            "messages": ASK,
            "tools": TOOLS,
            "max_tokens": MAX_TOKENS,
            **extra,
            **request,
        }
    )


def calls(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def test_auto_returns_the_models_call_as_tool_calls_the_same_with_and_without_lookahead(client):
    reply = ask(client)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert calls(choice.message) and calls(choice.message)[0][0] == "get_weather"
    assert calls(choice.message)[0][1]["city"] == "Paris"
    assert (
        choice.message.tool_calls[0].id.startswith("call_")
        and choice.message.tool_calls[0].type == "function"
    )
    baseline = ask(client, lookahead=False).choices[0]
    assert (
        calls(baseline.message) == calls(choice.message)
        and baseline.message.content == choice.message.content
    )


def test_a_streamed_call_reassembled_by_the_sdk_equals_the_whole_one(client):
    whole = ask(client).choices[0].message
    with client.chat.completions.stream(
        model="lookahead", messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS
    ) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    assert calls(final.choices[0].message) == calls(whole)
    assert final.choices[0].finish_reason == "tool_calls"
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [(e.name, json.loads(e.arguments)) for e in done] == calls(whole)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_with_arguments_that_match_its_schema(client, stream):
    choice = {"type": "function", "function": {"name": "get_time"}}
    request = {"tool_choice": choice, "messages": [{"role": "user", "content": "Hello!"}]}
    if stream:
        with client.chat.completions.stream(
            model="lookahead", tools=TOOLS, max_tokens=MAX_TOKENS, **request
        ) as streamed:
            message = streamed.get_final_completion().choices[0].message
    else:
        message = ask(client, **request).choices[0].message
    [(name, arguments)] = calls(message)
    assert name == "get_time" and isinstance(arguments["zone"], str)
    assert calls(ask(client, lookahead=False, **request).choices[0].message) == [(name, arguments)]


def test_required_makes_a_call_and_none_makes_none(client):
    required = ask(client, tool_choice="required", messages=[{"role": "user", "content": "Hello!"}])
    assert required.choices[0].finish_reason == "tool_calls"
    assert {name for name, _ in calls(required.choices[0].message)} <= {"get_weather", "get_time"}
    assert calls(required.choices[0].message)
    none = ask(client, tool_choice="none", max_tokens=8)
    assert not none.choices[0].message.tool_calls and none.choices[0].message.content
    assert none.choices[0].finish_reason in ("stop", "length")


def test_an_agent_loop_sends_the_call_and_its_result_back_and_goes_on(client):
    """Call, result, next turn: the SDK's own message object and the tool's result are rendered
    into the next prompt, and the next turn's answer is read. (The 0.5B model calls the tool
    again rather than answering; its answer, call or text, is the same without lookahead.)"""
    messages: list[Any] = list(ASK)
    first = ask(client, messages=messages).choices[0].message
    assert first.tool_calls
    messages.append(first)  # the SDK's own message object, as agents send it back
    result = '{"temperature": 21, "sky": "sunny"}'
    messages.append({"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": result})
    final = ask(client, messages=messages, max_tokens=24)
    answer = final.choices[0]
    assert answer.message.tool_calls or answer.message.content
    asked = ask(client, max_tokens=1).usage.prompt_tokens
    assert final.usage.prompt_tokens > asked + 20  # the call and its result came back as prompt
    baseline = ask(client, lookahead=False, messages=messages, max_tokens=24).choices[0]
    assert (baseline.message.content, calls(baseline.message)) == (
        answer.message.content,
        calls(answer.message),
    )


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({"type": "function", "function": {"name": "get weather"}}, "tools.0.function.name"),
        ({"type": "function"}, "tools.0.function"),
        ({"type": "function", "function": {"name": "f", "parameters": []}}, "tools.0.function.parameters"),
        ({"type": "retrieval", "function": {"name": "f"}}, "tools.0.type"),
    ],
)
def test_a_malformed_tool_gets_a_400_naming_the_field(client, tool, param):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, tools=[tool])
    assert caught.value.body["param"] == param
    assert ask(client, max_tokens=1).choices[0].finish_reason == "length"  # the server still answers
