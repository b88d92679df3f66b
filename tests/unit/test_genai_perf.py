"""genai-perf counts tokens with the tokenizer of the model the server really serves, and a point
whose perf_analyzer export came back empty is measured again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.genai_perf import EMPTY_EXPORT, EXPORT_ATTEMPTS, parse_args, run_point, served_tokenizer
from bench.servers import BenchmarkError
from lookahead.contract import MODEL_ENV

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"


def hf_folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def test_the_config_pbtxt_model_parameter_names_the_tokenizer(tmp_path, monkeypatch):
    monkeypatch.delenv(MODEL_ENV, raising=False)
    repository = tmp_path / "repository"
    (repository / "lookahead").mkdir(parents=True)
    folder = hf_folder(tmp_path / "my-model")
    (repository / "lookahead" / "config.pbtxt").write_text(
        f'parameters [\n  {{ key: "model", value: {{ string_value: "{folder}" }} }}\n]\n'
    )
    assert served_tokenizer(repository, "lookahead") == folder


def test_lookahead_model_replaces_the_config_pbtxt_model_as_it_does_in_the_server(tmp_path, monkeypatch):
    folder = hf_folder(tmp_path / "served")
    monkeypatch.setenv(MODEL_ENV, str(folder))
    assert served_tokenizer(REPOSITORY, "baseline") == folder
    monkeypatch.setenv(MODEL_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="neither an embedded model"):
        served_tokenizer(REPOSITORY, "lookahead")


def fake_genai_perf(tmp_path: Path, empty_exports: int, error: str = EMPTY_EXPORT) -> tuple[Path, Path]:
    """A genai-perf whose first `empty_exports` runs fail as genai-perf does on an empty perf_analyzer
    export (printing `error`), the next ones writing a whole export; it counts its runs."""
    runs = tmp_path / "runs"
    summary = json.dumps(
        {
            "request_count": {"avg": 4},
            "time_to_first_token": {"avg": 20.0, "p99": 30.0},
            "inter_token_latency": {"avg": 5.0, "p99": 6.0},
            "output_token_throughput": {"avg": 100.0},
            "request_throughput": {"avg": 2.0},
        }
    )
    raw = json.dumps({"experiments": [{"requests": [{"response_timestamps": [1, 2]}] * 4}]})
    script = tmp_path / "genai-perf"
    script.write_text(
        f"""#!/usr/bin/env bash
n=$(( $(cat {runs} 2>/dev/null || echo 0) + 1 )); echo $n > {runs}
out="${{@: -1}}"; mkdir -p "$out/lookahead-kserve-vllm-concurrency1"
if [ $n -le {empty_exports} ]; then echo 'orjson.JSONDecodeError: {error}: line 1 column 1'; exit 1; fi
echo '{summary}' > "$out/lookahead-kserve-vllm-concurrency1/profile_export_genai_perf.json"
echo '{raw}' > "$out/lookahead-kserve-vllm-concurrency1/profile_export.json"
""",
        encoding="utf-8",
    )
    script.chmod(0o755)
    return script, runs


def point_args(tmp_path: Path, genai_perf: Path):
    folder = hf_folder(tmp_path / "model")
    repository = tmp_path / "repository"
    (repository / "lookahead").mkdir(parents=True)
    (repository / "lookahead" / "config.pbtxt").write_text(
        f'parameters [\n  {{ key: "model", value: {{ string_value: "{folder}" }} }}\n]\n'
    )
    args = parse_args(
        [
            "--genai-perf",
            str(genai_perf),
            "--out",
            str(tmp_path / "out"),
            "--model-repository",
            str(repository),
        ]
    )
    args.out.mkdir()
    return args


def test_a_point_whose_export_perf_analyzer_left_empty_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.delenv(MODEL_ENV, raising=False)
    script, runs = fake_genai_perf(tmp_path, empty_exports=2)
    point = run_point(point_args(tmp_path, script), "lookahead", "localhost:1", 1, tmp_path)
    assert runs.read_text().strip() == "3"
    assert (point.requests, point.ttft_avg_ms, point.output_tokens_per_second) == (4, 20.0, 100.0)


def test_other_genai_perf_failures_and_a_persistent_empty_export_are_reported(tmp_path, monkeypatch):
    monkeypatch.delenv(MODEL_ENV, raising=False)
    script, runs = fake_genai_perf(tmp_path, empty_exports=1, error="Connection refused")
    args = point_args(tmp_path, script)
    with pytest.raises(BenchmarkError, match="genai-perf exited with 1"):
        run_point(args, "lookahead", "localhost:1", 1, tmp_path)
    assert runs.read_text().strip() == "1"  # not a lost export: no second run
    (tmp_path / "again").mkdir()
    script, runs = fake_genai_perf(tmp_path / "again", empty_exports=9)
    with pytest.raises(BenchmarkError, match="zero-length"):
        run_point(point_args(tmp_path / "again", script), "lookahead", "localhost:1", 1, tmp_path)
    assert runs.read_text().strip() == str(EXPORT_ATTEMPTS)
