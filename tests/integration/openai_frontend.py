"""Requests built exactly as Triton's OpenAI frontend (`--backend vllm`) builds them, and its reading of
the responses: `server/python/openai/openai_frontend/engine/utils/triton.py`, rewritten here from
its rules, in the frontend's two shapes (before and after it learned logprobs).

The frontend fills an OpenAI request with its schema's defaults, drops the non-sampling fields
and the None values, and sends the rest as `sampling_parameters`; `echo` becomes
`exclude_input_in_output`; chat prompts come from the tokenizer's chat template.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

# CreateCompletionRequest / CreateChatCompletionRequest fields whose defaults are not None.
COMPLETION_DEFAULTS = {
    "best_of": 1,
    "echo": False,
    "frequency_penalty": 0,
    "ignore_eos": False,
    "n": 1,
    "presence_penalty": 0,
    "stream": False,
    "temperature": 1,
    "top_p": 1,
}
CHAT_DEFAULTS = {
    "frequency_penalty": 0,
    "ignore_eos": False,
    "logprobs": False,
    "n": 1,
    "presence_penalty": 0,
    "stream": False,
    "temperature": 0.7,
    "top_p": 1,
}
_EXCLUDED = {
    "model", "stream", "messages", "prompt", "echo", "store", "metadata", "response_format", "service_tier",
    "stream_options", "tools", "tool_choice", "parallel_tool_calls", "user", "function_call", "functions",
    "suffix", "max_completion_tokens", "max_tokens",
}  # fmt: skip
# The frontend with logprobs support also leaves these out (and maps logprobs itself).
_EXCLUDED_SINCE_LOGPROBS = {"logprobs", "top_logprobs", "best_of"}
DEFAULT_MAX_TOKENS = 16  # --default-max-tokens


def vllm_inputs(
    request: dict[str, Any], *, chat: bool, tokenizer: Any, logprobs_aware: bool = True
) -> dict[str, Any]:
    """The tensors (name -> value) the frontend sends for an OpenAI request body."""
    request = {**(CHAT_DEFAULTS if chat else COMPLETION_DEFAULTS), **request}
    excluded = _EXCLUDED | (_EXCLUDED_SINCE_LOGPROBS if logprobs_aware else set())
    sampling = {k: v for k, v in request.items() if k not in excluded and v is not None}
    if chat:
        sampling["max_tokens"] = next(
            (request[k] for k in ("max_completion_tokens", "max_tokens") if request.get(k) is not None),
            DEFAULT_MAX_TOKENS,
        )
    else:
        sampling["max_tokens"] = (
            request["max_tokens"] if request.get("max_tokens") is not None else DEFAULT_MAX_TOKENS
        )
    inputs: dict[str, Any] = {}
    if logprobs_aware:
        wanted = False
        if chat and request.get("logprobs"):
            sampling["logprobs"] = request["top_logprobs"] if request.get("top_logprobs") is not None else 1
            wanted = True
        elif not chat and request.get("logprobs") is not None and request["logprobs"] > 0:
            sampling["logprobs"], wanted = request["logprobs"], True
        inputs["return_logprobs"] = wanted
    if chat:
        prompt = tokenizer.apply_chat_template(
            request["messages"], tokenize=False, add_generation_prompt=True
        )
    else:
        prompt = request["prompt"]
    echo = request.get("echo")
    inputs.update(
        text_input=prompt,
        stream=bool(request["stream"]),
        exclude_input_in_output=True if echo is None else not echo,
        sampling_parameters=json.dumps(sampling),
        return_num_input_tokens=True,
        return_num_output_tokens=True,
    )
    return inputs


def grpc_tensors(inputs: dict[str, Any]) -> list[Any]:
    import tritonclient.grpc as grpcclient

    tensors = []
    for name, value in inputs.items():
        if isinstance(value, bool):
            tensor = grpcclient.InferInput(name, [1], "BOOL")
            tensor.set_data_from_numpy(np.array([value]))
        else:
            tensor = grpcclient.InferInput(name, [1], "BYTES")
            tensor.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
        tensors.append(tensor)
    return tensors


def check_non_streaming(responses: list[Any]) -> None:
    """The frontend's _validate_triton_responses_non_streaming: 1 or 2 responses, the last final."""
    assert 1 <= len(responses) <= 2, f"expected 1 or 2 responses, got {len(responses)}"
    assert responses[-1].get_response().parameters["triton_final_response"].bool_param


def usage(responses: list[Any]) -> tuple[int, int]:
    """(prompt tokens, completion tokens) as the frontend counts them: the first num_input_tokens, the
    sum of every response's num_output_tokens."""
    prompt = int(responses[0].as_numpy("num_input_tokens")[0])
    completion = sum(int(r.as_numpy("num_output_tokens")[0]) for r in responses)
    return prompt, completion


def chat_logprobs(response: Any) -> list[dict[str, Any]] | None:
    """The frontend's chat logprobs of one response: per token the lowest-ranked entry is the
    token, the rest its top_logprobs."""
    tensor = response.as_numpy("logprobs")
    if tensor is None:
        return None
    text = tensor[0].decode()
    if text == "null":
        return None
    entries = []
    for position in json.loads(text):
        ordered = sorted(position.items(), key=lambda item: item[1].get("rank", sys.maxsize))
        _, chosen = ordered[0]
        entries.append(
            {
                "token": chosen["decoded_token"],
                "logprob": chosen["logprob"],
                "top_logprobs": [(entry["decoded_token"], entry["logprob"]) for _, entry in ordered],
            }
        )
    return entries
