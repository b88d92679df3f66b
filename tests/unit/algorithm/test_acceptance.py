"""The acceptance predictor: calibrated on synthetic verdict streams, better than the class
calibration where acceptance depends on what the drafter knows, bounded in memory."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from lookahead.algorithm.acceptance import (
    ONE_HOTS,
    SOURCES,
    WEIGHTS,
    AcceptancePredictor,
    features,
    source_of,
    verified_nodes,
)
from lookahead.algorithm.draft import (
    FROM_COPY,
    FROM_OWN_OUTPUT,
    FROM_RECYCLED,
    FROM_REQUEST_TRIE,
    FROM_SHARED_TRIE,
    Draft,
    Evidence,
)
from lookahead.algorithm.planner import Calibration


@dataclass(frozen=True)
class Kind:
    """A kind of node: what the drafter says (origins, raw conditional, matched) and the truth."""

    origins: int
    raw: float
    matched: int
    truth: float


# The drafter's own estimate misleads differently per kind: a copy after a long match is nearly
# certain, a copy resumed after one agreeing token is not, an n-gram is overrated at depth 1.
KINDS = (
    Kind(FROM_COPY, 0.97, 40, 0.97),
    Kind(FROM_COPY, 0.83, 1, 0.35),
    Kind(FROM_SHARED_TRIE, 0.8, 4, 0.55),
    Kind(FROM_REQUEST_TRIE, 0.6, 6, 0.6),
    Kind(FROM_RECYCLED, 0.6, 1, 0.2),
    Kind(FROM_COPY | FROM_OWN_OUTPUT, 0.9, 12, 0.9),
)


def synthetic_draft(rng: random.Random) -> tuple[Draft, list[float]]:
    """A root with a chain of one kind and a side branch of another; each node's true conditional."""
    main, side = rng.choice(KINDS), rng.choice(KINDS)
    length = rng.randint(1, 6)
    tokens, parents, probs, origins, evidence, truth = [0], [-1], [1.0], [0], [Evidence()], [1.0]
    for depth in range(length):
        tokens.append(100 + depth)
        parents.append(depth)
        probs.append(probs[-1] * main.raw)
        origins.append(main.origins)
        evidence.append(Evidence(main.matched + depth, 2.0, 10, 0))
        truth.append(main.truth)
    share = min(side.truth, 1.0 - main.truth)  # siblings exclude each other
    tokens.append(200)
    parents.append(0)
    probs.append(side.raw * (1 - main.raw))
    origins.append(side.origins)
    evidence.append(Evidence(side.matched, 1.0, 10, 1))
    truth.append(share)
    return Draft(tokens, parents, probs, origins, evidence), truth


def verdict(draft: Draft, truth: list[float], rng: random.Random) -> list[int]:
    """The model walks down: at each reached node it takes one child by the true conditionals, or none."""
    children = draft.children()
    node, accepted = 0, []
    while children[node]:
        pick, roll = None, rng.random()
        for child in children[node]:
            roll -= truth[child]
            if roll < 0:
                pick = child
                break
        if pick is None:
            break
        accepted.append(pick)
        node = pick
    return accepted


def log_loss(pairs: list[tuple[float, bool]]) -> float:
    return -sum(math.log(max(p, 1e-4)) if y else math.log(max(1 - p, 1e-4)) for p, y in pairs) / len(pairs)


def conditionals_of(weights: list[float], draft: Draft) -> list[float]:
    return [weights[i] / max(weights[p], 1e-12) for i, p in enumerate(draft.parents) if i]


