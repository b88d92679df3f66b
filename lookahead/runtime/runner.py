"""The model's side of a step: every forward, the KV pool and the prefix cache.

`ModelRunner.forward_segments` feeds the step's segments (prompt chunks and/or roots with their
drafts) as one ragged row over the KV pool, or, when every segment is a lone root, as a [k, 1]
block (plain batched decoding). It writes the segments' KV entries and commits nothing; the
decoder verifies, then moves the accepted entries (`compact`). A request's slot is given when it
is admitted, holding whatever prefix of its prompt the prefix cache has.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from ..algorithm.draft import Draft
from .core_budget import CoreBudget
from .generation import Generation
from .kv_pool import INITIAL_LENGTH, KVCacheFull, KVLayout, KVPool, PoolStep, accepted_moves, footprint, pow2
from .output_layer import plain_output_layer
from .prefix_cache import PrefixCache
from .step_inputs import (
    AttentionMasks,
    Segment,
    decode_inputs,
    own_visibility,
    ragged_inputs,
    ragged_tokens,
    to_device,
)

# Prompt positions whose logits exist at once when prompt logprobs are scored (rows x vocab floats).
SCORED_ROWS = 256
# `time_widths`: the cached entries each timed forward reads, and the widest forward timed.
PROBE_CONTEXT = 128
PROBE_WIDEST = 128
# `time_context`: the longer context it times beside PROBE_CONTEXT, and the rows of its wider forward.
PROBE_LONG_CONTEXT = 1024 + PROBE_CONTEXT
PROBE_ROWS = 8


class _Probe:
    """The owner of a pool slot fed outside any request (the pool reads only its `ids`)."""

    def __init__(self, length: int):
        self.ids = [0] * length


@dataclass
class Work:
    """One generation's part of a forward: its segment, and whether its prompt chunk is scored."""

    gen: Generation
    segment: Segment
    scoring: bool = False  # its prompt chunk's logits go to gen.score_prompt (prompt logprobs)


