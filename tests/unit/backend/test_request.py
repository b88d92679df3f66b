"""Request tensors -> GenerationRequest (backend/request.py): vLLM's tensor contract, without Triton."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from backend.request import (
    STREAMING_ECHO_ERROR,
    DictInputs,
    GenerationRequest,
    RequestError,
    RequestLimits,
    parse_request,
)
from lookahead.config import LookaheadConfig, SamplingParams, StructuredOutputs
from tests.unit.backend.fakes import tokenize

LIMITS = RequestLimits(
    LookaheadConfig(decoding_length=16, branch_length=8), max_prompt_tokens=20, max_output_tokens=64
)


def strings(*values: str) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=np.object_)


def flag(value: bool) -> np.ndarray:
    return np.array([value], dtype=bool)


def parse(params: dict[str, Any] | None = None, limits: RequestLimits = LIMITS, **tensors: np.ndarray):
    tensors.setdefault("text_input", strings("Hello"))
    return parse_request(DictInputs(tensors, params), limits, tokenize)


def sampling(options: dict[str, Any]) -> np.ndarray:
    return strings(json.dumps(options))


# Parsing


def test_a_bare_prompt_gets_vllm_defaults():
    request = parse()
    assert request.prompt == "Hello"
    assert request.prompt_ids == tuple(tokenize("Hello"))
    assert request.sampling == SamplingParams(max_tokens=64)  # min(library default 128, max_output_tokens)
    assert request.lookahead == LIMITS.lookahead
    assert (request.stream, request.prepend_input) == (False, True)
    assert not (
        request.return_finish_reason or request.return_num_input_tokens or request.return_perf_metrics
    )


def test_sampling_parameters_accept_strings_and_ignore_unknown_keys():
    options = {
        "max_tokens": "8",
        "min_tokens": 2,
        "temperature": "0.5",
        "top_k": "5",
        "top_p": 0.9,
        "repetition_penalty": "1.1",
        "seed": "3",
        "stop": "\n\n",
        "ignore_eos": "true",
        "echo": True,  # no vLLM version knows it
        "n": "1",
        "best_of": 1,
        "logprobs": "false",
        "lora_name": "",
        "use_beam_search": False,
    }
    request = parse(sampling_parameters=sampling(options))
    assert request.sampling == SamplingParams(
        max_tokens=8,
        min_tokens=2,
        temperature=0.5,
        top_k=5,
        top_p=0.9,
        repetition_penalty=1.1,
        seed=3,
        stop=("\n\n",),
        ignore_eos=True,
        best_of=1,  # the OpenAI frontend's default, the same as n
    )


def test_stop_may_be_a_list_and_null_means_unset():
    request = parse(sampling_parameters=sampling({"stop": ["a", "b"], "seed": None, "max_tokens": 4.0}))
    assert request.sampling.stop == ("a", "b")
    assert request.sampling.seed is None
    assert request.sampling.max_tokens == 4


def test_request_parameters_are_used_when_the_tensor_is_absent():
    assert parse({"max_tokens": 7, "temperature": 0}).sampling.max_tokens == 7
    tensor_wins = parse({"max_tokens": 7}, sampling_parameters=sampling({"max_tokens": 9}))
    assert tensor_wins.sampling.max_tokens == 9


def test_lookahead_overrides_are_capped_by_the_instance():
    request = parse(
        sampling_parameters=sampling(
            {
                "decoding_length": "8",
                "branch_length": 4,
                "decoding_mode": "one",
                "use_lookahead": "false",
                "drafter": "trie",
            }
        )
    )
    assert request.lookahead == LookaheadConfig(
        use_lookahead=False, decoding_length=8, branch_length=4, decoding_mode="one", drafter="trie"
    )


@pytest.mark.parametrize(
    ("stream", "exclude", "prepend"),
    [(None, None, True), (False, None, True), (None, True, False), (True, None, False), (True, True, False)],
)
def test_the_prompt_is_echoed_only_when_not_streaming(stream, exclude, prepend):
    tensors = {}
    if stream is not None:
        tensors["stream"] = flag(stream)
    if exclude is not None:
        tensors["exclude_input_in_output"] = flag(exclude)
    request = parse(**tensors)
    assert request.stream is bool(stream)
    assert request.prepend_input is prepend


def test_return_flags():
    request = parse(
        return_finish_reason=flag(True),
        return_num_input_tokens=flag(True),
        return_num_output_tokens=flag(False),
        return_perf_metrics=flag(True),
    )
    assert (request.return_finish_reason, request.return_num_input_tokens) == (True, True)
    assert (request.return_num_output_tokens, request.return_perf_metrics) == (False, True)


@pytest.mark.parametrize(
    ("tensors", "params", "message"),
    [
        ({"text_input": None}, None, "text_input is required"),
        ({"text_input": strings("a", "b")}, None, "text_input must hold exactly one element, got shape [2]"),
        (
            {"text_input": np.array([3], dtype=np.int32)},
            None,
            "text_input must be a STRING (BYTES) tensor, got int32",
        ),
        ({"text_input": np.array([b"\xff"], dtype=np.object_)}, None, "text_input is not valid UTF-8"),
        ({"text_input": strings("")}, None, "text_input is empty"),
        (
            {"text_input": strings("x" * 21)},
            None,
            "text_input has 21 tokens, more than max_prompt_tokens (20)",
        ),
        ({"stream": np.array([1], dtype=np.int32)}, None, "stream must be a BOOL tensor, got int32"),
        ({"stream": flag(True), "exclude_input_in_output": flag(False)}, None, STREAMING_ECHO_ERROR),
        ({"sampling_parameters": strings("{max_tokens: 3")}, None, "sampling_parameters is not valid JSON"),
        (
            {"sampling_parameters": strings("[1]")},
            None,
            "sampling_parameters must be a JSON object, got list",
        ),
        (
            {"sampling_parameters": sampling({"max_tokens": 65})},
            None,
            "max_tokens must be <= 64 on this model, got 65",
        ),
        ({"sampling_parameters": sampling({"max_tokens": 0})}, None, "max_tokens must be >= 1, got 0"),
        (
            {"sampling_parameters": sampling({"max_tokens": "lots"})},
            None,
            "max_tokens must be an integer, got 'lots'",
        ),
        (
            {"sampling_parameters": sampling({"max_tokens": True})},
            None,
            "max_tokens must be an integer, got True",
        ),
        ({"sampling_parameters": sampling({"temperature": -1})}, None, "temperature must be >= 0, got -1.0"),
        ({"sampling_parameters": sampling({"top_p": "0"})}, None, "top_p must be in (0, 1], got 0.0"),
        ({"sampling_parameters": sampling({"top_k": "x"})}, None, "top_k must be an integer, got 'x'"),
        (
            {"sampling_parameters": sampling({"stop": 3})},
            None,
            "stop must be a string or a list of strings, got 3",
        ),
        ({"sampling_parameters": sampling({"ignore_eos": "yes"})}, None, "ignore_eos must be true or false"),
        ({"sampling_parameters": sampling({"decoding_length": 17})}, None, "decoding_length must be <= 16"),
        ({"sampling_parameters": sampling({"branch_length": 9})}, None, "branch_length must be <= 8"),
        (
            {"sampling_parameters": sampling({"decoding_mode": "beam"})},
            None,
            "decoding_mode must be one of hier",
        ),
        (
            {"sampling_parameters": sampling({"decoding_mode": 1})},
            None,
            "decoding_mode must be a string, got 1",
        ),
        (
            {"sampling_parameters": sampling({"drafter": "oracle"})},
            None,
            "drafter must be one of trie, hybrid, recycled, got 'oracle'",
        ),
        ({}, {"max_tokens": "-3"}, "max_tokens must be >= 1, got -3"),
    ],
)
def test_problems_are_named(tensors, params, message):
    tensors = {"text_input": strings("Hello"), **tensors}
    tensors = {name: value for name, value in tensors.items() if value is not None}
    with pytest.raises(RequestError) as raised:
        parse_request(DictInputs(tensors, params), LIMITS, tokenize)
    assert message in str(raised.value)


def test_n_and_best_of_are_vllms_and_sample_only():
    request = parse(sampling_parameters=sampling({"n": "2", "best_of": 3, "temperature": 0.8}))
    assert (request.sampling.n, request.sampling.best_of, request.sampling.samples) == (2, 3, 3)
    assert request.sampling.logprobs == 0 and request.logprobs_hidden  # computed to rank the samples
    with pytest.raises(RequestError, match="n must be 1 when using greedy sampling, got 2"):
        parse(sampling_parameters=sampling({"n": 2}))
    with pytest.raises(RequestError, match=r"best_of \(3\) above n \(1\) returns the best samples"):
        parse(sampling_parameters=sampling({"best_of": 3, "temperature": 1}), stream=flag(True))
    with pytest.raises(RequestError, match="n must be between 1 and 16, got 17"):
        parse(sampling_parameters=sampling({"n": 17, "temperature": 1}))


def test_stream_each_token_comes_from_the_model_unless_the_request_says_otherwise():
    assert parse().stream_each_token is False
    each = replace(LIMITS, stream_each_token=True)
    assert parse(limits=each).stream_each_token is True
    assert (
        parse(limits=each, sampling_parameters=sampling({"stream_each_token": "false"})).stream_each_token
        is False
    )
    assert parse({"stream_each_token": True}).stream_each_token is True  # request parameters
    with pytest.raises(RequestError, match="stream_each_token must be true or false, got 'yes'"):
        parse(sampling_parameters=sampling({"stream_each_token": "yes"}))


def test_lookahead_cannot_be_enabled_on_a_model_serving_without_it():
    baseline = RequestLimits(LookaheadConfig(use_lookahead=False), max_prompt_tokens=20, max_output_tokens=64)
    with pytest.raises(RequestError, match="use_lookahead cannot be enabled"):
        parse(limits=baseline, sampling_parameters=sampling({"use_lookahead": True}))
    assert (
        parse(limits=baseline, sampling_parameters=sampling({"use_lookahead": False})).lookahead.use_lookahead
        is False
    )


def test_stop_words_and_debug_are_per_request_overrides():
    debugging = RequestLimits(
        replace(LIMITS.lookahead, debug=True), max_prompt_tokens=20, max_output_tokens=64
    )
    options = sampling({"stop_words": [",", 13], "debug": False})
    request = parse(limits=debugging, sampling_parameters=options)
    assert request.lookahead.stop_words == (",", 13) and not request.lookahead.debug
    assert parse(sampling_parameters=sampling({"stop_words": " "})).lookahead.stop_words == (" ",)
    with pytest.raises(RequestError, match="stop_words must be a list of strings and token ids, got"):
        parse(sampling_parameters=sampling({"stop_words": [True]}))


def test_stop_words_the_tokenizer_cannot_resolve_are_invalid_arguments():
    def check(prompt_tokens, params, lookahead):
        if lookahead.stop_words == ("ab",):
            raise ValueError("stop_words entry 'ab' is 2 tokens [97, 98], not one")

    options = DictInputs(
        {"text_input": strings("Hi"), "sampling_parameters": sampling({"stop_words": ["ab"]})}
    )
    with pytest.raises(RequestError, match="stop_words entry 'ab' is 2 tokens"):
        parse_request(options, LIMITS, tokenize, check)


# vLLM's keys: supported, accepted at their neutral value, or refused by name


OPENAI_CHAT_DEFAULTS = {  # what the OpenAI frontend sends for a bare chat request
    "frequency_penalty": 0.0,
    "ignore_eos": False,
    "n": 1,
    "presence_penalty": 0.0,
    "temperature": 0.7,
    "top_p": 1.0,
    "logprobs": False,
    "max_tokens": 16,
}


def test_the_openai_frontends_defaults_are_accepted():
    request = parse(sampling_parameters=sampling(OPENAI_CHAT_DEFAULTS), return_logprobs=flag(False))
    assert request.sampling == SamplingParams(max_tokens=16, temperature=0.7)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"use_beam_search": "true"}, 'use_beam_search="true"'),
        ({"lora_name": "french"}, 'lora_name="french"'),
        (
            {"structured_outputs": {"regex": "a+", "whitespace_pattern": " *"}},
            'structured_outputs.whitespace_pattern=" *"',
        ),
        (
            {"guided_decoding": {"choice": ["a"], "structural_tag": "{}"}},
            'guided_decoding.structural_tag="{}"',
        ),
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids=[1, 2]"),
        ({"bad_words": ["x"]}, 'bad_words=["x"]'),
        ({"detokenize": False}, "detokenize=false"),
    ],
)
def test_a_vllm_key_this_model_does_not_support_is_refused_by_name(options, key):
    with pytest.raises(RequestError, match="is not supported by this model") as raised:
        parse(sampling_parameters=sampling(options))
    assert str(raised.value).startswith(key)


def test_numbers_and_booleans_may_arrive_as_strings():
    options = {
        "presence_penalty": "0.5",
        "frequency_penalty": "-1",
        "min_p": "0.05",
        "top_k": "-1",
        "include_stop_str_in_output": "True",
        "skip_special_tokens": "false",
        "stop_token_ids": [7, "9"],
        "logit_bias": {"5": "-100", "6": 2.5},
        "seed": str(2**64 - 1),
        "logprobs": "3",
        "max_tokens": "8.0",
    }
    params = parse(sampling_parameters=sampling(options)).sampling
    assert (params.presence_penalty, params.frequency_penalty, params.min_p, params.top_k) == (
        0.5,
        -1.0,
        0.05,
        0,
    )
    assert params.include_stop_str_in_output is True and params.skip_special_tokens is False
    assert params.stop_token_ids == (7, 9) and params.logit_bias == {5: -100.0, 6: 2.5}
    assert (params.seed, params.logprobs, params.max_tokens) == (2**64 - 1, 3, 8)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"seed": 2**64}, "seed must be a 64-bit integer"),
        ({"seed": -(2**63) - 1}, "seed must be a 64-bit integer"),
        ({"temperature": "inf", "min_tokens": 4}, "temperature must be a finite number"),
        ({"temperature": "nan"}, "temperature must be a finite number"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in [0.01, 100.0]"),
        ({"repetition_penalty": 1e-45}, "repetition_penalty must be in [0.01, 100.0]"),
        ({"repetition_penalty": 1e39}, "repetition_penalty must be in [0.01, 100.0]"),
        ({"logit_bias": {"5": 1e39}}, "logit_bias values must be in [-100, 100]"),
        ({"logit_bias": {"5": -101}}, "logit_bias values must be in [-100, 100]"),
        (
            {"stop_words": [str(i) for i in range(200_000)]},
            "stop_words may hold at most 256 entries, got 200000",
        ),
        ({"stop_words": ["z" * 100]}, "stop_words must be a list of strings and token ids"),
        ({"debug": True}, "debug cannot be enabled: the model's config.pbtxt has debug off"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"top_k": -2}, "top_k must be -1 or 0 (off) or >= 1"),
        ({"logprobs": 21}, "logprobs must be between 0 and 20"),
        ({"stop": ["x"] * 100_000}, "stop may hold at most 64 strings"),
        ({"stop": ["y" * 1000]}, "each stop string may be at most 256 characters long"),
        ({"logit_bias": {"x": 1}}, "logit_bias token id must be an integer"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be >= 1"),
    ],
)
def test_extreme_values_are_refused_by_name(options, message):
    with pytest.raises(RequestError) as raised:
        parse(sampling_parameters=sampling(options))
    assert message in str(raised.value)


def test_a_tiny_temperature_is_raised_to_vllms_minimum_instead_of_overflowing():
    assert parse(sampling_parameters=sampling({"temperature": 1e-39})).sampling.temperature == 0.01


def test_an_oversize_prompt_is_refused_before_it_is_tokenized():
    calls = []

    def counting(text: str) -> list[int]:
        calls.append(text)
        return tokenize(text)

    limits = RequestLimits(LIMITS.lookahead, max_prompt_tokens=20, max_output_tokens=64, max_prompt_bytes=80)
    with pytest.raises(RequestError, match=r"text_input has 1000000 bytes: .* \(at most 80 bytes\)"):
        parse_request(DictInputs({"text_input": strings("x" * 1_000_000)}), limits, counting)
    assert calls == []


def test_a_truncated_prompt_is_echoed_as_the_text_of_the_tokens_kept():
    def detokenize(ids) -> str:
        return "".join(chr(i) for i in ids)

    def parsed(prompt: str) -> GenerationRequest:
        inputs = DictInputs({"text_input": strings(prompt)}, {"truncate_prompt_tokens": 5})
        return parse_request(inputs, LIMITS, tokenize, detokenize=detokenize)

    request = parsed("a long prompt whose head is cut")
    assert request.prompt_ids == tuple(tokenize("s cut")) and request.prompt == "s cut"
    assert request.prepend_input  # not streaming: the echo is what the model read
    assert parsed("short").prompt == "short"


def test_prompt_and_max_tokens_must_fit_the_models_context():
    limits = RequestLimits(LIMITS.lookahead, max_prompt_tokens=20, max_output_tokens=64, context_length=30)
    assert parse(limits=limits).sampling.max_tokens == 25  # without max_tokens: what the context leaves

    def check(prompt_tokens: int, params: SamplingParams, lookahead: LookaheadConfig) -> None:
        if prompt_tokens + params.max_tokens > 30:
            raise ValueError("the prompt and max_tokens exceed the model's context length (30 tokens)")

    with pytest.raises(RequestError, match="exceed the model's context length"):
        parse_request(
            DictInputs({"text_input": strings("Hello")}, {"max_tokens": 26}), limits, tokenize, check
        )


def test_without_max_output_tokens_only_the_context_bounds_max_tokens():
    """vLLM's rule (max_output_tokens 0, the default): max_tokens 1500 is fine on a 2048-token model."""
    limits = RequestLimits(LIMITS.lookahead, max_prompt_tokens=20, max_output_tokens=0, context_length=2048)
    assert parse(limits=limits).sampling.max_tokens == SamplingParams.max_tokens
    wide = parse(limits=limits, sampling_parameters=sampling({"max_tokens": 1500}))
    assert wide.sampling.max_tokens == 1500
    short = RequestLimits(LIMITS.lookahead, max_prompt_tokens=20, max_output_tokens=0, context_length=30)
    assert parse(limits=short).sampling.max_tokens == 25  # what the context leaves after the prompt
    with pytest.raises(RequestError, match="max_tokens must be <= 64 on this model, got 65"):
        parse(sampling_parameters=sampling({"max_tokens": 65}))  # a set max_output_tokens still bounds it


