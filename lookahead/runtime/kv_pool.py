"""The KV cache of every running request in one preallocated buffer, one slot (row) per request.

A decoding step feeds k requests at once: request i's q new tokens are written at
[len_i, len_i + q) of its own slot and attention reads slots [0, k) up to the longest length,
so one forward serves the whole batch with no per-step copying of anyone's cache. Slots are
kept in step order (a swap when membership changes), grown by doubling, and compacted in place
after verification: the accepted draft entries move right behind the request's prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

_INITIAL_LENGTH = 256


@dataclass(frozen=True)
class PoolStep:
    """Where one forward writes its new KV entries in the pool, and how far attention reads.

    One request (`slots` is None): its q new entries go to [start, start + q) of slot 0. A batch
    of k requests: row i's entries go to [slots, :, positions] (both [k, q], slot i from its own
    length on). Attention then reads slots [0, k) up to `read_length`. transformers' layers
    apply it through `write_and_read`; the fast CPU path's C++ layer stack (lookahead/cpu)
    applies the same object itself, and the tests hold the two to the same bits.
    """

    start: int
    slots: torch.Tensor | None
    positions: torch.Tensor | None
    read_length: int

    def write_and_read(
        self, keys_buffer: torch.Tensor, values_buffer: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one layer's new keys and values [k, kv_heads, q, head_dim] into its pool buffers
        [slots, kv_heads, capacity, head_dim]; return what attention reads."""
        k = keys.shape[0]
        if self.slots is None:
            written = slice(self.start, self.start + keys.shape[2])
            keys_buffer[0, :, written] = keys[0]
            values_buffer[0, :, written] = values[0]
        else:
            keys_buffer[self.slots, :, self.positions] = keys.transpose(1, 2)
            values_buffer[self.slots, :, self.positions] = values.transpose(1, 2)
        return keys_buffer[:k, :, : self.read_length], values_buffer[:k, :, : self.read_length]


class _SlotLayer(DynamicLayer):
    """What one attention layer sees during a pooled forward: write the new K/V, read the batch."""

    def __init__(self, cache: StepCache, index: int):
        super().__init__()
        self.cache, self.index = cache, index
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        pool = self.cache.pool
        return self.cache.step.write_and_read(
            pool.keys[self.index], pool.values[self.index], key_states, value_states
        )

    def get_seq_length(self) -> int:
        return self.cache.past_length


class StepCache(Cache):
    """The pool as one forward's cache: `step` says where this forward writes and reads."""

    def __init__(self, pool: KVPool, step: PoolStep, past_length: int):
        self.pool, self.step, self.past_length = pool, step, past_length
        super().__init__(layers=[_SlotLayer(self, i) for i in range(len(pool.keys))])


class KVPool:
    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []  # per layer [slots, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.owners: list[object | None] = []

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold."""
        return sum(buffer.nbytes for buffers in (self.keys, self.values) for buffer in buffers)

    @property
    def idle(self) -> bool:
        """Buffers allocated, and no request holding a slot."""
        return bool(self.keys) and all(owner is None for owner in self.owners)

    def free(self) -> None:
        """Drop the buffers (the next admit allocates them again, as small as it needs)."""
        self.keys, self.values, self.owners = [], [], []

    def shrink(self, capacity: int) -> None:
        """Drop the free slots after the last one held and shorten every slot to `capacity` entries
        (at least what any holder has written: the caller knows the lengths)."""
        slots = max((i for i, owner in enumerate(self.owners) if owner is not None), default=-1) + 1
        capacity = pow2(capacity)
        if slots == len(self.owners) and capacity >= self.capacity:
            return
        capacity = min(capacity, self.capacity)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                buffers[i] = old[:slots, :, :capacity].clone()
        del self.owners[slots:]

    def admit(self, owner: object, cache: DynamicCache) -> int:
        """Give `owner` a free slot holding the prefill KV in `cache`; return the slot."""
        length = cache.get_seq_length()
        if not self.keys:
            self._allocate(cache, slots=1, capacity=max(_INITIAL_LENGTH, pow2(length)))
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
            self._resize(slots=len(self.owners), capacity=pow2(length))

    def step_cache(self, lengths: list[int], q: int) -> StepCache:
        """A cache for one forward of q tokens per slot 0..k-1, slot i writing at lengths[i]."""
        read_length = max(lengths) + q
        self.reserve(read_length)
        if len(lengths) == 1:  # one request: a slice copy, a third of an index_put's overhead
            step = PoolStep(lengths[0], None, None, read_length)
        else:
            device = self.keys[0].device
            starts = torch.tensor(lengths, device=device)
            slots = torch.arange(len(lengths), device=device)[:, None].expand(-1, q)
            step = PoolStep(0, slots, starts[:, None] + torch.arange(q, device=device), read_length)
        return StepCache(self, step, max(lengths))

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


def accepted_moves(slot: int, length: int, accepted_nodes: Sequence[int]) -> list[tuple[int, int, int]]:
    """KV moves (slot, from, to) that put the accepted nodes of a draft fed after `length` cached
    entries right behind them; none when they are the draft's first branch, already in place."""
    return [
        (slot, length + node, length + 1 + depth)
        for depth, node in enumerate(accepted_nodes)
        if node != depth + 1
    ]


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())
