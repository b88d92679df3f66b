"""The agent benchmark's repository map and its summary."""

from __future__ import annotations

from bench.agent_loop import CHARS_PER_TOKEN, Turn, repo_map, summarize


def test_a_repository_map_lists_paths_and_signatures_within_its_budget() -> None:
    text = repo_map(1000)
    assert 0.9 * 1000 * CHARS_PER_TOKEN <= len(text) <= 1000 * CHARS_PER_TOKEN
    lines = text.splitlines()
    assert lines[0] == "textwrap.py:" and "  def dedent(text):" in lines
    assert all(line.endswith(".py:") or line.startswith("  ") for line in lines)
    assert repo_map(1000) == text and repo_map(3000).startswith(text)


def test_the_summary_keeps_the_first_tasks_cold_first_token_apart() -> None:
    turns = [
        Turn(task, turn, model, 100, tokens, ttft, seconds, 0, f"{task}.{turn}")
        for model, tokens, seconds in (("lookahead", 30, 1.0), ("baseline", 30, 2.0))
        for task, turn, ttft in ((0, 1, 3.0), (0, 2, 0.2), (1, 1, 0.1))
    ]
    lookahead, baseline = summarize(turns, "baseline")
    assert lookahead.model == "lookahead" and lookahead.speedup == 2.0
    assert lookahead.cold_ttft_ms == 3000.0
    assert lookahead.ttft_ms_by_turn == "1550 / 200"
    assert lookahead.identical == 3 and baseline.identical == 3
