"""Token selection that matches transformers' generate() exactly.

The same processors (repetition penalty, minimum new tokens) and warpers (temperature, top-k,
top-p) are applied, in generate()'s order, to the logits of each draft node with that node's
own ancestor path as history. Sampling draws exactly one multinomial sample per emitted token
from a per-request generator, so a seeded lookahead run emits the same tokens as a seeded
plain run: speculation changes how many forwards it takes, never what is sampled.
"""

from __future__ import annotations

import secrets

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..config import SamplingParams


class TokenSelector:
    """Chooses the next token from one position's logits, for one request."""

    def __init__(
        self, params: SamplingParams, prompt_length: int, eos_token_ids: tuple[int, ...], device: torch.device
    ):
        self.greedy = params.greedy
        self.processors = LogitsProcessorList()
        if params.repetition_penalty != 1.0:
            self.processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
        if params.min_tokens > 0 and eos_token_ids and not params.ignore_eos:
            self.processors.append(
                MinNewTokensLengthLogitsProcessor(
                    prompt_length, params.min_tokens, list(eos_token_ids), device=device
                )
            )
        if not self.greedy:
            if params.temperature != 1.0:
                self.processors.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                self.processors.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                self.processors.append(TopPLogitsWarper(params.top_p))
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self.generator = torch.Generator(device=device).manual_seed(seed)

    @property
    def needs_history(self) -> bool:
        """Whether a node's choice depends on more than its own logits (so it cannot be batched)."""
        return bool(self.processors) or not self.greedy

    def select(self, history: torch.Tensor, logits: torch.Tensor) -> int:
        """Pick the token after `history` ([seq] ids) from `logits` ([vocab]) of its last position."""
        scores = logits.float().unsqueeze(0)
        if self.processors:
            scores = self.processors(history.unsqueeze(0), scores)
        if self.greedy:
            return greedy_tokens(scores)[0]
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, num_samples=1, generator=self.generator))

    def select_all_greedy(self, logits: torch.Tensor) -> list[int]:
        """Argmax of every row at once: the fast path when no processor needs the history."""
        return greedy_tokens(logits)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, the first index on ties as torch.argmax. On the CPU numpy's takes ~3 us
    for a 49152-entry row where torch's takes ~60 us (~1 ms for a 16-node draft)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()
