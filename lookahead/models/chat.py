"""Prompts in a model's chat format."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def apply_chat_template(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` as one user turn followed by the assistant's generation prompt."""
    _require_template(tokenizer)
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def chat_prompt(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> str:
    """The text of a conversation in the model's chat format, ending with the assistant's generation
    prompt: what a client sends as the raw prompt of a server that applies no template itself.
    tools: OpenAI's function definitions, which the template renders where it has them."""
    _require_template(tokenizer)
    extra = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True, **extra)


def template_source(tokenizer: Any, tools: bool = False) -> str:
    """The chat template's Jinja source that renders a conversation (with tools: the one that
    renders them, where a tokenizer names several); "" where it has none."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("tool_use" if tools and "tool_use" in template else "default", "")
    return template


def renders_tools(tokenizer: Any) -> bool:
    """The chat template reads a `tools` list (as transformers passes it)."""
    return "tools" in template_source(tokenizer, tools=True)


def _require_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: send the prompt unformatted")
