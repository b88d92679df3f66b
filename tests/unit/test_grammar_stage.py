"""Constraints are compiled before their requests reach the engine: on the grammar stage's thread,
one at a time, never on Triton's request thread nor on the engine thread; a constraint that
outgrows llguidance's limits mid-generation ends its own request with INVALID_ARG."""

from __future__ import annotations

import json
import threading
import time

import pytest

from backend.engine import QUEUE_FULL, Engine, FailureCode, RequestState
from backend.grammars import GrammarStage
from backend.request import GenerationRequest
from lookahead import LookaheadConfig, LookaheadDecoder, SamplingParams
from lookahead.config import StructuredOutputs
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import load_tokenizer
from lookahead.runtime.decoder import StepOutput
from lookahead.structured import GrammarCompiler, GrammarLimitError
from tests.unit.test_backend_request import Recorder, run_engine, steps, submit
from tests.unit.test_grammar_bounds import children

VOCAB = 49152
YES_NO = StructuredOutputs("choice", json.dumps(["yes", "no"]))
SLOW = StructuredOutputs("grammar", "\n" * 60_000 + "x")  # seconds of GBNF detection


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


def constrained(name: str, spec: StructuredOutputs, prompt_ids: tuple[int, ...] = (120,)) -> RequestState:
    state = RequestState(id=name, sender=None)
    state.request = GenerationRequest(
        prompt="x",
        prompt_ids=prompt_ids,
        sampling=SamplingParams(max_tokens=4, structured_outputs=spec),
        lookahead=LookaheadConfig(),
        stream=True,
        prepend_input=False,
    )
    return state


class Stage:
    """A GrammarStage whose submissions and errors are recorded."""

    def __init__(self, compiler: GrammarCompiler, max_waiting: int = 0):
        self.recorder = Recorder()
        self.submitted: list[RequestState] = []
        self.arrived = threading.Semaphore(0)
        self.stage = GrammarStage(compiler, self._submit, self._emit, self.recorder, max_waiting)

    def _submit(self, state: RequestState) -> None:
        self.submitted.append(state)
        self.arrived.release()

    def _emit(self, update) -> None:
        self.recorder.emit(update)
        self.arrived.release()

    def wait(self, count: int, timeout_s: float = 30) -> None:
        for _ in range(count):
            assert self.arrived.acquire(timeout=timeout_s)


def test_the_stage_compiles_in_order_while_put_returns_at_once(tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], VOCAB, timeout_s=1.0)
    stage = Stage(compiler)
    stage.stage.start()
    slow, good, cancelled = constrained("slow", SLOW), constrained("good", YES_NO), constrained("gone", SLOW)
    before = children()
    for state in (slow, good, cancelled):
        stage.stage.put(state)
    cancelled.cancelled = True  # the engine answers it: no compile
    assert not stage.submitted and not stage.recorder.updates
    assert wait_for(lambda: children() - before)  # the slow compile runs in a process of its own
    stage.wait(3)
    [refused] = stage.recorder.of(slow)
    assert refused.failure is FailureCode.INVALID_ARG
    assert refused.message == "structured_outputs.grammar: the grammar did not compile within 1 s"
    assert stage.submitted == [good, cancelled]
    assert good.grammar is not None and cancelled.grammar is None
    stage.stage.close("unloading")


def test_closing_stops_the_compile_in_progress_and_refuses_the_waiting(tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], VOCAB, timeout_s=60)
    stage = Stage(compiler, max_waiting=2)
    stage.stage.start()
    compiler.tokenizer()
    running, waiting = constrained("running", SLOW), constrained("waiting", YES_NO)
    stage.stage.put(running)
    assert wait_for(lambda: children())  # compiling
    stage.stage.put(waiting)
    stage.stage.put(constrained("third", YES_NO))
    full = constrained("full", YES_NO)
    stage.stage.put(full)
    assert stage.recorder.of(full)[0].message == QUEUE_FULL.format(count=2)
    started = time.monotonic()
    stage.stage.close("the model is being unloaded", wait_s=10)
    assert time.monotonic() - started < 2 and not stage.stage.thread.is_alive()
    for state in (running, waiting):
        [update] = stage.recorder.of(state)
        assert (update.failure, update.message) == (FailureCode.UNAVAILABLE, "the model is being unloaded")
    late = constrained("late", YES_NO)
    stage.stage.put(late)
    assert stage.recorder.of(late)[0].failure is FailureCode.UNAVAILABLE
    assert not stage.submitted


def wait_for(condition, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_engine_starts_a_request_with_its_compiled_grammar_and_never_compiles(tiny_model, tokenizer):
    decoder = LookaheadDecoder(
        tiny_model("llama", vocab_size=VOCAB), tokenizer, None, LookaheadConfig(), (2,)
    )
    state = constrained("c", YES_NO, tuple(tokenizer.encode("Answer:")))
    state.grammar = decoder.grammars.compile(YES_NO)
    compiled_on: list[str] = []

    class NoCompiles(GrammarCompiler):  # the cache lost the grammar while the request waited
        def compile(self, spec):
            compiled_on.append(threading.current_thread().name)
            raise AssertionError("a compile on the engine thread")

    decoder.grammars = NoCompiles(tokenizer, [2], VOCAB, timeout_s=1)
    recorder = Recorder()
    engine = Engine(decoder, recorder.emit, recorder)
    engine.submit(state)
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    updates = recorder.of(state)
    assert updates[-1].failure is None, updates[-1].message
    assert "".join(u.text for u in updates) in ("yes", "no") and not compiled_on


def test_a_constraint_outgrowing_the_grammar_limits_ends_its_request_with_invalid_arg():
    reason = "structured_outputs.regex: lexer error: too many expressions constructed"
    failed = StepOutput([], "", "error", error=GrammarLimitError(reason))
    engine, _, recorder = run_engine({"g": [steps("a", "b")[0], failed], "o": steps("x", "y")})
    grammar = submit(engine, "g", stream=True, prepend_input=False)
    other = submit(engine, "o", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(2)
    engine.stop()
    assert [(u.text, u.failure, u.message) for u in recorder.of(grammar)] == [
        ("a", None, ""),
        ("", FailureCode.INVALID_ARG, reason),
    ]
    assert [u.text for u in recorder.of(other)] == ["x", "y"] and recorder.of(other)[-1].failure is None
    assert not recorder.errors  # the client's constraint, not a server failure: no traceback logged
