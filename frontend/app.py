"""The OpenAI routes: `/v1/models`, `/v1/chat/completions`, `/v1/completions`, `/health`.

A completion is one Triton request. Its first response is awaited before anything is sent, so a
refused request gets an error status (400 naming the field) even when streaming; a client that
goes away cancels the Triton request (the disconnect is raced against every response awaited).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .edge import Admission, Limits, parse_json, read_body
from .errors import APIError, from_validation, invalid
from .models import ServedModels
from .protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from .tool_calls import NamedCall, ParsedCalls, RequiredCalls, ToolFamily, ToolOutput, gather
from .tool_calls.calls import openai_call_id
from .triton import Piece, TokenLogprob, Triton, inputs

Body = TypeVar("Body", bound=BaseModel)
OWNER = "lookahead"


class ClientGone(Exception):
    """The HTTP client disconnected: nobody reads a response any more."""


class Disconnect:
    """Races awaits against the client's disconnect (the request's body is already read)."""

    def __init__(self, request: Request):
        self.waiter = asyncio.ensure_future(self._wait(request))

    @staticmethod
    async def _wait(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def race(self, awaitable: Any) -> Any:
        """The awaitable's result; ClientGone once the client left first. Either way, or when the
        caller is cancelled (Starlette cancels a stream whose client left), an unfinished awaitable
        is cancelled, which cancels the Triton request where it awaits a response."""
        work = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait({work, self.waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                await asyncio.wait({work})
        if work.cancelled():
            raise ClientGone
        return work.result()

    def close(self) -> None:
        self.waiter.cancel()


class Usage:
    """Token counts as the server reports them: the prompt's, and each response's new tokens."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def add(self, piece: Piece) -> None:
        if piece.prompt_tokens is not None:
            self.prompt_tokens = piece.prompt_tokens
        self.completion_tokens += piece.output_tokens

    def json(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": total,
        }


