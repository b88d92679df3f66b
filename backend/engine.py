"""The engine thread: the only thread that touches the model, the decoder and the global trie.

`execute` hands validated requests over through a queue and returns at once. The engine
thread advances every in-flight request with one batched `LookaheadDecoder.step()` per
iteration (continuous batching: requests join and leave between steps, a new one starts reading
its prompt in the iteration it arrives), so a long generation never keeps a short one from
starting, and a long prompt, read in chunks, never stalls the running streams. It
turns each step into an `Update` for the response thread; it never blocks on IPC itself.
Between steps it hands the global trie to its keeper (lookahead/state/keeper.py: snapshots, the
fleet's stream), so neither ever sees a half-applied step.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from lookahead.runtime.decoder import LookaheadDecoder
from lookahead.runtime.generation import Generation, GenerationStats, StepOutput
from lookahead.runtime.logprobs import PositionLogprobs
from lookahead.runtime.step_timing import StepTimes
from lookahead.state.keeper import TrieKeeper
from lookahead.structured import CompiledGrammar, GrammarLimitError

from .config import BackendConfig
from .request import GenerationRequest
from .shaping import MAX_ERROR_CHARS, FailureCode, Update, merged_stats, sample_updates, updates_for

__all__ = ["MAX_ERROR_CHARS", "Engine", "FailureCode", "RequestState", "Update", "merged_stats"]

SHUTDOWN_MESSAGE = "the model is being unloaded; the request was not completed"
QUEUE_FULL = "the queue is full ({count} requests wait, max_queued_requests); retry later"
QUEUE_TIMEOUT = (
    "the request waited {waited:.1f} s in the queue, more than queue_timeout_s ({limit:g}); retry later"
)
ENGINE_FAILED = "the engine thread failed ({error}); the model must be reloaded (see the server log)"
# Errors after which the device cannot be trusted for anyone: the engine stops (vLLM's health check).
# The engine thread lets go of the GIL in every torch call and in many small numpy ones; the
# response thread may take it there, and the engine gets it back when that thread blocks (its
# send) or once the switch interval has passed. A short interval bounds that wait.
ENGINE_SWITCH_INTERVAL_S = 0.0005
_WAKE = object()  # in the inbox: the engine thread looks at `unloading` at once, even while idle
FATAL_ERRORS: tuple[type[BaseException], ...] = (torch.AcceleratorError,)


class Log(Protocol):
    """The part of pb_utils.Logger the engine uses (tests pass any object with these methods)."""

    def log_info(self, message: str) -> None: ...

    def log_warn(self, message: str) -> None: ...

    def log_error(self, message: str) -> None: ...


@dataclass(eq=False)
class RequestState:
    """One request, shared by `execute`, the engine thread and the response thread.

    `cancelled` is written only by the response thread (after its `is_cancelled()` checks)
    and read by the engine before each step; the rest after `request` is engine-thread only.
    """

    id: str
    sender: Any  # the Triton response sender: only the response thread calls it
    request: GenerationRequest | None = None  # None when rejected before reaching the engine
    grammar: CompiledGrammar | None = None  # its structured-output constraint, compiled before the engine
    arrival: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    generation: Generation | None = None
    first_output_time: float | None = None
    last_output_time: float | None = None
    finish_time: float | None = None
    unreported_tokens: int = 0  # decoded, but their text is still held back by the detokenizer
    unreported_logprobs: list[PositionLogprobs] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)  # non-streaming: the whole output so far
    prompt_logprobs_sent: bool = False
    answered: bool = False  # its final response went out (response thread only)
    # Several samples of the prompt (n, best_of): a state per sample, this one first; each sample's
    # last update (non-streaming: its whole output) once it finished.
    samples: list[RequestState] = field(default_factory=list)
    last_update: Update | None = None

    @property
    def longest(self) -> list[int]:
        """The most KV entries each of the request's samples can hold (see LookaheadDecoder.longest)."""
        request = self.request
        longest = LookaheadDecoder.longest(len(request.prompt_ids), request.sampling, request.lookahead)
        return [longest] * request.sampling.samples

    @property
    def members(self) -> list[RequestState]:
        """The states of the request's samples (this one alone unless it has several)."""
        return self.samples or [self]

    @property
    def stats(self) -> GenerationStats | None:
        """The request's stats: its samples' summed (the prompt counted once)."""
        every = [m.generation.stats for m in self.members if m.generation is not None]
        return merged_stats(every) if every else None


class TokenArrival(NamedTuple):
    """Tokens one step gave one request, for the per-step latency metrics."""

    state: RequestState
    count: int
    previous: float | None  # when its previous tokens came; None for its first ones


