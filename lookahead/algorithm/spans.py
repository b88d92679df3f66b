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

An edit is often made again: a renamed variable occurs five times, and a conversation's next
turn repeats the last one's edits. When a broken copy is found again (KEY tokens agree with the
same source, within RESUME_WINDOW of the break), the index keeps the edit: the source tokens it
replaced, what the model wrote instead and the token before them. Every later copy that reaches
that token followed by those source tokens drafts the edit in their place and copies on past
them, so a rename's next occurrence is one step's draft, not three steps of guessing.

Probabilities follow Laplace's rule of succession: after m matching tokens the next one matches
with probability (m + 1) / (m + 2), so reaching depth d of the copy has probability
(m + 1) / (m + d + 1). A long match thus earns a long draft, a short one (a resumed copy after
one agreeing token) a short draft. A replayed edit seen k times starts with (k + 1) / (k + 2).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

KEY = 4  # shortest repeat looked up: shorter contexts are the tries' job
MAX_CANDIDATES = 16  # most recent earlier occurrences of the key compared per lookup
MAX_MATCH = 256  # a match is measured up to this length: beyond it the probabilities barely change
RESUME_WINDOW = 32  # source tokens from a copy's break on where copying may resume (what an edit replaced)
MAX_EDIT = 16  # longest replacement kept as an edit
MAX_EDITS = 64  # edits a request keeps, the most recently seen first


@dataclass(frozen=True)
class Copy:
    """`tokens` followed an earlier text whose last `matched` tokens equal the latest ones; the
    first `from_prompt` of them are the prompt's, the rest the request's own output."""

    tokens: list[int]
    matched: int
    from_prompt: int = field(default=0, compare=False)
    # index -> times seen, of each replayed edit's first token (its estimate: see the module docstring)
    edits: dict[int, int] = field(default_factory=dict, compare=False)

    def conditional(self, index: int) -> float:
        """Probability that tokens[index] comes next, given that tokens[:index] came."""
        seen = self.edits.get(index)
        if seen is None:
            seen = self.matched + index
        return (seen + 1) / (seen + 2)


@dataclass
class Edit:
    """Source tokens `replaced` (after the token an edit is keyed by) became `inserted`, `seen` times."""

    replaced: tuple[int, ...]
    inserted: tuple[int, ...]
    seen: int = 1


class SpanIndex:
    """A request's token ids and the end positions of each of their KEY-grams; the tokens it
    starts with are the prompt."""

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self._ids: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._cursor = -1  # position of the token the latest copy proposes next, -1 for none
        self._break = -1  # position of the source token where the latest copy broke off, -1 for none
        self._broke_at = -1  # position of the first token written in its place, until the edit is learned
        self._edits: dict[int, list[Edit]] = {}  # by the token before the replaced span
        self._edit_count = 0
        self.extend(tokens)
        self._prompt_length = len(self._ids)

    def _copy(self, start: int, max_tokens: int, matched: int) -> Copy:
        """What follows position `start`, after `matched` agreeing tokens, every known edit replayed."""
        ids = self._ids
        tokens: list[int] = []
        replayed: dict[int, int] = {}
        position, edited = start, False
        while len(tokens) < max_tokens and position < len(ids):
            edit = None if edited or not self._edits else self._edit_at(position)
            edited = edit is not None  # the token after an edit is copied as it is
            if edit is None:
                tokens.append(ids[position])
                position += 1
            else:
                replayed[len(tokens)] = edit.seen
                tokens.extend(edit.inserted)
                position += len(edit.replaced)
        from_prompt = max(0, self._prompt_length - start)
        kept = {index: seen for index, seen in replayed.items() if index < max_tokens}
        return Copy(tokens[:max_tokens], matched, from_prompt, kept)

    def _edit_at(self, position: int) -> Edit | None:
        """A kept edit of the source tokens from `position` on, after the token before it."""
        ids = self._ids
        for edit in self._edits.get(ids[position - 1], ()):
            if tuple(ids[position : position + len(edit.replaced)]) == edit.replaced:
                return edit
        return None

    def _learn_edit(self, end: int, matched: int) -> None:
        """The broken copy agrees again: the last `matched` tokens equal the source before `end`.
        Keep what replaced what, when the agreement resumed the broken source within reach."""
        ids = self._ids
        written = len(ids) - self._broke_at  # tokens since the departure, itself included
        agreeing = min(matched, written)
        resumed = end - agreeing
        if not self._break <= resumed <= self._break + RESUME_WINDOW or written - agreeing > MAX_EDIT:
            return
        replaced = tuple(ids[self._break : resumed])
        inserted = tuple(ids[self._broke_at : len(ids) - agreeing])
        if replaced == inserted:
            return
        edits = self._edits.setdefault(ids[self._break - 1], [])
        known = next((edit for edit in edits if edit.replaced == replaced), None)
        if known is not None:
            edits.remove(known)
            known.seen += known.inserted == inserted
            known.inserted = inserted
        else:
            known = Edit(replaced, inserted)
            self._edit_count += 1
        edits.insert(0, known)
        if self._edit_count > MAX_EDITS:  # the least recent edit of the earliest key goes
            oldest = next(iter(self._edits))
            self._edits[oldest].pop()
            self._edit_count -= 1
            if not self._edits[oldest]:
                del self._edits[oldest]

    def extend(self, tokens: Iterable[int]) -> None:
        ids = self._ids
        for token in tokens:
            token = int(token)
            if self._cursor >= 0:  # the cursor always lies before the end: it reads earlier text
                if ids[self._cursor] == token:
                    self._cursor += 1
                else:
                    self._break, self._cursor, self._broke_at = self._cursor, -1, len(ids)
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
        if self._broke_at >= 0:
            self._learn_edit(best_end, best_matched)
            self._broke_at = -1
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
