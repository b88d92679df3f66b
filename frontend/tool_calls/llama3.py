"""Llama 3.1 / 3.2 / 3.3 JSON calls: the output is `{"name": ..., "parameters": {...}}` (optionally
after `<|python_tag|>`), several separated by `;`."""

from __future__ import annotations

import json

from .calls import ToolCall, json_calls
from .family import ToolFamily

TAG = "<|python_tag|>"


def parse(text: str, final: bool) -> list[ToolCall] | None:
    if not final:  # a call's end is the output's end
        return []
    text = text.strip().removeprefix(TAG).strip()
    decoder, calls, position = json.JSONDecoder(), [], 0
    while position < len(text):
        try:
            value, end = decoder.raw_decode(text, position)
        except ValueError:
            rest = json_calls(text[position:])  # the last one, not valid JSON
            return calls + rest if rest is not None else None
        found = json_calls(json.dumps(value))
        if found is None:
            return None
        calls += found
        position = end
        while position < len(text) and text[position] in "; \n\t":
            position += 1
    return calls or None


FAMILY = ToolFamily(
    "llama3_json",
    template_markers=("respond with a JSON for a function call", TAG),
    starts=(),
    parse=parse,
    leading=("{", TAG),
    special_tokens=True,
)
