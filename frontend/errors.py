"""OpenAI's error JSON: every refusal names the field it is about."""

from __future__ import annotations

from pydantic import ValidationError
from starlette.responses import JSONResponse

# The gRPC stream carries an error's message but not its status code. The backend refuses a bad
# request with INVALID_ARG and a message naming the input; these prefixes mark its other errors
# (backend/engine.py, backend/model.py): the server's failures, and a model that cannot serve now
# (busy, stopping or broken: 503 with Retry-After, which OpenAI's SDKs honour).
_FAILURES = ("Error generating text", "Error reading the request", "Error compiling the constraint")
_UNAVAILABLE = (
    "the engine thread",
    "the model is being unloaded",
    "the model is unloading",
    "Request for unknown model",
    "the queue is full",
    "the request waited",
    "the server is shutting down",
    "Stub process",  # the Python backend's process of the model died: it is being restarted
)
RETRY_AFTER_S = 1  # the Retry-After of a 503: the queue or the server may take a request again soon


class APIError(Exception):
    """An error response: HTTP status, message, the request field it is about."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}
        if self.status == 413:  # the rest of the body is not read: the connection cannot go on
            headers["Connection"] = "close"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def unavailable(message: str) -> APIError:
    """503 with Retry-After: the server cannot take the request now."""
    return APIError(503, message, kind="server_error", retry_after_s=RETRY_AFTER_S)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def from_validation(error: ValidationError) -> APIError:
    """The first problem pydantic found, named by its path in the body (`messages.0.content`)."""
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        return invalid(f"{param} is not supported by this server", param)
    message = first["msg"].removeprefix("Value error, ")
    return invalid(f"{param}: {message}" if param else message, param)


def from_triton(message: str) -> APIError:
    """A Triton error response: the request's refusal (400), or the server's failure (500, 503)."""
    if message.startswith(_FAILURES):
        return APIError(500, message, kind="server_error")
    if message.startswith(_UNAVAILABLE):
        return unavailable(message)
    return invalid(message)
