"""The step profile's arithmetic on a metrics page: counter deltas -> ms per step by part."""

from __future__ import annotations

import pytest

from bench.step_profile import PARTS, cost_rows, format_tables, level_of, parse_samples


def page(steps: int, forward: float, wait: float) -> str:
    labels = 'model="lookahead",version="1",instance="lookahead_0_0",pid="7"'
    lines = [
        f"lookahead_steps_total{{{labels}}} {steps}",
        f"lookahead_step_requests_total{{{labels}}} {2 * steps}",
        f"lookahead_step_tokens_total{{{labels}}} {5 * steps}",
        f'lookahead_step_seconds_total{{{labels},part="forward"}} {forward}',
        f'lookahead_step_seconds_total{{{labels},part="wait"}} {wait}',
        f"lookahead_response_send_seconds_total{{{labels}}} 0.5",
        f'lookahead_step_cost_seconds{{{labels},width="1",source="predicted"}} 0.01',
        f'lookahead_step_cost_seconds{{{labels},width="1",source="measured"}} 0.012',
        f'lookahead_step_cost_seconds{{{labels},width="2",source="predicted"}} 0',
        'lookahead_steps_total{model="baseline",version="1",instance="baseline_0_0",pid="8"} 99',
        "# HELP lookahead_steps_total Engine steps that ran a forward.",
    ]
    return "\n".join(lines)


def test_a_level_is_the_deltas_of_its_model_per_step() -> None:
    before, after = (
        parse_samples(page(10, 1.0, 0.1), "lookahead"),
        parse_samples(page(30, 3.0, 0.5), "lookahead"),
    )
    level = level_of(4, before, after)
    assert level.steps == 20 and level.requests_per_step == 2.0 and level.tokens_per_step == 5.0
    assert level.forward == pytest.approx(100.0) and level.wait == pytest.approx(20.0)
    assert level.ms_per_step == pytest.approx(120.0) and level.host_share == pytest.approx(20 / 120)
    assert level.send == 0.0  # unchanged between the two pages
    rows = cost_rows(after)
    assert rows == [(1, "10.00", "12.00")]  # a gauge never set (0) is left out
    table = format_tables([level], rows)
    assert all(part in table for part in PARTS) and "| 4 | 20 |" in table
