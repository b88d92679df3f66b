"""The recycle table's updates (algorithm/recycling.py) from the logits a verification computed.

After each step, every fed node's row of logits is the model's next-token distribution after
that node's path: its top k, with their probabilities, become the table's row for the node's
token. Rows off the accepted path go first and the path's last, so where a token was read twice
in one step the text the request goes on from wins. No extra forward: one top-k and one
log-sum-exp over rows verification already holds (one C++ pass where the fast CPU path is loaded).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..algorithm.draft import Draft
from ..algorithm.recycling import Recycles


def recycle(table: Recycles, draft: Draft, logits: torch.Tensor, accepted_nodes: Sequence[int]) -> None:
    """Write each node's top candidates (logits: [len(draft), vocab], row i after node i's path)."""
    path = [0, *accepted_nodes]
    on_path = set(path)
    order = [i for i in range(len(draft)) if i not in on_path] + path
    values, candidates, lse = top_candidates(logits.float(), table.k)
    probs = torch.exp(values - lse[:, None])
    table.update(
        np.asarray([draft.tokens[i] for i in order]),
        candidates.cpu().numpy().astype(np.int32)[order],
        probs.cpu().numpy().astype(np.float16)[order],
    )


TopCandidates = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# The fast CPU path's one-pass kernel (lookahead/cpu registers it when its extension loads).
_cpu_kernel: TopCandidates | None = None


def use_cpu_kernel(kernel: TopCandidates) -> None:
    """Take fp32 CPU rows' top candidates from `kernel` (rows [R, V], k -> values, ids, log-sum-exp)."""
    global _cpu_kernel
    _cpu_kernel = kernel


def top_candidates(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's k largest logits (largest first), their token ids and the row's log-sum-exp:
    the fast CPU path's kernel where it is loaded and the rows are fp32 on the CPU, else torch."""
    if _cpu_kernel is not None and rows.device.type == "cpu" and rows.dtype == torch.float32:
        return _cpu_kernel(rows.contiguous(), k)
    values, candidates = rows.topk(k, dim=-1)
    return values, candidates, torch.logsumexp(rows, dim=-1)
