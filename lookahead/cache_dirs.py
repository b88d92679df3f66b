"""Where the library keeps what it builds once: converted models, compiled kernels, integer forms.

In a checkout (this package beside a pyproject.toml) that is <repo>/.cache/<kind>, next to the
environment scripts/bootstrap.sh makes; installed from a wheel, the user's cache,
$XDG_CACHE_HOME/lookahead/<kind> (default ~/.cache/lookahead/<kind>). Each kind's variable names
another folder for it.
"""

from __future__ import annotations

import os
from pathlib import Path

MODELS_ENV = "LOOKAHEAD_CACHE_DIR"
KERNELS_ENV = "LOOKAHEAD_KERNEL_DIR"
PACKED_ENV = "LOOKAHEAD_PACKED_DIR"
_CHECKOUT = Path(__file__).resolve().parents[1]


def models_dir() -> Path:
    """Converted models (models/embedded.py)."""
    return _cache_dir("models", MODELS_ENV)


def kernels_dir() -> Path:
    """The fast CPU path's compiled kernels (cpu/extension.py)."""
    return _cache_dir("kernels", KERNELS_ENV)


def packed_dir() -> Path:
    """Integer forms found for models' weights (cpu/integer_forms.py)."""
    return _cache_dir("packed", PACKED_ENV)


def _cache_dir(kind: str, env: str) -> Path:
    if os.environ.get(env):
        return Path(os.environ[env])
    if (_CHECKOUT / "pyproject.toml").is_file():
        return _CHECKOUT / ".cache" / kind
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lookahead" / kind
