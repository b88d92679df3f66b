"""Constraints -> compiled grammars (llguidance): bounded in size, time and memory, cached per constraint.

A compile can take long in two places no thread can interrupt: llguidance's Python side (GBNF
detection and conversion, superlinear in the text and holding the GIL) and its native side (a
pathological regex builds its lexer for seconds, into gigabytes). So a constraint is first
compiled in a process of its own (isolation.py: forked, sharing the tokenizer), which converts
it, builds the grammar, computes its first token mask (where llguidance builds its lexer), walks
a few tokens into it, and is killed at `timeout_s` or when it outgrows `memory_bytes`. Only then
is the grammar built again
here from the converted text, native work with the GIL released that the child has just shown
to be bounded. Compiles run one at a time; refusals, timeouts included, are remembered and
answered at once. Nothing here runs on the engine thread: the backend compiles before a request
enters the engine, which finds the grammar ready.

llguidance's parser limits (parser_limits) bound each later step's work: a grammar that outgrows
them while generating fails its own request (matcher.py, GrammarLimitError), never the others.
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.gbnf_to_lark  # imported here: a forked child must not import (the import lock)
import llguidance.hf
import numpy as np

from ..config import DecoderConfig, StructuredOutputs
from .isolation import ChildFailure, run_in_child

# Compiled grammars kept for later requests with the same constraint (a compiled grammar holds
# its lexer and parser tables, tens of kB for a typical schema); as many refusals are remembered.
CACHE_SIZE = 256
# Address space one compile's process may add: far above what a grammar within grammar_max_bytes
# needs, far below what a pathological one would take.
COMPILE_MEMORY_BYTES = 1024**3
# llguidance's limits, at its defaults but for the fuel of the lexer's regex construction (its
# default, 1,000,000, lets one regex build lexer states for seconds, on the engine thread when it
# happens mid-generation); ordinary schemas and regexes use a small part of this.
INITIAL_LEXER_FUEL = 100_000
CLOSED = "the model is unloading: no more grammars are compiled"
# The trial compile's walks through the grammar: how many, of how many tokens.
TRIAL_WALKS, TRIAL_TOKENS = 2, 8
_OK, _REFUSED = b"+", b"-"
_REASON_CHARS = 500


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL, verbose_errors=False)


class CompiledGrammar:
    """A validated grammar; `matcher()` starts a fresh matcher for one request."""

    def __init__(self, template: llguidance.LLMatcher):
        self._template = template

    def matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer; thread-safe, one compile at a time.

    eos_token_ids: what ends the output once the grammar is complete. vocab_size: the model's
    logits width (it may exceed the tokenizer's). max_bytes, max_choices: the largest constraint
    text and `choice` list accepted (DecoderConfig's grammar_max_bytes, grammar_max_choices).
    """

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        vocab_size: int,
        timeout_s: float,
        max_bytes: int = DecoderConfig.grammar_max_bytes,
        max_choices: int = DecoderConfig.grammar_max_choices,
        memory_bytes: int = COMPILE_MEMORY_BYTES,
    ):
        self._hf_tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.max_bytes, self.max_choices, self.memory_bytes = max_bytes, max_choices, memory_bytes
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # the cache and the refusals
        self._tokenizer_lock = threading.Lock()
        self._compiling = threading.Lock()  # one compile at a time
        self._closed = threading.Event()  # close(): the compile in progress stops, no other starts
        self._cache: OrderedDict[StructuredOutputs, CompiledGrammar] = OrderedDict()
        self._refused: OrderedDict[StructuredOutputs, str] = OrderedDict()

    def check(self, spec: StructuredOutputs) -> None:
        """ValueError naming the key for a constraint refused without compiling: over a size cap, or
        refused before (its reason remembered)."""
        size = len(spec.text.encode("utf-8", errors="surrogatepass"))
        if size > self.max_bytes:
            raise ValueError(f"{spec.name} has {size} bytes, more than grammar_max_bytes ({self.max_bytes})")
        if spec.kind == "choice":
            try:
                count = len(json.loads(spec.text))
            except (ValueError, TypeError):  # not a list: the compile says why
                count = 0
            if count > self.max_choices:
                raise ValueError(
                    f"{spec.name} has {count} choices, more than grammar_max_choices ({self.max_choices})"
                )
        with self._lock:
            reason = self._refused.get(spec)
        if reason is not None:
            raise ValueError(f"{spec.name}: {reason}")

    def cached(self, spec: StructuredOutputs) -> CompiledGrammar | None:
        """The compiled grammar of `spec` if it is ready (never compiles); ValueError as `check`."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        self.check(spec)
        return None

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The compiled grammar of `spec`; ValueError naming its key and the reason. Waits for the
        compile in progress, if any (at most one runs at a time)."""
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled
        tokenizer = self.tokenizer(spec)
        with self._compiling:
            compiled = self.cached(spec)  # compiled meanwhile, by the thread we waited for
            if compiled is not None:
                return compiled
            try:
                compiled = self._build(tokenizer, spec)
            except ValueError as error:
                if not self._closed.is_set():  # a refusal of the constraint itself
                    with self._lock:
                        self._refused[spec] = str(error)
                        while len(self._refused) > CACHE_SIZE:
                            self._refused.popitem(last=False)
                raise ValueError(f"{spec.name}: {error}") from None
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def close(self) -> None:
        """Stop the compile in progress (its caller gets ValueError) and refuse every later one: the
        model unloads."""
        self._closed.set()

    def tokenizer(self, spec: StructuredOutputs | None = None) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer, built once (~0.5 s, holding the GIL: a server builds it
        at load). spec: the constraint to name in an error."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
                    )
                except Exception as error:
                    key = spec.name if spec is not None else "structured outputs"
                    raise ValueError(
                        f"{key}: this model's tokenizer cannot run structured outputs: {error}"
                    ) from None
            return self._tokenizer

    def _build(self, tokenizer: llguidance.LLTokenizer, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile in a child process first; on success build the converted grammar here."""
        if self._closed.is_set():
            raise ValueError(CLOSED)
        try:
            outcome = run_in_child(
                lambda: _trial(tokenizer, spec),
                timeout_s=self.timeout_s,
                memory_bytes=self.memory_bytes,
                stop=self._closed,
            )
        except ChildFailure as failure:
            if self._closed.is_set():
                raise ValueError(CLOSED) from None
            if failure.timed_out:
                raise ValueError(f"the grammar did not compile within {self.timeout_s:g} s") from None
            raise ValueError(
                f"the grammar's compile failed ({failure.ended}): it may take at most "
                f"{self.memory_bytes // 1024**2} MiB of memory"
            ) from None
        if outcome.startswith(_REFUSED):
            raise ValueError(outcome[1:].decode("utf-8", errors="replace"))
        template = llguidance.LLMatcher(
            tokenizer, outcome[1:].decode("utf-8"), log_level=0, limits=parser_limits()
        )
        if not template.is_error():
            template.compute_bitmask()  # the lexer's first states: built here, not on the engine thread
        if template.is_error():
            raise ValueError(error_reason(template.get_error()))
        return CompiledGrammar(template)


def _trial(tokenizer: llguidance.LLTokenizer, spec: StructuredOutputs) -> bytes:
    """In the child: the constraint's converted grammar text (_OK), or why it is refused (_REFUSED).
    Beyond the first mask, a few short walks through the grammar (random permitted tokens) bring out
    a lexer that outgrows the limits within its first tokens here rather than mid-generation."""
    try:
        grammar = _grammar(spec)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        if not matcher.is_error():
            matcher.compute_bitmask()
        pick = random.Random(0)
        for _ in range(TRIAL_WALKS):
            walker = matcher.deep_copy()
            for _ in range(TRIAL_TOKENS):
                if walker.is_error() or walker.is_stopped():
                    break
                permitted = np.unpackbits(
                    np.frombuffer(walker.compute_bitmask(), np.uint8), bitorder="little"
                )
                tokens = np.flatnonzero(permitted[: tokenizer.vocab_size])
                if walker.is_error() or not len(tokens):
                    break
                walker.consume_token(int(tokens[pick.randrange(len(tokens))]))
            if walker.is_error():
                matcher = walker
                break
        if matcher.is_error():
            return _REFUSED + error_reason(matcher.get_error()).encode()
    except MemoryError:  # past memory_bytes: the child exits with an error
        raise
    except BaseException as error:  # a refused constraint (a native panic is a BaseException)
        return _REFUSED + error_reason(str(error) or type(error).__name__).encode()
    return _OK + grammar.encode("utf-8")


def _grammar(spec: StructuredOutputs) -> str:
    """llguidance's grammar text for a constraint."""
    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(
            spec.text, defaults={"whitespace_flexible": spec.any_whitespace}
        )
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps({"type": "object"}), defaults={"whitespace_flexible": spec.any_whitespace}
        )
    return llguidance.grammar_from(spec.kind, spec.text)


def error_reason(message: str) -> str:
    """llguidance's error on one line, without its quotes of the grammar (numbered lines, carets)."""
    lines = [line.strip() for line in message.strip().splitlines()]
    kept = [line for line in lines if line and not re.match(r"^(\d+ \||\^+$)", line)]
    return " ".join(kept)[:_REASON_CHARS] or "invalid grammar"
