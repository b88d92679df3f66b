"""The recycled drafter: the model's own candidates alone (Token Recycling; recycling.py).

A tree grown from the request's last token through the instance's recycle table: each node's
children are the tokens the model ranked most likely after that node's token the last time it
read it, each as likely as the model said then. No text is copied: it drafts the same on a
request's first token as on its thousandth.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..draft import Draft
from ..retrieval import retrieve_draft
from .protocol import DraftQuery, DraftRequest

if TYPE_CHECKING:
    from ..verify import Verdict


class RecycledDrafter:
    """Drafts for one request from the instance's recycle table only."""

    def __init__(self, request: DraftRequest) -> None:
        self.config = request.config
        self.recycled = request.recycled
        self.stop_tokens = request.stop_tokens
        self.stop_words = request.stop_words

    def retrieve(self, query: DraftQuery) -> Draft:
        root = [*query.context[-1:], *query.after][-1:]
        if self.recycled is None:
            return Draft.root_only(root[0])
        return retrieve_draft(
            root,
            None,
            None,
            decoding_length=query.width,
            branch_length=query.depth,
            mode=self.config.decoding_mode,
            max_query_length=1,
            stop_tokens=self.stop_tokens,
            stop_words=self.stop_words,
            min_prob=query.min_prob,
            admits=query.admits,
            recycled=self.recycled,
        )

    def record_verdict(self, draft: Draft, verdict: Verdict) -> None:
        """Nothing: the runtime writes every verified row into the table."""

    def extend(self, tokens: Sequence[int]) -> None:
        """Nothing: the table does not depend on the request's text."""
