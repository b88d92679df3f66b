"""The engine thread: the only thread that touches the model, the decoder and the global trie.

`execute` hands validated requests over through a queue and returns at once. The engine
thread advances every in-flight request with one batched `LookaheadDecoder.step()` per
iteration (continuous batching: requests join and leave between steps, a new one is prefilled
in the iteration it arrives), so a long generation never keeps a short one from starting. It
turns each step into an `Update` for the response thread; it never blocks on IPC itself.
Between steps it snapshots the global trie, so a snapshot never sees a half-applied step.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lookahead.algorithm.trie import NGramTrie
from lookahead.runtime.decoder import LookaheadDecoder
from lookahead.runtime.generation import Generation, GenerationStats, StepOutput
from lookahead.state.persistence import save_trie

from .request import GenerationRequest

SHUTDOWN_MESSAGE = "the model is being unloaded; the request was not completed"


class Log(Protocol):
    """The part of pb_utils.Logger the engine uses (tests pass any object with these methods)."""

    def log_info(self, message: str) -> None: ...

    def log_warn(self, message: str) -> None: ...

    def log_error(self, message: str) -> None: ...


class FailureCode(enum.Enum):
    """Why a request ended without output; mapped to a Triton error code when sent."""

    INVALID_ARG = "INVALID_ARG"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(eq=False)
class RequestState:
    """One request, shared by `execute`, the engine thread and the response thread.

    `cancelled` is written only by the response thread (after its `is_cancelled()` checks)
    and read by the engine before each step; the rest after `request` is engine-thread only.
    """

    id: str
    sender: Any  # the Triton response sender: only the response thread calls it
    request: GenerationRequest | None = None  # None when rejected before reaching the engine
    arrival: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    generation: Generation | None = None
    first_output_time: float | None = None
    finish_time: float | None = None
    unreported_tokens: int = 0  # decoded, but their text is still held back by the detokenizer
    text_parts: list[str] = field(default_factory=list)  # non-streaming: the whole output so far


@dataclass(frozen=True)
class Update:
    """One response for the response thread to send: a text delta, or a failure."""

    state: RequestState
    final: bool
    text: str = ""
    num_output_tokens: int = 0
    finish_reason: str | None = None
    stats: GenerationStats | None = None  # on a final response that followed a generation
    failure: FailureCode | None = None
    message: str = ""

    @classmethod
    def failed(cls, state: RequestState, code: FailureCode, message: str) -> Update:
        stats = state.generation.stats if state.generation is not None else None
        return cls(state, final=True, stats=stats, failure=code, message=message)


class TrieSnapshots:
    """Saves the instance's global trie: while serving at most once per interval when it changed,
    and always when the engine stops.

    Called from the engine thread between steps, so the trie is never saved mid-update;
    `save_trie` writes atomically, so a crash mid-save keeps the previous snapshot.
    """

    def __init__(self, trie: NGramTrie, path: Path, fingerprint: str, interval_s: float, log: Log):
        self.trie, self.path, self.fingerprint = trie, path, fingerprint
        self.interval_s, self.log = interval_s, log
        self.changed = False
        self.last_save = time.monotonic()

    def mark_changed(self) -> None:
        self.changed = True

    def maybe_save(self) -> None:
        if self.interval_s > 0 and self.changed and time.monotonic() - self.last_save >= self.interval_s:
            self.save()

    def save(self) -> None:
        """Write now, changed or not: on unload every instance leaves its file behind."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_trie(self.trie, self.path, self.fingerprint)
        except OSError as error:  # a full disk must not take the instance down; retry next interval
            self.log.log_error(f"Could not save the trie snapshot {self.path}: {error}")
        else:
            self.changed = False
        self.last_save = time.monotonic()


