"""How likely the model is to accept each draft node: a predictor learned online from verdicts.

A drafter's own probability for a node (retrieval's back-off estimate, a copy's rule of
succession, a recycled candidate's softmax) says how often the n-gram was followed so, not how
often this model, on this text, agrees. What predicts agreement beyond it is what the drafter
already knows and used to drop: where the node came from (a copy of the prompt or of the
request's own output, the request's trie, the shared trie with what this request or another
replica taught it, the grammar, the model's recycled candidates), how much context its estimate
rests on (a 40-token copy is stronger than a 4-token n-gram), its depth, its n-gram's count and
age, and its rank among its siblings.

The predictor estimates a node's conditional acceptance, the chance the model accepts it once it
accepted its parent, as a logistic regression: per source, a slope and an intercept on the
log-odds of the drafter's own conditional (Platt scaling, so a source's estimates are stretched
or shrunk as its verdicts say), plus a weight per bucket of each other feature (the matched
context also per source: a long copy and a long n-gram differ), plus one per FROM_* bit (agreeing
sources). About 150 weights; a draft's nodes are one small matrix product in numpy. It learns from
every verified node whose parent was accepted (the only ones a verdict tests), by one gradient
step of the log-loss, each weight's step shrinking as it gathers evidence but never below a
floor, so it follows a workload that drifts. It starts as the calibration it replaces: the
drafter's conditional times 0.7.

A request's view adds its own offset per source, learned faster: a request that copies its
prompt verbatim is trusted more than the instance's average, at once. Siblings exclude each
other (the model picks one token), so a node's children share at most probability one; a node's
weight, its chance of being reached, is its parent's times its conditional, so weights never
grow down a branch and every plan stays a connected subtree.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .draft import (
    FROM_COPY,
    FROM_FLEET,
    FROM_GRAMMAR,
    FROM_OWN_OUTPUT,
    FROM_REQUEST_TRIE,
    FROM_SHARED_TRIE,
    Draft,
)
from .planner import INITIAL_CALIBRATION, MIN_CALIBRATION

SOURCES = (
    "grammar",
    "copy of the prompt",
    "copy of the output",
    "request trie",
    "shared trie, this request",
    "shared trie, fleet",
    "shared trie",
    "recycled",
)
ORIGIN_BITS = 128  # every combination of the FROM_* bits


def source_of(origins: int) -> int:
    """A node's source (index into SOURCES): the strongest of its FROM_* bits."""
    if origins & FROM_GRAMMAR:
        return 0
    if origins & FROM_COPY:
        return 2 if origins & FROM_OWN_OUTPUT else 1
    if origins & FROM_REQUEST_TRIE:
        return 3
    if origins & FROM_SHARED_TRIE:
        if origins & FROM_OWN_OUTPUT:
            return 4
        return 5 if origins & FROM_FLEET else 6
    return 7  # recycled, or no evidence named


_SOURCE = np.array([source_of(bits) for bits in range(ORIGIN_BITS)], dtype=np.int64)
_BITS = np.array([[bits >> k & 1 for k in range(7)] for bits in range(ORIGIN_BITS)], dtype=np.float64)

# Bucket edges of each feature (a value v falls in bucket searchsorted(edges, v, "right")).
MATCHED_EDGES = np.array([2, 3, 4, 5, 7, 10, 16, 32, 64])
DEPTH_EDGES = np.array([2, 3, 4, 6, 9, 13, 21])
COUNT_EDGES = np.array([0.5, 1.5, 2.5, 4.5, 8.5, 16.5, 64.5])
AGE_EDGES = np.array([0, 16, 64, 256, 1024, 4096, 16384, 65536])  # age -1 (not in the shared trie): bucket 0
SHAPES = 8  # rank 0, 1, 2, 3+; on the draft's best branch or beside it
_S = len(SOURCES)
_M = len(MATCHED_EDGES) + 1
# Columns of the feature matrix: per source an intercept and a slope; then one-hot blocks.
_BLOCKS = {
    "intercept": _S,
    "slope": _S,
    "matched": _M,
    "matched by source": _S * _M,
    "depth": len(DEPTH_EDGES) + 1,
    "shape": SHAPES,
    "count": len(COUNT_EDGES) + 1,
    "age": len(AGE_EDGES) + 1,
    "bits": 7,
}
_START = dict(zip(_BLOCKS, np.cumsum([0, *_BLOCKS.values()])[:-1].tolist()))
WEIGHTS = sum(_BLOCKS.values())
_BIT_COLUMNS = _START["bits"] + np.arange(7)

