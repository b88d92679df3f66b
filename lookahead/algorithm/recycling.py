"""The model's own candidates, recycled (Token Recycling): for each token, the tokens the model
ranked most likely next the last time it read that token.

Every verification forward computes the next-token distribution at every node it feeds, and
verification reads one token of each. The rest is what the model would say after that token,
in that context: after `def` a name, after `(` an argument, in English the usual next words.
Kept per token, the top `k` of the latest such distribution draft where the request's text and
the tries have nothing to copy. The table is the instance's, bounded by the vocabulary: `vocab x
k` token ids (int32) and probabilities (float16), and per row the update that wrote it; a row is
replaced whole, with the distribution of the latest verified position that read its token (rows
of the accepted path last, as theirs is the text the request goes on from).

A request with `learn` off writes into a `PrivateRecycles` of its own instead: its rows drafted
for that request alone, the instance's table read but never written, so nothing it read leaves
a trace another request could draft from (or time).

No torch here: the runtime computes each row's top k from the logits (runtime/recycling.py).
"""

from __future__ import annotations

import numpy as np

# Candidates kept per token: Token Recycling's 8 (more add little: drafts read the first few).
CANDIDATES = 8


class RecycleTable:
    """Per token id, the `k` most likely next tokens (-1: none yet) and their probabilities."""

    def __init__(self, vocab_size: int, k: int = CANDIDATES) -> None:
        if vocab_size < 1 or k < 1:
            raise ValueError(f"vocab_size and k must be >= 1, got {vocab_size} and {k}")
        self.candidates = np.full((vocab_size, k), -1, dtype=np.int32)
        self.probs = np.zeros((vocab_size, k), dtype=np.float16)
        self.written = np.full(vocab_size, -1, dtype=np.int64)  # the update that wrote each row
        self.updates = 0

    @property
    def k(self) -> int:
        return self.candidates.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.candidates.shape[0]

    @property
    def byte_size(self) -> int:
        return self.candidates.nbytes + self.probs.nbytes + self.written.nbytes

    def update(self, tokens: np.ndarray, candidates: np.ndarray, probs: np.ndarray) -> None:
        """Row tokens[i] becomes (candidates[i], probs[i]) ([n, k] each, most likely first); of a
        token given twice, its last row counts."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if not len(tokens):
            return
        if candidates.shape != (len(tokens), self.k) or probs.shape != candidates.shape:
            raise ValueError(f"expected [{len(tokens)}, {self.k}] candidates and probabilities")
        # the last occurrence of each token: first occurrence in the reversed order
        unique, first = np.unique(tokens[::-1], return_index=True)
        rows = len(tokens) - 1 - first
        self.updates += 1
        self.candidates[unique] = candidates[rows]
        self.probs[unique] = probs[rows]
        self.written[unique] = self.updates

    def next_tokens(self, token: int, limit: int) -> list[tuple[int, float]]:
        """Up to `limit` (candidate, probability) the model ranked after `token` last time."""
        row = self.candidates[token, :limit].tolist()
        probs = self.probs[token, :limit].tolist()
        return [(candidate, p) for candidate, p in zip(row, probs) if candidate >= 0]

    def age(self, token: int) -> int:
        """Updates since `token`'s row was written (-1: never)."""
        written = int(self.written[token])
        return self.updates - written if written >= 0 else -1


class PrivateRecycles:
    """One request's own rows over the instance's table, which it reads but never writes: what a
    request with `learn` off recycles. Its rows are kept sparse (only the tokens it read)."""

    def __init__(self, shared: RecycleTable) -> None:
        self.shared = shared
        self.rows: dict[int, tuple[list[int], list[float], int]] = {}  # token -> candidates, probs, update
        self.updates = 0

    @property
    def k(self) -> int:
        return self.shared.k

    @property
    def vocab_size(self) -> int:
        return self.shared.vocab_size

    def update(self, tokens: np.ndarray, candidates: np.ndarray, probs: np.ndarray) -> None:
        """As `RecycleTable.update`, into this request's rows only."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if not len(tokens):
            return
        if candidates.shape != (len(tokens), self.k) or probs.shape != candidates.shape:
            raise ValueError(f"expected [{len(tokens)}, {self.k}] candidates and probabilities")
        self.updates += 1
        for token, row, p in zip(tokens.tolist(), candidates.tolist(), probs.tolist()):
            self.rows[token] = (row, p, self.updates)  # of a token given twice, the last row counts

    def next_tokens(self, token: int, limit: int) -> list[tuple[int, float]]:
        own = self.rows.get(token)
        if own is None:
            return self.shared.next_tokens(token, limit)
        return [(candidate, p) for candidate, p in zip(own[0][:limit], own[1][:limit]) if candidate >= 0]

    def age(self, token: int) -> int:
        own = self.rows.get(token)
        return self.updates - own[2] if own is not None else self.shared.age(token)


Recycles = RecycleTable | PrivateRecycles  # what a request drafts from and writes into
