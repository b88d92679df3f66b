"""tritonserver through its gRPC port: the models it serves, and one request's responses as pieces.

Every request goes over gRPC streaming (the models are decoupled), with the vLLM backend's tensors:
`text_input`, `stream`, `sampling_parameters`, `exclude_input_in_output` and the `return_*` flags.
Leaving a request's response iterator early cancels the gRPC call, which cancels the request.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from lookahead.contract import MODEL_ENV

from .errors import APIError, from_triton

_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")


@dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob and the most likely tokens at its position (best first); both None for
    the prompt's first token, which nothing precedes."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] | None


@dataclass(frozen=True)
class Piece:
    """What one Triton response adds: text, tokens and, on the last one, why generation ended."""

    text: str
    output_tokens: int
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # asked for: on the first one, first None
    final: bool = False


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


def read_piece(result: grpcclient.InferResult, top_logprobs: int) -> Piece:
    """A Piece from one response; top_logprobs: how many of the most likely tokens to keep."""
    finish = _string(result, "finish_reason")
    raw_logprobs = _string(result, "logprobs")
    raw_prompt_logprobs = _string(result, "prompt_logprobs")
    prompt_tokens = result.as_numpy("num_input_tokens")
    return Piece(
        text=_string(result, "text_output") or "",
        output_tokens=int(result.as_numpy("num_output_tokens")[0]),
        prompt_tokens=None if prompt_tokens is None else int(prompt_tokens[0]),
        finish_reason=finish,
        logprobs=None if raw_logprobs is None else token_logprobs(raw_logprobs, top_logprobs),
        prompt_logprobs=None
        if raw_prompt_logprobs is None
        else token_logprobs(raw_prompt_logprobs, top_logprobs),
        final=result.get_response().parameters["triton_final_response"].bool_param,
    )


def _string(result: grpcclient.InferResult, name: str) -> str | None:
    array = result.as_numpy(name)
    return None if array is None else array.reshape(-1)[0].decode("utf-8")


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

    async def close(self) -> None:
        await self.client.close()

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready())
        except InferenceServerException:
            return False

    async def models(self) -> list[str]:
        """The repository's models that are ready to serve."""
        index = await self.client.get_model_repository_index(as_json=True)
        return sorted({m["name"] for m in index.get("models", []) if m.get("state") == "READY"})

    async def served_model(self, model: str) -> str | None:
        """The model (embedded name or folder) a repository model serves: $LOOKAHEAD_MODEL, which
        replaces it in the server too, else its config.pbtxt `model` parameter (None: it has none)."""
        if os.environ.get(MODEL_ENV, "").strip():
            return os.environ[MODEL_ENV].strip()
        config = await self.client.get_model_config(model, as_json=True)
        value = config.get("config", {}).get("parameters", {}).get("model", {}).get("string_value", "")
        return value or None

    async def generate(
        self, model: str, tensors: list[grpcclient.InferInput], request_id: str, top_logprobs: int = 0
    ) -> AsyncIterator[Piece]:
        """Each response as a Piece, the last one final; a Triton error raises APIError. Closing
        the iterator early cancels the request."""

        async def request() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": model, "inputs": tensors, "request_id": request_id}

        responses = self.client.stream_infer(request())
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    finished = True
                    raise from_triton(error.message())
                piece = read_piece(result, top_logprobs)
                finished = piece.final
                yield piece
                if finished:
                    return
            raise APIError(500, "tritonserver ended the response stream early", kind="server_error")
        except (InferenceServerException, grpc.RpcError) as error:
            raise APIError(503, f"tritonserver did not answer: {error}", kind="server_error") from None
        finally:
            if not finished:
                responses.cancel()
