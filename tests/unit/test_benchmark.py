"""The decoder benchmark's measurement order (the benchmark itself is a script, not a test)."""

from __future__ import annotations

import torch

from bench.decoding import PromptRun, measure


def test_methods_take_turns_in_a_rotating_order() -> None:
    calls: list[tuple[str, int]] = []

    def runner(method: str):
        def run(prompt_ids: list[int], max_new_tokens: int) -> PromptRun:
            calls.append((method, prompt_ids[0]))
            return PromptRun([prompt_ids[0]] * max_new_tokens, decode_steps=max_new_tokens)

        return run

    methods = ["a", "b", "c"]
    runs = measure({m: runner(m) for m in methods}, [[0], [1], [2], [3]], 2, torch.device("cpu"))
    firsts = [calls[3 * prompt][0] for prompt in range(4)]
    assert firsts == ["a", "b", "c", "a"]  # nobody always follows the same method
    assert [prompt for _, prompt in calls] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    for method in methods:
        assert [run.output_ids[0] for run in runs[method]] == [0, 1, 2, 3]
        assert all(run.seconds > 0 for run in runs[method])
