"""The response thread: the only thread that calls a response sender.

`send()` and `is_cancelled()` are blocking IPC round trips to the server process, so they run
here and never on the engine thread (vLLM backend PR #46/#54). After each non-final send we ask
whether the client cancelled, and we poll requests that have not had a response for a while
(non-streaming ones, or a long prefill), so the engine learns of a cancellation within a step.
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

CANCEL_POLL_S = 0.2  # how often requests without recent responses are asked is_cancelled()


def build_response(update: Update) -> pb_utils.InferenceResponse:
    """The Triton response for one update; outputs the client did not ask for are left out."""
    if update.failure is not None:
        # The stub adds TritonError & co. to pb_utils after importing model.py: look them up late.
        code = getattr(pb_utils.TritonError, update.failure.value)
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(update.message, code))
    request = update.state.request
    tensors = [pb_utils.Tensor("text_output", np.array([update.text.encode("utf-8")], dtype=np.object_))]
    if request.return_finish_reason:  # as the vLLM backend sends it: "None" until the final response
        reason = str(update.finish_reason).encode()
        tensors.append(pb_utils.Tensor("finish_reason", np.array([reason], dtype=np.object_)))
    if request.return_cumulative_logprob:
        value = math.nan if update.cumulative_logprob is None else update.cumulative_logprob
        tensors.append(pb_utils.Tensor("cumulative_logprob", np.array([value], dtype=np.float32)))
    if request.return_logprobs:
        tensors.append(
            pb_utils.Tensor("logprobs", np.array([vllm_json(update.logprobs).encode()], dtype=np.object_))
        )
    if update.prompt_logprobs is not None:
        tensors.append(
            pb_utils.Tensor(
                "prompt_logprobs", np.array([vllm_json(update.prompt_logprobs).encode()], dtype=np.object_)
            )
        )
    if request.return_num_input_tokens:
        tensors.append(
            pb_utils.Tensor("num_input_tokens", np.array([len(request.prompt_ids)], dtype=np.uint32))
        )
    if request.return_num_output_tokens:
        tensors.append(
            pb_utils.Tensor("num_output_tokens", np.array([update.num_output_tokens], dtype=np.uint32))
        )
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


class ResponseLoop:
    """Sends queued updates in order; exactly one FINAL per request, since the engine emits one."""

    def __init__(self, log: Log, on_final: Callable[[Update], None]):
        self.log = log
        self.on_final = on_final
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

    def stop(self) -> None:
        """Send everything queued so far, then end the thread."""
        self.queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        while True:
            try:
                item = self.queue.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                self._poll_cancellations()
                continue
            if item is None:
                return
            if isinstance(item, RequestState):
                self.in_flight.add(item)
            elif isinstance(item, Update):
                self._send(item)
            else:
                try:
                    item()
                except Exception:
                    self.log.log_error(f"Error after the responses were sent: {traceback.format_exc()}")
            if time.monotonic() - self.last_poll >= CANCEL_POLL_S:
                self._poll_cancellations()

    def _send(self, update: Update) -> None:
        state = update.state
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if update.final else 0
        try:
            state.sender.send(build_response(update), flags=flags)
            if not update.final:
                state.cancelled = state.sender.is_cancelled()
        except Exception:  # a vanished client must not stop the responses of the others
            self.log.log_error(f"Error sending a response for request {state.id}: {traceback.format_exc()}")
        if update.final:
            self.in_flight.discard(state)
            self.on_final(update)

    def _poll_cancellations(self) -> None:
        """Ask every request still in flight: one IPC each, at most every CANCEL_POLL_S."""
        self.last_poll = time.monotonic()
        for state in list(self.in_flight):
            if not state.cancelled:
                try:
                    state.cancelled = state.sender.is_cancelled()
                except Exception:
                    self.log.log_error(
                        f"is_cancelled() failed for request {state.id}: {traceback.format_exc()}"
                    )
