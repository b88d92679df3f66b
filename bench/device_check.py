"""The forward-cost curve and a decoder benchmark on a random-weight model of Qwen2.5-7B's shape.

No download: the model is built from a config with random weights, directly in the requested
dtype on the device. Its acceptance means nothing (random weights copy nothing in particular);
what it measures is the hardware: the verification forward's cost for 1..64 new tokens after a
256-token prefix (on a GPU a 64-token forward should cost little more than a 1-token one), and
a decoding step's overhead outside the forward (retrieval, planning, verification). `--smoke`
runs the same steps on a tiny shape, so the script can be checked on a CPU.

    python -m bench device_check --device cuda            # part of scripts/gpu_check.sh
    python -m bench device_check --device cpu --smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from lookahead.algorithm.draft import Draft
from lookahead.algorithm.trie import NGramTrie
from lookahead.config import LookaheadConfig, SamplingParams
from lookahead.models.loading import DTYPES, LoadedModel, NoTokenizer, apply_execution_path
from lookahead.runtime.decoder import LookaheadDecoder

# Qwen2.5-7B-Instruct's published shape.
QWEN25_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
SMOKE = dict(QWEN25_7B, vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
NEW_TOKENS = (1, 2, 4, 8, 16, 32, 64)
CACHED = 256


def random_model(shape: dict[str, Any], device: str, dtype: str) -> LoadedModel:
    """A seeded random-weight Qwen2 model on `device`, on the execution path load_model would pick."""
    config = Qwen2Config(**shape, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]).eval()
    kernel, execution, cost_prior = apply_execution_path(model, "auto")
    return LoadedModel(
        model=model,
        tokenizer=NoTokenizer(config.vocab_size),
        name=f"random Qwen2 ({config.num_hidden_layers} layers, hidden {config.hidden_size})",
        fingerprint="random",
        eos_token_ids=(),
        linear_kernel=kernel,
        execution=execution,
        cost_prior=cost_prior,
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_costs(loaded: LoadedModel, repeats: int) -> dict[int, float]:
    """Median ms of one verification forward of a q-token chain after CACHED cached tokens."""
    decoder = LookaheadDecoder.for_model(loaded)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, loaded.model.config.vocab_size - 100, (CACHED,), generator=generator).tolist()
    decoder.start(prompt, SamplingParams(max_tokens=2)).step()  # prefill: slot 0 holds CACHED entries
    costs = {}
    with torch.inference_mode():
        for q in NEW_TOKENS:
            chain = Draft(list(range(20, 20 + q)), list(range(-1, q - 1)))
            samples = []
            for index in range(repeats + 3):  # 3 warm-up forwards
                synchronize(decoder.device)
                started = time.perf_counter()
                decoder.runner.forward_drafts([chain], [CACHED])
                synchronize(decoder.device)
                if index >= 3:
                    samples.append(time.perf_counter() - started)
            costs[q] = statistics.median(samples) * 1e3
    return costs


def repeating_prompts(vocab: int, count: int) -> list[list[int]]:
    """Random prompts whose second half repeats the first, so the decoder drafts copies."""
    generator = torch.Generator().manual_seed(1)
    prompts = []
    for _ in range(count):
        half = torch.randint(10, vocab - 100, (CACHED // 2,), generator=generator).tolist()
        prompts.append(half + half)
    return prompts


def decoder_benchmark(
    loaded: LoadedModel, prompts: Sequence[list[int]], max_tokens: int
) -> list[dict[str, Any]]:
    """Plain and lookahead decoding of the same prompts on the same path: speed, per-step costs, agreement."""
    rows, outputs = [], {}
    for name, config in (("plain", LookaheadConfig(use_lookahead=False)), ("lookahead", LookaheadConfig())):
        decoder = LookaheadDecoder.for_model(loaded, NGramTrie(), config)
        decoder.generate(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        tokens = steps = 0
        seconds = forward = retrieval = 0.0
        outputs[name] = []
        for prompt in prompts:
            synchronize(decoder.device)
            started = time.perf_counter()
            ids, stats = decoder.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            synchronize(decoder.device)
            seconds += time.perf_counter() - started - stats.prefill_seconds
            tokens, steps = tokens + len(ids) - 1, steps + stats.steps
            forward += sum(stats.forward_seconds)
            retrieval += sum(stats.retrieval_seconds)
            outputs[name].append(ids)
        rows.append(
            {
                "method": name,
                "tokens_per_second": tokens / seconds,
                "tokens_per_step": tokens / steps,
                "step_ms": seconds / steps * 1e3,
                "forward_ms": forward / steps * 1e3,
                "overhead_ms": (seconds - forward) / steps * 1e3,
                "retrieval_ms": retrieval / steps * 1e3,
            }
        )
    same = sum(a == b for a, b in zip(outputs["plain"], outputs["lookahead"]))
    rows[-1]["identical_to_plain"] = f"{same}/{len(prompts)}"
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--smoke", action="store_true", help="a tiny shape instead of Qwen2.5-7B's")
    parser.add_argument("--repeats", type=int, default=10, help="timed forwards per point of the curve")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    loaded = random_model(SMOKE if args.smoke else QWEN25_7B, args.device, args.dtype)
    parameters = sum(p.numel() for p in loaded.model.parameters())
    print(
        f"{loaded.name}, {parameters / 1e9:.2f}B parameters, {args.dtype} on {args.device} "
        f"({loaded.execution}); built in {time.perf_counter() - started:.1f} s"
    )
    if args.device.startswith("cuda"):
        print(f"GPU: {torch.cuda.get_device_name(torch.device(args.device))}")
    costs = forward_costs(loaded, args.repeats)
    print(f"\nforward cost after {CACHED} cached tokens (median of {args.repeats})")
    print(f"{'new tokens':>10} | {'ms':>8} | {'x q=1':>6}")
    for q, ms in costs.items():
        print(f"{q:>10} | {ms:8.2f} | {ms / costs[1]:6.2f}")
    rows = decoder_benchmark(
        loaded, repeating_prompts(loaded.model.config.vocab_size, args.prompts), args.max_tokens
    )
    print(f"\ndecoder, {args.prompts} prompts x {args.max_tokens} tokens (random weights: ignore acceptance)")
    print(
        f"{'method':>9} | {'tok/s':>8} | {'tok/step':>8} | {'step ms':>7} | {'forward':>7} | "
        "other ms | retrieval"
    )
    for row in rows:
        print(
            f"{row['method']:>9} | {row['tokens_per_second']:8.1f} | {row['tokens_per_step']:8.2f} | "
            f"{row['step_ms']:7.2f} | {row['forward_ms']:7.2f} | {row['overhead_ms']:8.2f} | "
            f"{row['retrieval_ms']:.2f}"
        )
    print(f"lookahead output identical to plain decoding on {rows[-1]['identical_to_plain']} prompts")
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0 if rows[-1]["identical_to_plain"].split("/")[0] == str(args.prompts) else 1
