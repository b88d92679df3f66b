"""The forward's relative cost by tokens fed on the fast CPU path, one curve per kernel variant:
where the decoder's cost model (algorithm/planner.py) starts before it has timed a step of its own.

cost(q) / cost(1) for a forward of q new tokens over 256 cached ones, from `bench/forward_cost.py`
(the decoder's own verification forward: KV pool, tree mask), SmolLM2-135M-Instruct fp32, 2 threads,
lean layers, int4 weights; points past 64 extrapolated. The planner keeps measuring, so a prior only
has to be close enough for the first steps of a cold server.
"""

from __future__ import annotations

# Xeon (Sapphire Rapids class, AVX-512), 2 vCPUs: q=1 21.5 ms, q=2 22.7, q=4 29.9, q=8 42.1,
# q=16 75.2, q=32 136.8, q=64 252.7.
AVX512 = {1: 1.0, 2: 1.05, 4: 1.39, 8: 1.96, 16: 3.49, 32: 6.35, 64: 11.74, 128: 23.0}

# The AVX2 variant on the same Xeon, the mean of a run as it is and one with torch and MKL held to
# AVX2 too (scripts/as_avx2.sh): q=1 28.5-29.2 ms, q=16 99.1-107.1, q=64 309.3-313.2.
AVX2 = {1: 1.0, 2: 1.22, 4: 1.38, 8: 2.56, 16: 3.57, 32: 6.22, 64: 10.79, 128: 21.5}

PRIORS: dict[str, dict[int, float]] = {"avx512": AVX512, "avx2": AVX2}


def cost_prior(kernel: str, variant: str) -> dict[int, float]:
    """The curve of `kernel` ("integer" or "packed") on `variant` (avxvnni: avx2's)."""
    return PRIORS["avx2" if variant == "avxvnni" else variant]
