"""The planner on the running model's own cost curve: measured at load within its budget, one
curve per (kernel, threads), the step's time split into its parts."""

from __future__ import annotations

import random
import time

import pytest
import torch

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.algorithm.cost_priors import STOCK_CPU_PRIOR
from lookahead.runtime.runner import PROBE_CONTEXT, PROBE_LONG_CONTEXT, PROBE_ROWS
from lookahead.runtime.step_timing import DECODER_PARTS
from tests.helpers import repetitive_prompt as random_repetitive


def repetitive_prompt() -> list[int]:
    return random_repetitive(random.Random(0), 200)


def test_measure_cost_times_the_model_within_its_budget(tiny_model, byte_tokenizer) -> None:
    decoder = LookaheadDecoder(tiny_model("llama"), byte_tokenizer, NGramTrie(1000, 8))
    assert decoder.cost.prior == STOCK_CPU_PRIOR and decoder.cost.predicted == {}
    decoder.kv_bytes_per_token  # as the backend does before measuring: the model's first forward
    started = time.perf_counter()
    cost = decoder.measure_cost(budget_s=0.3)
    elapsed = time.perf_counter() - started
    widths = sorted(cost.predicted)
    assert widths[:2] == [1, 2] and widths == [1 << i for i in range(len(widths))]
    # the last width started within the budget: at most two forwards of about twice the widest after it
    assert elapsed < 0.3 + 4 * max(cost.predicted.values()) + 0.5
    assert cost.prior == {q: max(s / cost.predicted[1], 1.0) for q, s in cost.predicted.items()}
    assert decoder.cost is cost and not any(decoder.runner.pool.owners)  # the probe left its slot


def test_the_cache_reads_are_timed_apart_and_taken_out_of_the_widths(tiny_model, byte_tokenizer) -> None:
    decoder = LookaheadDecoder(tiny_model("llama"), byte_tokenizer, NGramTrie(1000, 8))
    decoder.kv_bytes_per_token
    runner = decoder.runner
    timed: list[tuple[int, int]] = []
    forward = runner.forward_segments

    def recorded(works):
        timed.extend((work.segment.start, work.segment.width) for work in works)
        return forward(works)

    runner.forward_segments = recorded  # type: ignore[method-assign]
    started = time.perf_counter()
    reads = runner.time_context(0.2)
    assert reads is not None and time.perf_counter() - started < 0.2 + 0.5
    assert all(seconds >= 0 for seconds in reads) and not any(runner.pool.owners)
    shapes = {
        (PROBE_CONTEXT, 1),
        (PROBE_LONG_CONTEXT, 1),
        (PROBE_CONTEXT, PROBE_ROWS),
        (PROBE_LONG_CONTEXT, PROBE_ROWS),
    }
    assert set(timed) == shapes and timed.count((PROBE_CONTEXT, PROBE_ROWS)) >= 1

    runner.time_context = lambda budget_s: (2e-6, 1e-6)  # type: ignore[method-assign]
    runner.time_widths = lambda budget_s: {1: 0.004, 2: 0.005}  # type: ignore[method-assign]
    cost = decoder.measure_cost(0.1)
    probe_reads = PROBE_CONTEXT * 2e-6
    assert cost.predicted == pytest.approx(
        {1: 0.004 - probe_reads, 2: 0.005 - probe_reads - PROBE_CONTEXT * 1e-6}
    )
    assert (cost.per_entry, cost.per_row_entry) == (2e-6, 1e-6)


def test_a_burst_of_other_work_while_measuring_inflates_one_pass_not_the_curve(
    tiny_model, byte_tokenizer
) -> None:
    decoder = LookaheadDecoder(tiny_model("llama"), byte_tokenizer, NGramTrie(1000, 8))
    decoder.kv_bytes_per_token
    runner, forward = decoder.runner, decoder.runner.forward_segments
    calls = 0

    def busy_at_first(works):  # another model loading beside this one, for the first forwards
        nonlocal calls
        calls += 1
        if calls <= 6:
            time.sleep(0.03)
        return forward(works)

    runner.forward_segments = busy_at_first  # type: ignore[method-assign]
    seconds = runner.time_widths(0.5)
    assert calls > 6 and len(seconds) >= 3
    assert max(seconds.values()) < 0.03, seconds


