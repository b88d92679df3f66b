"""Prompts in a model's chat format."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def apply_chat_template(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` as one user turn followed by the assistant's generation prompt."""
    _require_template(tokenizer)
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def chat_prompt(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> str:
    """The text of a conversation in the model's chat format, ending with the assistant's generation
    prompt: what a client sends as the raw prompt of a server that applies no template itself."""
    _require_template(tokenizer)
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


def _require_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: send the prompt unformatted")
