"""What every family's parser returns, and the JSON call objects most families write.

A call is a function name and its arguments as JSON text: the arguments object re-serialised when
the model wrote valid JSON, else the text it wrote (never an error: the client sees what came out).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text (or, where the model's was not JSON, its text)


def arguments_text(arguments: Any) -> str:
    """OpenAI's `arguments` string: a string as written, anything else as JSON."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def json_calls(text: str) -> list[ToolCall] | None:
    """The calls in one JSON text: an object {"name", "arguments" | "parameters"} or a list of them.
    Text that is not JSON still gives its call where a name can be read off it (its arguments
    the text after `"arguments":`); None where no call can be read."""
    text = text.strip()
    try:
        value = json.loads(text)
    except ValueError:
        return _loose_call(text)
    objects = value if isinstance(value, list) else [value]
    calls = [_object_call(item) for item in objects]
    if not calls or any(call is None for call in calls):
        return None
    return calls  # type: ignore[return-value]


def json_call_sequence(text: str) -> list[ToolCall] | None:
    """The calls of call objects one after another (whitespace or `;` between them); the last one
    may be cut short or mistyped (json_calls reads what it can of it; nothing readable: dropped)."""
    text = text.strip()
    decoder, calls, position = json.JSONDecoder(), [], 0
    while position < len(text):
        try:
            value, end = decoder.raw_decode(text, position)
        except ValueError:
            rest = json_calls(text[position:])  # an unreadable tail after calls is dropped
            return calls + rest if rest is not None else (calls or None)
        found = json_calls(json.dumps(value))
        if found is None:
            return None
        calls += found
        position = end
        while position < len(text) and text[position] in "; \n\t":
            position += 1
    return calls or None


def _object_call(value: Any) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], arguments_text(arguments))


def _loose_call(text: str) -> list[ToolCall] | None:
    """One call from a JSON-like object the model did not finish or mistyped."""
    name = _NAME.search(text)
    if name is None:
        return None
    arguments = _ARGUMENTS.search(text)
    raw = ""
    if arguments is not None:
        raw = text[arguments.end() :].rstrip()
        if raw.endswith("}") and text.lstrip().startswith("{"):
            raw = raw[:-1].rstrip()  # the wrapping object's brace
    try:
        decoded_name = json.loads(f'"{name.group(1)}"')
    except ValueError:
        decoded_name = name.group(1)
    return [ToolCall(decoded_name, raw)]


def openai_call_id() -> str:
    """An id as OpenAI's look: call_ and 24 letters or digits."""
    return "call_" + _alphanumeric(24)


def short_call_id() -> str:
    """Nine letters or digits: the ids Mistral's chat templates require."""
    return _alphanumeric(9)


def _alphanumeric(length: int) -> str:
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(length))
