"""Decoder layers of packed Llama-shaped models without transformers' per-operation Python.

A one-token step of the default model on the CPU spent more time in the Python around its
tensor operations (module calls, keyword plumbing, ~35 small ops per layer, the packed layers'
sibling bookkeeping) than in the linear kernel's arithmetic. `use_lean_layers` gives each layer
of a packed Llama, Mistral, Qwen2 or Qwen3 model a forward run from C++ (`csrc/lean_layer.cpp`)
that issues the same ATen operations in the same order, with q/k/v and gate/up each one kernel
call and RoPE applied to q and k together; only the KV cache update between its two halves stays
in Python. It must reproduce the model's own forward bit for bit, which is checked at load (a
prefill, a masked two-token step, a padded batch); on any difference the model keeps
transformers' layers. A LlamaForCausalLM also gets a model-level forward without transformers'
wrappers, and on the decoder's KV pool it runs the whole layer loop, cache writes included, as
one C++ call (`LeanStack`: the same operations, the pool's writes done in C++). Measured (same
process, alternating): a one-token forward 28.4 -> 18.8 ms, 8 tokens 33.4 -> 27.9 with the
layers in Python; run from C++ (with the int4 kernel form, alternating processes) one token
22 -> 14.4 ms, 8 tokens 32 -> 23.6; the layer loop in C++, code editing (32 prompts, same
process, alternating) 1.057x the tokens/s of the loop in Python, same outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from .kv_pool import StepCache
from .packed_linear import PackedLinear, _extension

_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")


def use_lean_layers(model: nn.Module) -> bool:
    """Switch every decoder layer of `model` (and a Llama's model-level forward) to the lean
    forward if that gives the same bits; say if it did."""
    layers = [module for module in model.modules() if type(module).__name__ in _LAYERS]
    if not layers or not all(_packed_as_expected(layer) for layer in layers):
        return False
    before = _probe(model)
    leans = [_lean_layer(layer) for layer in layers]
    for layer, lean in zip(layers, leans):
        layer.forward = _lean_forward(lean, layer.self_attn.layer_idx)
    patched = [*layers]
    if type(model).__name__ == "LlamaForCausalLM":  # others build per-layer-type (sliding) masks
        model.forward = _lean_causal_lm_forward(model, layers, _extension().LeanStack(leans))
        patched.append(model)
    if all(torch.equal(a, b) for a, b in zip(_probe(model), before)):
        return True
    for module in patched:
        del module.forward  # back to the class's forward
    return False


def _packed_as_expected(layer: nn.Module) -> bool:
    """q/k/v and gate/up fused into one packed product each, o/down packed alone, SiLU, RMSNorm."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return (
        all(isinstance(linear, PackedLinear) for linear in linears)
        and attn.q_proj.weights is attn.k_proj.weights is attn.v_proj.weights
        and mlp.gate_proj.weights is mlp.up_proj.weights
        and type(mlp.act_fn).__name__ in ("SiLU", "SiLUActivation")
        and hasattr(layer.input_layernorm, "variance_epsilon")
        and hasattr(layer.post_attention_layernorm, "variance_epsilon")
    )


def _norm_weights(norm: nn.Module) -> tuple[torch.Tensor, float]:
    return norm.weight, norm.variance_epsilon


def _lean_layer(layer: nn.Module) -> Any:
    """The C++ layer over this layer's packed matrices and norms."""
    attn, mlp = layer.self_attn, layer.mlp
    return _extension().LeanLayer(
        attn.q_proj.weights.matrix,
        attn.o_proj.weights.matrix,
        mlp.gate_proj.weights.matrix,
        mlp.down_proj.weights.matrix,
        _norm_weights(layer.input_layernorm),
        _norm_weights(layer.post_attention_layernorm),
        _norm_weights(attn.q_norm) if hasattr(attn, "q_norm") else None,
        _norm_weights(attn.k_norm) if hasattr(attn, "k_norm") else None,
        attn.config.num_attention_heads,
        attn.config.num_key_value_heads,
        attn.head_dim,
        mlp.gate_proj.out_features,
        attn.scaling,
    )