def test_return_cumulative_logprob_alone_computes_logprobs_but_reports_none():
    request = parse(return_cumulative_logprob=flag(True))
    assert request.sampling.logprobs == 0 and request.logprobs_hidden
    assert not parse(
        return_cumulative_logprob=flag(True), sampling_parameters=sampling({"logprobs": 2})
    ).logprobs_hidden


# Structured outputs: vLLM's structured_outputs / guided_decoding objects and guided_* keys

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {"structured_outputs": {"json": SCHEMA}},
            StructuredOutputs("json", json.dumps(SCHEMA)),
        ),
        (
            {"structured_outputs": json.dumps({"json": json.dumps(SCHEMA)})},
            StructuredOutputs("json", json.dumps(SCHEMA)),
        ),
        (
            {"structured_outputs": {"regex": "a+", "backend": "xgrammar", "json": None}},
            StructuredOutputs("regex", "a+"),
        ),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputs("choice", '["yes", "no"]')),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, StructuredOutputs("grammar", 'start: "a"')),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
            StructuredOutputs("json_object", "", any_whitespace=False),
        ),
        (
            {
                "guided_decoding": {
                    "json": SCHEMA,
                    "regex": None,
                    "choice": None,
                    "grammar": None,
                    "json_object": None,
                    "backend": None,
                    "whitespace_pattern": None,
                }
            },
            StructuredOutputs("json", json.dumps(SCHEMA)),
        ),
        (
            {"guided_json": json.dumps(SCHEMA), "guided_decoding_backend": "outlines"},
            StructuredOutputs("json", json.dumps(SCHEMA)),
        ),
        ({"guided_regex": "[0-9]+"}, StructuredOutputs("regex", "[0-9]+")),
        (  # the schema's property order is the output's: kept as sent
            {"guided_json": '{"properties": {"zeta": {}, "alpha": {}}}'},
            StructuredOutputs("json", '{"properties": {"zeta": {}, "alpha": {}}}'),
        ),
        ({"guided_choice": ["x"]}, StructuredOutputs("choice", '["x"]')),
        ({"guided_json_object": True}, StructuredOutputs("json_object")),
        ({"structured_outputs": {}, "guided_decoding": ""}, None),
    ],
)
def test_structured_outputs_arrive_under_every_vllm_key(options, expected):
    assert parse(sampling_parameters=sampling(options)).sampling.structured_outputs == expected


