"""The contract the SDK, the OpenAI endpoint and the backend share (lookahead/contract.py): every
key it names is one the backend converts, and its users import it without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backend.request import DictInputs, RequestLimits, parse_request
from backend.sampling_keys import SUPPORTED
from frontend.protocol import CompletionRequest
from lookahead.config import LookaheadConfig
from lookahead.contract import (
    LOOKAHEAD_OVERRIDES,
    REQUEST_KEYS,
    SAMPLING_KEYS,
    STREAM_EACH_TOKEN,
    STRUCTURED_OUTPUTS,
)

ROOT = Path(__file__).resolve().parents[2]
INSTANCE = LookaheadConfig(decoding_length=16, branch_length=8, debug=True)
# a value other than the instance's for each override (drafter: the one there is)
OVERRIDDEN = {
    "use_lookahead": False,
    "decoding_length": 8,
    "branch_length": 4,
    "decoding_mode": "one",
    "stop_words": (",", 13),
    "debug": False,
    "learn": False,
    "drafter": "trie",
}


def test_the_backend_converts_every_sampling_key_the_contract_names() -> None:
    assert tuple(SUPPORTED) == SAMPLING_KEYS
    assert REQUEST_KEYS == (*SAMPLING_KEYS, STRUCTURED_OUTPUTS, *LOOKAHEAD_OVERRIDES, STREAM_EACH_TOKEN)


@pytest.mark.parametrize("key", LOOKAHEAD_OVERRIDES)
def test_every_lookahead_override_reaches_the_requests_settings(key: str) -> None:
    value = OVERRIDDEN[key]
    options = {key: list(value) if isinstance(value, tuple) else value}
    tensors = {
        "text_input": np.array([b"Hello"], dtype=np.object_),
        "sampling_parameters": np.array([json.dumps(options).encode()], dtype=np.object_),
    }
    limits = RequestLimits(INSTANCE, max_prompt_tokens=20, max_output_tokens=64)
    request = parse_request(DictInputs(tensors, None), limits, lambda text: [ord(c) for c in text])
    assert getattr(request.lookahead, key) == value
    # the OpenAI endpoint passes it on as it came
    body = CompletionRequest(model="lookahead", prompt="Hello", **options)
    assert body.sampling_parameters()[key] == options[key]


def test_the_sdk_and_the_contract_import_no_torch() -> None:
    script = """
import sys
sys.modules["torch"] = None  # any import of torch raises
import client, client.__main__, lookahead.contract
print(sorted(m for m in sys.modules if m.split(".")[0] in ("backend", "frontend", "transformers")))
"""
    finished = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.strip() == "[]"
