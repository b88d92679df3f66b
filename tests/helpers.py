"""What several test modules share: tiny random-weight models, reference decoding, toy tokenizers."""

from __future__ import annotations

import os
import queue
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, DynamicCache

from lookahead.cpu import apply_fast_path
from lookahead.cpu.extension import VARIANTS, runnable_variants, variant_named
from lookahead.models.loading import apply_execution_path

# Where the tiny models run: scripts/gpu_check.sh runs the lossless tests with cuda, in fp32 and bf16.
TEST_DEVICE = os.environ.get("LOOKAHEAD_TEST_DEVICE", "cpu")
TEST_DTYPE = getattr(torch, os.environ.get("LOOKAHEAD_TEST_DTYPE", "float32"))

# Run in a fresh interpreter, as one install of the project sees it: a tiny random Llama on the
# execution path "auto" picks, lookahead against transformers' greedy generate(); `extra` runs
# after it and may add to `result`, whose JSON is the last line printed.
TINY_DECODE_SCRIPT = """
import json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from lookahead import LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.models.loading import apply_execution_path

class Silent:  # token ids only: the detokenizer decodes to nothing
    def decode(self, ids, skip_special_tokens=True):
        return ""

torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config).eval()
kernel, execution, prior = apply_execution_path(model, "auto")
prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
ids = torch.tensor([prompt])
plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                       pad_token_id=0)[0, len(prompt):].tolist()
trie = NGramTrie()
trie.insert(prompt + plain)
params = SamplingParams(max_tokens=16, ignore_eos=True)
out, stats = LookaheadDecoder(model, Silent(), trie).generate(prompt, params)
result = {"kernel": kernel, "execution": execution, "prior": prior, "plain": plain, "lookahead": out,
          "accepted": stats.accepted_draft_tokens}
%s
print(json.dumps(result))
"""


def unavailable(reason: str) -> None:
    """Skip the test for want of `reason`; under CI=true fail it, so that a green CI run means it ran."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true, and {reason}")
    pytest.skip(reason)


TINY_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "glm", "glm4")

_TINY_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
# GLM's default pad id lies outside the tiny vocabulary.
_ARCHITECTURE_CONFIG = {"glm": dict(pad_token_id=0), "glm4": dict(pad_token_id=0)}


def _cannot_run(variant: Any) -> Any:
    return pytest.mark.skipif(
        variant not in runnable_variants(), reason=f"this CPU cannot run the {variant.name} variant"
    )


_NOT_ON_THE_CPU = pytest.mark.skipif(
    TEST_DEVICE != "cpu" or TEST_DTYPE != torch.float32, reason="the packed kernel is fp32 on the CPU"
)


# Every execution path, for tests that must hold on each: transformers' layers and every variant
# of the fast CPU path's kernels ("packed-<variant>", "integer-<variant>"; the integer kernel on a
# model whose weights are quantised first, so that it multiplies int8 activations). A variant this
# CPU cannot run is skipped with the reason, and the run's summary says which variants ran
# (tests/conftest.py).
LINEAR_KERNELS = (
    "stock",
    *(
        pytest.param(f"{kernel}-{v.name}", id=f"{kernel}-{v.name}", marks=[_cannot_run(v), _NOT_ON_THE_CPU])
        for kernel in ("packed", "integer")
        for v in VARIANTS
    ),
)
# Every variant of the fast CPU path, for tests of the kernel itself.
CPU_VARIANTS = tuple(pytest.param(v, id=v.name, marks=_cannot_run(v)) for v in VARIANTS)


def pbtxt_parameters(model: str) -> dict[str, str]:
    """The key/value pairs of a shipped config.pbtxt (its parameters use one line per entry)."""
    text = (Path(__file__).resolve().parents[1] / "model_repository" / model / "config.pbtxt").read_text()
    pairs = re.findall(r'\{ key: "([^"]+)", value: \{ string_value: "([^"]*)" \} \}', text)
    assert len(pairs) == text.count("key:"), "every parameter must be written on one line"
    return dict(pairs)


def build_tiny_model(
    architecture: str = "llama", linear_kernel: str = "stock", **config_overrides: Any
) -> Any:
    """A model in eval mode whose weights depend only on the architecture and config, set up as
    load_model sets up a real one: float32 on the CPU unless LOOKAHEAD_TEST_DEVICE/DTYPE say
    otherwise. linear_kernel: "stock", "packed" (the chosen variant) or "packed-<variant>"."""
    if architecture not in TINY_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {', '.join(TINY_ARCHITECTURES)}, got {architecture!r}")
    config = CONFIG_MAPPING[architecture](
        **{**_TINY_CONFIG, **_ARCHITECTURE_CONFIG.get(architecture, {}), **config_overrides}
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.to(TEST_DEVICE, TEST_DTYPE)
    apply_kernel(model, linear_kernel)
    return model


def apply_kernel(model: Any, linear_kernel: str) -> None:
    """Set up a model's execution path: "stock", "packed" or "integer" (the chosen variant), or
    "<kernel>-<variant>". The integer kernel's models get quantised weights first."""
    kernel, _, variant = linear_kernel.partition("-")
    if kernel == "integer":
        quantise_in_place(model, bits=4)
    if variant:
        apply_fast_path(model, kernel, variant_named(variant))
    else:
        apply_execution_path(model, kernel)


