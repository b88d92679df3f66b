"""The trie drafter: Lookahead's own retrieval (retrieval.py) over three sources of evidence.

The request's own trie (its prompt, and its output where the instance's trie does not learn
it; shared with the other samples of its prompt, whose outputs it holds too), the instance's
shared trie (every earlier output), and a copy of what followed the longest earlier repeat of
the request's latest tokens (spans.py). Under a structured-output grammar, retrieval searches
only among the nodes the grammar admits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..draft import Draft
from ..retrieval import retrieve_draft
from ..spans import SpanIndex
from ..trie import NGramTrie
from .protocol import DraftQuery, DraftRequest

if TYPE_CHECKING:
    from ..verify import Verdict


class TrieDrafter:
    """Drafts for one request from its own trie, the shared trie and its span copy."""

    def __init__(self, request: DraftRequest) -> None:
        self.config = request.config
        self.shared = request.shared
        self.stop_tokens = request.stop_tokens
        self.stop_words = request.stop_words
        # The output is learned once: by the shared trie when there is one and the request may
        # teach it (the runtime feeds that one). Counted in the request's own trie as well,
        # whatever the output has just copied from the prompt would count twice there and
        # outrank the prompt's own evidence.
        learns_output = request.shared is None or not request.config.learn
        depth = request.trie_depth
        if request.siblings is not None:  # the samples' common trie, which holds the prompt already
            self.local = request.siblings
            writer = self.local.writer()
            tail = max(0, len(request.prompt) - request.config.max_query_length + 1)
            writer.feed(request.prompt[tail:])  # the context the output goes on from
        else:
            capacity = (len(request.prompt) + (request.max_tokens if learns_output else 0)) * depth + 1
            self.local = NGramTrie(capacity=capacity, max_depth=depth)
            writer = self.local.writer()
            writer.feed(request.prompt)
        self.writer = writer if learns_output else None
        self.spans = SpanIndex(request.prompt)

    def retrieve(self, query: DraftQuery) -> Draft:
        """retrieve_draft after the context and the tokens drafted past it (where no copy of the
        request's own text goes on)."""
        size = self.config.max_query_length
        context = [*query.context[-size:], *query.after][-size:]
        return retrieve_draft(
            context,
            self.local,
            self.shared,
            decoding_length=query.width,
            branch_length=query.depth,
            mode=self.config.decoding_mode,
            max_query_length=size,
            copy=None if query.after else self.spans.continuation(query.depth),
            stop_tokens=self.stop_tokens,
            stop_words=self.stop_words,
            min_prob=query.min_prob,
            admits=query.admits,
        )

    def record_verdict(self, draft: Draft, verdict: Verdict) -> None:
        """Nothing: the tries learn from committed tokens, and calibration is the runtime's."""

    def extend(self, tokens: Sequence[int]) -> None:
        if self.writer is not None:
            self.writer.feed(tokens, self.stop_words)
        self.spans.extend(tokens)
