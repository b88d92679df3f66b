"""genai-perf 0.0.16 (its own environment) against a server the driver starts: both models answer
every request through `--endpoint-type kserve --backend vllm --streaming`, and through the
OpenAI-compatible endpoint with `--endpoint-type chat --streaming`, offline."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import get_type_hints

import pytest

from bench.genai_perf import GENAI_PERF, QUICK, GenaiPerfPoint, main


@pytest.mark.parametrize("endpoint_type", ["kserve", "chat"])
def test_a_short_genai_perf_profile_of_both_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], endpoint_type: str
) -> None:
    assert GENAI_PERF.exists(), f"{GENAI_PERF} is missing: run scripts/bootstrap.sh"
    status = main(["--quick", "--start-server", "--endpoint-type", endpoint_type, "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert status == 0, err
    types = get_type_hints(GenaiPerfPoint)
    with open(tmp_path / "genai_perf.csv", newline="") as file:
        points = [
            GenaiPerfPoint(**{n: kind(row[n]) for n, kind in types.items()}) for row in csv.DictReader(file)
        ]
    assert {(p.model, p.concurrency) for p in points} == {("lookahead", 1), ("baseline", 1)}
    for point in points:
        assert point.requests == QUICK["request_count"]  # every request sent was answered (none failed)
        assert point.output_tokens_per_second > 0
        assert 0 < point.ttft_avg_ms and 0 < point.inter_token_latency_avg_ms
    assert (tmp_path / "genai_perf.png").stat().st_size > 0
    assert "| lookahead | 1 |" in out
    if endpoint_type == "chat":  # every request went through the endpoint, streamed as OpenAI chunks
        log = (tmp_path / "openai.log").read_text()
        assert log.count('"POST /v1/chat/completions HTTP/1.1" 200') >= 2 * QUICK["request_count"]
