"""OpenAI's error JSON: every refusal names the field it is about."""

from __future__ import annotations

from pydantic import ValidationError
from starlette.responses import JSONResponse

# The gRPC stream carries an error's message but not its status code. The backend refuses a bad
# request with INVALID_ARG and a message naming the input; these prefixes mark its other errors
# (backend/engine.py, backend/model.py): the server's failures, and a model that cannot serve now.
_FAILURES = ("Error generating text", "Error reading the request")
_UNAVAILABLE = ("the engine thread", "the model is being unloaded", "Request for unknown model")


class APIError(Exception):
    """An error response: HTTP status, message, the request field it is about."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


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
        return APIError(503, message, kind="server_error")
    return invalid(message)
