"""Client for the lookahead Triton models: a Python API (`LookaheadClient`) and a CLI (`python -m client`)."""

from client.api import Chunk, Completion, LookaheadClient
from client.errors import (
    ModelNotReadyError,
    ResponseTimeoutError,
    ServerError,
    ServerUnreachableError,
    TritonClientError,
)

__all__ = [
    "Chunk",
    "Completion",
    "LookaheadClient",
    "ModelNotReadyError",
    "ResponseTimeoutError",
    "ServerError",
    "ServerUnreachableError",
    "TritonClientError",
]
