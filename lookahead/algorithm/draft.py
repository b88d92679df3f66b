"""A draft tree flattened for one verification forward.

A draft is (tokens, parents) in DFS order, best branch first: tokens[0] is the root (the
last accepted token, which has no KV entry yet) and parents[0] is -1. Every other node's
parent comes before it. From that alone we derive depths and the ancestor mask, from which the
runtime builds positions and the attention mask, so the model sees each branch as if it were a
plain continuation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

# Bits of Draft.origins: the evidence a node was drafted from (one node may have several).
# FROM_OWN_OUTPUT marks evidence from the request's own output (a copy of it, or shared-trie
# n-grams touched since the request started); FROM_FLEET shared-trie n-grams another replica
# taught last (trie_sync); FROM_RECYCLED the model's own ranked candidates (drafters/recycled.py).
FROM_COPY, FROM_REQUEST_TRIE, FROM_SHARED_TRIE, FROM_GRAMMAR = 1, 2, 4, 8
FROM_OWN_OUTPUT, FROM_FLEET, FROM_RECYCLED = 16, 32, 64
ORIGIN_NAMES = {
    FROM_COPY: "copy",
    FROM_REQUEST_TRIE: "request trie",
    FROM_SHARED_TRIE: "shared trie",
    FROM_GRAMMAR: "grammar",
    FROM_OWN_OUTPUT: "own output",
    FROM_FLEET: "fleet",
    FROM_RECYCLED: "recycled",
}


class Evidence(NamedTuple):
    """What a drafter saw behind one node, beyond its probability (acceptance.py's features).

    matched: context tokens the node's estimate is conditioned on (a copy: the tokens agreeing
    with the source before it; a trie: the matched query and the path below it); count: the
    n-gram's (decayed) count in the tries, or the rank-weighted count of a recycled candidate;
    age: tokens the shared trie took in since the n-gram was last seen (-1: not in it); rank: the
    node's place among its siblings by the drafter's estimate (0: the most likely).
    """

    matched: int = 0
    count: float = 0.0
    age: int = -1
    rank: int = 0


NO_EVIDENCE = Evidence()


@dataclass
class Draft:
    tokens: list[int]
    parents: list[int]
    # Estimated probability that the model's own continuation reaches each node (root: 1.0);
    # non-increasing along every path. Drives the adaptive draft size.
    probs: list[float] = field(default_factory=list)
    # FROM_* bits per node (root: 0): what the drafter drafted it from (the debug log, acceptance).
    origins: list[int] = field(default_factory=list)
    # Per node (root: NO_EVIDENCE): what the acceptance predictor reads besides probs and origins.
    evidence: list[Evidence] = field(default_factory=list)
    # (draft, kept nodes) of a draft made by `subset`, whose features acceptance.py reuses.
    subset_of: tuple[Draft, list[int]] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.probs:
            self.probs = [1.0] * len(self.tokens)
        if not self.origins:
            self.origins = [0] * len(self.tokens)
        if not self.evidence:
            self.evidence = [NO_EVIDENCE] * len(self.tokens)
        if not (
            len(self.parents)
            == len(self.probs)
            == len(self.origins)
            == len(self.evidence)
            == len(self.tokens)
        ):
            raise ValueError("tokens, parents, probs, origins and evidence must have the same length")
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
            [NO_EVIDENCE] * (n + 1) + tail.evidence[1:],
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
            [self.evidence[i] for i in keep],
            (self, keep),
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
