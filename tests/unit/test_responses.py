"""The response thread: every request gets its final response, whatever fails on the way.

pb_utils exists only inside Triton's stub; a minimal stand-in records what would be sent.
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
from typing import Any

import pytest

from backend.engine import FailureCode, RequestState, Update
from backend.request import GenerationRequest
from lookahead.config import LookaheadConfig, SamplingParams

FINAL = 1


class TritonError:
    INTERNAL, UNAVAILABLE, INVALID_ARG, CANCELLED = "INTERNAL", "UNAVAILABLE", "INVALID_ARG", "CANCELLED"

    def __init__(self, message: str, code: str):
        self.message, self.code = message, code


class InferenceResponse:
    def __init__(self, output_tensors: list[Any], error: TritonError | None = None):
        self.outputs = {tensor.name: tensor.array for tensor in output_tensors}
        self.error = error


class Tensor:
    def __init__(self, name: str, array: Any):
        self.name, self.array = name, array


@pytest.fixture
def responses(monkeypatch: pytest.MonkeyPatch) -> Any:
    stand_in = types.ModuleType("triton_python_backend_utils")
    stand_in.TritonError, stand_in.InferenceResponse, stand_in.Tensor = TritonError, InferenceResponse, Tensor
    stand_in.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stand_in)
    monkeypatch.delitem(sys.modules, "backend.responses", raising=False)
    return importlib.import_module("backend.responses")


class Sender:
    """Records (response, flags); fails the sends listed in `failing` (by their index)."""

    def __init__(self, failing: tuple[int, ...] = ()):
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self.failing, self.calls = failing, 0
        self.done = threading.Event()
        self.cancelled = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        self.calls += 1
        if self.calls - 1 in self.failing:
            raise RuntimeError("the stub could not send")
        self.sent.append((response, flags))
        if flags == FINAL:
            self.done.set()

    def is_cancelled(self) -> bool:
        return self.cancelled


class Log:
    def __init__(self):
        self.errors: list[str] = []
        self.info: list[str] = []

    def log_info(self, message: str) -> None:
        self.info.append(message)

    log_warn = log_info

    def log_error(self, message: str) -> None:
        self.errors.append(message)


def state(name: str, sender: Sender) -> RequestState:
    request = GenerationRequest(
        prompt="p", prompt_ids=(1,), sampling=SamplingParams(max_tokens=4), lookahead=LookaheadConfig()
    )
    return RequestState(id=name, sender=sender, request=request)


def run(responses: Any, updates: list[Update], **loop: Any) -> tuple[Any, Log]:
    log = Log()
    sending = responses.ResponseLoop(log, **{"on_final": lambda update: None, **loop})
    sending.start()
    for update in updates:
        sending.put(update)
    return sending, log


def test_a_final_response_that_cannot_be_built_becomes_a_final_error_and_the_next_request_is_answered(
    responses,
):
    broken, healthy = Sender(), Sender()
    a, b = state("a", broken), state("b", healthy)
    unencodable = "\ud800"  # a lone surrogate: text_output cannot encode it
    sending, log = run(responses, [Update(a, final=True, text=unencodable), Update(b, final=True, text="ok")])
    assert broken.done.wait(5) and healthy.done.wait(5)
    sending.stop()
    [(response, flags)] = broken.sent
    assert flags == FINAL and response.error.code == "INTERNAL"
    assert "Error building the response" in response.error.message
    assert healthy.sent[0][0].outputs["text_output"].tolist() == [b"ok"]
    assert any("Error building a response for request a" in error for error in log.errors)


def test_a_failed_non_final_response_ends_the_request_and_its_later_updates_are_dropped(responses):
    sender = Sender()
    a = state("a", sender)
    sending, _ = run(responses, [Update(a, final=False, text="\ud800"), Update(a, final=True, text="end")])
    assert sender.done.wait(5)
    sending.stop()
    assert [(r.error.code, flags) for r, flags in sender.sent] == [("INTERNAL", FINAL)]
    assert a.cancelled  # the engine stops generating for it


def test_a_final_send_that_fails_is_completed_with_a_bare_final_flag(responses):
    sender = Sender(failing=(0,))
    a = state("a", sender)
    sending, _ = run(responses, [Update(a, final=True, text="lost")])
    assert sender.done.wait(5)
    sending.stop()
    assert sender.sent == [(None, FINAL)]


def test_a_failing_final_callback_does_not_stop_the_thread(responses):
    first, second = Sender(), Sender()

    def on_final(update: Update) -> None:
        raise RuntimeError("metrics broke")

    updates = [
        Update(state("a", first), final=True, text="1"),
        Update(state("b", second), final=True, text="2"),
    ]
    sending, log = run(responses, updates, on_final=on_final)
    assert second.done.wait(5)
    sending.stop()
    assert len([e for e in log.errors if "metrics broke" in e]) == 2


def test_an_unserved_model_ends_its_requests_in_flight_once(responses, monkeypatch):
    monkeypatch.setattr(responses, "SERVED_POLL_S", 0.05)
    unloads = threading.Semaphore(0)
    sending, _ = run(responses, [], served=lambda: False, on_unload=unloads.release)
    sending.watch(state("a", Sender()))
    assert unloads.acquire(timeout=5)
    assert not unloads.acquire(timeout=0.5)
    sending.stop()


def test_failed_updates_carry_their_code(responses):
    sender = Sender()
    a = state("a", sender)
    sending, _ = run(responses, [Update.failed(a, FailureCode.UNAVAILABLE, "the model is being unloaded")])
    assert sender.done.wait(5)
    sending.stop()
    assert [(r.error.code, r.error.message) for r, _ in sender.sent] == [
        ("UNAVAILABLE", "the model is being unloaded")
    ]


def test_a_cancelled_request_is_answered_at_the_next_poll_and_its_engine_final_only_recorded(
    responses, monkeypatch
):
    monkeypatch.setattr(responses, "CANCEL_POLL_S", 0.05)
    sender, recorded = Sender(), []
    a = state("a", sender)
    sending, log = run(responses, [], on_final=recorded.append)
    sending.watch(a)
    sender.cancelled = True  # the client cancels while the engine is still in a step
    assert sender.done.wait(5)
    assert a.cancelled and a.answered  # the engine drops it before its next step
    assert [(r.error.code, r.error.message, flags) for r, flags in sender.sent] == [
        ("CANCELLED", "Request was cancelled", FINAL)
    ]
    # The vLLM backend's log lines, which its cancellation test reads.
    assert log.info == ["[vllm] Cancelling the request a", "[vllm] Successfully cancelled the request a"]
    engine_final = Update.failed(a, FailureCode.CANCELLED, "Request was cancelled")
    sending.put(engine_final)
    sending.stop()
    assert len(sender.sent) == 1 and recorded == [engine_final]


def test_the_final_update_is_recorded_before_it_is_sent(responses):
    sender, order = Sender(), []
    original_send = sender.send
    sender.send = lambda *args, **kwargs: (order.append("send"), original_send(*args, **kwargs))
    sending, _ = run(
        responses,
        [Update(state("a", sender), final=True, text="x")],
        on_final=lambda u: order.append("record"),
    )
    assert sender.done.wait(5)
    sending.stop()
    assert order == ["record", "send"]


def test_a_response_of_several_samples_holds_an_element_per_sample(responses):
    request = GenerationRequest(
        prompt="p",
        prompt_ids=(1, 2),
        sampling=SamplingParams(max_tokens=4, temperature=1.0, n=2),
        lookahead=LookaheadConfig(),
        return_finish_reason=True,
        return_num_output_tokens=True,
        return_num_input_tokens=True,
        return_cumulative_logprob=True,
    )
    owner = RequestState(id="a", sender=Sender(), request=request)
    pieces = (
        Update(owner, final=False, text="ab", num_output_tokens=2, cumulative_logprob=-1.5),
        Update(owner, final=False, text="", finish_reason="stop", cumulative_logprob=-0.25),
    )
    response = responses.build_response(Update(owner, final=False, samples=pieces))
    assert response.outputs["text_output"].tolist() == [b"ab", b""]
    assert response.outputs["finish_reason"].tolist() == [b"None", b"stop"]
    assert response.outputs["num_output_tokens"].tolist() == [2, 0]
    assert response.outputs["cumulative_logprob"].tolist() == [-1.5, -0.25]
    assert response.outputs["num_input_tokens"].tolist() == [2]  # the prompt, shared
