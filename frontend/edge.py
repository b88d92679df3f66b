"""What bounds one client at the endpoint's edge: a request's head within a timeout, its body
within a size, and how many completions run at once; bodies are parsed off the event loop.

Each limit is a `python -m frontend` option (Limits), named in its error. The event loop serves
every connection, /health included, so nothing proportional to a body runs on it: reading is
bounded by max_body_bytes and JSON parsing runs on a worker thread.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import h11
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from lookahead.contract import lone_surrogate

from .errors import APIError, invalid, unavailable


@dataclass(frozen=True)
class Limits:
    """max_body_bytes: the largest request body (413 beyond). max_concurrent_requests: completions
    in flight at once (503 with Retry-After beyond). header_timeout_s: how long a connection may take
    to send a request's head (from connecting, or from the previous response); then it is closed."""

    max_body_bytes: int = 4 * 1024**2
    max_concurrent_requests: int = 64
    header_timeout_s: float = 10.0


def head_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol that closes a connection whose request head (request line and headers)
    is not complete header_timeout_s after it connected or got its previous response: uvicorn's own
    keep-alive timer stops at the first byte, so a client sending half a line would hold it forever."""

    class HeadTimeoutProtocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_timer: asyncio.TimerHandle | None = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the head is complete
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutProtocol


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The body, read up to max_body_bytes; 413 beyond (as soon as Content-Length says so)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large(int(declared), max_body_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise too_large(size, max_body_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the body has {size} bytes, more than {limit} (--max-body-bytes)")


def parse_json(raw: bytes) -> Any:
    """The body as JSON (run it on a worker thread); 400 for what is not JSON, is nested too deeply
    or holds a lone surrogate (no Unicode text), naming where."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise invalid("the body is nested too deeply to be read") from None
    except (ValueError, UnicodeDecodeError) as error:  # not JSON, or a number too long for Python
        raise invalid(f"the body is not valid JSON: {str(error)[:200]}") from None
    where = lone_surrogate(body)
    if where is not None:
        param = ".".join(map(str, where)) or None
        message = "holds a lone surrogate (a \\ud800-\\udfff escape alone), which is not Unicode text"
        raise invalid(f"{param or 'the body'} {message}", param)
    return body


class Admission:
    """ASGI middleware: at most `limit` completions (requests to `paths`) in flight, a streamed one
    until its last event is sent; the next one gets 503 with Retry-After at once."""

    def __init__(self, app: ASGIApp, limit: int, paths: tuple[str, ...]):
        self.app, self.limit, self.paths = app, limit, paths
        self.running = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.running >= self.limit:
            refusal = unavailable(
                f"{self.running} completions are in flight, the most this endpoint runs at once "
                "(--max-concurrent-requests); retry later"
            )
            await refusal.response()(scope, receive, send)
            return
        self.running += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.running -= 1
