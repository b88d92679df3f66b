"""What a GGUF file's metadata must hold before transformers reads it, and its chat template's trial.

transformers converts a file's metadata into a config and a tokenizer trusting every value: a
head count of 0 divides by zero, a block count of 2^31 builds a tensor name map of 2^31 blocks,
an end-of-text id past the token list indexes out of it. `check_metadata` refuses such a file
first, naming the field; `check_chat_template` renders the template once in transformers' own
sandbox, so that a template that cannot render is refused at load, not at a request.
Each raises `MetadataError`, a message without the file's name (gguf_file.py adds it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .gguf_header import Array, TensorInfo

# Integer fields of `<architecture>.` that size the model: each must be a positive integer.
_SIZES = (
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "context_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.sliding_window",
    "rope.dimension_count",
    "vocab_size",
)
_LARGEST = 2**31 - 1  # beyond any real model's size, and what transformers' int32 fields hold
_TOKEN_ID = re.compile(r"tokenizer\.ggml\.\w+_token_id")
_TOKEN_ARRAYS = {  # arrays of one entry per token, and the item type each must hold
    "tokenizer.ggml.tokens": "STRING",
    "tokenizer.ggml.scores": "FLOAT32",
    "tokenizer.ggml.token_type": "INT32",
}
_BLOCK = re.compile(r"blk\.(\d+)\.")
# A conversation that exercises a template's usual branches: system, user, assistant, user.
SAMPLE_CONVERSATION = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi. How can I help?"},
    {"role": "user", "content": "Say one word."},
)


class MetadataError(ValueError):
    """What is wrong with a file's metadata or tokenizer, naming the field (not the file)."""


def check_metadata(metadata: Mapping[str, Any], tensors: Mapping[str, TensorInfo], architecture: str) -> None:
    """Refuse sizes transformers cannot build a model of, and token ids outside the vocabulary."""
    sizes = {name: _size(metadata, f"{architecture}.{name}") for name in _SIZES}
    blocks = {int(match.group(1)) for name in tensors if (match := _BLOCK.match(name))}
    block_count = sizes["block_count"]
    if block_count is None:
        raise MetadataError(f"{architecture}.block_count is missing")
    if block_count > len(blocks) or any(index not in blocks for index in range(block_count)):
        raise MetadataError(
            f"{architecture}.block_count is {block_count}, but the file holds tensors of {len(blocks)} blocks"
        )
    heads, kv_heads = sizes["attention.head_count"], sizes["attention.head_count_kv"]
    hidden = sizes["embedding_length"]
    if heads is None or hidden is None:
        raise MetadataError(f"{architecture}.attention.head_count and .embedding_length are required")
    if sizes["attention.key_length"] is None and hidden % heads:
        raise MetadataError(
            f"{architecture}.attention.head_count {heads} does not divide "
            f"{architecture}.embedding_length {hidden}"
        )
    if kv_heads is not None and heads % kv_heads:
        raise MetadataError(
            f"{architecture}.attention.head_count_kv {kv_heads} does not divide "
            f"{architecture}.attention.head_count {heads}"
        )
    _check_tokens(metadata, tensors)


def _size(metadata: Mapping[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _LARGEST:
        raise MetadataError(f"{key} is {_shown(value)}, not a positive integer up to {_LARGEST}")
    return value


def _check_tokens(metadata: Mapping[str, Any], tensors: Mapping[str, TensorInfo]) -> None:
    """The token arrays agree in length and type, and every special token id lies within them."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    embedding = tensors.get("token_embd.weight")
    vocab = embedding.shape[0] if embedding is not None and embedding.shape else None
    if tokens is not None:
        for key, item_type in _TOKEN_ARRAYS.items():
            value = metadata.get(key)
            if value is None:
                continue
            if not isinstance(value, Array) or value.item_type.name != item_type:
                raise MetadataError(f"{key} is {_shown(value)}, not an array of {item_type}")
            if value.length != tokens.length:
                raise MetadataError(
                    f"{key} has {value.length} entries, tokenizer.ggml.tokens {tokens.length}"
                )
        vocab = tokens.length
        if not vocab:
            raise MetadataError("tokenizer.ggml.tokens is empty")
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None and (not isinstance(merges, Array) or merges.item_type.name != "STRING"):
        raise MetadataError(f"tokenizer.ggml.merges is {_shown(merges)}, not an array of STRING")
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise MetadataError(f"tokenizer.chat_template is {_shown(template)}, not a string")
    for key, value in metadata.items():
        if not _TOKEN_ID.fullmatch(key):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise MetadataError(f"{key} is {_shown(value)}, not a token id")
        if vocab is not None and value >= vocab:
            raise MetadataError(f"{key} is {value}, outside the vocabulary of {vocab} tokens")


def check_merges(tokens: list[str], merges: list[str]) -> None:
    """Each BPE merge joins two tokens of the vocabulary into a third one (tokenizers panics on
    some merges that do not, which no exception handler can keep off stderr)."""
    vocabulary = set(tokens)
    for index, merge in enumerate(merges):
        parts = merge.split(" ")
        joined = "".join(parts)
        if len(parts) != 2 or not all(parts) or joined not in vocabulary or not vocabulary.issuperset(parts):
            raise MetadataError(
                f"tokenizer.ggml.merges[{index}] {merge[:40]!r} does not join two tokens into a token"
            )


def check_chat_template(tokenizer: Any) -> None:
    """Render the tokenizer's chat template once over SAMPLE_CONVERSATION (in transformers' sandbox:
    no attribute access to Python internals, no include or import); MetadataError says why not."""
    if not getattr(tokenizer, "chat_template", None):
        return
    try:
        text = tokenizer.apply_chat_template(
            list(SAMPLE_CONVERSATION), tokenize=False, add_generation_prompt=True
        )
    except Exception as error:  # whatever the template does, it is the file's fault
        raise MetadataError(
            "tokenizer.chat_template cannot render a conversation "
            f"({type(error).__name__}: {_one_line(error)})"
        ) from None
    if not isinstance(text, str):
        raise MetadataError("tokenizer.chat_template renders no text")


def _shown(value: Any) -> str:
    if isinstance(value, Array):
        return f"an array of {value.length} {value.item_type.name}"
    return repr(value) if not isinstance(value, str) else repr(value[:40])


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300] or type(error).__name__
