"""The tensors of one forward: token ids, per-node positions and the additive tree mask(s).

A decoding step feeds k requests as a [k, q] block, request i's root and draft in row i, padded
to the widest draft: each node sees its request's committed prefix and its own ancestors (never
its siblings, the padding or the other rows) and sits at position prefix + depth, so the model
scores every branch as if it were a plain continuation. A prefill feeds the prompt causally, then
the draft of what follows it with the same tree rule.

Models with a sliding attention window (Mistral's `sliding_window`, the "sliding_attention"
layers of Gemma 2/3, Qwen 2/3 and others) see, in those layers, only the keys whose position is
within the window of the query's position. transformers builds such masks itself, but passes a
prepared 4-D mask on untouched, so `AttentionMasks` builds them: one mask, or one per layer
type, keyed as the model's `layer_types` name them, when a model mixes windowed and full layers.
"""

from __future__ import annotations

from typing import Any

import torch

from ..algorithm.draft import Draft

FULL, SLIDING = "full_attention", "sliding_attention"

Mask = torch.Tensor | dict[str, torch.Tensor]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mask transformers adds to attention scores: 0 where `visible`, the dtype's minimum elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, torch.finfo(dtype).min
    )


class AttentionMasks:
    """Which keys each layer of a model lets a query see, as additive masks.

    windows: layer type -> its window (None: the whole prefix); the single key None when the
    model takes one mask for every layer.
    """

    def __init__(self, config: Any, dtype: torch.dtype):
        self.dtype = dtype
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            unknown = sorted(set(layer_types) - {FULL, SLIDING})
            if unknown:
                raise ValueError(
                    f"{type(config).__name__} has layers of type {', '.join(unknown)}: the decoder builds "
                    "full and sliding-window attention masks only"
                )
            self.windows: dict[str | None, int | None] = {
                kind: (window if kind == SLIDING else None) for kind in dict.fromkeys(layer_types)
            }
        else:
            self.windows = {None: window if isinstance(window, int) and window > 0 else None}

    def build(
        self, visible: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
    ) -> Mask:
        """Additive mask(s) [B, 1, q, kv] from visibility [B, q, kv] by the tree and causal rules, the
        queries' positions [B, q] and the keys' positions [B, kv]."""
        full = additive_mask(visible, self.dtype)[:, None]
        masks: dict[str | None, torch.Tensor] = {}
        for kind, window in self.windows.items():
            if window is None or int(query_positions.max()) < window:
                masks[kind] = full  # nothing is out of the window yet
            else:
                inside = key_positions[:, None, :] > query_positions[:, :, None] - window
                masks[kind] = additive_mask(visible & inside, self.dtype)[:, None]
        return masks[None] if None in masks else masks


def to_device(mask: Mask, device: torch.device) -> Mask:
    if isinstance(mask, dict):
        return {kind: tensor.to(device) for kind, tensor in mask.items()}
    return mask.to(device)


def decode_inputs(
    drafts: list[Draft], lengths: list[int], masks: AttentionMasks
) -> tuple[torch.Tensor, torch.Tensor, Mask]:
    """(ids [k, q], position ids [k, q], additive mask(s) [k, 1, q, max(lengths) + q]) of drafts fed
    after lengths[i] cached entries of row i."""
    k, width = len(drafts), max(len(d) for d in drafts)
    read_length = max(lengths) + width
    ids = torch.zeros(k, width, dtype=torch.long)
    positions = torch.zeros(k, width, dtype=torch.long)
    key_positions = torch.arange(read_length).repeat(k, 1)
    visible = torch.zeros(k, width, read_length, dtype=torch.bool)
    for i, (draft, length) in enumerate(zip(drafts, lengths)):
        n = len(draft)
        ids[i, :n] = torch.tensor(draft.tokens)
        positions[i, :n] = draft.position_ids(length)
        key_positions[i, length : length + n] = positions[i, :n]
        key_positions[i, length + n :] = 0  # padding rows (position 0) see only themselves
        visible[i, :n, :length] = True
        visible[i, :n, length : length + n] = draft.ancestor_mask()
        padding = torch.arange(n, width)
        visible[i, padding, length + padding] = True
    return ids, positions, masks.build(visible, positions, key_positions)


def prefill_inputs(draft: Draft, root: int, cached: int, masks: AttentionMasks) -> tuple[torch.Tensor, Mask]:
    """Position ids [n] and additive mask(s) [1, 1, n, cached + n] of prompt tokens [cached, root)
    fed after `cached` cached ones, then `draft` (its root is the prompt's last token): causal over
    the prompt; each draft node sees the prompt and its own ancestors."""
    n = len(draft)
    visible = torch.ones(root + n, root + n, dtype=torch.bool).tril_()[cached:]
    visible[root - cached :, root:] = draft.ancestor_mask()
    positions = torch.cat([torch.arange(cached, root), draft.position_ids(root)])
    key_positions = torch.cat([torch.arange(root), draft.position_ids(root)])
    return positions, masks.build(visible[None], positions[None], key_positions[None])
