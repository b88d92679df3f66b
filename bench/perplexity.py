"""Perplexity of held-out text on each execution path: what a kernel's arithmetic costs in quality.

The integer kernel quantises activations to int8 (llama.cpp's arithmetic) where the packed
kernel keeps them in fp32 (transformers' arithmetic); the two can pick different tokens where the
top two logits nearly tie, so token agreement says little about quality. Perplexity does: the
same text, read in chunks through the decoder's own forwards (its KV pool, the fused stack where
the path has one), scored token by token. The text is the running interpreter's standard library
source (never seen as such in a request of the benchmarks' prompt sets), so the numbers repeat.

A path may name the KV cache's entries after a colon (`integer-avx512:float16` stores IEEE
halves; without one, the model's dtype).

    python -m bench perplexity --models smollm2-135m-instruct qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from lookahead.algorithm.draft import Draft
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.runtime.runner import ModelRunner

from .forward_cost import load_on_path

# Standard-library modules whose sources make the text, in order.
TEXT_MODULES = ("textwrap", "shlex", "fnmatch", "colorsys", "bisect", "heapq", "difflib", "statistics")


def held_out_text() -> str:
    import importlib.util

    sources = []
    for name in TEXT_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        sources.append(Path(spec.origin).read_text(encoding="utf-8"))
    return "\n\n".join(sources)


def negative_log_likelihoods(runner: ModelRunner, ids: list[int], chunk: int) -> list[float]:
    """-log p(ids[i + 1] | ids[: i + 1]) for every i, the text fed `chunk` tokens a forward."""
    losses: list[float] = []
    with runner.scratch_slot() as slot, torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            tokens = ids[start : start + chunk]
            chain = Draft(tokens, [-1, *range(len(tokens) - 1)])
            logits = runner.forward_drafts([chain], [start], [slot])[0].float()
            targets = torch.tensor(ids[start + 1 : start + 1 + len(tokens)])
            rows = logits[: len(targets)]
            losses += torch.nn.functional.cross_entropy(rows, targets, reduction="none").tolist()
    return losses


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=[DEFAULT_MODEL])
    parser.add_argument(
        "--paths",
        default="packed-avx512,integer-avx512,integer-avx512:float16",
        help="comma-separated KERNEL-VARIANT[:KV_CACHE_DTYPE]",
    )
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of text scored per model")
    parser.add_argument("--chunk", type=int, default=64, help="tokens per forward")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("results/bench_perplexity.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    text = held_out_text()
    rows = []
    for model in args.models:
        reference = None
        for path in args.paths.split(","):
            kernel_variant, _, kv_cache_dtype = path.partition(":")
            loaded = load_on_path(model, kernel_variant)
            ids = loaded.tokenizer(text)["input_ids"][: args.tokens]
            runner = ModelRunner(
                loaded.model,
                prefix_cache_tokens=0,
                kv_cache_bytes=0,
                kv_cache_dtype=kv_cache_dtype or "model",
            )
            losses = negative_log_likelihoods(runner, ids, args.chunk)
            perplexity = math.exp(sum(losses) / len(losses))
            reference = reference or perplexity
            row = {
                "model": model,
                "path": path,
                "tokens": len(losses),
                "perplexity": perplexity,
                "x_first_path": perplexity / reference,
            }
            rows.append(row)
            print(
                f"{model} {path}: perplexity {perplexity:.4f} over {len(losses)} tokens "
                f"({row['x_first_path']:.4f}x the first path)",
                flush=True,
            )
            del loaded, runner
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    print("\n| model | path | perplexity | x first path |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['path']} | {row['perplexity']:.4f} | {row['x_first_path']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
