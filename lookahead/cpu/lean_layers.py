"""Decoder layers of packed Llama-shaped models without transformers' per-operation Python.

A one-token step of a small model on the CPU spends more time in the Python around its tensor
operations (module calls, keyword plumbing, ~35 small ops per layer) than in the linear
kernel's arithmetic. `use_lean_layers` turns each decoder layer of a packed Llama, Mistral,
Qwen2 or Qwen3 model into its lean subclass (`LeanLlamaDecoderLayer`, ...): the same module with
the same weights, whose forward runs from C++ (csrc/lean_layer.cpp) and issues the same ATen
operations in the same order, with q/k/v and gate/up each one kernel call and RoPE applied to q
and k together; only the cache update between its two halves stays in Python. Being subclasses, the
layers stay what transformers expects (its output capture finds them by class). The inner model
of a model with one attention mask for every layer (no sliding windows) is wrapped in a
`LeanLlamaModel`: no transformers wrappers around the layer loop, and on the decoder's KV pool the
whole loop, pool writes included, is one C++ call (`LeanStack`, which applies the step's
`PoolStep` as transformers' layers do through `StepCache`). On the pool every lean layer attends a
ragged step segment by segment, each over its own slot only.

The swap must reproduce the model's own forward bit for bit, which is checked at load (a
prefill, a masked two-token step, a padded batch); on any difference the model keeps
transformers' classes. On the integer kernel (`fused`), the forwards on the pool run a
`FusedStack` instead (csrc/fused_stack.h): the same layers in one parallel region, with its own
arithmetic for everything but the matrices, checked at load to stay within a rounding-sized
distance of the lean layers.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer, MistralModel
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2Model
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3Model

from ..runtime.kv_pool import StepCache
from .packed_linear import PackedLinear


class LeanDecoderLayer:
    """The lean forward of a decoder layer: the C++ layer's two halves around the cache update.
    Mixed into each supported layer class; `lean` is the C++ layer over this layer's weights."""

    lean: Any
    pool_step: type  # the extension's PoolStep

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        queries, keys, values = self.lean.before_attention(hidden_states, *position_embeddings)
        if isinstance(cache, StepCache) and attention_mask is not None:  # on the decoder's pool, from C++
            pool, index = cache.pool, self.self_attn.layer_idx
            step = cache.twin(self.pool_step)
            attended = self.lean.attend_pool(
                queries, keys, values, attention_mask, pool.keys[index], pool.values[index], step
            )
            return self.lean.finish(hidden_states, attended)
        if cache is not None:
            keys, values = cache.update(keys, values, self.self_attn.layer_idx, kwargs=kwargs)
        length = hidden_states.shape[1]
        causal = attention_mask is None and length > 1
        if causal and keys.shape[2] > length:  # as transformers' sdpa: a prefill into an empty static cache
            keys, values = keys[:, :, :length], values[:, :, :length]
        return self.lean.after_attention(hidden_states, queries, keys, values, attention_mask, causal)


class LeanLlamaDecoderLayer(LeanDecoderLayer, LlamaDecoderLayer):
    """A LlamaDecoderLayer on the lean forward."""


class LeanMistralDecoderLayer(LeanDecoderLayer, MistralDecoderLayer):
    """A MistralDecoderLayer on the lean forward."""


class LeanQwen2DecoderLayer(LeanDecoderLayer, Qwen2DecoderLayer):
    """A Qwen2DecoderLayer on the lean forward."""


class LeanQwen3DecoderLayer(LeanDecoderLayer, Qwen3DecoderLayer):
    """A Qwen3DecoderLayer on the lean forward."""


LEAN_CLASSES: dict[type, type] = {
    LlamaDecoderLayer: LeanLlamaDecoderLayer,
    MistralDecoderLayer: LeanMistralDecoderLayer,
    Qwen2DecoderLayer: LeanQwen2DecoderLayer,
    Qwen3DecoderLayer: LeanQwen3DecoderLayer,
}


# What a step whose rows carry their own visibility lists passes the fused stack for a mask.
_NO_MASK = torch.empty(0)

# Inner models that LeanLlamaModel stands in for, when every layer takes the same mask.
ONE_MASK_MODELS = (LlamaModel, MistralModel, Qwen2Model, Qwen3Model)

