"""SDPA for masked multi-token forwards of grouped-query models on the CPU, without copying K/V.

transformers' `sdpa` hands grouped-query heads to the kernel (`enable_gqa`) only when there is
no attention mask, because CUDA's fast kernels refuse that combination; with a mask it first
repeats every key and value head to the query heads' count. A draft-tree verification always
carries a mask, so on the default model (9 query heads over 3 key/value heads) each layer of a
16-token step copied 3x its whole KV cache. torch's CPU kernel takes `enable_gqa` with a mask
and computes every head exactly as on the repeated copy (bit for bit: tests/unit/cpu/test_attention.py),
so `grouped_sdpa` passes the grouping through and otherwise is `sdpa`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

GROUPED_SDPA = "grouped_sdpa"


def grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa_attention_forward, except that a masked multi-token CPU forward of a
    grouped-query layer reads the key/value heads in place."""
    if (
        getattr(module, "num_key_value_groups", 1) == 1
        or attention_mask is None
        or query.shape[2] == 1
        or query.device.type != "cpu"
        or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("output_attentions")
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: Any) -> bool:
    """Switch a model that runs transformers' `sdpa` to `grouped_sdpa`; False if it runs anything else."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(GROUPED_SDPA)
    return model.config._attn_implementation == GROUPED_SDPA


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
