"""One request's generation: its history, its sampler, its drafter.

The decoder (decoder.py) drives each running generation through the steps a Lookahead step has:
`retrieve` a draft (from the request's drafter, algorithm/drafters), the runner's one forward,
`record_verdict` on what the model accepted, `commit` the accepted tokens. Until its prompt is
fed (in chunks, beside the other requests' steps), a generation only counts how much of it the
KV pool holds (`fed`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..algorithm.acceptance import AcceptancePredictor
from ..algorithm.backoff import DraftBackoff
from ..algorithm.draft import FROM_GRAMMAR, Draft
from ..algorithm.drafters import Drafter, DraftQuery, DraftRequest, make_drafter
from ..algorithm.recycling import PrivateRecycles, Recycles, RecycleTable
from ..algorithm.trie import NGramTrie, TrieWriter
from ..algorithm.verify import Verdict
from ..config import RECYCLING_DRAFTERS, LookaheadConfig, SamplingParams
from .detokenizer import Detokenizer
from .logprobs import PositionLogprobs, token_logprobs
from .sampling import TokenSelector

if TYPE_CHECKING:
    from ..structured import GrammarMatcher


@dataclass
class StepOutput:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # None while running, else "stop", "length", "cancelled" or "error"
    logprobs: list[PositionLogprobs] | None = None  # one per token, when params.logprobs is set
    error: Exception | None = None  # why the request failed (finish_reason "error"); the others went on
    # The text each token added, as plain decoding streams it (one per token; joined, `text`).
    token_texts: list[str] = field(default_factory=list)


@dataclass
class GenerationStats:
    prompt_tokens: int
    output_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    steps: int = 0  # decoding forwards after the prefill
    draft_tokens: int = 0  # draft tokens fed (roots excluded)
    drafts: int = 0  # forwards that fed at least one draft token
    accepted_draft_tokens: int = 0
    prefill_seconds: float = 0.0  # from the first step to the prompt's last chunk
    forward_seconds: list[float] = field(default_factory=list)
    retrieval_seconds: list[float] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per decoding forward (1.0 for plain decoding)."""
        return (self.output_tokens - 1) / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class Shared:
    """What a generation reads of the decoder serving it."""

    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    device: torch.device
    trie: NGramTrie | None  # the instance's global trie
    trie_depth: int
    recycled: RecycleTable | None  # the model's recycled candidates (algorithm/recycling.py)
    acceptance: AcceptancePredictor  # the decoder's, learned from every request
    stop_words: frozenset[int]
    debug_log: Callable[[str], None]
    step: Callable[[Generation], StepOutput]  # one decoder step of this generation alone
    release: Callable[[Generation], None]  # gives the generation's KV slot back


@dataclass
class Siblings:
    """The samples of one prompt (SamplingParams n, best_of), started together: the leader reads
    the prompt, the others take its KV once it has (so the prompt is read once); `trie`, where the
    instance's trie does not learn their outputs, holds the prompt and every sample's output, so
    that each sample drafts from the others' (there, the instance's trie does it)."""

    leader: Generation | None = None
    trie: NGramTrie | None = None


