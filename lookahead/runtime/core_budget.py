"""How many threads a forward may use now: the cores this process may run on, less what other
processes keep busy.

A forward's threads meet at a barrier after every matrix. Where another process holds one of the
cores, the thread sharing that core waits for its time slice at every barrier and the whole team
waits with it: two threads beside one busy process run far slower than one thread alone. So before
each forward `CoreBudget.apply` sizes the team to the cores left free, measured over the last
fraction of a second from /proc/stat (each core's busy time) less this process's own CPU time. A
watcher thread looks every half interval, so that the first forward after an idle spell judges
the machine as it is now. And a process counts as holding a core only if something besides this
thread is runnable at the moment of the look (/proc/loadavg): the other model of the same server,
which answered the request just before, leaves its busy time in the window but holds no core.

The cores this process may use are its CPU affinity, capped by its cgroup's CPU quota (a
container's `--cpus`). A forward's results never depend on its team's size (the kernels split work
over output columns and rows, never over a sum), so resizing changes speed only.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path

# Seconds between two looks at the machine; a look costs tens of microseconds.
SAMPLE_INTERVAL_S = 0.2
# Another process counts as holding a core from this share of one on; below RELEASE of one the
# core counts as free again (the gap keeps the team from flapping at the edge).
HOLD = 0.6
RELEASE = 0.3


def usable_cores() -> int:
    """The cores this process may run on: its affinity, capped by its cgroup's CPU quota."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota - 1e-9))) if quota else cores


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (cgroup v2's cpu.max, v1's cfs files), or
    None where there is none."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def busy_seconds(cpus: set[int], stat: Path = Path("/proc/stat")) -> float | None:
    """Seconds the given CPUs have spent busy since boot (everything but idle and iowait), or None
    where /proc/stat cannot be read."""
    total = 0
    try:
        with open(stat) as lines:
            for line in lines:  # the cpu lines come first; the long interrupt lines are not read
                name, _, rest = line.partition(" ")
                if not name.startswith("cpu"):
                    break
                if name == "cpu" or int(name[3:]) not in cpus:
                    continue
                fields = [int(v) for v in rest.split()]
                total += sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)
    except OSError:
        return None
    return total / os.sysconf("SC_CLK_TCK")


def runnable_elsewhere(loadavg: Path = Path("/proc/loadavg"), reads: int = 3) -> int | None:
    """Threads runnable on the machine now besides the calling one: the fewest of a few reads (a
    wakeup in passing is no neighbour), or None where /proc/loadavg cannot be read."""
    counts = []
    for _ in range(reads):
        try:
            running = int(loadavg.read_text().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return None
        counts.append(running - 1)
    return max(0, min(counts))


class CoreBudget:
    """The team size for the next forward: at most `limit` threads, one per core that no other
    process holds (never below one)."""

    def __init__(
        self,
        limit: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        own_seconds: Callable[[], float] = time.process_time,
        machine_seconds: Callable[[set[int]], float | None] = busy_seconds,
        set_threads: Callable[[int], None] | None = None,
        runnable: Callable[[], int | None] = runnable_elsewhere,
        watch: bool = False,
    ):
        self.cpus = os.sched_getaffinity(0)
        # The machine-wide runnable count speaks for these cores only where they are all of them.
        self._runnable = runnable if len(self.cpus) == os.cpu_count() else lambda: None
        self.limit = max(1, min(limit, usable_cores()))
        self.threads = self.limit
        self.others = 0  # cores counted as held by other processes
        self._clock, self._own, self._machine = clock, own_seconds, machine_seconds
        self._set_threads = set_threads or _torch_set_threads
        # Recent looks (time, machine busy seconds, own CPU seconds), oldest first.
        self._looks: deque[tuple[float, float, float]] = deque(maxlen=8)
        self._judged: float | None = None  # when apply() last judged the machine
        self._watching = watch

    def apply(self) -> int:
        """Resize the calling thread's team if the free cores changed since the last look; return
        the team size. Call it on the thread that runs the forwards (a team is per thread)."""
        now = self._clock()
        if self._judged is not None and now - self._judged < SAMPLE_INTERVAL_S:
            return self.threads
        if self._watching:
            self._watching = False
            _start_watcher(self)
        earlier = list(self._looks)
        sample = self.look()
        if sample is None:
            return self.threads
        self._judged = now
        # The window: from the newest earlier look at least an interval old, to now.
        start = next((s for s in reversed(earlier) if now - s[0] >= SAMPLE_INTERVAL_S), None)
        if start is not None:
            wall = sample[0] - start[0]
            elsewhere = max(0.0, (sample[1] - start[1]) - (sample[2] - start[2])) / wall
            self.others = self._held(elsewhere)
            if self.others:
                now_runnable = self._runnable()
                if now_runnable is not None:
                    self.others = min(self.others, now_runnable)
            threads = max(1, min(self.limit, len(self.cpus) - self.others))
            if threads != self.threads:
                self._set_threads(threads)
                self.threads = threads
        return self.threads

    def look(self) -> tuple[float, float, float] | None:
        """Note the machine's and this process's CPU time now (None where /proc/stat cannot be read)."""
        now = self._clock()
        machine = self._machine(self.cpus)
        if machine is None:
            return None
        sample = (now, machine, self._own())
        self._looks.append(sample)
        return sample

    def _held(self, elsewhere: float) -> int:
        """Whole cores other processes hold, from the cores' worth of time they used, with
        hysteresis around the current count."""
        held = self.others
        while elsewhere >= held + HOLD:
            held += 1
        while held > 0 and elsewhere < held - 1 + RELEASE:
            held -= 1
        return held


def _start_watcher(budget: CoreBudget) -> None:
    """A daemon thread that looks every half interval while `budget` lives."""
    reference = weakref.ref(budget)

    def watch() -> None:
        while (alive := reference()) is not None:
            alive.look()
            del alive
            time.sleep(SAMPLE_INTERVAL_S / 2)

    threading.Thread(target=watch, name="lookahead-core-budget", daemon=True).start()


def wait_until_quiet(
    timeout_s: float,
    *,
    window_s: float = SAMPLE_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
    own_seconds: Callable[[], float] = time.process_time,
    machine_seconds: Callable[[set[int]], float | None] = busy_seconds,
    sleep: Callable[[float], None] = time.sleep,
) -> float | None:
    """Wait, at most timeout_s, until other processes use less than RELEASE of a core of those this
    process may run on over one window (a timing taken beside a busy neighbour, such as another
    model loading in the same server, measures the neighbour). Returns the seconds waited, or None
    where the machine stayed busy (or /proc/stat cannot be read: then at once)."""
    cpus = os.sched_getaffinity(0)
    started = clock()
    while True:
        before = (clock(), machine_seconds(cpus), own_seconds())
        if before[1] is None:
            return None
        sleep(window_s)
        after = (clock(), machine_seconds(cpus), own_seconds())
        if after[1] is None:
            return None
        wall = max(after[0] - before[0], 1e-9)
        elsewhere = max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / wall
        if elsewhere < RELEASE:
            return after[0] - started
        if after[0] - started >= timeout_s:
            return None


def _torch_set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
