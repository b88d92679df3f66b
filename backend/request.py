"""One inference request -> a validated GenerationRequest, or a RequestError naming the problem.

This module never imports Triton: the backend wraps a `pb_utils.InferenceRequest` in a tiny
adapter with the `RequestInputs` shape, tests pass plain numpy arrays and dicts. The tensor
contract is vLLM's backend's, so vLLM clients, genai-perf and the OpenAI frontend
work unchanged; lookahead settings ride along inside `sampling_parameters`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from lookahead.config import MAX_STOP_WORDS, LookaheadConfig, SamplingParams, shown
from lookahead.contract import LOOKAHEAD_OVERRIDES, STREAM_EACH_TOKEN

from .sampling_keys import (
    dotted,
    lone_surrogate,
    sampling_fields,
    surrogate_message,
    to_bool,
    to_int,
    to_str,
)

# The vLLM backend's words, which its clients match.
STREAMING_ECHO_ERROR = (
    "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
)
PERF_METRICS_OFF = "return_perf_metrics is turned off on this model (config.pbtxt acceptance_outputs false)"
_FLAGS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_perf_metrics",
)


class RequestError(ValueError):
    """A problem with one request: answered with INVALID_ARG, the instance stays healthy."""


class RequestInputs(Protocol):
    """What the parser needs from a request: its tensors by name and its parameters."""

    def tensor(self, name: str) -> np.ndarray | None: ...

    def parameters(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class DictInputs:
    """RequestInputs over plain dicts, for tests and for callers outside Triton."""

    tensors: Mapping[str, np.ndarray]
    params: Mapping[str, Any] | None = None

    def tensor(self, name: str) -> np.ndarray | None:
        return self.tensors.get(name)

    def parameters(self) -> Mapping[str, Any]:
        return self.params or {}


@dataclass(frozen=True)
class RequestLimits:
    """Instance limits a request is checked against.

    max_prompt_bytes: a prompt longer than this cannot be within max_prompt_tokens, so it is
    refused before it is tokenized (None: no such bound). context_length: the model's, which a
    prompt and its max_tokens must fit in. vocab_size: an id at or above it would index past the
    embedding (on a GPU a device assert that stops the engine for everyone).
    """

    lookahead: LookaheadConfig  # instance defaults, also the per-request maxima
    max_prompt_tokens: int
    max_output_tokens: int  # 0: no bound but the context
    max_prompt_bytes: int | None = None
    context_length: int | None = None
    vocab_size: int | None = None  # prompt token ids must be below it (the embedding's rows)
    acceptance_outputs: bool = True  # false: return_perf_metrics is refused
    stream_each_token: bool = False  # the default of the request key of that name


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    lookahead: LookaheadConfig
    stream: bool = False
    prepend_input: bool = True
    return_finish_reason: bool = False
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_perf_metrics: bool = False
    # The request asked for no logprobs: they are computed (logprobs=0) for its cumulative_logprob or
    # to rank its best_of samples only.
    logprobs_hidden: bool = False
    stream_each_token: bool = False  # streaming: one response per token, not per step


def parse_request(
    inputs: RequestInputs,
    limits: RequestLimits,
    tokenize: Callable[[str], list[int]],
    check: Callable[[int, SamplingParams, LookaheadConfig], None] | None = None,
    detokenize: Callable[[Sequence[int]], str] | None = None,
) -> GenerationRequest:
    """Validate every input; raise RequestError with a message naming the offending one.

    check: the decoder's own check of a request (vocabulary, stop_words, context, KV bound), raising
    ValueError. detokenize: the text of the tokens truncate_prompt_tokens keeps, which is all an
    echo of the prompt holds (None: the whole prompt is echoed).
    """
    prompt = _text_input(inputs)
    flags = {name: _flag(inputs, name) for name in _FLAGS}
    stream = bool(flags["stream"])
    exclude_input = flags["exclude_input_in_output"]
    if stream and exclude_input is False:
        raise RequestError(STREAMING_ECHO_ERROR)
    if flags["return_perf_metrics"] and not limits.acceptance_outputs:
        raise RequestError(PERF_METRICS_OFF)

    options = _sampling_options(inputs)
    try:
        fields, truncate = sampling_fields(options)
    except ValueError as error:
        raise RequestError(str(error)) from None
    lookahead = _lookahead_config(options, limits.lookahead)
    each_token = limits.stream_each_token
    if options.get(STREAM_EACH_TOKEN) is not None:
        try:
            each_token = to_bool(STREAM_EACH_TOKEN, options[STREAM_EACH_TOKEN])
        except ValueError as error:
            raise RequestError(str(error)) from None

    if limits.max_prompt_bytes is not None and len(prompt) * 4 > limits.max_prompt_bytes:
        size = len(prompt.encode("utf-8"))
        if size > limits.max_prompt_bytes:
            raise RequestError(
                f"text_input has {size} bytes: more than max_prompt_tokens ({limits.max_prompt_tokens}) "
                f"tokens can hold on this model (at most {limits.max_prompt_bytes} bytes)"
            )
    prompt_ids = tuple(tokenize(prompt))
    if limits.vocab_size is not None and prompt_ids and max(prompt_ids) >= limits.vocab_size:
        raise RequestError(
            f"text_input tokenizes to id {max(prompt_ids)}, "
            f"outside the model's vocabulary ({limits.vocab_size})"
        )
    if truncate is not None and len(prompt_ids) > truncate:
        prompt_ids = prompt_ids[-truncate:]
        if detokenize is not None:
            prompt = detokenize(prompt_ids)
    if not prompt_ids:
        raise RequestError("text_input is empty: the prompt must hold at least one token")
    limit = limits.max_prompt_tokens
    if len(prompt_ids) > limit:
        raise RequestError(f"text_input has {len(prompt_ids)} tokens, more than max_prompt_tokens ({limit})")
    ranked = isinstance(fields.get("best_of"), int) and fields["best_of"] > fields.get("n", 1)
    if ranked and stream:
        raise RequestError(
            f"best_of ({fields['best_of']}) above n ({fields.get('n', 1)}) returns the best samples once "
            "all are done: it cannot stream"
        )
    # Logprobs the request did not ask for are still computed for its cumulative_logprob, or to rank
    # its best_of samples.
    hidden = (bool(flags["return_cumulative_logprob"]) or ranked) and fields.get("logprobs") is None
    if hidden:
        fields["logprobs"] = 0
    sampling = _sampling_params(fields, limits, len(prompt_ids))
    if check is not None:
        try:
            check(len(prompt_ids), sampling, lookahead)
        except ValueError as error:
            raise RequestError(str(error)) from None
    return GenerationRequest(
        prompt=prompt,
        prompt_ids=prompt_ids,
        sampling=sampling,
        lookahead=lookahead,
        stream=stream,
        # vLLM's default: the prompt is echoed when not streaming, never when streaming.
        prepend_input=not stream if exclude_input is None else not exclude_input,
        logprobs_hidden=hidden,
        stream_each_token=each_token,
        **{name: bool(flags[name]) for name in _FLAGS if name.startswith("return_")},
    )


def _single(inputs: RequestInputs, name: str) -> Any | None:
    """The one element of an optional [1] tensor, or None when the tensor is absent."""
    array = inputs.tensor(name)
    if array is None:
        return None
    array = np.asarray(array)
    if array.size != 1:
        raise RequestError(f"{name} must hold exactly one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _text_input(inputs: RequestInputs) -> str:
    value = _single(inputs, "text_input")
    if value is None:
        raise RequestError("text_input is required")
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError("text_input is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise RequestError(f"text_input must be a STRING (BYTES) tensor, got {np.asarray(value).dtype}")


def _flag(inputs: RequestInputs, name: str) -> bool | None:
    value = _single(inputs, name)
    if value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise RequestError(f"{name} must be a BOOL tensor, got {np.asarray(value).dtype}")
    return bool(value)


def _sampling_options(inputs: RequestInputs) -> Mapping[str, Any]:
    """The sampling_parameters JSON object, or the request parameters when the tensor is absent."""
    raw = _single(inputs, "sampling_parameters")
    if raw is None:
        return inputs.parameters()
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", errors="replace")
    if not isinstance(raw, str):
        raise RequestError("sampling_parameters must be a STRING (BYTES) tensor holding a JSON object")
    if not raw.strip():
        return {}
    return json_options("sampling_parameters", raw)


def json_options(name: str, raw: str) -> dict[str, Any]:
    """The JSON object `raw`; RequestError naming `name` for anything else, for JSON nested too
    deeply, numbers too long for Python and lone surrogates."""
    try:
        options = json.loads(raw)
    except RecursionError:
        raise RequestError(f"{name} is nested too deeply") from None
    except ValueError as error:  # not JSON, or an integer of more than 4300 digits
        raise RequestError(f"{name} is not valid JSON: {error}") from None
    if not isinstance(options, dict):
        raise RequestError(f"{name} must be a JSON object, got {type(options).__name__}")
    where = lone_surrogate(options)
    if where is not None:
        raise RequestError(surrogate_message(name + dotted(where)))
    return options


def _sampling_params(fields: dict[str, Any], limits: RequestLimits, prompt_tokens: int) -> SamplingParams:
    """SamplingParams from the converted fields; without max_tokens, min(the library default,
    max_output_tokens when set, what the context leaves after the prompt). As in vLLM, only the
    context bounds max_tokens unless max_output_tokens is set (the decoder checks the context)."""
    cap = limits.max_output_tokens or None
    if "max_tokens" not in fields:
        room = limits.context_length - prompt_tokens if limits.context_length else None
        fields["max_tokens"] = max(1, min(n for n in (SamplingParams.max_tokens, cap, room) if n is not None))
    if cap is not None and fields["max_tokens"] > cap:
        raise RequestError(f"max_tokens must be <= {cap} on this model, got {fields['max_tokens']}")
    try:
        return SamplingParams(**fields)
    except ValueError as error:
        raise RequestError(str(error)) from None


def _lookahead_config(options: Mapping[str, Any], instance: LookaheadConfig) -> LookaheadConfig:
    overrides = _converted(options, LOOKAHEAD_OVERRIDES)
    if overrides.get("debug") and not instance.debug:  # a client must not fill the server log
        raise RequestError("debug cannot be enabled: the model's config.pbtxt has debug off")
    try:
        return instance.capped(instance, **overrides)
    except ValueError as error:
        raise RequestError(str(error)) from None


def _converted(options: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The lookahead overrides among the options, each converted to its field's type; null means unset."""
    converted = {}
    for name in names:
        if options.get(name) is not None:
            try:
                converted[name] = _OVERRIDES[name](name, options[name])
            except ValueError as error:
                raise RequestError(str(error)) from None
    return converted


def _to_stop_words(name: str, value: Any) -> tuple[int | str, ...]:
    words = [value] if isinstance(value, str | int) and not isinstance(value, bool) else value
    if isinstance(words, list) and len(words) > MAX_STOP_WORDS:
        raise RequestError(f"{name} may hold at most {MAX_STOP_WORDS} entries, got {len(words)}")
    if isinstance(words, list) and all(
        (isinstance(w, int) and not isinstance(w, bool)) or (isinstance(w, str) and len(w) <= 64)
        for w in words
    ):
        return tuple(words)
    raise RequestError(f"{name} must be a list of strings and token ids, got {shown(value)}")


_OVERRIDES: dict[str, Callable[[str, Any], Any]] = {
    "use_lookahead": to_bool,
    "decoding_length": to_int,
    "branch_length": to_int,
    "decoding_mode": to_str,
    "stop_words": _to_stop_words,
    "debug": to_bool,
    "learn": to_bool,
    "drafter": to_str,
}
