"""Running one piece of work in a forked child process, bounded in time and memory.

A fork shares everything the caller built (a tokenizer, loaded modules) without copying it, and
the child can be killed: work that holds the GIL or that native code cannot interrupt stops at
its deadline, and whatever it allocated goes with the process. The child ends with its parent
(PR_SET_PDEATHSIG), its stderr goes nowhere (a native panic's message is reported as the child's
exit instead), and the parent reads its result through a pipe.
"""

from __future__ import annotations

import math
import os
import resource
import select
import signal
import threading
import time
from collections.abc import Callable

from ..parent_death import die_with_parent

_STOP_POLL_S = 0.1  # how often a wait looks at its stop event


class ChildFailure(Exception):
    """The child produced no result: `timed_out` (killed at the deadline), else `ended` says how it
    ended (a signal, an exit code)."""

    def __init__(self, timed_out: bool, ended: str = ""):
        super().__init__(ended or "timed out")
        self.timed_out, self.ended = timed_out, ended


def run_in_child(
    work: Callable[[], bytes], *, timeout_s: float, memory_bytes: int, stop: threading.Event | None = None
) -> bytes:
    """work()'s bytes, computed in a forked child that may add at most memory_bytes of address space
    and is killed after timeout_s, or as soon as `stop` is set; ChildFailure when it gave none. The
    child runs only the calling thread: work() must take no lock another thread may hold (an import)."""
    read_end, write_end = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        _child(work, read_end, write_end, parent, timeout_s, memory_bytes)
    os.close(write_end)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    finished = False
    try:
        while (left := deadline - time.monotonic()) > 0 and not (stop is not None and stop.is_set()):
            if not select.select([read_end], [], [], left if stop is None else min(left, _STOP_POLL_S))[0]:
                continue
            chunk = os.read(read_end, 1 << 20)
            if not chunk:
                finished = True
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
        if not finished:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    if not finished:
        stopped = stop is not None and stop.is_set()
        raise ChildFailure(timed_out=not stopped, ended="stopped" if stopped else "")
    if os.WIFSIGNALED(status) or os.WEXITSTATUS(status) != 0:
        raise ChildFailure(timed_out=False, ended=_ending(status))
    return b"".join(chunks)


def _child(
    work: Callable[[], bytes], read_end: int, write_end: int, parent: int, timeout_s: float, memory_bytes: int
) -> None:
    """The forked child: bound itself, run work, write its result, exit (never returns)."""
    code = 1
    try:
        os.close(read_end)
        die_with_parent(parent)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        _limit(memory_bytes, timeout_s)
        result = memoryview(work())
        while result:
            result = result[os.write(write_end, result) :]
        code = 0
    finally:
        os._exit(code)


def _limit(memory_bytes: int, timeout_s: float) -> None:
    """Address space: what the process maps now plus memory_bytes; CPU time: past the deadline (the
    parent kills it first, this bounds it should the parent stall)."""
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + memory_bytes, mapped + memory_bytes))
    seconds = math.ceil(timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))


def _ending(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.WEXITSTATUS(status)}"
