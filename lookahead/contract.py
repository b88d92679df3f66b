"""What the SDK (client/), the OpenAI endpoint (frontend/), the launcher and the backend agree on,
in one module that imports no torch: the `sampling_parameters` keys a request may set, the values
its lookahead settings take, the perf metrics a final response carries, and the environment
variables through which the launcher (or a deployment) configures every model instance.
"""

from __future__ import annotations

import re
from typing import Any

from .config import DECODING_MODES, DRAFTER_NAMES, MAX_SAMPLES

# vLLM's sampling keys, with vLLM's meanings (backend/sampling_keys.py converts each).
SAMPLING_KEYS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "skip_special_tokens",
    "logprobs",
    "prompt_logprobs",
    "n",
    "best_of",
)
STRUCTURED_OUTPUTS = "structured_outputs"  # a constraint on the output (vLLM's name)
# LookaheadConfig fields a request may override in its sampling_parameters (backend/request.py).
LOOKAHEAD_OVERRIDES = (
    "use_lookahead",
    "decoding_length",
    "branch_length",
    "decoding_mode",
    "stop_words",
    "debug",
    "learn",
    "drafter",
)
# Streaming: a step's accepted tokens in one response each (the config.pbtxt parameter's override).
STREAM_EACH_TOKEN = "stream_each_token"
# the prompt bound where max_prompt_tokens is 0 and the model has neither a context length nor a KV bound
DEFAULT_MAX_PROMPT_TOKENS = 4096
REQUEST_KEYS = (*SAMPLING_KEYS, STRUCTURED_OUTPUTS, *LOOKAHEAD_OVERRIDES, STREAM_EACH_TOKEN)
# The outputs `return_perf_metrics` adds to a final response.
PERF_METRICS = ("total_draft_tokens", "total_accepted_draft_tokens", "num_decoding_steps", "acceptance_rate")

MODEL_ENV = "LOOKAHEAD_MODEL"  # set: replaces every model's `model` parameter
SYNC_ENV = "LOOKAHEAD_TRIE_SYNC"  # set: replaces every model's `trie_sync` parameter
STATE_DIR_ENV = "LOOKAHEAD_STATE_DIR"  # the folder of every model's default trie_state_dir
DRAIN_ENV = "LOOKAHEAD_DRAIN_DIR"  # the launcher's drain folder (backend/drain.py)
# The key of tritonserver's model-control API (launcher/supervisor.py): the header that carries
# it, and the variable that hands it to the OpenAI endpoint (which lists the models with it).
ADMIN_KEY_HEADER = "lookahead-admin-key"
ADMIN_KEY_ENV = "LOOKAHEAD_ADMIN_KEY"

# Text a request carries must be Unicode: JSON's lone \ud800-\udfff escapes are not, and no
# tokenizer encodes them; the endpoint and the backend refuse them alike.
SURROGATES = re.compile("[\ud800-\udfff]")


def lone_surrogate(value: Any) -> tuple[str | int, ...] | None:
    """Where in a parsed JSON value a string holds a lone UTF-16 surrogate (JSON's "\\ud800"
    escape alone), which is no Unicode text and no tokenizer can encode: the keys and indices down
    to it (those of an object whose key holds one), () for the value itself, None when there is none."""
    pending: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            if SURROGATES.search(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and SURROGATES.search(key):
                    return path
                pending.append(((*path, key), child))
        elif isinstance(item, list):
            pending.extend(((*path, i), child) for i, child in enumerate(item))
    return None


def dotted(path: tuple[str | int, ...]) -> str:
    """A path of keys and indices as `.stop_words[1]`."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path)


def surrogate_message(where: str) -> str:
    return f"{where} holds a lone surrogate (a \\ud800-\\udfff escape alone), which is not Unicode text"


__all__ = [
    "ADMIN_KEY_ENV",
    "ADMIN_KEY_HEADER",
    "DEFAULT_MAX_PROMPT_TOKENS",
    "dotted",
    "lone_surrogate",
    "surrogate_message",
    "DECODING_MODES",
    "DRAFTER_NAMES",
    "DRAIN_ENV",
    "LOOKAHEAD_OVERRIDES",
    "MAX_SAMPLES",
    "MODEL_ENV",
    "PERF_METRICS",
    "REQUEST_KEYS",
    "SAMPLING_KEYS",
    "STATE_DIR_ENV",
    "STREAM_EACH_TOKEN",
    "STRUCTURED_OUTPUTS",
    "SYNC_ENV",
]