def test_another_team_size_starts_from_the_measured_shape_without_stopping_to_measure(
    tiny_model, byte_tokenizer
) -> None:
    decoder = LookaheadDecoder(tiny_model("llama"), byte_tokenizer, NGramTrie(1000, 8))
    first = decoder.measure_cost(budget_s=0.1)
    kernel, threads = decoder.cost_key
    assert kernel == "stock"

    def no_probe(budget_s: float) -> dict[int, float]:
        raise AssertionError("serving stopped to time the forward")

    decoder.runner.time_widths = no_probe  # type: ignore[method-assign]
    try:
        torch.set_num_threads(threads + 1)
        decoder.generate(repetitive_prompt(), SamplingParams(max_tokens=8))
    finally:
        torch.set_num_threads(threads)
    second = decoder.costs[(kernel, threads + 1)]
    assert second is not first and second.prior == first.prior and second.predicted == {}
    assert second.seconds and not first.seconds  # the new team's steps refine its own curve
    decoder.on_threads_changed(threads)
    assert decoder.cost is first


def test_a_step_notices_a_change_of_torch_threads(tiny_model, byte_tokenizer) -> None:
    decoder = LookaheadDecoder(tiny_model("llama"), byte_tokenizer, NGramTrie(1000, 8))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        decoder.generate([1, 2, 3], SamplingParams(max_tokens=2))
        assert decoder.cost_key[1] == threads + 1 and set(decoder.costs) == {("stock", threads + 1)}
    finally:
        torch.set_num_threads(threads)


def test_a_step_the_core_budget_resizes_is_credited_to_the_team_that_ran_it(
    tiny_model, byte_tokenizer
) -> None:
    """The budget resizes the team before the step picks its curve, so a one-thread forward never
    lands on the two-thread curve."""
    decoder = LookaheadDecoder(tiny_model("llama"), byte_tokenizer, NGramTrie(1000, 8))
    threads = torch.get_num_threads()

    class Shrinking:
        def apply(self) -> int:
            torch.set_num_threads(threads + 1)
            return threads + 1

    try:
        decoder.runner.core_budget = Shrinking()
        decoder.generate([1, 2, 3], SamplingParams(max_tokens=2))
        assert set(decoder.costs) == {("stock", threads + 1)}
        assert decoder.costs[("stock", threads + 1)].seconds
    finally:
        torch.set_num_threads(threads)


def test_the_table_shows_the_prediction_beside_the_steps_measured(tiny_model, byte_tokenizer) -> None:
    decoder = LookaheadDecoder(tiny_model("llama"), byte_tokenizer, NGramTrie(1000, 8))
    cost = decoder.measure_cost(budget_s=0.1)
    assert all(measured is None for _, _, measured in cost.table())
    decoder.generate(repetitive_prompt(), SamplingParams(max_tokens=16))
    rows = {q: (predicted, measured) for q, predicted, measured in cost.table()}
    assert rows[1][0] == cost.predicted[1]
    assert any(measured is not None for _, measured in rows.values())


def test_a_steps_parts_add_up_and_count_what_it_fed(tiny_model, byte_tokenizer) -> None:
    decoder = LookaheadDecoder(tiny_model("llama"), byte_tokenizer, NGramTrie(1000, 8), LookaheadConfig())
    gens = [decoder.start(repetitive_prompt(), SamplingParams(max_tokens=8)) for _ in range(2)]
    decoder.step(gens)  # the prompts
    started = time.perf_counter()
    outputs = decoder.step(gens)
    wall = time.perf_counter() - started
    times = decoder.last_step
    assert all(output.token_ids for output in outputs)
    assert times.requests == 2 and times.tokens >= 2
    assert times.forward > 0 and times.commit > 0 and times.verify > 0
    assert set(times.parts()) == set(DECODER_PARTS)
    assert times.total <= wall
