"""Entry point Triton loads; the implementation is shared by every model in the repository.

The project root (three folders up) goes on sys.path here because some Python backend stubs
run an isolated interpreter that ignores PYTHONPATH; scripts/bootstrap.sh's .pth file covers
copies of this repository that live elsewhere.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from backend.model import TritonPythonModel  # noqa: E402

__all__ = ["TritonPythonModel"]
