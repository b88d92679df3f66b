"""The load test: summarising perf_analyzer's profile export, the report files, and a quick real run."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from bench.load_test import (
    LoadPoint,
    PromptSlices,
    format_table,
    parse_args,
    perf_analyzer_command,
    plot,
    request_count,
    request_prompts,
    summarize_experiment,
    summarize_profile,
    write_input_data,
    write_perf_analyzer_input,
)
from bench.report import write_csv
from bench.servers import BenchmarkError

FIXTURE = Path(__file__).parents[1] / "data" / "perf_analyzer_profile.json"
MS = 1_000_000  # nanoseconds


def request(sent_ms: int, responses_ms: list[int], tokens: list[int]) -> dict:
    """One request of a profile export, timestamps in ms from an arbitrary epoch."""
    return {
        "timestamp": 5_000 * MS + sent_ms * MS,
        "request_inputs": {"text_input": "p", "stream": True, "return_num_output_tokens": True},
        "response_timestamps": [5_000 * MS + t * MS for t in responses_ms],
        "response_outputs": [{"text_output": "x", "num_output_tokens": n} for n in tokens],
    }


def experiment(concurrency: int, requests: list[dict]) -> dict:
    return {"experiment": {"mode": "concurrency", "value": concurrency}, "requests": requests}


def test_summary_counts_tokens_from_response_deltas_and_times_from_timestamps() -> None:
    point = summarize_experiment(
        "lookahead",
        experiment(
            2,
            [
                request(0, [100, 300, 400], [1, 4, 3]),
                request(0, [200, 500], [2, 6]),
                request(400, [600, 1000], [5, 3]),
            ],
        ),
    )
    assert (point.model, point.concurrency, point.requests) == ("lookahead", 2, 3)
    assert point.seconds == 1.0
    assert point.output_tokens == 24
    assert point.requests_per_second == 3.0
    assert point.output_tokens_per_second == 24.0
    assert point.latency_p50_ms == 500.0  # latencies 400, 500, 600
    assert point.ttft_p50_ms == 200.0  # first responses after 100, 200, 200
    assert point.ttft_p99_ms == pytest.approx(200.0)
    assert point.ttft_p99_after_burst_ms == 200.0  # only the request sent at 400 came after the burst
    assert point.latency_p99_ms == pytest.approx(598.0)


def test_the_opening_burst_is_left_out_of_one_ttft_percentile() -> None:
    requests = [request(0, [900], [1]), request(0, [100], [1]), request(300, [350], [1])]
    point = summarize_experiment("lookahead", experiment(2, requests))
    assert point.ttft_p99_ms > 800  # the second of the two requests sent together
    assert point.ttft_p99_after_burst_ms == 50.0
    alone = summarize_experiment("lookahead", experiment(2, requests[:2]))
    assert math.isnan(alone.ttft_p99_after_burst_ms)


def test_token_counts_that_were_not_requested_are_not_trusted() -> None:
    bare = request(0, [100], [1])
    del bare["request_inputs"]["return_num_output_tokens"]
    with pytest.raises(BenchmarkError, match="return_num_output_tokens"):
        summarize_experiment("baseline", experiment(1, [bare]))


def test_an_experiment_without_responses_is_an_error() -> None:
    with pytest.raises(BenchmarkError, match="no request received a response"):
        summarize_experiment("baseline", experiment(4, [request(0, [], [])]))


def test_real_perf_analyzer_export_is_summarised() -> None:
    profile = json.loads(FIXTURE.read_text())
    (point,) = summarize_profile("lookahead", profile)
    assert point.requests == len(profile["experiments"][0]["requests"])
    assert (
        point.output_tokens
        == point.requests
        * json.loads(profile["experiments"][0]["requests"][0]["request_inputs"]["sampling_parameters"])[
            "max_tokens"
        ]
    )
    assert 0 < point.ttft_p50_ms <= point.latency_p50_ms <= point.latency_p99_ms


def test_perf_analyzer_streams_over_grpc_with_a_fixed_request_count(tmp_path: Path) -> None:
    command = perf_analyzer_command(
        Path("pa"), "baseline", "localhost:9001", 4, tmp_path / "in.json", tmp_path / "out.json", 8
    )
    assert command[:8] == ["pa", "-m", "baseline", "-i", "grpc", "--streaming", "-u", "localhost:9001"]
    for flag in (
        "--concurrency-range=4:4",
        "--measurement-mode=count_windows",
        "--request-count=8",
        f"--profile-export-file={tmp_path / 'out.json'}",
        f"--input-data={tmp_path / 'in.json'}",
    ):
        assert flag in command
    assert request_count(concurrency=8, minimum=4) == 16
    assert request_count(concurrency=1, minimum=4) == 4


def test_input_data_asks_for_token_counts(tmp_path: Path) -> None:
    path = write_input_data(["a", "b", "c"], 20, tmp_path / "input.json")
    entries = json.loads(path.read_text())["data"]
    assert len(entries) == 3
    for entry in entries:
        assert entry["return_num_output_tokens"] == [True]
        assert entry["stream"] == [True]
        assert json.loads(entry["sampling_parameters"][0])["max_tokens"] == 20


def test_every_slice_of_prompts_is_new_and_they_run_out_loudly(tmp_path: Path) -> None:
    slices = PromptSlices([f"p{i}" for i in range(5)], 2, 8, tmp_path)
    files = [slices.next_file(1), slices.next_file(1)]
    sent = [[entry["text_input"][0] for entry in json.loads(f.read_text())["data"]] for f in files]
    assert sent == [["p0", "p1"], ["p2", "p3"]]
    with pytest.raises(BenchmarkError, match="5 prompts: not enough for another 2 unseen ones"):
        slices.next_file(2)


def test_report_files(tmp_path: Path) -> None:
    points = [
        summarize_experiment(model, experiment(c, [request(0, [100, 200 * c], [2, 2])]))
        for model in ("lookahead", "baseline")
        for c in (1, 2)
    ]
    table = format_table(points).splitlines()
    assert len(table) == 2 + len(points)
    assert table[2].split("|")[1:4] == [" lookahead ", " 1 ", " 1 "]
    write_csv(points, LoadPoint, tmp_path / "load.csv")
    with open(tmp_path / "load.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [(row["model"], int(row["concurrency"])) for row in rows] == [
        (p.model, p.concurrency) for p in points
    ]
    assert float(rows[1]["output_tokens_per_second"]) == points[1].output_tokens_per_second
    plot(points, tmp_path / "load.png", "test")
    assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_perf_analyzer_input_has_the_vllm_streaming_shape(tmp_path) -> None:
    path = write_perf_analyzer_input(
        ['first "quoted" prompt', "zweite Frage ü"], tmp_path / "pa" / "in.json", 64
    )
    document = json.loads(path.read_text(encoding="utf-8"))
    assert list(document) == ["data"]
    assert [entry["text_input"] for entry in document["data"]] == [
        ['first "quoted" prompt'],
        ["zweite Frage ü"],
    ]
    for entry in document["data"]:
        assert set(entry) == {"text_input", "stream", "sampling_parameters"}
        assert entry["stream"] == [True]
        assert len(entry["sampling_parameters"]) == 1
        assert json.loads(entry["sampling_parameters"][0]) == {"max_tokens": 64, "ignore_eos": True}


def test_perf_analyzer_input_refuses_empty_or_bad_requests(tmp_path) -> None:
    with pytest.raises(ValueError, match="at least one prompt"):
        write_perf_analyzer_input([], tmp_path / "in.json", 8)
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        write_perf_analyzer_input(["x"], tmp_path / "in.json", 0)
    assert not (tmp_path / "in.json").exists()


def test_a_chat_set_goes_out_in_the_served_model_s_chat_template() -> None:
    from bench.prompt_sets import load_prompt_set
    from lookahead.models.embedded import DEFAULT_MODEL
    from lookahead.models.loading import load_tokenizer

    edits = load_prompt_set("code_edit").prompts
    formatted = request_prompts(parse_args(["--prompt-set", "code_edit", "--tokenizer", DEFAULT_MODEL]))
    messages = [{"role": "user", "content": edits[0]}]
    expected = load_tokenizer(DEFAULT_MODEL).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert formatted[0] == expected and formatted[0] != edits[0] and edits[0] in formatted[0]
    assert request_prompts(parse_args(["--prompt-set", "code_edit", "--raw-prompts"])) == list(edits)
    # completions go as they are
    assert request_prompts(parse_args(["--prompt-set", "humaneval"])) == list(
        load_prompt_set("humaneval").prompts
    )
