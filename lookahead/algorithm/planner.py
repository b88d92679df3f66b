"""Is a draft worth its forward? Expected tokens against the forward's cost.

A forward over q new tokens costs cost(q) relative to a one-token forward. On a GPU cost is
nearly flat up to tens of tokens; on a CPU it grows several-fold by q=64 (cost_priors.py).
A draft whose nodes are reached with probabilities w_i (each node's acceptance estimate, see
acceptance.py) yields 1 + sum(w_i) tokens in expectation. We keep the top-m nodes by weight (a
connected subtree, since weights never grow along a path). Which m? Decoding wants the most
tokens per unit of cost over the whole request, not in each step: a step is worth widening as
long as each added node's weight pays for its cost at the rate steps yield lately (lambda,
tokens per unit of cost), i.e. the m maximising (1 + sum w) - lambda * cost(m + 1)
(Dinkelbach's rule for a ratio of sums). So a reliable copy drafts a deep chain even when its
step already yields more than average, and a step of long shots drafts nothing. Until steps
have been seen, the m maximising (1 + sum w) / cost(m + 1) stands in. m = 0 is a plain decoding
step. cost(q), lambda and the estimates are learned online from real steps. A batched step
applies the same rule node by node across all its requests (see plan_step): the step's tokens
go to whichever request's next node is most likely to be accepted, so a request copying its
prompt drafts long while a chatty one beside it drafts nothing.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .cost_priors import GPU_PRIOR, STOCK_CPU_PRIOR
from .draft import FROM_COPY, Draft

_EMA = 0.1
# Forward times a cost point is estimated from: their median, since one stalled step (the OS
# running something else, a page fault) can take ten times a normal one, and an average would
# price a width out for tens of steps after it.
COST_WINDOW = 9
# The yield rate (tokens per unit of relative cost) moves by this share of each step without a
# prompt chunk: about the last 30 steps count.
YIELD_EMA = 0.03
# Lowest calibration ratio. Calibration only learns from drafts that are fed, and a ratio too
# low for any draft to pay (on a CPU a one-token draft adds ~6% to a forward) would stop a request
# drafting for good after a run of misses.
MIN_CALIBRATION = 0.15


def _points(q: float) -> tuple[int, int, float]:
    """The powers of two around q and q's linear weight on the upper one."""
    q = max(q, 1.0)
    lower = 1 << int(math.floor(math.log2(q)))
    return lower, 2 * lower, (q - lower) / lower


def _powers_below(top: int) -> list[int]:
    """1, 2, 4, ... up to top."""
    return [1 << i for i in range(top.bit_length()) if 1 << i <= top]


def _interpolate(table: dict[int, float], q: float) -> float:
    lower, upper, weight = _points(q)
    top = max(table)
    if lower >= top:
        return table[top] * q / top  # past the table: cost grows in proportion to the tokens
    return table[lower] + weight * (table[upper] - table[lower])


