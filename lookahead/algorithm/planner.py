"""Is a draft worth its forward? Expected tokens per unit of forward cost.

A forward over q new tokens costs cost(q) relative to a one-token forward. On a GPU cost is
nearly flat up to tens of tokens; on a CPU it grows several-fold by q=64 (cost_priors.py).
A draft whose nodes are reached with probabilities p_i yields 1 + sum(p_i) tokens in
expectation. We keep the top-m nodes by probability (a connected subtree, since probabilities
never grow along a path) for the m that maximises (1 + c * sum p) / cost(m + 1), where c
calibrates the draft's probability estimates against what the model actually accepted. m = 0
is a plain decoding step. Both cost(q) and c are learned online from real steps. A batched step
applies the same rule node by node across all its requests (see plan_step): the step's tokens
go to whichever request's next node is most likely to be accepted, so a request copying its
prompt drafts long while a chatty one beside it drafts nothing.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from .cost_priors import GPU_PRIOR, STOCK_CPU_PRIOR
from .draft import FROM_COPY, Draft

_EMA = 0.1
# Forward times a cost point is estimated from: their median, since one stalled step (the OS
# running something else, a page fault) can take ten times a normal one, and an average would
# price a width out for tens of steps after it.
COST_WINDOW = 9
# Lowest calibration ratio. Calibration only learns from drafts that are fed, and a ratio too
# low for any draft to pay (on a CPU a one-token draft adds ~6% to a forward) would stop a request
# drafting for good after a run of misses.
MIN_CALIBRATION = 0.15


def _points(q: float) -> tuple[int, int, float]:
    """The powers of two around q and q's linear weight on the upper one."""
    q = max(q, 1.0)
    lower = 1 << int(math.floor(math.log2(q)))
    return lower, 2 * lower, (q - lower) / lower


def _interpolate(table: dict[int, float], q: float) -> float:
    lower, upper, weight = _points(q)
    top = max(table)
    if lower >= top:
        return table[top] * q / top  # past the table: cost grows in proportion to the tokens
    return table[lower] + weight * (table[upper] - table[lower])


@dataclass
class CostModel:
    """Seconds per forward at q = 1, 2, 4, 8, ... new tokens (medians of the last COST_WINDOW
    forwards credited to each), interpolated in between.

    A forward over q tokens is credited to the nearer of the two powers of two around it, scaled
    by the prior's slope between q and that point, so a draft of 20 tokens is neither charged
    for 32 (which would make every width up to 32 look free) nor for 16.
    """

    prior: dict[int, float]
    seconds: dict[int, float] = field(init=False, default_factory=dict)
    _recent: dict[int, deque[float]] = field(init=False, default_factory=dict)
    _relative: dict[int, float] = field(init=False)  # cost(point) / cost(1) for every prior point

    def __post_init__(self) -> None:
        self._relative = dict(self.prior)

    @classmethod
    def for_device(cls, device_type: str, prior: dict[int, float] | None = None) -> CostModel:
        """Start from `prior` (the execution path's curve), else from the device's (cost_priors.py)."""
        if prior is not None:
            return cls(dict(prior))
        return cls(GPU_PRIOR if device_type == "cuda" else STOCK_CPU_PRIOR)

    def observe(self, q: int, seconds: float) -> None:
        lower, upper, weight = _points(q)
        point = min(upper if weight > 0.5 else lower, max(self.prior))
        seconds *= _interpolate(self.prior, point) / _interpolate(self.prior, q)
        recent = self._recent.setdefault(point, deque(maxlen=COST_WINDOW))
        recent.append(seconds)
        self.seconds[point] = statistics.median(recent)
        if 1 in self.seconds:  # measured points where both were seen, else the prior's
            for measured, typical in self.seconds.items():
                self._relative[measured] = max(typical / self.seconds[1], 1.0)

    def relative(self, q: int) -> float:
        """cost(q) / cost(1)."""
        return max(_interpolate(self._relative, q), 1.0)

    def least_slope(self, q: int) -> float:
        """The least relative cost of one more token anywhere past q tokens (the curve is linear
        between its points, and in proportion to the tokens past the last one)."""
        points = sorted(self._relative)
        top = points[-1]
        slopes = [self._relative[top] / top]
        for lower, upper in zip(points, points[1:]):
            if upper > q:
                slopes.append((self._relative[upper] - self._relative[lower]) / (upper - lower))
        return max(min(slopes), 0.0)


