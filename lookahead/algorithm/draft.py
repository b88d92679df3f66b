"""A draft tree flattened for one verification forward.

A draft is (tokens, parents) in DFS order, best branch first: tokens[0] is the root (the
last accepted token, which has no KV entry yet) and parents[0] is -1. Every other node's
parent comes before it. From that alone we derive depths and the ancestor mask, from which the
runtime builds positions and the attention mask, so the model sees each branch as if it were a
plain continuation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Bits of Draft.origins: the evidence a node was drafted from (one node may have several).
FROM_COPY, FROM_REQUEST_TRIE, FROM_SHARED_TRIE, FROM_GRAMMAR = 1, 2, 4, 8
ORIGIN_NAMES = {
    FROM_COPY: "copy",
    FROM_REQUEST_TRIE: "request trie",
    FROM_SHARED_TRIE: "shared trie",
    FROM_GRAMMAR: "grammar",
}


@dataclass
class Draft:
    tokens: list[int]
    parents: list[int]
    # Estimated probability that the model's own continuation reaches each node (root: 1.0);
    # non-increasing along every path. Drives the adaptive draft size.
    probs: list[float] = field(default_factory=list)
    # FROM_* bits per node (root: 0): what retrieval drafted it from, for the debug log.
    origins: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.probs:
            self.probs = [1.0] * len(self.tokens)
        if not self.origins:
            self.origins = [0] * len(self.tokens)
        if not len(self.parents) == len(self.probs) == len(self.origins) == len(self.tokens):
            raise ValueError("tokens, parents, probs and origins must have the same length")
        if not self.tokens or self.parents[0] != -1:
            raise ValueError("a draft starts with its root, whose parent is -1")
        if any(not 0 <= p < i for i, p in enumerate(self.parents[1:], start=1)):
            raise ValueError("every node's parent must come before it")

    @classmethod
    def root_only(cls, token: int) -> Draft:
        """The degenerate draft: plain decoding of one token."""
        return cls([token], [-1], [1.0])

    @classmethod
    def below_chain(cls, root: int, chain: list[int], origin: int, tail: Draft) -> Draft:
        """`chain` below `root` (each node certain, drafted from `origin`), then `tail`'s nodes below
        the chain's last one, whose token is `tail`'s root."""
        n = len(chain)
        return cls(
            [root, *chain, *tail.tokens[1:]],
            [-1, *range(n), *(parent + n for parent in tail.parents[1:])],
            [1.0] * (n + 1) + tail.probs[1:],
            [0, *[origin] * n, *tail.origins[1:]],
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        depths = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):
            depths[i] = depths[self.parents[i]] + 1
        return depths

    def first_branch(self) -> int:
        """Length of the first branch, nodes 1..m each the first child of the one before: the best
        branch, as retrieval lays drafts out."""
        m = 0
        while m + 1 < len(self.parents) and self.parents[m + 1] == m:
            m += 1
        return m

    def children(self) -> list[list[int]]:
        """Child indices of every node, in draft order."""
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            kids[self.parents[i]].append(i)
        return kids

    def subset(self, keep: list[int]) -> Draft:
        """The draft restricted to the nodes `keep` (sorted, root included, closed under parents)."""
        index = {old: new for new, old in enumerate(keep)}
        return Draft(
            [self.tokens[i] for i in keep],
            [-1] + [index[self.parents[i]] for i in keep[1:]],
            [self.probs[i] for i in keep],
            [self.origins[i] for i in keep],
        )

    def origin_counts(self) -> dict[str, int]:
        """How many draft nodes each source backs (a node may count for several)."""
        return {name: sum(1 for o in self.origins[1:] if o & bit) for bit, name in ORIGIN_NAMES.items()}

    def ancestor_mask(self) -> np.ndarray:
        """[n, n] bool: mask[k, j] is True iff j is k or an ancestor of k.

        Built in numpy, where a row copy costs a tenth of a torch indexing call: every decoding
        step builds one."""
        n = len(self.tokens)
        mask = np.zeros((n, n), dtype=np.bool_)
        for k, parent in enumerate(self.parents):
            if k:
                mask[k] = mask[parent]
            mask[k, k] = True
        return mask
