"""One request's generation: its history, its sampler, its own trie and span index.

The decoder (decoder.py) drives every running generation through the same four steps a
Lookahead step has: `retrieve` a draft, the decoder's one forward, `record_verdict` on what the
model accepted, `commit` the accepted tokens. A generation's first step is its `prefill`: the
prompt (less what the decoder's prefix cache holds) and a draft of what follows it, in one forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from ..algorithm.draft import Draft
from ..algorithm.planner import Calibration, plan_step
from ..algorithm.retrieval import retrieve_draft
from ..algorithm.spans import SpanIndex
from ..algorithm.trie import NGramTrie, TrieWriter
from ..algorithm.verify import Verdict, verify
from ..config import LookaheadConfig, SamplingParams
from .detokenizer import Detokenizer
from .kv_pool import accepted_moves
from .logprobs import PositionLogprobs, token_logprobs
from .sampling import TokenSelector
from .step_inputs import prefill_inputs, to_device

if TYPE_CHECKING:
    from .decoder import LookaheadDecoder

# A request's own acceptance history soon outweighs the decoder's shared one.
REQUEST_CALIBRATION_RATE = 0.15


@dataclass
class StepOutput:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # None while running, else "stop", "length", "cancelled" or "error"
    logprobs: list[PositionLogprobs] | None = None  # one per token, when params.logprobs is set
    error: Exception | None = None  # why the request failed (finish_reason "error"); the others went on


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


class Generation:
    """One request: prefill on its first step, then one (possibly speculative) forward per step."""

    def __init__(
        self,
        decoder: LookaheadDecoder,
        prompt_ids: list[int],
        params: SamplingParams,
        config: LookaheadConfig,
        request_id: str = "",
    ):
        self.decoder = decoder
        self.request_id = request_id  # names the request in the debug log
        self.params = params
        self.config = config
        self.ids = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.finish_reason: str | None = None
        self.in_pool = False  # holds a KV pool slot (prefilled and not yet finished)
        eos = () if params.ignore_eos else decoder.eos_token_ids
        self.stop_tokens = frozenset(eos) | frozenset(params.stop_token_ids)  # tokens that end the output
        shared = decoder.calibration
        self.calibration = Calibration(shared.ratio, shared.side_ratio, rate=REQUEST_CALIBRATION_RATE)
        # min_tokens keeps EOS out even with ignore_eos, as vLLM does.
        suppressed = (*decoder.eos_token_ids, *params.stop_token_ids)
        grammar = decoder.grammar_matcher(params.structured_outputs)
        self.selector = TokenSelector(params, prompt_ids, suppressed, decoder.device, grammar)
        self.detokenizer = Detokenizer(
            decoder.tokenizer,
            prompt_ids,
            params.stop,
            include_stop=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            min_tokens=params.min_tokens,
        )
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.local: NGramTrie | None = None
        self.spans: SpanIndex | None = None
        self.writers: list[TrieWriter] = []
        self.stop_words = decoder.stop_word_ids(config.stop_words)
        if config.drafting:
            # The output is learned once: by the shared trie when there is one. Counted in the
            # request's own trie as well, whatever the output has just copied from the prompt
            # would count twice there and outrank the prompt's own evidence.
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
            self.writers[-1].feed(
                prompt_ids[max(0, self.prompt_len - config.max_query_length + 1) :], self.stop_words
            )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.prompt_len :]

    def step(self) -> StepOutput:
        """Advance this generation alone (the engine batches through decoder.step)."""
        return self.decoder.step([self])[0]

    def close(self, reason: str = "cancelled") -> None:
        """Free the KV slot and the request's own trie (finished, cancelled, failed or abandoned)."""
        if self.in_pool:
            self.decoder.pool.release(self)
            self.in_pool = False
        self.local, self.spans, self.writers = None, None, []
        if self.finish_reason is None:
            self.finish_reason = reason

    def prefill(self, drafting: bool) -> StepOutput:
        """Feed the prompt, less any prefix the prefix cache holds, and in the same forward (when
        `drafting`) a draft of what follows it.

        Tokens accepted here need no decoding step. A draft token adds about as much to a
        prefill as to a small decoding step, so the draft is trimmed as a step's would be.
        """
        started = time.perf_counter()
        decoder = self.decoder
        root = self.prompt_len - 1  # the prompt's last token is the draft's root
        draft = Draft.root_only(self.ids[-1])
        if drafting:
            (draft,) = plan_step(
                [self.retrieve(decoder.step_token_budget)],
                [self.calibration],
                [self.config.adaptive],
                decoder.cost,
                decoder.step_token_budget,
            )
        # Prompt logprobs need every prompt position's logits: a cached prefix would have none.
        scoring = self.params.prompt_logprobs is not None
        cached, cache = decoder.prefix_cache.lookup(self.ids) if not scoring else (0, DynamicCache())
        inputs: dict[str, Any] = {"cache": cache, "use_cache": True}
        if len(draft) > 1:
            positions, mask = prefill_inputs(draft, root, cached, decoder.masks)
            inputs["position_ids"] = positions[None].to(decoder.device)
            inputs["attention_mask"] = to_device(mask, decoder.device)
        ids = torch.tensor([self.ids[cached:root] + draft.tokens], device=decoder.device)
        earlier = self._score_prompt if scoring else None
        logits = decoder.last_logits(len(draft), on_earlier_logits=earlier, input_ids=ids, **inputs)
        verdict = verify(draft, logits, self.selector)
        decoder.prefix_cache.store(self.ids, cache)
        self.stats.cached_prompt_tokens = cached
        slot = decoder.pool.admit(self, cache)
        self.in_pool = True
        decoder.pool.compact(accepted_moves(slot, root, verdict.accepted_nodes))
        self.record_verdict(draft, verdict)
        self.stats.prefill_seconds = time.perf_counter() - started
        return self.commit(
            verdict.tokens, logits[verdict.rows] if self.cumulative_logprob is not None else None
        )

    def _score_prompt(self, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens after the rows of `logits`, the next ones of the prompt."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has nothing before it
        start = len(self.prompt_logprobs)
        tokens = self.ids[start : start + len(logits)]
        decode = self._decode_one
        self.prompt_logprobs += token_logprobs(logits, tokens, self.params.prompt_logprobs, decode)

    def _decode_one(self, token: int) -> str:
        return self.decoder.tokenizer.decode([token])

    def retrieve(self, max_width: int) -> Draft:
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
            stop_tokens=self.stop_tokens,
            stop_words=self.stop_words,
        )
        if self.selector.grammar is not None:  # nodes the grammar forbids would only be rejected
            draft = self.selector.grammar.prune(draft)
        self.stats.retrieval_seconds.append(time.perf_counter() - started)
        return draft

    def record_verdict(self, draft: Draft, verdict: Verdict) -> None:
        """Count the draft's fed and accepted tokens, and calibrate its probabilities against them."""
        if len(draft) > 1:
            for calibration in (self.decoder.calibration, self.calibration):
                calibration.observe(draft, verdict.accepted_nodes)
        self.stats.draft_tokens += len(draft) - 1
        self.stats.accepted_draft_tokens += len(verdict.accepted_nodes)
        if self.config.debug:
            origins = ", ".join(f"{name} {count}" for name, count in draft.origin_counts().items())
            step = f"step {self.stats.steps}" if self.stats.steps else "prefill"
            self.decoder.debug_log(
                f"lookahead request {self.request_id or id(self)} {step}: draft "
                f"{len(draft) - 1} tokens ({origins}), accepted {len(verdict.accepted_nodes)}"
            )

    def commit(self, tokens: list[int], rows: torch.Tensor | None = None) -> StepOutput:
        """Append the step's tokens as plain decoding would have produced them: up to max_tokens, a
        stop token or the token that completes a stop string, and not one beyond. Feed the tries,
        the sampler and the detokenizer with exactly those. rows: the logits each token was chosen
        from (for logprobs)."""
        params = self.params
        tokens = tokens[: params.max_tokens - self.stats.output_tokens]
        stop_at = next((i for i, t in enumerate(tokens) if t in self.stop_tokens), None)
        if stop_at is not None:
            tokens = tokens[: stop_at + 1]
        # The stop token's own text is left out unless include_stop_str_in_output (vLLM's rule).
        shown = tokens if stop_at is None or params.include_stop_str_in_output else tokens[:-1]
        text, consumed = self.detokenizer.push(shown)
        if self.detokenizer.stopped:
            tokens, stop_at = tokens[:consumed], None
        self.ids.extend(tokens)
        self.stats.output_tokens += len(tokens)
        self.selector.commit(tokens)
        for writer in self.writers:
            writer.feed(tokens[:stop_at] if stop_at is not None else tokens, self.stop_words)
        if self.spans is not None:
            self.spans.extend(tokens)
        logprobs = None
        if self.cumulative_logprob is not None and rows is not None:
            logprobs = token_logprobs(rows[: len(tokens)], tokens, params.logprobs, self._decode_one)
            self.cumulative_logprob += sum(position[t].logprob for position, t in zip(logprobs, tokens))
        if stop_at is not None or self.detokenizer.stopped:
            self.finish_reason = "stop"
        elif self.stats.output_tokens >= params.max_tokens:
            self.finish_reason = "length"
        if self.finished:
            text += self.detokenizer.flush()
            self.close()
        return StepOutput(tokens, text, self.finish_reason, logprobs)
