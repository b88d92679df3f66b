"""The KV cache of every running request in one preallocated buffer, one slot (row) per request.

A step writes each request's new entries into its own slot right behind what the slot holds,
and attention reads them back from there, so one forward serves the whole batch with no
per-step copying of anyone's cache. Two layouts (see PoolStep): a ragged row, each request's
tokens one segment of it, and a batched block of k one-token rows (plain decoding of k
requests), whose requests must sit in slots 0..k-1 (`arrange`). Slots grow by doubling and are
compacted in place after verification: the accepted draft entries move right behind the prefix.

With a byte limit every allocation is checked before it is made, counting the buffers of its new
shape and the one old layer buffer a resize keeps alive beside them (`footprint`): the decoder
admits requests by the same count, so the pool never holds more than the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

INITIAL_LENGTH = 256


class KVCacheFull(RuntimeError):
    """An allocation would take the pool past its byte limit (nothing was allocated)."""


@dataclass(frozen=True)
class PoolStep:
    """Where one forward writes its new KV entries in the pool, and what attention reads.

    Ragged (`segments` [s, 3] of (slot, start, width), in feed order): the forward is one row of
    tokens, segment i's `width` of them; their entries go to [start, start + width) of its slot
    and it reads its slot up to there. The reads are laid side by side, so the attention mask is
    block-diagonal (runtime/step_inputs.py); the fast CPU path's layers attend segment by
    segment instead. Batched (`slots`, `positions` [k, q]): row i's entries go to [slots,
    :, positions] and attention reads slots [0, k) up to `read_length`. transformers' layers apply
    it through `write_and_read`; the fast CPU path's C++ layer stack (lookahead/cpu) applies the
    same object itself, and the tests hold the two to the same bits.

    A ragged step may also carry which of its segment's own tokens each row sees
    (`own_offsets`, `own_columns`: step_inputs.own_visibility). The fused C++ stack then reads
    each row's visible entries from these lists and needs no attention mask.
    """

    segments: torch.Tensor | None
    slots: torch.Tensor | None
    positions: torch.Tensor | None
    read_length: int
    own_offsets: torch.Tensor | None = None
    own_columns: torch.Tensor | None = None

    @classmethod
    def ragged(
        cls,
        slots: Sequence[int],
        starts: Sequence[int],
        widths: Sequence[int],
        own: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> PoolStep:
        rows = torch.tensor([list(row) for row in zip(slots, starts, widths)], dtype=torch.long)
        offsets, columns = own if own is not None else (None, None)
        return cls(rows, None, None, max(s + w for s, w in zip(starts, widths)), offsets, columns)

    @classmethod
    def batched(cls, starts: Sequence[int], width: int, device: torch.device) -> PoolStep:
        """Rows 0..k-1 in slots 0..k-1, row i writing `width` entries from starts[i] on."""
        first = torch.tensor(list(starts), device=device)[:, None]
        slots = torch.arange(len(starts), device=device)[:, None].expand(-1, width)
        return cls(None, slots, first + torch.arange(width, device=device), max(starts) + width)

    def segment_rows(self) -> list[tuple[int, int, int]]:
        """(slot, start, width) of each segment of a ragged step."""
        return [tuple(row) for row in self.segments.tolist()]

    def write_and_read(
        self, keys_buffer: torch.Tensor, values_buffer: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one layer's new keys and values [k, kv_heads, q, head_dim] into its pool buffers
        [slots, kv_heads, capacity, head_dim]; return what attention reads."""
        if self.segments is None:
            k = keys.shape[0]
            keys_buffer[self.slots, :, self.positions] = keys.transpose(1, 2)
            values_buffer[self.slots, :, self.positions] = values.transpose(1, 2)
            return keys_buffer[:k, :, : self.read_length], values_buffer[:k, :, : self.read_length]
        read_keys, read_values = [], []
        offset = 0
        for slot, start, width in self.segment_rows():
            keys_buffer[slot, :, start : start + width] = keys[0, :, offset : offset + width]
            values_buffer[slot, :, start : start + width] = values[0, :, offset : offset + width]
            read_keys.append(keys_buffer[slot : slot + 1, :, : start + width])
            read_values.append(values_buffer[slot : slot + 1, :, : start + width])
            offset += width
        if len(read_keys) == 1:
            return read_keys[0], read_values[0]
        return torch.cat(read_keys, 2), torch.cat(read_values, 2)


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
        self.twins: dict[type, object] = {}  # the step's C++ twin, built once per forward
        super().__init__(layers=[_SlotLayer(self, i) for i in range(len(pool.keys))])

    def twin(self, step_type: type) -> object:
        """The step as `step_type` (the fast CPU path's PoolStep), built once for all layers."""
        if step_type not in self.twins:
            step = self.step
            where = (step.segments, step.slots, step.positions, step.read_length)
            self.twins[step_type] = step_type(*where, step.own_offsets, step.own_columns)
        return self.twins[step_type]


