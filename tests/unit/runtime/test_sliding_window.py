"""Models with a sliding attention window stay lossless past the window.

Mistral takes one windowed mask; Qwen2 (with use_sliding_window), Gemma 2 and Gemma 3 mix full and
windowed layers and take a mask per layer type. A window of 6 and 30 tokens of output put most
of every sequence outside it; transformers' own generate() is the reference.
"""

from __future__ import annotations

import random

import pytest

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from tests.helpers import plain_greedy, repetitive_prompt

WINDOW = 6
MAX_TOKENS = 30
WINDOWED = {
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),
    "gemma2": dict(sliding_window=WINDOW),
    "gemma3_text": dict(sliding_window=WINDOW),
}


@pytest.mark.parametrize("arch", WINDOWED)
def test_greedy_past_the_window_equals_generate_with_and_without_drafts(arch, tiny_model, byte_tokenizer):
    model = tiny_model(arch, **WINDOWED[arch])
    model.generation_config.eos_token_id = None  # generate() runs to MAX_TOKENS, like the decoder here
    vocab = model.config.vocab_size
    rng = random.Random(arch)
    prompts = [repetitive_prompt(rng, vocab) for _ in range(3)]
    expected = [plain_greedy(model, prompt, MAX_TOKENS) for prompt in prompts]
    trie = NGramTrie(capacity=10_000, max_depth=9)
    for prompt, truth in zip(prompts, expected):
        trie.insert(prompt[-3:] + truth)
        trie.insert(prompt[-3:] + [t if i % 5 else (t + 1) % vocab for i, t in enumerate(truth)])
    config = LookaheadConfig(decoding_length=10, branch_length=5, adaptive=False)
    decoder = LookaheadDecoder(model, byte_tokenizer, trie, config, max_speculative_batch=3)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for prompt, truth in zip(prompts, expected):
        assert decoder.generate(prompt, params, LookaheadConfig(use_lookahead=False))[0] == truth
        ids, stats = decoder.generate(prompt, params)
        assert ids == truth
        assert stats.accepted_draft_tokens > 0
    # together: one padded batch whose rows lie at different positions relative to their windows
    generations = [decoder.start(prompt, params) for prompt in prompts]
    while not all(gen.finished for gen in generations):
        decoder.step([gen for gen in generations if not gen.finished])
    assert [gen.output_ids for gen in generations] == expected
