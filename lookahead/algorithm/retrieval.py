"""Draft retrieval: the last few context tokens -> a draft tree read from two n-gram tries.

`local` is the request's own trie (its prompt; see decoder.py), `shared` the instance's
global trie. Both are read through one merged view: a merged node is a pair of node ids (either
may be missing) and its children are the union, by token, of both nodes' children.

Probability model. A child's conditional probability backs off from local to shared evidence:

    p(t | u) = p_local(t) + escape_local * p_shared(t),   p_trie(t) = count(u.t) / (seen(u) + 1/L)

seen(u) is the number of occurrences of u that were followed by something: the sum of its
children's counts (count(u) when u has more than CHILD_LIMIT children). Occurrences with no
continuation yet, like the context itself, which the decoder has already fed to both tries,
say nothing about what comes next. L is the number of context tokens the estimate is
conditioned on (the matched query plus the path below it): the 1/L smoothing makes a 1-token
match weak evidence (one prior occurrence -> 0.5) and a 4-token match strong (-> 0.8).
escape_local = 1 - sum of p_local over u's children. So the request's own evidence (copying
from the prompt is the strongest signal) gets its share first and shared evidence fills what
local evidence leaves open. We back off rather than rank by weighted counts (w_local·c_local +
w_shared·c_shared) because with pooled counts a token seen 100,000 times globally drowns the
request's own "after X comes Y" evidence, whatever the weights.

A node's probability is the product of conditionals on its path: the root has 1.0, values never
increase along a path, and the probabilities of one depth sum to at most 1, so sum(probs) - 1 is
the expected number of accepted draft tokens if the estimates are right.

A copy (spans.py: what followed the longest earlier repeat of the request's latest tokens) is
stronger evidence still and backs off the same way: on the copy's path, its next token c gets
p_copy + (1 - p_copy) * p(c | u) and every other child (1 - p_copy) * p(t | u). The copy's path
goes on below the tries' depth, alone.

`hier` selects nodes best-first by that probability: the top nodes of a tree whose values never
increase downwards form a connected subtree, and they maximise the expected accepted tokens for
the budget. Children are enumerated from each trie's most recently used end, at most
CHILD_LIMIT per node, so one query costs O(budget) however large the tries are. Where the fast
CPU path is loaded, that search runs in its C++ twin (lookahead/cpu/csrc/draft_search.cpp),
which selects the same nodes with the same probabilities bit for bit.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import NamedTuple

from ..config import DECODING_MODES
from .draft import (
    FROM_COPY,
    FROM_OWN_OUTPUT,
    FROM_RECYCLED,
    FROM_REQUEST_TRIE,
    FROM_SHARED_TRIE,
    NO_EVIDENCE,
    Draft,
    Evidence,
)
from .recycling import Recycles, RecycleTable
from .spans import Copy
from .trie import NO_NODE, NGramTrie

CHILD_LIMIT = 8
RECYCLED_LIMIT = 4  # recycled candidates offered per node (the most likely ones)


class _Node(NamedTuple):
    """A draft node while the draft is built."""

    token: int
    parent: int  # index of the parent among the selected nodes (-1 for the root)
    prob: float  # probability that the model's own continuation reaches this node
    local_node: int  # the node's trie node in the request's own trie (NO_NODE: none)
    shared_node: int  # and in the shared trie
    depth: int
    copy_index: int  # index of the copy token that would follow this node; -1 off the copy's path
    recycled: int  # the node's rank among its parent's recycled candidates; -1: not one of them


# One child a node may get: (conditional probability given the node, token, its node in the local
# trie, in the shared trie, the index of the copy token that would follow it or -1, its rank among
# the recycled candidates or -1). Built by the hundred per query, so a plain tuple, always unpacked
# into these names.
_Continuation = tuple[float, int, int, int, int, int]
# Whether a request's grammar accepts a draft path (the tokens from below the root to a node).
Admits = Callable[[tuple[int, ...]], bool]
_NO_EVIDENCE = (NO_NODE, 0.0)
# What the C++ search reads of a merged view: both tries' search views, the copy as (tokens,
# matched, edits), the recycle table as (candidates, probabilities); None for an absent part.
_SearchViews = tuple[tuple | None, tuple | None, tuple | None, tuple | None]
# The C++ `_best_first`: search views, then the start node's and the search's numbers (see
# _best_first) -> the selected nodes' fields (those of _Node), in selection order.
NativeSearch = Callable[..., list[tuple]]
_native_search: NativeSearch | None = None


def use_native_search(search: NativeSearch | None) -> None:
    """Run `_best_first` in `search` (the fast CPU path's C++ search), or in Python with None."""
    global _native_search
    _native_search = search


class _MergedView:
    """Read-only union of the local and the shared trie, the request's copy draft and the model's
    recycled candidates."""

    def __init__(
        self,
        local: NGramTrie | None,
        shared: NGramTrie | None,
        copy: Copy | None,
        recycled: Recycles | None = None,
    ) -> None:
        self.local = local
        self.shared = shared
        self.copy = copy
        self.recycled = recycled

    @cached_property
    def search_views(self) -> _SearchViews | None:
        """What the C++ search reads of this view, once for all its queries; None where it cannot
        read it (a request's private recycled rows live in a dict)."""
        if self.recycled is not None and not isinstance(self.recycled, RecycleTable):
            return None
        copy = self.copy
        return (
            self.local.search_view() if self.local is not None else None,
            self.shared.search_view() if self.shared is not None else None,
            (copy.tokens, copy.matched, copy.edits) if copy is not None else None,
            (self.recycled.candidates, self.recycled.probs) if self.recycled is not None else None,
        )

    def match(self, query: Sequence[int]) -> tuple[int, int]:
        return (
            self.local.match(query) if self.local is not None else NO_NODE,
            self.shared.match(query) if self.shared is not None else NO_NODE,
        )

    def counts(self, local_node: int, shared_node: int) -> tuple[float, float]:
        return (
            self.local.count(local_node) if local_node != NO_NODE else 0.0,
            self.shared.count(shared_node) if shared_node != NO_NODE else 0.0,
        )

    def evidence(self, node: _Node, query_len: int, rank: int, parent_token: int) -> Evidence:
        """A selected node's Evidence (see draft.py): its copy's agreement or its context length,
        its n-gram's counts in both tries, its age in the shared one (a recycled candidate's
        alone: the age of its table row), its rank among its siblings."""
        local_count, shared_count = self.counts(node.local_node, node.shared_node)
        on_copy = node.copy_index > 0 and self.copy is not None
        if node.local_node == NO_NODE and node.shared_node == NO_NODE and not on_copy and self.recycled:
            return Evidence(1, 0.0, self.recycled.age(parent_token), rank)
        matched = self.copy.matched + node.copy_index - 1 if on_copy else query_len + node.depth - 1
        age = self.shared.age(node.shared_node) if node.shared_node != NO_NODE else -1
        return Evidence(matched, local_count + shared_count, age, rank)

    def continuations(
        self, token: int, local_node: int, shared_node: int, context_len: int, copy_index: int
    ) -> list[_Continuation]:
        """Every child of a node carrying `token`, most recent first; the copy's next token, when
        on its path, backs off to the tries, and the recycled candidates get what all leave."""
        options = self._copied(local_node, shared_node, context_len, copy_index)
        if self.recycled is None:
            return options
        candidates = self.recycled.next_tokens(token, RECYCLED_LIMIT)
        if not candidates:
            return options
        escape = max(0.0, 1.0 - sum(option[0] for option in options))
        known = {option[1]: i for i, option in enumerate(options)}
        for rank, (candidate, p) in enumerate(candidates):
            if candidate in known:  # the model's candidate agrees with the text's evidence
                i = known[candidate]
                conditional, _, local_child, shared_child, copy_next, _ = options[i]
                options[i] = (
                    min(1.0, conditional + escape * p),
                    candidate,
                    local_child,
                    shared_child,
                    copy_next,
                    rank,
                )
            elif escape > 0.0:
                options.append((escape * p, candidate, NO_NODE, NO_NODE, -1, rank))
        return options

    def _copied(
        self, local_node: int, shared_node: int, context_len: int, copy_index: int
    ) -> list[_Continuation]:
        """The tries' children, most recent first; the copy's next token, on its path, backs off to them."""
        local, local_unlisted = _conditionals(self.local, local_node, context_len)
        shared, shared_unlisted = _conditionals(self.shared, shared_node, context_len)
        evidence = []  # (token, local child, p_local, shared child, p_shared), the local trie's first
        for token in dict.fromkeys([*local, *shared]):  # a child may lie past one trie's enumeration cap
            local_child, p_local = local.get(token) or _lookup(self.local, local_node, token, local_unlisted)
            shared_child, p_shared = shared.get(token) or _lookup(
                self.shared, shared_node, token, shared_unlisted
            )
            evidence.append((token, local_child, p_local, shared_child, p_shared))
        escape = max(0.0, 1.0 - sum(p_local for _, _, p_local, _, _ in evidence))
        tries = [
            (min(1.0, p_local + escape * p_shared), token, local_child, shared_child, -1, -1)
            for token, local_child, p_local, shared_child, p_shared in evidence
        ]
        if self.copy is None or not 0 <= copy_index < len(self.copy.tokens):
            return tries
        copied, p_copy = self.copy.tokens[copy_index], self.copy.conditional(copy_index)
        kept, on_copy = [], (0.0, copied, NO_NODE, NO_NODE, -1, -1)
        for option in tries:
            conditional, token, local_child, shared_child, _, _ = option
            if token == copied:
                on_copy = option
            else:
                kept.append((conditional * (1.0 - p_copy), token, local_child, shared_child, -1, -1))
        p_tries, _, local_child, shared_child, _, _ = on_copy
        return [
            (p_copy + (1.0 - p_copy) * p_tries, copied, local_child, shared_child, copy_index + 1, -1),
            *kept,
        ]


def _conditionals(
    trie: NGramTrie | None, node: int, context_len: int
) -> tuple[dict[int, tuple[int, float]], float | None]:
    """token -> (child, p_trie) for up to CHILD_LIMIT children of `node`, most recent first, and,
    when `node` has more children than that, the denominator to price the unlisted ones with
    (else None). Nothing for a missing trie or node."""
    if trie is None or node == NO_NODE:
        return {}, None
    kids = trie.children(node, CHILD_LIMIT + 1)
    capped = len(kids) > CHILD_LIMIT
    seen = trie.count(node) if capped else sum(count for _, _, count in kids)
    denominator = seen + 1.0 / context_len
    listed = {token: (child, count / denominator) for token, child, count in kids[:CHILD_LIMIT]}
    return listed, denominator if capped else None


def _lookup(trie: NGramTrie | None, node: int, token: int, denominator: float | None) -> tuple[int, float]:
    """(child, p_trie) of a child past the enumeration cap, or no evidence."""
    if denominator is None:
        return _NO_EVIDENCE
    child = trie.child(node, token)
    return (child, trie.count(child) / denominator) if child != NO_NODE else _NO_EVIDENCE


def retrieve_draft(
    context: Sequence[int],
    local: NGramTrie | None,
    shared: NGramTrie | None,
    *,
    decoding_length: int,
    branch_length: int,
    mode: str = "hier",
    max_query_length: int = 4,
    copy: Copy | None = None,
    stop_tokens: frozenset[int] = frozenset(),
    stop_words: frozenset[int] = frozenset(),
    min_prob: float = 0.0,
    admits: Admits | None = None,
    recycled: Recycles | None = None,
) -> Draft:
    """The draft to verify after `context`: at most `decoding_length` nodes (root included), depth
    at most `branch_length`, tokens[0] == context[-1]; the bare root when nothing matches.
    `copy` (see spans.py) continues the request's longest repeat of its latest tokens, also
    past the tries' depth; `recycled` (see recycling.py) offers the model's own candidates
    where the tries and the copy leave probability unclaimed. A node carrying one of
    `stop_tokens` (the request's EOS ids) gets no children: the request ends there, so nothing
    below it could be accepted. A root among `stop_words` drafts nothing from its one-token
    context (see runtime/stop_words.py).

    The longest matching query (last k tokens, k <= max_query_length) is tried first; a shorter
    one replaces it only if its draft has a larger expected number of accepted tokens.
    """
    if not context:
        raise ValueError("context must hold at least the root token")
    if mode not in DECODING_MODES:
        raise ValueError(f"mode must be one of {', '.join(DECODING_MODES)}, got {mode!r}")
    root = int(context[-1])
    depth_limit = min(branch_length, decoding_length - 1)
    if depth_limit <= 0 or (local is None and shared is None and copy is None and recycled is None):
        return Draft.root_only(root)
    view = _MergedView(local, shared, copy, recycled)
    best: tuple[list[_Node], int] | None = None  # (nodes, query length) of the best draft so far
    best_value = 1.0
    previous_counts = None
    for query_len in range(min(max_query_length, len(context)), 0, -1):
        if query_len == 1 and root in stop_words:
            break
        query = context[-query_len:]
        local_node, shared_node = view.match(query)
        if local_node == NO_NODE and shared_node == NO_NODE and copy is None and recycled is None:
            continue
        counts = view.counts(local_node, shared_node)
        if counts == previous_counts:
            continue  # every occurrence of this query extends the longer one: same evidence, less context
        previous_counts = counts
        start = _Node(root, -1, 1.0, local_node, shared_node, 0, 0 if copy is not None else -1, -1)
        if mode == "one":
            nodes = _best_chain(view, start, query_len, depth_limit, stop_tokens, min_prob, admits)
        else:
            nodes = _best_first(
                view, start, query_len, decoding_length, depth_limit, stop_tokens, min_prob, admits
            )
        value = sum(node.prob for node in nodes)
        if value > best_value:
            best, best_value = (nodes, query_len), value
    if best is None:
        return Draft.root_only(root)
    return _layout(best[0], mode, decoding_length, view, best[1])


def _best_first(
    view: _MergedView,
    start: _Node,
    query_len: int,
    budget: int,
    depth_limit: int,
    stop_tokens: frozenset[int],
    min_prob: float,
    admits: Admits | None,
) -> list[_Node]:
    """The `budget` most probable nodes of the matched subtree (root included) of at least
    `min_prob` whose paths `admits` admits, in selection order."""
    if _native_search is not None and admits is None and (views := view.search_views) is not None:
        rows = _native_search(
            *views,
            start.token,
            start.local_node,
            start.shared_node,
            start.copy_index,
            query_len,
            budget,
            depth_limit,
            min_prob,
            stop_tokens,
        )
        return list(map(_Node._make, rows))
    selected: list[_Node] = []
    paths: list[tuple[int, ...]] = []  # with `admits`: each selected node's tokens from below the root
    # (-probability, push order, parent index, depth, continuation): a child becomes a node only
    # once it is selected, and most never are
    frontier: list[tuple[float, int, int, int, _Continuation | None]] = [(-1.0, 0, -1, 0, None)]
    pushed = 1
    while frontier and len(selected) < budget:
        negative_prob, _, parent, depth, option = heapq.heappop(frontier)
        path: tuple[int, ...] = ()
        if option is None:
            node = start
        else:
            _, token, local_child, shared_child, copy_next, recycled = option
            if admits is not None:
                path = (*paths[parent], token)
            node = _Node(token, parent, -negative_prob, local_child, shared_child, depth, copy_next, recycled)
        index = len(selected)
        selected.append(node)
        paths.append(path)
        if node.depth == depth_limit or len(selected) == budget or _ends_request(node, stop_tokens):
            continue
        options = view.continuations(
            node.token, node.local_node, node.shared_node, query_len + node.depth, node.copy_index
        )
        if admits is not None:
            options = _admitted(options, path, admits)
        for option in options:
            conditional = option[0]
            child_prob = node.prob * conditional
            if child_prob > 0.0 and child_prob >= min_prob:
                heapq.heappush(frontier, (-child_prob, pushed, index, node.depth + 1, option))
                pushed += 1
    return selected


def _best_chain(
    view: _MergedView,
    start: _Node,
    query_len: int,
    depth_limit: int,
    stop_tokens: frozenset[int],
    min_prob: float,
    admits: Admits | None,
) -> list[_Node]:
    """`one` mode: follow the most probable child (that `admits` admits) at each level."""
    chain = [start]
    path: tuple[int, ...] = ()
    while chain[-1].depth < depth_limit and not _ends_request(chain[-1], stop_tokens):
        last = chain[-1]
        options = view.continuations(
            last.token, last.local_node, last.shared_node, query_len + last.depth, last.copy_index
        )
        if admits is not None:  # the most probable child the grammar admits
            options = _admitted(options, path, admits, first_only=True)
        if not options:
            break
        conditional, token, local_child, shared_child, copy_next, recycled = max(
            options, key=lambda option: option[0]
        )
        path = (*path, token)
        prob = last.prob * conditional
        if conditional <= 0.0 or prob < min_prob:
            break
        chain.append(
            _Node(token, len(chain) - 1, prob, local_child, shared_child, last.depth + 1, copy_next, recycled)
        )
    return chain


def _admitted(
    options: list[_Continuation], path: tuple[int, ...], admits: Admits, first_only: bool = False
) -> list[_Continuation]:
    """The continuations the grammar admits after `path` (the most probable one alone with
    `first_only`), their conditionals divided by the probability left once the refused ones are
    ruled out: the model can take none of those, so retrieval's estimate, conditioned on the
    grammar, moves to what remains."""
    kept, refused = [], 0.0
    for option in sorted(options, key=lambda option: option[0], reverse=True):
        if admits((*path, option[1])):
            kept.append(option)
            if first_only:
                break
        else:
            refused += option[0]
    if refused <= 0.0:
        return kept
    left = max(1.0 - refused, 1e-9)
    return [(min(1.0, option[0] / left), *option[1:]) for option in kept]


def _ends_request(node: _Node, stop_tokens: frozenset[int]) -> bool:
    """A draft node carrying a stop token, below which nothing could be accepted. The root is
    already committed text, and a prompt may well end with an EOS id."""
    return node.depth > 0 and node.token in stop_tokens


def _layout(nodes: list[_Node], mode: str, budget: int, view: _MergedView, query_len: int) -> Draft:
    """DFS order with the most probable child first, so the best branch is nodes 1..m.

    `par` re-emits every root-to-leaf path as its own chain under the root, within the budget.
    """
    children: list[list[int]] = [[] for _ in nodes]
    ranks = [0] * len(nodes)
    for index, node in enumerate(nodes[1:], start=1):
        ranks[index] = len(children[node.parent])
        children[node.parent].append(index)  # selection order is descending probability
    origins = [0] + [_origin(node, view.copy) for node in nodes[1:]]
    evidence = [NO_EVIDENCE] + [
        view.evidence(nodes[i], query_len, ranks[i], nodes[nodes[i].parent].token)
        for i in range(1, len(nodes))
    ]
    order: list[int] = []
    stack = [0]
    while stack:
        index = stack.pop()
        order.append(index)
        stack.extend(reversed(children[index]))
    if mode != "par":
        position = {index: new for new, index in enumerate(order)}
        return Draft(
            [nodes[i].token for i in order],
            [-1] + [position[nodes[i].parent] for i in order[1:]],
            [nodes[i].prob for i in order],
            [origins[i] for i in order],
            [evidence[i] for i in order],
        )
    kept = [0]
    parents = [-1]
    for leaf in (i for i in order if not children[i] and i != 0):
        path = []
        while leaf != 0:
            path.append(leaf)
            leaf = nodes[leaf].parent
        parent = 0
        for index in reversed(path):
            if len(kept) == budget:
                break
            kept.append(index)
            parents.append(parent)
            parent = len(kept) - 1
    return Draft(
        [nodes[i].token for i in kept],
        parents,
        [nodes[i].prob for i in kept],
        [origins[i] for i in kept],
        [evidence[i] for i in kept],
    )


def _origin(node: _Node, copy: Copy | None) -> int:
    """The FROM_* bits of a non-root node: on the copy's path (of the request's own output past
    the copy's prompt part), in the request's trie, in the shared one."""
    on_copy = node.copy_index > 0 and copy is not None
    return (
        (FROM_COPY if on_copy else 0)
        | (FROM_OWN_OUTPUT if on_copy and node.copy_index > copy.from_prompt else 0)
        | (FROM_REQUEST_TRIE if node.local_node != NO_NODE else 0)
        | (FROM_SHARED_TRIE if node.shared_node != NO_NODE else 0)
        | (FROM_RECYCLED if node.recycled >= 0 else 0)
    )
