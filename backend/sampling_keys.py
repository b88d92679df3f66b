"""The `sampling_parameters` keys: every field name vLLM's SamplingParams has had, and what each does here.

Clients written for vLLM's backend (the OpenAI frontend, genai-perf, tritonclient scripts) send
the whole vLLM vocabulary, often as strings ("0.7", "false"). Every key vLLM knows is either
supported with vLLM's meaning, or accepted only while it holds the value that changes nothing
(the OpenAI frontend sends `logprobs: false`, `use_beam_search: false`...) and refused with
INVALID_ARG naming it otherwise. Keys no vLLM version knows are ignored, as vLLM's backend
ignores them. The list was read off vLLM's `vllm/sampling_params.py` across its releases (0.4
to 0.11+), plus `lora_name` from Triton's TritonSamplingParams.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from lookahead.config import (
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID_LIST,
    STRUCTURED_KINDS,
    StructuredOutputs,
    shown,
)
from lookahead.contract import dotted, lone_surrogate, surrogate_message

NO_EFFECT = object()  # an accepted-at-default key whose every value is accepted: vLLM ignores it too


def to_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {shown(value)}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                pass
            else:
                if number.is_integer():
                    return int(number)
    raise ValueError(f"{name} must be an integer, got {shown(value)}")


def to_float(name: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise ValueError(f"{name} must be a number, got {shown(value)}")


def to_bool(name: str, value: Any) -> bool:
    """true/false, also as strings ("false" is false) and 1/0."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise ValueError(f"{name} must be true or false, got {shown(value)}")


def to_str(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ValueError(f"{name} must be a string, got {shown(value)}")


def to_stop(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:  # before looking at each
        raise ValueError(f"{name} may hold at most {MAX_STOP_STRINGS} strings, got {len(value)}")
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise ValueError(f"{name} must be a string or a list of strings, got {shown(value)}")


def to_token_ids(name: str, value: Any) -> tuple[int, ...]:
    value = _json(name, value)
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list of token ids, got {shown(value)}")
    if len(value) > MAX_TOKEN_ID_LIST:
        raise ValueError(f"{name} may hold at most {MAX_TOKEN_ID_LIST} ids, got {len(value)}")
    return tuple(to_int(name, item) for item in value)


def to_logit_bias(name: str, value: Any) -> dict[int, float]:
    value = _json(name, value)
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object mapping token ids to biases, got {shown(value)}")
    if len(value) > MAX_TOKEN_ID_LIST:
        raise ValueError(f"{name} may hold at most {MAX_TOKEN_ID_LIST} entries, got {len(value)}")
    return {
        to_int(f"{name} token id", token): to_float(f"{name} value", bias) for token, bias in value.items()
    }


def to_logprobs(name: str, value: Any) -> int | None:
    """vLLM's logprobs: a count; true means 1, false (the OpenAI frontend's default) none."""
    if isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() in ("true", "false")):
        return 1 if to_bool(name, value) else None
    return to_int(name, value)


def as_json(name: str, value: Any) -> Any:
    """A list or object, also when it arrived as its JSON text."""
    return _json(name, value)


def _json(name: str, value: Any) -> Any:
    """A list or object that arrived as its JSON text (a string that is not JSON stays a string);
    ValueError naming `name` for JSON text nested too deeply, holding a number too long for Python
    or a lone surrogate."""
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    except RecursionError:
        raise ValueError(f"{name} is JSON text nested too deeply") from None
    except ValueError as error:  # e.g. an integer of more than 4300 digits
        raise ValueError(f"{name} is JSON text Python cannot read: {error}") from None
    where = lone_surrogate(parsed)
    if where is not None:
        raise ValueError(surrogate_message(name + dotted(where)))
    return parsed


# vLLM key -> (SamplingParams field, converter)
SUPPORTED: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "max_tokens": ("max_tokens", to_int),
    "min_tokens": ("min_tokens", to_int),
    "temperature": ("temperature", to_float),
    "top_k": ("top_k", to_int),
    "top_p": ("top_p", to_float),
    "min_p": ("min_p", to_float),
    "repetition_penalty": ("repetition_penalty", to_float),
    "presence_penalty": ("presence_penalty", to_float),
    "frequency_penalty": ("frequency_penalty", to_float),
    "logit_bias": ("logit_bias", to_logit_bias),
    "seed": ("seed", to_int),
    "stop": ("stop", to_stop),
    "stop_token_ids": ("stop_token_ids", to_token_ids),
    "include_stop_str_in_output": ("include_stop_str_in_output", to_bool),
    "ignore_eos": ("ignore_eos", to_bool),
    "skip_special_tokens": ("skip_special_tokens", to_bool),
    "logprobs": ("logprobs", to_logprobs),
    "prompt_logprobs": ("prompt_logprobs", to_logprobs),
    "n": ("n", to_int),
    "best_of": ("best_of", to_int),
}