def dequantised(rows: int, inputs: int, bits: int, seed: int) -> torch.Tensor:
    """Weights as a Q4_1 (bits=4: d * q + m, q in 0..15) or Q8_0 (bits=8: d * q) checkpoint dequantises.

    As those quantisers do, every group of 32 spans the full q range (its extremes define d).
    """
    generator = torch.Generator().manual_seed(seed)
    groups = inputs // 32
    d = (torch.rand(rows, groups, 1, generator=generator) * 0.01 + 1e-4).half().float()
    if bits == 4:
        q = torch.randint(0, 16, (rows, groups, 32), generator=generator).float()
        q[..., 0], q[..., 1] = 0, 15
        m = -(torch.rand(rows, groups, 1, generator=generator) * 0.1).half().float()
        return (d * q + m).reshape(rows, inputs)
    q = torch.randint(-127, 128, (rows, groups, 32), generator=generator).float()
    q[..., 0] = 127
    return (d * q).reshape(rows, inputs)


def _nonzero(d: torch.Tensor) -> torch.Tensor:
    """Scales to divide by: a group of equal weights (d == 0, e.g. a padding embedding's zeros) gets
    q = 0 rather than 0 / 0."""
    return torch.where(d == 0, torch.ones_like(d), d)


def quantise_in_place(model: Any, bits: int) -> None:
    """Quantise every linear layer's weights as llama.cpp's Q4_1 (bits=4: per 32 inputs fp16 d and
    m, q in 0..15) or Q8_0 (bits=8: fp16 d, q in -127..127) would, and dequantise them back: the
    model keeps its behaviour, and packing finds an integer form for every matrix."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight.detach().float().cpu()
            groups = weight.reshape(weight.shape[0], -1, 32)
            if bits == 4:
                m = groups.amin(-1, keepdim=True).half().float()
                d = ((groups.amax(-1, keepdim=True) - m) / 15).half().float()
                q = torch.round((groups - m) / _nonzero(d)).clamp(0, 15)
                rebuilt = d * q + m
            else:
                d = (groups.abs().amax(-1, keepdim=True) / 127).half().float()
                rebuilt = d * (
                    torch.round(groups / _nonzero(d)).clamp(-127, 127) + 0.0
                )  # an integer q has no -0
            module.weight.data.copy_(
                rebuilt.reshape(weight.shape).to(module.weight.device, module.weight.dtype)
            )


def on_fused_layers(model: Any) -> bool:
    """Whether the model's forwards on the decoder's KV pool run the fused layers (the integer
    kernel), whose arithmetic is not that of the model's other forwards."""
    stack = getattr(getattr(model, "model", None), "stack", None)
    return type(stack).__name__ == "FusedStack"


