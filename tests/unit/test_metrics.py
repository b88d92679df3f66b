"""The metrics path: one writer thread batches the calls into Triton's metric API, and the vllm:*
observations of a request add up to what vLLM's own backend records for it.

pb_utils exists only inside Triton's stub; a stand-in records the metric calls.
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
from typing import Any

import pytest

from backend.engine import FailureCode, RequestState, TokenArrival, Update
from backend.request import GenerationRequest
from lookahead.config import LookaheadConfig, SamplingParams
from lookahead.runtime.generation import GenerationStats


class Metric:
    """Records its calls; `gate`, when set, holds every call until it opens."""

    def __init__(self, gate: threading.Event | None = None):
        self.calls: list[tuple[str, float]] = []
        self.gate, self.entered = gate, threading.Event()

    def _call(self, operation: str, value: float) -> None:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(5)
        self.calls.append((operation, value))

    def increment(self, value: float) -> None:
        self._call("increment", value)

    def set(self, value: float) -> None:
        self._call("set", value)

    def observe(self, value: float) -> None:
        self._call("observe", value)


class Log:
    def __init__(self):
        self.errors: list[str] = []

    def log_error(self, message: str) -> None:
        self.errors.append(message)

    log_info = log_warn = log_error


@pytest.fixture
def modules(monkeypatch: pytest.MonkeyPatch) -> Any:
    stand_in = types.ModuleType("triton_python_backend_utils")
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stand_in)
    for name in ("backend.metrics", "backend.vllm_metrics"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return types.SimpleNamespace(
        metrics=importlib.import_module("backend.metrics"),
        vllm=importlib.import_module("backend.vllm_metrics"),
    )


def test_the_writer_applies_a_batch_with_one_call_per_counter_and_gauge(modules):
    gate = threading.Event()
    blocker, counter, gauge, histogram = Metric(gate), Metric(), Metric(), Metric()
    writer = modules.metrics.MetricWriter(Log())
    writer.put([(blocker, "increment", 1)])  # holds the thread while the batch below is queued
    assert blocker.entered.wait(5)
    writer.put([(counter, "increment", 2), (gauge, "set", 5), (histogram, "observe", 0.5)])
    writer.put([(counter, "increment", 3), (gauge, "set", 7), (histogram, "observe", 0.25)])
    writer.put([(counter, "increment", 0)])
    gate.set()
    assert writer.flush(5)
    assert counter.calls == [("increment", 5)]
    assert gauge.calls == [("set", 7)]
    assert histogram.calls == [("observe", 0.5), ("observe", 0.25)]
    writer.close()


def test_flush_returns_only_once_what_was_queued_before_it_is_applied(modules):
    gate = threading.Event()
    slow = Metric(gate)
    writer = modules.metrics.MetricWriter(Log())
    writer.put([(slow, "observe", 1.0)])
    assert not writer.flush(0.2)
    gate.set()
    assert writer.flush(5) and slow.calls == [("observe", 1.0)]
    writer.close()


def test_a_failing_metric_call_is_logged_and_the_writer_goes_on(modules):
    class Broken(Metric):
        def increment(self, value: float) -> None:
            raise RuntimeError("stub gone")

    log, healthy = Log(), Metric()
    writer = modules.metrics.MetricWriter(log)
    writer.put([(Broken(), "increment", 1)])
    assert writer.flush(5)
    writer.put([(healthy, "observe", 2.0)])
    assert writer.flush(5) and healthy.calls == [("observe", 2.0)]
    assert any("stub gone" in error for error in log.errors)
    writer.close()


def test_step_observations_give_one_time_to_first_token_and_one_time_per_later_token(modules):
    a = RequestState(id="a", sender=None, arrival=10.0)
    b = RequestState(id="b", sender=None, arrival=10.5)
    first = modules.vllm.step_observations([TokenArrival(a, 2, None)], now=11.0)
    assert first == [("ttft", 1.0), ("tpot", 0.0)]  # its second token came with the first
    later = modules.vllm.step_observations([TokenArrival(a, 3, 11.0), TokenArrival(b, 1, None)], now=11.6)
    assert later == [("tpot", pytest.approx(0.2))] * 3 + [("ttft", pytest.approx(1.1))]
    tokens = 2 + 3
    assert sum(key == "tpot" for key, _ in first + later) == tokens - 1


def test_a_cancelled_request_adds_its_counters_and_n_but_no_finished_request_latencies(modules):
    state = RequestState(id="a", sender=None, arrival=0.0)
    state.first_output_time, state.finish_time = 1.0, 2.0
    stats = GenerationStats(
        prompt_tokens=7, output_tokens=3, drafts=2, draft_tokens=5, accepted_draft_tokens=1
    )
    cancelled = Update(state, final=True, stats=stats, failure=FailureCode.CANCELLED)
    counters, observed = modules.vllm.final_observations(cancelled)
    assert counters == {
        "prompt_tokens": 7,
        "generation_tokens": 3,
        "drafts": 2,
        "draft_tokens": 5,
        "accepted_tokens": 1,
    }
    assert observed == [("request_params_n", 1)]
    finished = Update(state, final=True, stats=stats, finish_reason="length")
    _, observed = modules.vllm.final_observations(finished)
    assert observed == [
        ("request_params_n", 1),
        ("e2e", 2.0),
        ("request_prompt_tokens", 7),
        ("request_generation_tokens", 3),
    ]


def test_request_params_n_observes_the_requests_n(modules):
    state = RequestState(id="a", sender=None, arrival=0.0)
    sampling = SamplingParams(temperature=1.0, n=3)
    state.request = GenerationRequest("x", (1,), sampling, LookaheadConfig())
    state.first_output_time, state.finish_time = 1.0, 2.0
    update = Update(state, final=True, stats=GenerationStats(prompt_tokens=1, output_tokens=6))
    _, observed = modules.vllm.final_observations(update)
    assert observed[0] == ("request_params_n", 3)
