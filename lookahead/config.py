"""Every setting of the library and its default, defined once.

`SamplingParams` (what to generate) and `LookaheadConfig` (how to speculate) are per request;
`DecoderConfig` (what a decoder's requests share) and `TrieConfig` (the instance's trie) are per
model instance. Each validates itself, so a bad value fails with a message that names the field,
whether it came from Python, a config.pbtxt parameter or a request's JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

DECODING_MODES = ("hier", "par", "one")
# What proposes drafts (lookahead/algorithm/drafters: one module each, registered under its name).
DRAFTER_NAMES = ("trie", "hybrid", "recycled")
# The drafters that read the model's recycled candidates: only their requests pay for keeping the
# recycle table (one top-k over the vocabulary per verified row).
RECYCLING_DRAFTERS = frozenset({"hybrid", "recycled"})
# The fast CPU path (lookahead/cpu): "integer" multiplies int8 activations with the integer forms of
# quantised weights (llama.cpp's arithmetic) in fused layers; "packed" keeps fp32 activations and
# computes transformers' own bits. "stock": transformers' layers. "auto": integer where the fast path
# runs, else stock.
LINEAR_KERNELS = ("auto", "integer", "packed", "stock")
# What the KV pool stores: "model" entries of the model's dtype; "float16" IEEE halves, half the
# memory a position takes (llama.cpp's default cache type), on the integer path's fused layers only.
KV_CACHE_DTYPES = ("model", "float16")


SHOWN_CHARS = 80  # most characters of a value an error message quotes


def shown(value: Any, as_json: bool = False) -> str:
    """A value as an error message quotes it: its repr (or JSON), elided past SHOWN_CHARS with its
    length, so a megabyte of client input is named, never echoed."""
    text = _json_text(value) if as_json else repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[: SHOWN_CHARS - 20]}...{text[-12:]} ({len(text)} characters)"


def _json_text(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return repr(value)


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
    learn: whether the request's output feeds the instance's global trie (and, with fleet sync,
    every instance's); off, it still drafts from what the trie knows.
    drafter: which drafter proposes the drafts (one of DRAFTER_NAMES; "trie": the request's own
    trie, the shared trie and the request's copy of its longest earlier repeat; "hybrid": those,
    and the model's recycled next-token candidates where they leave probability unclaimed;
    "recycled": the model's recycled candidates alone).
    """

    use_lookahead: bool = True
    decoding_length: int = 64
    branch_length: int = 32
    decoding_mode: str = "hier"
    max_query_length: int = 4
    adaptive: bool = True
    stop_words: tuple[int | str, ...] = ()
    debug: bool = False
    learn: bool = True
    drafter: str = "trie"

    def __post_init__(self) -> None:
        _require(self.decoding_length >= 1, f"decoding_length must be >= 1, got {self.decoding_length}")
        _require(self.branch_length >= 0, f"branch_length must be >= 0, got {self.branch_length}")
        _require(
            self.decoding_mode in DECODING_MODES,
            f"decoding_mode must be one of {', '.join(DECODING_MODES)}, got {shown(self.decoding_mode)}",
        )
        _require(
            self.drafter in DRAFTER_NAMES,
            f"drafter must be one of {', '.join(DRAFTER_NAMES)}, got {shown(self.drafter)}",
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


# vLLM raises a positive temperature below this to it (smaller ones overflow the softmax).
MIN_TEMPERATURE = 1e-2
# seed: any signed or unsigned 64-bit integer (what torch.Generator.manual_seed takes); -1 is unseeded.
SEED_RANGE = (-(2**63), 2**64)
# Bounds that keep one request's per-step work small for everyone sharing the engine thread.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_TOKEN_ID_LIST = 4096  # stop_token_ids and logit_bias entries
MAX_LOGPROBS = 20  # vLLM's default max_logprobs, OpenAI's top_logprobs bound
MAX_LOGIT_BIAS = 100  # OpenAI's and vLLM's bound; larger ones overflow the logits
# Dividing a logit by a penalty near 0 overflows fp32 into inf/nan; beyond these bounds a penalty
# changes nothing more anyway.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_STOP_WORDS = 256  # stop_words entries; each one is looked up in the tokenizer
MAX_SAMPLES = 16  # n and best_of: each sample is a request of its own in the engine


def _number(name: str, value: Any, *, integer: bool = False) -> Any:
    """`value` as a float (or an int), refusing booleans, non-numbers and, for floats, nan/inf."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind}, got {shown(value)}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{name} must be an integer, got {shown(value)}")
        return int(value)
    value = float(value)
    _require(math.isfinite(value), f"{name} must be a finite number, got {value}")
    return value


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output, as vLLM's structured_outputs names it: `kind` is one of
    STRUCTURED_KINDS and `text` its source (a JSON schema as JSON text, a regex, the choices as a
    JSON list of strings, a Lark or GBNF grammar; empty for json_object). any_whitespace: JSON may
    hold any whitespace between tokens (vLLM's default; disable_any_whitespace turns it off).
    key: the request key it came from, so that a compile error names it.
    """

    kind: str
    text: str = ""
    any_whitespace: bool = True
    key: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        _require(
            self.kind in STRUCTURED_KINDS,
            f"structured_outputs must set one of {', '.join(STRUCTURED_KINDS)}, got {shown(self.kind)}",
        )

    @property
    def name(self) -> str:
        """The request key that set it, e.g. structured_outputs.json, for messages."""
        return (
            f"{self.key}.{self.kind}" if self.key in ("structured_outputs", "guided_decoding") else self.key
        )


@dataclass(frozen=True)
class SamplingParams:
    """What to generate, with vLLM's SamplingParams names and semantics; temperature 0 is greedy.

    Token choice at each position, in vLLM's order: min_tokens (EOS and stop_token_ids masked
    while fewer than min_tokens tokens were generated), logit_bias (added), repetition_penalty
    (over the prompt and the output: positive logits divided, others multiplied),
    frequency_penalty and presence_penalty (over the output: count and presence subtracted);
    then argmax, or temperature, min_p, top_k, top_p and one sample. top_k 0 or -1 is off.
    logprobs / prompt_logprobs: how many most likely tokens to report per position (None: none),
    of the model's raw distribution, as vLLM reports them.
    n / best_of: samples returned / generated (best_of, default n: the n of highest cumulative
    logprob are returned, best first, as vLLM's V0 engine did); sample i samples with seed + i
    when a seed is given (vLLM's parallel sampling). Sampling only, as in vLLM.
    """

    max_tokens: int = 128
    min_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None
    n: int = 1
    best_of: int | None = None

    def __post_init__(self) -> None:
        def set_(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        for name in ("max_tokens", "min_tokens", "top_k", "n"):
            set_(name, _number(name, getattr(self, name), integer=True))
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            set_(name, _number(name, getattr(self, name)))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                value = _number(name, value, integer=True)
                _require(
                    0 <= value <= MAX_LOGPROBS, f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}"
                )
                set_(name, value)
        _require(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _require(
            0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        _require(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            set_("temperature", MIN_TEMPERATURE)
        _require(self.top_k >= -1, f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        set_("top_k", max(self.top_k, 0))
        _require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _require(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _require(
            REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1],
            f"repetition_penalty must be in [{REPETITION_PENALTY_RANGE[0]}, {REPETITION_PENALTY_RANGE[1]}], "
            f"got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            _require(-2 <= getattr(self, name) <= 2, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None:
            seed = _number("seed", self.seed, integer=True)
            _require(
                SEED_RANGE[0] <= seed < SEED_RANGE[1],
                f"seed must be a 64-bit integer (between -2^63 and 2^64 - 1), got {seed}",
            )
            set_("seed", None if seed == -1 else seed)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        _require(all(isinstance(s, str) and s for s in stop), "stop must be a list of non-empty strings")
        _require(
            len(stop) <= MAX_STOP_STRINGS,
            f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}",
        )
        _require(
            all(len(s) <= MAX_STOP_STRING_CHARS for s in stop),
            f"each stop string may be at most {MAX_STOP_STRING_CHARS} characters long",
        )
        set_("stop", stop)
        ids = tuple(dict.fromkeys(_number("stop_token_ids", t, integer=True) for t in self.stop_token_ids))
        _require(all(t >= 0 for t in ids), "stop_token_ids must be token ids (>= 0)")
        _require(len(ids) <= MAX_TOKEN_ID_LIST, f"stop_token_ids may hold at most {MAX_TOKEN_ID_LIST} ids")
        set_("stop_token_ids", ids)
        bias = {
            _number("logit_bias token id", token, integer=True): _number("logit_bias value", value)
            for token, value in dict(self.logit_bias).items()
        }
        _require(all(t >= 0 for t in bias), "logit_bias keys must be token ids (>= 0)")
        _require(
            all(-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in bias.values()),
            f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]",
        )
        _require(len(bias) <= MAX_TOKEN_ID_LIST, f"logit_bias may hold at most {MAX_TOKEN_ID_LIST} entries")
        set_("logit_bias", bias)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _require(isinstance(getattr(self, name), bool), f"{name} must be true or false")
        _require(1 <= self.n <= MAX_SAMPLES, f"n must be between 1 and {MAX_SAMPLES}, got {self.n}")
        if self.best_of is not None:
            set_("best_of", _number("best_of", self.best_of, integer=True))
            _require(
                self.n <= self.best_of <= MAX_SAMPLES,
                f"best_of must be between n ({self.n}) and {MAX_SAMPLES}, got {self.best_of}",
            )
        if self.greedy:  # vLLM's rule: several greedy samples would all be the same
            _require(self.samples == 1, f"n must be 1 when using greedy sampling, got {self.samples}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def samples(self) -> int:
        """How many samples are generated: best_of, else n."""
        return self.best_of or self.n

    def sample(self, index: int) -> SamplingParams:
        """Sample `index`'s own parameters: one sample, seeded with seed + index (when seeded); the
        prompt's logprobs, which every sample shares, with the first."""
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed >= SEED_RANGE[1]:
            seed -= 2**64  # the same 64 bits
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return replace(self, n=1, best_of=None, seed=seed, prompt_logprobs=prompt_logprobs)

    @property
    def penalized(self) -> bool:
        """Whether a choice depends on the tokens before it (penalties)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuse token ids (stop_token_ids, logit_bias) the model cannot produce."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", tuple(self.logit_bias))):
            bad = [t for t in ids if t >= vocab_size]
            _require(not bad, f"{name} holds token ids outside the vocabulary (size {vocab_size}): {bad[:5]}")


@dataclass(frozen=True)
class DecoderConfig:
    """What the requests of one decoder share.

    step_token_budget: most tokens fed per forward (roots, draft nodes and prompt chunks): the
    planner spends it node by node where drafts pay, and a long prompt is read in chunks of it.
    max_speculative_batch: an optional cap: above this many running requests, decode plainly
    (0, the default: no cap, the planner alone decides).
    prefix_cache_tokens: KV positions kept for later prompts that share a prefix: recent prompts,
    and finished requests' prompts with their outputs (a conversation's next turn sends both
    back; runtime/prefix_cache.py); 0 turns the cache off.
    kv_cache_bytes: most bytes the running requests' KV pool may hold, counted for each request's
    longest possible sequence (prompt + max_tokens + one draft); 0: no bound.
    grammar_compile_timeout_s: longest a request's structured-output grammar may take to compile
    (in a process of its own, killed then); a slower one is refused.
    grammar_max_bytes, grammar_max_choices: the largest constraint text (a schema, regex or
    grammar) and `choice` list accepted; larger ones are refused before compiling.
    adaptive_threads: size each forward's thread team to the cores other processes leave free
    (runtime/core_budget.py), so that a busy neighbour slows a forward instead of stalling it.
    kv_cache_dtype: what the KV pool stores (KV_CACHE_DTYPES).
    """

    step_token_budget: int = 128
    max_speculative_batch: int = 0
    prefix_cache_tokens: int = 32768
    kv_cache_bytes: int = 2 * 1024**3
    grammar_compile_timeout_s: float = 10.0
    grammar_max_bytes: int = 65536
    grammar_max_choices: int = 1000
    adaptive_threads: bool = True
    kv_cache_dtype: str = "model"

    def __post_init__(self) -> None:
        _require(self.step_token_budget >= 1, f"step_token_budget must be >= 1, got {self.step_token_budget}")
        _require(
            self.max_speculative_batch >= 0,
            f"max_speculative_batch must be >= 0, got {self.max_speculative_batch}",
        )
        _require(
            self.prefix_cache_tokens >= 0, f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}"
        )
        _require(self.kv_cache_bytes >= 0, f"kv_cache_bytes must be >= 0, got {self.kv_cache_bytes}")
        _require(
            self.grammar_compile_timeout_s > 0,
            f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}",
        )
        _require(self.grammar_max_bytes >= 1, f"grammar_max_bytes must be >= 1, got {self.grammar_max_bytes}")
        _require(
            self.grammar_max_choices >= 1, f"grammar_max_choices must be >= 1, got {self.grammar_max_choices}"
        )
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
        )


@dataclass(frozen=True)
class TrieConfig:
    """The instance's n-gram trie: a hard node bound and the longest n-gram it stores (a matched
    query plus the branch drafted after it)."""

    capacity: int = 1_000_000
    depth: int = 16
