"""The forward's relative cost by tokens fed, cost(q) / cost(1), per execution path: where the
decoder's cost model (planner.CostModel) starts before it has timed a step of its own.

Each curve is a forward of q new tokens over 256 cached ones as `python -m bench forward_cost`
measures it (the decoder's own verification forward: KV pool, tree mask) on SmolLM2-135M-Instruct
fp32 with 2 threads; points past 64 are extrapolated. The planner keeps measuring, so a prior only
has to be close enough for the first steps of a cold server.
"""

from __future__ import annotations

# transformers' layers on a CPU, where nothing better is known.
STOCK_CPU_PRIOR = {1: 1.0, 2: 1.06, 4: 1.5, 8: 1.8, 16: 2.1, 32: 2.4, 64: 3.4, 128: 5.5}
# A GPU streams the weights once whatever the tokens fed: nearly flat up to tens of tokens.
GPU_PRIOR = {1: 1.0, 2: 1.02, 4: 1.03, 8: 1.05, 16: 1.08, 32: 1.15, 64: 1.3, 128: 1.7}

# The fast CPU path (lean layers, int4 weights), one curve per kernel variant (cpu/extension.py).
AVX512 = {1: 1.0, 2: 1.05, 4: 1.39, 8: 1.96, 16: 3.49, 32: 6.35, 64: 11.74, 128: 23.0}
# The AVX2 variant: the mean of a run as it is and one with torch and MKL held to AVX2 too
# (scripts/as_avx2.sh).
AVX2 = {1: 1.0, 2: 1.22, 4: 1.38, 8: 2.56, 16: 3.57, 32: 6.22, 64: 10.79, 128: 21.5}

PRIORS: dict[str, dict[int, float]] = {"avx512": AVX512, "avx2": AVX2}


def cost_prior(kernel: str, variant: str) -> dict[int, float]:
    """The curve of `kernel` ("integer" or "packed") on `variant` (avxvnni: avx2's); the integer
    kernel starts from the packed kernel's curve, which the planner's own timings then replace."""
    return PRIORS["avx2" if variant == "avxvnni" else variant]
