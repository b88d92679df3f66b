"""A bounded n-gram trie stored in flat typed arrays.

Why this layout: a dict-of-dicts trie costs ~510 bytes per node in CPython, and bounding it
per first token only (as the reference implementation does) leaves it without a global limit.
Here a node is one slot in ten `array.array` columns (38 bytes, plus the child index of
nodes with many children: `byte_estimate`) and `node_count` never exceeds `capacity`: when the
trie is full the least useful subtrees (leaves first) are evicted in a batch and every count is
halved, so counts are decayed frequencies that follow a shifting workload.

Children form a doubly linked list in most-recently-used order, so a reader can look at the
first few children of a node with thousands of them without scanning the rest. A child is found
by scanning that list while its parent has at most INDEX_FANOUT children; past that the parent's
children are also entered in one dict keyed by (parent << 32 | token). Most nodes sit deep in
the trie with one or two children, so the dict (~130 bytes per entry) holds only a small share.

Sibling lists are ordered by `last_touched`, newest first: every touch moves a node to the front
and one tick touches at most one child per parent. Bulk operations (eviction, loading, filling
an empty trie) therefore rebuild all links from the token, parent, count and last_touched
columns with numpy, and snapshots store only those four.

Counts never increase from a node to its children, also across evictions: a writer's open
windows decay with the counts they already added (see TrieWriter).

Ownership: one engine thread owns a trie and its writers; no locks are taken.
"""

from __future__ import annotations

import operator
import sys
from array import array
from collections import deque
from collections.abc import Sequence

import numpy as np

from ..config import TrieConfig

ROOT = 0
NO_NODE = -1
TOKEN_LIMIT = 1 << 31  # token ids are stored as int32 and packed into 32 bits of the child key
INDEX_FANOUT = 8  # parents with more children than this also find them through the dict
_FREE = -2  # parent of a free slot; the root's parent is NO_NODE

# Column -> (array typecode, numpy dtype). STORED columns make a snapshot; DERIVED ones follow from them.
STORED: dict[str, tuple[str, type]] = {
    "token": ("i", np.int32),
    "parent": ("i", np.int32),
    "count": ("f", np.float32),
    "last_touched": ("q", np.int64),
}
DERIVED: dict[str, tuple[str, type]] = {
    "first_child": ("i", np.int32),
    "next_sibling": ("i", np.int32),
    "prev_sibling": ("i", np.int32),
    "child_count": ("i", np.int32),
    "indexed": ("b", np.int8),
    "depth": ("b", np.int8),
}
MAX_DEPTH_LIMIT = 127  # depths are stored as int8


def _as_tokens(tokens: Sequence[int]) -> list[int]:
    """Plain Python ints (numpy or torch scalars included), each a valid token id."""
    ids = list(map(operator.index, tokens))
    if ids and (min(ids) < 0 or max(ids) >= TOKEN_LIMIT):
        raise ValueError(f"token ids must be in [0, {TOKEN_LIMIT}), got min {min(ids)}, max {max(ids)}")
    return ids


def _depths(parent: np.ndarray, max_depth: int) -> np.ndarray:
    """Depth of every node (0 for the root and free slots), one tree level per numpy pass."""
    depth = np.where(parent == NO_NODE, 0, -1).astype(np.int16)
    depth[parent == _FREE] = 0
    for _ in range(max_depth):
        pending = np.flatnonzero(depth < 0)
        ready = pending[depth[parent[pending]] >= 0]
        if not ready.size:
            break
        depth[ready] = depth[parent[ready]] + 1
    if (depth < 0).any():
        raise ValueError(f"some nodes are unreachable from the root or deeper than max_depth {max_depth}")
    return depth.astype(np.int8)


def _links(parent: np.ndarray, last_touched: np.ndarray) -> dict[str, np.ndarray]:
    """Sibling links, child counts and index flags for nodes whose parent is >= 0, children newest first."""
    size = len(parent)
    links = {
        name: np.full(size, NO_NODE, dtype=np.int32)
        for name in ("first_child", "next_sibling", "prev_sibling")
    }
    nodes = np.flatnonzero(parent >= 0)
    nodes = nodes[np.lexsort((-last_touched[nodes], parent[nodes]))]
    same = parent[nodes[1:]] == parent[nodes[:-1]]
    links["next_sibling"][nodes[:-1][same]] = nodes[1:][same]
    links["prev_sibling"][nodes[1:][same]] = nodes[:-1][same]
    heads = nodes[np.concatenate(([True], ~same))] if nodes.size else nodes
    links["first_child"][parent[heads]] = heads
    links["child_count"] = np.bincount(parent[nodes], minlength=size).astype(np.int32)
    links["indexed"] = (links["child_count"] > INDEX_FANOUT).astype(np.int8)
    return links


