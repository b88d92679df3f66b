#!/usr/bin/env bash
# Serve model_repository/ with tritonserver after preparing the environment (scripts/bootstrap.sh).
#
#   scripts/serve.sh                                   # HTTP 8000, gRPC 8001, metrics 8002
#   TRITON_HTTP_PORT=9000 scripts/serve.sh --grpc-port 9001 -- --log-verbose=1
#
# Ports come from TRITON_HTTP_PORT / TRITON_GRPC_PORT / TRITON_METRICS_PORT or the flags (flags
# win); MODEL_REPOSITORY picks another repository; arguments after -- go to tritonserver.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
cd "$root"
exec .venv/bin/python -m backend.launcher \
    --model-repository "${MODEL_REPOSITORY:-$root/model_repository}" \
    --http-port "${TRITON_HTTP_PORT:-8000}" \
    --grpc-port "${TRITON_GRPC_PORT:-8001}" \
    --metrics-port "${TRITON_METRICS_PORT:-8002}" \
    "$@"
