"""Tool calls read off each family's output, whole and streamed, as the openai SDK reads them back."""

from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from frontend.app import ChatFormat
from frontend.tool_calls import (
    FAMILIES,
    NamedCall,
    ParsedCalls,
    RequiredCalls,
    ToolCall,
    family_for_template,
    hermes,
    llama3,
    mistral,
)

WEATHER = {"location": "Paris", "unit": "celsius"}
ARGS = json.dumps(WEATHER)

# (family, a model's output, the content before the calls, the calls)
OUTPUTS = [
    (
        hermes.FAMILY,
        f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>',
        "",
        [("get_weather", ARGS)],
    ),
    (
        hermes.FAMILY,
        f'Let me check.\n<tool_call>\n{{"name": "a", "arguments": {{}}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "b", "arguments": {ARGS}}}\n</tool_call>',
        "Let me check.\n",
        [("a", "{}"), ("b", ARGS)],
    ),
    (hermes.FAMILY, f'<tool_call>[{{"name": "a", "arguments": {ARGS}}}]</tool_call>', "", [("a", ARGS)]),
    (hermes.FAMILY, f' {{"name": "get_weather", "arguments": {ARGS}}}', "", [("get_weather", ARGS)]),
    (hermes.FAMILY, f'```json\n{{"name": "a", "arguments": {ARGS}}}\n```', "", [("a", ARGS)]),
    (
        hermes.FAMILY,
        f'{{"name": "a", "arguments": {ARGS}}}\n{{"name": "b", "arguments": {{}}}}\n{{"',
        "",
        [("a", ARGS), ("b", "{}")],
    ),
    (llama3.FAMILY, f'{{"name": "get_weather", "parameters": {ARGS}}}', "", [("get_weather", ARGS)]),
    (
        llama3.FAMILY,
        f'<|python_tag|>{{"name": "a", "parameters": {{}}}}; {{"name": "b", "parameters": {ARGS}}}',
        "",
        [("a", "{}"), ("b", ARGS)],
    ),
    (
        mistral.FAMILY,
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}}}]',
        "",
        [("get_weather", ARGS)],
    ),
    (mistral.FAMILY, f"[TOOL_CALLS]get_weather[ARGS]{ARGS}", "", [("get_weather", ARGS)]),
]


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize(("family", "output", "content", "calls"), OUTPUTS)
def test_each_family_gives_its_calls_whole_and_streamed(family, output, content, calls):
    whole = ChatFormat(0, ParsedCalls(family)).choice(output, None, "stop")
    message = ChatCompletion.model_validate(completion([whole])).choices[0].message
    assert (message.content or "") == content and whole["finish_reason"] == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == calls
    streamed = reassembled(ChatFormat(0, ParsedCalls(family)), pieces(output))
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert (streamed.choices[0].message.content or "") == content
    assert [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls] == calls


def test_a_streamed_call_sends_its_name_first_then_its_arguments():
    form = ChatFormat(0, NamedCall("get_weather"))
    chunks = [c for piece in pieces(ARGS, 5) for c in form.deltas(piece, None, None)] + form.deltas(
        "", None, "stop"
    )
    first = chunks[0]["delta"]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["id"].startswith("call_")
    arguments = [c["delta"]["tool_calls"][0]["function"]["arguments"] for c in chunks[1:-1]]
    assert len(arguments) > 1 and "".join(arguments) == ARGS
    assert chunks[-1]["finish_reason"] == "tool_calls" and chunks[-1]["delta"] == {}


@pytest.mark.parametrize(
    "output",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris",}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Par',
    ],
)
def test_arguments_that_are_not_json_come_back_as_written(output):
    message = ChatFormat(0, ParsedCalls(hermes.FAMILY)).choice(output, None, "stop")["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert message["tool_calls"][0]["function"]["arguments"].startswith('{"location": "Par')


@pytest.mark.parametrize(
    "output",
    [
        "<tool_call>\nnot a call at all\n</tool_call>",
        '```json\n{"key": "a JSON answer"}\n```',
        "Plain text with <tool_call in it",
        "{not json",
    ],
)
def test_text_that_reads_as_no_call_is_content(output):
    family = llama3.FAMILY if output.startswith("{") else hermes.FAMILY
    whole = ChatFormat(0, ParsedCalls(family)).choice(output, None, "stop")
    assert whole["message"] == {"role": "assistant", "content": output} and whole["finish_reason"] == "stop"
    streamed = reassembled(ChatFormat(0, ParsedCalls(family)), pieces(output))
    assert streamed.choices[0].message.content == output and not streamed.choices[0].message.tool_calls


def test_content_streams_before_the_calls_open_and_a_marker_split_across_pieces_is_held_back():
    form = ChatFormat(0, ParsedCalls(hermes.FAMILY))
    first = form.deltas("Sure <tool", None, None)
    assert [c["delta"].get("content") for c in first] == ["Sure "]
    assert form.deltas('_call>{"name": "f", "arguments": {}}', None, None) == []
    call = form.deltas("</tool_call>", None, None)
    assert call[0]["delta"]["tool_calls"][0]["function"]["name"] == "f"


def test_parallel_tool_calls_false_keeps_the_first_call():
    output = OUTPUTS[1][1]
    message = ChatFormat(0, ParsedCalls(hermes.FAMILY, parallel=False)).choice(output, None, "stop")[
        "message"
    ]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["a"]


def test_required_reads_the_constrained_list_and_a_cut_output_is_content():
    output = json.dumps([{"name": "a", "parameters": WEATHER}, {"name": "b", "parameters": {}}])
    message = ChatFormat(0, RequiredCalls()).choice(output, None, "stop")["message"]
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
    ] == [
        ("a", WEATHER),
        ("b", {}),
    ]
    cut = ChatFormat(0, RequiredCalls()).choice(output[:10], None, "length")
    assert cut["message"]["content"] == output[:10] and cut["finish_reason"] == "length"


def test_mistral_calls_get_the_nine_character_ids_its_templates_take():
    message = ChatFormat(0, ParsedCalls(mistral.FAMILY), mistral.FAMILY.call_id).choice(
        OUTPUTS[-2][1], None, "stop"
    )
    identifier = message["message"]["tool_calls"][0]["id"]
    assert len(identifier) == 9 and identifier.isalnum()


def test_a_template_names_its_family():
    assert family_for_template("{% if tools %}<tools></tools> <tool_call>{% endif %}") is hermes.FAMILY
    assert family_for_template("[AVAILABLE_TOOLS] [TOOL_CALLS]") is mistral.FAMILY
    llama = "Given the following functions, please respond with a JSON for a function call"
    assert family_for_template(llama) is llama3.FAMILY
    assert family_for_template("{{ messages }}") is None
    assert len({family.name for family in FAMILIES}) == len(FAMILIES)


def test_a_call_is_its_name_and_its_arguments_text():
    assert hermes.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', True) == [
        ToolCall("f", '{"a": 1}')
    ]


def completion(choices: list[dict]) -> dict:
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": choices}


def reassembled(form: ChatFormat, texts: list[str]) -> ChatCompletion:
    """The chunks a stream of `texts` sends, reassembled by the openai SDK's own stream state."""
    state = ChatCompletionStreamState()
    chunks = [c for text in texts for c in form.deltas(text, None, None)] + form.deltas("", None, "stop")
    for choice in chunks:
        state.handle_chunk(
            ChatCompletionChunk.model_validate(
                {**completion([]), "object": "chat.completion.chunk", "choices": [choice]}
            )
        )
    return state.get_final_completion()