# Step sizes: LEARNING_RATE / sqrt(1 + updates) per weight, never below LEARNING_FLOOR; a
# request's own offsets move by REQUEST_RATE.
LEARNING_RATE = 0.1
LEARNING_FLOOR = 0.01
REQUEST_RATE = 0.1
OFFSET_LIMIT = 2.0  # a request's offsets stay within this many logits of the instance's estimate
_CLIP = 1e-3
MAX_SEEN = 1 << 20  # update counts saturate: the step size is at its floor long before


class Features(NamedTuple):
    """The non-root nodes of one draft, as the predictor reads them: each row's one-hot columns,
    its slope column and value, its FROM_* bits."""

    columns: np.ndarray  # [m, ONE_HOTS] weight index of each one-hot feature
    slope: np.ndarray  # [m] weight index of the node's source slope
    log_odds: np.ndarray  # [m] the drafter's conditional as log-odds (the slope's input)
    bits: np.ndarray  # [m, 7] the FROM_* bits as 0/1
    source: np.ndarray  # [m] index into SOURCES
    parents: np.ndarray  # [m] parent node of each (0: the root)
    conditional: np.ndarray  # [m] the drafter's own conditional probability


ONE_HOTS = 7  # intercept, matched, matched by source, depth, shape, count, age


def features(draft: Draft) -> Features:
    """Every non-root node's features (see the module docstring)."""
    n = len(draft)
    parents = np.asarray(draft.parents[1:], dtype=np.int64)
    probs = np.asarray(draft.probs)
    conditional = np.clip(probs[1:] / np.maximum(probs[parents], 1e-12), _CLIP, 1.0 - _CLIP)
    origins = np.asarray(draft.origins[1:], dtype=np.int64) & (ORIGIN_BITS - 1)
    matched_tokens, counts, ages, rank_list = zip(*draft.evidence[1:])  # columns at C speed
    ranks = np.asarray(rank_list, dtype=np.int64)
    depth = [0] * n
    side = [False] * n
    for i, (parent, rank) in enumerate(zip(draft.parents[1:], rank_list), start=1):
        depth[i] = depth[parent] + 1
        side[i] = side[parent] or rank > 0
    source = _SOURCE[origins]
    matched = np.searchsorted(MATCHED_EDGES, matched_tokens, "right")
    shape = np.minimum(ranks, 3) + 4 * np.asarray(side[1:], dtype=np.int64)
    columns = np.stack(
        [
            _START["intercept"] + source,
            _START["matched"] + matched,
            _START["matched by source"] + source * _M + matched,
            _START["depth"] + np.searchsorted(DEPTH_EDGES, depth[1:], "right"),
            _START["shape"] + shape,
            _START["count"] + np.searchsorted(COUNT_EDGES, counts, "right"),
            _START["age"] + np.searchsorted(AGE_EDGES, ages, "right"),
        ],
        axis=1,
    )
    log_odds = np.log(conditional / (1.0 - conditional))
    return Features(
        columns,
        _START["slope"] + source,
        log_odds,
        _BITS[origins],
        source,
        parents,
        conditional,
    )


def _rows_of(found: Features, keep: list[int]) -> Features:
    """`features(draft.subset(keep))` from `found = features(draft)`: a node's features depend on
    its own path and evidence alone, which a subset keeps."""
    rows = np.asarray(keep[1:], dtype=np.int64) - 1
    position = np.zeros(len(found.parents) + 1, dtype=np.int64)  # the draft's nodes, root included
    position[keep] = np.arange(len(keep))
    return Features(
        found.columns[rows],
        found.slope[rows],
        found.log_odds[rows],
        found.bits[rows],
        found.source[rows],
        position[found.parents[rows]],
        found.conditional[rows],
    )