def test_the_constraint_remembers_the_key_that_set_it():
    constraint = parse(sampling_parameters=sampling({"guided_regex": "a"})).sampling.structured_outputs
    assert constraint.name == "guided_regex"
    constraint = parse(
        sampling_parameters=sampling({"guided_decoding": {"regex": "a"}})
    ).sampling.structured_outputs
    assert constraint.name == "guided_decoding.regex"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json must be a JSON schema"),
        ({"structured_outputs": {"json": [1]}}, "structured_outputs.json must be a JSON schema"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs must set exactly one of .*got regex, choice",
        ),
        (
            {"structured_outputs": {"backend": "guidance"}},
            "structured_outputs must set exactly one of .*got none",
        ),
        ({"structured_outputs": 7}, "structured_outputs must be an object"),
        (
            {"structured_outputs": {"choice": []}},
            "structured_outputs.choice must be a non-empty list of strings",
        ),
        ({"structured_outputs": {"grammar": " "}}, "structured_outputs.grammar must be a non-empty string"),
        ({"guided_choice": "yes"}, "guided_choice must be a non-empty list of strings"),
        (
            {"guided_regex": "a", "structured_outputs": {"regex": "b"}},
            "structured_outputs and guided_regex both constrain",
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
            "structured_outputs.disable_additional_properties=true",
        ),
    ],
)
def test_a_malformed_constraint_is_refused_naming_its_key(options, message):
    with pytest.raises(RequestError, match=message):
        parse(sampling_parameters=sampling(options))


