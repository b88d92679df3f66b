"""Custom Prometheus metrics, shown on the server's metrics port next to nv_inference_*.

Names mirror the vLLM backend's families under a `lookahead_` prefix, plus what speculation
adds: draft tokens fed and accepted, and the global trie's size. Every metric call is an IPC
round trip to the server, so the engine and response threads only queue them: one MetricWriter
thread per instance applies them, for these families and the vllm:* ones (backend/vllm_metrics.py).
"""

from __future__ import annotations

import os
import queue
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import triton_python_backend_utils as pb_utils

from lookahead.runtime.step_timing import DECODER_PARTS

from .engine import EngineStepTimes, Log, Update

# Upper bounds in seconds; a CPU instance answers slower than vLLM's GPU-sized buckets assume.
TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
TPOT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0, 600.0]

# key -> (family name, description, MetricFamily kind, histogram buckets)
FAMILIES: dict[str, tuple[str, str, str, list[float] | None]] = {
    "ttft": (
        "lookahead_time_to_first_token_seconds",
        "Time to first token in seconds.",
        "HISTOGRAM",
        TTFT_BUCKETS,
    ),
    "tpot": (
        "lookahead_time_per_output_token_seconds",
        "Mean time per output token after the first, per request, in seconds.",
        "HISTOGRAM",
        TPOT_BUCKETS,
    ),
    "e2e": (
        "lookahead_e2e_request_latency_seconds",
        "End-to-end latency of finished requests in seconds.",
        "HISTOGRAM",
        E2E_BUCKETS,
    ),
    "prompt_tokens": ("lookahead_prompt_tokens_total", "Prompt tokens processed.", "COUNTER", None),
    "cached_prompt_tokens": (
        "lookahead_cached_prompt_tokens_total",
        "Prompt tokens whose KV came from the prefix cache instead of a prefill.",
        "COUNTER",
        None,
    ),
    "generation_tokens": ("lookahead_generation_tokens_total", "Tokens generated.", "COUNTER", None),
    "draft_tokens": (
        "lookahead_draft_tokens_total",
        "Draft tokens fed to the model for verification.",
        "COUNTER",
        None,
    ),
    "accepted_draft_tokens": (
        "lookahead_accepted_draft_tokens_total",
        "Draft tokens the model accepted.",
        "COUNTER",
        None,
    ),
    "trie_nodes": ("lookahead_trie_nodes", "Nodes in the instance's global n-gram trie.", "GAUGE", None),
    "trie_bytes": ("lookahead_trie_bytes", "Estimated bytes held by the global n-gram trie.", "GAUGE", None),
    "sync_published": (
        "lookahead_trie_sync_published_total",
        "Entries this instance published to the fleet's trie stream (trie_sync).",
        "COUNTER",
        None,
    ),
    "sync_received": (
        "lookahead_trie_sync_received_total",
        "Other instances' entries inserted into the global trie.",
        "COUNTER",
        None,
    ),
    "sync_rejected": (
        "lookahead_trie_sync_rejected_total",
        "Stream entries refused (bad format version, ids or size).",
        "COUNTER",
        None,
    ),
    "sync_reconnects": (
        "lookahead_trie_sync_reconnects_total",
        "Reconnections to Redis after it failed.",
        "COUNTER",
        None,
    ),
    "restarts": (
        "lookahead_model_restarts_total",
        "Restarts of the model by the launcher after one of its backend stubs died, since it started.",
        "COUNTER",
        None,
    ),
}

# Where steps' wall time goes: one series per part (label `part`) of one family, the engine
# thread's parts after the decoder's (backend/engine.py, EngineStepTimes); they add up to the
# steps' wall time. `send` is the response thread's, beside the steps (bench/step_profile.py).
STEP_PARTS = (*DECODER_PARTS, "admit", "respond", "keeper", "wait")
STEP_FAMILIES: dict[str, tuple[str, str]] = {
    "seconds": ("lookahead_step_seconds_total", "Seconds engine steps spent, by part."),
    "steps": ("lookahead_steps_total", "Engine steps that ran a forward."),
    "requests": ("lookahead_step_requests_total", "Requests fed, summed over steps."),
    "tokens": ("lookahead_step_tokens_total", "Tokens fed, summed over steps."),
    "send": (
        "lookahead_response_send_seconds_total",
        "Seconds the response thread spent building and sending responses through Triton.",
    ),
}
# The planner's cost curve: seconds of a step feeding `width` tokens, its cache reads taken out, as
# measured at load (source="predicted") and as the latest steps took (source="measured").
COST_FAMILY = (
    "lookahead_step_cost_seconds",
    "Seconds of a step by tokens fed, its cache reads taken out: measured at load and by the latest steps.",
)
COST_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)

