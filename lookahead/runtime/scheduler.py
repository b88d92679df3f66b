"""Which requests run, and what each feeds in a step (no model, no torch).

`Scheduler` is the one place that decides: `add` queues a validated request, `schedule` says which
waiting ones start now (arrival order, at most max_running, only as many as the KV bound holds) and
which are refused (waited too long, or beyond max_queued), `finish` takes one out; `plan` is a
step's plan for the running ones (`schedule_step`). The engine thread only drives it.

A step's plan: each request's segment within the step's token budget.

Running requests' roots come first; then, first come first served, prompts that fit whole (their
last token becomes a root); then the drafts of every root, node by node where they pay
(planner.plan_step; none is retrieved where no node can pay), next to at most one partial
prompt chunk, which gets what is left (and at least an eighth of the budget, so a prompt always
advances). With no running request to stall, the first prompt is read in chunks of up to
LONE_PROMPT_CHUNK tokens, its last one with its first draft: a forward stays short enough that
the next one can be sized to the cores free by then (core_budget.py) and that a request arriving
meanwhile waits at most one chunk. The decoder (decoder.py) turns the plan into one forward.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from ..algorithm.draft import Draft
from ..algorithm.planner import AcceptanceEstimate, CostModel, least_paying_weight, plan_step
from ..config import LookaheadConfig

# While a prompt is being read, drafts may take at most this share of what the running
# requests' roots leave of the step's budget; the prompt's chunk gets the rest.
DRAFT_SHARE_BESIDE_PROMPT = 0.5
# Most tokens of a prompt read while no running request waits on the step (its draft included).
LONE_PROMPT_CHUNK = 512


class Schedulable(Protocol):
    """What the scheduler reads of a request (runtime.generation.Generation is one)."""

    ids: list[int]  # the prompt, then every committed token
    fed: int | None  # prompt entries the KV pool holds
    config: LookaheadConfig
    acceptance: AcceptanceEstimate

    @property
    def root(self) -> int: ...

    @property
    def prefilled(self) -> bool: ...

    @property
    def scoring_prompt(self) -> bool: ...

    def retrieve(self, max_width: int, min_prob: float = 0.0) -> Draft: ...


R = TypeVar("R", bound=Schedulable)


@dataclass
class Scheduled(Generic[R]):
    """One request's part of a step: the prompt tokens it feeds after its `start` held entries,
    then its draft (a root and the nodes kept for it; None for a chunk that is not its prompt's last)."""

    request: R
    start: int
    chunk: list[int]
    draft: Draft | None
    scoring: bool = False  # its prompt chunk's logits are scored (prompt logprobs)


@dataclass
class StepPlan(Generic[R]):
    scheduled: list[Scheduled[R]] = field(default_factory=list)
    failed: list[tuple[R, Exception]] = field(default_factory=list)  # requests whose retrieval raised
    draft_seconds: float = 0.0  # spent in the requests' retrieval


class Queued(Protocol):
    """What the scheduler reads of a waiting request (backend.engine.RequestState is one)."""

    arrival: float  # time.monotonic() when it arrived
    cancelled: bool

    @property
    def longest(self) -> list[int]:
        """The most KV entries each of its generations can hold."""
        ...


Q = TypeVar("Q", bound=Queued)


@dataclass
class Admission(Generic[Q]):
    """What `Scheduler.schedule` decided: requests to start now, and those that leave the queue
    without starting."""

    started: list[Q] = field(default_factory=list)
    cancelled: list[Q] = field(default_factory=list)
    timed_out: list[tuple[Q, float]] = field(default_factory=list)  # with the seconds they waited
    overflow: list[tuple[Q, int]] = field(default_factory=list)  # with the count still waiting


class Scheduler(Generic[Q]):
    """Admission and budgets of one decoder: the waiting requests, the running ones, each step's
    plan. fits(longest): whether requests holding at most these many KV entries each fit in the
    KV bound (`LookaheadDecoder.fits`); max_queued 0 and queue_timeout_s 0: no bound."""

    def __init__(
        self,
        fits: Callable[[Sequence[int]], bool],
        *,
        step_token_budget: int,
        max_speculative_batch: int = 0,
        max_running: int = 1 << 30,
        max_queued: int = 0,
        queue_timeout_s: float = 0.0,
    ):
        self.fits = fits
        self.step_token_budget = step_token_budget
        self.max_speculative_batch = max_speculative_batch
        self.limit(max_running, max_queued, queue_timeout_s)
        self.waiting: deque[Q] = deque()
        self.running: list[Q] = []

    def limit(self, max_running: int, max_queued: int = 0, queue_timeout_s: float = 0.0) -> None:
        """The request limits (the backend's max_running_requests, max_queued_requests,
        queue_timeout_s)."""
        if max_running < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running}")
        self.max_running, self.max_queued, self.queue_timeout_s = max_running, max_queued, queue_timeout_s

    def add(self, request: Q) -> None:
        """Queue a validated request behind the others."""
        self.waiting.append(request)

    def schedule(self, now: float | None = None) -> Admission[Q]:
        """Start waiting requests in arrival order while the running ones leave room for them (the
        first one whatever it holds when none runs); drop the cancelled ones, those waiting longer
        than queue_timeout_s and the newest beyond max_queued. The started ones count as running."""
        admission: Admission[Q] = Admission()
        admission.cancelled = [request for request in self.waiting if request.cancelled]
        for request in admission.cancelled:
            self.waiting.remove(request)
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting[0]
            held = [longest for running in self.running for longest in running.longest]
            if self.running and not self.fits([*held, *request.longest]):
                break  # it waits, and so do the ones behind it
            self.running.append(self.waiting.popleft())
            admission.started.append(request)
        if self.queue_timeout_s > 0:
            now = time.monotonic() if now is None else now
            for request in [r for r in self.waiting if now - r.arrival > self.queue_timeout_s]:
                self.waiting.remove(request)
                admission.timed_out.append((request, now - request.arrival))
        while self.max_queued and len(self.waiting) > self.max_queued:
            request = self.waiting.pop()  # the newest: the others keep their place
            admission.overflow.append((request, len(self.waiting)))
        return admission

    def finish(self, request: Q) -> None:
        """Take a request out, running or waiting."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def plan(self, requests: Sequence[R], cost: CostModel) -> StepPlan[R]:
        """One step's plan for these admitted generations (schedule_step), within the budgets."""
        return schedule_step(requests, self.step_token_budget, cost, self.max_speculative_batch)


