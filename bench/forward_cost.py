"""Forward-cost micro-benchmark: stock layers and every variant of the fast CPU path, by new tokens.

Times the decoder's own verification forward (`ModelRunner.forward_drafts`: KV pool, 4-D tree
mask) for a chain of q new tokens after `--cached` cached tokens, for q in 1..64, on one copy of
the model per execution path in one process: transformers' stock layers and each variant of
`lookahead.cpu`'s kernels this CPU runs (`packed-<variant>`: fp32 activations, transformers'
bits; `integer-<variant>`: int8 activations, fused layers; `--kernels` picks). Each path is
timed in a block of its own (as a server runs one model, whose weights then stay in the caches),
and the blocks alternate over two rounds so that drift hits all of them. Prints medians in ms,
each q's cost relative to the same path's one-token forward and each fast path's speed-up over
stock, and checks that the paths of one arithmetic chose the same greedy tokens (stock and
packed; the integer variants among themselves).

    python -m bench forward_cost --threads 2 --repeats 15
    scripts/as_avx2.sh .venv/bin/python -m bench forward_cost   # as on an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lookahead.algorithm.draft import Draft
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import load_model
from lookahead.runtime.decoder import LookaheadDecoder

NEW_TOKENS = (1, 2, 4, 8, 16, 32, 64)


def execution_paths(kernels: Sequence[str]) -> list[str]:
    """ "stock", then "<kernel>-<variant>" for every kernel and every variant this CPU runs."""
    from lookahead.cpu.extension import runnable_variants

    return ["stock", *(f"{kernel}-{variant.name}" for kernel in kernels for variant in runnable_variants())]


def load_on_path(model_name: str, path: str) -> Any:
    """The model as a server loads it (a GGUF file's integer forms handed to the packing) on `path`:
    "stock" or "<kernel>-<variant>"."""
    if path == "stock":
        return load_model(model_name, linear_kernel="stock")
    from lookahead.cpu.extension import VARIANT_ENV

    kernel, _, variant = path.partition("-")
    saved = os.environ.get(VARIANT_ENV)
    os.environ[VARIANT_ENV] = variant
    try:
        return load_model(model_name, linear_kernel=kernel)
    finally:
        if saved is None:
            del os.environ[VARIANT_ENV]
        else:
            os.environ[VARIANT_ENV] = saved


def prefilled_decoder(model_name: str, path: str, cached: int) -> LookaheadDecoder:
    """A decoder on `path` whose pool slot 0 holds `cached` entries of a fixed pseudo-random prompt."""
    loaded = load_on_path(model_name, path)
    decoder = LookaheadDecoder(loaded.model, loaded.tokenizer)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, len(loaded.tokenizer) - 100, (cached,), generator=generator)
    generation = decoder.start(prompt.tolist())
    generation.step()  # prefill: the pool now holds `cached` entries plus nothing else
    return decoder


def time_forward(decoder: LookaheadDecoder, q: int, cached: int) -> tuple[float, torch.Tensor]:
    chain = Draft(list(range(1000, 1000 + q)), list(range(-1, q - 1)))
    with torch.inference_mode():
        started = time.perf_counter()
        logits = decoder.runner.forward_drafts([chain], [cached])
        return time.perf_counter() - started, logits[0].argmax(-1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cached", type=int, default=256, help="KV entries before the new tokens")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--kernels", default="packed,integer", help="comma-separated: packed, integer")
    parser.add_argument("--out", type=Path, default=Path("results/bench_forward.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    paths = execution_paths(args.kernels.split(","))
    decoders = {path: prefilled_decoder(args.model, path, args.cached) for path in paths}
    samples: dict[str, dict[int, list[float]]] = {path: {q: [] for q in NEW_TOKENS} for path in paths}
    tokens: dict[str, dict[int, torch.Tensor]] = {path: {} for path in paths}
    for _ in range(2):  # rounds
        for path, decoder in decoders.items():
            for q in NEW_TOKENS:
                for _ in range(2):  # warm-up
                    time_forward(decoder, q, args.cached)
                for _ in range(-(-args.repeats // 2)):
                    seconds, tokens[path][q] = time_forward(decoder, q, args.cached)
                    samples[path][q].append(seconds)
    families = [
        [p for p in paths if not p.startswith("integer-")],
        [p for p in paths if p.startswith("integer-")],
    ]
    agree = all(
        torch.equal(tokens[path][q], tokens[family[0]][q])
        for family in families
        for path in family
        for q in NEW_TOKENS
    )
    medians = {
        path: {q: statistics.median(seconds) * 1e3 for q, seconds in by_q.items()}
        for path, by_q in samples.items()
    }
    print(
        f"forward cost, {args.cached} cached tokens, {args.threads} threads, median of {args.repeats}; "
        f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    header = " | ".join(
        f"{path + ' ms':>18} | {'x q=1':>5}" + ("" if path == "stock" else " | x stock") for path in paths
    )
    print(f"{'new tokens':>10} | {header}")
    for q in NEW_TOKENS:
        cells = []
        for path in paths:
            ms = medians[path][q]
            cell = f"{ms:18.1f} | {ms / medians[path][1]:5.2f}"
            if path != "stock":
                cell += f" | {medians['stock'][q] / ms:7.2f}"
            cells.append(cell)
        print(f"{q:>10} | " + " | ".join(cells))
    print(
        "greedy tokens agree within each arithmetic (stock and packed; integer)"
        if agree
        else "WARNING: paths of one arithmetic chose other greedy tokens"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "cached": args.cached,
        "threads": args.threads,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "ms": medians,
        "agree": agree,
    }
    args.out.write_text(json.dumps(report, indent=2))
    return 0
