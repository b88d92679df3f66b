"""Lookahead decoding: lossless, model-free speculative decoding with trie-retrieved draft trees.

Usable without Triton:

    from lookahead import LookaheadDecoder, NGramTrie, SamplingParams, load_model
    loaded = load_model()                      # the embedded SmolLM2-135M-Instruct
    decoder = LookaheadDecoder(
        loaded.model, loaded.tokenizer, NGramTrie(), eos_token_ids=loaded.eos_token_ids
    )
    ids, stats = decoder.generate(loaded.tokenizer.encode("def fib(n):"), SamplingParams(max_tokens=64))
"""

from .config import LookaheadConfig, SamplingParams
from .decoder import Generation, GenerationStats, LookaheadDecoder, StepOutput
from .draft import Draft
from .models import LoadedModel, load_model
from .trie import NGramTrie

__all__ = [
    "Draft",
    "Generation",
    "GenerationStats",
    "LoadedModel",
    "LookaheadConfig",
    "LookaheadDecoder",
    "NGramTrie",
    "SamplingParams",
    "StepOutput",
    "load_model",
]
