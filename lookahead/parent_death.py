"""Processes that end with the process that started them, however it ends (Linux's PR_SET_PDEATHSIG).

A process killed with SIGKILL (the OOM killer, a supervisor out of patience) runs no cleanup, so
what it started must not rely on it: each child asks the kernel, between fork and exec, for a
signal when the thread that started it ends.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
try:  # looked up now: after a fork, a lookup could wait for a loader lock another thread held
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: nothing watches the parent
    _prctl = None


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    """In a child: have the kernel send `signum` when the parent's thread that forked it ends;
    exit at once when the parent (pid `parent`) is already gone."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def ending_with_this_process(signum: int) -> Callable[[], None] | None:
    """A Popen preexec_fn: the child gets `signum` when this process ends. The signal follows the
    thread that starts the child, so it is set only for children the main thread starts (None
    elsewhere: a worker thread's end must not end them)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()
    return lambda: die_with_parent(parent, signum)
