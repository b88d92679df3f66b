"""Brings a model back whose backend stub died (SIGKILL, the OOM killer, a crash in native code).

Triton's Python backend (2.51) neither notices nor restarts a decoupled model's stub that dies: the
model stays ready, every new request gets "Stub process '<instance>' is not healthy", and a stream
in flight gets nothing more. Every instance registers in the launcher's drain folder with its
model and its stub's shared-memory region (backend/drain.py), so a registered process that is gone
without having finalized or drained died. The supervisor then unloads that model (its readiness
turns false at once: the OpenAI endpoint ends its streams and answers 503), removes the dead stub's
shared-memory region, and loads the model again: new instances, warm from their last trie
snapshot. Loading goes through tritonserver's model-control API, which the launcher restricts to a
key only it (and the endpoint, to list models) holds. Tries are bounded; each restart is counted
in the drain folder, which the new instances publish as lookahead_model_restarts_total.
"""

from __future__ import annotations

import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from backend.drain import Drain, remove_region
from lookahead.contract import ADMIN_KEY_HEADER

POLL_S = 0.5  # how often the drain folder is checked for dead instances
UNLOAD_WAIT_S = 5.0  # the bound on the unload call (the old instances finish unloading in the background)
TRIES = 3  # loads tried per restart, BACKOFF_S apart, doubling
BACKOFF_S = 2.0


def model_control_args(key: str) -> list[str]:
    """tritonserver's arguments for model control through its API, restricted to `key` on the
    HTTP and gRPC ports (the repository index, load and unload; inference and health stay open)."""
    restricted = f"model-repository:{ADMIN_KEY_HEADER}={key}"
    return [
        "--model-control-mode=explicit",
        "--load-model=*",
        f"--http-restricted-api={restricted}",
        f"--grpc-restricted-protocol={restricted}",
    ]


class Supervisor:
    """A thread that restarts the model of every instance that dies while the server runs."""

    def __init__(
        self,
        drain: Drain,
        http_url: str,
        key: str,
        load_timeout_s: float,
        log: Callable[[str], None] | None = None,
    ):
        self.drain, self.key, self.load_timeout_s = drain, key, load_timeout_s
        self.base_url = f"http://{http_url}/v2/repository/models/"
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.stopping = threading.Event()
        self.restarts: dict[str, int] = {}
        self.thread = threading.Thread(target=self._run, name="launcher-supervisor", daemon=True)

    def start(self) -> Supervisor:
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (a load under way is left to the server's stop)."""
        self.stopping.set()
        self.thread.join(timeout=POLL_S * 4)

    def _run(self) -> None:
        while not self.stopping.wait(POLL_S):
            dead = self.drain.dead()
            for model in dict.fromkeys(instance.model for instance in dead):
                pids = [instance.pid for instance in dead if instance.model == model]
                regions = [instance.shm_region for instance in dead if instance.model == model]
                if model and not self.stopping.is_set():
                    self.restart(model, pids, regions)

    def restart(self, model: str, pids: list[int], regions: list[str]) -> bool:
        """Unload `model`, remove what its dead stubs left, load it again (TRIES tries); whether it serves."""
        self.log(f"backend stub(s) {pids} of model {model} died: restarting the model")
        status, message = self._control(model, "unload", UNLOAD_WAIT_S)
        if status not in (200, None):
            self.log(f"unloading {model}: {status} {message}")
        for region in regions:
            remove_region(region)
        count = self.drain.count_restart(model)
        delay = BACKOFF_S
        for attempt in range(1, TRIES + 1):
            if self.stopping.is_set():
                return False
            began = time.monotonic()
            status, message = self._control(model, "load", self.load_timeout_s)
            if status == 200:
                self.log(f"model {model} serves again ({time.monotonic() - began:.1f} s; restart {count})")
                return True
            self.log(f"loading {model} failed (try {attempt} of {TRIES}): {status} {message}")
            if attempt < TRIES and self.stopping.wait(delay):
                return False
            delay *= 2
        self.log(f"model {model} stays unloaded after {TRIES} tries; restart the server to serve it again")
        return False

    def _control(self, model: str, action: str, timeout_s: float) -> tuple[int | None, str]:
        """POST the model-control call; (HTTP status, body), (None, why) when it did not answer in time."""
        request = urllib.request.Request(
            f"{self.base_url}{urllib.parse.quote(model)}/{action}",
            data=b"{}",
            method="POST",
            headers={ADMIN_KEY_HEADER: self.key, "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                return reply.status, reply.read().decode(errors="replace")
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")
        except OSError as error:  # no answer in time
            return None, str(error)