class ModelRunner:
    """Runs one model's forwards for a decoder, over a KV pool of at most kv_cache_bytes (0: no
    bound) holding kv_cache_dtype entries (config.KV_CACHE_DTYPES) and a prefix cache of
    prefix_cache_tokens positions (0: none); `core_budget`, where given, sizes each forward's
    thread team to the free cores."""

    def __init__(
        self,
        model: Any,
        *,
        prefix_cache_tokens: int,
        kv_cache_bytes: int,
        kv_cache_dtype: str = "model",
        core_budget: CoreBudget | None = None,
    ):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = model.dtype  # a property that walks every parameter: read once
        self.masks = AttentionMasks(model.config, self.dtype)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.context_length: int | None = getattr(model.config, "max_position_embeddings", None)
        self.kv_cache_bytes = kv_cache_bytes
        self.pool = KVPool(limit_bytes=kv_cache_bytes)
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        # With a plain output layer, forwards run the decoder and the layer apart (fewer wrappers,
        # and no logits for padding rows).
        self.head_of_hidden = plain_output_layer(model)
        self.inner = model.get_decoder() if self.head_of_hidden is not None else None
        self.half_pool = kv_cache_dtype == "float16"
        if self.half_pool and not getattr(self.inner, "reads_half_pool", False):
            raise ValueError(
                "kv_cache_dtype float16 needs the integer path's fused layers (linear_kernel auto or "
                "integer, on an x86-64 CPU with AVX2 or AVX-512) and their load check on a pool of "
                "halves; this model runs without them: use kv_cache_dtype model"
            )
        self._kv_layout: KVLayout | None = None
        self.core_budget = core_budget

    @property
    def kv_layout(self) -> KVLayout:
        """Every layer's KV heads and head size (read once off a one-token forward)."""
        if self._kv_layout is None:
            cache = DynamicCache()
            with torch.inference_mode():
                self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), cache=cache)
            layers = [layer for layer in cache.layers if layer.keys is not None]
            self._kv_layout = KVLayout(
                [layer.keys.shape[1] for layer in layers],
                [layer.keys.shape[3] for layer in layers],
                torch.float16 if self.half_pool else layers[0].keys.dtype,
                layers[0].keys.device,
            )
        return self._kv_layout

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one position's keys and values over all layers."""
        layout = self.kv_layout
        size = torch.tensor([], dtype=layout.dtype).element_size()
        return sum(2 * heads * dim * size for heads, dim in zip(layout.heads, layout.head_dims))

    def kv_bytes(self, longest: Sequence[int]) -> int:
        """Peak bytes of the KV pool holding requests that hold at most these many entries each,
        its growth's transient copy included (the pool refuses to go past kv_cache_bytes by the same
        count)."""
        if not longest:
            return 0
        return footprint(self.kv_layout, len(longest), max(INITIAL_LENGTH, pow2(max(longest))))

    def fits(self, longest: Sequence[int]) -> bool:
        """Whether requests holding at most these many entries each fit within kv_cache_bytes."""
        return not self.kv_cache_bytes or self.kv_bytes(longest) <= self.kv_cache_bytes

    def held_entries(self) -> int:
        """The most KV entries any running request holds between steps."""
        return max((len(gen.ids) for gen in self.pool.owners if gen is not None), default=0)

    def _lay_out_pool(self) -> None:
        """Give the pool the model's KV layout before its first slot (the model's first forward
        tells it)."""
        if self.pool.layout is None:
            self.pool.layout = self.kv_layout

    def pack(self) -> None:
        """The running requests in the first slots, so that a growth allocates only theirs
        (kv_cache_bytes counts running requests); between steps only (slot numbers change)."""
        self.pool.pack(self.held_entries())

    def make_room(self, newcomers: int) -> None:
        """Slots for this many new generations, allocated at once where the KV bound allows (else
        each admission grows the pool, or is refused, on its own)."""
        self._lay_out_pool()
        try:
            self.pool.make_room(newcomers, used=self.held_entries())
        except KVCacheFull:
            pass

    def admit(self, gen: Generation, use_prefix_cache: bool) -> int:
        """Give a new generation a pool slot holding whatever prefix of its prompt the prefix cache
        has (only where `use_prefix_cache`); return that prefix's length."""
        self._lay_out_pool()
        cached, keys, values = self.prefix_cache.lookup(gen.ids) if use_prefix_cache else (0, [], [])
        self.pool.admit(gen, keys, values, used=self.held_entries())
        return cached

    def admit_after(self, gen: Generation, leader: Generation) -> int:
        """Give a new sample a pool slot holding its leader's prompt entries (the same prompt, all
        but its last token, which the sample feeds as its first root); return their count."""
        self._lay_out_pool()
        keys, values = self.pool.prefix(self.pool.slot_of(leader), leader.root)
        self.pool.admit(gen, keys, values, used=self.held_entries())
        return leader.root

    def slot_of(self, gen: Generation) -> int:
        """The pool slot an admitted generation holds (until the next `pack`)."""
        return self.pool.slot_of(gen)

    def keep_accepted(self, verified: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        """Move each verified segment's accepted entries right behind its prefix: (slot, entries
        before the draft's root, accepted draft nodes) per segment."""
        self.pool.compact(
            [move for slot, root, nodes in verified for move in accepted_moves(slot, root, nodes)]
        )

    def release(self, gen: Generation) -> None:
        """Give a generation's slot back (a prompt it shares is copied out first)."""
        self.prefix_cache.release(gen)
        self.pool.release(gen)

    def share_prompt(self, gen: Generation, prompt: list[int]) -> None:
        """Let later prompts find a running generation's read prompt (the first len(prompt)
        entries of its slot), copied only when one does, or when the generation leaves."""
        if not self.prefix_cache.holds(prompt):
            self.prefix_cache.share(prompt, gen, lambda n: self.pool.prefix(self.pool.slot_of(gen), n))

    def keep_prompt(self, prompt: list[int], slot: int) -> None:
        """Keep a copy of a slot's first len(prompt) entries, the KV of `prompt`, for later prompts
        sharing a prefix, where the prefix cache has room and does not hold it yet."""
        if not self.prefix_cache.capacity or len(prompt) > self.prefix_cache.capacity:
            return
        if self.prefix_cache.holds(prompt):
            return
        self.prefix_cache.store(prompt, *self.pool.prefix(slot, len(prompt)))

    def release_idle(self) -> None:
        """Give memory back when no request runs."""
        if self.pool.idle:
            self.pool.free()

    def size_team(self) -> int:
        """Size the calling thread's team for its next forwards (the core budget, where there is
        one) and return its size: a step picks the cost curve of the team that will run it."""
        if self.core_budget is not None:
            self.core_budget.apply()
        return torch.get_num_threads()

    def forward_segments(self, works: list[Work]) -> list[torch.Tensor | None]:
        """Logits of each segment's draft rows [len(draft), vocab] (None for a chunk without one);
        scored prompt chunks hand their rows' logits to their generation.

        Writes the segments' KV entries but commits nothing, so the same call can be repeated.
        """
        if self.core_budget is not None:
            self.core_budget.apply()
        segments = [work.segment for work in works]
        if len(segments) > 1 and all(s.width == 1 and s.draft is not None for s in segments):
            return self._forward_batched(works)
        slots, starts = [s.slot for s in segments], [s.start for s in segments]
        widths = [s.width for s in segments]
        if self.reads_row_lists:  # what each row sees goes with the step: no [N, sum of reads] mask
            ids, positions = ragged_tokens(segments)
            mask = None
            step = PoolStep.ragged(slots, starts, widths, own_visibility(segments))
        else:
            ids, positions, mask = ragged_inputs(segments, self.masks)
            step = PoolStep.ragged(slots, starts, widths)
        inputs = {
            "input_ids": ids.to(self.device),
            "position_ids": positions.to(self.device),
            "attention_mask": None if mask is None else to_device(mask, self.device),
            "cache": self.pool.step_cache(step, max(s.start for s in segments)),
            "use_cache": True,
        }
        if self.head_of_hidden is None:
            logits = self.model(**inputs).logits[0]
            head: Callable[[torch.Tensor], torch.Tensor] = lambda rows: rows  # noqa: E731
            hidden = logits
        else:
            hidden = self.inner(**inputs).last_hidden_state[0]
            head = self.head_of_hidden
        results: list[torch.Tensor | None] = []
        offset = 0
        for work in works:
            segment = work.segment
            chunk = len(segment.prompt)
            if work.scoring:
                for block in hidden[offset : offset + chunk].split(SCORED_ROWS):
                    work.gen.score_prompt(head(block))
            if segment.draft is None:
                results.append(None)
            else:
                results.append(hidden[offset + chunk : offset + segment.width])
            offset += segment.width
        drafted = [rows for rows in results if rows is not None]
        if not drafted or self.head_of_hidden is None:
            return results
        logits = iter(head(torch.cat(drafted)).split([len(rows) for rows in drafted]))
        return [next(logits) if rows is not None else None for rows in results]

    @property
    def reads_row_lists(self) -> bool:
        """Whether the model's layer stack reads a ragged step's rows' own lists instead of a mask
        (the fused CPU stack), and no layer limits attention to a window the lists do not say."""
        return getattr(self.inner, "reads_row_lists", False) and self.masks.windows_unused

    def _forward_batched(self, works: list[Work]) -> list[torch.Tensor | None]:
        """Plain decoding of k requests as a [k, 1] block, their slots arranged to 0..k-1."""
        gens = [work.gen for work in works]
        arranged = self.pool.arrange(gens, max(len(gen.ids) for gen in gens))
        order = {id(gen): i for i, gen in enumerate(arranged)}
        for work in works:
            work.segment.slot = order[id(work.gen)]
        ordered = sorted(works, key=lambda work: work.segment.slot)
        drafts = [work.segment.draft for work in ordered]
        lengths = [work.segment.start for work in ordered]
        ids, positions, mask = decode_inputs(drafts, lengths, self.masks)
        inputs = {
            "input_ids": ids.to(self.device),
            "position_ids": positions.to(self.device),
            "attention_mask": to_device(mask, self.device),
            "cache": self.pool.step_cache(PoolStep.batched(lengths, 1, self.device), max(lengths)),
            "use_cache": True,
        }
        if self.head_of_hidden is None:
            logits = self.model(**inputs).logits[:, 0]
        else:
            logits = self.head_of_hidden(self.inner(**inputs).last_hidden_state[:, 0])
        by_gen = {id(work.gen): logits[i : i + 1] for i, work in enumerate(ordered)}
        return [by_gen[id(work.gen)] for work in works]

    @torch.inference_mode()
    @contextmanager
    def scratch_slot(self) -> Iterator[int]:
        """A pool slot for forwards outside any request (load-time checks, benchmarks), given back
        afterwards; feed it with forward_drafts."""
        owner = _Probe(0)
        self._lay_out_pool()
        slot = self.pool.admit(owner, used=self.held_entries())
        try:
            yield slot
        finally:
            self.pool.release(owner)

    def time_widths(self, budget_s: float) -> dict[int, float]:
        """Seconds of this model's verification forward feeding q = 1, 2, 4, ... draft rows after
        PROBE_CONTEXT cached entries, the way a step feeds them (one ragged segment, the output
        layer on every row), within about budget_s: widths 1 and 2 always, wider ones while the
        next is expected to fit, then whole passes over those widths again while one fits, each
        width's fastest kept. Passes spread over the budget, so a burst of other work (another
        model loading beside this one) inflates one pass, not the curve. {} when the pool has no
        room for the probe."""
        seconds: dict[int, float] = {}
        with self._probe(PROBE_CONTEXT + PROBE_WIDEST) as forward:
            if forward is None:
                return {}
            started = time.perf_counter()
            forward(PROBE_CONTEXT, 1)  # the first forward pays for allocations
            q = 1
            while q <= PROBE_WIDEST:
                if q > 2 and 2 * seconds[q // 2] > budget_s - (time.perf_counter() - started):
                    break
                seconds[q] = forward(PROBE_CONTEXT, q)
                q *= 2
            while sum(seconds.values()) < budget_s - (time.perf_counter() - started):
                for q in seconds:
                    seconds[q] = min(seconds[q], forward(PROBE_CONTEXT, q))
        return seconds

    def time_context(self, budget_s: float) -> tuple[float, float] | None:
        """Seconds a forward spends per cached entry its first row reads, and per entry each
        further row of its segment reads (CostModel.per_entry, per_row_entry): one row and
        PROBE_ROWS rows timed after PROBE_CONTEXT and after PROBE_LONG_CONTEXT entries, in
        passes while the next fits in about budget_s (at least one), each timing's fastest kept.
        None when the pool has no room for the probe."""
        shapes = [
            (context, rows) for rows in (1, PROBE_ROWS) for context in (PROBE_CONTEXT, PROBE_LONG_CONTEXT)
        ]
        seconds = dict.fromkeys(shapes, math.inf)
        with self._probe(PROBE_LONG_CONTEXT + PROBE_ROWS) as forward:
            if forward is None:
                return None
            started = time.perf_counter()
            forward(PROBE_LONG_CONTEXT, 1)  # the first forward at this length pays for allocations
            while True:
                began = time.perf_counter()
                for shape in shapes:
                    seconds[shape] = min(seconds[shape], forward(*shape))
                now = time.perf_counter()
                if now - started + (now - began) > budget_s:
                    break
        entries = PROBE_LONG_CONTEXT - PROBE_CONTEXT
        first = (seconds[PROBE_LONG_CONTEXT, 1] - seconds[PROBE_CONTEXT, 1]) / entries
        wide = (seconds[PROBE_LONG_CONTEXT, PROBE_ROWS] - seconds[PROBE_CONTEXT, PROBE_ROWS]) / entries
        return max(first, 0.0), max(wide - first, 0.0) / (PROBE_ROWS - 1)

    @contextmanager
    def _probe(self, length: int) -> Iterator[Callable[[int, int], float] | None]:
        """A pool slot of `length` entries held outside any request while timing: yields a
        function timing one forward of a chain of `rows` rows after `context` entries (None when
        the pool has no room), and gives the slot back."""
        probe = _Probe(length)
        self._lay_out_pool()
        try:
            slot = self.pool.admit(probe, used=self.held_entries())
        except RuntimeError:  # KVCacheFull: the requests running hold the pool
            yield None
            return

        def forward(context: int, rows: int) -> float:
            draft = Draft([0] * rows, list(range(-1, rows - 1)))
            began = time.perf_counter()
            self.forward_segments([Work(probe, Segment(slot, context, [], draft))])  # type: ignore[arg-type]
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return time.perf_counter() - began

        try:
            yield forward
        finally:
            self.pool.release(probe)
            self.release_idle()

    def forward_drafts(
        self, drafts: list[Draft], lengths: list[int], slots: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """Logits [len(drafts[i]), vocab] of the draft of pool slot slots[i] (default i), fed after
        its lengths[i] cached entries, in one forward (benchmarks and tests; the decoder plans
        its own steps)."""
        slots = range(len(drafts)) if slots is None else slots
        works = [
            Work(self.pool.owners[slot], Segment(slot, length, [], draft))
            for slot, draft, length in zip(slots, drafts, lengths)
        ]
        return self.forward_segments(works)
