"""The recycle table's updates (algorithm/recycling.py) from the logits a verification computed.

After each step, every fed node's row of logits is the model's next-token distribution after
that node's path: its top k, with their probabilities, become the table's row for the node's
token. Rows off the accepted path go first and the path's last, so where a token was read twice
in one step the text the request goes on from wins. No extra forward: one top-k and one
log-sum-exp over rows verification already holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..algorithm.draft import Draft
from ..algorithm.recycling import Recycles


def recycle(table: Recycles, draft: Draft, logits: torch.Tensor, accepted_nodes: Sequence[int]) -> None:
    """Write each node's top candidates (logits: [len(draft), vocab], row i after node i's path)."""
    path = [0, *accepted_nodes]
    on_path = set(path)
    order = [i for i in range(len(draft)) if i not in on_path] + path
    rows = logits.float()
    values, candidates = rows.topk(table.k, dim=-1)
    probs = torch.exp(values - torch.logsumexp(rows, dim=-1, keepdim=True))
    table.update(
        np.asarray([draft.tokens[i] for i in order]),
        candidates.cpu().numpy().astype(np.int32)[order],
        probs.cpu().numpy().astype(np.float16)[order],
    )
