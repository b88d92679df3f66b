"""Every setting of the library and its default, defined once.

`SamplingParams` (what to generate) and `LookaheadConfig` (how to speculate) are per request;
`DecoderConfig` (what a decoder's requests share) and `TrieConfig` (the instance's trie) are per
model instance. Each validates itself, so a bad value fails with a message that names the field,
whether it came from Python, a config.pbtxt parameter or a request's JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

DECODING_MODES = ("hier", "par", "one")
# "packed": the fast CPU path (lookahead/cpu); "stock": transformers' layers; "auto": packed where it runs.
LINEAR_KERNELS = ("auto", "packed", "stock")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class LookaheadConfig:
    """How drafts are retrieved and verified.

    decoding_length: most tokens fed per forward, the root (last accepted token) included.
    branch_length: most draft depth, i.e. draft tokens on any root-to-leaf path.
    max_query_length: longest context (root included) matched in the trie.
    adaptive: decode plainly when a draft is unlikely to pay for its extra forward cost.
    stop_words: tokens (ids, or strings of one token each) at which the tries start no n-gram
    of the output and from which alone (a one-token context) nothing is drafted, as in the
    reference implementation (there: punctuation and spaces).
    debug: log every step's draft size, accepted length and where the draft came from.
    """

    use_lookahead: bool = True
    decoding_length: int = 64
    branch_length: int = 32
    decoding_mode: str = "hier"
    max_query_length: int = 4
    adaptive: bool = True
    stop_words: tuple[int | str, ...] = ()
    debug: bool = False

    def __post_init__(self) -> None:
        _require(self.decoding_length >= 1, f"decoding_length must be >= 1, got {self.decoding_length}")
        _require(self.branch_length >= 0, f"branch_length must be >= 0, got {self.branch_length}")
        _require(
            self.decoding_mode in DECODING_MODES,
            f"decoding_mode must be one of {', '.join(DECODING_MODES)}, got {self.decoding_mode!r}",
        )
        _require(self.max_query_length >= 1, f"max_query_length must be >= 1, got {self.max_query_length}")
        _require(
            all(
                (isinstance(word, int) and not isinstance(word, bool) and word >= 0)
                or (isinstance(word, str) and word)
                for word in self.stop_words
            ),
            f"stop_words must hold token ids >= 0 and non-empty strings, got {list(self.stop_words)}",
        )

    @property
    def drafting(self) -> bool:
        """True when this configuration can feed draft tokens at all."""
        return self.use_lookahead and self.decoding_length > 1 and self.branch_length > 0

    def capped(self, maxima: LookaheadConfig, **overrides: Any) -> LookaheadConfig:
        """Apply per-request overrides, refusing values above the instance's maxima."""
        for name in ("decoding_length", "branch_length", "max_query_length"):
            if name in overrides and overrides[name] > getattr(maxima, name):
                raise ValueError(
                    f"{name} must be <= {getattr(maxima, name)} on this model, got {overrides[name]}"
                )
        if overrides.get("use_lookahead") and not maxima.use_lookahead:
            raise ValueError("use_lookahead cannot be enabled: this model serves without lookahead")
        return replace(self, **overrides)


@dataclass(frozen=True)
class SamplingParams:
    """What to generate; temperature 0 means greedy decoding.

    Field names follow vLLM's SamplingParams so request JSON carries over unchanged.
    """

    max_tokens: int = 128
    min_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _require(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _require(
            0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        _require(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _require(self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _require(
            self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"
        )
        _require(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def field_names(cls: type) -> tuple[str, ...]:
    """The settable field names of one of the dataclasses above."""
    return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class DecoderConfig:
    """What the requests of one decoder share.

    step_token_budget: most tokens fed per batched forward (roots included); drafts shrink as
    the batch grows. max_speculative_batch: above this many running requests, decode plainly
    (on a 2-core CPU a plain step of 8 rows already costs 1.6x one row; a GPU affords more).
    prefix_cache_tokens: prompt tokens whose KV is kept for later prompts that share a prefix
    (runtime/prefix_cache.py); 0 turns the cache off.
    """

    step_token_budget: int = 128
    max_speculative_batch: int = 3
    prefix_cache_tokens: int = 2048

    def __post_init__(self) -> None:
        _require(self.step_token_budget >= 1, f"step_token_budget must be >= 1, got {self.step_token_budget}")
        _require(
            self.max_speculative_batch >= 0,
            f"max_speculative_batch must be >= 0, got {self.max_speculative_batch}",
        )
        _require(
            self.prefix_cache_tokens >= 0, f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}"
        )


@dataclass(frozen=True)
class TrieConfig:
    """The instance's n-gram trie: a hard node bound and the longest n-gram it stores (a matched
    query plus the branch drafted after it)."""

    capacity: int = 1_000_000
    depth: int = 16