def schedule_step(
    requests: Sequence[R], budget: int, cost: CostModel, max_speculative_batch: int = 0
) -> StepPlan[R]:
    """Each request's segment of one step, within `budget` tokens, in the requests' order.

    A request whose retrieval raises is left out and reported in `failed` (it fails alone); a
    request the budget leaves no room for (a prompt behind another one's chunk) is left out.
    """
    plan: StepPlan[R] = StepPlan()
    rooted = [request for request in requests if request.prefilled]
    free = budget - len(rooted)
    if not rooted and requests:  # no stream waits on this step: the first prompt goes in big chunks
        first = requests[0]
        free = max(free, min(first.root - _fed(first) + budget, LONE_PROMPT_CHUNK))
    partial = None
    for request in requests:
        if request.prefilled:
            continue
        need = request.root - _fed(request) + 1
        if partial is None and need <= free:
            rooted.append(request)
            free -= need
        elif partial is None:
            partial = request
    chunks = sum(request.root - _fed(request) for request in rooted if not request.prefilled)
    capped = max_speculative_batch and len(requests) > max_speculative_batch
    room = max(0, free if partial is None else int(free * DRAFT_SHARE_BESIDE_PROMPT))
    drafts = []
    for request in list(rooted):
        draft = Draft.root_only(request.ids[-1])
        # Retrieval skips nodes too unlikely to pay their way in this step (most of them, when
        # many requests already share the forward, or this one reads a long context).
        least = least_paying_weight(cost, len(rooted), len(rooted) + chunks, len(request.ids) - 1)
        # Where no node can pay (least >= 1: a compute-bound step of many requests), an adaptive
        # request declines to draft, and its retrieval is not paid for either.
        declined = request.config.adaptive and least >= 1.0
        if not capped and room and not declined:
            started = time.perf_counter()
            try:
                draft = request.retrieve(room + 1, least if request.config.adaptive else 0.0)
            except Exception as error:  # this request fails; the others go on
                plan.failed.append((request, error))
                rooted.remove(request)
                continue
            finally:
                plan.draft_seconds += time.perf_counter() - started
        drafts.append(draft)
    drafts = plan_step(
        drafts,
        [request.acceptance for request in rooted],
        [request.config.adaptive for request in rooted],
        cost,
        len(rooted) + chunks + room,
        other_tokens=chunks,
        starts=[len(request.ids) - 1 for request in rooted],  # the entries before each root
        other_entries=0 if partial is None else _fed(partial),
    )
    for request, draft in zip(rooted, drafts):
        fed = _fed(request)
        chunk = [] if request.prefilled else request.ids[fed : request.root]
        start = len(request.ids) - 1 if request.prefilled else fed
        plan.scheduled.append(Scheduled(request, start, chunk, draft, request.scoring_prompt and bool(chunk)))
    if partial is not None:
        drafted = sum(len(draft) - 1 for draft in drafts)
        size = max(free - drafted, budget // 8, 1)
        fed = _fed(partial)
        chunk = partial.ids[fed : min(partial.root, fed + size)]
        plan.scheduled.append(Scheduled(partial, fed, chunk, None, partial.scoring_prompt))
    return plan


def _fed(request: Schedulable) -> int:
    """Prompt entries held by an admitted request (the decoder admits every request it schedules)."""
    if request.fed is None:
        raise ValueError("schedule_step() needs admitted requests (fed is None)")
    return request.fed
