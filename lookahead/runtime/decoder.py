"""Lookahead decoding: retrieve a draft tree, verify it in one forward, keep what the model agrees with.

One `Generation` per request (generation.py) holds its token history, its sampler and its
drafter. The decoder holds what requests share and drives each step: it admits new requests
into the KV pool, asks the scheduler (scheduler.py) what each request feeds within the step's
token budget (a chunk of its prompt, or its root and the draft nodes that pay), has the runner
(runner.py, which owns the model's forwards, the KV pool and the prefix cache) feed them all as
one ragged row, verifies each draft and commits what the model accepted. It also holds the
online cost model and acceptance predictor that decide how much drafting pays.

    gen = decoder.start(prompt_ids, SamplingParams(max_tokens=64))
    while not gen.finished:
        out = gen.step()          # accepted token ids and the new text of this step
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from ..algorithm.acceptance import AcceptancePredictor
from ..algorithm.draft import Draft
from ..algorithm.planner import CostModel, context_reads
from ..algorithm.recycling import RecycleTable
from ..algorithm.trie import NGramTrie
from ..algorithm.verify import Verdict, verify
from ..config import DecoderConfig, LookaheadConfig, SamplingParams, TrieConfig
from ..structured import CompiledGrammar, GrammarCompiler, GrammarMatcher
from .core_budget import CoreBudget, wait_until_quiet
from .generation import Generation, GenerationStats, Shared, Siblings, StepOutput
from .recycling import recycle
from .runner import PROBE_CONTEXT, ModelRunner, Work
from .scheduler import Scheduler
from .step_inputs import Segment
from .step_timing import StepTimes
from .stop_words import stop_word_ids

__all__ = ["Generation", "GenerationStats", "LookaheadDecoder", "StepOutput"]

STOP_WORDS_CACHED = 64  # distinct stop_words lists whose token ids are kept
# The share of measure_cost's budget that times the widths; the rest times reading the cache.
WIDTHS_SHARE = 0.75


class Servable(Protocol):
    """What `LookaheadDecoder.for_model` reads of a loaded model (models.loading.LoadedModel)."""

    model: Any
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    cost_prior: Mapping[int, float] | None
    linear_kernel: str


class LookaheadDecoder:
    """Shared state of all requests served by one model instance (owned by one thread).

    step_token_budget, max_speculative_batch, prefix_cache_tokens, kv_cache_bytes,
    grammar_compile_timeout_s, grammar_max_bytes, grammar_max_choices, kv_cache_dtype: see
    `DecoderConfig`.
    cost_prior: the forward's relative cost by tokens fed on this execution path, which the cost
    model starts from (`LoadedModel.cost_prior`) until `measure_cost` times the model itself;
    None: the device's default curve. kernel: the linear kernel's name (`LoadedModel.linear_kernel`),
    part of the key of each measured curve.
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
        adaptive_threads: bool = DecoderConfig.adaptive_threads,
        kv_cache_dtype: str = DecoderConfig.kv_cache_dtype,
        cost_prior: Mapping[int, float] | None = None,
        kernel: str = "stock",
    ):
        DecoderConfig(
            step_token_budget,
            max_speculative_batch,
            prefix_cache_tokens,
            kv_cache_bytes,
            grammar_compile_timeout_s,
            grammar_max_bytes,
            grammar_max_choices,
            kv_cache_dtype=kv_cache_dtype,
        )  # validates
        self.runner = ModelRunner(
            model,
            prefix_cache_tokens=prefix_cache_tokens,
            kv_cache_bytes=kv_cache_bytes,
            kv_cache_dtype=kv_cache_dtype,
            core_budget=CoreBudget(torch.get_num_threads(), watch=True) if adaptive_threads else None,
        )
        self.model = model
        self.tokenizer = tokenizer
        self.trie = trie
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        # Admission and each step's plan (the backend's engine drives its request side).
        self.scheduler: Scheduler[Any] = Scheduler(
            self.runner.fits, step_token_budget=step_token_budget, max_speculative_batch=max_speculative_batch
        )
        # A request's own trie is as deep as the shared one; copies (spans.py) may draft deeper.
        self.trie_depth = trie.max_depth if trie is not None else TrieConfig.depth
        self.device = self.runner.device
        self.vocab_size = self.runner.vocab_size
        self.context_length = self.runner.context_length
        self.kv_cache_bytes = kv_cache_bytes
        self.grammars = GrammarCompiler(
            tokenizer,
            self.eos_token_ids,
            self.vocab_size,
            grammar_compile_timeout_s,
            max_bytes=grammar_max_bytes,
            max_choices=grammar_max_choices,
        )
        # The step's cost curve per (linear kernel, threads): from the path's prior, or, once
        # measure_cost() ran, measured on this model; every curve learns from its steps.
        self.kernel = kernel
        self.prior = dict(cost_prior) if cost_prior else None
        self.costs: dict[tuple[str, int], CostModel] = {}
        self.cost_key = (kernel, torch.get_num_threads())
        # How likely the model is to accept each draft node, learned from every verdict.
        self.acceptance = AcceptancePredictor()
        # The model's own next-token candidates per token, from the verified rows of the requests
        # whose drafter reads them (config.RECYCLING_DRAFTERS).
        self.recycled = RecycleTable(self.vocab_size) if config.drafting else None
        # Where LookaheadConfig.debug lines go (the backend sends them to the server log).
        self.debug_log: Callable[[str], None] = logging.getLogger("lookahead").info
        # Called with every verified step of every request (generation, the draft fed, the
        # verdict), before the request commits it: benchmarks record steps through it.
        self.recorder: Callable[[Generation, Draft, Verdict], None] | None = None
        self._stop_words: dict[tuple[int | str, ...], frozenset[int]] = {}
        self.last_step = StepTimes()  # where the latest step's time went
        self.stop_word_ids(config.stop_words)  # a bad instance setting fails here, not in a request

    @property
    def cost(self) -> CostModel:
        """The cost model of the kernel and thread count steps run on now."""
        model = self.costs.get(self.cost_key)
        if model is None:
            model = self.costs[self.cost_key] = self._new_cost_model()
        return model

    def measure_cost(self, budget_s: float = 1.0, quiet_wait_s: float = 0.0) -> CostModel:
        """Time this model's forward at a few widths and its cache reads (about budget_s seconds,
        see ModelRunner.time_widths and time_context) and start the current curve from them,
        first waiting up to quiet_wait_s for other processes to leave the cores
        (core_budget.wait_until_quiet). Before serving: a forward's team that later shrinks or
        grows (`adaptive_threads`) starts its own curve from this one's shape and learns its
        seconds from its steps, so serving never stops to measure."""
        if quiet_wait_s > 0 and wait_until_quiet(quiet_wait_s) is None:
            self.debug_log(
                f"lookahead cost curve: other processes kept the cores busy for {quiet_wait_s:g} s; "
                "timed beside them, the steps correct it"
            )
        seconds = self.runner.time_widths(budget_s * WIDTHS_SHARE)
        if seconds:
            per_entry, per_row_entry = self.runner.time_context(budget_s * (1 - WIDTHS_SHARE)) or (0.0, 0.0)
            self.costs[self.cost_key] = CostModel.measured(seconds, PROBE_CONTEXT, per_entry, per_row_entry)
            self.debug_log(
                f"lookahead cost curve of the {self.kernel} kernel on {self.cost_key[1]} threads: "
                + ", ".join(f"{q} tokens {1000 * t:.2f} ms" for q, t in seconds.items())
                + f" (after {PROBE_CONTEXT} cached entries); each cached entry read "
                f"{1e6 * per_entry:.2f} us, again by each further row {1e6 * per_row_entry:.2f} us"
            )
        return self.cost

    def on_threads_changed(self, threads: int) -> None:
        """Steps now run on `threads` threads: plan them on that count's curve. step() notices a
        change of torch's count itself."""
        self.cost_key = (self.kernel, threads)

    def _new_cost_model(self) -> CostModel:
        """A curve for a (kernel, threads) pair not seen before: the shape and the cache reads'
        seconds measured on this kernel with another team, else the execution path's prior; its
        steps refine it."""
        for (kernel, _), measured in self.costs.items():
            if kernel == self.kernel and measured.predicted:
                return CostModel(dict(measured.prior), {}, measured.per_entry, measured.per_row_entry)
        return CostModel.for_device(self.device.type, self.prior)

    def stop_word_ids(self, words: tuple[int | str, ...]) -> frozenset[int]:
        """The token ids of LookaheadConfig.stop_words (see stop_words.py); ValueError for a bad entry."""
        if words not in self._stop_words:
            if len(self._stop_words) >= STOP_WORDS_CACHED:  # requests choose the keys: keep it bounded
                del self._stop_words[next(iter(self._stop_words))]  # the oldest
            self._stop_words[words] = stop_word_ids(words, self.tokenizer, self.vocab_size)
        return self._stop_words[words]

    @classmethod
    def for_model(
        cls,
        loaded: Servable,
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
            adaptive_threads=settings.adaptive_threads,
            kv_cache_dtype=settings.kv_cache_dtype,
            cost_prior=loaded.cost_prior,
            kernel=loaded.linear_kernel,
        )

    def start(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        lookahead: LookaheadConfig | None = None,
        request_id: str = "",
        grammar: CompiledGrammar | None = None,
        siblings: Siblings | None = None,
        checked: bool = False,
    ) -> Generation:
        """One request's generation (one sample: start_samples starts several). grammar:
        params.structured_outputs compiled (`self.grammars.compile`); the backend compiles it before
        the request reaches the engine thread and passes it here. Without it the constraint is
        compiled on the caller's thread. checked: `check_request` passed already (the backend runs
        it as it parses the request), so a request is validated once."""
        if params.samples > 1:
            raise ValueError(f"{params.samples} samples are several generations: use start_samples")
        config = lookahead or self.config
        if not checked:
            self.check_request(len(prompt_ids), params, config)
        shared = Shared(
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            device=self.device,
            trie=self.trie,
            trie_depth=self.trie_depth,
            recycled=self.recycled,
            acceptance=self.acceptance,
            stop_words=self.stop_word_ids(config.stop_words),
            debug_log=self.debug_log,
            step=lambda gen: self.step([gen])[0],
            release=self._release,
        )
        spec = params.structured_outputs
        matcher = None
        if spec is not None:
            matcher = GrammarMatcher(grammar or self.grammars.compile(spec), self.vocab_size, spec.name)
        return Generation(shared, list(prompt_ids), params, config, request_id, matcher, siblings)

    def start_samples(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        lookahead: LookaheadConfig | None = None,
        request_id: str = "",
        grammar: CompiledGrammar | None = None,
        checked: bool = False,
    ) -> list[Generation]:
        """The params.samples samples of one prompt (n, or best_of), sample i sampling with
        params.sample(i). The first reads the prompt; the others take its KV once it has, and
        every sample drafts from the others' outputs (see Siblings). checked: as for start."""
        config = lookahead or self.config
        if not checked:
            self.check_request(len(prompt_ids), params, config)
        siblings = Siblings()
        if config.drafting and (self.trie is None or not config.learn):
            capacity = (len(prompt_ids) + params.samples * params.max_tokens) * self.trie_depth + 1
            siblings.trie = NGramTrie(capacity=capacity, max_depth=self.trie_depth)
            siblings.trie.insert(list(prompt_ids))
        samples = [
            self.start(
                prompt_ids, params.sample(i), config, f"{request_id}#{i}", grammar, siblings, checked=True
            )
            for i in range(params.samples)
        ]
        siblings.leader = samples[0]
        return samples

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
        needed = self.runner.kv_bytes([self.longest(prompt_length, params, lookahead)] * params.samples)
        if self.kv_cache_bytes and needed > self.kv_cache_bytes:
            raise ValueError(
                f"the prompt ({prompt_length} tokens) and max_tokens ({params.max_tokens}) need "
                f"{needed} bytes of KV cache, more than kv_cache_bytes ({self.kv_cache_bytes})"
            )

    @staticmethod
    def longest(prompt_length: int, params: SamplingParams, lookahead: LookaheadConfig) -> int:
        """The most KV entries a request can hold: its prompt, its output and one step's draft."""
        return prompt_length + params.max_tokens + lookahead.decoding_length

    def longest_prompt(self, lookahead: LookaheadConfig) -> int | None:
        """The longest prompt this decoder can serve (with one output token): within the model's
        context length and what kv_cache_bytes holds for one request; None where neither bounds it."""
        params = SamplingParams(max_tokens=1)
        bound = self.context_length - 1 if self.context_length is not None else None
        if not self.kv_cache_bytes:
            return bound
        low, high = 0, bound if bound is not None else 1 << 24
        while low < high:  # the largest prompt whose KV fits (kv_bytes grows with the length)
            middle = (low + high + 1) // 2
            needed = self.runner.kv_bytes([self.longest(middle, params, lookahead)])
            low, high = (middle, high) if needed <= self.kv_cache_bytes else (low, middle - 1)
        return low

    def fits(self, longest: Sequence[int]) -> bool:
        """Whether requests holding at most these many entries each fit within kv_cache_bytes."""
        return self.runner.fits(longest)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one position's keys and values over all layers."""
        return self.runner.kv_bytes_per_token

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
        threads = self.runner.size_team()
        if threads != self.cost_key[1]:
            self.on_threads_changed(threads)
        cost = self.cost
        started = time.perf_counter()
        times = self.last_step = StepTimes()
        outputs: dict[int, StepOutput] = {}
        newcomers = [gen for gen in generations if gen.fed is None and not gen.awaits_leader]
        if len(newcomers) > 1:
            self.runner.make_room(len(newcomers))
        for gen in newcomers:  # they take the slots finished requests left first
            failure = _isolated(gen, lambda gen=gen: self._admit(gen))
            if failure is not None:
                outputs[id(gen)] = failure
        self.runner.pack()  # before any slot is looked up: packing moves requests between slots
        admitted = [gen for gen in generations if id(gen) not in outputs and gen.fed is not None]
        plan = self.scheduler.plan(admitted, cost)
        times.draft = plan.draft_seconds
        for gen, error in plan.failed:
            outputs[id(gen)] = _failure(gen, error)
        works = []
        for item in plan.scheduled:
            slot = self.runner.slot_of(item.request)
            works.append(Work(item.request, Segment(slot, item.start, item.chunk, item.draft), item.scoring))
        if works:
            outputs.update(self._run(works, times, cost))
        self.runner.release_idle()
        result = [outputs.get(id(gen)) or StepOutput([], "") for gen in generations]
        elapsed = time.perf_counter() - started
        times.schedule = max(0.0, elapsed - times.draft - times.forward - times.verify - times.commit)
        return result

    def _admit(self, gen: Generation) -> None:
        """Give a new generation a pool slot holding whatever prefix of its prompt the prefix cache
        has (none when its prompt is scored, every prompt position's logits being needed, nor when
        it does not learn)."""
        # The prefix cache is shared by the requests that learn: one that does not neither reads
        # nor leaves anything there (see _prompt_read), so no match crosses the two scopes.
        leader = gen.leader
        if leader is not None and leader.prefilled and not gen.scoring_prompt:  # its sibling's prompt
            cached = self.runner.admit_after(gen, leader)
        else:
            cached = self.runner.admit(gen, use_prefix_cache=gen.config.learn and not gen.scoring_prompt)
        gen.fed = cached
        gen.stats.cached_prompt_tokens = cached
        gen.started = time.perf_counter()

    def _run(self, works: list[Work], times: StepTimes, cost: CostModel) -> dict[int, StepOutput]:
        """The step's one forward, then each request's verdict and commit."""
        started = time.perf_counter()
        rows = self.runner.forward_segments(works)
        times.forward = time.perf_counter() - started
        times.requests = len(works)
        times.tokens = sum(work.segment.width for work in works)
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
                continue
            if gen.recycled is not None:
                recycle(gen.recycled, segment.draft, logits, verdicts[id(gen)].accepted_nodes)
        self.runner.keep_accepted(
            [
                (work.segment.slot, work.gen.fed, verdicts[id(work.gen)].accepted_nodes)
                for work in works
                if id(work.gen) in verdicts
            ]
        )
        elapsed = time.perf_counter() - started
        width = sum(work.segment.width for work in works)
        reads = context_reads([(work.segment.start, work.segment.width) for work in works])
        cost.observe(width, elapsed, *reads)
        # the yield is a statistic of acceptance: a step with a request that does not learn adds none
        if all(not work.segment.prompt and work.gen.config.learn for work in works):
            kept = sum(len(verdict.tokens) for verdict in verdicts.values())
            cost.observe_yield(kept, cost.price(width, *reads))
        outputs = dict(failed)
        committing = 0.0
        for work, logits in zip(works, rows):
            gen, segment = work.gen, work.segment
            verdict = verdicts.get(id(gen))
            if verdict is None:
                continue
            if not gen.stats.output_tokens:  # the draft after the prompt's last chunk
                self._prompt_read(gen)
            else:
                gen.stats.steps += 1
                gen.stats.forward_seconds.append(elapsed)
            if self.recorder is not None:
                self.recorder(gen, segment.draft, verdict)
            gen.record_verdict(segment.draft, verdict)
            chosen = logits[verdict.rows] if gen.cumulative_logprob is not None else None
            committed = time.perf_counter()
            outputs[id(gen)] = _isolated(
                gen, lambda gen=gen, verdict=verdict, chosen=chosen: gen.commit(verdict.tokens, chosen)
            )
            committing += time.perf_counter() - committed
        times.commit = committing
        times.verify = time.perf_counter() - started - times.forward - committing
        return outputs

    def _prompt_read(self, gen: Generation) -> None:
        """The prompt's last chunk was fed: keep its KV for later prompts sharing a prefix (unless
        the request has `learn` off)."""
        gen.stats.prefill_seconds = time.perf_counter() - (gen.started or time.perf_counter())
        if gen.scoring_prompt or not gen.config.learn:
            return
        # The root's entry is the prompt's last one: the first prompt_len entries are the prompt's.
        self.runner.share_prompt(gen, gen.ids[: gen.prompt_len])

    def _release(self, gen: Generation) -> None:
        """Give a generation's slot back; a request that ran to its end first leaves its prompt and
        output there for the prefix cache: a conversation's next turn sends them back as its prompt."""
        if gen.finish_reason in ("stop", "length") and gen.config.learn and not gen.scoring_prompt:
            # every committed token but the last has its KV entry (the last one was never fed)
            self.runner.keep_prompt(gen.ids[:-1], self.runner.slot_of(gen))
        self.runner.release(gen)


def _isolated(gen: Generation, work: Callable[[], StepOutput | None]) -> StepOutput | None:
    """`work` for one generation; its exception becomes that generation's failed output."""
    try:
        return work()
    except Exception as error:
        return _failure(gen, error)


def _failure(gen: Generation, error: Exception) -> StepOutput:
    gen.close("error")
    return StepOutput([], "", "error", error=error)
