"""HTTP transport: Triton's generate extension (tritonclient.http has no helper for it).

`/generate_stream` answers with server-sent events, one `data: {...}` line per response;
`/generate` with one JSON object. Top-level request keys that name model inputs fill those tensors.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.client import HTTPResponse
from typing import Any

from client.errors import ResponseTimeoutError, ServerError, ServerUnreachableError, TritonClientError
from client.transport import RawResponse, RequestInputs

# Fields the generate extension adds to every response besides the model's outputs.
_ENVELOPE_FIELDS = ("model_name", "model_version", "id")


class HttpTransport:
    def __init__(self, url: str) -> None:
        self.url = url
        self._base = url.rstrip("/") if "://" in url else f"http://{url.rstrip('/')}"

    def responses(self, model: str, inputs: RequestInputs, timeout_s: float | None) -> Iterator[RawResponse]:
        endpoint = "generate_stream" if inputs.get("stream") else "generate"
        request = urllib.request.Request(
            self._model_url(model, endpoint),
            data=json.dumps(dict(inputs)).encode("utf-8"),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with self._open(request, timeout_s) as response:
            try:
                if endpoint == "generate":
                    yield RawResponse(time.perf_counter(), _outputs(json.load(response)))
                    return
                for line in response:
                    if line.startswith(b"data:"):
                        yield RawResponse(time.perf_counter(), _outputs(json.loads(line[len(b"data:") :])))
            except TimeoutError:
                raise ResponseTimeoutError(self.url, timeout_s) from None
            except OSError as error:
                raise TritonClientError(f"connection to Triton at {self.url} was lost: {error}") from None

    def model_ready(self, model: str) -> bool:
        try:
            with self._open(urllib.request.Request(self._model_url(model, "ready")), timeout_s=10):
                return True
        except ServerError:
            return False

    def _model_url(self, model: str, endpoint: str) -> str:
        return f"{self._base}/v2/models/{urllib.parse.quote(model, safe='')}/{endpoint}"

    def _open(self, request: urllib.request.Request, timeout_s: float | None) -> HTTPResponse:
        try:
            return urllib.request.urlopen(request, timeout=timeout_s)
        except urllib.error.HTTPError as error:
            raise ServerError(_error_message(error.read(), f"HTTP {error.code} {error.reason}")) from None
        except urllib.error.URLError as error:
            raise ServerUnreachableError(self.url, str(error.reason)) from None
        except TimeoutError:
            raise ResponseTimeoutError(self.url, timeout_s) from None


def _outputs(payload: dict[str, Any]) -> dict[str, Any]:
    """The model's outputs of one response; an error in the stream is raised verbatim."""
    if "error" in payload:
        raise ServerError(str(payload["error"]))
    # Single-element tensors arrive unwrapped; keep the first sequence of longer ones.
    return {
        name: value[0] if isinstance(value, list) else value
        for name, value in payload.items()
        if name not in _ENVELOPE_FIELDS
    }


def _error_message(body: bytes, fallback: str) -> str:
    """The server's error text: a JSON body, or (generate_stream) the one event that carries it."""
    text = body.decode("utf-8", errors="replace").strip().removeprefix("data:")
    try:
        return str(json.loads(text)["error"])
    except (ValueError, KeyError, TypeError):
        return fallback
