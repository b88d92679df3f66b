"""In one process, lookahead against plain decoding with c requests kept running: each kind of step's
wall time, its forward and the decoder's host parts.

A server's steps are of three kinds: c requests decoding; one of them reading its prompt beside
the others; and, once no prompt waits, fewer than c. Lookahead gains in the first kind, and its
host work (retrieval, planning, verdicts, tries) costs in every step. Here the decoder runs alone
(no server, no clients on the cores): at each concurrency c the prompts go through `lookahead`
(the default config) and `plain` (lookahead off) in blocks of 4c prompts, c of them running (a
finished request is replaced before the next step, as the engine does), the first model
alternating from block to block. Each step is classed by kind, and its wall time split into the
forward and the decoder's parts (runtime/step_timing.py). Every output must equal plain
decoding's (exit status 1 otherwise).

    python -m bench step_kinds --concurrency 4,8 --sets doc_qa code_edit --prompts 24
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.decoding import encode
from bench.prompt_sets import PROMPT_SET_NAMES, load_prompt_set
from bench.report import markdown_table, write_csv
from bench.servers import parse_concurrency
from lookahead.algorithm.trie import NGramTrie
from lookahead.config import LookaheadConfig, SamplingParams
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import LoadedModel, freeze_loaded_objects, load_model
from lookahead.runtime.decoder import LookaheadDecoder
from lookahead.runtime.generation import Generation
from lookahead.runtime.step_timing import StepTimes

KINDS = ("decoding", "reading a prompt", "fewer than c")
HOST_PARTS = ("schedule", "draft", "verify", "commit")
BLOCK = 4  # prompts per block, in units of c


@dataclass
class KindTotals:
    """The steps of one kind, summed."""

    steps: int = 0
    seconds: float = 0.0
    forward: float = 0.0
    host: dict[str, float] = field(default_factory=lambda: dict.fromkeys(HOST_PARTS, 0.0))
    fed: int = 0
    made: int = 0

    def add(self, seconds: float, times: StepTimes, made: int) -> None:
        self.steps += 1
        self.seconds += seconds
        self.forward += times.forward
        for part in HOST_PARTS:
            self.host[part] += getattr(times, part)
        self.fed += times.tokens
        self.made += made

    @classmethod
    def merged(cls, totals: Iterable[KindTotals]) -> KindTotals:
        merged = cls()
        for total in totals:
            merged.steps += total.steps
            merged.seconds += total.seconds
            merged.forward += total.forward
            merged.fed += total.fed
            merged.made += total.made
            for part in HOST_PARTS:
                merged.host[part] += total.host[part]
        return merged


@dataclass
class Row:
    concurrency: int
    model: str
    kind: str
    steps: int
    ms_per_step: float
    forward_ms: float
    schedule_ms: float
    draft_ms: float
    verify_ms: float
    commit_ms: float
    fed_per_step: float
    made_per_step: float
    tokens_per_second: float
    seconds: float


def step_kind(gens: Sequence[Generation], concurrency: int) -> str:
    if any(not gen.stats.output_tokens for gen in gens):
        return "reading a prompt"
    return "decoding" if len(gens) == concurrency else "fewer than c"


def run_block(
    decoder: LookaheadDecoder,
    prompts: Sequence[tuple[int, list[int]]],
    concurrency: int,
    params: SamplingParams,
    totals: dict[str, KindTotals],
) -> dict[int, list[int]]:
    """Every prompt's output ids (by its index), `concurrency` requests running at once; each step
    is added to the totals of its kind."""
    waiting, running, outputs = list(prompts), [], {}
    while running or waiting:
        while waiting and len(running) < concurrency:
            index, prompt_ids = waiting.pop(0)
            running.append((index, decoder.start(prompt_ids, params)))
            outputs[index] = []
        kind = step_kind([gen for _, gen in running], concurrency)
        started = time.perf_counter()
        results = decoder.step([gen for _, gen in running])
        seconds = time.perf_counter() - started
        for (index, _), result in zip(running, results):
            if result.error is not None:
                raise RuntimeError(f"prompt {index} failed: {result.error}")
            outputs[index] += result.token_ids
        totals[kind].add(seconds, decoder.last_step, sum(len(result.token_ids) for result in results))
        running = [(index, gen) for index, gen in running if not gen.finished]
    return outputs


def rows_of(concurrency: int, model: str, totals: dict[str, KindTotals]) -> list[Row]:
    """A row per kind that had steps, then one for all the steps."""
    kinds = [*totals.items(), ("all", KindTotals.merged(totals.values()))]
    return [row(concurrency, model, kind, total) for kind, total in kinds if total.steps]


def row(concurrency: int, model: str, kind: str, total: KindTotals) -> Row:
    per_step = 1e3 / total.steps
    return Row(
        concurrency,
        model,
        kind,
        total.steps,
        round(total.seconds * per_step, 2),
        round(total.forward * per_step, 2),
        *(round(total.host[part] * per_step, 3) for part in HOST_PARTS),
        round(total.fed / total.steps, 1),
        round(total.made / total.steps, 2),
        round(total.made / total.seconds, 1),
        round(total.seconds, 2),
    )


def format_table(rows: Sequence[Row]) -> str:
    header = (
        "c",
        "model",
        "kind",
        "steps",
        "ms/step",
        "forward",
        *HOST_PARTS,
        "fed/step",
        "made/step",
        "tokens/s",
        "seconds",
    )
    return markdown_table(
        header,
        [
            (
                r.concurrency,
                r.model,
                r.kind,
                r.steps,
                r.ms_per_step,
                r.forward_ms,
                r.schedule_ms,
                r.draft_ms,
                r.verify_ms,
                r.commit_ms,
                r.fed_per_step,
                r.made_per_step,
                r.tokens_per_second,
                r.seconds,
            )
            for r in rows
        ],
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="default model name or a local HF folder")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--concurrency", type=parse_concurrency, default=(1, 4, 8), help="e.g. 4,8")
    parser.add_argument("--sets", nargs="+", default=["doc_qa", "code_edit"], choices=PROMPT_SET_NAMES)
    parser.add_argument("--prompts", type=int, default=24, help="prompts of each set per level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("results/step_kinds"))
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1:
        parser.error("--prompts and --max-tokens must be >= 1")
    return args


def measure_level(
    loaded: LoadedModel, level: Sequence[tuple[int, list[int]]], concurrency: int, params: SamplingParams
) -> tuple[dict[str, dict[str, KindTotals]], list[int]]:
    """Each model's totals by kind at one concurrency, and the prompts whose outputs differ."""
    decoders = {
        "lookahead": LookaheadDecoder.for_model(loaded, NGramTrie(capacity=1_000_000, max_depth=16)),
        "plain": LookaheadDecoder.for_model(loaded, None, LookaheadConfig(use_lookahead=False)),
    }
    totals = {model: {kind: KindTotals() for kind in KINDS} for model in decoders}
    outputs: dict[str, dict[int, list[int]]] = {model: {} for model in decoders}
    size = BLOCK * concurrency
    for number, start in enumerate(range(0, len(level), size)):
        for model in list(decoders) if number % 2 == 0 else list(reversed(decoders)):
            block = level[start : start + size]
            outputs[model].update(run_block(decoders[model], block, concurrency, params, totals[model]))
    plain = outputs["plain"]
    return totals, [index for index in plain if outputs["lookahead"][index] != plain[index]]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    loaded = load_model(args.model, threads=args.threads)
    freeze_loaded_objects()  # as the server does
    params = SamplingParams(max_tokens=args.max_tokens)
    rows: list[Row] = []
    identical = True
    for name in args.sets:
        prompt_set = load_prompt_set(name)
        prompts = [encode(loaded, prompt_set, prompt) for prompt in prompt_set.prompts]
        for number, concurrency in enumerate(args.concurrency):
            first = number * args.prompts  # each level its own prompts
            level = list(enumerate(prompts[first : first + args.prompts], start=first))
            totals, differing = measure_level(loaded, level, concurrency, params)
            if differing:
                print(f"{name} c={concurrency}: outputs differ for prompts {differing}", file=sys.stderr)
                identical = False
            looked, plain = (rows_of(concurrency, f"{name}: {model}", totals[model]) for model in totals)
            ratio = looked[-1].tokens_per_second / plain[-1].tokens_per_second
            print(f"{name} c={concurrency}: lookahead {ratio:.2f}x plain decoding's tokens/s", flush=True)
            rows += looked + plain
    table = format_table(rows)
    print()
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_kinds.md").write_text(table + "\n")
    write_csv(rows, Row, args.out / "step_kinds.csv")
    return 0 if identical else 1
