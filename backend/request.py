"""One inference request -> a validated GenerationRequest, or a RequestError naming the problem.

This module never imports Triton: the backend wraps a `pb_utils.InferenceRequest` in a tiny
adapter with the `RequestInputs` shape, tests pass plain numpy arrays and dicts. The tensor
contract is vLLM's backend's, so vLLM clients, genai-perf and the OpenAI frontend
work unchanged; lookahead settings ride along inside `sampling_parameters`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from lookahead.config import LookaheadConfig, SamplingParams, field_names

STREAMING_ECHO_ERROR = "When streaming, `exclude_input_in_output` = False is not allowed."
SAMPLING_KEYS = field_names(SamplingParams)
LOOKAHEAD_OVERRIDES = (
    "use_lookahead",
    "decoding_length",
    "branch_length",
    "decoding_mode",
    "stop_words",
    "debug",
)
_FLAGS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
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
    """Instance limits a request is checked against."""

    lookahead: LookaheadConfig  # instance defaults, also the per-request maxima
    max_prompt_tokens: int
    max_output_tokens: int


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    lookahead: LookaheadConfig
    stream: bool = False
    prepend_input: bool = True
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_perf_metrics: bool = False


def parse_request(
    inputs: RequestInputs,
    limits: RequestLimits,
    tokenize: Callable[[str], list[int]],
    stop_word_ids: Callable[[tuple[int | str, ...]], frozenset[int]] | None = None,
) -> GenerationRequest:
    """Validate every input; raise RequestError with a message naming the offending one.

    stop_word_ids (the decoder's) checks a request's stop_words against the tokenizer."""
    prompt = _text_input(inputs)
    flags = {name: _flag(inputs, name) for name in _FLAGS}
    stream = bool(flags["stream"])
    exclude_input = flags["exclude_input_in_output"]
    if stream and exclude_input is False:
        raise RequestError(STREAMING_ECHO_ERROR)

    options = _sampling_options(inputs)
    sampling = _sampling_params(options, limits.max_output_tokens)
    lookahead = _lookahead_config(options, limits.lookahead)
    if stop_word_ids is not None:
        try:
            stop_word_ids(lookahead.stop_words)
        except ValueError as error:
            raise RequestError(str(error)) from None

    prompt_ids = tuple(tokenize(prompt))
    if not prompt_ids:
        raise RequestError("text_input is empty: the prompt must hold at least one token")
    limit = limits.max_prompt_tokens
    if len(prompt_ids) > limit:
        raise RequestError(f"text_input has {len(prompt_ids)} tokens, more than max_prompt_tokens ({limit})")
    return GenerationRequest(
        prompt=prompt,
        prompt_ids=prompt_ids,
        sampling=sampling,
        lookahead=lookahead,
        stream=stream,
        # vLLM's default: the prompt is echoed when not streaming, never when streaming.
        prepend_input=not stream if exclude_input is None else not exclude_input,
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
    try:
        options = json.loads(raw)
    except json.JSONDecodeError as error:
        raise RequestError(f"sampling_parameters is not valid JSON: {error}") from None
    if not isinstance(options, dict):
        raise RequestError(f"sampling_parameters must be a JSON object, got {type(options).__name__}")
    return options


def _sampling_params(options: Mapping[str, Any], max_output_tokens: int) -> SamplingParams:
    """Known SamplingParams fields, converted by their type; unknown keys are ignored."""
    values = _converted(options, SAMPLING_KEYS)
    values.setdefault("max_tokens", min(SamplingParams.max_tokens, max_output_tokens))
    if values["max_tokens"] > max_output_tokens:
        raise RequestError(
            f"max_tokens must be <= {max_output_tokens} on this model, got {values['max_tokens']}"
        )
    try:
        return SamplingParams(**values)
    except ValueError as error:
        raise RequestError(str(error)) from None


def _lookahead_config(options: Mapping[str, Any], instance: LookaheadConfig) -> LookaheadConfig:
    overrides = _converted(options, LOOKAHEAD_OVERRIDES)
    try:
        return instance.capped(instance, **overrides)
    except ValueError as error:
        raise RequestError(str(error)) from None


def _converted(options: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The options among `names`, each converted to its field's type; null means unset."""
    return {name: _CONVERTERS[name](name, options[name]) for name in names if options.get(name) is not None}


def _to_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise RequestError(f"{name} must be an integer, got {value!r}")


def _to_float(name: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise RequestError(f"{name} must be a number, got {value!r}")


def _to_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise RequestError(f"{name} must be true or false, got {value!r}")


def _to_stop(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise RequestError(f"{name} must be a string or a list of strings, got {value!r}")


def _to_stop_words(name: str, value: Any) -> tuple[int | str, ...]:
    words = [value] if isinstance(value, str | int) and not isinstance(value, bool) else value
    if isinstance(words, list) and all(
        (isinstance(w, int) and not isinstance(w, bool)) or isinstance(w, str) for w in words
    ):
        return tuple(words)
    raise RequestError(f"{name} must be a list of strings and token ids, got {value!r}")


def _to_str(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    raise RequestError(f"{name} must be a string, got {value!r}")


_CONVERTERS: dict[str, Callable[[str, Any], Any]] = {
    "max_tokens": _to_int,
    "min_tokens": _to_int,
    "temperature": _to_float,
    "top_k": _to_int,
    "top_p": _to_float,
    "repetition_penalty": _to_float,
    "seed": _to_int,
    "stop": _to_stop,
    "ignore_eos": _to_bool,
    "use_lookahead": _to_bool,
    "decoding_length": _to_int,
    "branch_length": _to_int,
    "decoding_mode": _to_str,
    "stop_words": _to_stop_words,
    "debug": _to_bool,
}
