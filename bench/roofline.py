"""Roofline: each forward width's cost beside what this CPU could do at best, and where a one-token
forward's time goes.

On the running CPU, per kernel variant it runs (avx512, avxvnni, avx2): read bandwidth from memory
(1 and 2 threads), fp32 FMA peak and int8 dot-product peak, measured with the instructions the
kernels use (csrc/roofline.cpp). Then, per execution path (the `packed` kernel: fp32 activations;
the `integer` kernel: int8 activations and fused layers) and variant, the decoder's verification
forward (`ModelRunner.forward_drafts`, KV pool and tree mask) for q = 1..64 new tokens after
`--cached` cached ones, beside its floors: the bytes it must stream (packed weights, LM head, KV
entries) over the measured bandwidth, and its operations (multiply-adds count two) over the
peak of the arithmetic that path uses. Each path is timed in a block of its own, the blocks
alternating over two rounds (as bench_forward does).

With the integer kernel, also its own rate on a matrix held in cache (576 x 3072, the shape of a
small model's gate/up matrix), for int4 weights with offsets (Q4_1's and Q4_K's shape) and int8 weights
(Q8_0's), over 1 to 64 rows: how much of the dot-product peak the kernel reaches once memory is out
of the way. Each 32-input group of a row and 16 outputs takes, beside its dot products, the
conversion and scaling of its sum, and that arithmetic shares the dot products' ports.

The breakdown of a one-token forward per path: the layer stack's steps (the fused stack's own
timers: each matrix kind, attention, norms/RoPE/SiLU/quantisation, hand-offs between threads), or
for the lean stack its matrices timed alone and the rest; the LM head as the forwards call it
(its weights streamed from memory); what the model's Python forward adds around the stack; and,
per plain decoding step of the decoder (one stream), the work outside the forward (planning,
verification, sampling, the pool). On the fused stack, also its steps at q = 1, 4, 8 and 16 beside
the floors of its matrices and of its attention (each the larger of what it must read over the
bandwidth and what it must compute over the peak), so the part furthest from its floor shows as
the tree widens.

    python -m bench roofline --threads 2
    scripts/as_avx2.sh .venv/bin/python -m bench roofline --variants avx2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lookahead.algorithm.draft import Draft
from lookahead.config import LookaheadConfig, SamplingParams
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.runtime.decoder import LookaheadDecoder

from .forward_cost import prefilled_decoder

NEW_TOKENS = (1, 2, 4, 8, 16, 32, 64)
STACK_WIDTHS = (1, 4, 8, 16)  # widths whose layer stack is taken apart step by step
KERNELS = ("packed", "integer")
BANDWIDTH_BYTES = 512 * 1024 * 1024  # far beyond any cache


@dataclass(frozen=True)
class Peaks:
    """What one variant's instructions reach on this CPU, by thread count."""

    variant: str
    integer_dot: str
    read_gb_s: dict[int, float]
    fma_gflop_s: dict[int, float]
    int8_gop_s: dict[int, float]