# How far the fused stack's hidden states may lie from the lean layers' (relative, in the 2-norm):
# its own rounding moves some int8 activations by one step, which moves outputs by ~1e-3.
FUSED_TOLERANCE = 2e-2
# How far its hidden states on a pool of fp16 entries may lie from the lean layers': the entries'
# rounding (2^-11 relative) moves int8 activations by a step more often than its own arithmetic.
HALF_POOL_TOLERANCE = 1e-1


class LeanLlamaModel(nn.Module):
    """A Llama-shaped model's inner model without transformers' wrappers, for the calls generate()
    and the decoder make (input ids, an optional mask, positions and cache); any other call goes to
    the stock model, whose modules are this one's. A masked step on the decoder's KV pool runs all
    layers in one C++ call: `stack`, a LeanStack (the lean layers' bits) or a FusedStack."""

    def __init__(self, stock: nn.Module, extension: ModuleType):
        super().__init__()
        self.config = stock.config
        self.embed_tokens, self.layers, self.norm = stock.embed_tokens, stock.layers, stock.norm
        self.rotary_emb = stock.rotary_emb
        self.stack = extension.LeanStack([layer.lean for layer in stock.layers])
        # Whether the stack reads each row's visible entries from a ragged step's own lists
        # (kv_pool.PoolStep.own_offsets), so that the step needs no attention mask: the fused one does.
        self.reads_row_lists = False
        # Whether the stack applies the final norm itself (the fused one, within its parallel region).
        self.stack_norms_output = False
        # Whether the stack also runs on a KV pool of fp16 entries (the fused one, where the load
        # probe on such a pool stays within HALF_POOL_TOLERANCE): half the memory a position takes.
        self.reads_half_pool = False
        self.pool_step = extension.PoolStep
        self._stock = (stock,)  # a tuple keeps it out of the module tree: its modules are ours

    def get_decoder(self) -> nn.Module:
        """As LlamaModel's: the decoder whose last hidden states the output layer reads."""
        return self

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        if kwargs or input_ids is None or inputs_embeds is not None:
            return self._stock[0](
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                **kwargs,
            )
        hidden_states = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(hidden_states.shape[1], device=hidden_states.device) + past)[None]
        if isinstance(attention_mask, dict):  # the decoder's masks by layer type: all of one type here
            (attention_mask,) = attention_mask.values()
        if isinstance(cache, StepCache) and cache.step.own_offsets is not None:
            mask = _NO_MASK  # the fused stack reads what each row sees from the step itself
        elif attention_mask is not None and attention_mask.dim() == 4:
            mask = attention_mask  # what create_causal_mask returns for a prepared mask, without its work
        else:
            mask = create_causal_mask(
                config=self.config,
                inputs_embeds=hidden_states,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
            )
        embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        if isinstance(cache, StepCache) and mask is not None:
            pool = cache.pool
            inputs = (hidden_states, *embeddings, mask, pool.keys, pool.values, cache.twin(self.pool_step))
            if self.stack_norms_output:
                normed = self.stack(*inputs, _norm_weights(self.norm))
                return BaseModelOutputWithPast(last_hidden_state=normed, cache=cache)
            hidden_states = self.stack(*inputs)
        else:
            for layer in self.layers:
                hidden_states = layer(
                    hidden_states, attention_mask=mask, cache=cache, position_embeddings=embeddings
                )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)


def use_lean_layers(model: nn.Module, extension: ModuleType, fused: bool = False) -> bool:
    """Turn every decoder layer of `model` (and a one-mask model's inner model) into its lean
    subclass if that gives the same bits; say if it did. `fused`: forwards on the decoder's KV pool
    run a FusedStack where the model's shapes allow one and it agrees with the lean layers."""
    layers = [module for module in model.modules() if type(module) in LEAN_CLASSES]
    if not layers or not all(_packed_as_expected(layer) for layer in layers):
        return False
    before = _probe(model)
    originals = [type(layer) for layer in layers]
    for layer in layers:
        layer.lean = _lean_layer(layer, extension)
        layer.pool_step = extension.PoolStep
        layer.__class__ = LEAN_CLASSES[type(layer)]  # the same module, its lean subclass
    inner = getattr(model, "model", None)
    wrapped = type(inner) in ONE_MASK_MODELS and _one_mask(inner.config)
    if wrapped:  # others build per-layer-type (sliding) masks
        model.model = LeanLlamaModel(inner, extension)
    if all(torch.equal(a, b) for a, b in zip(_probe(model), before)):
        if wrapped and fused:
            use_fused_stack(model.model, extension)
        return True
    for layer, original in zip(layers, originals):
        layer.__class__ = original
        del layer.lean, layer.pool_step
    if wrapped:
        model.model = inner
    return False


