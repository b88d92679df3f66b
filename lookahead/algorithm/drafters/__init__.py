"""Who proposes a request's drafts: the `Drafter` protocol (protocol.py) and the drafters by name.

`LookaheadConfig.drafter` names one of `DRAFTERS`: the instance's default (config.pbtxt's
`drafter`, per model) or a request's own choice (its `drafter` override). A new drafter is one
module here holding a class whose constructor takes a `DraftRequest`, and its name in `DRAFTERS`
(and in lookahead.config.DRAFTER_NAMES, which validates settings without importing drafters).
"""

from __future__ import annotations

from collections.abc import Callable

from .protocol import Drafter, DraftQuery, DraftRequest
from .trie import TrieDrafter

DRAFTERS: dict[str, Callable[[DraftRequest], Drafter]] = {"trie": TrieDrafter}


def make_drafter(request: DraftRequest) -> Drafter:
    """The drafter `request.config.drafter` names, for one request."""
    return DRAFTERS[request.config.drafter](request)


__all__ = ["DRAFTERS", "DraftQuery", "DraftRequest", "Drafter", "TrieDrafter", "make_drafter"]