def test_it_learns_calibrated_acceptance_that_the_class_calibration_cannot_see() -> None:
    rng = random.Random(0)
    predictor = AcceptancePredictor()
    calibration = Calibration.uniform(0.7)
    for request in range(40):  # requests come and go; the instance's weights stay
        mine, theirs = predictor.for_request(), calibration.for_request(0.15)
        for _ in range(50):
            draft, truth = synthetic_draft(rng)
            accepted = verdict(draft, truth, rng)
            mine.observe(draft, accepted)
            for estimate in (calibration, theirs):
                estimate.observe(draft, accepted)
    # held out: predicted conditional against the truth, kind by kind, and log-loss on the verdicts
    ours, classes, by_kind = [], [], {}
    view, theirs = predictor.for_request(), calibration.for_request(0.15)
    for _ in range(3000):
        draft, truth = synthetic_draft(rng)
        accepted = verdict(draft, truth, rng)
        mask, taken = verified_nodes(draft, accepted)
        predicted = view.conditionals(draft)
        baseline = conditionals_of(theirs.calibrated(draft), draft)
        for i in np.flatnonzero(mask):
            ours.append((float(predicted[i]), bool(taken[i])))
            classes.append((baseline[i], bool(taken[i])))
            key = (draft.origins[i + 1], draft.evidence[i + 1].matched >= 20)
            by_kind.setdefault(key, []).append((float(predicted[i]), truth[i + 1]))
    for key, pairs in by_kind.items():
        if len(pairs) > 200:
            mean_predicted = sum(p for p, _ in pairs) / len(pairs)
            mean_true = sum(t for _, t in pairs) / len(pairs)
            assert abs(mean_predicted - mean_true) < 0.06, key
    assert log_loss(ours) < log_loss(classes) - 0.02


def test_a_request_that_copies_more_reliably_than_the_instance_is_trusted_more_at_once() -> None:
    rng = random.Random(1)
    predictor = AcceptancePredictor()
    average = predictor.for_request()
    for _ in range(300):
        draft, truth = synthetic_draft(rng)
        average.observe(draft, verdict(draft, truth, rng))
    reliable = predictor.for_request()
    draft = Draft(
        [0, 1, 2],
        [-1, 0, 1],
        [1.0, 0.83, 0.69],
        [0, FROM_COPY, FROM_COPY],
        [Evidence(), Evidence(1), Evidence(2)],
    )
    before = reliable.conditionals(draft)[0]
    for _ in range(20):
        reliable.observe(draft, [1, 2])  # this request's resumed copies always hold
    assert reliable.conditionals(draft)[0] > before + 0.1
    assert predictor.for_request().conditionals(draft)[0] < reliable.conditionals(draft)[0]


def test_siblings_share_at_most_certainty_and_weights_never_grow_down_a_branch() -> None:
    predictor = AcceptancePredictor()
    view = predictor.for_request()
    view.offsets[:] = 8.0  # every node near certain on its own
    draft = Draft(
        [0, 1, 2, 3, 4],
        [-1, 0, 0, 0, 1],
        [1.0, 0.9, 0.8, 0.7, 0.8],
        [0, FROM_COPY, FROM_SHARED_TRIE, FROM_REQUEST_TRIE, FROM_COPY],
        [
            Evidence(),
            Evidence(9, 0, -1, 0),
            Evidence(3, 4, 5, 1),
            Evidence(3, 1, -1, 2),
            Evidence(10, 0, -1, 0),
        ],
    )
    conditionals = view.conditionals(draft)
    assert conditionals[:3].sum() <= 1.0 + 1e-9
    weights = view.calibrated(draft)
    assert weights[0] == 1.0 and all(weights[i] <= weights[p] for i, p in enumerate(draft.parents) if i)


def test_memory_is_fixed_however_long_it_learns() -> None:
    rng = random.Random(2)
    predictor = AcceptancePredictor()
    assert predictor.weights.shape == predictor.seen.shape == (WEIGHTS,)
    view = predictor.for_request()
    for _ in range(2000):
        draft, truth = synthetic_draft(rng)
        view.observe(draft, verdict(draft, truth, rng))
    assert predictor.weights.shape == (WEIGHTS,) and view.offsets.shape == (len(SOURCES),)
    assert np.isfinite(predictor.weights).all()
    assert sorted(vars(predictor)) == ["seen", "weights"]
    assert sorted(vars(view)) == ["_planned", "offsets", "predictor", "teaches"]
    assert view._planned is not None and view._planned[0] is draft  # the last draft's features only


