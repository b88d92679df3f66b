"""The draft-or-not decision: expected tokens per unit of forward cost."""

from __future__ import annotations

import random

import pytest

from lookahead.algorithm.cost_priors import GPU_PRIOR, PRIORS, STOCK_CPU_PRIOR
from lookahead.algorithm.draft import FROM_COPY, FROM_SHARED_TRIE, Draft
from lookahead.algorithm.planner import (
    MIN_CALIBRATION,
    NODE_CLASSES,
    Calibration,
    CostModel,
    least_paying_weight,
    node_class,
    plan_step,
)
from lookahead.cpu.extension import runnable_variants
from lookahead.models.loading import apply_execution_path
from lookahead.runtime.decoder import LookaheadDecoder


def choose_draft(draft: Draft, cost: CostModel, calibration: Calibration) -> Draft:
    """The plan for a batch of one request with a generous token budget."""
    return plan_step([draft], [calibration], [True], cost, token_budget=64)[0]


def chain(probs: list[float]) -> Draft:
    n = len(probs) + 1
    return Draft(list(range(n)), [-1, *range(n - 1)], [1.0, *probs])


def test_weak_draft_is_dropped_on_cpu_but_kept_on_gpu() -> None:
    weak = chain([0.04, 0.02])  # 1.04 expected tokens for the 1.06x cost of 2 tokens on a CPU
    assert len(choose_draft(weak, CostModel(STOCK_CPU_PRIOR), Calibration())) == 1
    assert len(choose_draft(weak, CostModel(GPU_PRIOR), Calibration())) == 3


def test_confident_draft_is_kept_and_its_unlikely_tail_trimmed() -> None:
    draft = Draft([9, 1, 2, 3, 4], [-1, 0, 1, 2, 0], [1.0, 0.95, 0.9, 0.85, 0.001])
    chosen = choose_draft(draft, CostModel(STOCK_CPU_PRIOR), Calibration())
    assert chosen.tokens == [9, 1, 2, 3]
    assert chosen.parents == [-1, 0, 1, 2]


def test_measured_costs_replace_the_prior() -> None:
    cost = CostModel(STOCK_CPU_PRIOR)
    for _ in range(3):
        cost.observe(1, 0.10)
        cost.observe(4, 0.11)
    assert abs(cost.relative(4) - 1.1) < 1e-9
    assert abs(cost.relative(3) - (STOCK_CPU_PRIOR[2] + 1.1) / 2) < 1e-9  # halfway between the points 2 and 4
    prior_only = choose_draft(chain([0.4, 0.2]), CostModel(STOCK_CPU_PRIOR), Calibration())
    assert len(prior_only) == 2  # the prior says 3 tokens cost 1.5x
    assert len(choose_draft(chain([0.4, 0.2]), cost, Calibration())) == 3


def test_one_stalled_forward_does_not_reprice_a_width() -> None:
    cost = CostModel(STOCK_CPU_PRIOR)
    for _ in range(5):
        cost.observe(1, 0.10)
        cost.observe(8, 0.20)
    cost.observe(8, 2.0)  # the OS took the cores for most of this step
    assert abs(cost.relative(8) - 2.0) < 1e-9
    for _ in range(5):  # a lasting change is followed within half the window
        cost.observe(8, 0.30)
    assert abs(cost.relative(8) - 3.0) < 1e-9


def test_a_width_between_two_points_is_charged_for_itself() -> None:
    cost = CostModel({1: 1.0, 2: 1.02, 4: 1.17, 8: 1.46, 16: 2.08, 32: 3.23, 64: 5.44, 128: 10.0})
    for _ in range(3):
        cost.observe(1, 0.10)
        cost.observe(20, 0.20)  # credited to the point 16, scaled by the prior's slope
    # ~ the observed 0.20 / 0.10 (interpolation runs on to the prior's 32); credited unscaled to 16 it
    # would read 2.31, charged as 32 3.23
    assert abs(cost.relative(20) - 2.0) < 0.15
    assert cost.relative(16) < cost.relative(20) < cost.relative(24) < cost.relative(32)
    assert cost.relative(256) == 2 * cost.relative(128)  # past the table: in proportion to the tokens


