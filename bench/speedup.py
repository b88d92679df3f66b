"""Lookahead against the baseline model through the server: per prompt set and concurrency,
greedy, every output identical.

For each prompt set a tritonserver is started with empty tries (its trie snapshots in
--out/trie_state, emptied first). At each concurrency level c the set's next unused prompts
(from --offset on, --prompts per level) go out in rounds of c requests sent at once over gRPC
streaming; each round goes to every model in turn, the first model rotating from round to
round, so the models share the same minutes of the machine. Prompts are a chat set's in the
served model's chat template (HumanEval's stubs as they are), greedy, up to --max-tokens tokens,
stopping at the model's end of turn. Each model learns only from what it served, as in
production: later prompts may draft from earlier answers.

Reported per set, level and model: output tokens/s (all output tokens over the summed wall time
of that model's rounds) and its ratio to the baseline's; tokens per decoding step and accepted
draft tokens per step (return_perf_metrics); milliseconds per step (a request's time after its
first response over its steps). Every model's text must equal the baseline's for every prompt
(exit status 1 otherwise). `--model-repository` from `python -m bench ab_repository` serves
another revision's models beside this checkout's (`lookahead_ref`), so "today" and the branch
are measured in the same run.

    python -m bench speedup --sets code_edit doc_qa mtbench humaneval --concurrency 1,4
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.genai_perf import served_tokenizer
from bench.prompt_sets import PROMPT_SET_NAMES, load_prompt_set
from bench.report import write_csv
from bench.servers import add_comparison_arguments, check_comparison_arguments, parse_concurrency, server_url
from client.api import Chunk, Completion, LookaheadClient
from launcher import TritonServerError
from lookahead.models.chat import chat_prompt

# Held out from the prompts the acceptance predictor was tuned on (bench/acceptance.py's
# defaults read code_edit from 100, the others from 40, 16 each).
OFFSETS = {"code_edit": 120, "doc_qa": 0, "mtbench": 0, "humaneval": 0, "gsm8k": 0}


@dataclass(frozen=True)
class Run:
    """One request of one model."""

    set: str
    concurrency: int
    prompt: int
    model: str
    output_tokens: int
    steps: int
    accepted_draft_tokens: int
    decode_seconds: float  # first response to last
    text: str


@dataclass(frozen=True)
class Point:
    """One model at one level of one set."""

    set: str
    concurrency: int
    model: str
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_second: float
    speedup: float  # over the baseline's tokens/s at the same level
    tokens_per_step: float
    accepted_per_step: float
    ms_per_step: float
    identical: int  # requests whose text equals the baseline's


def prompts_of(name: str, tokenizer: str) -> list[str]:
    """The set's prompts as a client sends them to a server that applies no template."""
    prompt_set = load_prompt_set(name)
    if not prompt_set.use_chat_template:
        return list(prompt_set.prompts)
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tokenizer)
    return [chat_prompt(loaded, [{"role": "user", "content": text}]) for text in prompt_set.prompts]


def complete(url: str, model: str, prompt: str, max_tokens: int, extra: dict[str, Any]) -> Completion:
    """One streamed completion. `model` may name a drafter after a colon (`lookahead:hybrid`): the
    served model with that per-request drafter (on a running --url that serves it to no other
    entry; a server started for the run serves it as a model of its own, check_comparison_arguments)."""
    name, _, drafter = model.partition(":")
    options = {**extra, "drafter": drafter} if drafter else extra
    chunks: list[Chunk] = list(
        LookaheadClient(url, model=name).stream(prompt, max_tokens=max_tokens, **options)
    )
    return Completion.from_chunks(chunks)


def run_round(
    url: str, model: str, prompts: Sequence[str], max_tokens: int, extra: dict[str, Any]
) -> tuple[list[Completion], float]:
    """Send every prompt at once; (completions in order, wall seconds until the last is done)."""
    import time

    results: list[Completion | BaseException | None] = [None] * len(prompts)

    def one(index: int) -> None:
        try:
            results[index] = complete(url, model, prompts[index], max_tokens, extra)
        except BaseException as error:  # reported below, on the caller's thread
            results[index] = error

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [result for result in results if isinstance(result, Completion)], elapsed