# How long the response thread waits for a request's metrics before sending its final response anyway.
FLUSH_TIMEOUT_S = 2.0

Operation = Literal["increment", "set", "observe"]
Op = tuple[Any, Operation, float]  # (pb_utils.Metric, operation, value)


class MetricWriter:
    """The one thread of an instance that calls Triton's metric API.

    It applies what is queued in batches: a batch's increments of one counter become one call,
    its sets of one gauge the last one, and each histogram observation stays one call (the API
    has no other). flush() waits until everything queued before it is visible on the metrics
    port, so a request's final response can follow its metrics.
    """

    def __init__(self, log: Log):
        self.log = log
        self.queue: queue.SimpleQueue[list[Op] | threading.Event | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="lookahead-metrics", daemon=True)
        self.thread.start()

    def put(self, ops: list[Op]) -> None:
        """Queue metric calls; never blocks."""
        if ops:
            self.queue.put(ops)

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until every call queued so far has been applied; False if that took over timeout_s."""
        applied = threading.Event()
        self.queue.put(applied)
        return applied.wait(timeout_s)

    def close(self) -> None:
        """Apply what is queued and end the thread."""
        self.queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        running = True
        while running:
            batch, flushed = [], []
            item = self.queue.get()
            while True:
                if item is None:
                    running = False
                elif isinstance(item, threading.Event):
                    flushed.append(item)
                else:
                    batch.extend(item)
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
            try:
                self._apply(batch)
            except Exception:  # a failed metric update must never affect serving
                self.log.log_error(f"Metric update failed: {traceback.format_exc()}")
            for event in flushed:
                event.set()

    @staticmethod
    def _apply(batch: list[Op]) -> None:
        increments: dict[int, tuple[Any, float]] = {}
        sets: dict[int, tuple[Any, float]] = {}
        for metric, operation, value in batch:
            if operation == "observe":
                metric.observe(value)
            elif operation == "increment":
                total = increments.get(id(metric), (metric, 0))[1]
                increments[id(metric)] = (metric, total + value)
            else:
                sets[id(metric)] = (metric, value)
        for metric, value in increments.values():
            if value:
                metric.increment(value)
        for metric, value in sets.values():
            metric.set(value)


def instance_labels(model: str, version: str, instance: str) -> dict[str, str]:
    """Labels that no other live instance shares.

    Triton keeps one Prometheus series per family and label set, shared by every MetricFamily
    of that name, and frees it when the first owner deletes its Metric. During a reload the new
    instance starts before the old one finalizes, so with shared labels the old instance's
    cleanup frees the series the new one keeps writing to (a use-after-free in
    Metric::Observe). Two live processes never share a pid, so no series has two owners.
    """
    return {"model": model, "version": version, "instance": instance, "pid": str(os.getpid())}


_COUNTERS = tuple(
    key
    for key, (_, _, kind, _) in FAMILIES.items()
    if kind == "COUNTER" and not key.startswith("sync_") and key != "restarts"
)  # a request's counters; the sync thread and the instance's start count the others


@dataclass(frozen=True)
class RequestRecord:
    """What one request contributes; latencies are None unless it finished normally."""

    prompt_tokens: int
    generation_tokens: int
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    cached_prompt_tokens: int = 0
    time_to_first_token_s: float | None = None
    time_per_output_token_s: float | None = None
    e2e_latency_s: float | None = None

    @classmethod
    def of(cls, update: Update) -> RequestRecord | None:
        """The record of a request's final update; None for one that never started generating."""
        state, stats = update.state, update.stats
        if stats is None:
            return None
        record = cls(
            stats.prompt_tokens,
            stats.output_tokens,
            stats.draft_tokens,
            stats.accepted_draft_tokens,
            stats.cached_prompt_tokens,
        )
        if update.failure is not None or state.first_output_time is None:
            return record
        later_tokens = stats.output_tokens - 1
        decode_time = state.finish_time - state.first_output_time
        return replace(
            record,
            time_to_first_token_s=state.first_output_time - state.arrival,
            time_per_output_token_s=decode_time / later_tokens if later_tokens > 0 else None,
            e2e_latency_s=state.finish_time - state.arrival,
        )


