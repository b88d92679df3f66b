"""Forward-cost micro-benchmark: stock vs packed linear kernel, by number of new tokens.

Times the decoder's own verification forward (`LookaheadDecoder.forward_drafts`: KV pool,
4-D tree mask) for a chain of q new tokens after `--cached` cached tokens, for q in 1..64, on two
copies of the model in one process: stock transformers linear layers and the packed kernel of
`lookahead.cpu`. Each path is timed in a block of its own (as a server runs one
model, whose weights then stay in the caches), and the blocks alternate over two rounds so that
drift hits both. Prints medians in ms and each q's cost relative to the same path's one-token forward, and
checks that both paths agree on the greedy tokens.

    python -m scripts.bench_forward --threads 2 --repeats 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..algorithm.draft import Draft
from ..models.embedded import DEFAULT_MODEL
from ..models.loading import load_model
from ..runtime.decoder import LookaheadDecoder

NEW_TOKENS = (1, 2, 4, 8, 16, 32, 64)
KERNELS = ("stock", "packed")


def prefilled_decoder(model_name: str, kernel: str, cached: int) -> LookaheadDecoder:
    """A decoder whose pool slot 0 holds `cached` entries of a fixed pseudo-random prompt."""
    loaded = load_model(model_name, linear_kernel=kernel)
    decoder = LookaheadDecoder.for_model(loaded)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, len(loaded.tokenizer) - 100, (cached,), generator=generator)
    generation = decoder.start(prompt.tolist())
    generation.step()  # prefill: the pool now holds `cached` entries plus nothing else
    return decoder


def time_forward(decoder: LookaheadDecoder, q: int, cached: int) -> tuple[float, torch.Tensor]:
    chain = Draft(list(range(1000, 1000 + q)), list(range(-1, q - 1)))
    with torch.inference_mode():
        started = time.perf_counter()
        logits = decoder.forward_drafts([chain], [cached])
        return time.perf_counter() - started, logits[0].argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cached", type=int, default=256, help="KV entries before the new tokens")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("results/bench_forward.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    decoders = {kernel: prefilled_decoder(args.model, kernel, args.cached) for kernel in KERNELS}
    samples: dict[str, dict[int, list[float]]] = {kernel: {q: [] for q in NEW_TOKENS} for kernel in KERNELS}
    tokens: dict[str, dict[int, torch.Tensor]] = {kernel: {} for kernel in KERNELS}
    for _ in range(2):  # rounds
        for kernel, decoder in decoders.items():
            for q in NEW_TOKENS:
                for _ in range(2):  # warm-up
                    time_forward(decoder, q, args.cached)
                for _ in range(-(-args.repeats // 2)):
                    seconds, tokens[kernel][q] = time_forward(decoder, q, args.cached)
                    samples[kernel][q].append(seconds)
    agree = all(torch.equal(tokens["stock"][q], tokens["packed"][q]) for q in NEW_TOKENS)
    medians = {
        kernel: {q: statistics.median(seconds) * 1e3 for q, seconds in by_q.items()}
        for kernel, by_q in samples.items()
    }
    print(f"forward cost, {args.cached} cached tokens, {args.threads} threads, median of {args.repeats}")
    print(f"{'new tokens':>10} | {'stock ms':>8} | {'x q=1':>6} | {'packed ms':>9} | {'x q=1':>6} | ratio")
    for q in NEW_TOKENS:
        stock, packed = medians["stock"][q], medians["packed"][q]
        print(
            f"{q:>10} | {stock:8.1f} | {stock / medians['stock'][1]:6.2f} | {packed:9.1f} | "
            f"{packed / medians['packed'][1]:6.2f} | {packed / stock:.2f}"
        )
    print("greedy tokens of both paths agree" if agree else "WARNING: the paths chose other greedy tokens")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cached": args.cached, "threads": args.threads, "ms": medians}, indent=2))


if __name__ == "__main__":
    main()
