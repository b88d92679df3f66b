"""The tensors of one forward: token ids, per-node positions and the additive tree mask.

A decoding step feeds k requests as a [k, q] block, request i's root and draft in row i, padded
to the widest draft: each node sees its request's committed prefix and its own ancestors (never
its siblings, the padding or the other rows) and sits at position prefix + depth, so the model
scores every branch as if it were a plain continuation. A prefill feeds the prompt causally, then
the draft of what follows it with the same tree rule.
"""

from __future__ import annotations

import torch

from ..algorithm.draft import Draft


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mask transformers adds to attention scores: 0 where `visible`, the dtype's minimum elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, torch.finfo(dtype).min
    )


def decode_inputs(
    drafts: list[Draft], lengths: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [k, q], position ids [k, q], additive mask [k, 1, q, max(lengths) + q]) of drafts fed
    after lengths[i] cached entries of row i."""
    k, width = len(drafts), max(len(d) for d in drafts)
    read_length = max(lengths) + width
    ids = torch.zeros(k, width, dtype=torch.long)
    positions = torch.zeros(k, width, dtype=torch.long)
    visible = torch.zeros(k, width, read_length, dtype=torch.bool)
    for i, (draft, length) in enumerate(zip(drafts, lengths)):
        n = len(draft)
        ids[i, :n] = torch.tensor(draft.tokens)
        positions[i, :n] = draft.position_ids(length)
        visible[i, :n, :length] = True
        visible[i, :n, length : length + n] = draft.ancestor_mask()
        padding = torch.arange(n, width)
        visible[i, padding, length + padding] = True  # padding rows see only themselves
    return ids, positions, additive_mask(visible, dtype)[:, None]


def prefill_inputs(
    draft: Draft, root: int, cached: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [n] and additive mask [n, cached + n] of prompt tokens [cached, root) fed after
    `cached` cached ones, then `draft` (its root is the prompt's last token): causal over the
    prompt; each draft node sees the prompt and its own ancestors."""
    n = len(draft)
    visible = torch.ones(root + n, root + n, dtype=torch.bool).tril_()[cached:]
    visible[root - cached :, root:] = draft.ancestor_mask()
    positions = torch.cat([torch.arange(cached, root), draft.position_ids(root)])
    return positions, additive_mask(visible, dtype)
