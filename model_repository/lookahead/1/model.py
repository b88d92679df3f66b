"""Entry point Triton loads; the implementation is shared by every model in the repository."""

from backend.model import TritonPythonModel

__all__ = ["TritonPythonModel"]
