"""A request's path through the engine thread (backend/engine.py): responses, samples, queues,
unload and trie snapshots, with a scripted decoder, without Triton."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import replace

import pytest
import torch

from backend.engine import (
    ENGINE_SWITCH_INTERVAL_S,
    QUEUE_FULL,
    SHUTDOWN_MESSAGE,
    Engine,
    FailureCode,
    Update,
)
from lookahead.algorithm.trie import NGramTrie
from lookahead.config import SamplingParams
from lookahead.runtime.decoder import StepOutput
from lookahead.runtime.logprobs import Logprob
from lookahead.runtime.step_timing import StepTimes
from lookahead.state.keeper import TrieKeeper
from lookahead.state.persistence import load_trie
from tests.helpers import wait_until
from tests.unit.backend.fakes import Recorder, ScriptedDecoder, ScriptedGeneration, run_engine, steps, submit


def test_streaming_sends_text_deltas_with_final_on_the_last_one():
    engine, decoder, recorder = run_engine({"a": steps("Hel", "", "lo", " world", reason="stop")})
    state = submit(engine, "a", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    updates = recorder.of(state)
    assert [(u.text, u.num_output_tokens, u.final) for u in updates] == [
        ("Hel", 3, False),
        ("lo", 3, False),  # the step without text is reported with the next one
        (" world", 6, True),
    ]
    assert updates[-1].finish_reason == "stop"
    assert updates[-1].stats is decoder.generations["a"].stats
    assert decoder.generations["a"].closed
    assert state.first_output_time is not None and state.finish_time >= state.first_output_time


def logprob_of(token: int, value: float) -> dict[int, Logprob]:
    return {token: Logprob(value, 1, chr(token))}


def test_stream_each_token_sends_a_steps_tokens_one_response_each():
    """Three tokens in one step: "H", half of "é" (no text yet), its other half; then a last step."""
    first = StepOutput(
        [72, 195, 169],
        "Hé",
        logprobs=[logprob_of(72, -0.5), logprob_of(195, -0.25), logprob_of(169, -0.125)],
        token_texts=["H", "", "é"],
    )
    last = StepOutput([33], "!", "stop", logprobs=[logprob_of(33, -1.0)], token_texts=["!"])
    engine, decoder, recorder = run_engine({"a": [first, last], "b": [replace(first), replace(last)]})
    each = submit(engine, "a", stream=True, prepend_input=False, stream_each_token=True)
    whole = submit(engine, "b", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(2)
    engine.stop()
    updates = recorder.of(each)
    assert [(u.text, u.num_output_tokens, u.final, u.finish_reason) for u in updates] == [
        ("H", 1, False, None),
        ("", 1, False, None),
        ("é", 1, False, None),
        ("!", 1, True, "stop"),
    ]
    assert [list(u.logprobs[0]) for u in updates] == [[72], [195], [169], [33]]
    assert [u.stats is not None for u in updates] == [False, False, False, True]
    assert [(u.text, u.num_output_tokens, u.final) for u in recorder.of(whole)] == [
        ("Hé", 3, False),
        ("!", 1, True),
    ]


def test_stream_each_token_reports_the_cumulative_logprob_up_to_each_token():
    steps_ = [
        StepOutput(
            [1, 2], "ab", logprobs=[logprob_of(1, -0.5), logprob_of(2, -0.25)], token_texts=["a", "b"]
        ),
        StepOutput([3], "c", "length", logprobs=[logprob_of(3, -1.0)], token_texts=["c"]),
    ]
    engine, decoder, recorder = run_engine({"a": steps_})
    state = submit(engine, "a", stream=True, prepend_input=False, stream_each_token=True)
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    assert [u.cumulative_logprob for u in recorder.of(state)] == [-0.5, -0.75, -1.75]


def sampled(n: int, best_of: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=1.0, n=n, best_of=best_of)


def texts_of(update: Update) -> list[tuple[str, int, str | None]]:
    return [(piece.text, piece.num_output_tokens, piece.finish_reason) for piece in update.pieces]


def test_n_samples_come_back_in_one_response_with_an_element_each():
    engine, _, recorder = run_engine({"a0": steps("bc", "de"), "a1": steps("x", reason="stop")})
    state = submit(engine, "a", stream=False, prepend_input=True, sampling=sampled(2))
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    (update,) = recorder.of(state)
    assert update.final and texts_of(update) == [("abcde", 4, "length"), ("ax", 1, "stop")]
    assert update.stats.output_tokens == 5 and update.stats.prompt_tokens == 1


def test_streamed_samples_share_each_response_and_a_finished_one_stays_in_it():
    engine, _, recorder = run_engine({"a0": steps("bc", "de"), "a1": steps("x", reason="stop")})
    state = submit(engine, "a", stream=True, prepend_input=False, sampling=sampled(2))
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    updates = recorder.of(state)
    assert [texts_of(u) for u in updates] == [
        [("bc", 2, None), ("x", 1, "stop")],
        [("de", 2, "length"), ("", 0, "stop")],
    ]
    assert [u.final for u in updates] == [False, True]


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob_best_first():
    def sample(text: str, logprob: float) -> list[StepOutput]:
        return [StepOutput([ord(text)], text, "stop", logprobs=[logprob_of(ord(text), logprob)])]

    scripts = {"a0": sample("x", -2.0), "a1": sample("y", -5.0), "a2": sample("z", -0.5)}
    engine, _, recorder = run_engine(scripts)
    state = submit(engine, "a", stream=False, prepend_input=False, sampling=sampled(2, best_of=3))
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    (update,) = recorder.of(state)
    assert [piece.text for piece in update.pieces] == ["z", "x"]
    assert [piece.cumulative_logprob for piece in update.pieces] == [-0.5, -2.0]


def test_non_streaming_sends_one_response_with_the_prompt_prepended():
    engine, _, recorder = run_engine({"p": steps("ab", "cd")})
    echoed = submit(engine, "p", stream=False, prepend_input=True)
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    assert [(u.text, u.num_output_tokens, u.final, u.finish_reason) for u in recorder.of(echoed)] == [
        ("pabcd", 4, True, "length")
    ]


def test_an_empty_last_step_still_carries_the_final_flag():
    engine, _, recorder = run_engine({"a": steps("x", "", reason="stop")})
    state = submit(engine, "a", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    assert [(u.text, u.num_output_tokens, u.final) for u in recorder.of(state)] == [
        ("x", 1, False),
        ("", 1, True),
    ]


def test_requests_are_stepped_together_so_a_short_one_finishes_first():
    engine, decoder, recorder = run_engine({"l": steps(*"abcdefgh"), "s": steps("x", "y")})
    long = submit(engine, "l", stream=True, prepend_input=False)
    short = submit(engine, "s", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(2)
    engine.stop()
    assert decoder.order[:4] == ["l", "s", "l", "s"]
    finals = [u.state for u in recorder.updates if u.final]
    assert finals == [short, long]


def test_a_new_request_reads_its_prompt_in_the_running_ones_step():
    engine, decoder, recorder = run_engine({"l": steps(*"abcdefgh"), "n": steps("x", "y")})
    original_emit = engine.emit

    def submit_after_first_response(update: Update) -> None:
        original_emit(update)
        if len(recorder.updates) == 1:
            submit(engine, "n", stream=True, prepend_input=False)

    engine.emit = submit_after_first_response
    submit(engine, "l", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(2)
    engine.stop()
    joined = next(i for i, batch in enumerate(decoder.batches) if "n" in batch)
    assert decoder.batches[joined] == ["l", "n"]  # no step of its own: the stream never waits for it
    assert all(batch == ["l"] for batch in decoder.batches[:joined])


def test_requests_arriving_together_share_their_first_step():
    engine, decoder, recorder = run_engine({"a": steps("x", "y"), "b": steps("u", "v")})
    events: list[tuple[str, ...]] = []
    original_step, original_emit = decoder.step, engine.emit

    def step(generations: list[ScriptedGeneration]) -> list[StepOutput]:
        events.append(("step", *(generation.name for generation in generations)))
        return original_step(generations)

    def emit(update: Update) -> None:
        events.append(("emit", update.text))
        original_emit(update)

    decoder.step, engine.emit = step, emit
    submit(engine, "a", stream=True, prepend_input=False)
    submit(engine, "b", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(2)
    engine.stop()
    assert events[:4] == [("step", "a", "b"), ("emit", "x"), ("emit", "u"), ("step", "a", "b")]


def test_a_cancelled_request_stops_within_one_step_and_gets_one_cancelled_final():
    script = steps(*"abcdefgh")
    engine, decoder, recorder = run_engine({"c": script})
    state = submit(engine, "c", stream=True, prepend_input=False)
    original_emit = engine.emit

    def cancel_after_second_response(update: Update) -> None:
        original_emit(update)
        if len(recorder.of(state)) == 2:
            state.cancelled = True  # what the response thread does after is_cancelled()

    engine.emit = cancel_after_second_response
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    updates = recorder.of(state)
    assert [u.final for u in updates] == [False, False, True]
    assert (updates[-1].failure, updates[-1].message) == (FailureCode.CANCELLED, "Request was cancelled")
    assert decoder.generations["c"].closed
    assert decoder.order == ["c", "c"]


def test_a_failing_step_ends_only_that_request():
    engine, _, recorder = run_engine({"f": [RuntimeError("boom")], "g": steps("ok")})
    failing = submit(engine, "f", stream=True, prepend_input=False)
    healthy = submit(engine, "g", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(2)
    engine.stop()
    [failure] = recorder.of(failing)
    assert (failure.final, failure.failure, failure.message) == (
        True,
        FailureCode.INTERNAL,
        "Error generating text: boom",
    )
    assert [(u.text, u.final) for u in recorder.of(healthy)] == [("ok", True)]
    assert "boom" in recorder.errors[0]


# The engine thread re-raises the fatal error after failing every request, as it must.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_when_the_engine_dies_mid_stream_every_request_gets_an_error_and_the_model_is_not_ready():
    device_error = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    stopped: list[str] = []
    engine, decoder, recorder = run_engine(
        {"r": [steps("a", "b")[0], device_error], "q": steps("x")},
        max_running_requests=1,
        on_stopped=stopped.append,
    )
    running = submit(engine, "r", stream=True, prepend_input=False)
    queued = submit(engine, "q", stream=True, prepend_input=False)  # waits: one request runs at a time
    engine.start()
    recorder.wait_finals(2)
    assert not engine.running
    late = submit(engine, "z", stream=True, prepend_input=False)  # arrives after the death
    recorder.wait_finals(1)
    engine.thread.join(5)
    assert [u.text for u in recorder.of(running)[:-1]] == ["a"]  # it streamed, then died
    for state in (running, queued, late):
        final = recorder.of(state)[-1]
        assert final.final and final.failure is FailureCode.UNAVAILABLE
        assert (
            "the engine thread failed (AcceleratorError: CUDA error: an illegal memory access"
            in final.message
        )
    assert stopped and "illegal memory access" in stopped[0]
    assert any(
        "The engine thread failed" in line and "illegal memory access" in line for line in recorder.errors
    )
    assert "q" not in decoder.generations  # never started


def test_at_most_max_running_requests_run_and_the_rest_start_in_arrival_order():
    engine, decoder, recorder = run_engine(
        {"a": steps("1", "2", "3"), "b": steps("4", "5"), "c": steps("6")}, max_running_requests=2
    )
    for name in "abc":
        submit(engine, name, stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(3)
    engine.stop()
    # c starts only once b has left, in a's next step
    assert decoder.batches == [["a", "b"], ["a", "b"], ["a", "c"]]


def test_a_request_waits_while_the_kv_bound_cannot_hold_it_too():
    engine, decoder, recorder = run_engine({"a": steps("1", "2", "3"), "b": steps("4")})
    decoder.kv_room = 100  # each request may hold 1 + 8 + 64 = 73 entries: one fits, two do not
    submit(engine, "a", stream=True, prepend_input=False)
    submit(engine, "b", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(2)
    engine.stop()
    assert ["a", "b"] not in decoder.batches and ["b", "a"] not in decoder.batches
    assert decoder.order.index("b") > decoder.order.index("a") == 0
    assert decoder.order.count("a") == 3


def test_stop_answers_every_request_still_in_flight():
    engine, decoder, recorder = run_engine({"w": steps(*"abcdefgh"), "v": steps(*"abcdefgh")})
    decoder.gate.clear()
    states = [submit(engine, name, stream=True, prepend_input=False) for name in "wv"]
    engine.start()
    time.sleep(0.05)  # the engine is now inside the first step, waiting for the gate
    stopper = threading.Thread(target=engine.stop)
    stopper.start()
    decoder.gate.set()
    stopper.join(5)
    assert not stopper.is_alive()
    for state in states:
        finals = [u for u in recorder.of(state) if u.final]
        assert [(u.failure, u.message) for u in finals] == [(FailureCode.UNAVAILABLE, SHUTDOWN_MESSAGE)]
    assert all(generation.closed for generation in decoder.generations.values())


# Trie snapshots, written by the engine thread


def test_an_idle_engine_writes_a_due_snapshot_and_stop_writes_another(tmp_path):
    trie = NGramTrie(capacity=100, max_depth=4)
    trie.insert([1, 2, 3, 4])
    path = tmp_path / "state" / "lookahead_0_0.trie"
    decoder, recorder = ScriptedDecoder({"a": steps("x")}), Recorder()
    snapshots = TrieKeeper(trie, path, "fp", interval_s=0.05, log=recorder)
    engine = Engine(decoder, recorder.emit, recorder, keeper=snapshots)
    submit(engine, "a", stream=True, prepend_input=False)
    engine.start()
    recorder.wait_finals(1)
    assert wait_until(lambda: path.is_file() and not snapshots.changed), "no snapshot while idle"
    first = load_trie(path, capacity=100, max_depth=4, fingerprint="fp").node_count
    assert first == trie.node_count == 10  # every window of up to 4 tokens of [1, 2, 3, 4]
    trie.insert([5, 6])  # changed behind the engine's back: only the final save can record it
    engine.stop()
    assert load_trie(path, capacity=100, max_depth=4, fingerprint="fp").node_count == trie.node_count == 13
    assert f"Saved {path} (13 trie nodes)" in recorder.info


def test_snapshots_wait_for_the_interval_and_for_a_change(tmp_path):
    trie = NGramTrie(capacity=100, max_depth=4)
    path = tmp_path / "t.trie"
    snapshots = TrieKeeper(trie, path, "fp", interval_s=3600, log=Recorder())
    snapshots.mark_changed()
    snapshots.maybe_save()
    assert not path.exists()  # the interval has not passed
    snapshots.interval_s = 0.0  # 0 disables periodic snapshots altogether
    snapshots.maybe_save()
    assert not path.exists()
    snapshots.interval_s, snapshots.last_save = 1.0, time.monotonic() - 2
    snapshots.maybe_save()
    assert path.is_file() and not snapshots.changed
    path.unlink()
    snapshots.last_save = time.monotonic() - 2
    snapshots.maybe_save()
    assert not path.exists()  # nothing changed since the last save


def test_a_failing_save_is_logged_and_retried(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    recorder = Recorder()
    snapshots = TrieKeeper(NGramTrie(capacity=100, max_depth=4), blocker / "t.trie", "fp", 1.0, recorder)
    snapshots.mark_changed()
    snapshots.save()
    assert snapshots.changed
    assert "Could not save the trie snapshot" in recorder.errors[0]


# Queue bounds and unload


def test_requests_beyond_max_queued_requests_get_unavailable_at_once():
    engine, decoder, recorder = run_engine(
        {name: steps("1", "2") for name in "abcd"}, max_running_requests=1, max_queued_requests=2
    )
    decoder.gate.clear()
    states = [submit(engine, name, stream=True, prepend_input=False) for name in "abcd"]
    engine.start()
    recorder.wait_finals(1)  # d: a runs, b and c wait, d is one too many
    assert [(u.failure, u.message) for u in recorder.of(states[3])] == [
        (FailureCode.UNAVAILABLE, QUEUE_FULL.format(count=2))
    ]
    decoder.gate.set()
    recorder.wait_finals(3)
    engine.stop()
    assert decoder.order == ["a", "a", "b", "b", "c", "c"]


def test_a_request_waiting_longer_than_queue_timeout_s_gets_unavailable():
    engine, decoder, recorder = run_engine(
        {"a": steps(*"12345678"), "b": steps("1")}, max_running_requests=1, queue_timeout_s=0.2
    )
    decoder.gate.clear()
    submit(engine, "a", stream=True, prepend_input=False)
    waiting = submit(engine, "b", stream=True, prepend_input=False)
    engine.start()
    time.sleep(0.4)
    decoder.gate.set()
    recorder.wait_finals(2)
    engine.stop()
    [final] = recorder.of(waiting)
    assert final.failure is FailureCode.UNAVAILABLE and "more than queue_timeout_s (0.2)" in final.message
    assert "b" not in decoder.order


def test_unload_ends_running_and_later_requests_with_unavailable_before_they_finish():
    engine, decoder, recorder = run_engine({"a": steps(*"abcdefgh"), "b": steps("1")})
    running = submit(engine, "a", stream=True, prepend_input=False)
    decoder.gate.clear()
    engine.start()
    time.sleep(0.05)
    engine.unload()
    decoder.gate.set()
    recorder.wait_finals(1)
    later = submit(engine, "b", stream=True, prepend_input=False)
    recorder.wait_finals(1)
    assert engine.running  # finalize() stops it later and takes the snapshot
    engine.stop()
    for state in (running, later):
        assert [(u.failure, u.message) for u in recorder.of(state) if u.final] == [
            (FailureCode.UNAVAILABLE, SHUTDOWN_MESSAGE)
        ]
    assert decoder.order.count("a") < 8 and "b" not in decoder.order


def test_unload_with_a_message_answers_running_requests_and_saves_the_trie_before_it_reports(tmp_path):
    """The launcher's drain: the event means every final is queued and the snapshot is on disk."""
    trie = NGramTrie(capacity=100, max_depth=4)
    path = tmp_path / "lookahead_0_0.trie"
    decoder, recorder = ScriptedDecoder({"a": steps(*"abcdefgh")}), Recorder()
    engine = Engine(decoder, recorder.emit, recorder, keeper=TrieKeeper(trie, path, "fp", 0.0, recorder))
    running = submit(engine, "a", stream=True, prepend_input=False)
    decoder.gate.clear()
    engine.start()
    time.sleep(0.05)
    trie.insert([1, 2, 3])  # what the stream taught the trie so far
    unloaded = engine.unload("the server is shutting down")
    decoder.gate.set()
    assert unloaded.wait(5)
    assert [(u.failure, u.message) for u in recorder.of(running) if u.final] == [
        (FailureCode.UNAVAILABLE, "the server is shutting down")
    ]
    assert load_trie(path, capacity=100, max_depth=4, fingerprint="fp").node_count == trie.node_count == 6
    assert engine.running
    engine.stop(timeout_s=5)
    assert not engine.thread.is_alive()


