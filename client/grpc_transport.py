"""gRPC transport: one bidirectional stream per request, the only way gRPC reaches decoupled models."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.errors import ResponseTimeoutError, ServerError, ServerUnreachableError, TritonClientError
from client.transport import RawResponse, RequestInputs

_FINAL = "triton_final_response"
# How long to wait for the callback that explains why a stream refused a request.
_STREAM_ERROR_WAIT_S = 2.0


class GrpcTransport:
    def __init__(self, url: str) -> None:
        self.url = url

    def responses(self, model: str, inputs: RequestInputs, timeout_s: float | None) -> Iterator[RawResponse]:
        client = grpcclient.InferenceServerClient(self.url)
        arrivals: queue.Queue[tuple[float, Any, InferenceServerException | None]] = queue.Queue()
        finished = False
        try:
            client.start_stream(
                callback=lambda result, error: arrivals.put((time.perf_counter(), result, error))
            )
            try:
                client.async_stream_infer(
                    model,
                    [_infer_input(name, value) for name, value in inputs.items()],
                    enable_empty_final_response=True,
                )
            except InferenceServerException as error:
                # A stream that failed (e.g. could not connect) says why through the callback.
                _, _, reason = _next(arrivals, _STREAM_ERROR_WAIT_S, self.url)
                raise _translated(reason or error, self.url) from None
            while not finished:
                arrival, result, error = _next(arrivals, timeout_s, self.url)
                if error is not None:
                    raise _translated(error, self.url)
                response = result.get_response()
                # A non-decoupled model answers once, without the flag.
                finished = response.parameters[_FINAL].bool_param if _FINAL in response.parameters else True
                if response.outputs:
                    outputs = {
                        output.name: _unwrapped(result.as_numpy(output.name)) for output in response.outputs
                    }
                    yield RawResponse(arrival, outputs)
        finally:
            # Leaving early (an error, or the caller stopped iterating) cancels the request on the server.
            client.stop_stream(cancel_requests=not finished)
            client.close()

    def model_ready(self, model: str) -> bool:
        client = grpcclient.InferenceServerClient(self.url)
        try:
            return client.is_model_ready(model)
        except InferenceServerException as error:
            raise _translated(error, self.url) from None
        finally:
            client.close()


def _next(
    arrivals: queue.Queue[tuple[float, Any, InferenceServerException | None]],
    timeout_s: float | None,
    url: str,
) -> tuple[float, Any, InferenceServerException | None]:
    try:
        return arrivals.get(timeout=timeout_s)
    except queue.Empty:
        raise ResponseTimeoutError(url, timeout_s) from None


def _infer_input(name: str, value: str | bool) -> grpcclient.InferInput:
    if isinstance(value, bool):
        array = np.array([value], dtype=bool)
        tensor = grpcclient.InferInput(name, [1], "BOOL")
    else:
        array = np.array([value.encode("utf-8")], dtype=np.object_)
        tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(array)
    return tensor


def _unwrapped(array: np.ndarray) -> Any:
    """The first element of an output tensor as str, int or float (one sequence per request)."""
    value = array.reshape(-1)[0]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value.item()


def _translated(error: InferenceServerException, url: str) -> TritonClientError:
    if error.status() == "StatusCode.UNAVAILABLE":
        return ServerUnreachableError(url, error.message())
    return ServerError(error.message())
