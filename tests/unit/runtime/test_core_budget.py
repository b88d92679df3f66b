"""CoreBudget: a forward's team shrinks to the cores other processes leave free, and grows back."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lookahead.runtime.core_budget import (
    SAMPLE_INTERVAL_S,
    CoreBudget,
    busy_seconds,
    cgroup_cpu_quota,
    runnable_elsewhere,
    wait_until_quiet,
)


class Machine:
    """A fake clock and CPU-time counters: `others` and `own` cores busy since the last advance."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0
        self.runnable: int | None = 8  # threads runnable elsewhere at a look

    def advance(self, seconds: float, *, others: float, own: float) -> None:
        self.now += seconds
        self.busy += seconds * (others + own)
        self.own += seconds * own


def budget(machine: Machine, limit: int, cores: int) -> tuple[CoreBudget, list[int]]:
    calls: list[int] = []
    core_budget = CoreBudget(
        limit,
        clock=lambda: machine.now,
        own_seconds=lambda: machine.own,
        machine_seconds=lambda cpus: machine.busy,
        set_threads=calls.append,
    )
    core_budget._runnable = lambda: machine.runnable
    core_budget.cpus = set(range(cores))
    core_budget.limit = limit
    core_budget.threads = limit
    return core_budget, calls


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back() -> None:
    machine = Machine()
    core_budget, calls = budget(machine, limit=2, cores=2)
    assert core_budget.apply() == 2  # the first look only starts the window
    machine.advance(0.3, others=0.05, own=2.0)
    assert core_budget.apply() == 2
    machine.advance(0.3, others=0.7, own=1.3)  # a busy process shares the two cores with the team
    assert core_budget.apply() == 1
    machine.advance(0.3, others=1.0, own=1.0)
    assert core_budget.apply() == 1
    machine.advance(0.3, others=0.5, own=1.0)  # within the hysteresis: still held
    assert core_budget.apply() == 1
    machine.advance(0.3, others=0.1, own=1.0)
    assert core_budget.apply() == 2
    assert calls == [1, 2]


def test_never_below_one_thread_nor_above_the_limit() -> None:
    machine = Machine()
    core_budget, calls = budget(machine, limit=3, cores=4)
    core_budget.apply()
    machine.advance(0.3, others=7.5, own=0.5)
    assert core_budget.apply() == 1
    machine.advance(0.3, others=0.0, own=1.0)
    assert core_budget.apply() == 3
    assert calls == [1, 3]


def test_looks_at_most_once_per_interval() -> None:
    machine = Machine()
    core_budget, calls = budget(machine, limit=2, cores=2)
    core_budget.apply()
    machine.advance(SAMPLE_INTERVAL_S / 4, others=1.0, own=1.0)
    assert core_budget.apply() == 2  # too soon to judge
    machine.advance(SAMPLE_INTERVAL_S, others=1.0, own=1.0)
    assert core_budget.apply() == 1


def test_a_neighbours_burst_that_ended_before_the_window_takes_no_thread() -> None:
    """The other model answered a request just before this one: looks in between (the watcher's)
    put the window after it, where the machine is quiet; without them the burst counts."""
    for watched in (True, False):
        machine = Machine()
        core_budget, calls = budget(machine, limit=2, cores=2)
        core_budget.apply()
        machine.advance(0.3, others=2.0, own=0.0)  # the neighbour's forward on both cores
        for _ in range(4):
            if watched:
                core_budget.look()
            machine.advance(SAMPLE_INTERVAL_S / 2, others=0.0, own=0.0)
        assert core_budget.apply() == (2 if watched else 1)
        assert calls == ([] if watched else [1])


def test_a_neighbour_that_is_not_runnable_now_holds_no_core() -> None:
    machine = Machine()
    core_budget, calls = budget(machine, limit=2, cores=2)
    core_budget.apply()
    machine.advance(0.3, others=1.0, own=1.0)  # busy in the window: the other model's last steps
    machine.runnable = 0  # ... and done by now
    assert core_budget.apply() == 2
    machine.advance(0.3, others=1.0, own=1.0)  # a process that spins: runnable at every look
    machine.runnable = 1
    assert core_budget.apply() == 1
    assert calls == [1]


def test_runnable_elsewhere_reads_the_fewest_of_a_few_looks(tmp_path: Path) -> None:
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.52 0.71 0.80 3/412 12345\n")
    assert runnable_elsewhere(loadavg) == 2
    loadavg.write_text("0.52 0.71 0.80 1/412 12345\n")
    assert runnable_elsewhere(loadavg) == 0
    assert runnable_elsewhere(tmp_path / "missing") is None


@pytest.mark.skipif(not Path("/proc/loadavg").exists(), reason="Linux's /proc/loadavg")
def test_a_real_spinning_process_is_runnable_elsewhere() -> None:
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert runnable_elsewhere() >= 1
    finally:
        child.kill()
        child.wait()


def test_the_watcher_looks_while_its_budget_lives() -> None:
    core_budget = CoreBudget(2, watch=True, set_threads=lambda threads: None)
    before = set(threading.enumerate())
    core_budget.apply()  # the first forward starts it
    time.sleep(3 * SAMPLE_INTERVAL_S)
    assert len(core_budget._looks) >= 4
    watchers = [t for t in set(threading.enumerate()) - before if t.name == "lookahead-core-budget"]
    assert len(watchers) == 1
    del core_budget
    for watcher in watchers:
        watcher.join(timeout=2 * SAMPLE_INTERVAL_S)
    assert not any(watcher.is_alive() for watcher in watchers)


def test_cgroup_quotas(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(v1) == 0.5


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="Linux's /proc/stat")
def test_busy_seconds_sees_a_real_busy_process() -> None:
    """A spinning child shows in the machine's busy time and not in this process's own."""
    cpus = os.sched_getaffinity(0)
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the child's interpreter is up and spinning
        start_machine, start_own, start = busy_seconds(cpus), time.process_time(), time.monotonic()
        time.sleep(1.0)
        machine, own, wall = busy_seconds(cpus), time.process_time(), time.monotonic() - start
    finally:
        child.kill()
        child.wait()
    elsewhere = ((machine - start_machine) - (own - start_own)) / wall
    assert elsewhere >= 0.6, f"a spinning process kept only {elsewhere:.2f} cores busy"


def test_waiting_until_quiet_ends_once_a_real_neighbour_stops() -> None:
    """A spinning child keeps the wait going; once it is killed the next window is quiet."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.3)
    killer = threading.Timer(1.0, child.kill)
    killer.start()
    try:
        waited = wait_until_quiet(10.0)
    finally:
        killer.cancel()
        child.kill()
        child.wait()
    assert waited is not None and 0.9 <= waited < 5.0, waited


def test_a_machine_that_stays_busy_is_timed_anyway_after_the_timeout() -> None:
    now = [0.0]
    busy = iter(range(0, 10_000))  # each look: one more core-second busy elsewhere per window

    def sleep(seconds: float) -> None:
        now[0] += seconds

    waited = wait_until_quiet(
        2.0,
        window_s=0.5,
        clock=lambda: now[0],
        own_seconds=lambda: 0.0,
        machine_seconds=lambda cpus: float(next(busy)),
        sleep=sleep,
    )
    assert waited is None and now[0] == pytest.approx(2.0)
