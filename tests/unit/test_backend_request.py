"""Request tensors -> GenerationRequest, and a request's path through the engine, without Triton."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from backend.engine import (
    QUEUE_FULL,
    SHUTDOWN_MESSAGE,
    Engine,
    FailureCode,
    RequestState,
    Update,
)
from backend.request import (
    STREAMING_ECHO_ERROR,
    DictInputs,
    GenerationRequest,
    RequestError,
    RequestLimits,
    parse_request,
)
from lookahead.algorithm.trie import NGramTrie
from lookahead.config import LookaheadConfig, SamplingParams, StructuredOutputs
from lookahead.runtime.decoder import GenerationStats, StepOutput
from lookahead.runtime.logprobs import Logprob
from lookahead.state.keeper import TrieKeeper
from lookahead.state.persistence import load_trie
from tests.helpers import wait_until

LIMITS = RequestLimits(
    LookaheadConfig(decoding_length=16, branch_length=8), max_prompt_tokens=20, max_output_tokens=64
)


def tokenize(text: str) -> list[int]:
    """One token per character: enough to test lengths without a real tokenizer."""
    return [ord(c) for c in text]


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
            "drafter must be one of trie, got 'oracle'",
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


# The engine thread, with a scripted decoder


class ScriptedGeneration:
    """Emits one scripted StepOutput per step; records when it was closed."""

    def __init__(
        self, steps: list[StepOutput], prompt_tokens: int, log: list[str], name: str, gate: threading.Event
    ):
        self.steps = list(steps)
        self.gate = gate
        self.stats = GenerationStats(prompt_tokens=prompt_tokens)
        self.finished = False
        self.finish_reason: str | None = None
        self.closed = False
        self.in_pool = False  # like Generation: true once its first step (the prefill) ran
        self.cumulative_logprob = None
        self.prompt_logprobs = None
        self.log, self.name = log, name

    def step(self) -> StepOutput:
        assert self.gate.wait(5)
        if isinstance(self.steps[0], Exception):  # a broken request fails every time it is stepped
            raise self.steps[0]
        output = self.steps.pop(0)
        self.in_pool = True
        self.log.append(self.name)
        self.stats.steps += 1
        self.stats.output_tokens += len(output.token_ids)
        self.stats.draft_tokens += 2
        self.stats.accepted_draft_tokens += len(output.token_ids) - 1
        self.finish_reason = output.finish_reason
        self.finished = output.finish_reason is not None
        if output.logprobs is not None:  # as Generation.commit sums them
            chosen = sum(position[t].logprob for position, t in zip(output.logprobs, output.token_ids))
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + chosen
        return output

    def close(self, reason: str = "cancelled") -> None:
        self.closed = True


class ScriptedDecoder:
    """start() hands out the script registered for the prompt's first character."""

    trie = None

    def __init__(self, scripts: dict[str, list[StepOutput]]):
        self.scripts = scripts
        self.order: list[str] = []
        self.batches: list[list[str]] = []  # the generations of each step() call
        self.generations: dict[str, ScriptedGeneration] = {}
        self.gate = threading.Event()  # steps wait for it; open unless a test closes it
        self.gate.set()
        self.kv_room: int | None = None  # most KV entries all running requests may hold (None: any)

    def fits(self, longest: list[int]) -> bool:
        return self.kv_room is None or sum(longest) <= self.kv_room

    def start(self, prompt_ids, params, lookahead=None, request_id="", grammar=None) -> ScriptedGeneration:
        name = chr(prompt_ids[0])
        self.generations[name] = ScriptedGeneration(
            self.scripts[name], len(prompt_ids), self.order, name, self.gate
        )
        return self.generations[name]

    def start_samples(
        self, prompt_ids, params, lookahead=None, request_id="", grammar=None
    ) -> list[ScriptedGeneration]:
        """Sample i runs the script registered for the prompt's first character and i ("a0", "a1"...)."""
        samples = []
        for index in range(params.samples):
            name = f"{chr(prompt_ids[0])}{index}"
            self.generations[name] = ScriptedGeneration(
                self.scripts[name], len(prompt_ids), self.order, name, self.gate
            )
            samples.append(self.generations[name])
        return samples

    def step(self, generations: list[ScriptedGeneration]) -> list[StepOutput]:
        """Like LookaheadDecoder.step: every generation advances by one step, in the given order."""
        self.batches.append([generation.name for generation in generations])
        return [generation.step() for generation in generations]


