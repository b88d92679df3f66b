#!/usr/bin/env bash
# Prepare the environment, lint, and run every test (integration tests start real tritonservers).
# Arguments go to pytest. Exit status: pytest's when tests fail, else ruff's.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh" || exit
cd "$root"
.venv/bin/ruff check .
lint_status=$?
.venv/bin/python -m pytest "$@"
test_status=$?
if (( test_status != 0 )); then
    exit "$test_status"
fi
exit "$lint_status"
