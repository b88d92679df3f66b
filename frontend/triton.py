"""tritonserver through its gRPC port: the models it serves, and one request's responses as pieces.

Every request goes over gRPC streaming (the models are decoupled), with the vLLM backend's tensors:
`text_input`, `stream`, `sampling_parameters`, `exclude_input_in_output` and the `return_*` flags.
Leaving a request's response iterator early cancels the gRPC call, which cancels the request.
A request whose model stops being ready while it waits (its stub died and the launcher restarts
it, launcher/supervisor.py) ends with 503: nothing more would come.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from lookahead.contract import ADMIN_KEY_ENV, ADMIN_KEY_HEADER, MODEL_ENV

from .errors import APIError, from_triton, unavailable

_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
_SERVER_ERRORS = (InferenceServerException, grpc.RpcError)  # the server is down, stopping or unreachable
READY_CHECK_S = 1.0  # how long a request waits for a response before it checks that its model is ready
MODEL_RESTARTING = (
    "the model `{model}` is restarting (its backend process ended); the request was not completed"
)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob and the most likely tokens at its position (best first); both None for
    the prompt's first token, which nothing precedes."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] | None


@dataclass(frozen=True)
class Piece:
    """What one Triton response adds to one sample (`index`, of n): text, tokens and, once the
    sample ended, why."""

    text: str
    output_tokens: int
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # asked for: on the first one, first None
    final: bool = False  # the request's last response
    index: int = 0


def inputs(
    prompt: str, sampling: dict[str, Any], *, stream: bool, logprobs: bool
) -> list[grpcclient.InferInput]:
    """The request's tensors; the prompt is never echoed (the endpoint adds it where asked)."""
    tensors = [_bytes("text_input", prompt), _bytes("sampling_parameters", json.dumps(sampling))]
    flags = {"stream": stream, "exclude_input_in_output": True, "return_logprobs": logprobs}
    flags.update(dict.fromkeys(_FLAGS, True))
    for name, value in flags.items():
        tensor = grpcclient.InferInput(name, [1], "BOOL")
        tensor.set_data_from_numpy(np.array([value], dtype=bool))
        tensors.append(tensor)
    return tensors


def _bytes(name: str, text: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode("utf-8")], dtype=np.object_))
    return tensor


def read_pieces(result: grpcclient.InferResult, top_logprobs: int) -> list[Piece]:
    """A Piece per sample of one response (the n outputs' elements); top_logprobs: how many of the
    most likely tokens to keep."""
    texts = _strings(result, "text_output") or [""]
    finishes = _strings(result, "finish_reason") or [None] * len(texts)
    raw_logprobs = _strings(result, "logprobs") or [None] * len(texts)
    scored = (_strings(result, "prompt_logprobs") or [None])[0]
    prompt_logprobs = None if scored is None else token_logprobs(scored, top_logprobs)
    prompt_tokens = result.as_numpy("num_input_tokens")
    final = result.get_response().parameters["triton_final_response"].bool_param
    return [
        Piece(
            text=text,
            output_tokens=int(count),
            prompt_tokens=None if prompt_tokens is None else int(prompt_tokens[0]),
            finish_reason=None if finish in (None, "None") else finish,
            logprobs=None if raw is None else token_logprobs(raw, top_logprobs),
            prompt_logprobs=prompt_logprobs,
            final=final,
            index=index,
        )
        for index, (text, count, finish, raw) in enumerate(
            zip(texts, result.as_numpy("num_output_tokens"), finishes, raw_logprobs)
        )
    ]


def _strings(result: grpcclient.InferResult, name: str) -> list[str] | None:
    array = result.as_numpy(name)
    return None if array is None else [value.decode("utf-8") for value in array.reshape(-1)]


def token_logprobs(raw: str, top: int) -> list[TokenLogprob | None] | None:
    """vLLM's logprobs JSON (per token {id: {logprob, rank, decoded_token}}, the chosen token
    first, or null where there is none) as TokenLogprobs with the `top` most likely tokens by rank."""
    positions = json.loads(raw)
    if positions is None:
        return None
    tokens: list[TokenLogprob | None] = []
    for position in positions:
        if position is None:
            tokens.append(None)
            continue
        entries = list(position.values())
        ranked = sorted(entries, key=lambda entry: entry["rank"])
        tokens.append(
            TokenLogprob(
                token=entries[0]["decoded_token"],
                logprob=entries[0]["logprob"],
                top=[(entry["decoded_token"], entry["logprob"]) for entry in ranked if entry["rank"] <= top][
                    :top
                ],
            )
        )
    return tokens