def model_eos_ids(model: Any) -> list[int]:
    """The token ids at which the model's generate() stops (its generation config's EOS)."""
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def plain_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Plain greedy decoding on the model's execution path, the reference every lossless test
    compares with: transformers' own generate(), or, on the fused layers, the decoder without
    lookahead (one token a step, alone), which runs them too."""
    if on_fused_layers(model):
        from lookahead import LookaheadConfig, LookaheadDecoder, SamplingParams

        config = LookaheadConfig(use_lookahead=False)
        decoder = LookaheadDecoder(model, IdsOnly(), None, config, eos_token_ids=model_eos_ids(model))
        return decoder.generate(prompt, SamplingParams(max_tokens=max_tokens))[0]
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def repetitive_prompt(rng: random.Random, vocab: int) -> list[int]:
    """Random prompt with a repeated span, so the prompt itself yields drafts."""
    span = [rng.randrange(vocab) for _ in range(rng.randint(3, 8))]
    noise = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
    return span + noise + span + noise[:2]


def tree_logits(model: Any, prefix: list[int], tree: list[int], parents: list[int]) -> torch.Tensor:
    """Logits of a draft tree fed after a cached prefix, with an ancestor mask, as the decoder feeds it."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prefix]), cache=cache, use_cache=True)
    n, past = len(tree), len(prefix)
    visible = torch.zeros(n, past + n, dtype=torch.bool)
    visible[:, :past] = True
    depth = [0] * n
    for node, parent in enumerate(parents):
        if parent >= 0:
            visible[node] = visible[parent]
            depth[node] = depth[parent] + 1
        visible[node, past + node] = True
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    return model(
        input_ids=torch.tensor([tree]),
        attention_mask=mask[None, None],
        position_ids=torch.tensor([[past + d for d in depth]]),
        cache=cache,
        use_cache=True,
    ).logits[0]


class IdsOnly:
    """A tokenizer for token ids alone: every id decodes to nothing (any vocabulary)."""

    pad_token_id = None
    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


class ByteTokenizer:
    """Token id = one byte (vocab 256), so multi-byte UTF-8 characters span several tokens."""

    pad_token_id = None
    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))


# A toy decoupled Python model for the launcher tests.
TOY_CONFIG = """
name: "toy"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
parameters { key: "finalize_marker" value: { string_value: "%s" } }
"""

# Streams three responses per request. Importing numpy and backend checks that the stub sees this
# virtual environment and the repository root; finalize() leaves a marker on disk.
TOY_MODEL = """
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

import backend

REPO_ROOT = Path(backend.__file__).resolve().parents[1]


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        self.marker = Path(parameters["finalize_marker"]["string_value"])
        %s

    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text").as_numpy()[0].decode()
            sender = request.get_response_sender()
            for part in (text, "from", str(REPO_ROOT)):
                output = pb_utils.Tensor("text_output", np.array([part.encode()], dtype=np.object_))
                sender.send(pb_utils.InferenceResponse(output_tensors=[output]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self):
        self.marker.write_text("finalized")
"""


def write_toy_repository(root: Path, marker: Path, initialize_extra: str = "pass") -> Path:
    model_dir = root / "models" / "toy"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(TOY_CONFIG % marker)
    (model_dir / "1" / "model.py").write_text(TOY_MODEL % initialize_extra)
    return root / "models"


def stream_once(grpc_url: str, text: str) -> list[str]:
    """Send one request on a gRPC stream and collect every response until the final flag."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    text_input = grpcclient.InferInput("text", [1], "BYTES")
    text_input.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    client.async_stream_infer("toy", [text_input], enable_empty_final_response=True)
    parts: list[str] = []
    while True:
        result, error = responses.get(timeout=30)
        assert error is None, error
        output = result.as_numpy("text_output")
        if output is not None:
            parts.append(output[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return parts


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll condition() until it holds (True) or timeout_s passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
