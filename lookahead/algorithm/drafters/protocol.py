"""The Drafter protocol: what proposes a request's drafts, and what it is told.

One drafter per request, made when the request starts (`DraftRequest`: its prompt, its settings,
what the instance knows) and driven by it at each step: `retrieve` a draft tree below the
request's last token (`DraftQuery`: the room the step gives it), then `record_verdict` on what
the model accepted of it, and `extend` with the tokens the request committed. The runtime keeps
what is common to every drafter: the step's budget, the text a grammar forces next (drafted as
certain ahead of the drafter's own), calibration against the verdicts, and the instance's
shared trie learning every output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ...config import LookaheadConfig
from ..draft import Draft
from ..recycling import Recycles
from ..retrieval import Admits
from ..trie import NGramTrie

if TYPE_CHECKING:
    from ..verify import Verdict


@dataclass(frozen=True)
class DraftRequest:
    """What a drafter knows of its request when it starts."""

    prompt: Sequence[int]
    max_tokens: int
    config: LookaheadConfig
    shared: NGramTrie | None  # the instance's trie: every earlier output (None: there is none)
    trie_depth: int  # the longest n-gram the instance's trie holds
    stop_tokens: frozenset[int]  # tokens that end the request: nothing is drafted below one
    stop_words: frozenset[int]  # LookaheadConfig.stop_words as token ids
    recycled: Recycles | None = None  # the model's recycled candidates (None: the instance keeps none)
    # Where the request is one of several samples of its prompt and the instance's trie does not
    # learn their outputs: the trie that holds the prompt and every sample's output (None: none).
    siblings: NGramTrie | None = None


@dataclass(frozen=True)
class DraftQuery:
    """One step's request for a draft.

    context: the request's tokens (prompt and output), its last one the draft's root unless
    `after` goes on from it; after: tokens already drafted past the context (text a grammar
    forces), below which this draft hangs; width: most nodes, the root included; depth: most
    draft tokens on any path; min_prob: nodes less likely than this to be accepted are not worth
    their forward; admits: None, or which paths below the root a grammar allows (every node of
    the draft must be admitted).
    """

    context: Sequence[int]
    after: Sequence[int]
    width: int
    depth: int
    min_prob: float = 0.0
    admits: Admits | None = None


class Drafter(Protocol):
    """Proposes drafts for one request (algorithm/drafters/trie.py is the model)."""

    def retrieve(self, query: DraftQuery) -> Draft:
        """A draft rooted at the query's last token (after[-1], else context[-1]), within its bounds."""
        ...

    def record_verdict(self, draft: Draft, verdict: Verdict) -> None:
        """What the model accepted of the last draft."""
        ...

    def extend(self, tokens: Sequence[int]) -> None:
        """The tokens the request committed this step (a final stop token left out)."""
        ...