def verified_nodes(draft: Draft, accepted_nodes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(mask of the non-root nodes a verdict tested, mask of those accepted): a node is tested
    when its parent is the root or was accepted."""
    reached = np.zeros(len(draft), dtype=bool)
    reached[0] = True
    reached[accepted_nodes] = True
    parents = np.asarray(draft.parents[1:], dtype=np.int64)
    return reached[parents], reached[1:]


class AcceptancePredictor:
    """The instance's predictor: WEIGHTS floats and their update counts, shared by every request."""

    def __init__(self) -> None:
        self.weights = np.zeros(WEIGHTS)
        self.seen = np.zeros(WEIGHTS)
        # logit(INITIAL_CALIBRATION * c) ~ logit(c) + log(INITIAL_CALIBRATION) where c is small,
        # and the verdicts correct the rest within a few steps
        self.weights[_START["slope"] : _START["slope"] + _S] = 1.0
        self.weights[_START["intercept"] : _START["intercept"] + _S] = math.log(INITIAL_CALIBRATION)

    def for_request(self, teaches: bool = True) -> RequestAcceptance:
        """One request's view; teaches: whether its verdicts train these weights (a request with
        `learn` off only reads them, and learns its own offsets)."""
        return RequestAcceptance(self, teaches)

    def probabilities(self, found: Features, offsets: np.ndarray) -> np.ndarray:
        """Each node's conditional acceptance, before siblings are made to exclude each other."""
        w = self.weights
        logits = w[found.columns].sum(axis=1) + w[found.slope] * found.log_odds
        logits += found.bits @ w[_BIT_COLUMNS] + offsets[found.source]
        return 1.0 / (1.0 + np.exp(-logits))

    def learn(self, found: Features, mask: np.ndarray, errors: np.ndarray) -> None:
        """One gradient step of the log-loss on the nodes of `mask` (errors: accepted - predicted),
        each weight's step LEARNING_RATE / sqrt(1 + its updates), at least LEARNING_FLOOR."""
        if not mask.any():
            return
        columns, slope, bits = found.columns[mask], found.slope[mask], found.bits[mask]
        # The three blocks' weights are distinct, so each step is the one its weight's count gives.
        index = np.concatenate([columns.ravel(), slope, _BIT_COLUMNS])
        gradient = np.concatenate([np.repeat(errors, ONE_HOTS), errors * found.log_odds[mask], errors @ bits])
        step = np.maximum(LEARNING_RATE / np.sqrt(1.0 + self.seen[index]), LEARNING_FLOOR)
        self.weights += np.bincount(index, step * gradient, minlength=WEIGHTS)
        counted = np.concatenate([columns.ravel(), slope, _BIT_COLUMNS[bits.any(axis=0)]])
        self.seen += np.bincount(counted, minlength=WEIGHTS)
        np.minimum(self.seen, MAX_SEEN, out=self.seen)


class RequestAcceptance:
    """One request's acceptance estimates: the instance's predictor plus the request's own
    offset per source. `calibrated` and `observe` are what the planner and the runtime call."""

    def __init__(self, predictor: AcceptancePredictor, teaches: bool = True) -> None:
        self.predictor = predictor
        self.teaches = teaches
        self.offsets = np.zeros(_S)
        # The features of the draft last planned: its verdict is observed a forward later.
        self._planned: tuple[Draft, Features] | None = None

    def _features(self, draft: Draft) -> Features:
        """The draft's features; those of the plan's subset of the draft last planned are its rows."""
        planned = self._planned
        if planned is not None and planned[0] is draft:
            return planned[1]
        source = draft.subset_of
        if planned is not None and source is not None and source[0] is planned[0]:
            found = _rows_of(planned[1], source[1])
        else:
            found = features(draft)
        self._planned = (draft, found)
        return found

    def conditionals(self, draft: Draft, found: Features | None = None) -> np.ndarray:
        """[len(draft) - 1] each non-root node's chance of acceptance once its parent is accepted;
        a node's children together at most 1."""
        if len(draft) < 2:
            return np.zeros(0)
        found = self._features(draft) if found is None else found
        p = self.predictor.probabilities(found, self.offsets)
        # Never below a share of the drafter's own estimate: a kind of node that is never
        # verified again could never be found to have become reliable.
        p = np.maximum(p, MIN_CALIBRATION * found.conditional)
        total = np.bincount(found.parents, weights=p, minlength=len(draft))
        return p / np.maximum(total[found.parents], 1.0)

    def calibrated(self, draft: Draft) -> list[float]:
        """Each node's chance of being accepted: its parent's times its conditional (root: 1)."""
        weights = [1.0]
        for parent, p in zip(draft.parents[1:], self.conditionals(draft).tolist()):
            weights.append(weights[parent] * p)
        return weights

    def observe(self, draft: Draft, accepted_nodes: list[int]) -> None:
        """Learn from a verified draft: this request's offsets, and the instance's weights if it teaches."""
        if len(draft) < 2:
            return
        found = self._features(draft)
        mask, accepted = verified_nodes(draft, accepted_nodes)
        errors = accepted[mask] - self.predictor.probabilities(found, self.offsets)[mask]
        if self.teaches:
            self.predictor.learn(found, mask, errors)
        self.offsets += np.bincount(found.source[mask], REQUEST_RATE * errors, minlength=_S)
        np.clip(self.offsets, -OFFSET_LIMIT, OFFSET_LIMIT, out=self.offsets)
