"""Structured-output constraints compiled before their requests reach the engine.

A compile takes from milliseconds up to grammar_compile_timeout_s (in a process of its own,
lookahead/structured/compiler.py). Triton's request thread only queues a request whose grammar
is not compiled yet; this stage's thread compiles them one at a time, in arrival order, and hands
each to the engine with its grammar, or answers it INVALID_ARG. So neither Triton's thread (every
new request to the model) nor the engine thread (every running stream) waits for a compile.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from lookahead.structured import GrammarCompiler

from .engine import QUEUE_FULL, FailureCode, Log, RequestState, Update


class GrammarStage:
    """The thread that compiles queued requests' constraints; `put` never blocks.

    submit: hands a request to the engine (state.grammar set). emit: a request's final error.
    max_waiting: requests waiting for a compile beyond this many get UNAVAILABLE (0: no bound).
    """

    def __init__(
        self,
        compiler: GrammarCompiler,
        submit: Callable[[RequestState], None],
        emit: Callable[[Update], None],
        log: Log,
        max_waiting: int = 0,
    ):
        self.compiler = compiler
        self.submit, self.emit, self.log = submit, emit, log
        self.max_waiting = max_waiting
        self.waiting: deque[RequestState] = deque()
        self.closed: str | None = None  # why requests are refused, once close() was called
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="lookahead-grammars", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def put(self, state: RequestState) -> None:
        """Queue a validated request whose constraint is not compiled yet."""
        with self.changed:
            refusal = self.closed
            if refusal is None and self.max_waiting and len(self.waiting) >= self.max_waiting:
                refusal = QUEUE_FULL.format(count=len(self.waiting))
            if refusal is None:
                self.waiting.append(state)
                self.changed.notify()
                return
        self.emit(Update.failed(state, FailureCode.UNAVAILABLE, refusal))

    def close(self, message: str, wait_s: float = 0.0) -> None:
        """The model stops serving: the compile in progress stops, every waiting request and every
        later one gets UNAVAILABLE (message). Waits at most wait_s for the thread to end."""
        with self.changed:
            if self.closed is None:
                self.closed = message
            waiting, self.waiting = list(self.waiting), deque()
            self.changed.notify()
        self.compiler.close()
        for state in waiting:
            self.emit(Update.failed(state, FailureCode.UNAVAILABLE, message))
        if self.thread.is_alive() and wait_s > 0:
            self.thread.join(wait_s)

    def _run(self) -> None:
        try:
            self.compiler.tokenizer()  # built now (~0.5 s), not when the first constraint waits for it
        except ValueError:
            pass  # each constraint's compile reports it
        while True:
            with self.changed:
                while not self.waiting and self.closed is None:
                    self.changed.wait()
                if self.closed is not None:
                    return
                state = self.waiting.popleft()
            self._compile(state)

    def _compile(self, state: RequestState) -> None:
        """Compile the request's constraint, then hand it to the engine (a cancelled request too: the
        engine answers it), or answer it INVALID_ARG."""
        if not state.cancelled:
            try:
                state.grammar = self.compiler.compile(state.request.sampling.structured_outputs)
            except ValueError as error:
                code, message = FailureCode.INVALID_ARG, str(error)
                if self.closed is not None:
                    code, message = FailureCode.UNAVAILABLE, self.closed
                self.emit(Update.failed(state, code, message))
                return
            except Exception as error:  # still exactly one final response for this request
                self.log.log_error(f"Error compiling the constraint of request {state.id}: {error!r}")
                self.emit(
                    Update.failed(state, FailureCode.INTERNAL, f"Error compiling the constraint: {error}")
                )
                return
        if self.closed is not None:
            self.emit(Update.failed(state, FailureCode.UNAVAILABLE, self.closed))
            return
        self.submit(state)
