"""What one step feeds: each request's segment within the step's token budget (no model, no torch).

Running requests' roots come first; then, first come first served, prompts that fit whole (their
last token becomes a root); then the drafts of every root, node by node where they pay
(planner.plan_step; none is retrieved where no node can pay), next to at most one partial
prompt chunk, which gets what is left (and at least an eighth of the budget, so a prompt always
advances). With no running request to stall,
the first prompt is read whole. The decoder (decoder.py) turns the plan into one forward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from ..algorithm.draft import Draft
from ..algorithm.planner import AcceptanceEstimate, CostModel, least_paying_weight, plan_step
from ..config import LookaheadConfig

# While a prompt is being read, drafts may take at most this share of what the running
# requests' roots leave of the step's budget; the prompt's chunk gets the rest.
DRAFT_SHARE_BESIDE_PROMPT = 0.5


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


def schedule(
    requests: Sequence[R], budget: int, cost: CostModel, max_speculative_batch: int = 0
) -> StepPlan[R]:
    """Each request's segment of one step, within `budget` tokens, in the requests' order.

    A request whose retrieval raises is left out and reported in `failed` (it fails alone); a
    request the budget leaves no room for (a prompt behind another one's chunk) is left out.
    """
    plan: StepPlan[R] = StepPlan()
    rooted = [request for request in requests if request.prefilled]
    free = budget - len(rooted)
    if not rooted and requests:  # no stream waits on this step: the first prompt goes whole
        first = requests[0]
        free = max(free, first.root - _fed(first) + budget)
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
    # Retrieval skips nodes too unlikely to pay their way in this step (most of them, when
    # many requests already share the forward).
    least = least_paying_weight(cost, len(rooted), len(rooted) + chunks)
    drafts = []
    for request in list(rooted):
        draft = Draft.root_only(request.ids[-1])
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
        raise ValueError("schedule() needs admitted requests (fed is None)")
    return request.fed
