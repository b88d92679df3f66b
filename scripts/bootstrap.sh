#!/usr/bin/env bash
# Prepare everything the server, the tests and the benchmarks need; safe to run again and again.
#
#   bash scripts/bootstrap.sh       # or: source scripts/bootstrap.sh (also activates .venv)
#
# - .venv: the pinned requirements (requirements*.txt), plus a .pth file that puts this repository
#   on the environment's sys.path: the Triton Python backend stub runs an isolated interpreter
#   that ignores PYTHONPATH, so the environment itself must know the project.
# - the default model's tokenizer, converted once into .cache/models, and the packed linear kernel, compiled
#   once into .cache/kernels (python -m lookahead prepare).
# - .venv-perf: perf_analyzer (requirements-perf.txt) and the libb64-0d system package it needs.
# - .venv-genai-perf: genai-perf 0.0.16 and its dependencies (requirements-genai-perf.txt).
# - redis-server (Debian package), which the trie_sync tests start on their own ports.
# pip is skipped while a stamp holding the requirements' hash is current, so a second run takes
# seconds. PYTHON chooses the interpreter for new environments (default python3, >= 3.10).

_lookahead_bootstrap() (
    set -euo pipefail
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    cd "$root"

    require_python() {  # $1: interpreter
        if ! command -v "$1" >/dev/null 2>&1; then
            echo "error: $1 not found. Install Python >= 3.10 (e.g. apt-get install python3 python3-venv)" \
                "or point PYTHON at one: PYTHON=/path/to/python3.11 bash scripts/bootstrap.sh" >&2
            return 1
        fi
        local version
        version="$("$1" -c 'import sys; print("Python %d.%d" % sys.version_info[:2])' 2>/dev/null)" || version="not Python"
        if ! "$1" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
            echo "error: $1 is $version, but Python 3.10 or newer is required:" \
                "rerun with PYTHON=/path/to/python3.11 bash scripts/bootstrap.sh" >&2
            return 1
        fi
    }

    make_venv() {  # $1: folder; an existing environment is kept
        if [[ -x "$1/bin/python" ]]; then
            require_python "$1/bin/python" || { echo "       (remove $1 and rerun)" >&2; return 1; }
            return 0
        fi
        local python="${PYTHON:-python3}"
        require_python "$python"
        echo "bootstrap: creating $1"
        "$python" -m venv "$1" || { echo "error: $python -m venv failed (Debian: apt-get install python3-venv)" >&2; return 1; }
    }

    stamp() {  # $1: venv; rest: requirement files. Hash of the files and the interpreter version.
        local venv="$1"
        shift
        { sha256sum "$@"; "$venv/bin/python" -VV; } | sha256sum | cut -d' ' -f1
    }

    is_current() {  # same arguments as stamp
        [[ -f "$1/.bootstrap.sha256" && "$(cat "$1/.bootstrap.sha256")" == "$(stamp "$@")" ]]
    }

    as_root() {
        if [[ "$(id -u)" == 0 ]]; then "$@"; else sudo -n "$@"; fi
    }

    # --no-warn-conflicts: the --no-deps packages' unmet declared dependencies are expected.
    pip_install() {  # $1: venv; rest: pip install arguments
        "$1/bin/python" -m pip install --quiet --progress-bar off --no-warn-conflicts "${@:2}"
    }

    server_requirements=(requirements.txt requirements-dev.txt requirements-server.txt)
    make_venv .venv
    if ! is_current .venv "${server_requirements[@]}"; then
        echo "bootstrap: installing ${server_requirements[*]} into .venv"
        pip_install .venv -r requirements.txt -r requirements-dev.txt
        pip_install .venv --no-deps -r requirements-server.txt
        stamp .venv "${server_requirements[@]}" > .venv/.bootstrap.sha256
    fi
    project_pth="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/triton_lookahead.pth"
    [[ "$(cat "$project_pth" 2>/dev/null)" == "$root" ]] || echo "$root" > "$project_pth"

    .venv/bin/python -m lookahead prepare

    make_venv .venv-perf
    if ! is_current .venv-perf requirements-perf.txt; then
        echo "bootstrap: installing requirements-perf.txt into .venv-perf"
        pip_install .venv-perf --no-deps -r requirements-perf.txt
        stamp .venv-perf requirements-perf.txt > .venv-perf/.bootstrap.sha256
    fi

    make_venv .venv-genai-perf
    if ! is_current .venv-genai-perf requirements-genai-perf.txt; then
        echo "bootstrap: installing requirements-genai-perf.txt into .venv-genai-perf"
        pip_install .venv-genai-perf --no-deps -r requirements-genai-perf.txt
        stamp .venv-genai-perf requirements-genai-perf.txt > .venv-genai-perf/.bootstrap.sha256
    fi

    if ! { ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | grep 'libb64\.so\.0d' >/dev/null; then
        echo "bootstrap: installing the system package libb64-0d (needed by perf_analyzer)"
        if ! as_root apt-get install -y -q libb64-0d >/dev/null 2>&1; then
            { as_root apt-get update -q && as_root apt-get install -y -q libb64-0d; } >/dev/null 2>&1 \
                || echo "warning: could not install libb64-0d, so perf_analyzer will not start;" \
                    "install it as root: apt-get install libb64-0d" >&2
        fi
    fi
    if ! command -v redis-server >/dev/null 2>&1; then
        echo "bootstrap: installing the system package redis-server (the trie_sync tests start their own)"
        if ! as_root apt-get install -y -q --no-install-recommends redis-server >/dev/null 2>&1; then
            { as_root apt-get update -q && as_root apt-get install -y -q --no-install-recommends redis-server; } \
                >/dev/null 2>&1 \
                || echo "warning: could not install redis-server, so the trie_sync tests cannot run;" \
                    "install it as root: apt-get install redis-server" >&2
        fi
    fi
    echo "bootstrap: ready (.venv; perf_analyzer via scripts/perf_analyzer.sh; genai-perf in .venv-genai-perf)"
)

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    _lookahead_bootstrap && source "$(dirname "${BASH_SOURCE[0]}")/../.venv/bin/activate"
    unset -f _lookahead_bootstrap
else
    _lookahead_bootstrap
fi