class Recorder:
    """Collects updates and log lines; on_step lets a test act between two steps."""

    def __init__(self):
        self.updates: list[Update] = []
        self.info: list[str] = []
        self.errors: list[str] = []
        self.finals = threading.Semaphore(0)

    def emit(self, update: Update) -> None:
        self.updates.append(update)
        if update.final:
            self.finals.release()

    def log_info(self, message: str) -> None:
        self.info.append(message)

    log_warn = log_info

    def log_error(self, message: str) -> None:
        self.errors.append(message)

    def wait_finals(self, count: int) -> None:
        for _ in range(count):
            assert self.finals.acquire(timeout=10), "the engine did not finish a request"

    def of(self, state: RequestState) -> list[Update]:
        return [u for u in self.updates if u.state is state]


def steps(*texts: str, reason: str = "length") -> list[StepOutput]:
    """One step per text, each holding len(text) or 1 tokens; the last one finishes."""
    return [
        StepOutput(list(range(max(1, len(t)))), t, reason if i == len(texts) - 1 else None)
        for i, t in enumerate(texts)
    ]


def submit(engine: Engine, prompt: str, **request: Any) -> RequestState:
    state = RequestState(id=f"req-{prompt}", sender=None)
    state.request = GenerationRequest(
        prompt=prompt,
        prompt_ids=tuple(tokenize(prompt)),
        sampling=request.pop("sampling", SamplingParams(max_tokens=8)),
        lookahead=LookaheadConfig(),
        **request,
    )
    engine.submit(state)
    return state


def run_engine(
    scripts: dict[str, list[StepOutput]], **engine: Any
) -> tuple[Engine, ScriptedDecoder, Recorder]:
    decoder, recorder = ScriptedDecoder(scripts), Recorder()
    return Engine(decoder, recorder.emit, recorder, **engine), decoder, recorder


