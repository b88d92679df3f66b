"""The response thread: the only thread that calls a response sender.

`send()` and `is_cancelled()` are blocking IPC round trips to the server process, so they run
here and never on the engine thread (vLLM backend PR #46/#54). Every CANCEL_POLL_S we ask each
request in flight whether its client cancelled (not after every send: on two cores each round
trip is time the forward's threads lose to the server process). A cancelled request is answered
here at once (a step can take seconds: a long prompt chunk, a loaded machine); the engine drops it
before its next step and its later updates are not sent.
While requests are in flight it also asks the server whether the model is still served: Triton
finalizes a model only after its requests end, so an unload (or a server shutdown) must reach
the engine through here.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import traceback
from collections.abc import Callable

import numpy as np
import triton_python_backend_utils as pb_utils

from lookahead.runtime.logprobs import vllm_json

from .engine import Log, RequestState, Update

_NOTHING = object()  # the queue was empty for CANCEL_POLL_S
CANCEL_POLL_S = 0.2  # how often requests without recent responses are asked is_cancelled()
SERVED_POLL_S = (
    1.0  # how often, while requests are in flight, the server is asked whether the model is served
)


def build_response(update: Update) -> pb_utils.InferenceResponse:
    """The Triton response for one update; outputs the client did not ask for are left out. Each
    per-sample output holds one element per returned sample (one, unless the request asked for n)."""
    if update.failure is not None:
        return error_response(update.failure.value, update.message)
    request, pieces = update.state.request, update.pieces

    def strings(values: list[str]) -> np.ndarray:
        return np.array([value.encode("utf-8") for value in values], dtype=np.object_)

    tensors = [pb_utils.Tensor("text_output", strings([piece.text for piece in pieces]))]
    if request.return_finish_reason:  # as the vLLM backend sends it: "None" until the final response
        tensors.append(pb_utils.Tensor("finish_reason", strings([str(p.finish_reason) for p in pieces])))
    if request.return_cumulative_logprob:
        values = [math.nan if p.cumulative_logprob is None else p.cumulative_logprob for p in pieces]
        tensors.append(pb_utils.Tensor("cumulative_logprob", np.array(values, dtype=np.float32)))
    if request.return_logprobs:
        tensors.append(pb_utils.Tensor("logprobs", strings([vllm_json(p.logprobs) for p in pieces])))
    prompt_logprobs = next((p.prompt_logprobs for p in pieces if p.prompt_logprobs is not None), None)
    if prompt_logprobs is not None:
        tensors.append(pb_utils.Tensor("prompt_logprobs", strings([vllm_json(prompt_logprobs)])))
    if request.return_num_input_tokens:
        tensors.append(
            pb_utils.Tensor("num_input_tokens", np.array([len(request.prompt_ids)], dtype=np.uint32))
        )
    if request.return_num_output_tokens:
        counts = np.array([piece.num_output_tokens for piece in pieces], dtype=np.uint32)
        tensors.append(pb_utils.Tensor("num_output_tokens", counts))
    if request.return_perf_metrics and update.final and update.stats is not None:
        stats = update.stats
        tensors += [
            pb_utils.Tensor("total_draft_tokens", np.array([stats.draft_tokens], dtype=np.int32)),
            pb_utils.Tensor(
                "total_accepted_draft_tokens", np.array([stats.accepted_draft_tokens], dtype=np.int32)
            ),
            pb_utils.Tensor("num_decoding_steps", np.array([stats.steps], dtype=np.int32)),
            pb_utils.Tensor("acceptance_rate", np.array([stats.acceptance_rate], dtype=np.float32)),
        ]
    return pb_utils.InferenceResponse(output_tensors=tensors)


def error_response(code: str, message: str) -> pb_utils.InferenceResponse:
    # The stub adds TritonError & co. to pb_utils after importing model.py: look them up late.
    error = pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


class ResponseLoop:
    """Sends queued updates in order; exactly one FINAL per request, since the engine emits one.

    A response that cannot be built becomes a final INTERNAL error, and a final one that cannot be
    sent is retried as a bare final flag: whatever fails, the thread goes on and the client is
    answered. `on_final` gets the engine's final update of each request before it is sent.
    `served()` (the server's readiness of this model) turning false calls `on_unload()`.
    """

    def __init__(
        self,
        log: Log,
        on_final: Callable[[Update], None],
        served: Callable[[], bool] = lambda: True,
        on_unload: Callable[[], None] = lambda: None,
        on_sent: Callable[[float], None] | None = None,
    ):
        self.log = log
        self.on_final = on_final
        self.on_sent = on_sent  # told the seconds each response took to build and send
        self.served, self.on_unload = served, on_unload
        self.unloading = False
        self.last_served_check = time.monotonic()
        # Updates to send, requests to watch for cancellation, work to run once what is before it
        # was sent, or None to stop.
        self.queue: queue.SimpleQueue[Update | RequestState | Callable[[], None] | None] = queue.SimpleQueue()
        self.in_flight: set[RequestState] = set()  # response-thread only
        self.last_poll = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="lookahead-responses", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def watch(self, state: RequestState) -> None:
        """Poll this request for cancellation until its FINAL is sent; call before the engine sees it."""
        self.queue.put(state)

    def put(self, update: Update) -> None:
        """Queue a response; never blocks (called from the engine thread and from execute)."""
        self.queue.put(update)

    def after_queued(self, work: Callable[[], None]) -> None:
        """Run `work` on this thread once every response queued so far has been sent."""
        self.queue.put(work)

    def stop(self, timeout_s: float | None = None) -> None:
        """Send everything queued so far, then end the thread (waiting at most timeout_s)."""
        self.queue.put(None)
        self.thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            try:
                item = self.queue.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                item = _NOTHING
            if item is None:
                return
            try:
                self._handle(item)
                if time.monotonic() - self.last_poll >= CANCEL_POLL_S:
                    self._poll_cancellations()
                    self._check_served()
            except Exception:  # this is the only thread that answers clients: it must go on
                self.log.log_error(f"Error in the response thread: {traceback.format_exc()}")

    def _handle(self, item: Update | RequestState | Callable[[], None]) -> None:
        if item is _NOTHING:
            return
        if isinstance(item, RequestState):
            self.in_flight.add(item)
        elif isinstance(item, Update):
            started = time.perf_counter()
            self._send(item)
            if self.on_sent is not None:
                self.on_sent(time.perf_counter() - started)
        else:
            try:
                item()
            except Exception:
                self.log.log_error(f"Error after the responses were sent: {traceback.format_exc()}")

    def _send(self, update: Update) -> None:
        state = update.state
        if update.final:  # the engine's one final update of the request: its metrics go out first
            try:
                self.on_final(update)
            except Exception:
                self.log.log_error(f"Error recording request {state.id}: {traceback.format_exc()}")
        if state.answered:  # it already got a final error in place of a response that failed
            return
        final = update.final
        try:
            response = build_response(update)
        except Exception as error:
            self.log.log_error(f"Error building a response for request {state.id}: {traceback.format_exc()}")
            response, final = error_response("INTERNAL", f"Error building the response: {error}"), True
            state.cancelled = True  # the engine stops generating for it
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        try:
            state.sender.send(response, flags=flags)
        except Exception:  # a vanished client must not stop the responses of the others
            self.log.log_error(f"Error sending a response for request {state.id}: {traceback.format_exc()}")
            if final:
                self._complete(state)
        if final:
            state.answered = True
            self.in_flight.discard(state)

    def _end_cancelled(self, state: RequestState) -> None:
        """The client cancelled: its final CANCELLED response goes out now, logged in the vLLM
        backend's words (its clients read the log); the engine drops the request before its next step."""
        self.log.log_info(f"[vllm] Cancelling the request {state.id}")
        state.cancelled = True
        try:
            state.sender.send(
                error_response("CANCELLED", "Request was cancelled"),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        except Exception:
            self.log.log_error(
                f"Error sending the cancellation of request {state.id}: {traceback.format_exc()}"
            )
            self._complete(state)
        state.answered = True
        self.in_flight.discard(state)
        self.log.log_info(f"[vllm] Successfully cancelled the request {state.id}")

    def _complete(self, state: RequestState) -> None:
        """The bare final flag, so the request completes even when its final response failed."""
        try:
            state.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            self.log.log_error(f"Could not complete request {state.id}: {traceback.format_exc()}")

    def _check_served(self) -> None:
        """While requests are in flight, at most every SERVED_POLL_S: is the model still served?"""
        if self.unloading or not self.in_flight:
            return
        if time.monotonic() - self.last_served_check < SERVED_POLL_S:
            return
        self.last_served_check = time.monotonic()
        if not self.served():
            self.unloading = True
            self.log.log_info(f"The model is being unloaded: ending {len(self.in_flight)} requests in flight")
            self.on_unload()

    def _poll_cancellations(self) -> None:
        """Ask every request still in flight: one IPC each, at most every CANCEL_POLL_S."""
        self.last_poll = time.monotonic()
        for state in list(self.in_flight):
            try:
                cancelled = state.sender.is_cancelled()
            except Exception:
                self.log.log_error(f"is_cancelled() failed for request {state.id}: {traceback.format_exc()}")
                continue
            if cancelled:
                self._end_cancelled(state)
