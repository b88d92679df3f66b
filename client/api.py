"""Python API for the lookahead models: one call per completion, or an iterator of streamed chunks.

    client = LookaheadClient()                       # gRPC on localhost:8001, model "lookahead"
    print(client.generate("def fib(n):", max_tokens=64).text)
    for chunk in client.stream("def fib(n):", max_tokens=64):
        print(chunk.text, end="", flush=True)

Requests follow the vLLM tensor contract; sampling and lookahead settings travel as the JSON
`sampling_parameters` string. Every chunk records when it arrived, so callers get time to first
token and throughput without timing anything themselves.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from client.errors import ModelNotReadyError, ServerError
from client.grpc_transport import GrpcTransport
from client.http_transport import HttpTransport
from client.transport import RawResponse, RequestInputs, Transport
from lookahead.contract import PERF_METRICS, REQUEST_KEYS

ProtocolName = Literal["grpc", "http"]
DEFAULT_URLS: dict[str, str] = {"grpc": "localhost:8001", "http": "localhost:8000"}


@dataclass(frozen=True)
class Chunk:
    """One streamed response: new text, and what the server reported with it."""

    text: str
    seconds: float  # since the request was sent
    num_output_tokens: int = 0  # tokens in this chunk
    num_input_tokens: int | None = None  # reported once, on the first response
    finish_reason: str | None = None  # on the final response
    perf: Mapping[str, float] = field(default_factory=dict)  # PERF_METRICS, on the final response


@dataclass(frozen=True)
class Completion:
    """A whole generation, with the arrival time of each of its responses."""

    text: str
    finish_reason: str | None
    num_input_tokens: int | None
    num_output_tokens: int
    perf: Mapping[str, float]
    chunk_seconds: tuple[float, ...]

    @classmethod
    def from_chunks(cls, chunks: Iterable[Chunk]) -> Completion:
        chunks = list(chunks)
        return cls(
            text="".join(chunk.text for chunk in chunks),
            finish_reason=next((c.finish_reason for c in reversed(chunks) if c.finish_reason), None),
            num_input_tokens=next(
                (c.num_input_tokens for c in chunks if c.num_input_tokens is not None), None
            ),
            num_output_tokens=sum(chunk.num_output_tokens for chunk in chunks),
            perf={name: value for chunk in chunks for name, value in chunk.perf.items()},
            chunk_seconds=tuple(chunk.seconds for chunk in chunks),
        )

    @property
    def time_to_first_token(self) -> float | None:
        return self.chunk_seconds[0] if self.chunk_seconds else None

    @property
    def total_seconds(self) -> float | None:
        return self.chunk_seconds[-1] if self.chunk_seconds else None

    @property
    def tokens_per_second(self) -> float | None:
        """Output tokens over the whole request time, time to first token included."""
        if not self.total_seconds:
            return None
        return self.num_output_tokens / self.total_seconds

    @property
    def accepted_draft_tokens_per_step(self) -> float | None:
        """Draft tokens the model accepted per decoding step: lookahead's gain over one token a step."""
        steps = self.perf.get("num_decoding_steps")
        accepted = self.perf.get("total_accepted_draft_tokens")
        if not steps or accepted is None:
            return None
        return accepted / steps


class LookaheadClient:
    """Talks to one model of a running Triton server over gRPC streaming or HTTP generate.

    `url` defaults to the protocol's default port on localhost. Not tied to one connection:
    each request opens its own, so one client can be shared between threads.
    """

    def __init__(
        self,
        url: str | None = None,
        protocol: ProtocolName = "grpc",
        model: str = "lookahead",
        timeout_s: float | None = 600.0,
    ) -> None:
        if protocol not in DEFAULT_URLS:
            raise ValueError(f"protocol must be one of {', '.join(DEFAULT_URLS)}, got {protocol!r}")
        self.url = url or DEFAULT_URLS[protocol]
        self.protocol = protocol
        self.model = model
        self.timeout_s = timeout_s
        self._transport: Transport = (
            GrpcTransport(self.url) if protocol == "grpc" else HttpTransport(self.url)
        )

    def generate(self, prompt: str, **sampling: Any) -> Completion:
        """The whole completion in one response (the prompt is not echoed)."""
        return Completion.from_chunks(self._chunks(prompt, stream=False, sampling=sampling))

    def stream(self, prompt: str, **sampling: Any) -> Iterator[Chunk]:
        """Text deltas as the server produces them; stopping early cancels the request."""
        return self._chunks(prompt, stream=True, sampling=sampling)

    def _chunks(self, prompt: str, stream: bool, sampling: Mapping[str, Any]) -> Iterator[Chunk]:
        inputs = request_inputs(prompt, stream, sampling)  # fails before any network use
        return self._timed_chunks(inputs)

    def _timed_chunks(self, inputs: RequestInputs) -> Iterator[Chunk]:
        sent = time.perf_counter()
        try:
            for response in self._transport.responses(self.model, inputs, self.timeout_s):
                yield _chunk(response, sent)
        except ServerError as error:
            # "Unknown model" and "model not loaded" read better with the server and model named.
            if not self._transport.model_ready(self.model):
                raise ModelNotReadyError(self.model, self.url, str(error)) from None
            raise


def request_inputs(prompt: str, stream: bool, sampling: Mapping[str, Any]) -> RequestInputs:
    """The request's input tensors; every optional output is asked for, the prompt is never echoed."""
    unknown = sorted(set(sampling) - set(REQUEST_KEYS))
    if unknown:
        raise TypeError(
            f"unknown sampling parameter(s) {', '.join(unknown)}; known: {', '.join(REQUEST_KEYS)}"
        )
    parameters = {name: value for name, value in sampling.items() if value is not None}
    if isinstance(parameters.get("stop"), str):
        parameters["stop"] = [parameters["stop"]]
    return {
        "text_input": prompt,
        "stream": stream,
        "sampling_parameters": json.dumps(parameters),
        "exclude_input_in_output": True,
        "return_finish_reason": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "return_perf_metrics": True,
    }


def _chunk(response: RawResponse, sent: float) -> Chunk:
    outputs = response.outputs
    return Chunk(
        text=outputs.get("text_output", ""),
        seconds=response.arrival - sent,
        num_output_tokens=int(outputs.get("num_output_tokens", 0)),
        num_input_tokens=outputs.get("num_input_tokens"),
        finish_reason=_finish_reason(outputs.get("finish_reason")),
        perf={name: outputs[name] for name in PERF_METRICS if name in outputs},
    )


def _finish_reason(value: str | None) -> str | None:
    """The reason a generation ended; vLLM's contract sends "None" on every response before the last."""
    return None if value in (None, "", "None") else value
