#!/usr/bin/env bash
# GPU readiness in one command: at most 8 minutes on one H200-class GPU, nothing downloaded.
#
#   scripts/gpu_check.sh                          # on cuda
#   scripts/gpu_check.sh --device cpu --smoke     # the same steps on the CPU, a tiny model shape
#
# 1. The lossless tests (tiny random models against transformers' own greedy generate():
#    tests/unit/test_decoder.py, test_batching.py) with the models on the device, fp32 and bf16.
# 2. The forward-cost curve (1..64 new tokens after 256 cached) and a decoder benchmark (plain vs
#    lookahead, per-step overhead) on a random-weight model of Qwen2.5-7B's shape in bf16
#    (bench/device_check.py; --smoke: a tiny shape).
# It needs the project's requirements with a CUDA build of torch (PYTHON picks the interpreter,
# default .venv/bin/python) and runs no bootstrap. Exit status 1 when any part failed.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-$root/.venv/bin/python}"
device=cuda
smoke=()
while (( $# )); do
    case "$1" in
        --device) device="${2:?--device needs a value}"; shift 2 ;;
        --smoke) smoke=(--smoke); shift ;;
        *) echo "usage: scripts/gpu_check.sh [--device cuda|cuda:N|cpu] [--smoke]" >&2; exit 2 ;;
    esac
done
if [[ "$device" == cuda* ]] && ! "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "error: $python sees no CUDA device (torch $("$python" -c 'import torch; print(torch.__version__)'))" >&2
    exit 1
fi
started=$SECONDS
status=0
for dtype in float32 bfloat16; do
    echo "== lossless tests on $device, $dtype"
    LOOKAHEAD_TEST_DEVICE="$device" LOOKAHEAD_TEST_DTYPE="$dtype" timeout 180 "$python" -m pytest -q \
        -p no:cacheprovider tests/unit/test_decoder.py tests/unit/test_batching.py \
        -k "lossless or match or share" || status=1
done
echo "== forward cost and decoder benchmark on $device"
timeout 240 "$python" -m bench device_check --device "$device" --dtype bfloat16 "${smoke[@]}" \
    || status=1
echo "== gpu_check: $( ((status == 0)) && echo passed || echo FAILED) in $((SECONDS - started)) s"
exit "$status"
