#!/usr/bin/env bash
# Run a command as it would run on an AVX2-only x86-64 CPU (e.g. AMD EPYC Zen 2/3), on a machine
# that also has AVX-512: the fast CPU path's avx2 variant, torch's own kernels at AVX2, and MKL and
# oneDNN (the stock layers' matrix multiplications) held to AVX2.
#   scripts/as_avx2.sh .venv/bin/python -m bench forward_cost
set -euo pipefail
export LOOKAHEAD_CPU_VARIANT=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
exec "$@"
