"""Decoder benchmark: plain greedy, prompt lookup and Lookahead on the same prompts, in one process.

For every prompt set: transformers greedy `generate`, transformers prompt lookup decoding
(`prompt_lookup_num_tokens=10`), then LookaheadDecoder in `hier` and `one` modes. Each prompt
goes through every method in turn, in an order rotating from prompt to prompt, so that the
machine's drift over minutes and the caches one method leaves to the next hit all methods alike.
Each Lookahead mode gets a fresh global trie (and a fresh decoder, whose cost model learns
online), so every mode starts from the same state; HumanEval's trie is warmed with its disjoint
warm-up half first. Within a set the global trie keeps learning from
every output, as it does when serving.

Every output must be token-identical to plain greedy (all methods are lossless); a mismatch is
reported loudly and makes the exit status 1. Tokens/s counts all output tokens over wall time,
prefill included; tokens/step counts tokens after the first one per decoding forward.

    python -m bench decoding --limit 20 --out results/benchmark
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from lookahead.algorithm.trie import NGramTrie
from lookahead.config import LINEAR_KERNELS, LookaheadConfig, SamplingParams
from lookahead.models.chat import apply_chat_template
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import DTYPES, LoadedModel, freeze_loaded_objects, load_model
from lookahead.runtime.decoder import LookaheadDecoder

from .prompt_sets import PROMPT_SET_NAMES, PromptSet, load_prompt_set
from .report import figure

METHODS = ("greedy", "prompt_lookup", "lookahead_hier", "lookahead_one")
BASELINES = ("greedy", "prompt_lookup")
PROMPT_LOOKUP_TOKENS = 10
WARMUP_NEW_TOKENS = 8
TRIE_LEARNING_NOTE = (
    "each Lookahead mode starts from a fresh global trie per set (HumanEval's warmed with its warm-up "
    "half); the trie also learns from every output within a set, so later prompts can draft from "
    "earlier answers"
)


@dataclass(frozen=True)
class PromptRun:
    """One prompt's generation; decode_steps counts the forwards after the prefill."""

    output_ids: list[int]
    decode_steps: int
    seconds: float = 0.0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass
class MethodResult:
    set_name: str
    method: str
    runs: list[PromptRun]
    mismatches: list[int] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(len(run.output_ids) for run in self.runs)

    @property
    def seconds(self) -> float:
        return sum(run.seconds for run in self.runs)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens accepted per decoding forward; the prefill's token is not a step's."""
        steps = sum(run.decode_steps for run in self.runs)
        after_prefill = sum(max(len(run.output_ids) - 1, 0) for run in self.runs)
        return after_prefill / steps if steps else 0.0


Runner = Callable[[list[int], int], PromptRun]


@contextmanager
def counted_forwards(model: Any) -> Iterator[list[int]]:
    """Count the model's forward calls inside the block (one per decoding step in HF generate)."""
    count = [0]

    def hook(*_: Any) -> None:
        count[0] += 1

    handle = model.register_forward_pre_hook(hook)
    try:
        yield count
    finally:
        handle.remove()


def transformers_runner(loaded: LoadedModel, **generate_kwargs: Any) -> Runner:
    model = loaded.model
    pad_token_id = loaded.tokenizer.pad_token_id
    if pad_token_id is None:
        pad_token_id = loaded.eos_token_ids[0]

    def run(prompt_ids: list[int], max_new_tokens: int) -> PromptRun:
        input_ids = torch.tensor([prompt_ids], device=model.device)
        with counted_forwards(model) as forwards, torch.inference_mode():
            output = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=list(loaded.eos_token_ids),
                pad_token_id=pad_token_id,
                **generate_kwargs,
            )
        return PromptRun(output[0, len(prompt_ids) :].tolist(), decode_steps=forwards[0] - 1)

    return run


def lookahead_runner(loaded: LoadedModel, config: LookaheadConfig, trie: NGramTrie) -> Runner:
    decoder = LookaheadDecoder.for_model(loaded, trie, config)

    def run(prompt_ids: list[int], max_new_tokens: int) -> PromptRun:
        output_ids, stats = decoder.generate(prompt_ids, SamplingParams(max_tokens=max_new_tokens))
        return PromptRun(
            list(output_ids),
            decode_steps=stats.steps,
            draft_tokens=stats.draft_tokens,
            accepted_draft_tokens=stats.accepted_draft_tokens,
        )

    return run


def lookahead_config(method: str) -> LookaheadConfig:
    """The library defaults, with the decoding mode named by the method."""
    return LookaheadConfig(decoding_mode=method.removeprefix("lookahead_"))


