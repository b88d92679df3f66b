"""Lookahead decoding: lossless, model-free speculative decoding with trie-retrieved draft trees.

Usable without Triton:

    from lookahead import LookaheadDecoder, NGramTrie, SamplingParams, load_model
    loaded = load_model()                      # the embedded SmolLM2-135M-Instruct
    decoder = LookaheadDecoder.for_model(loaded, NGramTrie())
    ids, stats = decoder.generate(loaded.tokenizer.encode("def fib(n):"), SamplingParams(max_tokens=64))

Sub-packages, one concern each: `algorithm` (trie, spans, retrieval, draft, planner, verify: no
model code), `runtime` (decoder, generation, step inputs, KV pool, prefix cache, sampling,
detokenizer), `models` (loading, embedded models, load-time checks), `state` (trie snapshots,
warm-up) and `cpu` (the optional fast CPU path).
"""

from .algorithm.draft import Draft
from .algorithm.trie import NGramTrie
from .config import DecoderConfig, LookaheadConfig, SamplingParams, TrieConfig
from .models.loading import LoadedModel, load_model
from .runtime.decoder import LookaheadDecoder
from .runtime.generation import Generation, GenerationStats, StepOutput

__all__ = [
    "DecoderConfig",
    "Draft",
    "Generation",
    "GenerationStats",
    "LoadedModel",
    "LookaheadConfig",
    "LookaheadDecoder",
    "NGramTrie",
    "SamplingParams",
    "StepOutput",
    "TrieConfig",
    "load_model",
]
