"""Hermes-style calls, which Qwen2.5, Qwen2.5-Coder, Qwen3 and NousResearch's Hermes templates ask for:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call. A block holding a
JSON list of calls (SmolLM2's trained form) gives each of them; an output of bare call objects,
without the tags, or in a ```json fence (small Qwen models write those), gives theirs."""

from __future__ import annotations

from .calls import ToolCall, json_call_sequence, json_calls
from .family import ToolFamily

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```json"


def parse(text: str, final: bool) -> list[ToolCall] | None:
    if not text.startswith(OPEN):  # bare call objects (in a code fence or not): they end with the output
        bare = (
            text.removeprefix(FENCE).removeprefix("\n").removesuffix("```")
            if text.startswith(FENCE)
            else text
        )
        return json_call_sequence(bare) if final else []
    calls: list[ToolCall] = []
    for block in text.split(OPEN)[1:]:
        closed = CLOSE in block
        if not closed and not final:
            break
        found = json_calls(block.split(CLOSE, 1)[0])
        if found is None:
            return None
        calls += found
    return calls or (None if final else [])


FAMILY = ToolFamily("hermes", template_markers=(OPEN,), starts=(OPEN,), parse=parse, leading=("{", FENCE))