class Generation:
    """One request: its prompt fed in chunks, then one (possibly speculative) forward per step."""

    def __init__(
        self,
        shared: Shared,
        prompt_ids: list[int],
        params: SamplingParams,
        config: LookaheadConfig,
        request_id: str = "",
        grammar: GrammarMatcher | None = None,
        siblings: Siblings | None = None,
    ):
        self.shared = shared
        self.siblings = siblings
        self.request_id = request_id  # names the request in the debug log
        self.params = params
        self.config = config
        self.ids = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.finish_reason: str | None = None
        # Prompt entries the KV pool holds (the last prompt token's comes with the first draft);
        # None until the decoder gives the generation a slot.
        self.fed: int | None = None
        self.started: float | None = None
        eos = () if params.ignore_eos else shared.eos_token_ids
        self.stop_tokens = frozenset(eos) | frozenset(params.stop_token_ids)  # tokens that end the output
        # How likely each draft node is accepted; with `learn` off the instance's predictor is only read.
        self.acceptance = shared.acceptance.for_request(teaches=config.learn)
        # The table this request drafts from and writes its verified rows into, where its drafter
        # reads one: with `learn` off, rows of its own over the instance's (nothing shared learns
        # from a private request).
        self.recycled: Recycles | None = shared.recycled if config.drafter in RECYCLING_DRAFTERS else None
        if self.recycled is not None and shared.recycled is not None and not config.learn:
            self.recycled = PrivateRecycles(shared.recycled)
        # min_tokens keeps EOS out even with ignore_eos, as vLLM does.
        suppressed = (*shared.eos_token_ids, *params.stop_token_ids)
        self.selector = TokenSelector(params, prompt_ids, suppressed, shared.device, grammar)
        self.detokenizer = Detokenizer(
            shared.tokenizer,
            prompt_ids,
            params.stop,
            include_stop=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            min_tokens=params.min_tokens,
        )
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.stop_words = shared.stop_words
        self.drafter: Drafter | None = None
        self.retrieved: Draft | None = None  # the latest draft retrieved, before the step's plan trimmed it
        # Rests from looking for drafts while they keep failing to pay (adaptive requests only).
        self.backoff = DraftBackoff() if config.adaptive else None
        self.looked = False  # this step's draft came from the drafter (its verdict feeds `backoff`)
        if config.drafting:
            self.drafter = make_drafter(
                DraftRequest(
                    prompt_ids,
                    params.max_tokens,
                    config,
                    shared.trie,
                    shared.trie_depth,
                    self.stop_tokens,
                    self.stop_words,
                    recycled=self.recycled,
                    siblings=siblings.trie if siblings is not None else None,
                )
            )
        # The shared trie learns outputs, keyed by the prompt's last tokens so that they can be queried.
        self.learner: TrieWriter | None = None
        if shared.trie is not None and config.learn:
            self.learner = shared.trie.writer()
            self.learner.feed(
                prompt_ids[max(0, self.prompt_len - config.max_query_length + 1) :], self.stop_words
            )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.prompt_len :]

    @property
    def root(self) -> int:
        """Position of the last prompt token: the first draft's root."""
        return self.prompt_len - 1

    @property
    def prefilled(self) -> bool:
        """The whole prompt but its last token is in the pool: the next step drafts."""
        return self.fed is not None and self.fed >= self.root

    @property
    def leader(self) -> Generation | None:
        """The sibling whose prompt KV this sample takes (None: it reads its own prompt)."""
        leader = self.siblings.leader if self.siblings is not None else None
        return None if leader is self else leader

    @property
    def awaits_leader(self) -> bool:
        """Its leader is still reading the prompt (a finished one leaves this sample to read it)."""
        leader = self.leader
        return leader is not None and not leader.finished and not leader.prefilled

    @property
    def scoring_prompt(self) -> bool:
        """Prompt logprobs are asked for: every prompt position's logits are needed."""
        return self.params.prompt_logprobs is not None

    def step(self) -> StepOutput:
        """Advance this generation alone (the engine batches through decoder.step)."""
        return self.shared.step(self)

    def close(self, reason: str = "cancelled") -> None:
        """Free the KV slot and the request's own trie (finished, cancelled, failed or abandoned)."""
        if self.fed is not None:
            self.shared.release(self)
            self.fed = None
        self.drafter, self.learner, self.recycled = None, None, None
        if self.finish_reason is None:
            self.finish_reason = reason

    def score_prompt(self, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens after the rows of `logits`, the next ones of the prompt."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has nothing before it
        start = len(self.prompt_logprobs)
        tokens = self.ids[start : start + len(logits)]
        decode = self._decode_one
        self.prompt_logprobs += token_logprobs(logits, tokens, self.params.prompt_logprobs, decode)

    def _decode_one(self, token: int) -> str:
        return self.shared.tokenizer.decode([token])

    def retrieve(self, max_width: int, min_prob: float = 0.0) -> Draft:
        """The draft this request would like to verify next, at most max_width nodes, none less
        probable than min_prob (the batch plan may trim it further)."""
        root = self.ids[-1]
        depth = min(self.config.branch_length, self.params.max_tokens - self.stats.output_tokens - 1)
        if self.drafter is None or depth <= 0:
            return Draft.root_only(root)
        started = time.perf_counter()
        width = min(self.config.decoding_length, max_width)
        grammar = self.selector.grammar
        # Text the grammar fixes next is drafted as certain, and the drafter goes on after it.
        forced = grammar.forced()[: min(depth, width - 1)] if grammar is not None else []
        width, depth = width - len(forced), depth - len(forced)
        self.looked = False
        if width <= 1 or depth <= 0 or (not forced and self.backoff is not None and not self.backoff.looks()):
            draft = Draft.root_only(forced[-1] if forced else root)
        else:
            self.looked = True
            admits = None
            if grammar is not None:
                # nodes the grammar forbids would only be rejected: search among those it admits
                admits = (lambda path: grammar.admits((*forced, *path))) if forced else grammar.admits
            draft = self.drafter.retrieve(DraftQuery(self.ids, forced, width, depth, min_prob, admits))
        if forced:
            draft = Draft.below_chain(root, forced, FROM_GRAMMAR, draft)
        self.stats.retrieval_seconds.append(time.perf_counter() - started)
        self.retrieved = draft
        return draft

    def record_verdict(self, draft: Draft, verdict: Verdict) -> None:
        """Count the draft's fed and accepted tokens, and learn acceptance from them."""
        if len(draft) > 1:
            self.acceptance.observe(draft, verdict.accepted_nodes)
        self.stats.draft_tokens += len(draft) - 1
        self.stats.drafts += len(draft) > 1
        self.stats.accepted_draft_tokens += len(verdict.accepted_nodes)
        if self.drafter is not None:
            self.drafter.record_verdict(draft, verdict)
        if self.looked and self.backoff is not None:
            self.backoff.observe(len(verdict.accepted_nodes))
            self.looked = False
        if self.config.debug:
            origins = ", ".join(f"{name} {count}" for name, count in draft.origin_counts().items())
            step = f"step {self.stats.steps}" if self.stats.steps else "prefill"
            self.shared.debug_log(
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
        texts = []
        for token in shown:  # token by token: each one's text as plain decoding streams it
            texts.append(self.detokenizer.push([token])[0])
            if self.detokenizer.stopped:
                tokens, stop_at = tokens[: len(texts)], None
                break
        texts += [""] * (len(tokens) - len(texts))  # an end token whose text is left out
        self.ids.extend(tokens)
        self.retrieved = None
        self.stats.output_tokens += len(tokens)
        self.selector.commit(tokens)
        learned = tokens[:stop_at] if stop_at is not None else tokens
        if self.drafter is not None:
            self.drafter.extend(learned)
        if self.learner is not None:
            self.learner.feed(learned, self.stop_words)
        logprobs = None
        if self.cumulative_logprob is not None and rows is not None:
            logprobs = token_logprobs(rows[: len(tokens)], tokens, params.logprobs, self._decode_one)
            self.cumulative_logprob += sum(position[t].logprob for position, t in zip(logprobs, tokens))
        if stop_at is not None or self.detokenizer.stopped:
            self.finish_reason = "stop"
        elif self.stats.output_tokens >= params.max_tokens:
            self.finish_reason = "length"
        if self.finished:
            texts[-1] += self.detokenizer.flush()  # a step commits at least one token
            self.close()
        return StepOutput(tokens, "".join(texts), self.finish_reason, logprobs, token_texts=texts)
