"""What the SDK (client/), the OpenAI endpoint (frontend/), the launcher and the backend agree on,
in one module that imports no torch: the `sampling_parameters` keys a request may set, the values
its lookahead settings take, the perf metrics a final response carries, and the environment
variables through which the launcher (or a deployment) configures every model instance.
"""

from __future__ import annotations

from .config import DECODING_MODES, DRAFTER_NAMES

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
REQUEST_KEYS = (*SAMPLING_KEYS, STRUCTURED_OUTPUTS, *LOOKAHEAD_OVERRIDES)
# The outputs `return_perf_metrics` adds to a final response.
PERF_METRICS = ("total_draft_tokens", "total_accepted_draft_tokens", "num_decoding_steps", "acceptance_rate")

MODEL_ENV = "LOOKAHEAD_MODEL"  # set: replaces every model's `model` parameter
SYNC_ENV = "LOOKAHEAD_TRIE_SYNC"  # set: replaces every model's `trie_sync` parameter
STATE_DIR_ENV = "LOOKAHEAD_STATE_DIR"  # the folder of every model's default trie_state_dir
DRAIN_ENV = "LOOKAHEAD_DRAIN_DIR"  # the launcher's drain folder (backend/drain.py)

__all__ = [
    "DECODING_MODES",
    "DRAFTER_NAMES",
    "DRAIN_ENV",
    "LOOKAHEAD_OVERRIDES",
    "MODEL_ENV",
    "PERF_METRICS",
    "REQUEST_KEYS",
    "SAMPLING_KEYS",
    "STATE_DIR_ENV",
    "STRUCTURED_OUTPUTS",
    "SYNC_ENV",
]
