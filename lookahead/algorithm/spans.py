"""The longest earlier repeat of a request's latest tokens: long copy drafts (SuffixDecoding's idea).

The tries see at most max_query_length tokens of context, so "the last 4 tokens occur in the
prompt" and "the last 40 tokens are a verbatim copy of the prompt" look alike to them. The
second is far stronger evidence: a model that has been copying a span tends to go on copying
it (code edits, quoted documents, repeated answers). `SpanIndex` keeps where every KEY-token
n-gram of the request's text (prompt and output) ends, finds the earlier occurrence whose
agreement with the latest tokens runs back furthest, and proposes what followed it.

Probabilities follow Laplace's rule of succession: after m matching tokens the next one matches
with probability (m + 1) / (m + 2), so reaching depth d of the copy has probability
(m + 1) / (m + d + 1). A long match thus earns a long draft, a short one a short draft.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

KEY = 4  # shortest repeat looked up: shorter contexts are the tries' job
MAX_CANDIDATES = 16  # most recent earlier occurrences of the key compared per lookup
MAX_MATCH = 256  # a match is measured up to this length: beyond it the probabilities barely change


@dataclass(frozen=True)
class Copy:
    """`tokens` followed an earlier text whose last `matched` tokens equal the latest ones."""

    tokens: list[int]
    matched: int

    def conditional(self, index: int) -> float:
        """Probability that tokens[index] comes next, given that tokens[:index] came."""
        seen = self.matched + index
        return (seen + 1) / (seen + 2)


class SpanIndex:
    """A request's token ids and the end positions of each of their KEY-grams."""

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self._ids: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        ids = self._ids
        for token in tokens:
            ids.append(int(token))
            if len(ids) >= KEY:
                self._ends.setdefault(tuple(ids[-KEY:]), []).append(len(ids))

    def continuation(self, max_tokens: int) -> Copy | None:
        """What followed the longest earlier repeat of the latest tokens (ties: the most recent)."""
        ids = self._ids
        n = len(ids)
        if n < KEY or max_tokens <= 0:
            return None
        ends = self._ends[tuple(ids[-KEY:])][:-1]  # the last entry is the latest tokens themselves
        best_end, best_matched = -1, 0
        for end in reversed(ends[-MAX_CANDIDATES:]):
            matched = KEY
            while matched < MAX_MATCH and matched < end and ids[end - matched - 1] == ids[n - matched - 1]:
                matched += 1
            if matched > best_matched:
                best_end, best_matched = end, matched
        if best_end < 0:
            return None
        return Copy(ids[best_end : best_end + max_tokens], best_matched)