class Engine:
    """Owns the decoder; steps all in-flight generations together on one thread."""

    def __init__(
        self,
        decoder: LookaheadDecoder,
        emit: Callable[[Update], None],
        log: Log,
        snapshots: TrieSnapshots | None = None,
        on_trie_size: Callable[[int, int], None] | None = None,
    ):
        self.decoder = decoder
        decoder.debug_log = log.log_info  # the `debug` setting's per-step lines go to the server log
        self.emit = emit
        self.log = log
        self.snapshots = snapshots
        self.on_trie_size = on_trie_size
        self.inbox: queue.SimpleQueue[RequestState | None] = queue.SimpleQueue()
        self.active: list[RequestState] = []
        self.thread = threading.Thread(target=self._run, name="lookahead-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def running(self) -> bool:
        """False once the thread has ended: after stop(), or after a bug killed it."""
        return self.thread.is_alive()

    def submit(self, state: RequestState) -> None:
        """Queue a validated request (state.request set); returns at once."""
        self.inbox.put(state)

    def stop(self) -> None:
        """Fail what is still in flight, take a last snapshot, and end the thread."""
        self.inbox.put(None)
        self.thread.join()

    def _run(self) -> None:
        try:
            while self._admit():
                self._advance()
                if self.snapshots is not None:
                    self.snapshots.maybe_save()
        except BaseException:
            self.log.log_error(
                f"The engine thread failed; the model must be reloaded: {traceback.format_exc()}"
            )
            raise
        finally:
            for state in list(self.active):
                self._finish(state, Update.failed(state, FailureCode.UNAVAILABLE, SHUTDOWN_MESSAGE))
            if self.snapshots is not None:
                self.snapshots.save()
                self.log.log_info(
                    f"Saved {self.snapshots.path} ({self.snapshots.trie.node_count} trie nodes)"
                )

    def _admit(self) -> bool:
        """Move new requests into the round, waiting while idle. False once stop() was called."""
        while True:
            idle = not self.active
            try:
                state = self.inbox.get(block=idle, timeout=self._idle_timeout() if idle else None)
            except queue.Empty:
                if not idle:
                    return True
                self.snapshots.maybe_save()  # only a pending snapshot sets an idle timeout
                continue
            if state is None:
                return False
            self.active.append(state)

    def _idle_timeout(self) -> float | None:
        """While idle, wake up only to write a snapshot that is due."""
        if self.snapshots is None or not self.snapshots.changed or self.snapshots.interval_s <= 0:
            return None
        return max(0.01, self.snapshots.last_save + self.snapshots.interval_s - time.monotonic())

    def _advance(self) -> None:
        """One batched step of every running request; cancelled ones end first."""
        for state in [s for s in self.active if s.cancelled]:
            self.log.log_info(f"Cancelling request {state.id}")
            self._finish(state, Update.failed(state, FailureCode.CANCELLED, "Request was cancelled"))
        for state in [s for s in self.active if s.generation is None]:
            request = state.request
            try:
                state.generation = self.decoder.start(
                    request.prompt_ids, request.sampling, request.lookahead, request_id=state.id
                )
            except Exception as error:
                self._fail(state, error)
        # New requests are prefilled one by one, each sending its first token at once, before the
        # others' decoding step: time to first token never includes a decoding step, and in a
        # burst of arrivals only the last one waits for every prefill.
        decoding = [state for state in self.active if state.generation.in_pool]
        for state in [state for state in self.active if not state.generation.in_pool]:
            self._step([state])
        if decoding:
            self._step(decoding)

    def _step(self, states: list[RequestState]) -> None:
        """One decoder.step() for these requests, then their updates."""
        try:
            outputs = self.decoder.step([state.generation for state in states])
        except Exception:  # find the request that broke the batch; the others carry on alone
            outputs = []
            for state in list(states):
                try:
                    outputs.extend(self.decoder.step([state.generation]))
                except Exception as error:
                    states.remove(state)
                    self._fail(state, error)
        if self.snapshots is not None:
            self.snapshots.mark_changed()
        for state, output in zip(states, outputs):
            update = self._update_for(state, output)
            if update is None:
                continue
            if update.final:
                self._finish(state, update)
            else:
                self.emit(update)

    def _fail(self, state: RequestState, error: Exception) -> None:
        """One broken request ends with an error; the instance and the other requests go on."""
        self.log.log_error(f"Error generating request {state.id}: {traceback.format_exc()}")
        self._finish(state, Update.failed(state, FailureCode.INTERNAL, f"Error generating text: {error}"))

    def _update_for(self, state: RequestState, output: StepOutput) -> Update | None:
        """The response this step produces, if any: streaming sends only steps that made text."""
        request = state.request
        if state.first_output_time is None and output.token_ids:
            state.first_output_time = time.monotonic()
        state.unreported_tokens += len(output.token_ids)
        final = output.finish_reason is not None
        if request.stream:
            if not (output.text or final):
                return None
            text = output.text
        else:
            state.text_parts.append(output.text)
            if not final:
                return None
            text = (request.prompt if request.prepend_input else "") + "".join(state.text_parts)
        tokens, state.unreported_tokens = state.unreported_tokens, 0
        return Update(
            state,
            final=final,
            text=text,
            num_output_tokens=tokens,
            finish_reason=output.finish_reason,
            stats=state.generation.stats if final else None,
        )

    def _finish(self, state: RequestState, update: Update) -> None:
        """Send the request's one final response and free its generation."""
        if state.generation is not None:
            state.generation.close()
        state.finish_time = time.monotonic()
        if state in self.active:
            self.active.remove(state)
        self.emit(update)
        trie = self.decoder.trie
        if trie is not None and self.on_trie_size is not None:
            self.on_trie_size(trie.node_count, trie.byte_estimate)
