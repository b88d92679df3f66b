"""What bounds a structured-output compile: its size, a process of its own that is killed at the
timeout (the caller's process keeps running meanwhile), one compile at a time, refusals
remembered, and llguidance's limits failing a request cleanly mid-generation."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from lookahead import LookaheadConfig, LookaheadDecoder, SamplingParams
from lookahead.config import StructuredOutputs
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import load_tokenizer
from lookahead.structured import GrammarCompiler, GrammarLimitError
from lookahead.structured import compiler as compiler_module
from lookahead.structured.isolation import ChildFailure, run_in_child

VOCAB = 49152
# llguidance's GBNF detection and conversion run in Python, quadratic in the line count: seconds here.
NEWLINES = StructuredOutputs("grammar", "\n" * 60_000 + "x")
# Compiles and masks its first step at once, then needs more lexer states than llguidance allows.
EXPLODING = StructuredOutputs("regex", "[a-z]{1,3}(a{1000}){1000}")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


def compiler_for(tokenizer, **bounds) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, [tokenizer.eos_token_id], VOCAB, **{"timeout_s": 30, **bounds})


def children() -> set[int]:
    """This process's live child processes."""
    found = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            found |= {int(pid) for pid in (task / "children").read_text().split()}
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return {pid for pid in found if _alive(pid)}


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Ticker:
    """A thread that wakes every 10 ms and records its longest gap: how long the GIL was held."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self.stop.wait(0.01):
            now = time.monotonic()
            self.longest = max(self.longest, now - last)
            last = now

    def __enter__(self) -> Ticker:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def test_a_compile_past_its_timeout_is_killed_while_the_process_runs_on(tokenizer) -> None:
    compiler = compiler_for(tokenizer, timeout_s=1.0)
    compiler.tokenizer()  # built once, before the clock starts
    before = children()
    with Ticker() as ticker:
        started = time.monotonic()
        with pytest.raises(
            ValueError, match=r"structured_outputs.grammar: the grammar did not compile within 1 s"
        ):
            compiler.compile(NEWLINES)
        took = time.monotonic() - started
    assert took < 3.0, took
    assert ticker.longest < 0.5, ticker.longest  # the compile never held this process's GIL
    assert children() == before  # the compile's process was killed and reaped
    started = time.monotonic()
    with pytest.raises(ValueError, match="did not compile within 1 s"):  # remembered: refused at once
        compiler.compile(StructuredOutputs("grammar", "\n" * 60_000 + "x", key="guided_decoding"))
    assert time.monotonic() - started < 0.1


def test_compiles_run_one_at_a_time(tokenizer) -> None:
    compiler = compiler_for(tokenizer, timeout_s=1.0)
    compiler.tokenizer()
    specs = [StructuredOutputs("grammar", "\n" * (60_000 + i) + "x") for i in range(2)]
    errors: list[Exception] = []

    def compile_(spec: StructuredOutputs) -> None:
        try:
            compiler.compile(spec)
        except ValueError as error:
            errors.append(error)

    before = children()
    threads = [threading.Thread(target=compile_, args=(spec,)) for spec in specs]
    for thread in threads:
        thread.start()
    most = 0
    while any(thread.is_alive() for thread in threads):
        most = max(most, len(children() - before))
        time.sleep(0.02)
    assert len(errors) == 2 and all("did not compile within 1 s" in str(e) for e in errors)
    assert most == 1


@pytest.mark.parametrize(
    ("spec", "bounds", "message"),
    [
        (
            StructuredOutputs("regex", "a" * 2000, key="guided_regex"),
            {"max_bytes": 1024},
            r"guided_regex has 2000 bytes, more than grammar_max_bytes \(1024\)",
        ),
        (
            StructuredOutputs("choice", json.dumps([str(i) for i in range(101)])),
            {"max_choices": 100},
            r"structured_outputs.choice has 101 choices, more than grammar_max_choices \(100\)",
        ),
    ],
)
def test_constraints_over_the_size_caps_are_refused_naming_the_cap(tokenizer, spec, bounds, message) -> None:
    compiler = compiler_for(tokenizer, **bounds)
    with pytest.raises(ValueError, match=message):
        compiler.check(spec)
    with pytest.raises(ValueError, match=message):
        compiler.compile(spec)


def test_a_child_returns_its_result_and_is_bounded_in_time_and_memory() -> None:
    result = run_in_child(lambda: b"x" * 5_000_000, timeout_s=30, memory_bytes=256 * 1024**2)
    assert result == b"x" * 5_000_000  # more than a pipe holds: read while it is written
    started = time.monotonic()
    with pytest.raises(ChildFailure) as failure:
        run_in_child(_spin, timeout_s=0.5, memory_bytes=256 * 1024**2)
    assert failure.value.timed_out and time.monotonic() - started < 2.0
    with pytest.raises(ChildFailure) as failure:  # far more than it may map: MemoryError, exit code 1
        run_in_child(lambda: bytes(2 * 1024**3), timeout_s=30, memory_bytes=64 * 1024**2)
    assert not failure.value.timed_out and failure.value.ended == "exit code 1"


def _spin() -> bytes:
    while True:  # holds the child's GIL, as a pure-Python conversion does
        pass


def test_an_ordinary_constraint_compiles_into_a_working_matcher(tokenizer) -> None:
    compiled = compiler_for(tokenizer).compile(StructuredOutputs("choice", json.dumps(["yes", "no"])))
    matcher = compiled.matcher()
    assert not matcher.is_error()
    assert matcher.consume_tokens(tokenizer.encode("yes")) and matcher.is_accepting()


def test_a_lexer_that_outgrows_the_limits_within_a_few_tokens_is_refused_at_compile(tokenizer) -> None:
    with pytest.raises(ValueError, match=r"structured_outputs.regex: .*too many expressions constructed"):
        compiler_for(tokenizer).compile(StructuredOutputs("regex", "(a{1000}){1000}"))


def test_a_grammar_that_exceeds_the_lexer_limits_mid_generation_ends_its_request_cleanly(
    tiny_model, tokenizer, monkeypatch
):
    monkeypatch.setattr(compiler_module, "TRIAL_WALKS", 0)  # as for a path the trial did not walk
    model = tiny_model("llama", vocab_size=VOCAB)
    decoder = LookaheadDecoder(model, tokenizer, None, LookaheadConfig(), (tokenizer.eos_token_id,))
    compiled = decoder.grammars.compile(EXPLODING)
    gen = decoder.start(
        tokenizer.encode("x"), SamplingParams(max_tokens=16, structured_outputs=EXPLODING), grammar=compiled
    )
    other = decoder.start(tokenizer.encode("y"), SamplingParams(max_tokens=4))
    failed = None
    while not gen.finished:
        outputs = decoder.step([gen] + ([other] if not other.finished else []))
        failed = outputs[0].error or failed
    assert isinstance(failed, GrammarLimitError), failed
    assert str(failed).startswith("structured_outputs.regex: ") and "too many expressions" in str(failed)
    while not other.finished:
        other.step()
    assert other.finish_reason == "length"
