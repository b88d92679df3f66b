"""The step scheduler alone: the token budget, chunked prefill, and which requests get drafts."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lookahead.algorithm.draft import Draft
from lookahead.algorithm.planner import Calibration, CostModel
from lookahead.config import LookaheadConfig
from lookahead.runtime.scheduler import DRAFT_SHARE_BESIDE_PROMPT, LONE_PROMPT_CHUNK, Scheduler
from lookahead.runtime.scheduler import schedule_step as schedule

ROOT = Path(__file__).resolve().parents[3]
POINTS = [2**i for i in range(8)]  # 1 .. 128 tokens fed
FLAT = {q: 1.0 for q in POINTS}  # every width costs one forward: every likely node pays


@dataclass(eq=False)
class Request:
    """A request as the scheduler sees it, drafting a chain of `offer` certain tokens."""

    ids: list[int]
    fed: int | None
    prompt_len: int
    offer: int = 0
    config: LookaheadConfig = LookaheadConfig()
    acceptance: Calibration = field(default_factory=lambda: Calibration.uniform(1.0))
    fails: bool = False
    asked: list[int] = field(default_factory=list)  # max_width of every retrieve

    @property
    def root(self) -> int:
        return self.prompt_len - 1

    @property
    def prefilled(self) -> bool:
        return self.fed is not None and self.fed >= self.root

    @property
    def scoring_prompt(self) -> bool:
        return False

    def retrieve(self, max_width: int, min_prob: float = 0.0) -> Draft:
        self.asked.append(max_width)
        if self.fails:
            raise RuntimeError("retrieval failed")
        n = min(self.offer, max_width - 1)
        return Draft([self.ids[-1], *range(100, 100 + n)], list(range(-1, n)), [1.0] * (n + 1))


def running(offer: int = 0, **kwargs) -> Request:
    return Request(ids=[1, 2, 3, 4, 5], fed=4, prompt_len=3, offer=offer, **kwargs)


def waiting(length: int, **kwargs) -> Request:
    return Request(ids=list(range(10, 10 + length)), fed=0, prompt_len=length, **kwargs)


def test_with_nothing_running_the_first_prompt_is_read_whole_with_its_first_draft() -> None:
    prompt = waiting(300, offer=4)
    plan = schedule([prompt], budget=16, cost=CostModel(FLAT))
    (item,) = plan.scheduled
    assert (item.request, item.start, item.chunk) == (prompt, 0, prompt.ids[:299])
    assert item.draft.tokens == [prompt.ids[-1], 100, 101, 102, 103]


def test_with_nothing_running_a_long_prompt_is_read_in_bounded_chunks_then_drafts() -> None:
    prompt = waiting(LONE_PROMPT_CHUNK * 2 + 100, offer=4)
    chunks = []
    while True:
        (item,) = schedule([prompt], budget=16, cost=CostModel(FLAT)).scheduled
        assert item.start == prompt.fed and len(item.chunk) <= LONE_PROMPT_CHUNK
        chunks.append(len(item.chunk))
        if item.draft is not None:
            break
        prompt.fed += len(item.chunk)
    assert chunks == [LONE_PROMPT_CHUNK, LONE_PROMPT_CHUNK, 99]
    assert item.draft.tokens == [prompt.ids[-1], 100, 101, 102, 103]


def test_roots_come_first_and_a_prompt_that_does_not_fit_gets_a_chunk_without_a_draft() -> None:
    first, second = running(offer=50), running(offer=50)
    prompt = waiting(200, offer=8)
    plan = schedule([first, prompt, second], budget=64, cost=CostModel(FLAT))
    assert [item.request for item in plan.scheduled] == [first, second, prompt]
    free = 64 - 2
    room = int(free * DRAFT_SHARE_BESIDE_PROMPT)
    assert first.asked == second.asked == [room + 1] and prompt.asked == []
    drafted = sum(len(item.draft) - 1 for item in plan.scheduled[:2])
    assert drafted <= room
    chunk = plan.scheduled[2]
    assert chunk.draft is None and chunk.start == 0
    assert chunk.chunk == prompt.ids[: max(free - drafted, 64 // 8)]
    assert [item.start for item in plan.scheduled[:2]] == [4, 4]  # after their committed tokens


def test_a_prompt_always_advances_by_an_eighth_of_the_budget() -> None:
    greedy = [running(offer=100) for _ in range(3)]
    prompt = waiting(500)
    plan = schedule([*greedy, prompt], budget=64, cost=CostModel(FLAT))
    assert len(plan.scheduled[-1].chunk) >= 64 // 8


def test_prompts_that_fit_whole_join_the_step_first_come_first_served() -> None:
    short, long, after = waiting(10), waiting(100), waiting(5)
    plan = schedule([running(), short, long, after], budget=40, cost=CostModel(FLAT))
    scheduled = {id(item.request): item for item in plan.scheduled}
    assert scheduled[id(short)].chunk == short.ids[:9] and scheduled[id(short)].draft is not None
    assert scheduled[id(long)].draft is None  # the partial chunk
    assert id(after) not in scheduled  # behind the partial one: no room this step


def test_a_request_whose_retrieval_fails_is_reported_and_the_others_are_planned() -> None:
    good, bad = running(offer=3), running(offer=3, fails=True)
    plan = schedule([bad, good], budget=32, cost=CostModel(FLAT))
    assert [request for request, _ in plan.failed] == [bad]
    assert str(plan.failed[0][1]) == "retrieval failed"
    assert [item.request for item in plan.scheduled] == [good]
    assert len(plan.scheduled[0].draft) == 4


def test_above_max_speculative_batch_nobody_drafts() -> None:
    requests = [running(offer=5) for _ in range(3)]
    plan = schedule(requests, budget=64, cost=CostModel(FLAT), max_speculative_batch=2)
    assert all(len(item.draft) == 1 for item in plan.scheduled)
    assert all(request.asked == [] for request in requests)


def test_drafts_are_trimmed_where_they_do_not_pay() -> None:
    steep = CostModel({q: float(q) for q in POINTS})  # every token costs a whole forward
    request = running(offer=10, acceptance=Calibration.uniform(0.1))
    (item,) = schedule([request], budget=64, cost=steep).scheduled
    assert len(item.draft) == 1


def test_where_no_node_can_pay_no_draft_is_retrieved() -> None:
    steep = CostModel({q: float(q) for q in POINTS})  # compute-bound: a row costs a whole forward
    requests = [running(offer=10) for _ in range(8)]
    plan = schedule(requests, budget=64, cost=steep)
    assert all(len(item.draft) == 1 for item in plan.scheduled)
    assert all(request.asked == [] for request in requests)
    opted_out = running(offer=10, config=LookaheadConfig(adaptive=False))
    (item,) = schedule([opted_out], budget=64, cost=steep).scheduled
    assert opted_out.asked and len(item.draft) == 11


def test_an_unadmitted_request_is_refused() -> None:
    with pytest.raises(ValueError, match="admitted"):
        schedule([Request(ids=[1, 2], fed=None, prompt_len=2)], budget=8, cost=CostModel(FLAT))


def test_the_scheduler_and_the_algorithm_import_no_torch() -> None:
    script = """
