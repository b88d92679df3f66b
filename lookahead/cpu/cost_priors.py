"""The forward's relative cost by tokens fed on the fast CPU path, one curve per kernel variant:
where the decoder's cost model (algorithm/planner.py) starts before it has timed a step of its own.

cost(q) / cost(1) for a forward of q new tokens over 256 cached ones, from `scripts/bench_forward.py`
(the decoder's own verification forward: KV pool, tree mask), SmolLM2-135M-Instruct fp32, 2 threads,
lean layers, int4 weights; points past 64 extrapolated. The planner keeps measuring, so a prior only
has to be close enough for the first steps of a cold server.
"""

from __future__ import annotations

# Xeon (Sapphire Rapids class, AVX-512): q=1 14.2 ms, q=2 15.2, q=4 17.4, q=8 23.2, q=16 36.1,
# q=32 56.5, q=64 106.0.
AVX512 = {1: 1.0, 2: 1.07, 4: 1.23, 8: 1.63, 16: 2.54, 32: 3.98, 64: 7.47, 128: 14.5}

# The AVX2 variant on the same Xeon (LOOKAHEAD_CPU_VARIANT=avx2, torch and MKL held to AVX2 too).
AVX2 = dict(AVX512)

PRIORS: dict[str, dict[int, float]] = {"avx512": AVX512, "avx2": AVX2}