def make_runner(
    method: str, loaded: LoadedModel, warmup_ids: Sequence[list[int]], trie_capacity: int
) -> Runner:
    """A fresh runner: Lookahead ones get a new decoder and a new (warmed) global trie."""
    if method == "greedy":
        return transformers_runner(loaded)
    if method == "prompt_lookup":
        return transformers_runner(loaded, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)
    config = lookahead_config(method)
    trie = NGramTrie(capacity=trie_capacity)
    for token_ids in warmup_ids:
        trie.insert(token_ids)
    return lookahead_runner(loaded, config, trie)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so that wall-clock timing covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    runners: dict[str, Runner], prompts: Sequence[list[int]], max_new_tokens: int, device: torch.device
) -> dict[str, list[PromptRun]]:
    """Every method's runs, the methods taking each prompt in turn.

    The order rotates from one prompt to the next: a method run right after another finds the
    caches that one left behind (a few percent on code editing), so no method always follows the same one.
    """
    runs: dict[str, list[PromptRun]] = {method: [] for method in runners}
    methods = list(runners)
    for index, prompt_ids in enumerate(prompts):
        shift = index % len(methods)
        for method in methods[shift:] + methods[:shift]:
            runner = runners[method]
            synchronize(device)
            started = time.perf_counter()
            run = runner(prompt_ids, max_new_tokens)
            synchronize(device)
            runs[method].append(replace(run, seconds=time.perf_counter() - started))
    return runs


def encode(loaded: LoadedModel, prompt_set: PromptSet, prompt: str) -> list[int]:
    if prompt_set.use_chat_template:
        return apply_chat_template(loaded.tokenizer, prompt)
    return loaded.tokenizer(prompt).input_ids


def first_difference(expected: list[int], actual: list[int]) -> int:
    return next(
        (i for i, (a, b) in enumerate(zip(expected, actual)) if a != b), min(len(expected), len(actual))
    )


def check_lossless(result: MethodResult, reference: MethodResult, tokenizer: Any) -> None:
    """Record and loudly report every prompt whose output differs from plain greedy."""
    for index, (expected, actual) in enumerate(zip(reference.runs, result.runs)):
        if expected.output_ids == actual.output_ids:
            continue
        result.mismatches.append(index)
        at = first_difference(expected.output_ids, actual.output_ids)
        lengths = f"greedy {len(expected.output_ids)} tokens, {result.method} {len(actual.output_ids)}"
        print(
            f"!!! MISMATCH {result.set_name}/{result.method} prompt {index}: differs from greedy at output "
            f"token {at} ({lengths})\n"
            f"    greedy: {tokenizer.decode(expected.output_ids[at : at + 12])!r}\n"
            f"    {result.method}: {tokenizer.decode(actual.output_ids[at : at + 12])!r}",
            file=sys.stderr,
            flush=True,
        )


def benchmark_set(
    loaded: LoadedModel, prompt_set: PromptSet, max_new_tokens: int, trie_capacity: int
) -> list[MethodResult]:
    device = loaded.model.device
    prompts = [encode(loaded, prompt_set, prompt) for prompt in prompt_set.prompts]
    warmup_ids = [loaded.tokenizer(text).input_ids for text in prompt_set.warmup_texts]
    runners: dict[str, Runner] = {}
    for method in METHODS:
        # A throwaway runner pays the first-call costs so the measured one starts clean.
        make_runner(method, loaded, warmup_ids, trie_capacity)(
            prompts[0], min(WARMUP_NEW_TOKENS, max_new_tokens)
        )
        runners[method] = make_runner(method, loaded, warmup_ids, trie_capacity)
    results: list[MethodResult] = []
    for method, runs in measure(runners, prompts, max_new_tokens, device).items():
        result = MethodResult(prompt_set.name, method, runs)
        if results:
            check_lossless(result, results[0], loaded.tokenizer)
        print(
            f"{prompt_set.name:>10} {method:>15}: {result.output_tokens} tokens in {result.seconds:.1f} s, "
            f"{result.tokens_per_second:.2f} tok/s, {result.tokens_per_step:.2f} tok/step",
            flush=True,
        )
        results.append(result)
    return results


def speedup(result: MethodResult, baseline: MethodResult) -> float:
    return result.tokens_per_second / baseline.tokens_per_second if baseline.tokens_per_second else 0.0


