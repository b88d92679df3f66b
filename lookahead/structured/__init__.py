"""Structured outputs: grammars compiled once per constraint, matched along every draft branch."""

from .compiler import CompiledGrammar, GrammarCompiler
from .matcher import GrammarLimitError, GrammarMatcher

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarLimitError", "GrammarMatcher"]
