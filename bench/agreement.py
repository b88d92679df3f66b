"""Agreement of Lookahead on a fast CPU kernel with plain transformers greedy on the stock layers.

Lookahead is lossless on its own execution path: its greedy output equals plain greedy decoding
on the same layers (the decoder benchmark checks that). Against another path, transformers'
stock layers, the two can part where the model's top two logits are nearly tied, because the
kernels round differently (the `packed` kernel), or because the activations are quantised (the
`integer` kernel, `--kernels integer`). This script reports how often they agree over a named
prompt set, and for each prompt that differs, the first differing token and the stock model's
top-2 logit gap there (a near-tie shows as a tiny gap). With `--llama-url`, llama.cpp's own
greedy output on the same prompt tokens (a running `llama-server` on the GGUF file the model was
converted from) is held to the same reference: how often the peer agrees with the fp32 model.

    python -m bench agreement --model qwen2.5-coder-0.5b-instruct --set code_edit --limit 20
    python -m bench agreement --kernels packed,integer --llama-url http://127.0.0.1:8080
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from collections.abc import Callable, Sequence
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


Generate = Callable[[list[int], int], list[int]]


def compare(
    candidates: dict[str, Generate], stock: LoadedModel, prompts: Sequence[list[int]], max_new_tokens: int
) -> dict[str, list[Agreement]]:
    """Each candidate's greedy output against transformers' greedy on the stock layers, by prompt."""
    plain = transformers_runner(stock)
    results: dict[str, list[Agreement]] = {name: [] for name in candidates}
    for index, prompt in enumerate(prompts):
        reference = plain(prompt, max_new_tokens).output_ids
        for name, generate in candidates.items():
            output = generate(prompt, max_new_tokens)
            if output == reference:
                results[name].append(Agreement(index, len(reference), None, None))
                continue
            at = first_difference(reference, output)
            gap = top2_gap(stock, prompt + reference[:at])
            results[name].append(Agreement(index, len(reference), at, gap))
            print(f"{name}, prompt {index}: differs at output token {at}, stock top-2 gap {gap:.3g}")
    return results


def lookahead_generate(loaded: LoadedModel) -> Generate:
    decoder = LookaheadDecoder.for_model(loaded, NGramTrie(), LookaheadConfig())
    return lambda prompt, tokens: decoder.generate(prompt, SamplingParams(max_tokens=tokens))[0]


def llama_generate(url: str, eos_token_ids: Sequence[int]) -> Generate:
    """llama-server's greedy continuation of the prompt's token ids, as token ids, cut after an EOS
    as the decoder ends there."""

    def generate(prompt: list[int], tokens: int) -> list[int]:
        body = {
            "prompt": prompt,
            "n_predict": tokens,
            "temperature": 0.0,
            "top_k": 1,
            "return_tokens": True,
            "cache_prompt": False,
        }
        request = urllib.request.Request(
            f"{url}/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            output = [int(token) for token in json.load(response)["tokens"]]
        for at, token in enumerate(output):
            if token in eos_token_ids:
                return output[: at + 1]
        return output

    return generate


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
    parser.add_argument(
        "--kernels", default="packed", help="lookahead's kernels, comma-separated: packed, integer"
    )
    parser.add_argument("--llama-url", default=None, help="a running llama-server on the model's GGUF file")
    parser.add_argument("--out", type=Path, default=Path("results/agreement.json"))
    args = parser.parse_args(argv)
    kernels = args.kernels.split(",")
    if not set(kernels) <= {"packed", "integer"}:
        parser.error(f"--kernels: packed and/or integer, not {args.kernels!r}")
    fast = [load_model(args.model, threads=args.threads, linear_kernel=kernel) for kernel in kernels]
    stock = load_model(args.model, threads=args.threads, linear_kernel="stock")
    prompt_set = load_prompt_set(args.prompt_set, args.limit)
    prompts = [encode(stock, prompt_set, prompt) for prompt in prompt_set.prompts]
    candidates = {f"lookahead ({loaded.execution})": lookahead_generate(loaded) for loaded in fast}
    if args.llama_url:
        candidates["llama.cpp"] = llama_generate(args.llama_url, stock.eos_token_ids)
    print(f"{stock.name}: {', '.join(candidates)} vs transformers greedy on {stock.execution}")
    results = compare(candidates, stock, prompts, args.max_new_tokens)
    for name, agreements in results.items():
        print(f"{name}: {summary(agreements)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "model": stock.name,
        "set": args.prompt_set,
        "max_new_tokens": args.max_new_tokens,
        "stock": stock.execution,
        "candidates": {
            name: {"summary": summary(agreements), "prompts": [asdict(result) for result in agreements]}
            for name, agreements in results.items()
        },
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0
