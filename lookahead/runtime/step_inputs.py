"""The tensors of one forward: token ids, per-node positions and the additive tree mask(s).

A step feeds its requests as one ragged row: request i's segment is a chunk of its prompt fed
causally and/or its root and draft tree, exactly as wide as it is (no padding). Each draft node
sees its request's committed prefix, the chunk, and its own ancestors (never its siblings or
other requests' tokens) and sits at position prefix + depth, so the model scores every branch as
if it were a plain continuation. The mask is block-diagonal over the segments' reads laid side by
side (kv_pool.PoolStep). A step of one-token segments only (plain batched decoding) is fed as a
[k, 1] block instead (`decode_inputs`), which attention reads in one batched call. Every step
builds these, so the index arrays and visibility are built in numpy, where a slice assignment costs
a tenth of a torch call, and become tensors at the end.

Models with a sliding attention window (Mistral's `sliding_window`, the "sliding_attention"
layers of Gemma 2/3, Qwen 2/3 and others) see, in those layers, only the keys whose position is
within the window of the query's position. transformers builds such masks itself, but passes a
prepared 4-D mask on untouched, so `AttentionMasks` builds them: one mask, or one per layer
type, keyed as the model's `layer_types` name them, when a model mixes windowed and full layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..algorithm.draft import Draft

FULL, SLIDING = "full_attention", "sliding_attention"

Mask = torch.Tensor | dict[str, torch.Tensor]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mask transformers adds to attention scores: 0 where `visible`, the dtype's minimum elsewhere."""
    return torch.where(visible, torch.zeros((), dtype=dtype, device=visible.device), torch.finfo(dtype).min)


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

    @property
    def windows_unused(self) -> bool:
        """Whether every layer sees its whole prefix (no sliding window anywhere)."""
        return all(window is None for window in self.windows.values())

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


def draft_positions(draft: Draft, prefix_len: int) -> np.ndarray:
    """[n] positions of a draft's nodes: the root right after the committed prefix, children one deeper."""
    return np.asarray(draft.depths(), dtype=np.int64) + prefix_len


def decode_inputs(
    drafts: list[Draft], lengths: list[int], masks: AttentionMasks
) -> tuple[torch.Tensor, torch.Tensor, Mask]:
    """(ids [k, q], position ids [k, q], additive mask(s) [k, 1, q, max(lengths) + q]) of drafts fed
    after lengths[i] cached entries of row i."""
    k, width = len(drafts), max(len(d) for d in drafts)
    read_length = max(lengths) + width
    ids = np.zeros((k, width), dtype=np.int64)
    positions = np.zeros((k, width), dtype=np.int64)
    key_positions = np.tile(np.arange(read_length, dtype=np.int64), (k, 1))
    visible = np.zeros((k, width, read_length), dtype=np.bool_)
    for i, (draft, length) in enumerate(zip(drafts, lengths)):
        n = len(draft)
        ids[i, :n] = draft.tokens
        positions[i, :n] = draft_positions(draft, length)
        key_positions[i, length : length + n] = positions[i, :n]
        key_positions[i, length + n :] = 0  # padding rows (position 0) see only themselves
        visible[i, :n, :length] = True
        visible[i, :n, length : length + n] = draft.ancestor_mask()
        padding = np.arange(n, width)
        visible[i, padding, length + padding] = True
    query_positions = torch.from_numpy(positions)
    mask = masks.build(torch.from_numpy(visible), query_positions, torch.from_numpy(key_positions))
    return torch.from_numpy(ids), query_positions, mask


@dataclass
class Segment:
    """One request's tokens in a ragged step: `prompt` (a chunk of its prompt, fed causally) then
    `draft` (root and tree), written into `slot` after its first `start` entries."""

    slot: int
    start: int
    prompt: list[int]
    draft: Draft | None  # None: a chunk that does not end the prompt

    @property
    def width(self) -> int:
        return len(self.prompt) + (len(self.draft) if self.draft is not None else 0)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + (self.draft.tokens if self.draft is not None else [])

    def positions(self) -> np.ndarray:
        chunk = np.arange(self.start, self.start + len(self.prompt), dtype=np.int64)
        if self.draft is None:
            return chunk
        return np.concatenate([chunk, draft_positions(self.draft, self.start + len(self.prompt))])

    def visibility(self) -> np.ndarray:
        """[width, width] bool: which of the segment's own tokens each one sees (itself included)."""
        if not self.prompt and self.draft is not None:
            return self.draft.ancestor_mask()
        n, p = self.width, len(self.prompt)
        visible = np.tri(n, dtype=np.bool_)
        if self.draft is not None:
            visible[p:, p:] = self.draft.ancestor_mask()
        return visible


def ragged_tokens(segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [1, N], position ids [1, N]) of the segments fed as one row."""
    ids = torch.tensor([token for segment in segments for token in segment.tokens])
    positions = np.concatenate([segment.positions() for segment in segments])
    return ids[None], torch.from_numpy(positions)[None]


def own_visibility(segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of its own segment's tokens each row of a ragged step sees, as lists: row r sees the
    columns columns[offsets[r]:offsets[r + 1]] of its segment, in order (int32 [N + 1] and
    int32). With its slot's first `start` entries, that is everything it attends to, so a stack
    that reads these lists needs no [N, sum(start + width)] mask."""
    offsets, columns = [np.zeros(1, dtype=np.int32)], []
    seen = 0
    for segment in segments:
        rows, cols = np.nonzero(segment.visibility())
        counts = np.bincount(rows, minlength=segment.width)
        offsets.append(seen + np.cumsum(counts, dtype=np.int64).astype(np.int32))
        seen += len(cols)
        columns.append(cols.astype(np.int32))
    return torch.from_numpy(np.concatenate(offsets)), torch.from_numpy(np.concatenate(columns))


def ragged_inputs(segments: list[Segment], masks: AttentionMasks) -> tuple[torch.Tensor, torch.Tensor, Mask]:
    """(ids [1, N], position ids [1, N], additive mask(s) [1, 1, N, sum(start + width)]) of the
    segments fed as one row; segment i reads its slot's first start + width entries, laid side
    by side in segment order."""
    widths = [segment.width for segment in segments]
    reads = [segment.start + segment.width for segment in segments]
    ids, query_positions = ragged_tokens(segments)
    positions = [segment.positions() for segment in segments]
    visible = np.zeros((sum(widths), sum(reads)), dtype=np.bool_)
    row = column = 0
    for segment, width, read in zip(segments, widths, reads):
        visible[row : row + width, column : column + segment.start] = True
        visible[row : row + width, column + segment.start : column + read] = segment.visibility()
        row, column = row + width, column + read
    key_positions = np.concatenate(
        [part for segment, own in zip(segments, positions) for part in (np.arange(segment.start), own)]
    )
    mask = masks.build(
        torch.from_numpy(visible)[None], query_positions, torch.from_numpy(key_positions)[None]
    )
    return ids, query_positions, mask