# Classes of draft nodes whose estimated probabilities mislead alike: the evidence (a copy of the
# request's own text, or n-gram counts), the branch (the draft's best one, or a side branch), the
# depth (a child of the root, which decides whether the right text was found at all, or a node
# below one, which mostly follows once it was) and the estimated conditional probability itself, cut
# at these edges. Copies are reliable when nearly certain and far too confident below that; n-gram
# estimates are close to the truth down to about one half; side branches are taken far less often
# than their estimates say.
CONDITIONAL_EDGES = (0.5, 0.7, 0.9)
_BUCKETS = len(CONDITIONAL_EDGES) + 1
NODE_CLASSES = 2 * 2 * 2 * _BUCKETS
# The starting averages: the starting ratio over one predicted node, which the observed steps
# replace at `rate` each.
_PRIOR_EVIDENCE = 1.0


def node_class(copied: bool, side: bool, conditional: float, deep: bool = False) -> int:
    """The calibration class of a node (see CONDITIONAL_EDGES); `deep`: not a child of the root."""
    bucket = sum(conditional >= edge for edge in CONDITIONAL_EDGES)
    return ((2 * copied + side) * 2 + deep) * _BUCKETS + bucket


@dataclass
class Calibration:
    """How far to trust each class of draft node (node_class): the ratio of accepted nodes to
    their estimated conditional probabilities (of being accepted once their parent is), learned
    from verified drafts.

    Each class keeps moving averages of the nodes accepted and of the probabilities predicted
    (both decay by `rate` per observed step), so every tested node weighs alike: a step that put
    one node to the test does not count as much as one that tested eight.

    A node's calibrated weight, its chance of being accepted, is its parent's weight times its
    own ratio times its conditional probability (at most 1), so it never exceeds its parent's
    and every plan stays a connected subtree. The decoder keeps one across all requests; each
    request starts from it (`for_request`) and adapts faster to its own text.
    """

    hits: list[float] = field(default_factory=lambda: [_PRIOR_EVIDENCE] * NODE_CLASSES)
    expected: list[float] = field(default_factory=lambda: [_PRIOR_EVIDENCE] * NODE_CLASSES)
    rate: float = _EMA

    @classmethod
    def uniform(cls, ratio: float, rate: float = _EMA) -> Calibration:
        return cls([ratio * _PRIOR_EVIDENCE] * NODE_CLASSES, [_PRIOR_EVIDENCE] * NODE_CLASSES, rate)

    def for_request(self, rate: float) -> Calibration:
        """A copy that learns at `rate`: one request's own calibration."""
        return Calibration(list(self.hits), list(self.expected), rate)

    @property
    def ratios(self) -> list[float]:
        """Accepted over predicted per class, within [MIN_CALIBRATION, 1]: estimates are upper
        bounds, never inflated."""
        return [h / e for h, e in zip(self.hits, self.expected)]

    def calibrated(self, draft: Draft) -> list[float]:
        """Each node's chance of being accepted: its parent's times its calibrated conditional."""
        ratios = self.ratios
        weights = [1.0]
        for i, (cls, conditional) in enumerate(_classes(draft), start=1):
            weights.append(weights[draft.parents[i]] * min(ratios[cls] * conditional, 1.0))
        return weights

    def observe(self, draft: Draft, accepted_nodes: list[int]) -> None:
        """Learn from a fed draft and the nodes the model accepted. Only nodes whose parent was
        accepted (or is the root) were put to the test; the others say nothing."""
        accepted = set(accepted_nodes)
        predicted = [0.0] * NODE_CLASSES
        hits = [0] * NODE_CLASSES
        for i, (cls, conditional) in enumerate(_classes(draft), start=1):
            parent = draft.parents[i]
            if parent and parent not in accepted:
                continue
            predicted[cls] += conditional
            hits[cls] += i in accepted
        keep = 1.0 - self.rate
        for cls, expected in enumerate(predicted):
            if expected > 0:
                total = keep * self.expected[cls] + self.rate * expected
                taken = keep * self.hits[cls] + self.rate * hits[cls]
                # Kept within the ratio's bounds, so a run of misses or of hits is undone as fast
                # as it was learned.
                self.hits[cls] = min(max(taken, MIN_CALIBRATION * total), total)
                self.expected[cls] = total


