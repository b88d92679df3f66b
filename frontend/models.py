"""The models the server holds, and the chat template of what each one serves.

Only the tokenizer of a served model is loaded here, never its weights: the one named by
`--tokenizer`, else by $LOOKAHEAD_MODEL or the model's config.pbtxt `model` parameter, which is
what the server itself loads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from .errors import APIError, model_not_found
from .triton import Triton


class ServedModels:
    def __init__(self, triton: Triton, tokenizer: str | None = None):
        self.triton = triton
        self.tokenizer_override = tokenizer
        self.tokenizers: dict[str, Any] = {}  # served model (name or folder) -> its tokenizer
        self.loading = asyncio.Lock()

    async def names(self) -> list[str]:
        return await self.triton.models()

    async def require(self, model: str) -> None:
        """404 unless the server has `model` ready."""
        if model not in await self.names():
            raise model_not_found(model)

    async def chat_prompt(self, model: str, messages: Sequence[dict[str, Any]]) -> str:
        """The conversation in the chat format of what `model` serves, as the raw prompt to send."""
        from lookahead.models.chat import chat_prompt

        tokenizer = await self.tokenizer(model)
        try:
            return chat_prompt(tokenizer, messages)
        except Exception as error:  # the template's own refusal (e.g. roles out of order)
            raise APIError(400, f"messages: {error}", "messages") from None

    async def first_token(self, model: str, prompt: str) -> str:
        """The text of the first token of `prompt` as the server tokenizes it (the prompt's logprobs
        leave it out: nothing precedes it)."""
        tokenizer = await self.tokenizer(model)
        ids = tokenizer.encode(prompt)
        return tokenizer.decode(ids[:1])

    async def tokenizer(self, model: str) -> Any:
        served = self.tokenizer_override or await self.triton.served_model(model)
        if served is None:
            raise APIError(
                400,
                f"model `{model}` names no tokenizer (for its chat template, or an echo's first token; "
                "no `model` parameter): start the endpoint with --tokenizer",
                "model",
            )
        async with self.loading:
            if served not in self.tokenizers:
                self.tokenizers[served] = await asyncio.to_thread(_load_tokenizer, served)
        return self.tokenizers[served]


def _load_tokenizer(served: str) -> Any:
    from lookahead.models.loading import load_tokenizer

    try:
        return load_tokenizer(served)
    except (OSError, ValueError) as error:
        raise APIError(500, f"cannot load the tokenizer of {served}: {error}", kind="server_error") from None
