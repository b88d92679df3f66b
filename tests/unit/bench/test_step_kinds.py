"""The step-kinds benchmark's bookkeeping: every step counted once, under its kind, and the outputs
those of plain decoding."""

from __future__ import annotations

from bench.step_kinds import KINDS, KindTotals, rows_of, run_block
from lookahead import LookaheadDecoder, NGramTrie, SamplingParams
from tests.helpers import plain_greedy


def test_each_step_counts_once_under_its_kind(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    decoder = LookaheadDecoder(model, byte_tokenizer, NGramTrie(10_000, 9))
    prompts = [(i, [3 + i, 5, 6, 7, 3 + i, 5]) for i in range(5)]
    steps = []
    step = decoder.step
    decoder.step = lambda gens: steps.append(len(gens)) or step(gens)  # type: ignore[method-assign]
    totals = {kind: KindTotals() for kind in KINDS}
    outputs = run_block(decoder, prompts, 2, SamplingParams(max_tokens=12), totals)
    for index, prompt in prompts:
        expected = plain_greedy(model, prompt, 12)
        assert outputs[index][: len(expected)] == expected
    assert sum(total.steps for total in totals.values()) == len(steps)
    assert totals["reading a prompt"].steps >= 3  # each of the five prompts is read in some step
    assert totals["fewer than c"].steps >= 1  # the last request runs alone
    assert totals["decoding"].steps >= 1
    made = sum(len(ids) for ids in outputs.values())
    assert sum(total.made for total in totals.values()) == made
    rows = rows_of(2, "lookahead", totals)
    assert [row.kind for row in rows] == [*KINDS, "all"]
    assert rows[-1].steps == len(steps) and rows[-1].made_per_step == round(made / len(steps), 2)
