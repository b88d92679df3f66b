"""Structured outputs through a real tritonserver: lookahead's constrained output equals the
baseline's (plain constrained decoding) and parses against its schema; bad constraints get
INVALID_ARG naming the key and the reason, and the server stays ready."""

from __future__ import annotations

import json
import re

import pytest

from bench.json_extraction import json_extraction_prompts, schema_errors
from client.api import Completion, LookaheadClient
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import load_tokenizer
from tests.integration.test_server import is_ready, post


@pytest.fixture(scope="module")
def extraction() -> tuple[str, dict]:
    """A chat prompt of the JSON-extraction set and its schema."""
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    prompt = json_extraction_prompts(1)[0]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt.instruction}], tokenize=False, add_generation_prompt=True
    )
    return text, prompt.schema


def complete(server, model: str, prompt: str, **sampling) -> Completion:
    """Over gRPC streaming, with no client deadline: steps are slow on two shared cores."""
    return LookaheadClient(server.grpc_url, model=model, timeout_s=None).generate(prompt, **sampling)


def test_lookahead_json_equals_plain_constrained_decoding_and_parses(server, extraction):
    prompt, schema = extraction
    lookahead = complete(server, "lookahead", prompt, max_tokens=96, structured_outputs={"json": schema})
    baseline = complete(server, "baseline", prompt, max_tokens=96, structured_outputs={"json": schema})
    assert lookahead.text == baseline.text
    assert lookahead.finish_reason == baseline.finish_reason == "stop"
    assert schema_errors(json.loads(lookahead.text), schema) == []
    assert lookahead.perf["total_accepted_draft_tokens"] > 0


def body(prompt: str, **sampling) -> dict:
    return {
        "text_input": prompt,
        "exclude_input_in_output": True,
        "return_finish_reason": True,
        "sampling_parameters": json.dumps({"max_tokens": 16, **sampling}),
    }


def test_older_keys_and_other_kinds_constrain_the_output(server, extraction):
    prompt = extraction[0]
    status, text = post(
        server,
        "/v2/models/lookahead/generate",
        body(prompt, guided_decoding={"regex": "[A-Z][a-z]{1,9} [A-Z][a-z]{1,9}"}, max_tokens=24),
    )
    assert status == 200, text
    reply = json.loads(text)
    assert (
        re.fullmatch("[A-Z][a-z]{1,9} [A-Z][a-z]{1,9}", reply["text_output"])
        and reply["finish_reason"] == "stop"
    )
    status, text = post(server, "/v2/models/baseline/generate", body(prompt, guided_choice=["yes", "no"]))
    assert status == 200, text
    assert json.loads(text)["text_output"] in ("yes", "no")


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
