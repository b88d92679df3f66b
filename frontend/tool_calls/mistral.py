"""Mistral's calls: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers) or
`[TOOL_CALLS]name[ARGS]{...}` per call (v11 and later). `[TOOL_CALLS]` is a special token, which
the output keeps; Mistral's templates take back only ids of nine letters or digits."""

from __future__ import annotations

from .calls import ToolCall, arguments_text, json_calls, short_call_id
from .family import ToolFamily

OPEN, ARGS = "[TOOL_CALLS]", "[ARGS]"


def parse(text: str, final: bool) -> list[ToolCall] | None:
    if not final:
        return []
    calls: list[ToolCall] = []
    for part in text.split(OPEN)[1:]:
        part = part.strip()
        if ARGS in part:
            name, arguments = part.split(ARGS, 1)
            calls.append(ToolCall(name.strip(), arguments_text(arguments.strip())))
            continue
        found = json_calls(part)
        if found is None:
            return None
        calls += found
    return calls or None


FAMILY = ToolFamily(
    "mistral",
    template_markers=("[AVAILABLE_TOOLS]", OPEN),
    starts=(OPEN,),
    parse=parse,
    special_tokens=True,
    call_id=short_call_id,
)
