"""Token selection with vLLM's sampling semantics, exact at every node of a draft tree.

A node's choice depends on the tokens before it (penalties, min_tokens), so verification hands
each node its own path: the draft tokens between the request's committed tokens and the node.
The selector keeps the committed part itself (counts of the output, the prompt's tokens), so a
node costs one pass over its logits whatever the length of the history. Sampling draws exactly
one multinomial sample per emitted token from a per-request generator, so a seeded lookahead run
emits the same tokens as a seeded plain run: speculation changes how many forwards it takes,
never what is sampled. A structured-output grammar masks each node's row with the grammar state
reached along that node's own path, so constrained output is plain constrained decoding's too.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

import torch

from ..config import SamplingParams
from ..structured import GrammarMatcher


class TokenSelector:
    """Chooses the next token from one position's logits, for one request.

    stop_ids: the ids min_tokens keeps out (EOS and stop_token_ids, as vLLM masks them).
    grammar: the request's structured-output matcher, if it has one.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        stop_ids: Sequence[int],
        device: torch.device,
        grammar: GrammarMatcher | None = None,
    ):
        self.params = params
        self.grammar = grammar
        self.greedy = params.greedy
        self.device = device
        self.output_len = 0
        self.suppressed = (
            torch.tensor(sorted(set(stop_ids)), device=device) if params.min_tokens and stop_ids else None
        )
        self.bias = None
        if params.logit_bias:
            ids, values = zip(*sorted(params.logit_bias.items()))
            self.bias = (torch.tensor(ids, device=device), torch.tensor(values, device=device))
        self.prompt_ids = list(prompt_ids) if params.repetition_penalty != 1 else []
        self.counts: torch.Tensor | None = None  # [vocab] output token counts, built on first use
        self.seen: torch.Tensor | None = None  # [vocab] in the prompt or the output
        self.pending: list[int] = []  # committed tokens not yet in counts/seen
        self.generator = None
        if not self.greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self.generator = torch.Generator(device=device).manual_seed(seed)

    @property
    def needs_path(self) -> bool:
        """Whether a node's choice depends on more than its own logits (so it cannot be batched)."""
        masking = self.suppressed is not None and self.output_len < self.params.min_tokens
        constrained = self.grammar is not None
        return masking or constrained or self.bias is not None or self.params.penalized or not self.greedy

    def commit(self, tokens: Sequence[int]) -> None:
        """Tokens appended to the request's output."""
        self.output_len += len(tokens)
        if self.grammar is not None:
            self.grammar.commit(tokens)
        if self.params.penalized:
            self.pending.extend(tokens)

    def select(self, path: Sequence[int], logits: torch.Tensor) -> int:
        """Pick the token after the committed tokens and `path` (the draft tokens since them) from
        `logits` ([vocab]) of that position."""
        scores = self.process(path, logits)
        if self.greedy:
            return int(scores.argmax())
        return int(torch.multinomial(self.warp(scores).softmax(-1), 1, generator=self.generator))

    def greedy_choices(self, logits: torch.Tensor) -> Callable[[int], int]:
        """Each row's argmax, by row index: the fast path when no processor reads the path."""
        return greedy_choices(logits)

    def process(self, path: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """The logits after the grammar, min_tokens, logit_bias and the penalties, in vLLM's order
        (float32). Where the grammar permits only what min_tokens keeps out (its end), it wins."""
        params = self.params
        scores = logits.float().clone()
        allowed = self.grammar.allowed(path, scores.device) if self.grammar is not None else None
        if allowed is not None:
            scores.masked_fill_(~allowed, -float("inf"))
        if self.suppressed is not None and self.output_len + len(path) < params.min_tokens:
            if allowed is None or allowed.clone().index_fill_(0, self.suppressed, False).any():
                scores[self.suppressed] = -float("inf")
        if self.bias is not None:
            scores.index_add_(0, self.bias[0], self.bias[1])
        if params.penalized:
            counts, seen = self._history(path, scores.shape[-1])
            if params.repetition_penalty != 1:
                penalty = params.repetition_penalty
                scores = torch.where(
                    seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores
                )
            if params.frequency_penalty:
                scores -= params.frequency_penalty * counts
            if params.presence_penalty:
                scores -= params.presence_penalty * (counts > 0).float()
        return scores

    def warp(self, scores: torch.Tensor) -> torch.Tensor:
        """Sampling's transforms of processed logits: temperature, min_p, top_k, top_p."""
        params = self.params
        scores = scores / params.temperature
        if params.min_p > 0:
            probs = scores.softmax(-1)
            scores = scores.masked_fill(probs < params.min_p * probs.max(), -float("inf"))
        if params.top_k and params.top_k < scores.shape[-1]:
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, -float("inf"))
        if params.top_p < 1:
            ordered, order = scores.sort()
            removed = ordered.softmax(-1).cumsum(-1) <= 1 - params.top_p
            removed[-1] = False
            scores = scores.masked_fill(torch.zeros_like(removed).scatter(0, order, removed), -float("inf"))
        return scores

    def _history(self, path: Sequence[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(output token counts, prompt-or-output mask) of the committed tokens plus `path`."""
        if self.counts is None:
            self.counts = torch.zeros(vocab, device=self.device)
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            if self.prompt_ids:
                self.seen[torch.tensor(self.prompt_ids, device=self.device)] = True
        if self.pending:
            self._add(self.counts, self.seen, self.pending)
            self.pending = []
        if not path:
            return self.counts, self.seen
        counts, seen = self.counts.clone(), self.seen.clone()
        self._add(counts, seen, path)
        return counts, seen

    def _add(self, counts: torch.Tensor, seen: torch.Tensor, tokens: Sequence[int]) -> None:
        ids = torch.tensor(list(tokens), device=self.device)
        counts.index_add_(0, ids, torch.ones(len(ids), device=self.device))
        seen[ids] = True


def greedy_choices(logits: torch.Tensor) -> Callable[[int], int]:
    """Row k's argmax for any k, the first index on ties as torch.argmax. On the CPU each row's
    argmax is taken when asked (verification asks only along the accepted branch, and a row costs
    a read of the whole vocabulary's logits); elsewhere every row's at once, in one call."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        rows = logits.numpy()
        return lambda row: int(rows[row].argmax())
    return logits.argmax(-1).tolist().__getitem__
