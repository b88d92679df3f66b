"""Verification of a draft tree against the model's own choices (lossless).

Walk from the root: at each node choose the token the model would emit after that node's path
(argmax, or a sample from the warped distribution); if a child of the node carries exactly that
token, accept the child and continue from it, otherwise stop. Every emitted token is therefore
the model's own choice given everything before it, so greedy output equals plain greedy output
and sampled output follows exactly the plain sampling distribution; the last chosen token is
the bonus token that needs no draft.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .draft import Draft

if TYPE_CHECKING:
    import torch


class TokenSelector(Protocol):
    """How one request picks a token from one position's logits (runtime/sampling.py)."""

    @property
    def needs_path(self) -> bool:
        """Whether a choice depends on more than its own logits (so the rows cannot be batched)."""
        ...

    def select(self, path: Sequence[int], logits: torch.Tensor) -> int:
        """The token after the committed tokens and `path` (draft tokens since the root)."""
        ...

    def greedy_choices(self, logits: torch.Tensor) -> Callable[[int], int]:
        """Each row's greedy token, by row index (for a selector that needs no path)."""
        ...


@dataclass
class Verdict:
    accepted_nodes: list[int]  # draft node indices accepted, in path order (root excluded)
    tokens: list[int]  # accepted draft tokens followed by the bonus token

    @property
    def rows(self) -> list[int]:
        """The logits row each token was chosen from: the root's, then each accepted node's."""
        return [0, *self.accepted_nodes]


def verify(draft: Draft, logits: torch.Tensor, selector: TokenSelector) -> Verdict:
    """Accept the longest draft path the model agrees with, plus one bonus token.

    logits: [len(draft), vocab], row k = the model's next-token logits after node k's path.
    """
    children = draft.children()
    if selector.needs_path:
        choose = _choose_along_path(draft, logits, selector)
    else:
        choose = selector.greedy_choices(logits)
    node, accepted, tokens = 0, [], []
    while True:
        token = choose(node)
        tokens.append(token)
        child = next((c for c in children[node] if draft.tokens[c] == token), None)
        if child is None:
            return Verdict(accepted, tokens)
        accepted.append(child)
        node = child


def _choose_along_path(draft: Draft, logits: torch.Tensor, selector: TokenSelector) -> Callable[[int], int]:
    """A chooser that hands each node its ancestor path (draft tokens after the root), lazily, node
    by node: verification only walks down the accepted branch."""
    path: list[int] = []

    def choose(node: int) -> int:
        if node:
            path.append(draft.tokens[node])
        return selector.select(path, logits[node])

    return choose
