"""Whether a step may run the model's output layer on the rows that hold draft tokens only."""

from __future__ import annotations

from typing import Any

import torch


def plain_logits(model: Any, tokens: list[int], device: torch.device) -> torch.Tensor:
    """Logits [len(tokens), vocab] of one uncached forward."""
    return model(input_ids=torch.tensor([tokens], device=device), use_cache=False).logits[0]


def plain_output_layer(model: Any) -> Any | None:
    """The model's output layer if its logits are exactly that layer applied to its decoder's last
    hidden states, else None (soft-capping, scaling or anything else after the layer, or a model
    without the two accessors). Probed with one short forward, compared bit for bit.

    With it, a batched step runs the output layer (a 49152 x 576 matrix for the default model)
    on the rows that hold draft tokens only, not on the padding.
    """
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
        if decoder is None or head is None or decoder is model:
            return None
        vocab, device = model.get_input_embeddings().num_embeddings, next(model.parameters()).device
        tokens = [t % vocab for t in (11, 12, 13)]
        with torch.inference_mode():
            full = plain_logits(model, tokens, device)
            ids = torch.tensor([tokens], device=device)
            split = head(decoder(input_ids=ids, use_cache=False).last_hidden_state)[0]
    except Exception:  # a model without a separable decoder and head: keep its own forward
        return None
    return head if full.shape == split.shape and torch.equal(full, split) else None