def test_a_planned_drafts_features_serve_its_verdict_and_a_new_draft_gets_its_own() -> None:
    rng = random.Random(4)
    view = AcceptancePredictor().for_request()
    planned, truth = synthetic_draft(rng)
    view.calibrated(planned)
    found = view._planned[1] if view._planned else None
    view.observe(planned, verdict(planned, truth, rng))
    assert view._planned is not None and view._planned[1] is found  # computed once for both
    other, truth = synthetic_draft(rng)
    alone = AcceptancePredictor().for_request()
    alone.offsets = view.offsets.copy()
    alone.predictor.weights = view.predictor.weights.copy()
    assert view.calibrated(other) == alone.calibrated(other)  # never another draft's features


def test_the_plans_subset_of_a_draft_reads_the_features_of_its_rows() -> None:
    """What the planner keeps of a draft is verified: its features come from the planned draft's
    rows, equal to features computed afresh, and they differ from the whole draft's."""
    rng = random.Random(5)
    partial = 0
    for _ in range(200):
        size = rng.randint(2, 30)
        parents = [-1] + [rng.randrange(i) for i in range(1, size)]
        probs = [1.0]
        for parent in parents[1:]:
            probs.append(probs[parent] * rng.uniform(0.05, 1.0))
        origins = [0] + [rng.randrange(128) for _ in range(size - 1)]
        evidence = [Evidence()] + [
            Evidence(rng.randint(1, 70), rng.uniform(0, 80), rng.randint(-1, 70_000), rng.randint(0, 4))
            for _ in range(size - 1)
        ]
        draft = Draft(list(range(size)), parents, probs, origins, evidence)
        kept = {0}
        for node in range(1, size):  # closed under parents, as the planner keeps nodes
            if parents[node] in kept and rng.random() < 0.6:
                kept.add(node)
        if len(kept) < 2:  # a bare root has no features: nothing is planned or verified
            continue
        partial += len(kept) < size
        subset = draft.subset(sorted(kept))
        view = AcceptancePredictor().for_request()
        view.calibrated(draft)
        reused = view._features(subset)
        fresh = features(subset)
        for name, value in fresh._asdict().items():
            assert np.array_equal(getattr(reused, name), value), name
    assert partial > 100


def test_a_view_that_does_not_teach_learns_only_its_own_offsets() -> None:
    """A request with `learn` off reads the instance's weights and leaves them as they were."""
    rng = random.Random(3)
    predictor = AcceptancePredictor()
    weights, seen = predictor.weights.copy(), predictor.seen.copy()
    view = predictor.for_request(teaches=False)
    for _ in range(50):
        draft, truth = synthetic_draft(rng)
        view.observe(draft, verdict(draft, truth, rng))
    assert np.array_equal(predictor.weights, weights) and np.array_equal(predictor.seen, seen)
    assert view.offsets.any()


def test_sources_and_features_read_what_the_drafter_knew() -> None:
    assert SOURCES[source_of(FROM_COPY | FROM_SHARED_TRIE)] == "copy of the prompt"
    assert SOURCES[source_of(FROM_COPY | FROM_OWN_OUTPUT)] == "copy of the output"
    assert SOURCES[source_of(FROM_SHARED_TRIE | FROM_OWN_OUTPUT)] == "shared trie, this request"
    assert SOURCES[source_of(FROM_RECYCLED)] == "recycled"
    draft, _ = synthetic_draft(random.Random(3))
    found = features(draft)
    m = len(draft) - 1
    assert found.columns.shape == (m, ONE_HOTS) and found.bits.shape == (m, 7)
    assert (found.columns < WEIGHTS).all() and (found.slope < WEIGHTS).all()
    assert found.parents.tolist() == draft.parents[1:]
