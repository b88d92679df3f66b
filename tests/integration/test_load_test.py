"""The load test's quick run against a server it starts: real perf_analyzer, both models."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import get_type_hints

import pytest

from bench.load_test import QUICK, LoadPoint, main


def test_quick_load_test_against_a_started_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["--quick", "--start-server", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert status == 0, err
    types = get_type_hints(LoadPoint)
    with open(tmp_path / "load_test.csv", newline="") as file:
        points = [
            LoadPoint(**{name: kind(row[name]) for name, kind in types.items()})
            for row in csv.DictReader(file)
        ]
    assert {(p.model, p.concurrency) for p in points} == {
        (m, c) for m in ("lookahead", "baseline") for c in (1, 2)
    }
    for point in points:
        assert point.requests == max(QUICK["request_count"], 2 * point.concurrency)
        # ignore_eos: every request runs to max_tokens
        assert point.output_tokens == point.requests * QUICK["max_tokens"]
        assert point.output_tokens_per_second > 0
        assert 0 < point.ttft_p50_ms <= point.latency_p50_ms
    assert (tmp_path / "load_test.png").stat().st_size > 0
    assert "| lookahead | 1 |" in out