def test_unload_wakes_an_idle_engine(tmp_path):
    path = tmp_path / "t.trie"
    recorder = Recorder()
    keeper = TrieKeeper(NGramTrie(capacity=100, max_depth=4), path, "fp", 0.0, recorder)
    engine = Engine(ScriptedDecoder({}), recorder.emit, recorder, keeper=keeper)
    engine.start()
    assert engine.unload().wait(5) and path.is_file()
    engine.stop(timeout_s=5)
    assert not engine.thread.is_alive()


def test_a_stop_queued_while_unloading_is_not_lost():
    engine, decoder, recorder = run_engine({"a": steps(*"abcdefgh")})
    submit(engine, "a", stream=True, prepend_input=False)
    decoder.gate.clear()
    engine.start()
    time.sleep(0.05)
    engine.unload()
    engine.inbox.put(None)  # stop() arriving between the unload and the engine's next look
    decoder.gate.set()
    engine.thread.join(5)
    assert not engine.thread.is_alive()


def test_a_request_is_validated_once_and_each_step_is_timed_by_part():
    timed = []
    engine, decoder, recorder = run_engine({"a": steps("x", "y")}, on_step_timed=timed.append)
    decoder.last_step = StepTimes(requests=1, tokens=1)  # the scripted step takes no time of its own
    state = submit(engine, "a", stream=True)
    engine.start()
    recorder.wait_finals(1)
    engine.stop()
    assert decoder.checked == [True]  # parse_request ran check_request; the engine does not again
    assert len(timed) == 2 and recorder.of(state)[-1].final
    for times in timed:
        parts = times.parts()
        assert set(parts) == {
            "schedule",
            "draft",
            "forward",
            "verify",
            "commit",
            "admit",
            "respond",
            "keeper",
            "wait",
        }
        assert sum(parts.values()) == pytest.approx(times.wall) and times.wall > 0


def test_a_started_engine_bounds_how_long_its_thread_waits_for_the_gil() -> None:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default
    recorder = Recorder()
    engine = Engine(ScriptedDecoder({}), recorder.emit, recorder)
    try:
        engine.start()
        assert sys.getswitchinterval() == ENGINE_SWITCH_INTERVAL_S < 0.005
    finally:
        engine.stop()
        sys.setswitchinterval(before)