def measure_level(
    url: str, args: argparse.Namespace, name: str, level: int, prompts: Sequence[str], first: int
) -> tuple[list[Run], dict[str, float]]:
    """Every round of one level; the runs and each model's summed round seconds."""
    runs: list[Run] = []
    seconds = dict.fromkeys(args.models, 0.0)
    for start in range(0, len(prompts), level):
        batch = prompts[start : start + level]
        shift = (start // level) % len(args.models)
        for model in args.models[shift:] + args.models[:shift]:
            completions, elapsed = run_round(url, model, batch, args.max_tokens, {})
            seconds[model] += elapsed
            for offset, reply in enumerate(completions):
                steps = int(reply.perf.get("num_decoding_steps", 0))
                decode = (reply.chunk_seconds[-1] - reply.chunk_seconds[0]) if reply.chunk_seconds else 0.0
                runs.append(
                    Run(
                        name,
                        level,
                        first + start + offset,
                        model,
                        reply.num_output_tokens,
                        steps,
                        int(reply.perf.get("total_accepted_draft_tokens", 0)),
                        decode,
                        reply.text,
                    )
                )
        print(f"{name} c={level}: prompts {first + start}..{first + start + len(batch) - 1} done", flush=True)
    return runs, seconds


def summarize(runs: Sequence[Run], seconds: dict[tuple[str, int, str], float], baseline: str) -> list[Point]:
    points = []
    order = list(dict.fromkeys(r.model for r in runs))  # the models in the order they were asked for
    keys = sorted(
        {(r.set, r.concurrency, r.model) for r in runs}, key=lambda k: (k[0], k[1], order.index(k[2]))
    )
    texts = {(r.set, r.concurrency, r.prompt, r.model): r.text for r in runs}
    for set_name, level, model in keys:
        mine = [r for r in runs if (r.set, r.concurrency, r.model) == (set_name, level, model)]
        tokens = sum(r.output_tokens for r in mine)
        steps = sum(r.steps for r in mine)
        rate = tokens / seconds[set_name, level, model]
        base_runs = [r for r in runs if (r.set, r.concurrency, r.model) == (set_name, level, baseline)]
        base_rate = sum(r.output_tokens for r in base_runs) / seconds[set_name, level, baseline]
        points.append(
            Point(
                set_name,
                level,
                model,
                len(mine),
                tokens,
                seconds[set_name, level, model],
                rate,
                rate / base_rate,
                sum(r.output_tokens - 1 for r in mine) / steps if steps else 0.0,
                sum(r.accepted_draft_tokens for r in mine) / steps if steps else 0.0,
                1000 * sum(r.decode_seconds for r in mine) / steps if steps else 0.0,
                sum(texts[set_name, level, r.prompt, baseline] == r.text for r in mine),
            )
        )
    return points


def format_table(points: Sequence[Point]) -> str:
    header = (
        "| set | concurrency | model | requests | output tokens | tokens/s (x baseline) "
        "| tokens/step | accepted/step | ms/step | identical |"
    )
    lines = [header, "|---" * 10 + "|"]
    for p in points:
        lines.append(
            f"| {p.set} | {p.concurrency} | {p.model} | {p.requests} | {p.output_tokens} "
            f"| {p.tokens_per_second:.1f} ({p.speedup:.2f}x) | {p.tokens_per_step:.2f} "
            f"| {p.accepted_per_step:.2f} | {p.ms_per_step:.1f} | {p.identical}/{p.requests} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_comparison_arguments(parser)
    parser.add_argument("--sets", nargs="+", default=["code_edit", "doc_qa", "mtbench", "humaneval"])
    parser.add_argument("--concurrency", type=parse_concurrency, default=(1, 4))
    parser.add_argument("--prompts", type=int, default=8, help="prompts per level")
    parser.add_argument("--offset", type=int, default=None, help="first prompt (default: per set, OFFSETS)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--tokenizer", default=None, help="default: the lookahead model's (served_tokenizer)")
    parser.add_argument("--out", type=Path, default=Path("results/speedup"))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.sets) - set(PROMPT_SET_NAMES))
    if unknown:
        parser.error(f"unknown prompt sets {unknown}; choose from {', '.join(PROMPT_SET_NAMES)}")
    return check_comparison_arguments(parser, args)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = args.tokenizer or str(served_tokenizer(args.model_repository, "lookahead"))
    runs: list[Run] = []
    seconds: dict[tuple[str, int, str], float] = {}
    try:
        for name in args.sets:
            prompts = prompts_of(name, tokenizer)
            first = OFFSETS.get(name, 0) if args.offset is None else args.offset
            with server_url(args) as url:  # a fresh server: empty tries for every set
                for model in args.models:
                    complete(url, model, "Hello", 4, {})
                for level in args.concurrency:
                    chunk = prompts[first : first + args.prompts]
                    if len(chunk) < args.prompts:
                        raise ValueError(f"{name} has {len(prompts)} prompts: not enough from {first}")
                    level_runs, level_seconds = measure_level(url, args, name, level, chunk, first)
                    runs += level_runs
                    seconds.update({(name, level, model): s for model, s in level_seconds.items()})
                    first += args.prompts
    except (TritonServerError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    points = summarize(runs, seconds, args.baseline)
    table = format_table(points)
    print(table)
    (args.out / "speedup.md").write_text(
        f"# Lookahead against {args.baseline}\n\n{table}\n", encoding="utf-8"
    )
    write_csv(points, Point, args.out / "speedup.csv")
    (args.out / "runs.json").write_text(
        json.dumps([asdict(r) for r in runs], indent=1) + "\n", encoding="utf-8"
    )
    differing = [p for p in points if p.identical != p.requests]
    if differing:
        for p in differing:
            print(
                f"error: {p.model} differs from {args.baseline} on {p.requests - p.identical} prompts of "
                f"{p.set} at concurrency {p.concurrency}",
                file=sys.stderr,
            )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