# Known to vLLM, not implemented here: key -> (converter, the values that change nothing). A
# value equal to one of those is accepted; any other is refused. NO_EFFECT: any value (vLLM's
# own sampler ignores it, or it only tunes vLLM's engine).
ACCEPTED_AT_DEFAULT: dict[str, tuple[Callable[[str, Any], Any], Any]] = {
    "use_beam_search": (to_bool, (False,)),
    "length_penalty": (to_float, (1.0,)),
    "early_stopping": (to_bool, (False,)),
    "detokenize": (to_bool, (True,)),
    "spaces_between_special_tokens": (to_bool, (True,)),
    "logits_processors": (as_json, ([],)),
    "allowed_token_ids": (as_json, ([],)),
    "bad_words": (as_json, ([],)),
    "lora_name": (to_str, ("",)),
    "thinking_token_budget": (to_int, (-1,)),
    "repetition_detection": (as_json, ({},)),
    "stream_interval": (to_int, (1,)),
    "flat_logprobs": (to_bool, (False,)),
    "logprob_token_ids": (as_json, ([],)),
    "prompt_logprob_token_ids": (as_json, ([],)),
    "prompt_logprob_start": (to_int, (0,)),
    "trace_decode_token_ids": (as_json, ([],)),
    "routed_experts_prompt_start": (to_int, (0,)),
    "output_kind": (as_json, NO_EFFECT),
    "output_text_buffer_length": (as_json, NO_EFFECT),
    "extra_args": (as_json, NO_EFFECT),
    "skip_clone": (as_json, NO_EFFECT),
    "skip_reading_prefix_cache": (as_json, NO_EFFECT),
}

# Structured outputs: vLLM's structured_outputs and its older guided_decoding (an object with one
# of STRUCTURED_KINDS set), and the OpenAI server's guided_* request fields.
STRUCTURED = ("structured_outputs", "guided_decoding")
GUIDED = {f"guided_{kind}": kind for kind in STRUCTURED_KINDS}
# Fields of vLLM's StructuredOutputsParams that change nothing here, at any value (a backend
# choice, a fallback rule) or at their default.
STRUCTURED_NEUTRAL = {
    "backend": NO_EFFECT,
    "_backend": NO_EFFECT,
    "backend_was_auto": NO_EFFECT,
    "disable_fallback": NO_EFFECT,
    "disable_additional_properties": (False,),
    "whitespace_pattern": (),
    "structural_tag": (),
    "_backend_was_auto": NO_EFFECT,
}
GUIDED_NEUTRAL = ("guided_decoding_backend", "guided_whitespace_pattern")


