"""Token ids -> text deltas that are safe to stream.

Each step may accept several tokens. We decode a short window of the whole sequence rather
than each token on its own (byte-level BPE tokens may hold half a UTF-8 character, and
SentencePiece tokens change spacing with context), emit only the new suffix, hold back a
trailing replacement character until the character completes, and hold back any tail that
could still become a stop string so a stop string is never emitted, not even in part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the output so the first delta is spaced right


@dataclass
class Detokenizer:
    tokenizer: Any
    prompt_ids: list[int]
    stop: tuple[str, ...] = ()
    ids: list[int] = field(init=False)
    prefix_offset: int = field(init=False)
    read_offset: int = field(init=False)
    pending: str = field(init=False, default="")  # decoded but held back (possible stop-string start)
    stopped: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.ids = list(self.prompt_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text that may be emitted now ("" while a character is incomplete)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return self._release("")
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(full[len(prefix) :])

    def flush(self) -> str:
        """Text held back at the end of generation (no stop string can complete any more)."""
        text, self.pending = ("" if self.stopped else self.pending), ""
        return text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _release(self, new_text: str) -> str:
        text = self.pending + new_text
        if not self.stop:
            self.pending = ""
            return text
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return text[: min(hits)]
        hold = max((_overlap(text, s) for s in self.stop), default=0)
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
