"""Ends a backend stub whose tritonserver is gone, within ORPHAN_DEADLINE_S whatever it was doing.

When tritonserver exits without finalizing the model (its exit timeout expired, or it was
killed), its stub is re-parented and, left alone, would go on decoding for nobody with its
memory held. The stub's own health thread notices too, but its way out waits on queues and locks
that the dead server held, and a response send waits forever for the server to take it. This
thread notices the new parent, arms a deadline that needs no Python (SIGALRM, whose default action
ends the process in the kernel), lets `on_orphaned` save what it can, and ends the process.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable

POLL_S = 0.25
ORPHAN_DEADLINE_S = 3.0  # from noticing the new parent to the end of the process, at the latest


def exit_when_orphaned(
    on_orphaned: Callable[[], None], poll_s: float = POLL_S, deadline_s: float = ORPHAN_DEADLINE_S
) -> threading.Thread:
    """Start a daemon thread that, once the parent dies, calls on_orphaned() and exits the process;
    the process ends deadline_s later at the latest, on_orphaned or another thread notwithstanding."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        arm_deadline(deadline_s)
        try:
            on_orphaned()
        finally:
            os._exit(1)

    thread = threading.Thread(target=watch, name="lookahead-orphan-watch", daemon=True)
    thread.start()
    return thread


def arm_deadline(seconds: float) -> None:
    """End this process `seconds` from now, even if no Python thread runs by then: SIGALRM where its
    action is the default (termination), else a SIGKILL from a timer thread."""
    if signal.getsignal(signal.SIGALRM) == signal.SIG_DFL:
        signal.alarm(max(1, math.ceil(seconds)))
        return
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()