def summary_rows(results: Sequence[MethodResult]) -> list[dict[str, Any]]:
    baselines = {(r.set_name, r.method): r for r in results if r.method in BASELINES}
    rows = []
    for result in results:
        rows.append(
            {
                "set": result.set_name,
                "method": result.method,
                "prompts": len(result.runs),
                "output_tokens": result.output_tokens,
                "seconds": result.seconds,
                "tokens_per_second": result.tokens_per_second,
                "tokens_per_step": result.tokens_per_step,
                **{
                    f"speedup_vs_{name}": speedup(result, baselines[(result.set_name, name)])
                    for name in BASELINES
                },
                "mismatches": result.mismatches,
                "draft_tokens": sum(run.draft_tokens for run in result.runs),
                "accepted_draft_tokens": sum(run.accepted_draft_tokens for run in result.runs),
            }
        )
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    columns = (
        f"{'set':<10} {'method':<15} {'tokens':>7} {'tok/s':>8} {'tok/step':>8} {'x greedy':>8} {'x PLD':>7}"
    )
    lines = [f"{columns}  lossless", "-" * (len(columns) + 10)]
    for row in rows:
        if row["method"] == "greedy":
            lossless = "-"
        else:
            lossless = f"NO: prompts {row['mismatches']}" if row["mismatches"] else "yes"
        numbers = (
            f"{row['output_tokens']:>7} {row['tokens_per_second']:>8.2f} {row['tokens_per_step']:>8.2f} "
            f"{row['speedup_vs_greedy']:>8.2f} {row['speedup_vs_prompt_lookup']:>7.2f}"
        )
        lines.append(f"{row['set']:<10} {row['method']:<15} {numbers}  {lossless}")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Grouped bars of tokens/s per set, each bar labelled with its speedup over greedy."""
    sets = list(dict.fromkeys(row["set"] for row in rows))
    width = 0.8 / len(METHODS)
    with figure(path, title, size=(2.2 + 2.2 * len(sets), 4.5)) as axes:
        for offset, method in enumerate(METHODS):
            by_set = {row["set"]: row for row in rows if row["method"] == method}
            positions = [index + (offset - (len(METHODS) - 1) / 2) * width for index in range(len(sets))]
            bars = axes.bar(
                positions, [by_set[name]["tokens_per_second"] for name in sets], width, label=method
            )
            labels = [f"{by_set[name]['speedup_vs_greedy']:.2f}x" for name in sets]
            axes.bar_label(bars, labels=labels, fontsize=7, padding=2)
        axes.set_xticks(range(len(sets)), sets)
        axes.set_ylabel("generated tokens/s")
        axes.legend(fontsize=8)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="default model name or a local HF folder")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument(
        "--linear-kernel", default="auto", choices=LINEAR_KERNELS, help="linear kernel of every method"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sets", nargs="+", default=list(PROMPT_SET_NAMES), choices=PROMPT_SET_NAMES)
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    parser.add_argument("--trie-capacity", type=int, default=1_000_000, help="global trie node bound")
    parser.add_argument("--out", type=Path, default=Path("results/benchmark"))
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    loaded = load_model(
        args.model,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        linear_kernel=args.linear_kernel,
    )
    freeze_loaded_objects()  # as the server does
    print(
        f"model {loaded.name} on {args.device} ({args.dtype}, {torch.get_num_threads()} threads, "
        f"{loaded.execution})",
        flush=True,
    )
    print(f"note: {TRIE_LEARNING_NOTE}", flush=True)
    results: list[MethodResult] = []
    prompt_sets = [load_prompt_set(name, args.limit) for name in args.sets]
    for prompt_set in prompt_sets:
        results.extend(benchmark_set(loaded, prompt_set, args.max_new_tokens, args.trie_capacity))
    rows = summary_rows(results)
    print()
    print(format_table(rows))
    print(f"\nnote: {TRIE_LEARNING_NOTE}")

    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "model": loaded.name,
        "device": args.device,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "linear_kernel": loaded.linear_kernel,
        "torch": torch.__version__,
        "max_new_tokens": args.max_new_tokens,
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
        "lookahead_configs": {m: asdict(lookahead_config(m)) for m in METHODS if m.startswith("lookahead_")},
        "trie_capacity": args.trie_capacity,
        "sets": {
            s.name: {"prompts": len(s.prompts), "warmup_texts": len(s.warmup_texts)} for s in prompt_sets
        },
        "note": TRIE_LEARNING_NOTE,
        "results": rows,
        "per_prompt": [
            {"set": r.set_name, "method": r.method, "runs": [asdict(run) for run in r.runs]} for r in results
        ],
    }
    (args.out / "benchmark.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    plot(
        rows,
        args.out / "benchmark.png",
        f"{loaded.name}, {args.device} {args.dtype}, {args.max_new_tokens} new tokens",
    )
    print(f"wrote {args.out / 'benchmark.json'} and {args.out / 'benchmark.png'}")
    mismatched = sum(len(row["mismatches"]) for row in rows)
    if mismatched:
        print(
            f"!!! {mismatched} outputs differ from plain greedy: lookahead is NOT lossless here",
            file=sys.stderr,
        )
        return 1
    return 0