@dataclass(frozen=True)
class KVLayout:
    """The shape of one position's entries in every layer: what the pool allocates."""

    heads: list[int]  # KV heads per layer
    head_dims: list[int]
    dtype: torch.dtype
    device: torch.device


def footprint(layout: KVLayout, slots: int, capacity: int) -> int:
    """Peak bytes of pool buffers of this shape: all of them, and one more layer buffer (a resize
    copies layer by layer, so at most one old buffer lives beside the new ones, whichever is the
    larger shape; an arrange swap or a pack copies less)."""
    size = torch.tensor([], dtype=layout.dtype).element_size()
    per_layer = [heads * dim * size for heads, dim in zip(layout.heads, layout.head_dims)]
    return slots * capacity * (2 * sum(per_layer) + max(per_layer))


class KVPool:
    def __init__(self, layout: KVLayout | None = None, limit_bytes: int = 0) -> None:
        self.layout = layout  # set by the decoder before the first admit
        self.limit_bytes = limit_bytes  # 0: none
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

    def slot_of(self, owner: object) -> int:
        return self.owners.index(owner)

    def admit(
        self,
        owner: object,
        keys: Sequence[torch.Tensor] = (),
        values: Sequence[torch.Tensor] = (),
        used: int = 0,
    ) -> int:
        """Give `owner` a free slot, holding the entries of a cached prefix (per layer
        [1, kv_heads, n, head_dim], or none); return the slot. `used`: the most entries any holder
        holds, all a new slot's resize keeps (the capacity a finished request left is given back).
        KVCacheFull, with nothing changed, when that goes past the limit."""
        length = keys[0].shape[2] if keys else 0
        if not self.keys:
            self._allocate(slots=1, capacity=max(INITIAL_LENGTH, pow2(length)))
        elif length > self.capacity:  # a growth: the holders first fill the free slots before them
            self.pack(used)
        slot = next((i for i, o in enumerate(self.owners) if o is None), None)
        if slot is None:
            slot = len(self.owners)
            self._resize(slots=slot + 1, capacity=max(INITIAL_LENGTH, pow2(max(used, length))))
        self.owners[slot] = owner  # held before reserve(), which keeps only held slots
        try:
            self.reserve(length)
        except KVCacheFull:
            self.owners[slot] = None
            raise
        for layer, (source_keys, source_values) in enumerate(zip(keys, values)):
            self.keys[layer][slot, :, :length] = source_keys[0]
            self.values[layer][slot, :, :length] = source_values[0]
        return slot

    def make_room(self, holders: int, used: int = 0) -> None:
        """At least `holders` free slots, in one allocation (admitting them one by one would copy
        the buffers once each). `used`: as for admit. KVCacheFull, with nothing changed, when that
        goes past the limit."""
        free = self.owners.count(None)
        if holders <= free:
            return
        if not self.keys:
            self._allocate(slots=holders, capacity=INITIAL_LENGTH)
        else:
            self._resize(slots=len(self.owners) + holders - free, capacity=max(INITIAL_LENGTH, pow2(used)))

    def release(self, owner: object) -> None:
        self.owners[self.owners.index(owner)] = None

    def prefix(self, slot: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the first `length` entries of a slot, per layer [1, kv_heads, length, head_dim]."""
        keys = [layer[slot : slot + 1, :, :length].clone() for layer in self.keys]
        values = [layer[slot : slot + 1, :, :length].clone() for layer in self.values]
        return keys, values

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
        """Make every held slot able to hold `length` entries (the free slots after the last held one
        are dropped). KVCacheFull, with nothing changed, when that goes past the limit."""
        if length > self.capacity:
            self._resize(slots=self._held_slots(), capacity=pow2(length))

    def pack(self, used: int) -> None:
        """Move the holders of the last slots into the free slots before them, so that the next
        growth allocates only held slots. Between steps only (slot numbers change); `used`: the
        most entries any holder holds."""
        while True:
            last = self._held_slots() - 1
            hole = next((i for i in range(last) if self.owners[i] is None), None)
            if hole is None:
                return
            for buffers in (self.keys, self.values):
                for layer in buffers:
                    layer[hole, :, :used] = layer[last, :, :used]
            self.owners[hole], self.owners[last] = self.owners[last], None

    def _held_slots(self) -> int:
        """Slots up to the last held one."""
        return max((i for i, owner in enumerate(self.owners) if owner is not None), default=-1) + 1

    def step_cache(self, step: PoolStep, past_length: int) -> StepCache:
        """A cache for one forward that writes and reads as `step` says."""
        self.reserve(step.read_length)
        return StepCache(self, step, past_length)

    def compact(self, moves: list[tuple[int, int, int]]) -> None:
        """Copy entries (slot, source position, target position), all sources read before any write."""
        if not moves:
            return
        slot, source, target = (torch.tensor(column, device=self.keys[0].device) for column in zip(*moves))
        for buffers in (self.keys, self.values):
            for layer in buffers:
                layer[slot, :, target] = layer[slot, :, source]

    def _check(self, slots: int, capacity: int) -> None:
        if self.layout is None:
            raise RuntimeError("the pool's layout must be set before the first admit")
        needed = footprint(self.layout, slots, capacity)
        if self.limit_bytes and needed > self.limit_bytes:
            raise KVCacheFull(
                f"{slots} KV slots of {capacity} entries need {needed} bytes, more than the "
                f"{self.limit_bytes} of kv_cache_bytes"
            )

    def _allocate(self, slots: int, capacity: int) -> None:
        self._check(slots, capacity)
        layout = self.layout
        for heads, dim in zip(layout.heads, layout.head_dims):
            for buffers in (self.keys, self.values):
                buffers.append(
                    torch.zeros(slots, heads, capacity, dim, dtype=layout.dtype, device=layout.device)
                )
        self.owners = [None] * slots

    def _resize(self, slots: int, capacity: int) -> None:
        """New buffers of this shape holding what fits of the old ones (callers drop free slots only)."""
        self._check(slots, capacity)
        kept_slots, kept = min(slots, len(self.owners)), min(capacity, self.capacity)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_zeros(slots, old.shape[1], capacity, old.shape[3])
                new[:kept_slots, :, :kept] = old[:kept_slots, :, :kept]
                buffers[i] = new
        self.owners = self.owners[:slots] + [None] * (slots - len(self.owners))


def accepted_moves(slot: int, root: int, accepted_nodes: Sequence[int]) -> list[tuple[int, int, int]]:
    """KV moves (slot, from, to) that put the accepted nodes of a draft whose root sits at position
    `root` right behind it; none when they are the draft's first branch, already in place."""
    return [
        (slot, root + node, root + 1 + depth)
        for depth, node in enumerate(accepted_nodes)
        if node != depth + 1
    ]


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())