class Triton:
    """One aio gRPC client of one tritonserver; create it inside the event loop that uses it."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        key = os.environ.get(ADMIN_KEY_ENV)  # the launcher restricts the repository index to it
        # tritonserver reads a restricted protocol's header over gRPC under this prefix
        self.index_headers = {f"triton-grpc-protocol-{ADMIN_KEY_HEADER}": key} if key else None

    async def close(self) -> None:
        await self.client.close()

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready())
        except InferenceServerException:
            return False

    async def models(self) -> list[str]:
        """The repository's models that are ready to serve; 503 when the server does not answer."""
        states = await self.model_states()
        return sorted(name for name, state in states.items() if state == "READY")

    async def model_states(self) -> dict[str, str]:
        """Each repository model's state (READY, LOADING, UNLOADING, UNAVAILABLE); 503 when the server
        does not answer."""
        try:
            index = await self.client.get_model_repository_index(headers=self.index_headers, as_json=True)
        except _SERVER_ERRORS as error:
            raise unavailable(f"tritonserver did not answer: {error}") from None
        states: dict[str, str] = {}
        for entry in index.get("models", []):  # READY wins over an older version's state
            if states.get(entry["name"]) != "READY":
                states[entry["name"]] = entry.get("state", "")
        return states

    async def model_ready(self, model: str) -> bool:
        try:
            return bool(await self.client.is_model_ready(model))
        except _SERVER_ERRORS:
            return False

    async def served_model(self, model: str) -> str | None:
        """The model (embedded name or folder) a repository model serves: $LOOKAHEAD_MODEL, which
        replaces it in the server too, else its config.pbtxt `model` parameter (None: it has none)."""
        if os.environ.get(MODEL_ENV, "").strip():
            return os.environ[MODEL_ENV].strip()
        value = (await self._parameters(model)).get("model", {}).get("string_value", "")
        return value or None

    async def max_prompt_tokens(self, model: str) -> int | None:
        """The model's max_prompt_tokens (its config.pbtxt parameter); None where it follows the
        model's context length (0 or left out), which only the server knows."""
        parameters = await self._parameters(model)
        value = parameters.get("max_prompt_tokens", {}).get("string_value", "").strip()
        return int(value) if value.isdigit() and int(value) > 0 else None

    async def _parameters(self, model: str) -> dict[str, Any]:
        try:
            config = await self.client.get_model_config(model, as_json=True)
        except _SERVER_ERRORS as error:
            raise unavailable(f"tritonserver did not answer: {error}") from None
        return config.get("config", {}).get("parameters", {})

    async def generate(
        self, model: str, tensors: list[grpcclient.InferInput], request_id: str, top_logprobs: int = 0
    ) -> AsyncIterator[list[Piece]]:
        """Each response as its samples' Pieces, the last one final; a Triton error raises
        APIError. Closing the iterator early cancels the request."""

        async def request() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": model, "inputs": tensors, "request_id": request_id}

        responses = self.client.stream_infer(request())
        finished = False
        try:
            async for result, error in self._watched(model, responses):
                if error is not None:
                    finished = True
                    raise from_triton(error.message())
                pieces = read_pieces(result, top_logprobs)
                finished = pieces[0].final
                yield pieces
                if finished:
                    return
            raise APIError(500, "tritonserver ended the response stream early", kind="server_error")
        except _SERVER_ERRORS as error:
            raise unavailable(f"tritonserver did not answer: {error}") from None
        finally:
            if not finished:
                responses.cancel()

    async def _watched(self, model: str, responses: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """The responses; 503 once `model` is no longer ready while a response is awaited."""
        iterator = aiter(responses)
        while True:
            following = asyncio.ensure_future(anext(iterator))
            try:
                while not (await asyncio.wait({following}, timeout=READY_CHECK_S))[0]:
                    if not await self.model_ready(model):
                        raise unavailable(MODEL_RESTARTING.format(model=model))
                item = following.result()
            except StopAsyncIteration:
                return
            finally:
                if not following.done():
                    following.cancel()
            yield item