@dataclass
class CostModel:
    """Seconds per forward at q = 1, 2, 4, 8, ... new tokens (medians of the last COST_WINDOW
    forwards credited to each), interpolated in between, plus what reading the cache costs.

    A forward over q tokens is credited to the nearer of the two powers of two around it, scaled
    by the prior's slope between q and that point, so a draft of 20 tokens is neither charged
    for 32 (which would make every width up to 32 look free) nor for 16.

    A step's segments read their requests' cached entries: every segment's first row reads its
    `start` entries (per_entry seconds each), every further row reads them again (per_row_entry
    each; a tree's rows share one read of the keys and values, not the scores). Where these
    were measured (`measured`), a step's context cost is taken out before its seconds are
    credited to its width, so the width curve says what one more token costs whatever the
    requests beside it: eight requests' steps priced as eight tokens of one request would make
    every draft token look several times dearer than it is.
    """

    prior: dict[int, float]
    # Seconds per width measured before serving (`measured`); empty when starting from a prior.
    predicted: dict[int, float] = field(default_factory=dict)
    per_entry: float = 0.0  # seconds per cached entry a segment's first row reads
    per_row_entry: float = 0.0  # seconds per cached entry each further row of a segment reads
    seconds: dict[int, float] = field(init=False, default_factory=dict)
    _recent: dict[int, deque[float]] = field(init=False, default_factory=dict)
    _relative: dict[int, float] = field(init=False)  # cost(point) / cost(1) for every prior point
    # Moving sums of the tokens steps yielded and of their relative costs (see `rate`).
    _tokens: float = field(init=False, default=0.0)
    _costs: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self._relative = dict(self.prior)

    def observe_yield(self, tokens: int, price: float) -> None:
        """A step of relative cost `price` (see `price`) and its requests kept `tokens` (accepted
        and bonus)."""
        keep = 1.0 - YIELD_EMA
        self._tokens = keep * self._tokens + YIELD_EMA * tokens
        self._costs = keep * self._costs + YIELD_EMA * price

    @property
    def rate(self) -> float | None:
        """Tokens per unit of relative cost that steps yield lately (None before any)."""
        return self._tokens / self._costs if self._costs > 0 else None

    @classmethod
    def measured(
        cls,
        seconds: dict[int, float],
        context: int = 0,
        per_entry: float = 0.0,
        per_row_entry: float = 0.0,
    ) -> CostModel:
        """Start from the running path's own timings: seconds of a forward of q = 1, 2, 4, ...
        tokens (every power of two up to the widest measured), one segment after `context`
        cached entries, and the seconds each cached entry costs (see the class docstring). The
        curve keeps the widths' seconds without the context's. Steps then refine it, and
        `table` compares them with these."""
        if 1 not in seconds or any(q not in seconds for q in _powers_below(max(seconds))):
            raise ValueError(f"timings for 1, 2, 4, ... tokens needed, got widths {sorted(seconds)}")
        own = {
            q: max(s - context * (per_entry + per_row_entry * (q - 1)), s / 2)
            for q, s in sorted(seconds.items())
        }
        base = own[1]
        relative = {q: max(s / base, 1.0) for q, s in own.items()}
        return cls(relative, own, per_entry, per_row_entry)

    def context_seconds(self, entries: int, row_entries: int) -> float:
        """Seconds a step spends reading the cache: `entries` read by its segments' first rows,
        `row_entries` by their further rows (see `context_reads`)."""
        return self.per_entry * entries + self.per_row_entry * row_entries

    def price(self, q: int, entries: int = 0, row_entries: int = 0) -> float:
        """A step's cost relative to a one-token forward without context: q tokens fed, and the
        cache reads of `context_reads`."""
        return self.relative(q) + self.reading(entries, row_entries)

    def reading(self, entries: int, row_entries: int) -> float:
        """The cache reads' part of `price`."""
        base = self.seconds.get(1, self.predicted.get(1))
        return self.context_seconds(entries, row_entries) / base if base else 0.0

    def table(self) -> list[tuple[int, float | None, float | None]]:
        """(width, predicted seconds, measured seconds) per power of two, without the context's
        seconds: the prediction made before serving (None without one) and the median of the
        latest steps credited to that width (None before any)."""
        base = self.predicted.get(1)
        widths = sorted(set(self.prior) | set(self.seconds))
        return [
            (q, None if base is None else base * _interpolate(self.prior, q), self.seconds.get(q))
            for q in widths
        ]

    @classmethod
    def for_device(cls, device_type: str, prior: dict[int, float] | None = None) -> CostModel:
        """Start from `prior` (the execution path's curve), else from the device's (cost_priors.py)."""
        if prior is not None:
            return cls(dict(prior))
        return cls(GPU_PRIOR if device_type == "cuda" else STOCK_CPU_PRIOR)

    def observe(self, q: int, seconds: float, entries: int = 0, row_entries: int = 0) -> None:
        """A step fed q tokens in `seconds`, its segments reading the cache as `context_reads`
        counts: its width is credited with the seconds the context did not take (at least half)."""
        seconds = max(seconds - self.context_seconds(entries, row_entries), seconds / 2)
        lower, upper, weight = _points(q)
        point = min(upper if weight > 0.5 else lower, max(self.prior))
        seconds *= _interpolate(self.prior, point) / _interpolate(self.prior, q)
        recent = self._recent.setdefault(point, deque(maxlen=COST_WINDOW))
        recent.append(seconds)
        self.seconds[point] = statistics.median(recent)
        # Relative to a one-token step seen live, else to the one measured before serving; points
        # not seen keep the starting curve's.
        base = self.seconds.get(1, self.predicted.get(1))
        if base:
            for measured, typical in self.seconds.items():
                self._relative[measured] = max(typical / base, 1.0)

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


