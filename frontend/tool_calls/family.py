"""ToolFamily: one model family's tool-call syntax, as its chat template asks the model to write it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .calls import ToolCall, openai_call_id


@dataclass(frozen=True)
class ToolFamily:
    """name: the family, for messages and docs. template_markers: text that only this family's
    chat templates hold (any one identifies it). starts: text that opens the model's tool calls
    anywhere; leading: text that opens them only at the output's start (after whitespace).
    parse(calls_text, final): the calls in the text from the opening marker on; with final
    False, only those already closed (so that a stream can send them), None where none can be
    read. special_tokens: the syntax uses special tokens, which the output must keep.
    call_id: a new call's id, as the family's template takes them back.
    """

    name: str
    template_markers: tuple[str, ...]
    starts: tuple[str, ...]
    parse: Callable[[str, bool], list[ToolCall] | None]
    leading: tuple[str, ...] = ()
    special_tokens: bool = False
    call_id: Callable[[], str] = openai_call_id

    def matches(self, template: str) -> bool:
        return any(marker in template for marker in self.template_markers)

    def find_start(self, text: str) -> int | None:
        """Where the calls open in `text` (None: not yet)."""
        stripped = text.lstrip()
        if any(stripped.startswith(lead) for lead in self.leading):
            return len(text) - len(stripped)
        found = [index for index in (text.find(start) for start in self.starts) if index >= 0]
        return min(found) if found else None

    def may_start(self, text: str) -> int:
        """How many characters at the end of `text` could begin an opening marker: a stream holds
        them back until it knows."""
        stripped = text.lstrip()
        if self.leading and (not stripped or any(lead.startswith(stripped) for lead in self.leading)):
            return len(text)
        longest = max(map(len, self.starts), default=0)
        for length in range(min(len(text), longest - 1), 0, -1):
            if any(start.startswith(text[-length:]) for start in self.starts):
                return length
        return 0