def use_fused_stack(lean: LeanLlamaModel, extension: ModuleType) -> bool:
    """Give `lean` a FusedStack for its forwards on the decoder's pool if its shapes allow one and
    it stays within FUSED_TOLERANCE of the lean layers; say if it did."""
    try:
        fused = extension.FusedStack([layer.lean for layer in lean.layers])
    except RuntimeError:
        return False
    expected = _stack_probe(lean, lean.stack)
    got = _stack_probe(lean, fused)
    if not bool(torch.isfinite(got).all()):
        return False
    if float((got - expected).norm() / expected.norm()) > FUSED_TOLERANCE:
        return False
    lean.stack = fused
    lean.reads_row_lists = True
    on_halves = _stack_probe(lean, fused, torch.float16)
    lean.reads_half_pool = bool(torch.isfinite(on_halves).all()) and bool(
        float((on_halves - expected).norm() / expected.norm()) <= HALF_POOL_TOLERANCE
    )
    # The stack's own RMSNorm stands in for the final norm where that is the layers' kind of norm.
    lean.stack_norms_output = type(lean.norm) is type(lean.layers[0].input_layernorm)
    return True


def _one_mask(config: Any) -> bool:
    """Whether every layer of the model attends with the same mask (no sliding window anywhere)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return all(kind == "full_attention" for kind in layer_types)
    return (
        getattr(config, "sliding_window", None) is None
        or getattr(config, "use_sliding_window", True) is False
    )


def _stack_probe(lean: LeanLlamaModel, stack: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Hidden states of a stack over a fresh pool of `dtype` entries: a 6-token prompt in slot 0,
    then a 3-node tree (a root and two children) in slot 1 after a 4-token prompt."""
    config, embeddings = lean.config, lean.embed_tokens
    vocab = embeddings.num_embeddings
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pool = [torch.zeros(2, kv_heads, 16, head_dim, dtype=dtype) for _ in range(2 * len(lean.layers))]
    keys, values = pool[: len(lean.layers)], pool[len(lean.layers) :]
    outputs = []
    with torch.inference_mode():
        for slot, tokens, positions, visible in (
            (0, [11, 12, 13, 14, 15, 16], [0, 1, 2, 3, 4, 5], torch.ones(6, 6).tril()),
            (1, [21, 22, 23, 24], [0, 1, 2, 3], torch.ones(4, 4).tril()),
            (1, [31, 32, 33], [4, 5, 5], torch.tensor([[1.0, 0, 0], [1, 1, 0], [1, 0, 1]])),
        ):
            start = positions[0]
            ids = torch.tensor([[t % vocab for t in tokens]])
            hidden = embeddings(ids)
            cos, sin = lean.rotary_emb(hidden, position_ids=torch.tensor([positions]))
            seen = torch.cat([torch.ones(len(tokens), start), visible], 1)
            mask = torch.zeros(1, 1, *seen.shape).masked_fill_(
                seen[None, None] == 0, torch.finfo(torch.float32).min
            )
            step = lean.pool_step(torch.tensor([[slot, start, len(tokens)]]), None, None, start + len(tokens))
            outputs.append(stack(hidden, cos, sin, mask, keys, values, step)[0])
    return torch.cat(outputs)


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


def _lean_layer(layer: nn.Module, extension: ModuleType) -> Any:
    """The C++ layer over this layer's packed matrices and norms."""
    attn, mlp = layer.self_attn, layer.mlp
    return extension.LeanLayer(
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


def _probe(model: nn.Module) -> list[torch.Tensor]:
    """Logits of a 3-token prefill, of a masked 2-token step after it (a root and its child) and
    of a padded batch of two."""
    vocab, device = model.get_input_embeddings().num_embeddings, next(model.parameters()).device
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
