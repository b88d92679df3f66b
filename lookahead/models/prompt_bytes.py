"""How many bytes a prompt may have before it is tokenized: a bound checked on the raw text, so an
oversize prompt is refused without the work of tokenizing it."""

from __future__ import annotations

from typing import Any


def prompt_byte_limit(tokenizer: Any, max_prompt_tokens: int) -> int:
    """The most UTF-8 bytes a prompt of max_prompt_tokens tokens can have: the longest token's
    bytes (its vocabulary string, which spells a byte with at least one), times four for
    normalizers that shrink text (no Unicode normalization shrinks it more)."""
    longest = max(
        len(token.encode("utf-8"))
        for token in tokenizer.convert_ids_to_tokens(range(len(tokenizer)))
        if token
    )
    return 4 * max_prompt_tokens * longest
