"""Lookahead decoding: retrieve a draft tree, verify it in one forward, keep what the model agrees with.

One `Generation` per request (generation.py) holds its token history, its sampler and its own
trie (its prompt; its output too when there is no global trie). The decoder holds what requests
share and does every forward: the model, the KV pool, the prefix cache, the global trie that
learns from every generated token, and the online cost model that decides how much drafting
pays. `decoder.step(generations)` advances any number of requests with one forward of one
ragged row: each running request contributes its root and exactly the draft nodes the step's
token budget gives it (planner.plan_step), and a request still reading its prompt a chunk of it,
so a long prompt never stalls the others for more than a step.

    gen = decoder.start(prompt_ids, SamplingParams(max_tokens=64))
    while not gen.finished:
        out = gen.step()          # accepted token ids and the new text of this step
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from ..algorithm.draft import Draft
from ..algorithm.planner import Calibration, CostModel, least_paying_weight, plan_step
from ..algorithm.trie import NGramTrie
from ..algorithm.verify import verify
from ..config import DecoderConfig, LookaheadConfig, SamplingParams, TrieConfig
from ..structured import CompiledGrammar, GrammarCompiler, GrammarMatcher
from .generation import Generation, GenerationStats, Shared, StepOutput
from .kv_pool import INITIAL_LENGTH, KVLayout, KVPool, PoolStep, accepted_moves, footprint, pow2
from .output_layer import plain_output_layer
from .prefix_cache import PrefixCache
from .step_inputs import AttentionMasks, Segment, decode_inputs, ragged_inputs, to_device
from .stop_words import stop_word_ids

if TYPE_CHECKING:
    from ..models.loading import LoadedModel

__all__ = ["Generation", "GenerationStats", "LookaheadDecoder", "StepOutput"]

STOP_WORDS_CACHED = 64  # distinct stop_words lists whose token ids are kept

# Prompt positions whose logits exist at once when prompt logprobs are scored (rows x vocab floats).
_SCORED_ROWS = 256
# Retrieval's conditional probabilities overstate acceptance until calibrated, so a cold decoder
# trusts them this far.
INITIAL_CALIBRATION = 0.7
# While a prompt is being read, drafts may take at most this share of what the running
# requests' roots leave of the step's budget; the prompt's chunk gets the rest.
DRAFT_SHARE_BESIDE_PROMPT = 0.5


@dataclass
class _Work:
    """One generation's part of a step: its segment, and the draft verified after it (if any)."""

    gen: Generation
    segment: Segment
    scoring: bool = False  # its prompt chunk's logits are scored (prompt logprobs)


