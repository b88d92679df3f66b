"""What the API needs from a protocol: send one request, yield its responses as they arrive."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

# Inputs are the model's optional [1] tensors: str for BYTES (TYPE_STRING), bool for BOOL.
RequestInputs = Mapping[str, str | bool]


@dataclass(frozen=True)
class RawResponse:
    """One response of the model: its outputs, unwrapped to plain Python values."""

    arrival: float  # time.perf_counter() when the response reached the client
    outputs: dict[str, Any]


class Transport(Protocol):
    """gRPC streaming or the HTTP generate extension; both raise client.errors exceptions."""

    url: str

    def responses(
        self, model: str, inputs: RequestInputs, timeout_s: float | None
    ) -> Iterator[RawResponse]: ...

    def model_ready(self, model: str) -> bool: ...
