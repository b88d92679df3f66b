"""The oracle bound's pieces on hand-made texts: what it could copy, and what that saves."""

from __future__ import annotations

import pytest

from bench.oracle_bound import best_runs, oracle_ratio, relative_cost

CURVE = {1: 1.0, 2: 1.0, 4: 1.2, 8: 2.0}


def test_the_oracle_copies_only_text_known_before_each_position() -> None:
    prompt, output = [1, 2, 3, 4], [2, 3, 4, 9]
    # after 4 nothing known follows a 4; after 2, "3 4" (then 2, not 9); after 3, "4"; after 4 again, "2"
    assert best_runs(prompt, output, []) == [0, 2, 1, 0]
    # an earlier request's text "4 2 3 4 9" holds the rest of the output after each of its tokens
    assert best_runs(prompt, output, [[4, 2, 3, 4, 9]]) == [4, 3, 2, 1]


def test_the_cost_curve_is_linear_between_its_points_and_proportional_past_them() -> None:
    assert relative_cost(CURVE, 4) == 1.2
    assert relative_cost(CURVE, 6) == pytest.approx(1.6)
    assert relative_cost(CURVE, 16) == 4.0


def test_the_ratio_prices_the_oracle_steps_against_plain_ones() -> None:
    # alone: one step of 4 tokens (cost 1.2) against four plain steps (cost 1 each)
    assert oracle_ratio([[3, 0, 0, 0]], 1, CURVE) == pytest.approx(4 / 1.2)
    # nothing to copy: the same steps
    assert oracle_ratio([[0, 0, 0, 0]] * 2, 2, CURVE) == pytest.approx(1.0)
    # two at a time: the copying request's 4 tokens and the other's 1 in one step of 5 (cost 1.4),
    # then the other alone for 3 steps, against 4 plain steps of two (cost 1 each)
    assert oracle_ratio([[3, 0, 0, 0], [0, 0, 0, 0]], 2, CURVE) == pytest.approx(4 / (1.4 + 3))
