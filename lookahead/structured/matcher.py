"""One request's grammar state along every branch of its draft tree.

The matcher holds the state after the request's committed tokens; a draft node's state is that
state advanced by the node's own path (the draft tokens from the root to it), never by another
branch. `admits` answers retrieval's search node by node (a node the grammar forbids is never
drafted), `forced` gives the text the grammar fixes next (drafted as certain), `allowed` the
tokens permitted after a path (every verified node's row, the bonus token's included), `commit`
advances by what the request emitted. Paths are followed by rolling back to the longest common
prefix and consuming the rest, so a question about a node next to the last one costs one
rollback and one consume.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .compiler import CompiledGrammar, error_reason


class GrammarLimitError(ValueError):
    """The constraint cannot go on: llguidance's matcher stopped with an error (a grammar that outgrew
    the parser limits mid-generation). The request that holds it fails; the others go on."""


@dataclass
class GrammarStats:
    """Where the grammar's time goes, for benchmarks: masks computed, draft nodes checked."""

    masks: int = 0
    mask_seconds: float = 0.0
    checked_nodes: int = 0
    pruned_nodes: int = 0
    prune_seconds: float = 0.0


class GrammarMatcher:
    """The grammar of one request (not thread-safe: the engine thread owns it)."""

    def __init__(self, compiled: CompiledGrammar, vocab_size: int, name: str = "structured_outputs"):
        self._matcher = compiled.matcher()
        self.name = name  # the request key of the constraint, for errors
        self._vocab_size = vocab_size
        self._path: list[int] = []  # draft tokens consumed beyond the committed ones
        self.stats = GrammarStats()

    def admits(self, path: Sequence[int]) -> bool:
        """Whether the grammar accepts the draft path `path` after the committed tokens, every token
        but the last already admitted (retrieval asks as it searches the draft tree)."""
        started = time.perf_counter()
        self._follow(path[:-1])
        admitted = self._matcher.try_consume_tokens([path[-1]]) == 1
        if admitted:
            self._path.append(path[-1])
        self.stats.checked_nodes += 1
        self.stats.pruned_nodes += not admitted
        self.stats.prune_seconds += time.perf_counter() - started
        return admitted

    def forced(self) -> list[int]:
        """The tokens the grammar forces after the committed ones, in the tokenizer's canonical
        split of the forced text (the model may split it otherwise: they are drafts, verified)."""
        self._follow([])
        if self._matcher.is_stopped():
            return []
        return list(self._matcher.compute_ff_tokens())

    def allowed(self, path: Sequence[int], device: torch.device) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar permits after the committed tokens and `path`."""
        started = time.perf_counter()
        self._follow(path)
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        if self._matcher.is_error():
            raise self._failure()
        mask = np.unpackbits(bits, bitorder="little")[: self._vocab_size].view(np.bool_)
        self.stats.masks += 1
        self.stats.mask_seconds += time.perf_counter() - started
        return torch.from_numpy(mask).to(device)

    def commit(self, tokens: Sequence[int]) -> None:
        """Tokens appended to the output. Once the grammar is complete only its end (EOS) may follow,
        which changes nothing (with ignore_eos the output goes on with EOS up to max_tokens)."""
        self._follow([])
        for token in tokens:
            if self._matcher.is_stopped():
                break
            if not self._matcher.consume_token(token):
                raise self._failure(f"token {token} refused")

    def _follow(self, path: Sequence[int]) -> None:
        """Put the matcher in the state after `path`, whose every token the grammar accepts."""
        common = 0
        for mine, theirs in zip(self._path, path):
            if mine != theirs:
                break
            common += 1
        if common < len(self._path):
            self._matcher.rollback(len(self._path) - common)
            del self._path[common:]
        for token in path[common:]:
            if not self._matcher.consume_token(token):
                raise self._failure(f"draft token {token} refused")
            self._path.append(token)

    def _failure(self, what: str = "") -> GrammarLimitError:
        reason = error_reason(self._matcher.get_error())
        return GrammarLimitError(f"{self.name}: {what + ': ' if what else ''}{reason}")
