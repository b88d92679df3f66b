"""Client-side errors, each worded so that the one line the CLI prints says what to do next."""

from __future__ import annotations


class TritonClientError(RuntimeError):
    """Any failure of a request; the message is meant to be shown to the user as it is."""


class ServerUnreachableError(TritonClientError):
    """Nothing answers at the URL: the server is not running, or the URL or protocol is wrong."""

    def __init__(self, url: str, detail: str) -> None:
        super().__init__(
            f"cannot reach Triton at {url}: is the server running? "
            f"start it with ./scripts/serve.sh ({detail})"
        )


class ModelNotReadyError(TritonClientError):
    """The server answers but does not serve the model (unknown name, still loading, or failed)."""

    def __init__(self, model: str, url: str, server_message: str) -> None:
        super().__init__(f"model {model!r} is not ready on Triton at {url}: {server_message}")


class ServerError(TritonClientError):
    """The model rejected or failed the request; the message is the server's, verbatim."""


class ResponseTimeoutError(TritonClientError):
    """The server accepted the request but sent nothing for longer than the client waits."""

    def __init__(self, url: str, timeout_s: float | None) -> None:
        super().__init__(f"no response from Triton at {url} within {timeout_s} s")
