"""The KV cache of every running request in one preallocated buffer, one slot (row) per request.

A decoding step feeds k requests at once: request i's q new tokens are written at
[len_i, len_i + q) of its own slot and attention reads slots [0, k) up to the longest length,
so one forward serves the whole batch with no per-step copying of anyone's cache. Slots are
kept in step order (a swap when membership changes), grown by doubling, and compacted in place
after verification: the accepted draft entries move right behind the request's prefix.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

_INITIAL_LENGTH = 256


class _SlotLayer(DynamicLayer):
    """What one attention layer sees during a pooled forward: write the new K/V, read the batch."""

    def __init__(self, pool: KVPool, index: int):
        super().__init__()
        self.pool, self.index = pool, index
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.pool.write_and_read(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.pool.past_length


class StepCache(Cache):
    """The pool as one forward's cache. transformers' layers call update() layer by layer; the
    lean layers (lean_layers.py) write and read the pool's buffers themselves."""

    def __init__(self, pool: KVPool):
        super().__init__(layers=[_SlotLayer(pool, i) for i in range(len(pool.keys))])
        self.pool = pool


class KVPool:
    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []  # per layer [slots, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.owners: list[object | None] = []
        self.past_length = 0
        # Where the current step writes: from write_start in slot 0 (one request), else at
        # [write_slots, :, write_positions] (both [k, q]); attention reads up to read_length.
        self.write_start = 0
        self.write_slots: torch.Tensor | None = None
        self.write_positions: torch.Tensor | None = None
        self.read_length = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def admit(self, owner: object, cache: DynamicCache) -> int:
        """Give `owner` a free slot holding the prefill KV in `cache`; return the slot."""
        length = cache.get_seq_length()
        if not self.keys:
            self._allocate(cache, slots=1, capacity=max(_INITIAL_LENGTH, _pow2(length)))
        slot = next((i for i, o in enumerate(self.owners) if o is None), None)
        if slot is None:
            slot = len(self.owners)
            self._resize(slots=slot + 1, capacity=self.capacity)
        self.reserve(length)
        for layer, source in enumerate(cache.layers):
            self.keys[layer][slot, :, :length] = source.keys[0]
            self.values[layer][slot, :, :length] = source.values[0]
        self.owners[slot] = owner
        return slot

    def release(self, owner: object) -> None:
        self.owners[self.owners.index(owner)] = None

    def arrange(self, owners: list[object], used: int) -> list[object]:
        """Put `owners` into slots 0..k-1 moving as few as possible; return them in slot order.

        Only owners sitting at slot k or above move, each into a slot that is free or held by a
        request outside this batch (then swapped whole). `used`: the most entries any of the
        owners holds, all that moves into a free slot.
        """
        k = len(owners)
        batch = {id(owner) for owner in owners}
        movers = [owner for owner in owners if self.owners.index(owner) >= k]
        targets = [slot for slot in range(k) if id(self.owners[slot]) not in batch]
        for owner, position in zip(movers, targets):
            current, displaced = self.owners.index(owner), self.owners[position]
            for buffers in (self.keys, self.values):
                for layer in buffers:
                    if displaced is None:
                        layer[position, :, :used] = layer[current, :, :used]
                    else:
                        layer[[position, current]] = layer[[current, position]]
            self.owners[position], self.owners[current] = owner, displaced
        return self.owners[:k]

    def reserve(self, length: int) -> None:
        """Make every slot able to hold `length` entries."""
        if length > self.capacity:
            self._resize(slots=len(self.owners), capacity=_pow2(length))

    def step_cache(self, lengths: list[int], q: int) -> StepCache:
        """A cache for one forward of q tokens per slot 0..k-1, slot i writing at lengths[i]."""
        if len(lengths) == 1:  # one request: a slice copy, a third of an index_put's overhead
            self.write_start, self.write_slots, self.write_positions = lengths[0], None, None
        else:
            device = self.keys[0].device
            starts = torch.tensor(lengths, device=device)
            self.write_slots = torch.arange(len(lengths), device=device)[:, None].expand(-1, q)
            self.write_positions = starts[:, None] + torch.arange(q, device=device)
        self.read_length = max(lengths) + q
        self.past_length = max(lengths)
        self.reserve(self.read_length)
        return StepCache(self)

    def write_and_read(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        k = keys.shape[0]
        if self.write_slots is None:
            written = slice(self.write_start, self.write_start + keys.shape[2])
            self.keys[layer][0, :, written] = keys[0]
            self.values[layer][0, :, written] = values[0]
        else:
            self.keys[layer][self.write_slots, :, self.write_positions] = keys.transpose(1, 2)
            self.values[layer][self.write_slots, :, self.write_positions] = values.transpose(1, 2)
        return self.keys[layer][:k, :, : self.read_length], self.values[layer][:k, :, : self.read_length]

    def compact(self, moves: list[tuple[int, int, int]]) -> None:
        """Copy entries (slot, source position, target position), all sources read before any write."""
        if not moves:
            return
        slot, source, target = (torch.tensor(column, device=self.keys[0].device) for column in zip(*moves))
        for buffers in (self.keys, self.values):
            for layer in buffers:
                layer[slot, :, target] = layer[slot, :, source]

    def _allocate(self, cache: DynamicCache, slots: int, capacity: int) -> None:
        for source in cache.layers:
            _, heads, _, dim = source.keys.shape
            self.keys.append(source.keys.new_zeros(slots, heads, capacity, dim))
            self.values.append(source.values.new_zeros(slots, heads, capacity, dim))
        self.owners = [None] * slots

    def _resize(self, slots: int, capacity: int) -> None:
        old_slots, old_capacity = len(self.owners), self.capacity
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_zeros(slots, old.shape[1], capacity, old.shape[3])
                new[:old_slots, :, :old_capacity] = old
                buffers[i] = new
        self.owners += [None] * (slots - old_slots)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