class NGramTrie:
    """Counts every n-gram of up to `max_depth` tokens of what is inserted, in at most `capacity` nodes.

    The count of a node is the (decayed, weighted) number of occurrences of the token path from
    the virtual root to it, so counts never increase from a node to its children.
    """

    def __init__(self, capacity: int = TrieConfig.capacity, max_depth: int = TrieConfig.depth) -> None:
        if not 1 <= max_depth <= MAX_DEPTH_LIMIT:
            raise ValueError(f"max_depth must be in [1, {MAX_DEPTH_LIMIT}], got {max_depth}")
        if capacity < max_depth:
            raise ValueError(
                f"capacity must be >= max_depth ({max_depth}) to hold one n-gram, got {capacity}"
            )
        if capacity >= TOKEN_LIMIT:
            raise ValueError(f"capacity must be < {TOKEN_LIMIT}, got {capacity}")
        self._capacity = capacity
        self._max_depth = max_depth
        # Evict well below the bound so that evictions (a few O(nodes) numpy passes) stay rare.
        self._evict_batch = max(capacity // 10, max_depth)
        self._epoch = 0
        self._decays = 0  # evictions so far, each of which halved every count
        self.clear()

    def clear(self) -> None:
        """Drop every node; open writers notice and restart from the next token."""
        root = {"token": NO_NODE, "parent": NO_NODE, "count": 0.0, "last_touched": 0}
        self._set_columns(
            {name: np.array([root[name]], dtype=dtype) for name, (_, dtype) in STORED.items()},
            np.zeros(1, np.int8),
        )
        self._tick = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def max_depth(self) -> int:
        return self._max_depth

    @property
    def node_count(self) -> int:
        """Nodes below the virtual root."""
        return self._nodes

    @property
    def epoch(self) -> int:
        """Changes whenever nodes are removed or renumbered, i.e. whenever held node ids may be stale."""
        return self._epoch

    @property
    def byte_estimate(self) -> int:
        """Memory held: the arrays as allocated, the dict's table and its key and value int objects."""
        arrays = [getattr(self, f"_{name}") for name in (*STORED, *DERIVED)] + [self._free]
        per_entry = sys.getsizeof(len(self._token) << 32) + sys.getsizeof(len(self._token))
        return sum(map(sys.getsizeof, arrays)) + sys.getsizeof(self._index) + len(self._index) * per_entry

    # Writing

    def insert(self, tokens: Sequence[int], weight: float = 1.0) -> None:
        """Count every window tokens[i:i+max_depth] (the shorter tail windows included).

        An empty trie is filled in one numpy pass when everything fits (a request's prompt).
        """
        ids = _as_tokens(tokens)
        if self._nodes == 0 and self._fill_empty(ids, weight) is not None:
            return
        advance = self._advance
        for start in range(len(ids)):
            window = ids[start : start + self._max_depth]
            self._begin_step(len(window))
            node = ROOT
            for token in window:
                node = advance(node, token, weight)

    def writer(self, weight: float = 1.0) -> TrieWriter:
        """A stream into this trie: fed tokens are counted as if the whole stream were inserted."""
        return TrieWriter(self, weight)

    def _begin_step(self, new_nodes: int) -> None:
        """Make room for `new_nodes` nodes, then start a new recency tick."""
        if self._nodes + new_nodes > self._capacity:
            self._evict_to(self._capacity - self._evict_batch)
        self._tick += 1

    def _advance(self, node: int, token: int, weight: float) -> int:
        """The child of `node` for `token`, created if needed, counted, touched and moved to the front."""
        child = self.child(node, token)
        if child == NO_NODE:
            child = self._allocate(node, token)
        elif self._prev_sibling[child] != NO_NODE:
            self._unlink(child)
            self._link_first(node, child)
        self._count[child] += weight
        self._last_touched[child] = self._tick
        return child

    def _allocate(self, parent: int, token: int) -> int:
        if self._free:
            child = self._free.pop()
            self._token[child] = token
            self._parent[child] = parent
            self._count[child] = 0.0
        else:
            child = len(self._token)
            for column, value in (
                (self._token, token),
                (self._parent, parent),
                (self._count, 0.0),
                (self._last_touched, 0),
                (self._first_child, NO_NODE),
                (self._next_sibling, NO_NODE),
                (self._prev_sibling, NO_NODE),
                (self._child_count, 0),
                (self._indexed, 0),
                (self._depth, 0),
            ):
                column.append(value)
        self._nodes += 1
        self._depth[child] = self._depth[parent] + 1
        self._link_first(parent, child)
        self._child_count[parent] += 1
        if self._indexed[parent]:
            self._index[parent << 32 | token] = child
        elif self._child_count[parent] > INDEX_FANOUT:
            self._indexed[parent] = 1
            for sibling_token, sibling, _ in self.children(parent, INDEX_FANOUT + 1):
                self._index[parent << 32 | sibling_token] = sibling
        return child

    def _link_first(self, parent: int, child: int) -> None:
        first = self._first_child[parent]
        self._next_sibling[child] = first
        self._prev_sibling[child] = NO_NODE
        if first != NO_NODE:
            self._prev_sibling[first] = child
        self._first_child[parent] = child

    def _unlink(self, child: int) -> None:
        prev, after = self._prev_sibling[child], self._next_sibling[child]
        if prev == NO_NODE:
            self._first_child[self._parent[child]] = after
        else:
            self._next_sibling[prev] = after
        if after != NO_NODE:
            self._prev_sibling[after] = prev

    # Bulk operations

    def _column_copy(self, name: str) -> np.ndarray:
        """A numpy copy of a column (a view would pin the array's buffer and block appends)."""
        dtype = (STORED | DERIVED)[name][1]
        return np.frombuffer(getattr(self, f"_{name}"), dtype=dtype).copy()

    def _set_columns(self, stored: dict[str, np.ndarray], depth: np.ndarray | None = None) -> None:
        """Replace the whole content by these STORED columns (row 0 = root, parent _FREE = free slot).

        Raises ValueError (from the depth pass) when parent links do not form a tree of max_depth.
        """
        parent = stored["parent"]
        depth = _depths(parent, self._max_depth) if depth is None else depth
        columns = stored | _links(parent, stored["last_touched"]) | {"depth": depth}
        for name, (typecode, dtype) in (STORED | DERIVED).items():
            setattr(
                self, f"_{name}", array(typecode, np.ascontiguousarray(columns[name], dtype=dtype).tobytes())
            )
        live = np.flatnonzero(parent >= 0)
        in_index = live[columns["indexed"][parent[live]] == 1]
        keys = (parent[in_index].astype(np.int64) << 32) | stored["token"][in_index]
        self._index: dict[int, int] = dict(zip(keys.tolist(), in_index.tolist(), strict=True))
        self._free = array("i", np.flatnonzero(parent == _FREE)[::-1].astype(np.int32).tobytes())
        self._nodes = int(live.size)
        self._epoch += 1

    def _evict_to(self, target: int) -> None:
        """Halve all counts, then remove the least useful nodes until at most `target` remain.

        A node is as useful as the best of its subtree: highest count, then latest touch (counts
        never grow downwards, so the count part is its own). Ordering by that, deeper first on
        ties, every node comes after its descendants, so the removed set is whole subtrees and
        the trie stays prefix-closed.
        """
        stored = {name: self._column_copy(name) for name in STORED}
        depth = self._column_copy("depth")
        parent, count = stored["parent"], stored["count"]
        count *= 0.5
        self._decays += 1
        live = np.flatnonzero(parent >= 0)
        excess = self._nodes - max(target, 0)
        if excess > 0:
            best_count, latest = count.copy(), stored["last_touched"].copy()
            for level in range(int(depth.max()), 1, -1):
                nodes = live[depth[live] == level]
                np.maximum.at(best_count, parent[nodes], best_count[nodes])
                np.maximum.at(latest, parent[nodes], latest[nodes])
            victims = live[np.lexsort((-depth[live], latest[live], best_count[live]))[:excess]]
            parent[victims] = _FREE
            stored["token"][victims] = NO_NODE
            count[victims] = 0.0
            depth[victims] = 0
        self._set_columns(stored, depth)

    def _fill_empty(self, ids: list[int], weight: float) -> list[np.ndarray] | None:
        """Fill this empty trie with every n-gram of `ids` at numpy speed (a request's prompt).

        Returns per depth d the node of ids[i:i+d] for each i, or None (trie untouched) when the
        n-grams would not fit in the capacity.
        """
        tokens = np.asarray(ids, dtype=np.int64)
        positions = np.arange(len(ids), dtype=np.int64)
        prefix = np.zeros(len(ids), dtype=np.int64)  # node of ids[i:i+d-1]; the root for d = 1
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per depth: keys, counts, last touch
        levels: list[np.ndarray] = []
        next_id = 1
        for depth in range(1, min(self._max_depth, len(ids)) + 1):
            keys = prefix[: len(ids) - depth + 1] << 32 | tokens[depth - 1 :]
            unique, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
            if next_id - 1 + unique.size > self._capacity:
                return None
            last = np.zeros(unique.size, dtype=np.int64)
            np.maximum.at(last, inverse, positions[depth - 1 :])  # a node is touched by its last token
            parts.append((unique, counts, last))
            prefix = next_id + inverse
            levels.append(prefix)
            next_id += unique.size
        unique = np.concatenate([np.zeros(1, dtype=np.int64)] + [part[0] for part in parts])
        stored = {
            "token": np.where(np.arange(next_id) == 0, NO_NODE, unique & 0xFFFFFFFF),
            "parent": np.where(np.arange(next_id) == 0, NO_NODE, unique >> 32),
            "count": np.concatenate([[0.0]] + [part[1] * weight for part in parts]),
            "last_touched": np.concatenate([[0]] + [self._tick + 1 + part[2] for part in parts]),
        }
        depth = np.concatenate(
            [[0]] + [np.full(part[0].size, level) for level, part in enumerate(parts, start=1)]
        )
        self._set_columns(stored, depth)
        self._tick += len(ids)
        return levels

    # Reading (used by retrieval.py)

    def match(self, tokens: Sequence[int]) -> int:
        """The node of the path `tokens` from the root (ROOT for no tokens), or NO_NODE."""
        node = ROOT
        for token in tokens:
            if not 0 <= token < TOKEN_LIMIT:
                return NO_NODE
            node = self.child(node, token)
            if node == NO_NODE:
                return NO_NODE
        return node

    def child(self, node: int, token: int) -> int:
        """The child of `node` for `token`, or NO_NODE."""
        if self._indexed[node]:
            return self._index.get(node << 32 | token, NO_NODE)
        child = self._first_child[node]
        while child != NO_NODE and self._token[child] != token:
            child = self._next_sibling[child]
        return child

    def children(self, node: int, limit: int) -> list[tuple[int, int, float]]:
        """Up to `limit` (token, child, count) of `node`, most recently used first."""
        found = []
        child = self._first_child[node]
        while child != NO_NODE and len(found) < limit:
            found.append((self._token[child], child, self._count[child]))
            child = self._next_sibling[child]
        return found

    def count(self, node: int) -> float:
        return self._count[node]

    def search_view(self) -> tuple[array, array, array, array, array, dict[int, int]]:
        """The columns and the index the fast CPU path's draft search reads (retrieval.py):
        token, count, first_child, next_sibling, indexed, and the (parent << 32 | token) index."""
        return self._token, self._count, self._first_child, self._next_sibling, self._indexed, self._index

    def age(self, node: int) -> int:
        """Tokens taken in since `node`'s n-gram was last counted (recency ticks)."""
        return self._tick - self._last_touched[node]

    @property
    def tick(self) -> int:
        """The recency clock: advances by one per window counted."""
        return self._tick

    # Snapshots (used by persistence.py)

    def to_columns(self) -> dict[str, np.ndarray]:
        """The STORED columns of the live nodes, renumbered densely (root first)."""
        stored = {name: self._column_copy(name) for name in STORED}
        live = stored["parent"] != _FREE
        new_id = (np.cumsum(live) - 1).astype(np.int32)
        columns = {name: values[live] for name, values in stored.items()}
        columns["parent"] = np.where(
            columns["parent"] >= 0, new_id[np.maximum(columns["parent"], 0)], NO_NODE
        )
        columns["parent"] = columns["parent"].astype(np.int32)
        return columns

    @classmethod
    def from_columns(cls, columns: dict[str, np.ndarray], *, capacity: int, max_depth: int) -> NGramTrie:
        """Rebuild a trie from `to_columns()` output, evicting down to `capacity` if it holds more.

        Raises ValueError when the columns do not describe a well-formed trie.
        """
        size = len(columns["token"])
        if size < 1 or any(len(columns[name]) != size for name in STORED):
            raise ValueError("columns differ in length or lack the root")
        token, parent, count = (
            columns["token"].astype(np.int64),
            columns["parent"].astype(np.int64),
            columns["count"],
        )
        if parent[0] != NO_NODE or (parent[1:] < 0).any() or (parent[1:] >= size).any():
            raise ValueError("parent links point outside the trie")
        if (token[1:] < 0).any() or (token[1:] >= TOKEN_LIMIT).any():
            raise ValueError("token ids are out of range")
        if not np.isfinite(count).all() or (count < 0).any():
            raise ValueError("counts must be finite and non-negative")
        if np.unique((parent[1:] << 32) | token[1:]).size != size - 1:
            raise ValueError("a node has two children with the same token")
        trie = cls(capacity=capacity, max_depth=max_depth)
        # Raises ValueError on cycles and on paths deeper than max_depth.
        trie._set_columns(
            {name: np.asarray(columns[name], dtype=dtype) for name, (_, dtype) in STORED.items()}
        )
        trie._tick = int(columns["last_touched"].max())
        if size - 1 <= capacity:
            return trie
        trie._evict_to(capacity)  # then renumber so that the arrays shrink to the new bound too
        return cls.from_columns(trie.to_columns(), capacity=capacity, max_depth=max_depth)


class TrieWriter:
    """Streams tokens into a trie; an n-gram is counted the moment its last token arrives.

    Keeps one cursor per open window (the last max_depth-1 start positions) with the weight that
    window still adds. Evictions may free cursor nodes, so after one (the trie's epoch changed)
    the cursors are looked up again from the recent tokens, without counting anything twice; a
    window whose prefix was evicted stops. Each eviction halved the counts a window had added
    so far, so its weight is halved too: children never outgrow their parents.
    """

    def __init__(self, trie: NGramTrie, weight: float = 1.0) -> None:
        self._trie = trie
        self._weight = weight
        self._recent: deque[int] = deque(maxlen=trie.max_depth - 1)
        # Cursor i, (node, weight), is the window recent[i:]; maxlen drops a window at max_depth.
        self._cursors: deque[tuple[int, float]] = deque(maxlen=trie.max_depth - 1)
        self._epoch = trie.epoch
        self._decays = trie._decays

    def feed(self, tokens: Sequence[int], no_starts: frozenset[int] = frozenset()) -> None:
        """Append `tokens` to the stream, counting every n-gram that ends at one of them, except
        the n-grams that start at one of `no_starts` (stop words)."""
        trie = self._trie
        ids = _as_tokens(tokens)
        if not self._recent and trie.node_count == 0 and not no_starts and self._fill_empty(ids):
            return
        for token in ids:
            trie._begin_step(len(self._cursors) + 1)
            if trie.epoch != self._epoch:
                self._refind_cursors()
            extended = [
                (NO_NODE if node == NO_NODE else trie._advance(node, token, weight), weight)
                for node, weight in self._cursors
            ]
            start = NO_NODE if token in no_starts else trie._advance(ROOT, token, self._weight)
            extended.append((start, self._weight))
            self._cursors.clear()
            self._cursors.extend(extended)
            self._recent.append(token)

    def _fill_empty(self, ids: list[int]) -> bool:
        """The fast path for a request's prompt: bulk-fill the empty trie, then open the last windows."""
        levels = self._trie._fill_empty(ids, self._weight)
        if levels is None:
            return False
        open_windows = range(max(0, len(ids) - self._trie.max_depth + 1), len(ids))
        self._cursors.extend(
            (int(levels[len(ids) - start - 1][start]), self._weight) for start in open_windows
        )
        self._recent.extend(ids[start] for start in open_windows)
        self._epoch = self._trie.epoch
        return True

    def _refind_cursors(self) -> None:
        trie, recent = self._trie, list(self._recent)
        decay = 0.5 ** (trie._decays - self._decays)
        refound = [
            (NO_NODE if node == NO_NODE else trie.match(recent[i:]), weight * decay)
            for i, (node, weight) in enumerate(self._cursors)
        ]
        self._cursors.clear()
        self._cursors.extend(refound)
        self._epoch, self._decays = trie.epoch, trie._decays