def measure_peaks(variant: Any, threads: tuple[int, ...]) -> Peaks:
    from lookahead.cpu.extension import load_extension

    extension = load_extension(variant)
    buffer = torch.ones(BANDWIDTH_BYTES // 4)
    extension.read_bandwidth(buffer, max(threads), 1)  # pages touched, caches warm
    best = lambda run: max(run() for _ in range(3))  # noqa: E731
    return Peaks(
        variant.name,
        extension.integer_dot,
        {t: best(lambda t=t: extension.read_bandwidth(buffer, t, 2)) / 1e9 for t in threads},
        {t: best(lambda t=t: extension.fma_peak(t, 20_000_000)) / 1e9 for t in threads},
        {t: best(lambda t=t: extension.int8_dot_peak(t, 20_000_000)) / 1e9 for t in threads},
    )


IN_CACHE_SHAPE = (3072, 576)  # outputs, inputs: ~1 MB of int4, within L2
IN_CACHE_ROWS = (1, 4, 8, 16, 64)


def in_cache_rates(variant: Any) -> dict[str, dict[int, float]]:
    """GOP/s of the integer kernel on a cached matrix, by weight form and row count (the fastest of
    five blocks of 50 products), on torch's thread count."""
    from lookahead.cpu.extension import load_extension
    from lookahead.cpu.integer_forms import IntegerForm
    from lookahead.cpu.packed_linear import PackedWeights

    extension = load_extension(variant)
    generator = torch.Generator().manual_seed(0)
    N, K = IN_CACHE_SHAPE
    scales = (torch.rand(N, K // 32, generator=generator) * 0.01).half()
    forms = {
        "int4 + offsets": IntegerForm(
            torch.randint(0, 16, (N, K), dtype=torch.int8, generator=generator),
            scales,
            (-torch.rand(N, K // 32, generator=generator) * 0.05).half(),
            32,
        ),
        "int8": IntegerForm(
            torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=generator),
            scales,
            torch.zeros(N, K // 32).half(),
            32,
        ),
    }
    rates: dict[str, dict[int, float]] = {}
    for name, form in forms.items():
        matrix = PackedWeights.of(form, None, extension, "int8")
        rates[name] = {}
        for rows in IN_CACHE_ROWS:
            x = torch.randn(rows, K, generator=generator)
            for _ in range(20):
                matrix.product(x)
            best = float("inf")
            for _ in range(5):
                started = time.perf_counter()
                for _ in range(50):
                    matrix.product(x)
                best = min(best, (time.perf_counter() - started) / 50)
            rates[name][rows] = 2 * rows * N * K / best / 1e9
    return rates


@dataclass(frozen=True)
class Traffic:
    """What a forward of q new tokens must move and compute."""

    weight_bytes: int  # what the kernels stream of the packed matrices (LM head included), once per forward
    kv_bytes: int  # KV entries the new tokens attend to
    int8_ops: int  # multiply-adds (x2) of int8 activations
    fp32_ops: int  # multiply-adds (x2) in fp32: linear layers on fp32 activations, attention


def traffic(model: Any, q: int, cached: int) -> Traffic:
    matrices = matrix_traffic(model, q)
    attention = attention_traffic(model.config, q, cached)
    return Traffic(
        matrices.weight_bytes,
        attention.kv_bytes,
        matrices.int8_ops,
        matrices.fp32_ops + attention.fp32_ops,
    )


def matrix_traffic(module: Any, q: int) -> Traffic:
    """The packed matrices under `module`: their weights streamed once, their multiply-adds."""
    from lookahead.cpu.packed_linear import PackedWeights

    weight_bytes = int8_ops = fp32_ops = 0
    for matrix in module.modules():
        if isinstance(matrix, PackedWeights):
            weight_bytes += matrix.streamed_bytes()
            ops = 2 * q * matrix.in_features * matrix.out_features
            if matrix.activations == "int8":
                int8_ops += ops
            else:
                fp32_ops += ops
    return Traffic(weight_bytes, 0, int8_ops, fp32_ops)


def attention_traffic(config: Any, q: int, cached: int) -> Traffic:
    """Every layer's attention for q new tokens after `cached` entries: the KV entries read, and
    q . k and p . v for every query head over all of them (an upper bound for a chain, whose
    earlier rows see fewer)."""
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_bytes = layers * 2 * config.num_key_value_heads * head_dim * 4 * (cached + q)
    fp32_ops = layers * 2 * 2 * q * heads * head_dim * (cached + q)
    return Traffic(0, kv_bytes, 0, fp32_ops)


def floors_ms(load: Traffic, peaks: Peaks, threads: int) -> tuple[float, float]:
    """(memory floor, compute floor) in ms."""
    memory = (load.weight_bytes + load.kv_bytes) / (peaks.read_gb_s[threads] * 1e9)
    compute = load.int8_ops / (peaks.int8_gop_s[threads] * 1e9) + load.fp32_ops / (
        peaks.fma_gflop_s[threads] * 1e9
    )
    return memory * 1e3, compute * 1e3


def stack_by_width(
    decoder: LookaheadDecoder, cached: int, repeats: int, peaks: Peaks, threads: int
) -> dict[int, dict[str, float]]:
    """Per forward of q = STACK_WIDTHS tokens on the fused stack: ms in each of its steps (thread
    0's timers), and the floors of its matrices and of its attention (each the larger of its
    memory and compute floors). Empty for another stack."""
    inner = decoder.model.model
    stack = getattr(inner, "stack", None)
    if type(stack).__name__ != "FusedStack":
        return {}
    result = {}
    for q in STACK_WIDTHS:
        for _ in range(2):
            forward_seconds(decoder, q, cached)
        _, steps = profiled_steps(
            stack, lambda: [forward_seconds(decoder, q, cached) for _ in range(repeats)]
        )
        matrices = floors_ms(matrix_traffic(inner.layers, q), peaks, threads)
        attention = floors_ms(attention_traffic(decoder.model.config, q, cached), peaks, threads)
        steps["matrices' floor"] = max(matrices)
        steps["attention's floor"] = max(attention)
        result[q] = steps
    return result


def profiled_steps(stack: Any, run: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    """run() with the fused stack's own timers on: what it returns, and the ms per forward the
    stack's thread 0 spent in each of its steps meanwhile."""
    stack.reset_step_times()
    stack.profiling = True
    try:
        value = run()
    finally:
        stack.profiling = False
    times = stack.step_times()
    forwards = times.pop("forwards")
    return value, {name: seconds / forwards * 1e3 for name, seconds in times.items()}


def print_stack_by_width(table: dict[int, dict[str, float]]) -> None:
    widths = list(table)
    print("layer stack by width, ms (the fused stack's timers, thread 0; then two floors):")
    print(f"  {'step':<28}" + "".join(f"{f'q={q}':>8}" for q in widths))
    steps = sorted(table[widths[0]], key=lambda name: (name.endswith("floor"), -table[widths[-1]][name]))
    for name in steps:
        print(f"  {name:<28}" + "".join(f"{table[q][name]:8.2f}" for q in widths))


def forward_seconds(decoder: LookaheadDecoder, q: int, cached: int) -> float:
    chain = Draft(list(range(1000, 1000 + q)), list(range(-1, q - 1)))
    with torch.inference_mode():
        started = time.perf_counter()
        decoder.runner.forward_drafts([chain], [cached])
        return time.perf_counter() - started


class TimedCalls:
    """Wraps a callable and adds up the seconds its calls take."""

    def __init__(self, inner: Callable[..., Any]):
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def median_ms(run: Callable[[], None], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e3


def breakdown(decoder: LookaheadDecoder, cached: int, repeats: int, steps: int) -> dict[str, float]:
    """Where a one-token forward's ms go, and the decoder's own work per plain decoding step."""
    model, result = decoder.model, {}
    inner = model.model
    stack = getattr(inner, "stack", None)
    if stack is not None:
        inner.stack = TimedCalls(stack)
    fused = type(stack).__name__ == "FusedStack"
    head = decoder.runner.head_of_hidden
    # The head is timed inside the forwards: its weights come from memory there, not a warm cache.
    timed_head = None if head is None else TimedCalls(head)
    if timed_head is not None:
        decoder.runner.head_of_hidden = timed_head

    def measure() -> float:
        return median_ms(lambda: forward_seconds(decoder, 1, cached), repeats)

    total, step_ms = profiled_steps(stack, measure) if fused else (measure(), {})
    result["forward"] = total
    if stack is not None:
        result["layer stack"] = inner.stack.seconds / inner.stack.calls * 1e3
    if fused:
        for name, ms in step_ms.items():
            result[f"  {name}"] = ms
    elif stack is not None:
        for kind, width in _matrix_inputs(inner.layers[0]).items():
            matrices = [_matrix(layer, kind) for layer in inner.layers]
            x = torch.randn(1, width)
            result[f"  {kind} matrices alone"] = median_ms(lambda: [m(x) for m in matrices], repeats)
        result["  the rest (attention, norms, RoPE, SiLU, dispatch, hand-offs)"] = result[
            "layer stack"
        ] - sum(value for key, value in result.items() if key.endswith("matrices alone"))
    if timed_head is not None:
        result["LM head"] = timed_head.seconds / timed_head.calls * 1e3
        decoder.runner.head_of_hidden = head
    if stack is not None:
        inner.stack = stack
        result["around the stack (embedding, RoPE tables, step inputs, Python)"] = (
            total - result["layer stack"] - result.get("LM head", 0.0)
        )
    # Plain decoding, one stream: the decoder's step beside the forward inside it.
    plain = LookaheadDecoder(model, decoder.tokenizer, None, LookaheadConfig(use_lookahead=False))
    timed = TimedCalls(plain.runner.forward_segments)
    plain.runner.forward_segments = timed
    generation = plain.start(
        list(range(1000, 1000 + cached)), SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    )
    while not generation.prefilled:  # the prompt, in as many chunks as it takes
        generation.step()
    timed.seconds, timed.calls = 0.0, 0
    started = time.perf_counter()
    while not generation.finished:
        generation.step()
    per_step = (time.perf_counter() - started) / timed.calls * 1e3
    result["plain decoding step"] = per_step
    result["  its forward"] = timed.seconds / timed.calls * 1e3
    result["  the decoder's work outside the forward"] = per_step - result["  its forward"]
    return result


def _matrix_inputs(layer: Any) -> dict[str, int]:
    """Each packed matrix kind of a layer and its input width."""
    attention, mlp = layer.self_attn, layer.mlp
    width = attention.q_proj.in_features
    return {
        "qkv": width,
        "o": attention.o_proj.in_features,
        "gate_up": width,
        "down": mlp.down_proj.in_features,
    }


def _matrix(layer: Any, kind: str) -> Any:
    """The C++ packed matrix of one kind of a layer (fused siblings share one)."""
    attention, mlp = layer.self_attn, layer.mlp
    linear = {
        "qkv": attention.q_proj,
        "o": attention.o_proj,
        "gate_up": mlp.gate_proj,
        "down": mlp.down_proj,
    }[kind]
    return linear.weights.matrix


def main(argv: list[str] | None = None) -> int:
    from lookahead.cpu.extension import runnable_variants, variant_named

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cached", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated: packed, integer")
    parser.add_argument(
        "--variants", default="", help="comma-separated variants (default: every one this CPU runs)"
    )
    parser.add_argument("--steps", type=int, default=48, help="plain decoding steps timed in the breakdown")
    parser.add_argument("--out", type=Path, default=Path("results/bench_roofline.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = (
        [variant_named(name) for name in args.variants.split(",")]
        if args.variants
        else list(runnable_variants())
    )
    thread_counts = tuple(sorted({1, args.threads}))
    peaks = {variant.name: measure_peaks(variant, thread_counts) for variant in variants}
    print(f"machine: {_cpu_model()}, torch {torch.__version__}, {args.threads} threads")
    for p in peaks.values():
        print(
            f"  {p.variant} ({p.integer_dot} dot products): read "
            + ", ".join(f"{gb:.1f} GB/s ({t} thr)" for t, gb in p.read_gb_s.items())
            + "; fp32 FMA "
            + ", ".join(f"{g:.0f} GFLOP/s ({t} thr)" for t, g in p.fma_gflop_s.items())
            + "; int8 dot "
            + ", ".join(f"{g:.0f} GOP/s ({t} thr)" for t, g in p.int8_gop_s.items())
        )
    kernels = args.kernels.split(",")
    in_cache = {}
    if "integer" in kernels:
        for variant in variants:
            in_cache[variant.name] = in_cache_rates(variant)
            peak = peaks[variant.name].int8_gop_s[args.threads]
            for form, rates in in_cache[variant.name].items():
                print(
                    f"  {variant.name} integer kernel in cache, {form}: "
                    + ", ".join(
                        f"{rows} rows {gop:.0f} GOP/s ({gop / peak:.0%})" for rows, gop in rates.items()
                    )
                )
    paths = [(kernel, variant.name) for kernel in kernels for variant in variants]
    decoders = {path: prefilled_decoder(args.model, "-".join(path), args.cached) for path in paths}
    samples: dict[tuple[str, str], dict[int, list[float]]] = {
        path: {q: [] for q in NEW_TOKENS} for path in paths
    }
    for _ in range(2):  # rounds: every path's block, alternating
        for path, decoder in decoders.items():
            for q in NEW_TOKENS:
                for _ in range(2):
                    forward_seconds(decoder, q, args.cached)
                for _ in range(-(-args.repeats // 2)):
                    samples[path][q].append(forward_seconds(decoder, q, args.cached))
    report: dict[str, Any] = {
        "peaks": {name: asdict(p) for name, p in peaks.items()},
        "integer_in_cache_gop_s": in_cache,
        "paths": {},
    }
    for path, decoder in decoders.items():
        kernel, variant = path
        medians = {q: statistics.median(s) * 1e3 for q, s in samples[path].items()}
        print(f"\n{kernel} kernel, {variant} variant: {args.model}, {args.cached} cached tokens")
        print(
            " | ".join(
                f"{h:>{w}}"
                for h, w in (
                    ("q", 4),
                    ("ms", 7),
                    ("x q=1", 5),
                    ("memory floor", 12),
                    ("compute floor", 13),
                    ("x floor", 7),
                )
            )
        )
        rows = {}
        for q, ms in medians.items():
            memory, compute = floors_ms(traffic(decoder.model, q, args.cached), peaks[variant], args.threads)
            floor = max(memory, compute)
            cells = (
                f"{q:>4}",
                f"{ms:7.2f}",
                f"{ms / medians[1]:5.2f}",
                f"{memory:9.2f} ms",
                f"{compute:10.2f} ms",
            )
            print(" | ".join(cells) + f" | {ms / floor:7.2f}")
            rows[q] = {"ms": ms, "memory_floor_ms": memory, "compute_floor_ms": compute}
        parts = breakdown(decoder, args.cached, args.repeats * 3, args.steps)
        print("one-token forward, ms:")
        for name, ms in parts.items():
            print(f"  {name:<70} {ms:7.2f}")
        stack = stack_by_width(decoder, args.cached, args.repeats * 2, peaks[variant], args.threads)
        if stack:
            print_stack_by_width(stack)
        report["paths"][f"{kernel}-{variant}"] = {"widths": rows, "breakdown": parts, "stack_by_width": stack}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown CPU"