def _lean_forward(lean: Any, index: int) -> Callable[..., torch.Tensor]:
    """The layer's forward: the C++ halves around the cache's update."""

    def forward(
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        queries, keys, values = lean.before_attention(hidden_states, *position_embeddings)
        if cache is not None:
            keys, values = cache.update(keys, values, index, kwargs=kwargs)
        length = hidden_states.shape[1]
        causal = attention_mask is None and length > 1
        if causal and keys.shape[2] > length:  # as transformers' sdpa: a prefill into an empty static cache
            keys, values = keys[:, :, :length], values[:, :, :length]
        return lean.after_attention(hidden_states, queries, keys, values, attention_mask, causal)

    return forward


def _lean_causal_lm_forward(model: nn.Module, layers: list[nn.Module], stack: Any) -> Callable[..., Any]:
    """LlamaForCausalLM's forward for the calls generate() and the decoder make, without its
    wrappers (keyword renaming, output capture, return-type plumbing: ~1.5 ms a forward); any
    other call goes to the stock forward. A masked step on the decoder's KV pool runs all layers
    in one C++ call (`stack`)."""
    stock, inner, config = model.forward, model.model, model.config
    forwards = [layer.forward for layer in layers]

    def forward(
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> Any:
        if kwargs or input_ids is None or not return_dict or not isinstance(logits_to_keep, int):
            return stock(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                return_dict=return_dict,
                **kwargs,
            )
        hidden_states = inner.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=config)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(hidden_states.shape[1], device=hidden_states.device) + past)[None]
        if attention_mask is not None and attention_mask.dim() == 4:
            mask = attention_mask  # what create_causal_mask returns for a prepared mask, ~0.1 ms sooner
        else:
            mask = create_causal_mask(
                config=config,
                inputs_embeds=hidden_states,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
            )
        embeddings = inner.rotary_emb(hidden_states, position_ids=position_ids)
        if isinstance(cache, StepCache) and mask is not None:
            pool = cache.pool
            hidden_states = stack(
                hidden_states,
                *embeddings,
                mask,
                pool.keys,
                pool.values,
                pool.write_start,
                pool.write_slots,
                pool.write_positions,
                pool.read_length,
            )
        else:
            for layer_forward in forwards:
                hidden_states = layer_forward(
                    hidden_states, attention_mask=mask, cache=cache, position_embeddings=embeddings
                )
        hidden_states = inner.norm(hidden_states)[:, -logits_to_keep:]  # 0 keeps every position
        return CausalLMOutputWithPast(logits=model.lm_head(hidden_states), cache=cache)

    return forward


def _probe(model: nn.Module) -> list[torch.Tensor]:
    """Logits of a 3-token prefill, of a masked 2-token step after it (a root and its child) and
    of a padded batch of two."""
    embeddings = model.get_input_embeddings()
    vocab, device = embeddings.num_embeddings, embeddings.weight.device
    tokens = [t % vocab for t in (11, 12, 13, 14, 15)]
    cache = DynamicCache(config=model.config)
    mask = torch.zeros(1, 1, 2, 5, device=device)
    mask[0, 0, 0, 4] = torch.finfo(mask.dtype).min
    with torch.inference_mode():
        prefill = model(input_ids=torch.tensor([tokens[:3]], device=device), cache=cache, use_cache=True)
        step = model(
            input_ids=torch.tensor([tokens[3:]], device=device),
            attention_mask=mask,
            position_ids=torch.tensor([[3, 4]], device=device),
            cache=cache,
            use_cache=True,
        )
        batch = model(
            input_ids=torch.tensor([tokens, tokens[2:] + tokens[:2]], device=device),
            attention_mask=torch.tensor([[1] * 5, [0, 0, 1, 1, 1]], device=device),
        )
    return [prefill.logits, step.logits, batch.logits]