class LookaheadMetrics:
    """The lookahead_* metric families of one model instance; their calls go through the writer."""

    def __init__(self, labels: Mapping[str, str], writer: MetricWriter):
        self.writer = writer
        self.families: dict[str, pb_utils.MetricFamily] = {}
        self.metrics: dict[str, pb_utils.Metric] = {}
        for key, (name, description, kind, buckets) in FAMILIES.items():
            family = pb_utils.MetricFamily(
                name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind)
            )
            self.families[key] = family
            extra = {"buckets": buckets} if buckets else {}
            self.metrics[key] = family.Metric(labels=dict(labels), **extra)
        self.step_metrics: dict[str, Any] = {}
        for key, (name, description) in STEP_FAMILIES.items():
            family = pb_utils.MetricFamily(
                name=name, description=description, kind=pb_utils.MetricFamily.COUNTER
            )
            self.families[key] = family
            if key == "seconds":
                for part in STEP_PARTS:
                    self.step_metrics[part] = family.Metric(labels={**labels, "part": part})
            else:
                self.step_metrics[key] = family.Metric(labels=dict(labels))
        cost = pb_utils.MetricFamily(
            name=COST_FAMILY[0], description=COST_FAMILY[1], kind=pb_utils.MetricFamily.GAUGE
        )
        self.families["cost"] = cost
        self.cost_metrics = {
            (width, source): cost.Metric(labels={**labels, "width": str(width), "source": source})
            for width in COST_WIDTHS
            for source in ("predicted", "measured")
        }

    @classmethod
    def create(cls, labels: Mapping[str, str], writer: MetricWriter, log: Log) -> LookaheadMetrics | None:
        """The metrics, or None when the server runs with --allow-metrics=false."""
        try:
            return cls(labels, writer)
        except pb_utils.TritonModelException as error:
            if "metrics not supported" not in str(error).lower():
                raise
            log.log_info("Custom metrics are not supported by this server (--allow-metrics=false)")
            return None

    def request_finished(self, update: Update) -> None:
        """Queue what a request's final update adds (called from the response thread; never blocks)."""
        record = RequestRecord.of(update)
        if record is None:
            return
        ops: list[Op] = [(self.metrics[key], "increment", getattr(record, key)) for key in _COUNTERS]
        for key, value in (
            ("ttft", record.time_to_first_token_s),
            ("tpot", record.time_per_output_token_s),
            ("e2e", record.e2e_latency_s),
        ):
            if value is not None:
                ops.append((self.metrics[key], "observe", value))
        self.writer.put(ops)

    def trie_size(self, nodes: int, byte_estimate: int) -> None:
        self.writer.put(
            [(self.metrics["trie_nodes"], "set", nodes), (self.metrics["trie_bytes"], "set", byte_estimate)]
        )

    def trie_sync_counted(self, kind: str, count: int) -> None:
        """Count sync events (called from the sync thread; never blocks): kind is one of sync.COUNTS."""
        self.writer.put([(self.metrics[f"sync_{kind}"], "increment", count)])

    def restarts(self, count: int) -> None:
        """The launcher's restarts of this model so far (backend/drain.py): set once, at the start."""
        self.writer.put([(self.metrics["restarts"], "increment", count)])

    def step_timed(self, times: EngineStepTimes) -> None:
        """Count where a step's time went (engine thread; never blocks)."""
        metrics = self.step_metrics
        ops: list[Op] = [(metrics[part], "increment", seconds) for part, seconds in times.parts().items()]
        ops += [
            (metrics["steps"], "increment", 1),
            (metrics["requests"], "increment", times.decoder.requests),
            (metrics["tokens"], "increment", times.decoder.tokens),
        ]
        self.writer.put(ops)

    def response_sent(self, seconds: float) -> None:
        """Count the response thread's time on one response (never blocks)."""
        self.writer.put([(self.step_metrics["send"], "increment", seconds)])

    def step_cost(self, rows: list[tuple[int, float | None, float | None]]) -> None:
        """The cost curve's (width, predicted, measured) rows, as gauges (never blocks)."""
        ops: list[Op] = []
        for width, predicted, measured in rows:
            for source, value in (("predicted", predicted), ("measured", measured)):
                metric = self.cost_metrics.get((width, source))
                if metric is not None and value is not None:
                    ops.append((metric, "set", value))
        self.writer.put(ops)

    def close(self) -> None:
        """Drop the metrics before their families (after the writer applied what was queued)."""
        self.step_metrics.clear()
        self.cost_metrics.clear()
        self.metrics.clear()
        self.families.clear()
