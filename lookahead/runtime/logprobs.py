"""Log probabilities of chosen tokens, as vLLM reports them, from logits a forward already made.

vLLM (V1, its default `raw_logprobs` mode) reports the log-softmax of the model's raw logits,
before penalties, logit_bias, temperature or any truncation: so do we. Each position gives a
dict: the chosen token first, with its rank among all tokens (1 = the most likely), then the
`top` most likely tokens with ranks 1..top (an entry for the chosen token among them replaces the
first, as in vLLM).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str


PositionLogprobs = dict[int, Logprob]


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], top: int, decode: Callable[[int], str]
) -> list[PositionLogprobs]:
    """One dict per row of `logits` ([n, vocab]) for the token chosen after it (`tokens[i]`)."""
    if not len(tokens):
        return []
    logprobs = logits.float().log_softmax(-1)
    chosen = torch.tensor(list(tokens), device=logits.device)[:, None]
    values = logprobs.gather(1, chosen)
    ranks = (logprobs >= values).sum(-1).tolist()
    tops = logprobs.topk(top, -1) if top else None
    positions = []
    for i, (token, value, rank) in enumerate(zip(tokens, values[:, 0].tolist(), ranks)):
        entry = {token: Logprob(value, rank, decode(token))}
        if tops is not None:
            for j, (top_value, top_id) in enumerate(zip(tops.values[i].tolist(), tops.indices[i].tolist())):
                entry[top_id] = Logprob(top_value, j + 1, decode(top_id))
        positions.append(entry)
    return positions


def vllm_json(positions: Sequence[PositionLogprobs | None] | None) -> str:
    """The JSON vLLM's Triton backend sends in its `logprobs` output: a list with, per position,
    {token id: {"logprob", "rank", "decoded_token"}} (null for a position without any, as the
    first prompt token); "null" when none were asked for."""
    if positions is None:
        return "null"
    return json.dumps(
        [
            None
            if position is None
            else {
                token: {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": entry.decoded_token}
                for token, entry in position.items()
            }
            for position in positions
        ]
    )