def test_json_nested_too_deeply_is_an_invalid_argument():
    with pytest.raises(RequestError, match="sampling_parameters is nested too deeply"):
        parse(sampling_parameters=strings("[" * 100_000))


def test_prompt_token_ids_outside_the_vocabulary_are_refused():
    limits = RequestLimits(LIMITS.lookahead, max_prompt_tokens=20, max_output_tokens=64, vocab_size=ord("z"))
    assert parse(limits=limits, text_input=strings("Hello")).prompt_ids == tuple(map(ord, "Hello"))
    with pytest.raises(RequestError, match="tokenizes to id 122, outside the model's vocabulary \\(122\\)"):
        parse(limits=limits, text_input=strings("zebra"))


def test_return_perf_metrics_is_refused_where_acceptance_outputs_are_off():
    private = RequestLimits(
        LIMITS.lookahead, max_prompt_tokens=20, max_output_tokens=64, acceptance_outputs=False
    )
    flag = np.array([True])
    assert parse(return_perf_metrics=flag).return_perf_metrics
    with pytest.raises(RequestError, match="return_perf_metrics is turned off on this model"):
        parse(limits=private, return_perf_metrics=flag)
    assert not parse(limits=private, return_perf_metrics=np.array([False])).return_perf_metrics


# Hostile values: a precise INVALID_ARG naming the key, never INTERNAL, never the whole value echoed

