"""Lookahead decoding: lossless, model-free speculative decoding with trie-retrieved draft trees.

Usable without Triton:

    from lookahead import LookaheadDecoder, NGramTrie, SamplingParams, load_model
    loaded = load_model()                      # the embedded SmolLM2-135M-Instruct
    decoder = LookaheadDecoder.for_model(loaded, NGramTrie())
    ids, stats = decoder.generate(loaded.tokenizer.encode("def fib(n):"), SamplingParams(max_tokens=64))

Sub-packages, one concern each: `algorithm` (trie, spans, retrieval, drafters, draft, planner,
verify: no model code, no torch), `runtime` (decoder, scheduler, runner, generation, step
inputs, KV pool, prefix cache, sampling, detokenizer), `structured` (grammars), `models`
(loading, embedded models, load-time checks), `state` (trie snapshots, warm-up, fleet sync) and
`cpu` (the optional fast CPU path). The names below are imported on first use, so that importing
a torch-free module (lookahead.config, the algorithm, the scheduler) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, for type checkers
    from .algorithm.draft import Draft as Draft
    from .algorithm.trie import NGramTrie as NGramTrie
    from .config import DecoderConfig as DecoderConfig
    from .config import LookaheadConfig as LookaheadConfig
    from .config import SamplingParams as SamplingParams
    from .config import TrieConfig as TrieConfig
    from .models.loading import LoadedModel as LoadedModel
    from .models.loading import load_model as load_model
    from .runtime.decoder import LookaheadDecoder as LookaheadDecoder
    from .runtime.generation import Generation as Generation
    from .runtime.generation import GenerationStats as GenerationStats
    from .runtime.generation import StepOutput as StepOutput

# exported name -> the module defining it
_EXPORTS = {
    "DecoderConfig": ".config",
    "Draft": ".algorithm.draft",
    "Generation": ".runtime.generation",
    "GenerationStats": ".runtime.generation",
    "LoadedModel": ".models.loading",
    "LookaheadConfig": ".config",
    "LookaheadDecoder": ".runtime.decoder",
    "NGramTrie": ".algorithm.trie",
    "SamplingParams": ".config",
    "StepOutput": ".runtime.generation",
    "TrieConfig": ".config",
    "load_model": ".models.loading",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
