"""ChatGLM2/3 checkpoints in THUDM's own format, loaded onto transformers' GLM without remote code.

A chatglm3-6b folder (config `model_type` "chatglm", `transformer.encoder.layers.N...` keys)
ships its modeling code for `trust_remote_code`. That code computes exactly what transformers'
`GlmForCausalLM` computes with partial rotary factor 0.5 (RoPE on interleaved pairs of each
head's first half), multi-query attention groups as key/value heads and the fused
`query_key_value` split row-wise into queries | keys | values. So the config is translated, every
tensor is renamed (and the fused attention projection split) at load, and no file of the folder
is ever executed. Later variants scale the RoPE base 10000 by `rope_ratio`.

Flags of other GLM generations (LayerNorm instead of RMSNorm, biases on every linear layer,
the residual taken after the layer norm) have no counterpart in `GlmForCausalLM`: such a folder
is refused with the flag named.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from transformers import GlmConfig, GlmForCausalLM

MODEL_TYPE = "chatglm"
ROPE_BASE = 10000.0
# flag -> the value GlmForCausalLM computes; any other value is refused.
REQUIRED_FLAGS = {
    "rmsnorm": True,
    "post_layer_norm": True,
    "add_bias_linear": False,
    "apply_residual_connection_post_layernorm": False,
    "original_rope": True,
}
_LAYER_KEY = re.compile(r"transformer\.encoder\.layers\.(\d+)\.(.+)")
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.dense.weight": "self_attn.o_proj.weight",
    "mlp.dense_h_to_4h.weight": "mlp.gate_up_proj.weight",
    "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "transformer.embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "transformer.encoder.final_layernorm.weight": "model.norm.weight",
    "transformer.output_layer.weight": "lm_head.weight",
}
_UNUSED = ("transformer.rotary_pos_emb.inv_freq",)  # recomputed by the GLM rotary embedding


class ChatGLMFormatError(ValueError):
    """A ChatGLM folder this loader cannot map exactly."""


def is_chatglm_folder(folder: Path) -> bool:
    """True when folder/config.json declares ChatGLM's own format."""
    return _read_config(folder).get("model_type") == MODEL_TYPE


def glm_config(chatglm: dict[str, Any]) -> GlmConfig:
    """The GlmConfig that computes what a ChatGLM config describes; ChatGLMFormatError otherwise."""
    for flag, expected in REQUIRED_FLAGS.items():
        if flag in chatglm and bool(chatglm[flag]) != expected:
            raise ChatGLMFormatError(
                f"ChatGLM config {flag}={chatglm[flag]!r} is not supported: "
                f"only ChatGLM2/3's {flag}={expected} maps onto transformers' GLM"
            )
    heads = int(chatglm["num_attention_heads"])
    groups = int(chatglm["multi_query_group_num"]) if chatglm.get("multi_query_attention") else heads
    head_dim = int(chatglm.get("kv_channels") or int(chatglm["hidden_size"]) // heads)
    eos = chatglm.get("eos_token_id", 2)
    return GlmConfig(
        vocab_size=int(chatglm["padded_vocab_size"]),
        hidden_size=int(chatglm["hidden_size"]),
        intermediate_size=int(chatglm["ffn_hidden_size"]),
        num_hidden_layers=int(chatglm["num_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=head_dim,
        max_position_embeddings=int(chatglm.get("seq_length", 8192)),
        rms_norm_eps=float(chatglm.get("layernorm_epsilon", 1e-5)),
        attention_bias=bool(chatglm.get("add_qkv_bias", True)),
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": ROPE_BASE * float(chatglm.get("rope_ratio", 1)),
        },
        partial_rotary_factor=0.5,
        pad_token_id=chatglm.get("pad_token_id", 0),
        eos_token_id=eos,
        bos_token_id=None,
    )


def glm_tensors(name: str, tensor: torch.Tensor, config: GlmConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The GlmForCausalLM tensors (name, value) of one ChatGLM tensor; ChatGLMFormatError if unknown."""
    if name in _TOP_NAMES:
        yield _TOP_NAMES[name], tensor
        return
    if name in _UNUSED:
        return
    layer = _LAYER_KEY.fullmatch(name)
    if layer is None:
        raise ChatGLMFormatError(f"unknown ChatGLM tensor {name!r}")
    index, rest = layer.groups()
    prefix = f"model.layers.{index}."
    if rest in _LAYER_NAMES:
        yield prefix + _LAYER_NAMES[rest], tensor
        return
    kind = rest.removeprefix("self_attention.query_key_value.")
    if kind not in ("weight", "bias") or kind == rest:
        raise ChatGLMFormatError(f"unknown ChatGLM tensor {name!r}")
    queries = config.num_attention_heads * config.head_dim
    keys = config.num_key_value_heads * config.head_dim
    if tensor.shape[0] != queries + 2 * keys:
        raise ChatGLMFormatError(
            f"{name} has {tensor.shape[0]} rows, not queries {queries} + keys {keys} + values {keys}"
        )
    q, k, v = tensor.split([queries, keys, keys])
    for projection, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
        yield f"{prefix}self_attn.{projection}.{kind}", part


def load_chatglm(folder: Path, dtype: torch.dtype) -> GlmForCausalLM:
    """A GlmForCausalLM holding a ChatGLM folder's weights in `dtype`; the folder's code is never run."""
    config = glm_config(_read_config(folder))
    with init_empty_weights(include_buffers=False):
        model = GlmForCausalLM(config)
    state = {}
    for name, tensor in _checkpoint_tensors(folder):
        for glm_name, value in glm_tensors(name, tensor, config):
            state[glm_name] = value.to(dtype).contiguous()
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ChatGLMFormatError(
            f"{folder}: the checkpoint does not fill the GLM model (missing {missing[:4]}, "
            f"unexpected {unexpected[:4]})"
        )
    # The rotary embedding's inv_freq stays fp32, as from_pretrained leaves it.
    model.load_state_dict(state, assign=True, strict=True)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def _read_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text(encoding="utf-8"))


def _checkpoint_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a safetensors or PyTorch checkpoint (sharded or not), never unpickling code."""
    from safetensors import safe_open

    safetensors = _shards(folder, "model.safetensors")
    if safetensors:
        for shard in safetensors:
            with safe_open(shard, framework="pt") as tensors:
                for name in tensors.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, tensors.get_tensor(name)
        return
    pickles = _shards(folder, "pytorch_model.bin")
    if not pickles:
        raise ChatGLMFormatError(f"{folder} has no model.safetensors or pytorch_model.bin (sharded or not)")
    for shard in pickles:
        yield from torch.load(shard, map_location="cpu", weights_only=True, mmap=True).items()


def _shards(folder: Path, file: str) -> list[Path]:
    if (folder / file).is_file():
        return [folder / file]
    index = folder / f"{file}.index.json"
    if not index.is_file():
        return []
    weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    return [folder / shard for shard in dict.fromkeys(weight_map.values())]
