"""The models the server holds, and the chat template of what each one serves.

Only the tokenizer of a served model is loaded here, never its weights: the one named by
`--tokenizer`, else by $LOOKAHEAD_MODEL or the model's config.pbtxt `model` parameter, which is
what the server itself loads. What loads it is imported with this module (it imports torch), at
start: an import mid-serving would hold the event loop for seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from lookahead.models.chat import chat_prompt, renders_tools, template_source
from lookahead.models.loading import load_tokenizer
from lookahead.models.prompt_bytes import prompt_byte_limit

from .errors import APIError, model_not_found, unavailable
from .tool_calls import ToolFamily, family_for_template
from .triton import Triton


class ServedModels:
    def __init__(self, triton: Triton, tokenizer: str | None = None):
        self.triton = triton
        self.tokenizer_override = tokenizer
        self.tokenizers: dict[str, Any] = {}  # served model (name or folder) -> its tokenizer
        self.bounds: dict[str, tuple[int, int] | None] = {}  # model -> prompt_bound(model)
        self.loading = asyncio.Lock()

    async def names(self) -> list[str]:
        return await self.triton.models()

    async def require(self, model: str) -> None:
        """404 unless the server holds `model`; 503 while it is not ready (loading, restarting)."""
        state = (await self.triton.model_states()).get(model)
        if state is None:
            raise model_not_found(model)
        if state != "READY":
            state = state.lower() or "unknown"
            raise unavailable(f"the model `{model}` is not ready ({state}); try again soon")

    async def chat_prompt(
        self, model: str, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> str:
        """The conversation (and the tools' definitions) in the chat format of what `model`
        serves, as the raw prompt to send (the template runs on a worker thread)."""
        tokenizer = await self.tokenizer(model)
        return await asyncio.to_thread(_chat_prompt, tokenizer, messages, tools, model)

    async def tool_family(self, model: str, *, parsed: bool) -> ToolFamily | None:
        """The tool-call syntax of what `model` serves; 400 naming the model where its chat template
        renders no tools, or (parsed: the output's calls are read in the model's own syntax) where
        no family's parser knows its syntax."""
        tokenizer = await self.tokenizer(model)
        if not renders_tools(tokenizer):
            raise APIError(400, f"tools: the chat template of model `{model}` has no tools", "tools")
        family = family_for_template(template_source(tokenizer, tools=True))
        if family is None and parsed:
            raise APIError(
                400,
                f"tools: no tool-call parser knows the syntax of model `{model}`'s chat template "
                "(tool_choice required or a named function still work)",
                "tools",
            )
        return family

    async def first_token(self, model: str, prompt: str) -> str:
        """The text of the first token of `prompt` as the server tokenizes it (the prompt's logprobs
        leave it out: nothing precedes it); tokenized on a worker thread."""
        tokenizer = await self.tokenizer(model)
        return await asyncio.to_thread(lambda: tokenizer.decode(tokenizer.encode(prompt)[:1]))

    async def check_prompt_size(self, model: str, size: int, param: str) -> None:
        """400 for a prompt of `size` UTF-8 bytes that the model's max_prompt_tokens cannot hold
        (the bound its server checks before tokenizing), so that it is never tokenized here. A
        model whose bound follows its context length is bounded by the body's size here."""
        bound = await self.prompt_bound(model)
        if bound is not None and size > bound[1]:
            raise APIError(
                400,
                f"{param} has {size} bytes: more than max_prompt_tokens ({bound[0]}) tokens can hold "
                f"on this model (at most {bound[1]} bytes)",
                param,
            )

    async def prompt_bound(self, model: str) -> tuple[int, int] | None:
        """(max_prompt_tokens, the most UTF-8 bytes so many tokens can spell) of `model`; None
        where its bound follows the model's context length."""
        if model not in self.bounds:
            most_tokens = await self.triton.max_prompt_tokens(model)
            if most_tokens is None:
                self.bounds[model] = None
            else:
                tokenizer = await self.tokenizer(model)
                most_bytes = await asyncio.to_thread(prompt_byte_limit, tokenizer, most_tokens)
                self.bounds[model] = most_tokens, most_bytes
        return self.bounds[model]

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


def _chat_prompt(
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, model: str
) -> str:
    try:
        return chat_prompt(tokenizer, messages, tools)
    except Exception as error:  # the template's own refusal (e.g. roles out of order)
        if tools and _renders(tokenizer, messages):
            message = f"tools: the chat template of model `{model}` cannot render them: {str(error)[:500]}"
            raise APIError(400, message, "tools") from None
        raise APIError(400, f"messages: {str(error)[:500]}", "messages") from None


def _renders(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> bool:
    """The conversation renders without tools (so that it is the tools that a template refused)."""
    try:
        chat_prompt(tokenizer, messages)
    except Exception:
        return False
    return True


def _load_tokenizer(served: str) -> Any:
    try:
        return load_tokenizer(served)
    except (OSError, ValueError) as error:
        raise APIError(500, f"cannot load the tokenizer of {served}: {error}", kind="server_error") from None