class LookaheadDecoder:
    """Shared state of all requests served by one model instance (owned by one thread).

    step_token_budget, max_speculative_batch, prefix_cache_tokens, kv_cache_bytes,
    grammar_compile_timeout_s, grammar_max_bytes, grammar_max_choices: see `DecoderConfig`.
    cost_prior: the forward's relative cost by tokens fed on this execution path, which the cost
    model starts from (`LoadedModel.cost_prior`); None: the device's default curve.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        trie: NGramTrie | None = None,
        config: LookaheadConfig = LookaheadConfig(),
        eos_token_ids: Sequence[int] = (),
        *,
        step_token_budget: int = DecoderConfig.step_token_budget,
        max_speculative_batch: int = DecoderConfig.max_speculative_batch,
        prefix_cache_tokens: int = DecoderConfig.prefix_cache_tokens,
        kv_cache_bytes: int = DecoderConfig.kv_cache_bytes,
        grammar_compile_timeout_s: float = DecoderConfig.grammar_compile_timeout_s,
        grammar_max_bytes: int = DecoderConfig.grammar_max_bytes,
        grammar_max_choices: int = DecoderConfig.grammar_max_choices,
        cost_prior: Mapping[int, float] | None = None,
    ):
        DecoderConfig(
            step_token_budget,
            max_speculative_batch,
            prefix_cache_tokens,
            kv_cache_bytes,
            grammar_compile_timeout_s,
            grammar_max_bytes,
            grammar_max_choices,
        )  # validates
        self.model = model
        self.tokenizer = tokenizer
        self.trie = trie
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        self.step_token_budget = step_token_budget
        self.max_speculative_batch = max_speculative_batch
        # A request's own trie is as deep as the shared one; copies (spans.py) may draft deeper.
        self.trie_depth = trie.max_depth if trie is not None else TrieConfig.depth
        self.device = next(model.parameters()).device
        self.dtype = model.dtype  # a property that walks every parameter: read once
        self.masks = AttentionMasks(model.config, self.dtype)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.context_length: int | None = getattr(model.config, "max_position_embeddings", None)
        self.kv_cache_bytes = kv_cache_bytes
        self._kv_layout: KVLayout | None = None
        self.grammars = GrammarCompiler(
            tokenizer,
            self.eos_token_ids,
            self.vocab_size,
            grammar_compile_timeout_s,
            max_bytes=grammar_max_bytes,
            max_choices=grammar_max_choices,
        )
        self._kv_bytes_per_token: int | None = None
        self.pool = KVPool(limit_bytes=kv_cache_bytes)
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.cost = CostModel.for_device(self.device.type, dict(cost_prior) if cost_prior else None)
        # With a plain output layer, forwards run the decoder and the layer apart (fewer wrappers,
        # and no logits for padding rows).
        self.head_of_hidden = plain_output_layer(model)
        self.inner = model.get_decoder() if self.head_of_hidden is not None else None
        self.calibration = Calibration.uniform(INITIAL_CALIBRATION)
        # Where LookaheadConfig.debug lines go (the backend sends them to the server log).
        self.debug_log: Callable[[str], None] = logging.getLogger("lookahead").info
        self._stop_words: dict[tuple[int | str, ...], frozenset[int]] = {}
        self.stop_word_ids(config.stop_words)  # a bad instance setting fails here, not in a request

    def stop_word_ids(self, words: tuple[int | str, ...]) -> frozenset[int]:
        """The token ids of LookaheadConfig.stop_words (see stop_words.py); ValueError for a bad entry."""
        if words not in self._stop_words:
            vocab_size = self.model.get_input_embeddings().num_embeddings
            if len(self._stop_words) >= STOP_WORDS_CACHED:  # requests choose the keys: keep it bounded
                del self._stop_words[next(iter(self._stop_words))]  # the oldest
            self._stop_words[words] = stop_word_ids(words, self.tokenizer, vocab_size)
        return self._stop_words[words]

    @classmethod
    def for_model(
        cls,
        loaded: LoadedModel,
        trie: NGramTrie | None = None,
        config: LookaheadConfig = LookaheadConfig(),
        settings: DecoderConfig = DecoderConfig(),
    ) -> LookaheadDecoder:
        """A decoder for a model from `load_model`, with its tokenizer, EOS ids and cost prior."""
        return cls(
            loaded.model,
            loaded.tokenizer,
            trie,
            config,
            loaded.eos_token_ids,
            step_token_budget=settings.step_token_budget,
            max_speculative_batch=settings.max_speculative_batch,
            prefix_cache_tokens=settings.prefix_cache_tokens,
            kv_cache_bytes=settings.kv_cache_bytes,
            grammar_compile_timeout_s=settings.grammar_compile_timeout_s,
            grammar_max_bytes=settings.grammar_max_bytes,
            grammar_max_choices=settings.grammar_max_choices,
            cost_prior=loaded.cost_prior,
        )

    def start(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        lookahead: LookaheadConfig | None = None,
        request_id: str = "",
        grammar: CompiledGrammar | None = None,
    ) -> Generation:
        """A new generation. grammar: params.structured_outputs compiled (`self.grammars.compile`);
        the backend compiles it before the request reaches the engine thread and passes it here.
        Without it the constraint is compiled on the caller's thread."""
        config = lookahead or self.config
        self.check_request(len(prompt_ids), params, config)
        shared = Shared(
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            device=self.device,
            trie=self.trie,
            trie_depth=self.trie_depth,
            calibration=self.calibration,
            stop_words=self.stop_word_ids(config.stop_words),
            debug_log=self.debug_log,
            step=lambda gen: self.step([gen])[0],
            release=self.pool.release,
        )
        spec = params.structured_outputs
        matcher = None
        if spec is not None:
            matcher = GrammarMatcher(grammar or self.grammars.compile(spec), self.vocab_size, spec.name)
        return Generation(shared, list(prompt_ids), params, config, request_id, matcher)

    def check_request(self, prompt_length: int, params: SamplingParams, lookahead: LookaheadConfig) -> None:
        """Raise ValueError for a request this decoder can never serve: an empty prompt, token ids
        outside the vocabulary, stop_words the tokenizer cannot resolve, more tokens than the model's
        context, more KV than kv_cache_bytes, a structured-output constraint over the size caps or
        refused before. It never compiles: `self.grammars.compile` does, off the engine thread."""
        if prompt_length < 1:
            raise ValueError("the prompt must contain at least one token")
        params.check_vocabulary(self.vocab_size)
        self.stop_word_ids(lookahead.stop_words)
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)
        total = prompt_length + params.max_tokens
        if self.context_length is not None and total > self.context_length:
            raise ValueError(
                f"the prompt ({prompt_length} tokens) and max_tokens ({params.max_tokens}) exceed the "
                f"model's context length ({self.context_length} tokens)"
            )
        needed = self.kv_bytes([self.longest(prompt_length, params, lookahead)])
        if self.kv_cache_bytes and needed > self.kv_cache_bytes:
            raise ValueError(
                f"the prompt ({prompt_length} tokens) and max_tokens ({params.max_tokens}) need "
                f"{needed} bytes of KV cache, more than kv_cache_bytes ({self.kv_cache_bytes})"
            )

    @staticmethod
    def longest(prompt_length: int, params: SamplingParams, lookahead: LookaheadConfig) -> int:
        """The most KV entries a request can hold: its prompt, its output and one step's draft."""
        return prompt_length + params.max_tokens + lookahead.decoding_length

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

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one position's keys and values over all layers."""
        layout = self.kv_layout
        size = torch.tensor([], dtype=layout.dtype).element_size()
        return sum(2 * heads * dim * size for heads, dim in zip(layout.heads, layout.head_dims))

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
                layers[0].keys.dtype,
                layers[0].keys.device,
            )
        return self._kv_layout

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
        """Advance every generation by one step, all in one forward: a chunk of the prompt for those
        still reading it, the root and its planned draft for the others.

        A generation the step's budget leaves no room for (a prompt behind another one's chunk)
        gets an empty output. A request whose own work fails (its draft, its sampler, its text)
        ends with an output whose `error` says why, finish_reason "error"; the others are
        unaffected. A failure of the shared forward is raised, before any request has committed
        anything, so the caller may step each request alone again.
        """
        if any(gen.finished for gen in generations):
            raise RuntimeError("step() called on a finished or closed generation")
        # The running requests in the first slots, so that a growth allocates only theirs
        # (kv_cache_bytes counts running requests); before any slot number is planned.
        self.pool.pack(self._held_entries())
        outputs: dict[int, StepOutput] = {}
        for gen in generations:
            if gen.fed is None:
                failure = _isolated(gen, lambda gen=gen: self._admit(gen))
                if failure is not None:
                    outputs[id(gen)] = failure
        works = self._plan([gen for gen in generations if id(gen) not in outputs], outputs)
        if works:
            outputs.update(self._run(works))
        self._fit_pool()
        return [outputs.get(id(gen)) or StepOutput([], "") for gen in generations]

    def _admit(self, gen: Generation) -> None:
        """Give a new generation a pool slot holding whatever prefix of its prompt the prefix cache
        has (none when its prompt is scored, every prompt position's logits being needed, nor when
        it does not learn)."""
        if self.pool.layout is None:
            self.pool.layout = self.kv_layout
        # The prefix cache is shared by the requests that learn: one that does not neither reads
        # nor leaves anything there (see _prompt_read), so no match crosses the two scopes.
        shared = gen.config.learn and not gen.scoring_prompt
        cached, keys, values = self.prefix_cache.lookup(gen.ids) if shared else (0, [], [])
        self.pool.admit(gen, keys, values, used=self._held_entries())
        gen.fed = cached
        gen.stats.cached_prompt_tokens = cached
        gen.started = time.perf_counter()

    def _plan(self, gens: list[Generation], failed: dict[int, StepOutput]) -> list[_Work]:
        """Each generation's segment of this step, within step_token_budget.

        Running requests' roots come first; then, first come first served, prompts that fit whole
        (their last token becomes a root); then the drafts of every root, node by node where
        they pay (plan_step), next to at most one partial prompt chunk, which gets what is left
        (and at least an eighth of the budget, so a prompt always advances). With no running
        request to stall, the first prompt is read whole.
        """
        budget = self.step_token_budget
        rooted = [gen for gen in gens if gen.prefilled]
        free = budget - len(rooted)
        if not rooted and gens:  # no stream waits on this step: the first prompt goes whole
            free = max(free, gens[0].root - gens[0].fed + budget)
        partial = None
        for gen in gens:
            if gen.prefilled:
                continue
            need = gen.root - gen.fed + 1
            if partial is None and need <= free:
                rooted.append(gen)
                free -= need
            elif partial is None:
                partial = gen
        chunks = sum(gen.root - gen.fed for gen in rooted if not gen.prefilled)
        capped = self.max_speculative_batch and len(gens) > self.max_speculative_batch
        room = max(0, free if partial is None else int(free * DRAFT_SHARE_BESIDE_PROMPT))
        # Retrieval skips nodes too unlikely to pay their way in this step (most of them, when
        # many requests already share the forward).
        least = least_paying_weight(self.cost, len(rooted), len(rooted) + chunks)
        drafts = []
        for gen in list(rooted):
            draft = Draft.root_only(gen.ids[-1])
            if not capped and room:
                try:
                    draft = gen.retrieve(room + 1, least if gen.config.adaptive else 0.0)
                except Exception as error:  # this request fails; the others go on
                    failed[id(gen)] = _failure(gen, error)
                    rooted.remove(gen)
                    continue
            drafts.append(draft)
        drafts = plan_step(
            drafts,
            [gen.calibration for gen in rooted],
            [gen.config.adaptive for gen in rooted],
            self.cost,
            len(rooted) + chunks + room,
            other_tokens=chunks,
        )
        works = []
        for gen, draft in zip(rooted, drafts):
            start = len(gen.ids) - 1 if gen.prefilled else gen.fed
            chunk = gen.ids[gen.fed : gen.root] if not gen.prefilled else []
            segment = Segment(self.pool.slot_of(gen), start, chunk, draft)
            works.append(_Work(gen, segment, scoring=gen.scoring_prompt and bool(chunk)))
        if partial is not None:
            drafted = sum(len(draft) - 1 for draft in drafts)
            size = max(free - drafted, budget // 8, 1)
            chunk = partial.ids[partial.fed : min(partial.root, partial.fed + size)]
            segment = Segment(self.pool.slot_of(partial), partial.fed, chunk, None)
            works.append(_Work(partial, segment, scoring=partial.scoring_prompt))
        return works

    def _run(self, works: list[_Work]) -> dict[int, StepOutput]:
        """The step's one forward, then each request's verdict and commit."""
        started = time.perf_counter()
        rows = self.forward_segments(works)
        failed: dict[int, StepOutput] = {}
        verdicts = {}
        for work, logits in zip(works, rows):
            gen, segment = work.gen, work.segment
            gen.fed = segment.start + len(segment.prompt)  # entries held before the draft's root
            if segment.draft is None:
                continue
            try:
                verdicts[id(gen)] = verify(segment.draft, logits, gen.selector)
            except Exception as error:
                failed[id(gen)] = _failure(gen, error)
        self.pool.compact(
            [
                move
                for work in works
                if id(work.gen) in verdicts
                for move in accepted_moves(
                    work.segment.slot, work.gen.fed, verdicts[id(work.gen)].accepted_nodes
                )
            ]
        )
        elapsed = time.perf_counter() - started
        self.cost.observe(sum(work.segment.width for work in works), elapsed)
        outputs = dict(failed)
        for work, logits in zip(works, rows):
            gen, segment = work.gen, work.segment
            verdict = verdicts.get(id(gen))
            if verdict is None:
                continue
            if not gen.stats.output_tokens:  # the draft after the prompt's last chunk
                self._prompt_read(gen, segment)
            else:
                gen.stats.steps += 1
                gen.stats.forward_seconds.append(elapsed)
            gen.record_verdict(segment.draft, verdict)
            chosen = logits[verdict.rows] if gen.cumulative_logprob is not None else None
            outputs[id(gen)] = _isolated(
                gen, lambda gen=gen, verdict=verdict, chosen=chosen: gen.commit(verdict.tokens, chosen)
            )
        return outputs

    def _prompt_read(self, gen: Generation, segment: Segment) -> None:
        """The prompt's last chunk was fed: keep its KV for later prompts sharing a prefix (unless
        the request has `learn` off)."""
        gen.stats.prefill_seconds = time.perf_counter() - (gen.started or time.perf_counter())
        length = gen.prompt_len  # the root's entry is the prompt's last one
        if gen.scoring_prompt or not gen.config.learn:
            return
        if not self.prefix_cache.capacity or length > self.prefix_cache.capacity:
            return
        if self.prefix_cache.holds(gen.ids[:length]):
            return
        self.prefix_cache.store(gen.ids[:length], *self.pool.prefix(segment.slot, length))

    def _fit_pool(self) -> None:
        """Give memory back when no request runs."""
        if self.pool.idle:
            self.pool.free()

    def _held_entries(self) -> int:
        """The most KV entries any running request holds between steps."""
        return max((len(gen.ids) for gen in self.pool.owners if gen is not None), default=0)

    def forward_segments(self, works: list[_Work]) -> list[torch.Tensor | None]:
        """Logits of each segment's draft rows [len(draft), vocab] (None for a chunk without one);
        scored prompt chunks hand their rows' logits to their generation.

        Writes the segments' KV entries but commits nothing, so the same call can be repeated.
        """
        segments = [work.segment for work in works]
        if len(segments) > 1 and all(s.width == 1 and s.draft is not None for s in segments):
            return self._forward_batched(works)
        ids, positions, mask = ragged_inputs(segments, self.masks)
        step = PoolStep.ragged(
            [s.slot for s in segments], [s.start for s in segments], [s.width for s in segments]
        )
        inputs = {
            "input_ids": ids.to(self.device),
            "position_ids": positions.to(self.device),
            "attention_mask": to_device(mask, self.device),
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
                for block in hidden[offset : offset + chunk].split(_SCORED_ROWS):
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

    def _forward_batched(self, works: list[_Work]) -> list[torch.Tensor | None]:
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

    def forward_drafts(
        self, drafts: list[Draft], lengths: list[int], slots: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """Logits [len(drafts[i]), vocab] of the draft of pool slot slots[i] (default i), fed after
        its lengths[i] cached entries, in one forward (benchmarks and tests; the decoder plans
        its own steps)."""
        slots = range(len(drafts)) if slots is None else slots
        works = [
            _Work(self.pool.owners[slot], Segment(slot, length, [], draft))
            for slot, draft, length in zip(slots, drafts, lengths)
        ]
        return self.forward_segments(works)


def _isolated(gen: Generation, work: Callable[[], StepOutput | None]) -> StepOutput | None:
    """`work` for one generation; its exception becomes that generation's failed output."""
    try:
        return work()
    except Exception as error:
        return _failure(gen, error)


def _failure(gen: Generation, error: Exception) -> StepOutput:
    gen.close("error")
    return StepOutput([], "", "error", error=error)
