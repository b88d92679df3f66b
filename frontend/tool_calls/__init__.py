"""Tool-call syntax per model family: which family a chat template is, and its calls in an output.

A new family is one file here defining a ToolFamily (family.py) and its line in FAMILIES; the
first whose template markers the chat template holds parses the model's output.
"""

from __future__ import annotations

from . import hermes, llama3, mistral
from .calls import ToolCall
from .family import ToolFamily
from .split import CallDelta, NamedCall, ParsedCalls, RequiredCalls, ToolOutput, gather

FAMILIES: tuple[ToolFamily, ...] = (hermes.FAMILY, mistral.FAMILY, llama3.FAMILY)


def family_for_template(template: str) -> ToolFamily | None:
    """The family whose syntax a chat template asks for; None where no parser knows it."""
    return next((family for family in FAMILIES if family.matches(template)), None)


__all__ = [
    "FAMILIES",
    "CallDelta",
    "NamedCall",
    "ParsedCalls",
    "RequiredCalls",
    "ToolCall",
    "ToolFamily",
    "ToolOutput",
    "family_for_template",
    "gather",
]