import json, sys
sys.modules["torch"] = None  # any import of torch raises
from lookahead.algorithm.drafters import DRAFTERS
from lookahead.algorithm.planner import CostModel
import lookahead.algorithm.acceptance, lookahead.algorithm.recycling
from lookahead.runtime.scheduler import Scheduler
import lookahead.algorithm.verify, lookahead.runtime.step_timing
scheduler = Scheduler(lambda longest: True, step_token_budget=8)
print(json.dumps({"plan": len(scheduler.plan([], CostModel.for_device("cpu")).scheduled),
                  "drafters": sorted(DRAFTERS)}))
"""
    finished = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert finished.returncode == 0, finished.stderr
    assert json.loads(finished.stdout) == {"plan": 0, "drafters": ["hybrid", "recycled", "trie"]}


@dataclass(eq=False)
class Waiting:
    """A queued request as the Scheduler sees it."""

    longest: list[int]
    arrival: float = 0.0
    cancelled: bool = False


def test_the_scheduler_admits_in_arrival_order_within_its_limits() -> None:
    room = {"entries": 100}
    scheduler = Scheduler(
        lambda longest: sum(longest) <= room["entries"], step_token_budget=64, max_running=3
    )
    big, small, later = Waiting([90]), Waiting([20]), Waiting([5])
    for request in (big, small, later):
        scheduler.add(request)
    assert scheduler.schedule().started == [big]  # the small one waits behind what does not fit
    assert list(scheduler.waiting) == [small, later]
    scheduler.finish(big)
    assert scheduler.schedule().started == [small, later]
    assert scheduler.running == [small, later]
    alone = Scheduler(lambda longest: False, step_token_budget=64)
    alone.add(big)
    assert alone.schedule().started == [big]  # the first one starts whatever it holds


def test_the_scheduler_drops_the_cancelled_the_late_and_the_overflow() -> None:
    scheduler = Scheduler(lambda longest: True, step_token_budget=64, max_running=1)
    scheduler.limit(max_running=1, max_queued=1, queue_timeout_s=5.0)
    running, cancelled, late, kept, newest = (Waiting([1], arrival=t) for t in (0.0, 0.0, 1.0, 8.0, 9.0))
    cancelled.cancelled = True
    for request in (running, cancelled, late, kept, newest):
        scheduler.add(request)
    admission = scheduler.schedule(now=10.0)
    assert admission.started == [running] and admission.cancelled == [cancelled]
    assert admission.timed_out == [(late, 9.0)] and admission.overflow == [(newest, 1)]
    assert list(scheduler.waiting) == [kept]
    with pytest.raises(ValueError, match="max_running_requests"):
        scheduler.limit(max_running=0)