class ChatFormat:
    """chat.completion objects and their chunks, of the choice `index`; with tools (the request's
    reader of tool calls), the output's calls as tool_calls, streamed as OpenAI streams them."""

    id_prefix, whole, chunk = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(
        self, index: int = 0, tools: ToolOutput | None = None, call_id: Callable[[], str] = openai_call_id
    ) -> None:
        self.index = index
        self.started = False
        self.tools = tools
        self.call_id = call_id
        self.called = False  # the output holds a tool call

    def choice(self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None:
            content, deltas = self.tools.feed(text, True)
            calls = gather(deltas)
            if calls:
                message["content"] = content or None
                message["tool_calls"] = [
                    {
                        "id": self.call_id(),
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in calls
                ]
                self.called = True
        return {
            "index": self.index,
            "message": message,
            "logprobs": self.logprobs(logprobs),
            "finish_reason": self.finish(finish_reason),
        }

    def finish(self, finish_reason: str | None) -> str | None:
        """OpenAI's finish_reason: tool_calls where an output that ended on its own called tools."""
        return "tool_calls" if self.called and finish_reason == "stop" else finish_reason

    def deltas(self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None) -> list[dict]:
        """The chunks' choices for a response's new text (none where there is nothing to send)."""
        if self.tools is None:
            if text or logprobs or finish_reason or not self.started:
                return [self.delta(text, logprobs, finish_reason)]
            return []
        content, calls = self.tools.feed(text, finish_reason is not None)
        changes: list[dict[str, Any]] = [{"content": content}] if content else []
        for call in calls:
            if call.name is not None:
                self.called = True
                function = {"name": call.name, "arguments": ""}
                entry = {"index": call.index, "id": self.call_id(), "type": "function", "function": function}
            elif call.arguments:
                entry = {"index": call.index, "function": {"arguments": call.arguments}}
            else:
                continue
            changes.append({"tool_calls": [entry]})
        if not changes and (not self.started or logprobs):
            changes = [{"content": ""} if not self.started else {}]
        chunks = [self._delta(change, logprobs if i == 0 else None, None) for i, change in enumerate(changes)]
        if finish_reason is not None:
            if chunks and not any("tool_calls" in change for change in changes):
                chunks[-1]["finish_reason"] = self.finish(finish_reason)
            else:
                chunks.append(self._delta({}, None, self.finish(finish_reason)))
        return chunks

    def delta(self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None) -> dict:
        return self._delta({"content": text} if text or not self.started else {}, logprobs, finish_reason)

    def _delta(
        self, delta: dict[str, Any], logprobs: list[TokenLogprob] | None, finish_reason: str | None
    ) -> dict:
        if not self.started:
            delta["role"], self.started = "assistant", True
        return {
            "index": self.index,
            "delta": delta,
            "logprobs": self.logprobs(logprobs),
            "finish_reason": finish_reason,
        }

    @staticmethod
    def logprobs(tokens: list[TokenLogprob] | None) -> dict | None:
        if tokens is None:
            return None

        def entry(token: str, logprob: float) -> dict:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

        content = [
            {**entry(t.token, t.logprob), "top_logprobs": [entry(token, lp) for token, lp in t.top]}
            for t in tokens
        ]
        return {"content": content, "refusal": None}


class TextFormat:
    """text_completion objects (whole and chunks) of the choice `index`; logprobs with offsets into
    the whole text."""

    id_prefix, whole, chunk = "cmpl", "text_completion", "text_completion"

    def __init__(self, offset: int = 0, index: int = 0) -> None:
        self.offset = offset  # where the next token's text starts in the returned text
        self.index = index

    def choice(self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None) -> dict:
        return {
            "index": self.index,
            "text": text,
            "logprobs": self.logprobs(logprobs),
            "finish_reason": finish_reason,
        }

    delta = choice

    def deltas(self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None) -> list[dict]:
        return [self.choice(text, logprobs, finish_reason)] if text or logprobs or finish_reason else []

    def logprobs(self, tokens: list[TokenLogprob] | None) -> dict | None:
        if tokens is None:
            return None
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token.token)
        return {
            "tokens": [t.token for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [None if t.top is None else dict(t.top) for t in tokens],
            "text_offset": offsets,
        }


async def parse(request: Request, schema: type[Body]) -> Body:
    """The body, bounded in size, parsed and validated on a worker thread."""
    raw = await read_body(request, request.app.state.limits.max_body_bytes)
    return await asyncio.to_thread(_validated, raw, schema)


def _validated(raw: bytes, schema: type[Body]) -> Body:
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    try:
        return schema.model_validate(body)
    except ValidationError as error:
        raise from_validation(error) from None


async def chat_completions(request: Request) -> Response:
    body = await parse(request, ChatCompletionRequest)
    models: ServedModels = request.app.state.models
    await models.require(body.model)
    messages = [m.template_message() for m in body.messages]
    tools = body.template_tools()
    family = None
    if tools:
        family = await models.tool_family(body.model, parsed=body.calls_tools and not body.constraining_tools)
    size = sum(len(m["content"].encode()) for m in messages) + len(json.dumps(tools or []).encode())
    size += sum(len(c.function.arguments.encode()) for m in body.messages for c in m.tool_calls or ())
    await models.check_prompt_size(body.model, size, "messages")
    prompt = await models.chat_prompt(body.model, messages, tools)
    sampling = body.sampling_parameters()
    if family is not None and family.special_tokens and body.calls_tools and not body.constraining_tools:
        sampling.setdefault("skip_special_tokens", False)  # the family's syntax is special tokens
    call_id = family.call_id if family is not None else openai_call_id
    return await complete(
        request,
        body,
        prompt,
        lambda index: ChatFormat(index, tool_output(body, family), call_id),
        top_logprobs=body.top_logprobs or 0,
        sampling=sampling,
    )


def tool_output(body: ChatCompletionRequest, family: ToolFamily | None) -> ToolOutput | None:
    """How a choice's tool calls are read off its output (None: the output is content only)."""
    if not body.calls_tools:
        return None
    if isinstance(body.tool_choice, NamedToolChoice):
        return NamedCall(body.tool_choice.function.name)
    if body.tool_choice == "required":
        return RequiredCalls()
    assert family is not None  # tool_family refuses a model without a parser
    return ParsedCalls(family, parallel=body.parallel_tool_calls is not False)


async def completions(request: Request) -> Response:
    body = await parse(request, CompletionRequest)
    models: ServedModels = request.app.state.models
    await models.require(body.model)
    echo = body.text if body.echo else ""
    first_token = None
    if body.scores_prompt:  # the prompt is tokenized here: not beyond what the model would take
        await models.check_prompt_size(body.model, len(body.text.encode()), "prompt")
        first_token = await models.first_token(body.model, body.text)
    offset = 0 if first_token is not None else len(echo)  # logprobs' offsets into the returned text
    return await complete(
        request,
        body,
        body.text,
        lambda index: TextFormat(offset, index),
        top_logprobs=body.logprobs or 0,
        echo=echo,
        first_token=first_token,
    )


async def complete(
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    prompt: str,
    form: Callable[[int], ChatFormat | TextFormat],
    *,
    top_logprobs: int,
    echo: str = "",
    first_token: str | None = None,
    sampling: dict[str, Any] | None = None,
) -> Response:
    """One Triton request for `prompt`, answered whole or as server-sent events, a choice per
    sample (`n`; form(i) writes choice i). With first_token (the prompt's first token's text), the
    prompt's tokens and logprobs lead each choice's. sampling: the sampling_parameters to send
    (default: the body's)."""
    forms = [form(index) for index in range(body.n or 1)]
    request_id = f"{forms[0].id_prefix}-{uuid.uuid4().hex}"
    sampling = body.sampling_parameters() if sampling is None else sampling
    tensors = inputs(prompt, sampling, stream=body.stream, logprobs=body.wants_logprobs)
    triton: Triton = request.app.state.triton
    responses = triton.generate(body.model, tensors, request_id, top_logprobs)
    header = {"id": request_id, "created": int(time.time()), "model": body.model}
    disconnect = Disconnect(request)
    try:
        first = await disconnect.race(anext(responses))
        if first_token is not None:
            first = [with_prompt_logprobs(piece, first_token) for piece in first]
        if body.stream:
            events = stream(responses, first, disconnect, header, forms, echo, body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        usage, pieces = Usage(), first
        texts, logprobs = [echo] * len(forms), [[] for _ in forms]
        while True:
            for piece in pieces:
                usage.add(piece)
                texts[piece.index] += piece.text
                logprobs[piece.index] += piece.logprobs or []
            if pieces[0].final:
                break
            pieces = await disconnect.race(anext(responses))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    except BaseException:
        disconnect.close()
        await responses.aclose()
        raise
    disconnect.close()
    choices = [
        forms[piece.index].choice(
            texts[piece.index],
            logprobs[piece.index] if body.wants_logprobs else None,
            piece.finish_reason or "stop",
        )
        for piece in pieces
    ]
    return JSONResponse({**header, "object": forms[0].whole, "choices": choices, "usage": usage.json()})


def with_prompt_logprobs(piece: Piece, first_token: str) -> Piece:
    """The first response with the prompt's tokens before its own (the first with no logprob)."""
    scored = piece.prompt_logprobs or [None]
    prompt = [TokenLogprob(first_token, None, None), *(t for t in scored[1:] if t is not None)]
    return replace(piece, logprobs=prompt + (piece.logprobs or []))


async def stream(
    responses: AsyncIterator[list[Piece]],
    pieces: list[Piece],
    disconnect: Disconnect,
    header: dict[str, Any],
    forms: list[ChatFormat | TextFormat],
    echo: str,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per response and choice with something new (the choice's
    index in it), its finish reason once it ended, then (stream_options.include_usage) the usage,
    then [DONE]."""
    usage = Usage()
    extra = {"usage": None} if include_usage else {}
    echoes, ended = [echo] * len(forms), [False] * len(forms)

    def event(choices: list[dict], **fields: Any) -> str:
        chunk = {**header, "object": forms[0].chunk, "choices": choices, **extra, **fields}
        return f"data: {json.dumps(chunk)}\n\n"

    try:
        while True:
            for piece in pieces:
                usage.add(piece)
                index, form = piece.index, forms[piece.index]
                text, echoes[index] = echoes[index] + piece.text, ""
                finish = None
                if not ended[index] and (piece.final or piece.finish_reason):
                    finish, ended[index] = piece.finish_reason or "stop", True
                for choice in form.deltas(text, piece.logprobs, finish):
                    yield event([choice])
            if pieces[0].final:
                break
            pieces = await disconnect.race(anext(responses))
        if include_usage:
            yield event([], usage=usage.json())
    except ClientGone:
        return
    except APIError as error:  # after the first response: the status is sent, so say it in the stream
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        disconnect.close()
        await responses.aclose()
    yield "data: [DONE]\n\n"


async def list_models(request: Request) -> JSONResponse:
    names = await request.app.state.models.names()
    created = request.app.state.created
    data = [{"id": name, "object": "model", "created": created, "owned_by": OWNER} for name in names]
    return JSONResponse({"object": "list", "data": data})


async def get_model(request: Request) -> JSONResponse:
    name = request.path_params["model"]
    await request.app.state.models.require(name)
    return JSONResponse(
        {"id": name, "object": "model", "created": request.app.state.created, "owned_by": OWNER}
    )


async def health(request: Request) -> Response:
    """200 while tritonserver is ready (its models loaded), else 503."""
    ready = await request.app.state.triton.ready()
    return Response(status_code=200 if ready else 503)


async def api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, APIError)
    return error.response()


async def server_error(request: Request, error: Exception) -> Response:
    """A bug, not a refusal: OpenAI's error JSON (the traceback goes to the endpoint's log)."""
    message = f"internal error of the endpoint: {type(error).__name__}"
    return APIError(500, message, kind="server_error").response()


async def http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return APIError(
        error.status_code, f"{request.method} {request.url.path}: {error.detail}", kind=kind
    ).response()


def create_app(grpc_url: str, tokenizer: str | None = None, limits: Limits = Limits()) -> Starlette:
    """The endpoint for the tritonserver at grpc_url; tokenizer: the chat template's model for
    every served model (default: what each model serves); limits: what bounds one client."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.triton = Triton(grpc_url)  # the aio channel belongs to this event loop
        app.state.models = ServedModels(app.state.triton, tokenizer)
        app.state.created = int(time.time())
        app.state.limits = limits
        yield
        await app.state.triton.close()

    routes = [
        Route("/health", health),
        Route("/v1/models", list_models),
        Route("/v1/models/{model:path}", get_model),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    handlers = {APIError: api_error, HTTPException: http_error, Exception: server_error}
    admission = Middleware(
        Admission, limit=limits.max_concurrent_requests, paths=("/v1/chat/completions", "/v1/completions")
    )
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers, middleware=[admission])
