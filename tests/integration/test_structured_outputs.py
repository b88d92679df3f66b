"""Structured outputs through a real tritonserver: lookahead's constrained output equals the
baseline's (plain constrained decoding) and parses against its schema; bad constraints get
INVALID_ARG naming the key and the reason, and the server stays ready."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from lookahead.benchmarks.json_extraction import json_extraction_prompts, schema_errors
from lookahead.models.embedded import prepare_default_model
from tests.integration.test_server import generate, is_ready, post


@pytest.fixture(scope="module")
def chat_prompts() -> list[tuple[str, dict]]:
    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    return [
        (
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p.instruction}], tokenize=False, add_generation_prompt=True
            ),
            p.schema,
        )
        for p in json_extraction_prompts(2)
    ]


def body(prompt: str, **sampling) -> dict:
    return {
        "text_input": prompt,
        "exclude_input_in_output": True,
        "return_finish_reason": True,
        "return_perf_metrics": True,
        "sampling_parameters": json.dumps({"max_tokens": 160, **sampling}),
    }


def test_lookahead_json_equals_plain_constrained_decoding_and_parses(server, chat_prompts):
    accepted = 0
    for prompt, schema in chat_prompts:
        constraint = {"structured_outputs": {"json": schema}}
        lookahead = generate(server, "lookahead", body(prompt, **constraint))
        baseline = generate(server, "baseline", body(prompt, **constraint))
        assert lookahead["text_output"] == baseline["text_output"]
        assert lookahead["finish_reason"] == baseline["finish_reason"] == "stop"
        assert schema_errors(json.loads(lookahead["text_output"]), schema) == []
        accepted += lookahead["total_accepted_draft_tokens"]
    assert accepted > 0


def test_older_keys_and_other_kinds_constrain_the_output(server, chat_prompts):
    prompt = chat_prompts[0][0]
    reply = generate(server, "lookahead", body(prompt, guided_decoding={"regex": "[A-Z][a-z]+ [A-Z][a-z]+"}))
    assert re.fullmatch("[A-Z][a-z]+ [A-Z][a-z]+", reply["text_output"])
    reply = generate(server, "lookahead", body(prompt, guided_choice=["yes", "no"]))
    assert reply["text_output"] in ("yes", "no")
    reply = generate(
        server, "baseline", body(prompt, structured_outputs={"json_object": True}, max_tokens=400)
    )
    assert isinstance(json.loads(reply["text_output"]), dict)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex: "),
        (
            {"structured_outputs": {"json": {"type": "objectx"}}},
            "structured_outputs.json: Invalid type: objectx",
        ),
        ({"guided_decoding": {"grammar": "start: missing"}}, "guided_decoding.grammar: "),
        ({"guided_json": "{not json"}, "guided_json must be a JSON schema"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs must set exactly one of",
        ),
    ],
)
def test_bad_constraints_get_invalid_arg_naming_the_key(server, constraint, message):
    status, text = post(server, "/v2/models/lookahead/generate", body("hi", **constraint))
    assert status == 400, text
    assert message in json.loads(text)["error"]
    assert is_ready(server)
