"""The longest earlier repeat of a request's latest tokens: long copy drafts (SuffixDecoding's idea).

The tries see at most max_query_length tokens of context, so "the last 4 tokens occur in the
prompt" and "the last 40 tokens are a verbatim copy of the prompt" look alike to them. The
second is far stronger evidence: a model that has been copying a span tends to go on copying
it (code edits, quoted documents, repeated answers). `SpanIndex` keeps where every KEY-token
n-gram of the request's text (prompt and output) ends, finds the earlier occurrence whose
agreement with the latest tokens runs back furthest, and proposes what followed it.

An edit breaks a copy: the model writes something else (a new name, an inserted line) and then
goes back to copying where it left off, or a little further on. Until KEY tokens agree again the
index resumes the broken copy itself: once the latest token is one of the RESUME_WINDOW source
tokens from the break on, it proposes what followed that token.

Probabilities follow Laplace's rule of succession: after m matching tokens the next one matches
with probability (m + 1) / (m + 2), so reaching depth d of the copy has probability
(m + 1) / (m + d + 1). A long match thus earns a long draft, a short one (a resumed copy after
one agreeing token) a short draft.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

KEY = 4  # shortest repeat looked up: shorter contexts are the tries' job
MAX_CANDIDATES = 16  # most recent earlier occurrences of the key compared per lookup
MAX_MATCH = 256  # a match is measured up to this length: beyond it the probabilities barely change
RESUME_WINDOW = 32  # source tokens from a copy's break on where copying may resume (what an edit replaced)


@dataclass(frozen=True)
class Copy:
    """`tokens` followed an earlier text whose last `matched` tokens equal the latest ones; the
    first `from_prompt` of them are the prompt's, the rest the request's own output."""

    tokens: list[int]
    matched: int
    from_prompt: int = field(default=0, compare=False)

    def conditional(self, index: int) -> float:
        """Probability that tokens[index] comes next, given that tokens[:index] came."""
        seen = self.matched + index
        return (seen + 1) / (seen + 2)


class SpanIndex:
    """A request's token ids and the end positions of each of their KEY-grams; the tokens it
    starts with are the prompt."""

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self._ids: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._cursor = -1  # position of the token the latest copy proposes next, -1 for none
        self._break = -1  # position of the source token where the latest copy broke off, -1 for none
        self.extend(tokens)
        self._prompt_length = len(self._ids)

    def _copy(self, start: int, max_tokens: int, matched: int) -> Copy:
        """What follows position `start`, after `matched` agreeing tokens."""
        return Copy(self._ids[start : start + max_tokens], matched, max(0, self._prompt_length - start))

    def extend(self, tokens: Iterable[int]) -> None:
        ids = self._ids
        for token in tokens:
            token = int(token)
            if self._cursor >= 0:  # the cursor always lies before the end: it reads earlier text
                if ids[self._cursor] == token:
                    self._cursor += 1
                else:
                    self._break, self._cursor = self._cursor, -1
            ids.append(token)
            if len(ids) >= KEY:
                self._ends.setdefault(tuple(ids[-KEY:]), []).append(len(ids))

    def continuation(self, max_tokens: int) -> Copy | None:
        """What followed the longest earlier repeat of the latest tokens (ties: the most recent);
        without one, the latest broken copy resumed (see `_resumed`)."""
        ids = self._ids
        n = len(ids)
        if n < KEY or max_tokens <= 0:
            return None
        ends = self._ends[tuple(ids[-KEY:])][:-1]  # the last entry is the latest tokens themselves
        best_end, best_matched = -1, 0
        for end in reversed(ends[-MAX_CANDIDATES:]):
            matched = self._agreement(end, KEY)
            if matched > best_matched:
                best_end, best_matched = end, matched
        if best_end < 0:
            return self._resumed(max_tokens)
        self._cursor = best_end
        return self._copy(best_end, max_tokens, best_matched)

    def _resumed(self, max_tokens: int) -> Copy | None:
        """The broken copy again, from the first source token after the break that equals the
        latest token. The cursor is left alone: a wrong guess must not move the break."""
        ids = self._ids
        n = len(ids)
        start = self._break
        if start < 0:
            return None
        for position in range(start, min(start + RESUME_WINDOW, n - 1)):
            if ids[position] == ids[-1]:
                end = position + 1
                return self._copy(end, max_tokens, self._agreement(end, 1))
        return None

    def _agreement(self, end: int, known: int) -> int:
        """How many tokens before `end` equal the latest ones, counting back (up to MAX_MATCH) from
        `known` tokens already seen to agree."""
        ids = self._ids
        n = len(ids)
        matched = known
        while matched < MAX_MATCH and matched < end and ids[end - matched - 1] == ids[n - matched - 1]:
            matched += 1
        return matched