def test_calibration_learns_that_the_trie_is_overconfident() -> None:
    calibration = Calibration()
    confident = chain([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])
    assert len(choose_draft(confident, CostModel(STOCK_CPU_PRIOR), calibration)) == 9
    for _ in range(50):
        calibration.observe(confident, accepted_nodes=[])
    first = node_class(copied=False, side=False, conditional=0.9)
    assert calibration.ratios[first] == MIN_CALIBRATION
    # Only the first node was put to the test (the others' parents were rejected): no other class moved.
    assert [r for c, r in enumerate(calibration.ratios) if c != first] == [1.0] * (NODE_CLASSES - 1)
    # Still a one-token draft, so that the request goes on learning whether drafts pay again.
    assert len(choose_draft(confident, CostModel(STOCK_CPU_PRIOR), calibration)) == 2
    calibration.observe(confident, accepted_nodes=[1])
    assert calibration.ratios[first] > MIN_CALIBRATION


def test_side_branches_are_calibrated_apart_from_the_first() -> None:
    # root -> 1 -> 2 -> 3 is the first branch; 4 (under 1) and 5 (under the root) are side nodes.
    tree = Draft([9, 1, 2, 3, 4, 5], [-1, 0, 1, 2, 1, 0], [1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    assert tree.first_branch() == 3 and chain([0.5] * 4).first_branch() == 4
    calibration = Calibration()
    for _ in range(50):  # the model always follows the first branch
        calibration.observe(tree, accepted_nodes=[1, 2, 3])
    side = node_class(copied=False, side=True, conditional=0.6)
    assert calibration.ratios[side] == MIN_CALIBRATION
    weights = calibration.calibrated(tree)
    assert weights[:4] == pytest.approx(tree.probs[:4])
    assert weights[4:] == pytest.approx([0.6 * MIN_CALIBRATION, 0.5 * MIN_CALIBRATION])
    assert choose_draft(tree, CostModel(STOCK_CPU_PRIOR), calibration).tokens == [9, 1, 2, 3]
    assert choose_draft(tree, CostModel(STOCK_CPU_PRIOR), Calibration()).tokens == tree.tokens
    # a node is never weighted above its parent, so every plan stays a connected subtree
    distrusted_first = Calibration()
    for conditional in (0.0, 0.6, 0.8, 0.95):
        distrusted_first.hits[node_class(copied=False, side=False, conditional=conditional)] = 0.2
    weights = distrusted_first.calibrated(tree)
    assert weights[4] <= weights[1] == pytest.approx(0.2 * 0.9)


def test_copies_are_calibrated_apart_from_n_gram_estimates() -> None:
    # The same estimates, once from a copy of the request's text and once from n-gram counts.
    copied = Draft([0, 1, 2], [-1, 0, 1], [1.0, 0.75, 0.6], [0, FROM_COPY, FROM_COPY])
    counted = Draft([0, 1, 2], [-1, 0, 1], [1.0, 0.75, 0.6], [0, FROM_SHARED_TRIE, FROM_SHARED_TRIE])
    calibration = Calibration()
    for _ in range(50):  # copies this unsure are rarely right; the n-gram estimates are
        calibration.observe(copied, accepted_nodes=[])
        calibration.observe(counted, accepted_nodes=[1, 2])
    assert calibration.calibrated(copied)[1] == pytest.approx(0.75 * MIN_CALIBRATION)
    assert calibration.calibrated(counted) == pytest.approx(counted.probs)
    plan = plan_step([copied, counted], [calibration] * 2, [True] * 2, CostModel(GPU_PRIOR), token_budget=4)
    assert [len(d) for d in plan] == [1, 3]


def test_a_request_calibration_starts_from_the_shared_one_and_learns_apart() -> None:
    shared = Calibration.uniform(0.5)
    own = shared.for_request(rate=0.5)
    own.observe(chain([0.95]), accepted_nodes=[1])
    assert shared.ratios == [0.5] * NODE_CLASSES
    # accepted and predicted nodes, each a moving average: (0.5 x 0.5 + 0.5 x 1) / (0.5 x 1 + 0.5 x 0.95)
    assert own.ratios[node_class(False, False, 0.95)] == pytest.approx(0.75 / 0.975)


def test_every_tested_node_weighs_alike_in_the_calibration() -> None:
    # A class whose one-node tests fail but whose eight-node tests all pass: 8 accepted of 9
    # predicted, not the average of two steps' ratios (0 and 1).
    calibration = Calibration()
    short, long = chain([1.0, 0.5]), chain([1.0] * 8)
    deep = node_class(copied=False, side=False, conditional=1.0, deep=True)
    for _ in range(100):
        calibration.observe(short, accepted_nodes=[1])  # the deep node 2 (conditional 0.5) fails
        calibration.observe(long, accepted_nodes=list(range(1, 9)))
    assert calibration.ratios[deep] == pytest.approx(1.0)
    half = node_class(copied=False, side=False, conditional=0.5, deep=True)
    assert calibration.ratios[half] == MIN_CALIBRATION
    mixed = Calibration()
    shallow = node_class(copied=False, side=False, conditional=1.0)
    for _ in range(100):
        mixed.observe(chain([1.0]), accepted_nodes=[])  # one node tested, rejected
        mixed.observe(chain([1.0]), accepted_nodes=[1])
    assert mixed.ratios[shallow] == pytest.approx(0.5, abs=0.06)


def test_a_branch_first_node_is_calibrated_apart_from_the_nodes_below_it() -> None:
    # The right text is often not found (the first node fails), but once it is, the copy goes on.
    calibration = Calibration()
    copy = Draft([0, 1, 2, 3], [-1, 0, 1, 2], [1.0, 0.95, 0.95, 0.95], [0, FROM_COPY, FROM_COPY, FROM_COPY])
    for step in range(60):
        calibration.observe(copy, accepted_nodes=[1, 2, 3] if step % 2 else [])
    first = node_class(copied=True, side=False, conditional=1.0)
    below = node_class(copied=True, side=False, conditional=1.0, deep=True)
    assert calibration.ratios[first] == pytest.approx(0.5, abs=0.1)
    assert calibration.ratios[below] == pytest.approx(1.0)
    weights = calibration.calibrated(copy)  # the copy is certain once its first token is right
    assert weights[3] == weights[2] == weights[1] == pytest.approx(calibration.ratios[first] * 0.95)


def test_the_budget_goes_node_by_node_to_the_requests_whose_drafts_pay() -> None:
    strong, weak = chain([0.95] * 6), chain([0.05] * 6)
    plan = plan_step([strong, weak], [Calibration()] * 2, [True] * 2, CostModel(GPU_PRIOR), token_budget=8)
    assert [len(d) for d in plan] == [7, 1]  # every node to the likely copy, none to the weak draft
    plan = plan_step([strong, weak], [Calibration()] * 2, [True] * 2, CostModel(GPU_PRIOR), token_budget=5)
    assert [len(d) for d in plan] == [4, 1]  # 2 roots and the 3 most likely nodes
    plan = plan_step(
        [strong] * 4, [Calibration()] * 4, [True] * 4, CostModel(STOCK_CPU_PRIOR), token_budget=4
    )
    assert [len(d) for d in plan] == [1] * 4  # budget of one token per request: plain decoding


def test_nodes_go_where_they_are_most_likely_across_requests_and_trees_stay_connected() -> None:
    a = Draft([1, 2, 3, 4], [-1, 0, 1, 0], [1.0, 0.9, 0.5, 0.3])
    b = Draft([5, 6, 7], [-1, 0, 1], [1.0, 0.8, 0.7])
    plan = plan_step([a, b], [Calibration()] * 2, [True] * 2, CostModel(GPU_PRIOR), token_budget=5)
    assert plan[0].tokens == [1, 2] and plan[1].tokens == [5, 6, 7]  # 0.9, 0.8, 0.7 beat 0.5 and 0.3
    for draft in plan:
        assert all(0 <= p < i for i, p in enumerate(draft.parents[1:], start=1))


def test_prompt_tokens_in_the_step_make_a_draft_cheaper_at_the_margin() -> None:
    weak = chain([0.03, 0.02])
    alone = plan_step([weak], [Calibration()], [True], CostModel(STOCK_CPU_PRIOR), token_budget=64)
    beside = plan_step(
        [weak], [Calibration()], [True], CostModel(STOCK_CPU_PRIOR), token_budget=64, other_tokens=40
    )
    assert len(alone[0]) == 1 and len(beside[0]) == 3


def test_a_request_that_opted_out_of_adaptivity_keeps_its_draft() -> None:
    weak = chain([0.01] * 3)
    plan = plan_step(
        [weak, chain([0.01])], [Calibration()] * 2, [False, True], CostModel(STOCK_CPU_PRIOR), token_budget=64
    )
    assert len(plan[0]) == 4


def test_the_cost_prior_follows_the_device_and_the_execution_path(tiny_model, byte_tokenizer) -> None:
    assert CostModel.for_device("cuda").prior == GPU_PRIOR
    assert CostModel.for_device("cpu").prior == STOCK_CPU_PRIOR
    assert CostModel.for_device("cpu", {1: 1.0, 2: 3.0}).prior == {1: 1.0, 2: 3.0}
    assert LookaheadDecoder(tiny_model("llama"), byte_tokenizer).cost.prior == STOCK_CPU_PRIOR
    best = runnable_variants()[:1]
    for variant in best:  # "packed" takes the best variant this CPU runs
        model = tiny_model("llama")
        kernel, _, prior = apply_execution_path(model, "packed")
        assert (kernel, prior) == ("packed", PRIORS[variant.name])
        assert LookaheadDecoder(model, byte_tokenizer, cost_prior=prior).cost.prior == PRIORS[variant.name]


def test_no_node_lighter_than_the_least_paying_weight_ever_joins_a_plan() -> None:
    rng = random.Random(3)
    cost = CostModel(PRIORS["avx512"])
    for _ in range(200):
        k = rng.randrange(1, 9)
        least = least_paying_weight(cost, k, k)
        heavy = [chain(sorted((rng.uniform(least, 1.0) for _ in range(rng.randrange(0, 6))), reverse=True))]
        light = [chain([rng.uniform(0.0, least)] * rng.randrange(1, 8)) for _ in range(k - 1)]
        drafts = (heavy + light)[:k]
        plan = plan_step(drafts, [Calibration()] * k, [True] * k, cost, token_budget=128)
        assert all(prob >= least for planned in plan for prob in planned.probs[1:])
    # many requests in one step: only nearly certain nodes can pay; one request alone: almost any
    assert least_paying_weight(cost, 8, 8) > 0.5 > 0.1 > least_paying_weight(cost, 1, 1)


def test_no_node_lighter_than_its_requests_least_paying_weight_joins_a_plan_beside_cache_reads() -> None:
    rng = random.Random(5)
    seconds = {1: 0.010, 2: 0.0102, 4: 0.0106, 8: 0.013, 16: 0.019, 32: 0.033}
    cost = CostModel.measured(seconds, per_entry=2e-6, per_row_entry=0.5e-6)
    for _ in range(40):
        cost.observe_yield(3, 1.5)
    for _ in range(200):
        k = rng.randrange(1, 9)
        starts = [rng.randrange(0, 8000) for _ in range(k)]
        drafts = [
            chain(sorted((rng.uniform(0.0, 1.0) for _ in range(rng.randrange(0, 8))), reverse=True))
            for _ in range(k)
        ]
        plan = plan_step(drafts, [Calibration()] * k, [True] * k, cost, token_budget=128, starts=starts)
        for planned, start in zip(plan, starts):
            least = least_paying_weight(cost, k, k, start)
            assert all(weight >= least for weight in Calibration().calibrated(planned)[1:])
    # the same node pays beside a short context and not beside a long one
    assert least_paying_weight(cost, 1, 1, 100) < least_paying_weight(cost, 1, 1, 8000)


def test_a_measured_curve_starts_the_cost_model_and_is_compared_with_the_steps() -> None:
    seconds = {1: 0.010, 2: 0.011, 4: 0.016}
    cost = CostModel.measured(seconds)
    assert cost.prior == pytest.approx({1: 1.0, 2: 1.1, 4: 1.6}) and cost.relative(8) == pytest.approx(3.2)
    assert [(q, predicted) for q, predicted, _ in cost.table()] == [
        (1, 0.010),
        (2, pytest.approx(0.011)),
        (4, pytest.approx(0.016)),
    ]
    cost.observe(4, 0.040)  # no one-token step seen yet: relative to the measured one
    assert cost.relative(4) == pytest.approx(4.0)
    assert dict((q, m) for q, _, m in cost.table())[4] == 0.040
    with pytest.raises(ValueError, match="1, 2, 4"):
        CostModel.measured({1: 0.01, 4: 0.02})


def test_a_steps_cache_reads_are_priced_apart_from_its_width() -> None:
    # one row reads 1 us per cached entry, each further row 0.5 us more; 128 entries were behind the probe
    probe = {1: 0.010 + 128e-6, 2: 0.011 + 128e-6 * 1.5, 4: 0.016 + 128e-6 * 2.5}
    cost = CostModel.measured(probe, context=128, per_entry=1e-6, per_row_entry=0.5e-6)
    assert cost.predicted == pytest.approx({1: 0.010, 2: 0.011, 4: 0.016})  # the widths' own seconds
    assert cost.prior == pytest.approx({1: 1.0, 2: 1.1, 4: 1.6})
    # a step of four requests, one row each, after 1,000 cached entries apiece: the reads took
    # 4 ms of its 20, and its width is credited with the rest, as a step of four tokens of one request
    for _ in range(3):
        cost.observe(4, 0.020, entries=4000, row_entries=0)
    assert cost.seconds[4] == pytest.approx(0.016)
    assert cost.price(4, 4000, 0) == pytest.approx(2.0)  # (16 ms + 4 ms) / the 10 ms of one token
    assert cost.price(1, 0, 2000) == pytest.approx(1.1)  # a further row over 2,000 entries: 1 ms more


def test_a_draft_reading_a_long_context_pays_for_its_reads() -> None:
    cost = CostModel.measured({1: 0.010, 2: 0.0105, 4: 0.011, 8: 0.012}, per_entry=1e-6, per_row_entry=1e-6)
    for _ in range(40):
        cost.observe_yield(2, 1.0)  # steps lately yield two tokens per one-token forward's cost
    drafts = [chain([0.5, 0.45, 0.4]), chain([0.5, 0.45, 0.4])]
    # alike but for their contexts: each further row after 3,000 entries costs 3 ms, 0.3 of a forward
    near, far = plan_step(drafts, [Calibration()] * 2, [True] * 2, cost, token_budget=64, starts=[100, 3000])
    assert len(near) == 4 and len(far) == 1
    # without the reads priced, both drafts are kept whole
    both = plan_step(drafts, [Calibration()] * 2, [True] * 2, cost, token_budget=64)
    assert [len(draft) for draft in both] == [4, 4]
