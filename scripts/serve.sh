#!/usr/bin/env bash
# Serve model_repository/ with tritonserver after preparing the environment (scripts/bootstrap.sh).
#
#   scripts/serve.sh                                   # HTTP 8000, gRPC 8001, metrics 8002, OpenAI 9000
#   scripts/serve.sh --model qwen2.5-coder-0.5b-instruct       # every model on an embedded model
#   scripts/serve.sh --model path/to/model.Q4_K_M.gguf          # ... or on a GGUF file
#   LOOKAHEAD_MODEL=path/to/hf-folder scripts/serve.sh         # ... or on a local folder
#   scripts/serve.sh --trie-sync redis://127.0.0.1:6379/0      # replicas learn together (or LOOKAHEAD_TRIE_SYNC)
#   TRITON_HTTP_PORT=8080 scripts/serve.sh --grpc-port 8081 --openai-port 0 -- --log-verbose=1
#
# Ports come from TRITON_HTTP_PORT / TRITON_GRPC_PORT / TRITON_METRICS_PORT / TRITON_OPENAI_PORT
# or the flags (flags win; --openai-port 0 turns the OpenAI-compatible endpoint off);
# MODEL_REPOSITORY picks another repository; --model (or LOOKAHEAD_MODEL) replaces every model's
# `model` parameter, a relative file or folder read from the current directory; arguments after --
# go to tritonserver.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
# No cd: a relative --model folder is the caller's (bootstrap puts the project on the venv's path).
exec "$root/.venv/bin/python" -m launcher \
    --model-repository "${MODEL_REPOSITORY:-$root/model_repository}" \
    --http-port "${TRITON_HTTP_PORT:-8000}" \
    --grpc-port "${TRITON_GRPC_PORT:-8001}" \
    --metrics-port "${TRITON_METRICS_PORT:-8002}" \
    --openai-port "${TRITON_OPENAI_PORT:-9000}" \
    "$@"
