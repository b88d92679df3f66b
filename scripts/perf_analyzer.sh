#!/usr/bin/env bash
# Run perf_analyzer (from tritonclient 2.50.0 in .venv-perf, see requirements-perf.txt) with the
# CUDA runtime it links against on the library path. Arguments go to perf_analyzer unchanged, e.g.
#   scripts/perf_analyzer.sh -m lookahead -i grpc --streaming -u localhost:8001 --input-data in.json
set -euo pipefail
perf_venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv-perf"
binary="$perf_venv/bin/perf_analyzer"
if [[ ! -x "$binary" ]]; then
    echo "error: $binary is missing: run scripts/bootstrap.sh" >&2
    exit 1
fi
cuda_runtime="$("$perf_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cuda_runtime/lib"
export LD_LIBRARY_PATH="$cuda_runtime${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$binary" "$@"
