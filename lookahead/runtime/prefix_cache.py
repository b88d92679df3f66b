"""KV entries of recent prompts, so that a prompt sharing a prefix with one of them prefills only the rest.

Chat requests share at least their template's system prompt (24 tokens for the default model,
a quarter to a third of a short question), and a conversation's next turn repeats the whole
previous one, the assistant's answer included: a finished request leaves its prompt and its
output here. A prefill is bound by arithmetic, so every token found here is one the model does
not recompute. Entries are whole token sequences, least recently used dropped first, within a
bound on the KV positions held (an entry whose tokens begin a new one's is dropped for it); a
lookup takes the longest common prefix with any of them.
A running request's prompt is shared without a copy: its entry reads the request's own pool slot
(`share`) until the request leaves (`release`), when it becomes a copy, unless the request's
prompt and output replaced it; only copies count toward the bound.
Logits over a cached prefix equal those over a recomputed one up to the attention kernel's
summation order, which depends on how many rows it is fed (~1e-7 relative, as between a plain
prefill and the decoder's own steps; tests/unit/runtime/test_prefix_cache.py).

A request with `learn` off leaves no trace here (the decoder stores no prompt of it, and its
lookups do not refresh an entry's place): what it reads is what any client can read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

KV = tuple[list[torch.Tensor], list[torch.Tensor]]  # keys and values, per layer [1, kv_heads, n, head_dim]


@dataclass(frozen=True)
class _Entry:
    tokens: torch.Tensor  # [n] prompt ids
    keys: list[torch.Tensor]  # per layer [1, kv_heads, >= n, head_dim]; entries past n unused
    values: list[torch.Tensor]

    @property
    def held(self) -> int:
        return self.keys[0].shape[-2] if self.keys else 0

    def read(self, n: int) -> KV:
        return [keys[:, :, :n] for keys in self.keys], [values[:, :, :n] for values in self.values]


@dataclass(frozen=True)
class _Shared:
    """A running request's prompt, read from its pool slot: `read(n)` copies its first n entries."""

    tokens: torch.Tensor
    holder: object
    read: Callable[[int], KV]
    held = 0  # its KV is the request's own


class PrefixCache:
    """At most `capacity` KV positions (0 disables it)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, ...], _Entry | _Shared] = OrderedDict()
        self._held = 0

    @property
    def tokens(self) -> int:
        """KV positions held in copies (the prompts' and whatever else their tensors hold)."""
        return self._held

    def lookup(self, prompt: list[int]) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
        """(n, keys, values) of prompt[:n] for the longest n found (per layer [1, kv_heads, n,
        head_dim]), at most len(prompt) - 1 (the last prompt token is always fed, for its
        logits); n = 0 and no tensors on a miss. The entry found becomes the most recent."""
        if not self._entries or len(prompt) < 2:
            return 0, [], []
        query = torch.tensor(prompt[:-1])
        best, found = None, 0
        for key, entry in self._entries.items():
            length = min(len(query), len(entry.tokens))
            differs = (query[:length] != entry.tokens[:length]).nonzero()
            common = int(differs[0]) if len(differs) else length
            if common > found:
                best, found = key, common
        if best is None:
            return 0, [], []
        self._entries.move_to_end(best)
        return (found, *self._entries[best].read(found))

    def holds(self, prompt: list[int]) -> bool:
        return tuple(prompt) in self._entries

    def store(self, prompt: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Hold the KV of `prompt`: the first len(prompt) entries of keys and values (per layer
        [1, kv_heads, >= len(prompt), head_dim]; not copied: the caller must not write to them)."""
        entry = _Entry(torch.tensor(prompt), list(keys), list(values))
        if entry.held <= self.capacity:
            self._add(tuple(prompt), entry)

    def share(self, prompt: list[int], holder: object, copy: Callable[[int], KV]) -> None:
        """Let later prompts find `prompt`, whose KV `holder` holds while it runs: copy(n) copies
        its first n entries (per layer [1, kv_heads, n, head_dim]). Until `release(holder)`."""
        if len(prompt) <= self.capacity:
            self._add(tuple(prompt), _Shared(torch.tensor(prompt), holder, copy))

    def release(self, holder: object) -> None:
        """`holder` leaves: each prompt it shares that is still here becomes a copy."""
        for key in [
            k for k, entry in self._entries.items() if isinstance(entry, _Shared) and entry.holder is holder
        ]:
            shared = self._entries.pop(key)
            self.store(list(key), *shared.read(len(key)))

    def _add(self, key: tuple[int, ...], entry: _Entry | _Shared) -> None:
        if key in self._entries:
            return
        # An entry holding a prefix of this one is subsumed by it: a finished request's prompt
        # and output replace its prompt's entry.
        for shorter in [k for k in self._entries if len(k) < len(key) and key[: len(k)] == k]:
            self._held -= self._entries.pop(shorter).held
        while self._held + entry.held > self.capacity:
            _, dropped = self._entries.popitem(last=False)
            self._held -= dropped.held
        self._entries[key] = entry
        self._held += entry.held
