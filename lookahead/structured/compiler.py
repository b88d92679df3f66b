"""Constraints -> compiled grammars (llguidance), cached per constraint and bounded in time.

llguidance builds its token trie once per tokenizer and a grammar when its first matcher is made, with parser
limits bounding the grammar's size and each step's work, so a pathological schema fails instead
of growing. A compile runs on a thread of its own (llguidance releases the GIL) and the caller
waits at most `timeout_s` (a compile past it finishes in the background, within the parser
limits, and is dropped): requests are checked, hence compiled, on Triton's request threads,
never on the engine thread, which finds the grammar in the cache.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf

from ..config import StructuredOutputs

# Compiled grammars kept for later requests with the same constraint (a compiled grammar holds
# its lexer and parser tables, tens of kB for a typical schema).
CACHE_SIZE = 256


class CompiledGrammar:
    """A validated grammar; `matcher()` starts a fresh matcher for one request."""

    def __init__(self, template: llguidance.LLMatcher):
        self._template = template

    def matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer; thread-safe.

    eos_token_ids: what ends the output once the grammar is complete. vocab_size: the model's
    logits width (it may exceed the tokenizer's).
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], vocab_size: int, timeout_s: float):
        self._hf_tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # the cache
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputs, CompiledGrammar] = OrderedDict()

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The compiled grammar of `spec`; ValueError naming its key and the reason."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        tokenizer = self.tokenizer(spec)
        outcome: list[CompiledGrammar | Exception] = []
        worker = threading.Thread(
            target=lambda: outcome.append(_build(tokenizer, spec)), name="lookahead-grammar", daemon=True
        )
        worker.start()
        worker.join(self.timeout_s)
        if not outcome:
            raise ValueError(f"{spec.name}: the grammar did not compile within {self.timeout_s:g} s")
        if isinstance(outcome[0], Exception):
            raise ValueError(f"{spec.name}: {outcome[0]}")
        with self._lock:
            self._cache[spec] = outcome[0]
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return outcome[0]

    def tokenizer(self, spec: StructuredOutputs | None = None) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer, built once, on the first constraint's thread (~0.5 s;
        the cache stays readable meanwhile). spec: the constraint to name in an error."""
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


def _build(tokenizer: llguidance.LLTokenizer, spec: StructuredOutputs) -> CompiledGrammar | Exception:
    try:
        template = llguidance.LLMatcher(tokenizer, _grammar(spec), log_level=0)
    except Exception as error:  # a refused constraint, reported by the caller
        return error
    if template.is_error():
        return ValueError(_reason(template.get_error()))
    return CompiledGrammar(template)


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


def _reason(message: str) -> str:
    """llguidance's error on one line, without its quotes of the grammar (numbered lines, carets)."""
    lines = [line.strip() for line in message.strip().splitlines()]
    kept = [line for line in lines if line and not re.match(r"^(\d+ \||\^+$)", line)]
    return " ".join(kept)[:500] or "invalid grammar"
