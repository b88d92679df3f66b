"""Lookahead decoding: retrieve a draft tree, verify it in one forward, keep what the model agrees with.

One `Generation` per request (generation.py) holds its token history, its sampler and its own
trie (its prompt; its output too when there is no global trie). The decoder holds what requests
share: the model, the KV pool, the global trie that learns from every generated token, and the
online cost model that decides how much drafting pays. `decoder.step(generations)` advances any
number of requests with one forward: each contributes its root token and its draft tree, padded
to a common width.

    gen = decoder.start(prompt_ids, SamplingParams(max_tokens=64))
    while not gen.finished:
        out = gen.step()          # accepted token ids and the new text of this step
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from ..algorithm.draft import Draft
from ..algorithm.planner import Calibration, CostModel, plan_step
from ..algorithm.trie import NGramTrie
from ..algorithm.verify import verify
from ..config import DecoderConfig, LookaheadConfig, SamplingParams, TrieConfig
from .generation import Generation, GenerationStats, StepOutput
from .kv_pool import KVPool, accepted_moves, pow2
from .output_layer import plain_output_layer
from .prefix_cache import PrefixCache
from .step_inputs import AttentionMasks, decode_inputs, to_device
from .stop_words import stop_word_ids

if TYPE_CHECKING:
    from ..models.loading import LoadedModel

__all__ = ["Generation", "GenerationStats", "LookaheadDecoder", "StepOutput"]

STOP_WORDS_CACHED = 64  # distinct stop_words lists whose token ids are kept

# Prompt positions whose logits exist at once when prompt logprobs are scored (rows x vocab floats).
_SCORED_ROWS = 256
# The trie's probabilities overstate acceptance about threefold until calibrated (the shared
# ratio settles at 0.3-0.4 on every benchmark set), so a cold decoder starts there.
INITIAL_CALIBRATION = 0.35


class LookaheadDecoder:
    """Shared state of all requests served by one model instance (owned by one thread).

    step_token_budget, max_speculative_batch, prefix_cache_tokens, kv_cache_bytes: see `DecoderConfig`.
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
        cost_prior: Mapping[int, float] | None = None,
    ):
        DecoderConfig(
            step_token_budget, max_speculative_batch, prefix_cache_tokens, kv_cache_bytes
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
        self._kv_bytes_per_token: int | None = None
        self.pool = KVPool()
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.cost = CostModel.for_device(self.device.type, dict(cost_prior) if cost_prior else None)
        # With a plain output layer, forwards run the decoder and the layer apart (fewer wrappers,
        # and no logits for padding rows).
        self.head_of_hidden = plain_output_layer(model)
        self.inner = model.get_decoder() if self.head_of_hidden is not None else None
        self.calibration = Calibration(INITIAL_CALIBRATION, INITIAL_CALIBRATION)
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
            cost_prior=loaded.cost_prior,
        )

    def start(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        lookahead: LookaheadConfig | None = None,
        request_id: str = "",
    ) -> Generation:
        self.check_request(len(prompt_ids), params, lookahead or self.config)
        return Generation(self, list(prompt_ids), params, lookahead or self.config, request_id)

    def check_request(self, prompt_length: int, params: SamplingParams, lookahead: LookaheadConfig) -> None:
        """Raise ValueError for a request this decoder can never serve: an empty prompt, token ids
        outside the vocabulary, stop_words the tokenizer cannot resolve, more tokens than the model's
        context, more KV than kv_cache_bytes."""
        if prompt_length < 1:
            raise ValueError("the prompt must contain at least one token")
        params.check_vocabulary(self.vocab_size)
        self.stop_word_ids(lookahead.stop_words)
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
        """Bytes of the KV pool holding requests that hold at most these many entries each."""
        if not longest:
            return 0
        return len(longest) * pow2(max(longest)) * self.kv_bytes_per_token

    def fits(self, longest: Sequence[int]) -> bool:
        """Whether requests holding at most these many entries each fit within kv_cache_bytes."""
        return not self.kv_cache_bytes or self.kv_bytes(longest) <= self.kv_cache_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one position's keys and values over all layers (measured once, on one token)."""
        if self._kv_bytes_per_token is None:
            cache = DynamicCache()
            with torch.inference_mode():
                self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), cache=cache)
            self._kv_bytes_per_token = sum(
                layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None
            )
        return self._kv_bytes_per_token

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
        """Advance every generation by one step: prefill the new ones, decode the rest together.

        A request whose own work fails (its draft, its sampler, its text) ends with an output whose
        `error` says why, finish_reason "error"; the others are unaffected. A failure of the shared
        forward is raised, before any request has committed anything, so the caller may step
        each request alone again.
        """
        if any(gen.finished for gen in generations):
            raise RuntimeError("step() called on a finished or closed generation")
        # A prefill's draft pays only when the steps it saves are the request's own: in a batch
        # above max_speculative_batch every step runs for the others anyway.
        drafting = len(generations) <= self.max_speculative_batch
        outputs = {}
        for gen in generations:
            if not gen.in_pool:
                outputs[id(gen)] = _isolated(gen, lambda gen=gen: gen.prefill(drafting))
        running = [gen for gen in generations if id(gen) not in outputs]
        if running:
            running = self.pool.arrange(running, max(len(gen.ids) - 1 for gen in running))
            outputs.update(zip(map(id, running), self._decode(running)))
        self._fit_pool()
        return [outputs[id(gen)] for gen in generations]

    def _fit_pool(self) -> None:
        """Give memory back: all of it when no request runs, the excess when over kv_cache_bytes."""
        if self.pool.idle:
            self.pool.free()
        elif self.kv_cache_bytes and self.pool.nbytes > self.kv_cache_bytes:
            held = [len(gen.ids) for gen in self.pool.owners if gen is not None]
            self.pool.shrink(max(held) + self.step_token_budget)

    def _decode(self, gens: list[Generation]) -> list[StepOutput]:
        """One forward for `gens`, which hold pool slots 0..k-1 in this order (see KVPool.arrange)."""
        failed: dict[int, StepOutput] = {}
        if len(gens) > self.max_speculative_batch:
            drafts = [Draft.root_only(gen.ids[-1]) for gen in gens]
        else:
            # The step's budget caps every draft (see plan_step): build no node it would trim.
            width = max(1, self.step_token_budget // len(gens))
            drafts = []
            for gen in gens:
                try:
                    drafts.append(gen.retrieve(width))
                except Exception as error:  # this request fails; its row still runs, unread
                    failed[id(gen)] = _failure(gen, error)
                    drafts.append(Draft.root_only(gen.ids[-1]))
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
        verdicts = {}
        for gen, draft, rows in zip(gens, drafts, logits):
            if id(gen) not in failed:
                try:
                    verdicts[id(gen)] = verify(draft, rows, gen.selector)
                except Exception as error:
                    failed[id(gen)] = _failure(gen, error)
        self.pool.compact(
            [
                move
                for slot, (gen, length) in enumerate(zip(gens, lengths))
                if id(gen) in verdicts
                for move in accepted_moves(slot, length, verdicts[id(gen)].accepted_nodes)
            ]
        )
        elapsed = time.perf_counter() - started
        width = max(len(d) for d in drafts)
        self.cost.observe(len(gens) * width, elapsed)
        outputs = []
        for gen, draft, rows in zip(gens, drafts, logits):
            verdict = verdicts.get(id(gen))
            if verdict is None:
                outputs.append(failed[id(gen)])
                continue
            gen.stats.steps += 1
            gen.record_verdict(draft, verdict)
            gen.stats.forward_seconds.append(elapsed)
            chosen = rows[verdict.rows] if gen.cumulative_logprob is not None else None
            outputs.append(
                _isolated(
                    gen, lambda gen=gen, verdict=verdict, chosen=chosen: gen.commit(verdict.tokens, chosen)
                )
            )
        return outputs

    def forward_drafts(self, drafts: list[Draft], lengths: list[int]) -> list[torch.Tensor]:
        """Logits [len(drafts[i]), vocab] of pool slot i's draft, fed after its lengths[i] cached entries.

        Writes the drafts' KV entries but commits nothing, so the same call can be repeated.
        """
        k, width = len(drafts), max(len(d) for d in drafts)
        ids, positions, mask = decode_inputs(drafts, lengths, self.masks)
        inputs = {
            "input_ids": ids.to(self.device),
            "position_ids": positions.to(self.device),
            "attention_mask": to_device(mask, self.device),
            "cache": self.pool.step_cache(lengths, width),
            "use_cache": True,
        }
        sizes = [len(d) for d in drafts]
        if self.head_of_hidden is None:
            logits = self.model(**inputs).logits
            return [row[:n] for row, n in zip(logits, sizes)]
        # The decoder's hidden states, then the output layer on the real rows only: padding rows'
        # logits would never be read.
        hidden = self.inner(**inputs).last_hidden_state
        if sum(sizes) == k * width:
            rows = hidden.reshape(k * width, hidden.shape[-1])
        else:
            rows = torch.cat([hidden[i, :n] for i, n in enumerate(sizes)])
        return list(self.head_of_hidden(rows).split(sizes))

    def last_logits(
        self, keep: int, *, on_earlier_logits: Callable[[torch.Tensor], None] | None = None, **inputs: Any
    ) -> torch.Tensor:
        """Logits [keep, vocab] of the last `keep` positions of a one-row forward (a prefill).

        on_earlier_logits: called with the logits of the positions before them, in order, a block
        of rows at a time (prompt logprobs), from the same forward.
        """
        if on_earlier_logits is None:
            if self.head_of_hidden is None:
                return self.model(**inputs, logits_to_keep=keep).logits[0]
            hidden = self.inner(**inputs).last_hidden_state
            return self.head_of_hidden(hidden[0, -keep:])
        if self.head_of_hidden is None:
            logits = self.model(**inputs, logits_to_keep=0).logits[0]
            if len(logits) > keep:
                on_earlier_logits(logits[:-keep])
            return logits[-keep:]
        hidden = self.inner(**inputs).last_hidden_state[0]
        for block in hidden[:-keep].split(_SCORED_ROWS):
            on_earlier_logits(self.head_of_hidden(block))
        return self.head_of_hidden(hidden[-keep:])


def _isolated(gen: Generation, work: Callable[[], StepOutput]) -> StepOutput:
    """`work` for one generation; its exception becomes that generation's failed output."""
    try:
        return work()
    except Exception as error:
        return _failure(gen, error)


def _failure(gen: Generation, error: Exception) -> StepOutput:
    gen.close("error")
    return StepOutput([], "", "error", error=error)
