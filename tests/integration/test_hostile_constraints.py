"""Hostile structured-output constraints against the shared tritonserver while a stream runs on the
same model: each gets INVALID_ARG (at once for a size cap or a remembered refusal, at the compile
timeout otherwise, mid-generation for a lexer that outgrows llguidance's limits), the stream's
longest gap between responses stays within a few steps, and a short request is served meanwhile."""

from __future__ import annotations

import json
import queue
import statistics
import time
from pathlib import Path

import tritonclient.grpc as grpcclient

from launcher import TritonServer
from tests.integration.test_reliability import stub_pids
from tests.integration.test_server import grpc_inputs, is_ready, post

TIMEOUT_S = 10  # grammar_compile_timeout_s (the default)
# A few steps of the default model on two loaded cores (a compile that stalls the engine stalls
# it for tens of seconds).
LONGEST_GAP_S = 1.5
GBNF_CHAIN = "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(25_000)) + 'r25000 ::= "b"\n'
TIMED_OUT = f"guided_grammar: the grammar did not compile within {TIMEOUT_S} s"
TOO_BIG = "more than grammar_max_bytes (65536)"
# (request key, value, what the error says); the stream runs beside all of them
HOSTILE = [
    ("guided_grammar", "\n" * 80_000 + "x", "guided_grammar has 80001 bytes, " + TOO_BIG),
    ("guided_grammar", "\n" * 60_000 + "x", TIMED_OUT),
    ("guided_grammar", "\n" * 60_000 + "x", TIMED_OUT),  # remembered: refused at once
    ("guided_choice", [f"option {i}" for i in range(100_000)], TOO_BIG),
    ("guided_choice", [str(i) for i in range(5_000)], "5000 choices, more than grammar_max_choices (1000)"),
    ("guided_grammar", GBNF_CHAIN, TOO_BIG),
    ("guided_regex", "(a{1000}){1000}", "guided_regex: lexer error: too many expressions constructed"),
]


class TimedStream:
    """One streaming request whose responses are recorded with their arrival times."""

    def __init__(self, server: TritonServer):
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.arrivals: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.arrivals.put((time.monotonic(), error)))

    def times(self) -> list[float]:
        """Arrival times since the last call."""
        found = []
        while not self.arrivals.empty():
            arrived, error = self.arrivals.get()
            assert error is None, error
            found.append(arrived)
        return found

    def wait(self, count: int, timeout_s: float) -> list[float]:
        """The arrival times of the next `count` responses."""
        found = []
        while len(found) < count:
            arrived, error = self.arrivals.get(timeout=timeout_s)
            assert error is None, error
            found.append(arrived)
        return found

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def rss_mib(pid: int) -> float:
    for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_hostile_constraints_are_refused_while_a_stream_on_the_model_runs_on(server):
    [stub] = [pid for pid in stub_pids(server) if "baseline" in Path(f"/proc/{pid}/cmdline").read_text()]
    rss_before = rss_mib(stub)
    stream = TimedStream(server)
    options = {"max_tokens": 2048, "ignore_eos": True}
    stream.client.async_stream_infer(
        "baseline", grpc_inputs("Write a long story.", sampling_parameters=options)
    )
    try:
        steady = stream.wait(12, timeout_s=120)  # the stream's steady pace
        pace = statistics.median(b - a for a, b in zip(steady, steady[1:]))
        outcomes = []
        for key, value, message in HOSTILE:
            sent = time.monotonic()
            status, text = post(server, "/v2/models/baseline/generate", body(key, value))
            outcomes.append((key, status, text[:300], sent, time.monotonic()))
            assert status == 400 and message in json.loads(text)["error"], outcomes[-1]
        sent = time.monotonic()
        status, text = post(
            server, "/v2/models/baseline/generate", {"text_input": "Hi", "parameters": {"max_tokens": 4}}
        )
        outcomes.append(("a 4-token request", status, text, sent, time.monotonic()))
        assert status == 200, text
        sent = time.monotonic()
        status, text = post(server, "/v2/models/baseline/generate", body("guided_regex", "(.*a){25}x"))
        outcomes.append(("guided_regex (.*a){25}x", status, text, sent, time.monotonic()))
        assert status == 200, text
        during = stream.times()
    finally:
        stream.close()
    times = [steady[-1], *during]
    gaps = [(b - a, b) for a, b in zip(times, during)]
    rss = f"stub RSS {rss_before:.0f} -> {rss_mib(stub):.0f} MiB"
    print(f"\nstream: {pace:.3f} s per response before; {rss}")
    for key, status, _, sent, answered in outcomes:
        longest = max((gap for gap, end in gaps if end > sent and end - gap < answered), default=0.0)
        print(f"  {key}: {status} in {answered - sent:.2f} s; longest gap meanwhile {longest:.3f} s")
    assert max(gaps)[0] < LONGEST_GAP_S, (pace, sorted(gaps)[-5:])
    remembered = outcomes[2]  # the constraint that timed out, sent again: refused at once
    assert remembered[4] - remembered[3] < 0.5
    assert is_ready(server)


def body(key: str, value) -> dict:
    return {
        "text_input": "Answer:",
        "sampling_parameters": json.dumps({"max_tokens": 16, key: value}),
    }
