"""Ends a backend stub whose tritonserver is gone.

When tritonserver exits without finalizing the model (its exit timeout expired, or it was
killed), its stub is re-parented and, left alone, would go on decoding for nobody with its
memory held. This thread notices the new parent, lets `on_orphaned` save what it can, and ends
the process.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

POLL_S = 1.0


def exit_when_orphaned(on_orphaned: Callable[[], None], poll_s: float = POLL_S) -> threading.Thread:
    """Start a daemon thread that calls on_orphaned() and exits the process once the parent dies."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        try:
            on_orphaned()
        finally:
            os._exit(1)

    thread = threading.Thread(target=watch, name="lookahead-orphan-watch", daemon=True)
    thread.start()
    return thread