def test_streaming_sends_text_deltas_with_final_on_the_last_one():
    engine, decoder, recorder = run_engine({"a": steps("Hel", "", "lo", " world", reason="stop")})
    state = submit(engine, "a", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    updates = recorder.of(state)
    assert [(u.text, u.num_output_tokens, u.final) for u in updates] == [
        ("Hel", 3, False),
        ("lo", 3, False),  # the step without text is reported with the next one
        (" world", 6, True),
    ]
    assert updates[-1].finish_reason == "stop"
    assert updates[-1].stats is decoder.generations["a"].stats
    assert decoder.generations["a"].closed
    assert state.first_output_time is not None and state.finish_time >= state.first_output_time


def logprob_of(token: int, value: float) -> dict[int, Logprob]:
    return {token: Logprob(value, 1, chr(token))}


def test_stream_each_token_sends_a_steps_tokens_one_response_each():
    """Three tokens in one step: "H", half of "é" (no text yet), its other half; then a last step."""
    first = StepOutput(
        [72, 195, 169],
        "Hé",
        logprobs=[logprob_of(72, -0.5), logprob_of(195, -0.25), logprob_of(169, -0.125)],
        token_texts=["H", "", "é"],
    )
    last = StepOutput([33], "!", "stop", logprobs=[logprob_of(33, -1.0)], token_texts=["!"])
    engine, decoder, recorder = run_engine({"a": [first, last], "b": [replace(first), replace(last)]})
    each = submit(engine, "a", stream=True, prepend_input=False, stream_each_token=True)
    whole = submit(engine, "b", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(2)
    engine.stop()
    updates = recorder.of(each)
    assert [(u.text, u.num_output_tokens, u.final, u.finish_reason) for u in updates] == [
        ("H", 1, False, None),
        ("", 1, False, None),
        ("é", 1, False, None),
        ("!", 1, True, "stop"),
    ]
    assert [list(u.logprobs[0]) for u in updates] == [[72], [195], [169], [33]]
    assert [u.stats is not None for u in updates] == [False, False, False, True]
    assert [(u.text, u.num_output_tokens, u.final) for u in recorder.of(whole)] == [
        ("Hé", 3, False),
        ("!", 1, True),
    ]


def test_stream_each_token_reports_the_cumulative_logprob_up_to_each_token():
    steps_ = [
        StepOutput(
            [1, 2], "ab", logprobs=[logprob_of(1, -0.5), logprob_of(2, -0.25)], token_texts=["a", "b"]
        ),
        StepOutput([3], "c", "length", logprobs=[logprob_of(3, -1.0)], token_texts=["c"]),
    ]
    engine, decoder, recorder = run_engine({"a": steps_})
    state = submit(engine, "a", stream=True, prepend_input=False, stream_each_token=True)
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    assert [u.cumulative_logprob for u in recorder.of(state)] == [-0.5, -0.75, -1.75]


def sampled(n: int, best_of: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=1.0, n=n, best_of=best_of)


def texts_of(update: Update) -> list[tuple[str, int, str | None]]:
    return [(piece.text, piece.num_output_tokens, piece.finish_reason) for piece in update.pieces]


def test_n_samples_come_back_in_one_response_with_an_element_each():
    engine, _, recorder = run_engine({"a0": steps("bc", "de"), "a1": steps("x", reason="stop")})
    state = submit(engine, "a", stream=False, prepend_input=True, sampling=sampled(2))
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    (update,) = recorder.of(state)
    assert update.final and texts_of(update) == [("abcde", 4, "length"), ("ax", 1, "stop")]
    assert update.stats.output_tokens == 5 and update.stats.prompt_tokens == 1


def test_streamed_samples_share_each_response_and_a_finished_one_stays_in_it():
    engine, _, recorder = run_engine({"a0": steps("bc", "de"), "a1": steps("x", reason="stop")})
    state = submit(engine, "a", stream=True, prepend_input=False, sampling=sampled(2))
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    updates = recorder.of(state)
    assert [texts_of(u) for u in updates] == [
        [("bc", 2, None), ("x", 1, "stop")],
        [("de", 2, "length"), ("", 0, "stop")],
    ]
    assert [u.final for u in updates] == [False, True]


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob_best_first():
    def sample(text: str, logprob: float) -> list[StepOutput]:
        return [StepOutput([ord(text)], text, "stop", logprobs=[logprob_of(ord(text), logprob)])]

    scripts = {"a0": sample("x", -2.0), "a1": sample("y", -5.0), "a2": sample("z", -0.5)}
    engine, _, recorder = run_engine(scripts)
    state = submit(engine, "a", stream=False, prepend_input=False, sampling=sampled(2, best_of=3))
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    (update,) = recorder.of(state)
    assert [piece.text for piece in update.pieces] == ["z", "x"]
    assert [piece.cumulative_logprob for piece in update.pieces] == [-0.5, -2.0]


def test_non_streaming_sends_one_response_with_the_prompt_prepended():
    engine, _, recorder = run_engine({"p": steps("ab", "cd")})
    echoed = submit(engine, "p", stream=False, prepend_input=True)
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    assert [(u.text, u.num_output_tokens, u.final, u.finish_reason) for u in recorder.of(echoed)] == [
        ("pabcd", 4, True, "length")
    ]


def test_an_empty_last_step_still_carries_the_final_flag():
    engine, _, recorder = run_engine({"a": steps("x", "", reason="stop")})
    state = submit(engine, "a", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    assert [(u.text, u.num_output_tokens, u.final) for u in recorder.of(state)] == [
        ("x", 1, False),
        ("", 1, True),
    ]


def test_requests_are_stepped_together_so_a_short_one_finishes_first():
    engine, decoder, recorder = run_engine({"l": steps(*"abcdefgh"), "s": steps("x", "y")})
    long = submit(engine, "l", stream=True, prepend_input=False)
    short = submit(engine, "s", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(2)
    engine.stop()
    assert decoder.order[:4] == ["l", "s", "l", "s"]
    finals = [u.state for u in recorder.updates if u.final]
    assert finals == [short, long]


def test_a_new_request_reads_its_prompt_in_the_running_ones_step():
    engine, decoder, recorder = run_engine({"l": steps(*"abcdefgh"), "n": steps("x", "y")})
    original_emit = engine.emit

    def submit_after_first_response(update: Update) -> None:
        original_emit(update)
        if len(recorder.updates) == 1:
            submit(engine, "n", stream=True, prepend_input=False)

    engine.emit = submit_after_first_response
    submit(engine, "l", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(2)
    engine.stop()
    joined = next(i for i, batch in enumerate(decoder.batches) if "n" in batch)
    assert decoder.batches[joined] == ["l", "n"]  # no step of its own: the stream never waits for it
    assert all(batch == ["l"] for batch in decoder.batches[:joined])


def test_requests_arriving_together_share_their_first_step():
    engine, decoder, recorder = run_engine({"a": steps("x", "y"), "b": steps("u", "v")})
    events: list[tuple[str, ...]] = []
    original_step, original_emit = decoder.step, engine.emit

    def step(generations: list[ScriptedGeneration]) -> list[StepOutput]:
        events.append(("step", *(generation.name for generation in generations)))
        return original_step(generations)

    def emit(update: Update) -> None:
        events.append(("emit", update.text))
        original_emit(update)

    decoder.step, engine.emit = step, emit
    submit(engine, "a", stream=True, prepend_input=False)
    submit(engine, "b", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(2)
    engine.stop()
    assert events[:4] == [("step", "a", "b"), ("emit", "x"), ("emit", "u"), ("step", "a", "b")]


def test_a_cancelled_request_stops_within_one_step_and_gets_one_cancelled_final():
    script = steps(*"abcdefgh")
    engine, decoder, recorder = run_engine({"c": script})
    state = submit(engine, "c", stream=True, prepend_input=False)
    original_emit = engine.emit

    def cancel_after_second_response(update: Update) -> None:
        original_emit(update)
        if len(recorder.of(state)) == 2:
            state.cancelled = True  # what the response thread does after is_cancelled()

    engine.emit = cancel_after_second_response
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    updates = recorder.of(state)
    assert [u.final for u in updates] == [False, False, True]
    assert (updates[-1].failure, updates[-1].message) == (FailureCode.CANCELLED, "Request was cancelled")
    assert decoder.generations["c"].closed
    assert decoder.order == ["c", "c"]


def test_a_failing_step_ends_only_that_request():
    engine, _, recorder = run_engine({"f": [RuntimeError("boom")], "g": steps("ok")})
    failing = submit(engine, "f", stream=True, prepend_input=False)
    healthy = submit(engine, "g", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(2)
    engine.stop()
    [failure] = recorder.of(failing)
    assert (failure.final, failure.failure, failure.message) == (
        True,
        FailureCode.INTERNAL,
        "Error generating text: boom",
    )
    assert [(u.text, u.final) for u in recorder.of(healthy)] == [("ok", True)]
    assert "boom" in recorder.errors[0]


# The engine thread re-raises the fatal error after failing every request, as it must.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_when_the_engine_dies_mid_stream_every_request_gets_an_error_and_the_model_is_not_ready():
    device_error = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    stopped: list[str] = []
    engine, decoder, recorder = run_engine(
        {"r": [steps("a", "b")[0], device_error], "q": steps("x")},
        max_running_requests=1,
        on_stopped=stopped.append,
    )
    running = submit(engine, "r", stream=True, prepend_input=False)
    queued = submit(engine, "q", stream=True, prepend_input=False)  # waits: one request runs at a time
    engine.start()
    recorder.wait_finals(2)
    assert not engine.running
    late = submit(engine, "z", stream=True, prepend_input=False)  # arrives after the death
    recorder.wait_finals(1)
    engine.thread.join(5)
    assert [u.text for u in recorder.of(running)[:-1]] == ["a"]  # it streamed, then died
    for state in (running, queued, late):
        final = recorder.of(state)[-1]
        assert final.final and final.failure is FailureCode.UNAVAILABLE
        assert (
            "the engine thread failed (AcceleratorError: CUDA error: an illegal memory access"
            in final.message
        )
    assert stopped and "illegal memory access" in stopped[0]
    assert any(
        "The engine thread failed" in line and "illegal memory access" in line for line in recorder.errors
    )
    assert "q" not in decoder.generations  # never started


def test_at_most_max_running_requests_run_and_the_rest_start_in_arrival_order():
    engine, decoder, recorder = run_engine(
        {"a": steps("1", "2", "3"), "b": steps("4", "5"), "c": steps("6")}, max_running_requests=2
    )
    for name in "abc":
        submit(engine, name, stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(3)
    engine.stop()
    # c starts only once b has left, in a's next step
    assert decoder.batches == [["a", "b"], ["a", "b"], ["a", "c"]]


def test_a_request_waits_while_the_kv_bound_cannot_hold_it_too():
    engine, decoder, recorder = run_engine({"a": steps("1", "2", "3"), "b": steps("4")})
    decoder.kv_room = 100  # each request may hold 1 + 8 + 64 = 73 entries: one fits, two do not
    submit(engine, "a", stream=True, prepend_input=False)
    submit(engine, "b", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(2)
    engine.stop()
    assert ["a", "b"] not in decoder.batches and ["b", "a"] not in decoder.batches
    assert decoder.order.index("b") > decoder.order.index("a") == 0
    assert decoder.order.count("a") == 3


def test_stop_answers_every_request_still_in_flight():
    engine, decoder, recorder = run_engine({"w": steps(*"abcdefgh"), "v": steps(*"abcdefgh")})
    decoder.gate.clear()
    states = [submit(engine, name, stream=True, prepend_input=False) for name in "wv"]
    engine.start()
    time.sleep(0.05)  # the engine is now inside the first step, waiting for the gate
    stopper = threading.Thread(target=engine.stop)
    stopper.start()
    decoder.gate.set()
    stopper.join(5)
    assert not stopper.is_alive()
    for state in states:
        finals = [u for u in recorder.of(state) if u.final]
        assert [(u.failure, u.message) for u in finals] == [(FailureCode.UNAVAILABLE, SHUTDOWN_MESSAGE)]
    assert all(generation.closed for generation in decoder.generations.values())


# Trie snapshots, written by the engine thread


def test_an_idle_engine_writes_a_due_snapshot_and_stop_writes_another(tmp_path):
    trie = NGramTrie(capacity=100, max_depth=4)
    trie.insert([1, 2, 3, 4])
    path = tmp_path / "state" / "lookahead_0_0.trie"
    decoder, recorder = ScriptedDecoder({"a": steps("x")}), Recorder()
    snapshots = TrieKeeper(trie, path, "fp", interval_s=0.05, log=recorder)
    engine = Engine(decoder, recorder.emit, recorder, keeper=snapshots)
    submit(engine, "a", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(1)
    assert wait_until(lambda: path.is_file() and not snapshots.changed), "no snapshot while idle"
    first = load_trie(path, capacity=100, max_depth=4, fingerprint="fp").node_count
    assert first == trie.node_count == 10  # every window of up to 4 tokens of [1, 2, 3, 4]
    trie.insert([5, 6])  # changed behind the engine's back: only the final save can record it
    engine.stop()
    assert load_trie(path, capacity=100, max_depth=4, fingerprint="fp").node_count == trie.node_count == 13
    assert f"Saved {path} (13 trie nodes)" in recorder.info


def test_snapshots_wait_for_the_interval_and_for_a_change(tmp_path):
    trie = NGramTrie(capacity=100, max_depth=4)
    path = tmp_path / "t.trie"
    snapshots = TrieKeeper(trie, path, "fp", interval_s=3600, log=Recorder())
    snapshots.mark_changed()
    snapshots.maybe_save()
    assert not path.exists()  # the interval has not passed
    snapshots.interval_s = 0.0  # 0 disables periodic snapshots altogether
    snapshots.maybe_save()
    assert not path.exists()
    snapshots.interval_s, snapshots.last_save = 1.0, time.monotonic() - 2
    snapshots.maybe_save()
    assert path.is_file() and not snapshots.changed
    path.unlink()
    snapshots.last_save = time.monotonic() - 2
    snapshots.maybe_save()
    assert not path.exists()  # nothing changed since the last save


def test_a_failing_save_is_logged_and_retried(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    recorder = Recorder()
    snapshots = TrieKeeper(NGramTrie(capacity=100, max_depth=4), blocker / "t.trie", "fp", 1.0, recorder)
    snapshots.mark_changed()
    snapshots.save()
    assert snapshots.changed
    assert "Could not save the trie snapshot" in recorder.errors[0]


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


def test_requests_beyond_max_queued_requests_get_unavailable_at_once():
    engine, decoder, recorder = run_engine(
        {name: steps("1", "2") for name in "abcd"}, max_running_requests=1, max_queued_requests=2
    )
    decoder.gate.clear()
    states = [submit(engine, name, stream=True, prepend_input=False) for name in "abcd"]
    engine.start()
    recorder.wait_finals(1)  # d: a runs, b and c wait, d is one too many
    assert [(u.failure, u.message) for u in recorder.of(states[3])] == [
        (FailureCode.UNAVAILABLE, QUEUE_FULL.format(count=2))
    ]
    decoder.gate.set()
    recorder.wait_finals(3)
    engine.stop()
    assert decoder.order == ["a", "a", "b", "b", "c", "c"]


def test_a_request_waiting_longer_than_queue_timeout_s_gets_unavailable():
    engine, decoder, recorder = run_engine(
        {"a": steps(*"12345678"), "b": steps("1")}, max_running_requests=1, queue_timeout_s=0.2
    )
    decoder.gate.clear()
    submit(engine, "a", stream=True, prepend_input=False)
    waiting = submit(engine, "b", stream=True, prepend_input=False)
    engine.start()
    time.sleep(0.4)
    decoder.gate.set()
    recorder.wait_finals(2)
    engine.stop()
    [final] = recorder.of(waiting)
    assert final.failure is FailureCode.UNAVAILABLE and "more than queue_timeout_s (0.2)" in final.message
    assert "b" not in decoder.order


def test_unload_ends_running_and_later_requests_with_unavailable_before_they_finish():
    engine, decoder, recorder = run_engine({"a": steps(*"abcdefgh"), "b": steps("1")})
    running = submit(engine, "a", stream=True, prepend_input=False)
    decoder.gate.clear()
    engine.start()
    time.sleep(0.05)
    engine.unload()
    decoder.gate.set()
    recorder.wait_finals(1)
    later = submit(engine, "b", stream=True, prepend_input=False)
    recorder.wait_finals(1)
    assert engine.running  # finalize() stops it later and takes the snapshot
    engine.stop()
    for state in (running, later):
        assert [(u.failure, u.message) for u in recorder.of(state) if u.final] == [
            (FailureCode.UNAVAILABLE, SHUTDOWN_MESSAGE)
        ]
    assert decoder.order.count("a") < 8 and "b" not in decoder.order


def test_unload_with_a_message_answers_running_requests_and_saves_the_trie_before_it_reports(tmp_path):
    """The launcher's drain: the event means every final is queued and the snapshot is on disk."""
    trie = NGramTrie(capacity=100, max_depth=4)
    path = tmp_path / "lookahead_0_0.trie"
    decoder, recorder = ScriptedDecoder({"a": steps(*"abcdefgh")}), Recorder()
    engine = Engine(decoder, recorder.emit, recorder, keeper=TrieKeeper(trie, path, "fp", 0.0, recorder))
    running = submit(engine, "a", stream=True, prepend_input=False)
    decoder.gate.clear()
    engine.start()
    time.sleep(0.05)
    trie.insert([1, 2, 3])  # what the stream taught the trie so far
    unloaded = engine.unload("the server is shutting down")
    decoder.gate.set()
    assert unloaded.wait(5)
    assert [(u.failure, u.message) for u in recorder.of(running) if u.final] == [
        (FailureCode.UNAVAILABLE, "the server is shutting down")
    ]
    assert load_trie(path, capacity=100, max_depth=4, fingerprint="fp").node_count == trie.node_count == 6
    assert engine.running
    engine.stop(timeout_s=5)
    assert not engine.thread.is_alive()


def test_unload_wakes_an_idle_engine(tmp_path):
    path = tmp_path / "t.trie"
    recorder = Recorder()
    keeper = TrieKeeper(NGramTrie(capacity=100, max_depth=4), path, "fp", 0.0, recorder)
    engine = Engine(ScriptedDecoder({}), recorder.emit, recorder, keeper=keeper)
    engine.start()
    assert engine.unload().wait(5) and path.is_file()
    engine.stop(timeout_s=5)
    assert not engine.thread.is_alive()


def test_a_stop_queued_while_unloading_is_not_lost():
    engine, decoder, recorder = run_engine({"a": steps(*"abcdefgh")})
    submit(engine, "a", stream=True, prepend_input=False)
    decoder.gate.clear()
    engine.start()
    time.sleep(0.05)
    engine.unload()
    engine.inbox.put(None)  # stop() arriving between the unload and the engine's next look
    decoder.gate.set()
    engine.thread.join(5)
    assert not engine.thread.is_alive()


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
