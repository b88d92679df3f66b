"""Prompts in a model's chat format."""

from __future__ import annotations

from typing import Any


def apply_chat_template(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` as one user turn followed by the assistant's generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: send the prompt unformatted")
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