NESTED = "[" * 100_000


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"structured_outputs": NESTED}, "structured_outputs"),
        ({"stop_token_ids": NESTED}, "stop_token_ids"),
        ({"logit_bias": NESTED}, "logit_bias"),
        ({"guided_json": NESTED}, "guided_json"),
        ({"bad_words": NESTED}, "bad_words"),
    ],
)
def test_json_text_nested_too_deeply_is_refused_naming_its_key(options, key):
    with pytest.raises(RequestError, match=rf"^{key}.*nested too deeply") as raised:
        parse(sampling_parameters=sampling(options))
    assert len(str(raised.value)) < 300


@pytest.mark.parametrize(
    ("options", "where"),
    [
        ({"stop_words": ["ok", "\ud800"]}, "stop_words[1]"),
        ({"stop": "\udfff"}, "stop"),
        ({"structured_outputs": {"regex": "a\ud800"}}, "structured_outputs.regex"),
        ({"logit_bias": {"\ud800": 1}}, "logit_bias"),
    ],
)
def test_lone_surrogates_are_refused_naming_where_they_are(options, where):
    with pytest.raises(RequestError, match=r"lone surrogate") as raised:
        parse(sampling_parameters=sampling(options))
    assert str(raised.value).startswith(f"sampling_parameters.{where}")


def test_a_number_too_long_for_python_is_refused_not_an_internal_error():
    with pytest.raises(RequestError, match="sampling_parameters"):
        parse(sampling_parameters=strings('{"max_tokens": ' + "9" * 5000 + "}"))
    with pytest.raises(RequestError, match="max_tokens"):
        parse(sampling_parameters=sampling({"max_tokens": "9" * 5000}))


@pytest.mark.parametrize(
    "options",
    [
        {"stop_words": ["x" * 500_000]},
        {"stop_words": "x" * 500_000},
        {"stop": [1] * 100_000},
        {"temperature": "x" * 500_000},
        {"structured_outputs": {"json": "x" * 500_000}},
        {"decoding_mode": "x" * 500_000},
    ],
)
def test_a_refusal_quotes_at_most_the_start_of_a_huge_value(options):
    with pytest.raises(RequestError) as raised:
        parse(sampling_parameters=sampling(options))
    message = str(raised.value)
    assert len(message) < 500, message[:200]
    assert next(iter(options)) in message