def _classes(draft: Draft) -> list[tuple[int, float]]:
    """(class, conditional probability) of every node after the root."""
    first = draft.first_branch()
    probs, parents = draft.probs, draft.parents
    classes = []
    for i in range(1, len(draft)):
        parent = parents[i]
        parent_prob = probs[parent]
        conditional = probs[i] / parent_prob if parent_prob > 0 else 0.0
        copied = bool(draft.origins[i] & FROM_COPY)
        classes.append((node_class(copied, i > first, conditional, deep=parent != 0), conditional))
    return classes


def least_paying_weight(cost: CostModel, requests: int, tokens: int) -> float:
    """The weight below which no draft node can pay for its place in a step of `requests` roots
    among `tokens` fed, so retrieval need not look for it.

    Without drafts the step yields requests / cost(tokens) tokens per unit of cost. A set of nodes
    each weighing less than that rate times the least marginal cost of a token yields less per
    unit than the step already does, whatever nodes it joins, so no plan is better for it.
    """
    if requests == 0:
        return 0.0
    return cost.least_slope(tokens) * requests / cost.relative(tokens)


def plan_step(
    drafts: list[Draft],
    calibrations: list[Calibration],
    adaptive: list[bool],
    cost: CostModel,
    token_budget: int,
    other_tokens: int = 0,
) -> list[Draft]:
    """Trim the drafts of one step to the nodes whose expected accepted tokens pay for their cost.

    The step feeds every request's root and kept nodes as one ragged row, beside `other_tokens`
    more (prompt chunks), so it costs cost(k + other_tokens + m) for m kept nodes. Every node's
    worth is its probability of being accepted, calibrated by its own request's ratios
    (acceptance differs a lot between, say, code editing and a story). Nodes are taken most
    likely first across all requests, each after its parent, and the m with the best expected
    tokens per cost wins (m = 0: plain decoding). Requests that opted out of adaptivity keep
    their whole draft, within the budget (token_budget - k - other_tokens nodes in all).
    """
    k = len(drafts)
    fixed = k + other_tokens
    room = max(0, token_budget - fixed)
    keep: list[list[int]] = [[0] for _ in drafts]
    forced_gain = 0.0
    candidates: list[tuple[float, int, int]] = []
    for r, (draft, calibration, free) in enumerate(zip(drafts, calibrations, adaptive)):
        weights = calibration.calibrated(draft)
        if free:
            candidates.extend((-weights[i], r, i) for i in range(1, len(draft)))
            continue
        taken = list(range(1, min(len(draft), room + 1)))  # DFS order: parents first
        keep[r] += taken
        forced_gain += sum(weights[i] for i in taken)
        room -= len(taken)
    candidates.sort()  # most likely first; a parent (never less likely) before its children
    candidates = candidates[:room]
    best_m, best_rate = 0, -1.0
    gain = float(k) + forced_gain
    base = fixed + sum(len(nodes) - 1 for nodes in keep)
    for m in range(len(candidates) + 1):
        if m:
            gain -= candidates[m - 1][0]
        rate = gain / cost.relative(base + m)
        if rate > best_rate:
            best_m, best_rate = m, rate
    for _, r, i in candidates[:best_m]:
        keep[r].append(i)
    return [d if len(nodes) == len(d) else d.subset(sorted(nodes)) for d, nodes in zip(drafts, keep)]
