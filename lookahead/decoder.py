"""Lookahead decoding: retrieve a draft tree, verify it in one forward, keep what the model agrees with.

One `Generation` per request holds its token history, its sampler and its own trie (its prompt;
its output too when there is no global trie). The decoder holds what requests share: the
model, the KV pool, the global trie that learns from every generated token, and the online cost
model that decides how much drafting pays. `decoder.step(generations)` advances any number of
requests with one forward: each contributes its root token and its draft tree, padded to a
common width.

    gen = decoder.start(prompt_ids, SamplingParams(max_tokens=64))
    while not gen.finished:
        out = gen.step()          # accepted token ids and the new text of this step
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .adaptive import Calibration, CostModel, plan_step
from .config import LookaheadConfig, SamplingParams
from .detokenizer import Detokenizer
from .draft import Draft
from .kv_pool import KVPool
from .models import additive_mask, plain_output_layer
from .packed_linear import linear_kernel_of
from .prefix_cache import PrefixCache
from .retrieval import retrieve_draft
from .sampling import TokenSelector
from .spans import SpanIndex
from .trie import DEFAULT_MAX_DEPTH, NGramTrie, TrieWriter
from .verify import Verdict, verify

# The trie's probabilities overstate acceptance about threefold until calibrated: the shared
# ratio converged to 0.3-0.4 on every benchmark set, so a cold decoder starts there.
INITIAL_CALIBRATION = 0.35
_REQUEST_CALIBRATION_RATE = 0.15  # a request's own acceptance history soon outweighs the global one
# Above this many running requests drafts stop paying on a 2-core CPU with the packed kernel, where a
# plain step of 8 rows costs 1.63x one row. Server load test, 16 HumanEval requests a level: with
# drafts up to 4 running requests, concurrency 4 ran at 0.91x plain decoding; up to 3, concurrency
# 2 / 3 / 4 at 1.13x / 1.09x / 1.00x (same run). A GPU can afford more.
MAX_SPECULATIVE_BATCH = 3
# Prompt tokens whose KV the decoder keeps for later prompts with the same prefix: 94 MB of fp32
# KV for the default model, enough for its chat system prompt and the last several conversations.
PREFIX_CACHE_TOKENS = 2048


@dataclass
class StepOutput:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # None while running, else "stop", "length" or "cancelled"


@dataclass
class GenerationStats:
    prompt_tokens: int
    output_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    steps: int = 0  # decoding forwards after the prefill
    draft_tokens: int = 0  # draft tokens fed (roots excluded)
    accepted_draft_tokens: int = 0
    prefill_seconds: float = 0.0
    forward_seconds: list[float] = field(default_factory=list)
    retrieval_seconds: list[float] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per decoding forward (1.0 for plain decoding)."""
        return (self.output_tokens - 1) / self.steps if self.steps else 0.0


