"""Agreement of Lookahead on the packed kernel with plain transformers greedy on the stock layers.

Lookahead is lossless on its own execution path: its greedy output equals plain greedy decoding
on the same layers (the decoder benchmark checks that). Against another path, transformers'
stock layers, the two can part where the model's top two logits are nearly tied, because the
kernels round differently. This script reports how often they agree over a named prompt set,
and for each prompt that differs, the first differing token and the stock model's top-2 logit
gap there (a near-tie shows as a tiny gap).

    python -m bench agreement --model qwen2.5-coder-0.5b-instruct --set code_edit --limit 20
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lookahead.algorithm.trie import NGramTrie
from lookahead.config import LookaheadConfig, SamplingParams
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import LoadedModel, load_model
from lookahead.runtime.decoder import LookaheadDecoder

from .decoding import encode, first_difference, transformers_runner
from .prompt_sets import PROMPT_SET_NAMES, load_prompt_set


@dataclass(frozen=True)
class Agreement:
    """One prompt: where the outputs first differ (None: identical) and the stock top-2 gap there."""

    prompt: int
    output_tokens: int
    first_difference: int | None
    top2_gap: float | None


def top2_gap(loaded: LoadedModel, ids: list[int]) -> float:
    """The stock model's gap between its two largest next-token logits after `ids`."""
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids], device=loaded.model.device)).logits[0, -1].float()
    best = logits.topk(2).values
    return float(best[0] - best[1])


def compare(
    packed: LoadedModel, stock: LoadedModel, prompts: Sequence[list[int]], max_new_tokens: int
) -> list[Agreement]:
    decoder = LookaheadDecoder.for_model(packed, NGramTrie(), LookaheadConfig())
    plain = transformers_runner(stock)
    results = []
    for index, prompt in enumerate(prompts):
        lookahead, _ = decoder.generate(prompt, SamplingParams(max_tokens=max_new_tokens))
        reference = plain(prompt, max_new_tokens).output_ids
        if lookahead == reference:
            results.append(Agreement(index, len(reference), None, None))
            continue
        at = first_difference(reference, lookahead)
        results.append(Agreement(index, len(reference), at, top2_gap(stock, prompt + reference[:at])))
        print(f"prompt {index}: differs at output token {at}, stock top-2 gap {results[-1].top2_gap:.3g}")
    return results


def summary(results: Sequence[Agreement]) -> str:
    differing = [r for r in results if r.first_difference is not None]
    line = f"{len(results) - len(differing)}/{len(results)} prompts identical"
    if differing:
        where = ", ".join(f"#{r.prompt} at {r.first_difference} (gap {r.top2_gap:.3g})" for r in differing)
        line += f"; first differences: {where}"
    return line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="an embedded model name or a local folder")
    parser.add_argument("--set", default="code_edit", choices=PROMPT_SET_NAMES, dest="prompt_set")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of the set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=Path("results/agreement.json"))
    args = parser.parse_args(argv)
    packed = load_model(args.model, threads=args.threads, linear_kernel="packed")
    stock = load_model(args.model, threads=args.threads, linear_kernel="stock")
    prompt_set = load_prompt_set(args.prompt_set, args.limit)
    prompts = [encode(stock, prompt_set, prompt) for prompt in prompt_set.prompts]
    print(f"{packed.name}: lookahead on {packed.execution} vs transformers greedy on {stock.execution}")
    results = compare(packed, stock, prompts, args.max_new_tokens)
    print(summary(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "model": packed.name,
        "set": args.prompt_set,
        "max_new_tokens": args.max_new_tokens,
        "packed": packed.execution,
        "stock": stock.execution,
        "summary": summary(results),
        "prompts": [asdict(result) for result in results],
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0
