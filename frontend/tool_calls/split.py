"""A choice's output split into content and tool calls, as it streams or whole.

Each reader takes the output's text as it grows and answers what can be sent now: content, and
CallDeltas (a call's start with its name, then pieces of its arguments), so that a stream sends
what OpenAI's streams send and a whole response is the same deltas gathered.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from .calls import ToolCall, arguments_text
from .family import ToolFamily


@dataclass(frozen=True)
class CallDelta:
    """index: the call's place among the choice's calls; name: set on the call's first delta only."""

    index: int
    name: str | None
    arguments: str


class ToolOutput(Protocol):
    def feed(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        """(content, call deltas) that `text`, the output's next piece, lets a stream send now;
        final: the output ended with it."""
        ...


def _starts(calls: Iterable[ToolCall], first_index: int) -> list[CallDelta]:
    deltas = []
    for index, call in enumerate(calls, first_index):
        deltas += [CallDelta(index, call.name, ""), CallDelta(index, None, call.arguments)]
    return deltas


class ParsedCalls:
    """tool_choice auto: content until the family's calls open, then each call once it closed
    (the output's end closes them all). Text that reads as no call is content."""

    def __init__(self, family: ToolFamily, parallel: bool = True):
        self.family = family
        self.parallel = parallel
        self.text = ""
        self.sent = 0  # characters of text sent as content (or, from start on, read as calls)
        self.start: int | None = None
        self.calls = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        self.text += text
        if self.start is None:
            self.start = self.family.find_start(self.text)
        if self.start is None:
            end = len(self.text) - (0 if final else self.family.may_start(self.text))
            return self._content(end), []
        content = self._content(self.start)
        content = content if content.strip() else ""  # the whitespace before the calls is no content
        calls = self.family.parse(self.text[self.start :], final)
        if calls is None:
            return content + (self._content(len(self.text)) if final else ""), []
        if not self.parallel:
            calls = calls[:1]
        new, self.calls = calls[self.calls :], len(calls)
        return content, _starts(new, self.calls - len(new))

    def _content(self, end: int) -> str:
        content = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return content


class NamedCall:
    """tool_choice naming a function: the output, constrained to its parameters' schema, is the
    call's arguments, sent as it comes."""

    def __init__(self, name: str):
        self.name = name
        self.started = False

    def feed(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        deltas = []
        if not self.started and (text or final):
            deltas.append(CallDelta(0, self.name, ""))
            self.started = True
        if text:
            deltas.append(CallDelta(0, None, text))
        return "", deltas


class RequiredCalls:
    """tool_choice required: the output, constrained to a JSON list of {"name", "parameters"}, is
    read once it ended; an output cut short is content."""

    def __init__(self) -> None:
        self.text = ""

    def feed(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        self.text += text
        if not final:
            return "", []
        try:
            listed = json.loads(self.text)
            calls = [ToolCall(item["name"], arguments_text(item["parameters"])) for item in listed]
        except (ValueError, TypeError, KeyError):
            return self.text, []
        return "", _starts(calls, 0)


def gather(deltas: list[CallDelta]) -> list[ToolCall]:
    """The calls that a whole output's deltas spell."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        if delta.name is not None:
            names[delta.index] = delta.name
        arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    return [ToolCall(names[index], arguments[index]) for index in sorted(names)]