class LookaheadDecoder:
    """Shared state of all requests served by one model instance (owned by one thread).

    step_token_budget: most tokens fed per batched forward (roots included); drafts shrink as
    the batch grows. max_speculative_batch: above this many running requests, decode plainly.
    prefix_cache_tokens: bound of the prefix cache (prefix_cache.py); 0 turns it off.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        trie: NGramTrie | None = None,
        config: LookaheadConfig = LookaheadConfig(),
        eos_token_ids: Sequence[int] = (),
        *,
        step_token_budget: int = 128,
        max_speculative_batch: int = MAX_SPECULATIVE_BATCH,
        prefix_cache_tokens: int = PREFIX_CACHE_TOKENS,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.trie = trie
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        self.step_token_budget = step_token_budget
        self.max_speculative_batch = max_speculative_batch
        # A request's own trie is as deep as the shared one; copies (spans.py) may draft deeper.
        self.trie_depth = trie.max_depth if trie is not None else DEFAULT_MAX_DEPTH
        self.device = next(model.parameters()).device
        self.dtype = model.dtype  # a property that walks every parameter: read once
        self.pool = KVPool()
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.cost = CostModel.for_device(self.device.type, linear_kernel_of(model))
        self.head_of_hidden = plain_output_layer(model)
        self.calibration = Calibration(INITIAL_CALIBRATION, INITIAL_CALIBRATION)

    def start(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        lookahead: LookaheadConfig | None = None,
    ) -> Generation:
        if not prompt_ids:
            raise ValueError("the prompt must contain at least one token")
        return Generation(self, list(prompt_ids), params, lookahead or self.config)

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(), **kwargs: Any
    ) -> Iterator[StepOutput]:
        gen = self.start(prompt_ids, params, **kwargs)
        try:
            while not gen.finished:
                yield gen.step()
        finally:
            gen.close()

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        lookahead: LookaheadConfig | None = None,
    ) -> tuple[list[int], GenerationStats]:
        """Run one request to completion: (output ids, stats)."""
        gen = self.start(prompt_ids, params, lookahead)
        while not gen.finished:
            gen.step()
        return gen.output_ids, gen.stats

    @torch.inference_mode()
    def step(self, generations: Sequence[Generation]) -> list[StepOutput]:
        """Advance every generation by one step: prefill the new ones, decode the rest together."""
        if any(gen.finished for gen in generations):
            raise RuntimeError("step() called on a finished or closed generation")
        # A prefill's draft pays only when the steps it saves are the request's own: in a batch
        # above max_speculative_batch every step runs for the others anyway.
        drafting = len(generations) <= self.max_speculative_batch
        outputs = {id(gen): gen._prefill(drafting) for gen in generations if not gen.in_pool}
        running = [gen for gen in generations if id(gen) not in outputs]
        if running:
            running = self.pool.arrange(running, max(len(gen.ids) - 1 for gen in running))
            outputs.update(zip(map(id, running), self._decode(running)))
        return [outputs[id(gen)] for gen in generations]

    def _decode(self, gens: list[Generation]) -> list[StepOutput]:
        """One forward for `gens`, which hold pool slots 0..k-1 in this order (see KVPool.arrange)."""
        if len(gens) > self.max_speculative_batch:
            drafts = [Draft.root_only(gen.ids[-1]) for gen in gens]
        else:
            # The step's budget caps every draft (see plan_step): build no node it would trim.
            width = max(1, self.step_token_budget // len(gens))
            drafts = [gen._retrieve(width) for gen in gens]
        drafts = plan_step(
            drafts,
            [g.calibration for g in gens],
            [g.config.adaptive for g in gens],
            self.cost,
            self.step_token_budget,
        )
        started = time.perf_counter()
        lengths = [len(gen.ids) - 1 for gen in gens]
        logits = self.forward_drafts(drafts, lengths)
        verdicts = [
            verify(draft, rows, gen.ids, gen.selector) for gen, draft, rows in zip(gens, drafts, logits)
        ]
        self.pool.compact(
            [
                move
                for slot, (length, verdict) in enumerate(zip(lengths, verdicts))
                for move in _accepted_moves(slot, length, verdict)
            ]
        )
        elapsed = time.perf_counter() - started
        width = max(len(d) for d in drafts)
        self.cost.observe(len(gens) * width, elapsed)
        outputs = []
        for gen, draft, verdict in zip(gens, drafts, verdicts):
            gen._record_verdict(draft, verdict)
            gen.stats.steps += 1
            gen.stats.forward_seconds.append(elapsed)
            outputs.append(gen._commit(verdict.tokens))
        return outputs

    def forward_drafts(self, drafts: list[Draft], lengths: list[int]) -> list[torch.Tensor]:
        """Logits [len(drafts[i]), vocab] of pool slot i's draft, fed after its lengths[i] cached entries.

        Writes the drafts' KV entries but commits nothing, so the same call can be repeated.
        """
        k, width = len(drafts), max(len(d) for d in drafts)
        read_length = max(lengths) + width
        ids = torch.zeros(k, width, dtype=torch.long)
        positions = torch.zeros(k, width, dtype=torch.long)
        visible = torch.zeros(k, width, read_length, dtype=torch.bool)
        for i, (draft, length) in enumerate(zip(drafts, lengths)):
            n = len(draft)
            ids[i, :n] = torch.tensor(draft.tokens)
            positions[i, :n] = draft.position_ids(length)
            visible[i, :n, :length] = True
            visible[i, :n, length : length + n] = draft.ancestor_mask()
            padding = torch.arange(n, width)
            visible[i, padding, length + padding] = True  # padding rows see only themselves
        mask = additive_mask(visible, self.dtype)
        inputs = {
            "input_ids": ids.to(self.device),
            "position_ids": positions.to(self.device),
            "attention_mask": mask[:, None].to(self.device),
            "cache": self.pool.step_cache(lengths, width),
            "use_cache": True,
        }
        sizes = [len(d) for d in drafts]
        if self.head_of_hidden is None or sum(sizes) == k * width:
            logits = self.model(**inputs).logits
            return [row[:n] for row, n in zip(logits, sizes)]
        # The padding rows' logits would never be read: run the output layer on the real rows only.
        hidden = self.model.get_decoder()(**inputs).last_hidden_state
        rows = torch.cat([hidden[i, :n] for i, n in enumerate(sizes)])
        return list(self.head_of_hidden(rows).split(sizes))


class Generation:
    """One request: prefill on its first step, then one (possibly speculative) forward per step."""

    def __init__(
        self,
        decoder: LookaheadDecoder,
        prompt_ids: list[int],
        params: SamplingParams,
        config: LookaheadConfig,
    ):
        self.decoder = decoder
        self.params = params
        self.config = config
        self.ids = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.finish_reason: str | None = None
        self.in_pool = False  # holds a KV pool slot (prefilled and not yet finished)
        self.eos = frozenset() if params.ignore_eos else frozenset(decoder.eos_token_ids)
        shared = decoder.calibration
        self.calibration = Calibration(shared.ratio, shared.side_ratio, rate=_REQUEST_CALIBRATION_RATE)
        self.selector = TokenSelector(params, self.prompt_len, decoder.eos_token_ids, decoder.device)
        self.detokenizer = Detokenizer(decoder.tokenizer, prompt_ids, params.stop)
        self.local: NGramTrie | None = None
        self.spans: SpanIndex | None = None
        self.writers: list[TrieWriter] = []
        if config.drafting:
            # The output is learned once: by the shared trie when there is one. Counted in the
            # request's own trie as well, whatever the output has just copied from the prompt
            # would count twice there, outranking the prompt's own evidence (replaying the
            # benchmark sets: 1% fewer forward costs on three of four, 1% more on HumanEval).
            learns_output = decoder.trie is None
            depth = decoder.trie_depth
            capacity = (self.prompt_len + (params.max_tokens if learns_output else 0)) * depth + 1
            self.local = NGramTrie(capacity=capacity, max_depth=depth)
            writer = self.local.writer()
            writer.feed(prompt_ids)
            if learns_output:
                self.writers.append(writer)
            self.spans = SpanIndex(prompt_ids)
        if decoder.trie is not None:
            # The shared trie learns outputs, keyed by the prompt's last tokens so that they can be queried.
            self.writers.append(decoder.trie.writer())
            self.writers[-1].feed(prompt_ids[max(0, self.prompt_len - config.max_query_length + 1) :])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.prompt_len :]

    def step(self) -> StepOutput:
        """Advance this generation alone (the engine batches through decoder.step)."""
        return self.decoder.step([self])[0]

    def close(self) -> None:
        """Free the KV slot and the request's own trie (finished, cancelled or abandoned)."""
        if self.in_pool:
            self.decoder.pool.release(self)
            self.in_pool = False
        self.local, self.spans, self.writers = None, None, []
        if self.finish_reason is None:
            self.finish_reason = "cancelled"

    def _prefill(self, drafting: bool) -> StepOutput:
        """Feed the prompt, less any prefix the prefix cache holds, and in the same forward (when
        `drafting`) a draft of what follows it.

        Tokens accepted here need no decoding step. A draft token adds about as much to a
        prefill (~1 ms on the default CPU model) as to a small decoding step, so the draft is
        trimmed as a decoding step's would be.
        """
        started = time.perf_counter()
        decoder = self.decoder
        root = self.prompt_len - 1  # the prompt's last token is the draft's root
        draft = Draft.root_only(self.ids[-1])
        if drafting:
            (draft,) = plan_step(
                [self._retrieve(decoder.step_token_budget)],
                [self.calibration],
                [self.config.adaptive],
                decoder.cost,
                decoder.step_token_budget,
            )
        cached, cache = decoder.prefix_cache.lookup(self.ids)
        inputs: dict[str, Any] = {"cache": cache, "use_cache": True, "logits_to_keep": len(draft)}
        if len(draft) > 1:
            positions, mask = _prefill_layout(draft, root, cached, decoder.dtype)
            inputs["position_ids"] = positions[None].to(decoder.device)
            inputs["attention_mask"] = mask[None, None].to(decoder.device)
        ids = torch.tensor([self.ids[cached:root] + draft.tokens], device=decoder.device)
        logits = decoder.model(input_ids=ids, **inputs).logits[0]
        verdict = verify(draft, logits, self.ids, self.selector)
        decoder.prefix_cache.store(self.ids, cache)
        self.stats.cached_prompt_tokens = cached
        slot = decoder.pool.admit(self, cache)
        self.in_pool = True
        decoder.pool.compact(_accepted_moves(slot, root, verdict))
        self._record_verdict(draft, verdict)
        self.stats.prefill_seconds = time.perf_counter() - started
        return self._commit(verdict.tokens)

    def _retrieve(self, max_width: int) -> Draft:
        """The draft this request would like to verify next, at most max_width nodes (the batch plan
        may trim it further)."""
        root = self.ids[-1]
        depth = min(self.config.branch_length, self.params.max_tokens - self.stats.output_tokens - 1)
        if not self.config.drafting or depth <= 0:
            return Draft.root_only(root)
        started = time.perf_counter()
        draft = retrieve_draft(
            self.ids[-self.config.max_query_length :],
            self.local,
            self.decoder.trie,
            decoding_length=min(self.config.decoding_length, max_width),
            branch_length=depth,
            mode=self.config.decoding_mode,
            max_query_length=self.config.max_query_length,
            copy=self.spans.continuation(depth),
            stop_tokens=self.eos,
        )
        self.stats.retrieval_seconds.append(time.perf_counter() - started)
        return draft

    def _record_verdict(self, draft: Draft, verdict: Verdict) -> None:
        """Count the draft's fed and accepted tokens, and calibrate its probabilities against them."""
        if len(draft) > 1:
            for calibration in (self.decoder.calibration, self.calibration):
                calibration.observe(draft, verdict.accepted_nodes)
        self.stats.draft_tokens += len(draft) - 1
        self.stats.accepted_draft_tokens += len(verdict.accepted_nodes)

    def _commit(self, tokens: list[int]) -> StepOutput:
        """Append the step's tokens, applying length and EOS limits; feed the tries and the detokenizer."""
        tokens = tokens[: self.params.max_tokens - self.stats.output_tokens]
        hit_eos = next((i for i, t in enumerate(tokens) if t in self.eos), None)
        if hit_eos is not None:
            tokens = tokens[: hit_eos + 1]
        self.ids.extend(tokens)
        self.stats.output_tokens += len(tokens)
        for writer in self.writers:
            writer.feed(tokens[:hit_eos] if hit_eos is not None else tokens)
        if self.spans is not None:
            self.spans.extend(tokens)
        text = self.detokenizer.push(tokens)
        if hit_eos is not None or self.detokenizer.stopped:
            self.finish_reason = "stop"
        elif self.stats.output_tokens >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finished:
            text += self.detokenizer.flush()
            self.close()
        return StepOutput(tokens, text, self.finish_reason)


def _accepted_moves(slot: int, length: int, verdict: Verdict) -> list[tuple[int, int, int]]:
    """KV moves (slot, from, to) that put the accepted nodes of a draft fed after `length` cached
    entries right behind them; none when they are the draft's first branch, already in place."""
    return [
        (slot, length + node, length + 1 + depth)
        for depth, node in enumerate(verdict.accepted_nodes)
        if node != depth + 1
    ]


def _prefill_layout(
    draft: Draft, root: int, cached: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids and additive mask of prompt tokens [cached, root) fed after `cached` cached
    ones, then `draft` (its root is the prompt's last token): causal over the prompt; each draft
    node sees the prompt and its own ancestors."""
    n = len(draft)
    visible = torch.ones(root + n, root + n, dtype=torch.bool).tril_()[cached:]
    visible[root - cached :, root:] = draft.ancestor_mask()
    positions = torch.cat([torch.arange(cached, root), draft.position_ids(root)])
    return positions, additive_mask(visible, dtype)
