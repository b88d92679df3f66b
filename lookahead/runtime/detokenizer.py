"""Token ids -> text deltas that are safe to stream, and the stop strings in them.

Each step may accept several tokens. We decode a short window of the whole sequence rather
than each token on its own (byte-level BPE tokens may hold half a UTF-8 character, and
SentencePiece tokens change spacing with context), emit only the new suffix up to the last
complete character, and hold back any tail that could still become a stop string so that a stop
string is never emitted, not even in part (unless include_stop_str_in_output). When a step's text
holds a stop string, its tokens are replayed one by one: the generation ends at the token that
completes the stop string, exactly where plain decoding would have stopped, and the tokens after
it are not consumed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the output so the first delta is spaced right


class Detokenizer:
    """Incremental detokenization of one request's output, with vLLM's stop-string rules.

    min_tokens: stop strings count only once more than this many tokens were pushed.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        stop: tuple[str, ...] = (),
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.min_tokens = min_tokens
        self.ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.partial = (
            0  # characters of the window after read_offset already decoded (a character is incomplete)
        )
        self.pending = ""  # decoded but held back (a possible stop-string start)
        # include_stop: the end of the emitted text, where a stop string may have begun.
        self.tail = ""
        self.tail_length = max((len(s) for s in stop), default=1) - 1
        self.pushed = 0  # output tokens pushed so far
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """Add tokens; return (the text that may be emitted now, how many of them were consumed:
        all, or up to the one completing a stop string)."""
        if not self.stop:
            self.ids.extend(token_ids)
            self.pushed += len(token_ids)
            return self._decode_next(), len(token_ids)
        saved = (
            len(self.ids),
            self.prefix_offset,
            self.read_offset,
            self.partial,
            self.pending,
            self.tail,
            self.pushed,
        )
        self.ids.extend(token_ids)
        self.pushed += len(token_ids)
        candidate = self.pending + self._decode_next()
        if self._find_stop(self.tail + candidate) is None:
            return self._release(candidate, checked=False), len(token_ids)
        # A stop string is in this step's text: replay token by token to stop where plain decoding would.
        length, self.prefix_offset, self.read_offset, self.partial, self.pending, self.tail, self.pushed = (
            saved
        )
        del self.ids[length:]
        text = ""
        for consumed, token in enumerate(token_ids, start=1):
            self.ids.append(token)
            self.pushed += 1
            text += self._release(self.pending + self._decode_next(), checked=self.pushed > self.min_tokens)
            if self.stopped:
                return text, consumed
        return text, len(token_ids)

    def flush(self) -> str:
        """Text held back at the end of generation (no stop string can complete any more)."""
        text, self.pending = ("" if self.stopped else self.pending), ""
        return text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_next(self) -> str:
        """The new text of the window up to its last complete character."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        complete = full.rstrip("\ufffd")
        start = len(prefix) + self.partial
        if len(complete) <= start:
            return ""
        new = complete[start:]
        if complete == full:
            self.prefix_offset, self.read_offset, self.partial = self.read_offset, len(self.ids), 0
        else:
            self.partial += len(new)
        return new

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The first stop string (in the list's order, as vLLM checks them) found in text."""
        for stop in self.stop:
            index = text.find(stop)
            if index >= 0:
                return index, stop
        return None

    def _release(self, text: str, *, checked: bool) -> str:
        """What of `text` (held back text + new text) may be emitted; sets `stopped` on a stop string
        when `checked`."""
        if checked and (found := self._find_stop(self.tail + text)) is not None:
            index, stop = found
            index -= len(self.tail)  # where it starts in `text` (before it, with include_stop)
            self.stopped, self.pending = True, ""
            return text[: index + len(stop)] if self.include_stop else text[: max(index, 0)]
        if self.include_stop:
            self.tail = (self.tail + text)[max(0, len(self.tail) + len(text) - self.tail_length) :]
            return text
        hold = max((_overlap(text, s) for s in self.stop), default=0)
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