def context_reads(segments: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """(entries, row_entries) of a step's segments, each given as (cached entries before it,
    rows): the entries their first rows read, and those their further rows read."""
    return sum(start for start, _ in segments), sum(start * (rows - 1) for start, rows in segments)


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
# Drafters' conditional probabilities overstate acceptance: a cold estimate trusts them this far
# (the class calibration's starting ratio, and the acceptance predictor's).
INITIAL_CALIBRATION = 0.7
# A request's own class calibration learns at this rate (bench/acceptance.py runs the class
# calibration as a request did, to compare it with the acceptance predictor).
REQUEST_CALIBRATION_RATE = 0.15


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


class AcceptanceEstimate(Protocol):
    """A request's acceptance estimates (acceptance.RequestAcceptance, or a Calibration)."""

    def calibrated(self, draft: Draft) -> list[float]:
        """Each node's chance of being accepted (root: 1), never growing down a branch."""
        ...


def least_paying_weight(cost: CostModel, requests: int, tokens: int, entries: int = 0) -> float:
    """The weight below which no draft node of a request whose root follows `entries` cached
    entries can pay for its place in a step of `requests` roots among `tokens` fed, so retrieval
    need not look for it: a node pays when its weight exceeds the yield rate times its marginal
    cost, and no token costs less than the least slope plus its own reads of the cache.

    Before steps have been seen, the rate is this step's without drafts: requests / cost(tokens).
    """
    if requests == 0:
        return 0.0
    rate = cost.rate if cost.rate is not None else requests / cost.relative(tokens)
    return (cost.least_slope(tokens) + cost.reading(0, entries)) * rate


def plan_step(
    drafts: list[Draft],
    calibrations: Sequence[AcceptanceEstimate],
    adaptive: list[bool],
    cost: CostModel,
    token_budget: int,
    other_tokens: int = 0,
    starts: Sequence[int] | None = None,
    other_entries: int = 0,
) -> list[Draft]:
    """Trim the drafts of one step to the nodes whose expected accepted tokens pay for their cost.

    The step feeds every request's root and kept nodes as one ragged row, beside `other_tokens`
    more (prompt chunks), so it costs cost(k + other_tokens + m) for m kept nodes, plus its cache
    reads: each request's root reads its starts[r] cached entries, and so does each node kept
    for it (CostModel.price; `other_entries`: those the prompt chunks read). Every node's worth
    is its probability of being accepted, calibrated by its own request's ratios (acceptance
    differs a lot between, say, code editing and a story). Nodes are taken best first across
    all requests, each after its parent (most likely first; once the yield rate is known, net
    of what its own cache reads cost), and the m with the best expected tokens per cost wins
    (m = 0: plain decoding). Requests that opted out of adaptivity keep their whole draft,
    within the budget (token_budget - k - other_tokens nodes in all). The m kept maximises
    gain - rate * cost, or gain / cost before the cost model knows its rate (see the module
    docstring).
    """
    k = len(drafts)
    starts = [0] * k if starts is None else starts
    fixed = k + other_tokens
    room = max(0, token_budget - fixed)
    keep: list[list[int]] = [[0] for _ in drafts]
    forced_gain = 0.0
    rate = cost.rate
    node_reads = [cost.reading(0, start) for start in starts]  # relative cost of one more row's reads
    candidates: list[tuple[float, int, int, float]] = []  # (order, request, node, weight)
    for r, (draft, calibration, free) in enumerate(zip(drafts, calibrations, adaptive)):
        weights = calibration.calibrated(draft)
        if free:
            net = rate * node_reads[r] if rate is not None else 0.0
            candidates.extend((net - weights[i], r, i, weights[i]) for i in range(1, len(draft)))
            continue
        taken = list(range(1, min(len(draft), room + 1)))  # DFS order: parents first
        keep[r] += taken
        forced_gain += sum(weights[i] for i in taken)
        room -= len(taken)
    candidates.sort()  # best first; a parent (never less likely, the same reads) before its children
    candidates = candidates[:room]
    best_m, best_value = 0, -math.inf
    gain = float(k) + forced_gain
    base = fixed + sum(len(nodes) - 1 for nodes in keep)
    reads = cost.reading(
        sum(starts) + other_entries, sum(start * (len(nodes) - 1) for start, nodes in zip(starts, keep))
    )
    for m in range(len(candidates) + 1):
        if m:
            _, r, _, weight = candidates[m - 1]
            gain += weight
            reads += node_reads[r]
        price = cost.relative(base + m) + reads
        value = gain / price if rate is None else gain - rate * price
        if value > best_value:
            best_m, best_value = m, value
    for _, r, i, _ in candidates[:best_m]:
        keep[r].append(i)
    return [d if len(nodes) == len(d) else d.subset(sorted(nodes)) for d, nodes in zip(drafts, keep)]
