"""The OpenAI endpoint's translation: request bodies -> sampling_parameters or a 400 naming the
field, vLLM's logprobs JSON -> OpenAI's logprobs, Triton's error messages -> HTTP statuses."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import ValidationError

from frontend import app
from frontend.app import ChatFormat, TextFormat, with_prompt_logprobs
from frontend.errors import APIError, from_triton, from_validation
from frontend.protocol import ChatCompletionRequest, CompletionRequest
from frontend.triton import Piece, TokenLogprob, token_logprobs

USER = [{"role": "user", "content": "hi"}]


def chat(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "lookahead", "messages": USER, **body})


def refusal(schema: type, body: dict[str, Any]) -> APIError:
    with pytest.raises(ValidationError) as caught:
        schema.model_validate(body)
    return from_validation(caught.value)


def test_only_what_the_body_sets_is_sent_so_the_models_defaults_apply():
    assert chat().sampling_parameters() == {}
    sampling = chat(
        max_tokens=9,
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        stop="\n",
        presence_penalty=0.1,
        frequency_penalty=0.2,
        logit_bias={"42": -100},
        logprobs=True,
        top_logprobs=4,
        ignore_eos=True,
        min_tokens=2,
        decoding_mode="one",
        use_lookahead=False,
    ).sampling_parameters()
    assert sampling == {
        "max_tokens": 7,  # max_completion_tokens wins
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "stop": "\n",
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "logit_bias": {"42": -100.0},
        "logprobs": 4,
        "ignore_eos": True,
        "min_tokens": 2,
        "decoding_mode": "one",
        "use_lookahead": False,
    }
    assert chat(logprobs=True).sampling_parameters() == {"logprobs": 0}  # the chosen token only
    completion = CompletionRequest.model_validate(
        {"model": "m", "prompt": ["p"], "logprobs": 2, "max_tokens": 5}
    )
    assert completion.text == "p" and completion.sampling_parameters() == {"logprobs": 2, "max_tokens": 5}
    assert not completion.scores_prompt


def test_echo_with_logprobs_asks_for_the_prompts_logprobs_as_vllm_names_them():
    echoed = CompletionRequest.model_validate({"model": "m", "prompt": "p", "echo": True, "logprobs": 3})
    assert echoed.scores_prompt
    assert echoed.sampling_parameters() == {"logprobs": 3, "prompt_logprobs": 3}
    plain_echo = CompletionRequest.model_validate({"model": "m", "prompt": "p", "echo": True})
    assert not plain_echo.scores_prompt and plain_echo.sampling_parameters() == {}


def test_the_prompts_tokens_lead_the_logprobs_the_first_without_any():
    def position(token: str, logprob: float) -> dict:
        return {"9": {"logprob": logprob, "rank": 1, "decoded_token": token}}

    scored = token_logprobs(json.dumps([None, position(" b", -1.5), position(" c", -0.5)]), top=1)
    generated = token_logprobs(json.dumps([position(" d", -0.25)]), top=1)
    piece = with_prompt_logprobs(Piece(" d", 1, logprobs=generated, prompt_logprobs=scored), first_token="a")
    assert piece.logprobs[0] == TokenLogprob("a", None, None)
    assert TextFormat(0).logprobs(piece.logprobs) == {
        "tokens": ["a", " b", " c", " d"],
        "token_logprobs": [None, -1.5, -0.5, -0.25],
        "top_logprobs": [None, {" b": -1.5}, {" c": -0.5}, {" d": -0.25}],
        "text_offset": [0, 1, 3, 5],
    }


def test_response_format_becomes_vllms_structured_outputs():
    assert chat(response_format={"type": "text"}).sampling_parameters() == {}
    assert chat(response_format={"type": "json_object"}).sampling_parameters() == {
        "structured_outputs": {"json_object": True}
    }
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert body.sampling_parameters() == {"structured_outputs": {"json": schema}}


def test_chat_messages_reach_the_template_as_text():
    body = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    )
    assert [m.template_message() for m in body.messages] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}


def test_tools_and_the_conversation_reach_the_template_as_templates_read_them():
    body = chat(
        tools=[TOOL, {"type": "function", "function": {"name": "now", "strict": True}}],
        messages=[
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None},
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
        ],
    )
    assert body.template_tools() == [
        TOOL,
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
    ]
    assert [m.template_message() for m in body.messages][1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    assert "structured_outputs" not in body.sampling_parameters()  # auto: the model's own syntax, parsed


def test_a_named_or_required_tool_choice_constrains_the_output():
    named = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.sampling_parameters()["structured_outputs"] == {"json": TOOL["function"]["parameters"]}
    required = chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    listed = required.sampling_parameters()["structured_outputs"]["json"]
    assert listed["type"] == "array" and listed["minItems"] == 1 and listed["maxItems"] == 1
    call = listed["items"]["anyOf"][0]
    assert call["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert call["properties"]["parameters"] == TOOL["function"]["parameters"]
    assert not chat(tools=[TOOL], tool_choice="none").calls_tools


@pytest.mark.parametrize(
    ("schema", "body", "param", "words"),
    [
        (ChatCompletionRequest, {"n": 17}, "n", "less than or equal to 16"),
        (ChatCompletionRequest, {"tools": [{"type": "function"}]}, "tools.0.function", "Field required"),
        (
            ChatCompletionRequest,
            {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
            "tools.0.function.name",
            "should match pattern",
        ),
        (
            ChatCompletionRequest,
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools.0.function.parameters",
            "valid dictionary",
        ),
        (ChatCompletionRequest, {"tools": [TOOL, TOOL]}, "tools", "same name"),
        (ChatCompletionRequest, {"tool_choice": "auto"}, "tool_choice", "needs tools"),
        (ChatCompletionRequest, {"tool_choice": "any", "tools": [TOOL]}, "tool_choice", ""),
        (
            ChatCompletionRequest,
            {"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [TOOL]},
            "tool_choice",
            "'g' is not among the tools",
        ),
        (
            ChatCompletionRequest,
            {"tool_choice": "required", "tools": [TOOL], "response_format": {"type": "json_object"}},
            "tool_choice",
            "both constrain",
        ),
        (ChatCompletionRequest, {"functions": [TOOL["function"]]}, "functions", "not supported"),
        (ChatCompletionRequest, {"audio": {"voice": "x"}}, "audio", "not supported"),
        (ChatCompletionRequest, {"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        (
            ChatCompletionRequest,
            {"top_logprobs": 21, "logprobs": True},
            "top_logprobs",
            "less than or equal to 20",
        ),
        (ChatCompletionRequest, {"temperature": 3}, "temperature", "less than or equal to 2"),
        (ChatCompletionRequest, {"messages": []}, "messages", "at least 1"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content",
            "only text parts",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages.0",
            "tool_call_id",
        ),
        (ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "user"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
            "messages.0",
            "only assistant messages",
        ),
        (CompletionRequest, {"prompt": ["a", "b"]}, "prompt", ""),
        (CompletionRequest, {"prompt": "a", "best_of": 0}, "best_of", "greater than or equal to 1"),
    ],
)
def test_a_refusal_names_the_field(schema, body, param, words):
    base = {"model": "m", "messages": USER} if schema is ChatCompletionRequest else {"model": "m"}
    error = refusal(schema, {**base, **body})
    assert error.status == 400 and error.kind == "invalid_request_error"
    assert (error.param or "").startswith(param) and words in error.message
    assert error.body()["error"]["message"] == error.message


def test_vllm_logprobs_become_the_chosen_token_and_the_top_ones_by_rank():
    def entry(logprob: float, rank: int, token: str) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token}

    raw = json.dumps(
        [
            {"7": entry(-3.0, 5, "x"), "1": entry(-0.1, 1, "a"), "2": entry(-0.5, 2, "b")},
            {"1": entry(-0.2, 1, "a"), "3": entry(-2.0, 2, "c")},
        ]
    )
    first, second = token_logprobs(raw, top=2)
    assert (first.token, first.logprob, first.top) == ("x", -3.0, [("a", -0.1), ("b", -0.5)])
    assert (second.token, second.logprob, second.top) == ("a", -0.2, [("a", -0.2), ("c", -2.0)])
    assert token_logprobs(raw, top=0)[0].top == []
    assert token_logprobs("null", top=2) is None


def test_openai_logprob_objects_chat_and_text():
    positions = [
        {"5": {"logprob": -0.5, "rank": 1, "decoded_token": "é"}},
        {"6": {"logprob": -1.0, "rank": 1, "decoded_token": "ab"}},
    ]
    tokens = token_logprobs(json.dumps(positions), top=1)
    content = ChatFormat.logprobs(tokens)["content"]
    assert content[0] == {
        "token": "é",
        "logprob": -0.5,
        "bytes": [0xC3, 0xA9],
        "top_logprobs": [{"token": "é", "logprob": -0.5, "bytes": [0xC3, 0xA9]}],
    }
    text = TextFormat(offset=3)  # after an echoed three-character prompt
    assert text.logprobs(tokens[:1]) == {
        "tokens": ["é"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"é": -0.5}],
        "text_offset": [3],
    }
    assert text.logprobs(tokens[1:])["text_offset"] == [4]  # offsets run on across chunks


def test_the_first_chat_chunk_names_the_role_and_the_last_has_only_the_finish_reason():
    form = ChatFormat()
    assert form.delta("", None, None)["delta"] == {"role": "assistant", "content": ""}
    assert form.delta("Hi", None, None)["delta"] == {"content": "Hi"}
    assert form.delta("", None, "stop") == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }


@pytest.mark.parametrize(
    ("message", "status"),
    [
        ("max_tokens must be <= 1024 on this model, got 5000", 400),
        ("decoding_mode must be one of hier, par, one, got 'x'", 400),
        ("Error generating text: out of memory", 500),
        ("the engine thread failed (boom); the model must be reloaded (see the server log)", 503),
        ("the model is being unloaded; the request was not completed", 503),
    ],
)
def test_triton_errors_map_to_statuses(message, status):
    error = from_triton(message)
    assert (error.status, error.message) == (status, message)


@pytest.mark.parametrize(
    "message",
    [
        "the queue is full (256 requests wait, max_queued_requests); retry later",
        "the request waited 5.2 s in the queue, more than queue_timeout_s (5); retry later",
        "the server is shutting down; the request was not completed",
        "the model is being unloaded; the request was not completed",
        "Stub process 'lookahead_0_0' is not healthy.",  # its process died: the launcher restarts it
    ],
)
def test_a_busy_or_stopping_server_is_503_with_retry_after(message):
    error = from_triton(message)
    assert (error.status, error.kind, error.retry_after_s) == (503, "server_error", 1)
    assert error.response().headers["retry-after"] == "1"


def test_n_and_best_of_go_to_the_server_as_vllms_keys():
    assert chat(n=3, temperature=0.7).sampling_parameters() == {"n": 3, "temperature": 0.7}
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "p", "n": 2, "best_of": 4})
    assert completion.sampling_parameters() == {"n": 2, "best_of": 4}


class Connected:
    """A client that never leaves."""

    async def race(self, awaitable):
        return await awaitable

    def close(self) -> None:
        pass


def test_streamed_choices_carry_their_index_and_each_its_own_finish_reason():
    responses = [
        [Piece("Hi", 1, 3, index=0), Piece("Yo", 1, 3, finish_reason="stop", index=1)],
        [
            Piece("!", 1, 3, finish_reason="length", index=0, final=True),
            Piece("", 0, 3, finish_reason="stop", index=1, final=True),
        ],
    ]

    async def rest():
        for pieces in responses[1:]:
            yield pieces

    async def events() -> list[str]:
        forms = [ChatFormat(0), ChatFormat(1)]
        stream = app.stream(rest(), responses[0], Connected(), {"id": "x"}, forms, "", include_usage=True)
        return [event async for event in stream]

    sent = asyncio.run(events())
    chunks = [json.loads(event[len("data: ") :]) for event in sent[:-1]]
    assert sent[-1] == "data: [DONE]\n\n"
    choices = [
        (c["index"], c["delta"].get("content"), c["finish_reason"]) for k in chunks[:-1] for c in k["choices"]
    ]
    assert choices == [(0, "Hi", None), (1, "Yo", "stop"), (0, "!", "length")]
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
