"""Llama 3.1 / 3.2 / 3.3 JSON calls: the output is `{"name": ..., "parameters": {...}}` (optionally
after `<|python_tag|>`), several separated by `;`."""

from __future__ import annotations

from .calls import ToolCall, json_call_sequence
from .family import ToolFamily

TAG = "<|python_tag|>"


def parse(text: str, final: bool) -> list[ToolCall] | None:
    if not final:  # a call's end is the output's end
        return []
    return json_call_sequence(text.strip().removeprefix(TAG))


FAMILY = ToolFamily(
    "llama3_json",
    template_markers=("respond with a JSON for a function call", TAG),
    starts=(),
    parse=parse,
    leading=("{", TAG),
    special_tokens=True,
)
