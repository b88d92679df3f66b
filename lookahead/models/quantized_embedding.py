"""An input embedding that keeps a GGUF file's blocks: the rows a forward looks up are dequantised then.

A vocabulary's table is a large part of a small model (151936 x 1536 for Qwen2.5-Coder-1.5B: 0.9 GB
in fp32, a sixth of its weights). A forward reads a few of its rows, so the table stays in its
file's encoding and each looked-up row is dequantised by gguf, the same function (and so the same
bits) transformers' fp32 table holds. The rows dequantised last are kept, up to CACHED_BYTES: a
decoding step looks up a few tokens, mostly ones it looked up before, and gguf's call costs a
fifth of a millisecond however few rows it gets.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

CACHED_BYTES = 16 << 20  # dequantised rows kept, oldest dropped first


class QuantizedEmbedding(nn.Module):
    """Stands in for an `nn.Embedding` (or Gemma's scaled one, whose `embed_scale` it applies)."""

    def __init__(
        self,
        rows: np.ndarray,
        qtype: GGMLQuantizationType,
        embedding_dim: int,
        embed_scale: torch.Tensor | None = None,
    ):
        super().__init__()
        self.qtype = qtype
        self.num_embeddings, self.embedding_dim = rows.shape[0], embedding_dim
        self.register_buffer("rows", torch.from_numpy(rows.view(np.uint8)), persistent=False)
        self.register_buffer("embed_scale", embed_scale, persistent=False)
        self._dequantized: dict[int, np.ndarray] = {}
        self._capacity = max(1, CACHED_BYTES // (4 * embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).tolist()
        rows = {token: self._dequantized.get(token) for token in dict.fromkeys(ids)}
        missing = [token for token, row in rows.items() if row is None]
        if missing:
            fresh = dequantize(self.rows.numpy()[missing], self.qtype)
            for token, row in zip(missing, fresh):
                rows[token] = self._dequantized[token] = row.copy()  # not a view holding `fresh`
            while len(self._dequantized) > self._capacity:  # first in, first out
                del self._dequantized[next(iter(self._dequantized))]
        table = (
            np.stack([rows[token] for token in ids]) if ids else np.empty((0, self.embedding_dim), np.float32)
        )
        embedded = torch.from_numpy(table).view(*input_ids.shape, self.embedding_dim)
        if self.embed_scale is not None:
            embedded = embedded * self.embed_scale.to(embedded.dtype)
        return embedded

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name}"
