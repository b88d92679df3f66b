"""The vLLM backend's metric families (`vllm:*`), beside our own `lookahead_*` ones.

Same names, labels (model, version) and bucket boundaries as triton-inference-server/vllm_backend
exports, so a dashboard built for it reads this server unchanged; plus vLLM's speculative-decoding
counters, fed by the lookahead drafts. Latencies are observed per engine step, the rest when a
request ends; everything a request adds is applied before its final response is sent (the
response thread flushes the instance's MetricWriter first), so a scrape right after it sees it.
"""

from __future__ import annotations

from collections.abc import Mapping

import triton_python_backend_utils as pb_utils

from .engine import TokenArrival, Update
from .metrics import MetricWriter, Op, RequestRecord

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
N_BUCKETS = [1, 2, 5, 10, 20]

COUNTERS = {
    "prompt_tokens": ("vllm:prompt_tokens_total", "Number of prefill tokens processed."),
    "generation_tokens": ("vllm:generation_tokens_total", "Number of generation tokens processed."),
    "drafts": ("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts."),
    "draft_tokens": ("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens."),
    "accepted_tokens": ("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens."),
}
HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    "tpot": ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds."),
    "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds."),
    "request_prompt_tokens": ("vllm:request_prompt_tokens", "Number of prefill tokens processed."),
    "request_generation_tokens": ("vllm:request_generation_tokens", "Number of generation tokens processed."),
    "request_params_n": ("vllm:request_params_n", "Histogram of the n request parameter."),
}


def buckets_1_2_5(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's bounds for token counts)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def step_observations(arrivals: list[TokenArrival], now: float) -> list[tuple[str, float]]:
    """What one engine step adds, as vLLM records it per step: a request's first tokens observe
    its time to first token, every later token its time per output token.

    The tokens of one lookahead step arrive together: each observes the step's time since the
    request's previous tokens divided among them (those that came with the first token, 0).
    """
    observed: list[tuple[str, float]] = []
    for state, count, previous in arrivals:
        if previous is None:
            observed.append(("ttft", now - state.arrival))
            observed += [("tpot", 0.0)] * (count - 1)
        else:
            observed += [("tpot", (now - previous) / count)] * count
    return observed


def final_observations(update: Update) -> tuple[dict[str, int], list[tuple[str, float]]]:
    """What a request's final update adds: counter increments, and histogram observations."""
    record, stats = RequestRecord.of(update), update.stats
    if record is None or stats is None:
        return {}, []
    counters = {
        "prompt_tokens": record.prompt_tokens,
        "generation_tokens": record.generation_tokens,
        "drafts": stats.drafts,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_draft_tokens,
    }
    request = update.state.request
    observed: list[tuple[str, float]] = [("request_params_n", request.sampling.n if request else 1)]
    if record.e2e_latency_s is None:  # failed or cancelled: vLLM counts finished requests only
        return counters, observed
    observed += [
        ("e2e", record.e2e_latency_s),
        ("request_prompt_tokens", record.prompt_tokens),
        ("request_generation_tokens", record.generation_tokens),
    ]
    return counters, observed


class VllmMetrics:
    """The vllm:* families of one model instance; their calls go through the writer."""

    def __init__(self, labels: Mapping[str, str], max_model_len: int, writer: MetricWriter):
        self.writer = writer
        buckets = {
            "ttft": TTFT_BUCKETS,
            "tpot": TPOT_BUCKETS,
            "e2e": E2E_BUCKETS,
            "request_prompt_tokens": buckets_1_2_5(max_model_len),
            "request_generation_tokens": buckets_1_2_5(max_model_len),
            "request_params_n": N_BUCKETS,
        }
        self.families: list[pb_utils.MetricFamily] = []
        self.metrics: dict[str, pb_utils.Metric] = {}
        for kind, specs in (("COUNTER", COUNTERS), ("HISTOGRAM", HISTOGRAMS)):
            for key, (name, description) in specs.items():
                family = pb_utils.MetricFamily(
                    name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind)
                )
                self.families.append(family)
                extra = {"buckets": buckets[key]} if key in buckets else {}
                self.metrics[key] = family.Metric(labels=dict(labels), **extra)

    @classmethod
    def create(
        cls, labels: Mapping[str, str], max_model_len: int, writer: MetricWriter
    ) -> VllmMetrics | None:
        """The metrics, or None when the server runs with --allow-metrics=false."""
        try:
            return cls(labels, max_model_len, writer)
        except pb_utils.TritonModelException as error:
            if "metrics not supported" not in str(error).lower():
                raise
            return None

    def step(self, arrivals: list[TokenArrival], now: float) -> None:
        """Queue what an engine step adds (called from the engine thread; never blocks)."""
        self.writer.put(
            [(self.metrics[key], "observe", value) for key, value in step_observations(arrivals, now)]
        )

    def request_finished(self, update: Update) -> None:
        """Queue what a request's final update adds (called from the response thread; never blocks)."""
        counters, observed = final_observations(update)
        ops: list[Op] = [(self.metrics[key], "increment", value) for key, value in counters.items()]
        ops += [(self.metrics[key], "observe", value) for key, value in observed]
        self.writer.put(ops)

    def close(self) -> None:
        """Drop the metrics before their families (after the writer applied what was queued)."""
        self.metrics.clear()
        self.families.clear()