def to_structured(name: str, value: Any) -> StructuredOutputs | None:
    """A structured_outputs / guided_decoding object (or its JSON text); None when it sets nothing."""
    value = _json(name, value)
    if value == "" or value == {}:
        return None
    if not isinstance(value, dict):
        raise ValueError(
            f"{name} must be an object setting one of {', '.join(STRUCTURED_KINDS)}, got {shown(value)}"
        )
    for key, neutral in STRUCTURED_NEUTRAL.items():
        if value.get(key) is not None and neutral is not NO_EFFECT and value[key] not in neutral:
            raise ValueError(f"{name}.{key}={shown(value[key], as_json=True)} is not supported by this model")
    kinds = [kind for kind in STRUCTURED_KINDS if value.get(kind) not in (None, False)]
    if len(kinds) != 1:
        raise ValueError(
            f"{name} must set exactly one of {', '.join(STRUCTURED_KINDS)}, got {', '.join(kinds) or 'none'}"
        )
    any_whitespace = not to_bool(
        f"{name}.disable_any_whitespace", value.get("disable_any_whitespace") or False
    )
    return _constraint(name, kinds[0], value[kinds[0]], f"{name}.{kinds[0]}", any_whitespace)


def _constraint(key: str, kind: str, value: Any, name: str, any_whitespace: bool = True) -> StructuredOutputs:
    """One constraint's source, checked for its type; `name` names it in messages."""
    if kind == "json":
        schema = _json(name, value)
        if isinstance(schema, bool):  # JSON Schema's true (anything) and false (nothing)
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise ValueError(f"{name} must be a JSON schema (an object or its JSON text), got {shown(value)}")
        text = json.dumps(schema)  # property order is the output's order
    elif kind == "choice":
        choices = _json(name, value)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError(f"{name} must be a non-empty list of strings, got {shown(value)}")
        text = json.dumps(choices)
    elif kind == "json_object":
        if not to_bool(name, value):
            raise ValueError(f"{name} must be true, got {shown(value)}")
        text = ""
    else:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name} must be a non-empty string, got {shown(value)}")
        text = value
    return StructuredOutputs(kind, text, any_whitespace, key=key)


def structured_outputs(options: Mapping[str, Any]) -> StructuredOutputs | None:
    """The request's constraint from whichever key set it; ValueError when several do or it is bad."""
    found = []
    for key in STRUCTURED:
        if options.get(key) is not None:
            constraint = to_structured(key, options[key])
            if constraint is not None:
                found.append((key, constraint))
    for key, kind in GUIDED.items():
        if options.get(key) not in (None, False):
            found.append((key, _constraint(key, kind, options[key], key)))
    if len(found) > 1:
        raise ValueError(f"{' and '.join(key for key, _ in found)} both constrain the output: send one")
    return found[0][1] if found else None


# truncate_prompt_tokens: keep only the prompt's last k tokens (vLLM's left truncation).
TRUNCATE = "truncate_prompt_tokens"

VLLM_KEYS = (
    frozenset(SUPPORTED) | frozenset(ACCEPTED_AT_DEFAULT) | {TRUNCATE, *STRUCTURED, *GUIDED, *GUIDED_NEUTRAL}
)


def sampling_fields(options: Mapping[str, Any]) -> tuple[dict[str, Any], int | None]:
    """(SamplingParams fields, truncate_prompt_tokens) from `sampling_parameters`; null means unset.

    Raises ValueError naming the key for a bad value or an unsupported one.
    """
    fields: dict[str, Any] = {}
    truncate = None
    for key, value in options.items():
        if value is None:
            continue
        if key in SUPPORTED:
            name, convert = SUPPORTED[key]
            converted = convert(key, value)
            if converted is not None:
                fields[name] = converted
        elif key in ACCEPTED_AT_DEFAULT:
            convert, neutral = ACCEPTED_AT_DEFAULT[key]
            if neutral is not NO_EFFECT and convert(key, value) not in neutral:
                raise ValueError(
                    f"{key}={shown(value, as_json=True)} is not supported by this model "
                    f"(it accepts {key} only as {' or '.join(json.dumps(v) for v in neutral)})"
                )
        elif key == TRUNCATE:
            truncate = to_int(key, value)
            if truncate < 1:
                raise ValueError(f"{TRUNCATE} must be >= 1, got {truncate}")
    constraint = structured_outputs(options)
    if constraint is not None:
        fields["structured_outputs"] = constraint
    return fields, truncate
