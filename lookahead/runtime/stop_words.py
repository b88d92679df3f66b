"""Stop words: the token ids of `LookaheadConfig.stop_words`, given as ids or one-token strings.

As in the reference implementation, a stop word (typically punctuation or a space) never starts
an n-gram the tries learn from an output, and a one-token context that is a stop word retrieves
no draft: what follows a bare "," or " " is too varied to be worth verifying. Inside n-grams,
after other tokens, stop words are learned and drafted as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def stop_word_ids(words: Sequence[int | str], tokenizer: Any, vocab_size: int) -> frozenset[int]:
    """The ids of `words`; ValueError names an id outside the vocabulary or a string that is
    not exactly one token."""
    ids = set()
    for word in words:
        if isinstance(word, str):
            tokens = list(tokenizer.encode(word, add_special_tokens=False))
            if len(tokens) != 1:
                raise ValueError(
                    f"stop_words entry {word!r} is {len(tokens)} tokens {tokens}, not one: "
                    "give single-token strings or token ids"
                )
            word = tokens[0]
        if not 0 <= word < vocab_size:
            raise ValueError(f"stop_words entry {word} is outside the vocabulary (0..{vocab_size - 1})")
        ids.add(int(word))
    return frozenset(ids)