@dataclass(frozen=True)
class EngineStepTimes:
    """One engine iteration that ran a step: the decoder's parts (`StepTimes`) and the engine
    thread's own, in seconds; `wait` is the rest of the iteration's wall time (the GIL held by the
    response and metrics threads, the inbox)."""

    decoder: StepTimes
    admit: float  # the inbox, queue limits, starting generations
    respond: float  # turning the step's outputs into updates and queueing them
    keeper: float  # the global trie between steps
    wall: float

    @property
    def wait(self) -> float:
        return max(0.0, self.wall - self.decoder.total - self.admit - self.respond - self.keeper)

    def parts(self) -> dict[str, float]:
        """Every part by name; they add up to `wall`."""
        own = {"admit": self.admit, "respond": self.respond, "keeper": self.keeper, "wait": self.wait}
        return {**self.decoder.parts(), **own}


class Engine:
    """Owns the decoder; steps all in-flight generations together on one thread.

    At most max_running_requests run at once, and only as many as the decoder's KV bound holds;
    the others wait in arrival order. If the thread dies (a bug, a device error), every queued
    and running request gets a final UNAVAILABLE error, `running` turns false, the log says why
    and on_stopped(reason) is called (the model then reports not ready).
    """

    def __init__(
        self,
        decoder: LookaheadDecoder,
        emit: Callable[[Update], None],
        log: Log,
        keeper: TrieKeeper | None = None,
        on_trie_size: Callable[[int, int], None] | None = None,
        max_running_requests: int = BackendConfig.max_running_requests,
        on_stopped: Callable[[str], None] | None = None,
        max_queued_requests: int = BackendConfig.max_queued_requests,
        queue_timeout_s: float = BackendConfig.queue_timeout_s,
        on_step: Callable[[list[TokenArrival], float], None] | None = None,
        on_step_timed: Callable[[EngineStepTimes], None] | None = None,
        on_cost: Callable[[list[tuple[int, float | None, float | None]]], None] | None = None,
    ):
        self.decoder = decoder
        # Admission: which waiting requests start (the decoder's scheduler; this thread drives it).
        self.scheduler = decoder.scheduler
        self.scheduler.limit(max_running_requests, max_queued_requests, queue_timeout_s)
        decoder.debug_log = log.log_info  # the `debug` setting's per-step lines go to the server log
        self.emit = emit
        self.log = log
        self.keeper = keeper
        self.on_trie_size = on_trie_size
        self.unloading = False  # set once by unload(); read by the engine thread
        self.unload_message = SHUTDOWN_MESSAGE
        self.unloaded = threading.Event()  # set by the engine thread once unload() took effect
        self.on_stopped = on_stopped
        self.on_step = on_step  # told each step's tokens before their responses are emitted
        self.on_step_timed = on_step_timed  # told where each step's wall time went
        self.on_cost = on_cost  # told the planner's cost curve (CostModel.table) as requests finish
        self._began = 0.0  # when the engine's current iteration began (after any idle wait)
        self._responding = 0.0  # seconds the current step spent on its updates
        # Requests, _WAKE (look at `unloading` now) or None (stop).
        self.inbox: queue.SimpleQueue[RequestState | object | None] = queue.SimpleQueue()
        self.failure: str | None = None  # why the thread died, once it has
        self.lock = threading.Lock()  # orders submit() against the thread's death
        self.thread = threading.Thread(target=self._run, name="lookahead-engine", daemon=True)

    def start(self) -> None:
        sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)  # the stub process serves this model alone
        self.thread.start()

    @property
    def running(self) -> bool:
        """False once the thread has ended or is ending: after stop(), or after it failed."""
        return self.thread.is_alive() and self.failure is None

    def submit(self, state: RequestState) -> None:
        """Queue a validated request (state.request set); returns at once. After the thread died the
        request is answered UNAVAILABLE here."""
        with self.lock:
            if self.failure is None:
                self.inbox.put(state)
                return
            failure = self.failure
        self.emit(Update.failed(state, FailureCode.UNAVAILABLE, failure))

    def unload(self, message: str = SHUTDOWN_MESSAGE) -> threading.Event:
        """The server unloads the model or stops: end every request in flight, and any that still
        arrives, with UNAVAILABLE (message) at the next step. Triton finalizes a model only after its
        requests got their final responses, so a long stream would otherwise outlive the server's
        exit timeout. Returns an event set once the engine has ended them and saved the trie."""
        self.unload_message = message
        self.unloading = True
        self.inbox.put(_WAKE)
        return self.unloaded

    def stop(self, timeout_s: float | None = None) -> None:
        """Fail what is still in flight, stop syncing, take a last snapshot, and end the thread
        (waiting at most timeout_s for it)."""
        self.inbox.put(None)
        self.thread.join(timeout_s)

    def _run(self) -> None:
        message = SHUTDOWN_MESSAGE
        try:
            self._began = time.perf_counter()
            while self._admit():
                if self.unloading:
                    self._fail_everything(FailureCode.UNAVAILABLE, self.unload_message)
                    if not self.unloaded.is_set():
                        self._save()
                        self.unloaded.set()
                    continue
                admitted = time.perf_counter()
                stepped = self._advance()
                advanced = time.perf_counter()
                if self.keeper is not None:
                    self.keeper.between_steps()
                ended = time.perf_counter()
                if stepped and self.on_step_timed is not None:
                    self.on_step_timed(
                        EngineStepTimes(
                            self.decoder.last_step,
                            admitted - self._began,
                            self._responding,
                            ended - advanced,
                            ended - self._began,
                        )
                    )
                self._began = ended
        except BaseException as error:
            message = ENGINE_FAILED.format(error=f"{type(error).__name__}: {error}")
            self.log.log_error(
                f"The engine thread failed; the model must be reloaded: {traceback.format_exc()}"
            )
            with self.lock:
                self.failure = message
            raise
        finally:
            self._fail_everything(FailureCode.UNAVAILABLE, message)
            if self.keeper is not None:
                self.keeper.close()
                self.log.log_info(f"Saved {self.keeper.path} ({self.keeper.trie.node_count} trie nodes)")
            self.unloaded.set()
            if self.failure is not None and self.on_stopped is not None:
                self.on_stopped(self.failure)

    def _save(self) -> None:
        """A snapshot now (unload: the server may never call finalize)."""
        if self.keeper is not None:
            self.keeper.save()
            self.log.log_info(f"Saved {self.keeper.path} ({self.keeper.trie.node_count} trie nodes)")

    def _fail_everything(self, code: FailureCode, message: str) -> None:
        """A final error for every running, waiting and queued request (a queued stop stays queued)."""
        with self.lock:
            queued, stop = [], False
            while True:
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, RequestState):
                    queued.append(item)
                stop = stop or item is None
            if stop:
                self.inbox.put(None)
        for state in [*self.scheduler.running, *self.scheduler.waiting, *queued]:
            self._finish(state, Update.failed(state, code, message))

    def _admit(self) -> bool:
        """Move new requests into the waiting line (waiting while idle), then start as many as fit.
        False once stop() was called."""
        while True:
            idle = not self.scheduler.running and not self.scheduler.waiting
            try:
                state = self.inbox.get(block=idle, timeout=self._idle_timeout() if idle else None)
                if idle:
                    self._began = time.perf_counter()  # waiting for work is no step's time
            except queue.Empty:
                if not idle:
                    break
                if self.keeper is not None:
                    self.keeper.between_steps()  # only the keeper sets an idle timeout
                continue
            if state is None:
                return False
            if state is _WAKE:
                break
            self.scheduler.add(state)
        self._start_waiting()
        return True

    def _start_waiting(self) -> None:
        """Start the requests the scheduler admits; end those it drops from the queue (cancelled,
        waited too long, beyond max_queued_requests)."""
        admission = self.scheduler.schedule()
        for state in admission.cancelled:
            self._cancel(state)
        for state, waited in admission.timed_out:
            message = QUEUE_TIMEOUT.format(waited=waited, limit=self.scheduler.queue_timeout_s)
            self._finish(state, Update.failed(state, FailureCode.UNAVAILABLE, message))
        for state, count in admission.overflow:
            message = QUEUE_FULL.format(count=count)
            self._finish(state, Update.failed(state, FailureCode.UNAVAILABLE, message))
        for state in admission.started:
            request = state.request
            try:
                if request.sampling.samples > 1:
                    self._start_samples(state)
                else:
                    state.generation = self.decoder.start(
                        request.prompt_ids,
                        request.sampling,
                        request.lookahead,
                        state.id,
                        state.grammar,
                        checked=True,
                    )
            except ValueError as error:  # a request this model can never serve
                self._finish(state, Update.failed(state, FailureCode.INVALID_ARG, str(error)))
            except FATAL_ERRORS:
                raise
            except Exception as error:
                self._fail(state, error)

    def _start_samples(self, state: RequestState) -> None:
        """A request for several samples: a state per sample, each with its generation."""
        request = state.request
        generations = self.decoder.start_samples(
            request.prompt_ids, request.sampling, request.lookahead, state.id, state.grammar, checked=True
        )
        state.generation = generations[0]
        state.samples = [state] + [
            RequestState(
                f"{state.id}#{i}", None, request, state.grammar, state.arrival, generation=generation
            )
            for i, generation in enumerate(generations[1:], 1)
        ]

    def _idle_timeout(self) -> float | None:
        """While idle, wake up only for the keeper: a snapshot that is due, entries to insert."""
        return None if self.keeper is None else self.keeper.idle_timeout()

    def _advance(self) -> bool:
        """One batched step of every running request; cancelled ones end first. False when none
        was left to step."""
        for state in [s for s in self.scheduler.running if s.cancelled]:
            self._cancel(state)
        # One forward for everyone: new requests read their prompts in chunks beside the running
        # requests' steps, so a long prompt never stalls a stream for more than a step.
        if not self.scheduler.running:
            return False
        self._step(list(self.scheduler.running))
        return True

    def _step(self, states: list[RequestState]) -> None:
        """One decoder.step() for these requests, then their updates. A request whose own work
        failed ends with INTERNAL; a failed shared forward is retried request by request (nothing
        was committed yet)."""
        running = {id(state): _running(state) for state in states}
        try:
            stepped = self.decoder.step([m.generation for s in states for m in running[id(s)]])
            outputs = iter(stepped)
            results = {id(s): [next(outputs) for _ in running[id(s)]] for s in states}
        except FATAL_ERRORS:
            raise
        except Exception:
            results = {}
            for state in list(states):
                try:
                    results[id(state)] = self.decoder.step([m.generation for m in running[id(state)]])
                except FATAL_ERRORS:
                    raise
                except Exception as error:
                    states.remove(state)
                    self._fail(state, error)
        if self.keeper is not None:
            self.keeper.mark_changed()
        responding = time.perf_counter()
        pairs = {id(s): list(zip(running[id(s)], results[id(s)])) for s in states}
        self._timestamp([pair for s in states for pair in pairs[id(s)]])
        for state in states:
            error = next((output.error for _, output in pairs[id(state)] if output.error is not None), None)
            if error is not None:
                self._fail(state, error)
                continue
            if state.samples:
                updates = sample_updates(state, pairs[id(state)])
            else:
                updates = updates_for(state, pairs[id(state)][0][1])
            for update in updates:
                if update.final:
                    self._finish(state, update)
                else:
                    self.emit(update)
        self._responding = time.perf_counter() - responding

    def _timestamp(self, pairs: list[tuple[RequestState, StepOutput]]) -> None:
        """Note when each request's (or sample's) tokens came, and tell on_step before any response
        goes out."""
        now, arrivals = time.monotonic(), []
        for state, output in pairs:
            if output.error is None and output.token_ids:
                arrivals.append(TokenArrival(state, len(output.token_ids), state.last_output_time))
                if state.first_output_time is None:
                    state.first_output_time = now
                state.last_output_time = now
        if arrivals and self.on_step is not None:
            self.on_step(arrivals, now)

    def _cancel(self, state: RequestState) -> None:
        """End a cancelled request (the response thread has answered it already)."""
        self._finish(state, Update.failed(state, FailureCode.CANCELLED, "Request was cancelled"))

    def _fail(self, state: RequestState, error: BaseException) -> None:
        """One broken request ends with an error; the instance and the other requests go on. A
        constraint that outgrew the grammar engine's limits is the request's own: INVALID_ARG."""
        if isinstance(error, GrammarLimitError):
            self.log.log_warn(f"Request {state.id} ended: {error}")
            self._finish(state, Update.failed(state, FailureCode.INVALID_ARG, str(error)))
            return
        trace = "".join(traceback.format_exception(error))
        self.log.log_error(f"Error generating request {state.id}: {trace}")
        self._finish(state, Update.failed(state, FailureCode.INTERNAL, f"Error generating text: {error}"))

    def _finish(self, state: RequestState, update: Update) -> None:
        """Send the request's one final response, free its generations and publish what the global
        trie learned from them."""
        for member in state.members:
            if member.generation is not None:
                member.generation.close()
                if self.keeper is not None:
                    self.keeper.learned_from(member.generation)
        state.finish_time = time.monotonic()
        self.scheduler.finish(state)
        self.emit(update)
        if self.on_cost is not None:
            self.on_cost(self.decoder.cost.table())
        trie = self.decoder.trie
        if trie is not None and self.on_trie_size is not None:
            self.on_trie_size(trie.node_count, trie.byte_estimate)


def _running(state: RequestState) -> list[RequestState]:
    """The request's samples still generating (itself, unless it has several)."""
    return [m for m in state.members if m.generation is not None and not m.generation.finished]
