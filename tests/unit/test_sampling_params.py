"""vLLM's sampling parameters are exact under lookahead: every draft node sees its own path.

The reference is written here from vLLM's formulas, independently of lookahead/runtime/sampling.py:
a plain loop that recomputes the whole sequence's logits for every token and applies, in numpy
float32, min_tokens, logit_bias, the repetition penalty over prompt and output, then the frequency
and presence penalties over the output, and takes the argmax.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from tests.helpers import LINEAR_KERNELS, repetitive_prompt

MAX_TOKENS = 16
EOS = 7


def reference_greedy(model, prompt: list[int], params: SamplingParams, eos: tuple[int, ...]) -> list[int]:
    output: list[int] = []
    stops = set(eos) | set(params.stop_token_ids)
    for _ in range(params.max_tokens):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + output]), use_cache=False).logits[0, -1]
        scores = logits.float().numpy().astype(np.float32).copy()
        if len(output) < params.min_tokens:
            for token in stops:
                scores[token] = -np.inf
        for token, bias in params.logit_bias.items():
            scores[token] += np.float32(bias)
        counts = Counter(output)
        seen = set(prompt) | set(output)
        for token in range(len(scores)):
            value = scores[token]
            if token in seen and params.repetition_penalty != 1:
                penalty = np.float32(params.repetition_penalty)
                value = value / penalty if value > 0 else value * penalty
            value -= np.float32(params.frequency_penalty) * np.float32(counts[token])
            value -= np.float32(params.presence_penalty) * np.float32(counts[token] > 0)
            scores[token] = value
        token = int(np.argmax(scores))
        output.append(token)
        if token in stops:
            break
    return output


PENALIZED = [
    dict(repetition_penalty=1.8),
    dict(presence_penalty=1.5, frequency_penalty=0.7),
    dict(repetition_penalty=0.6, frequency_penalty=-0.5, logit_bias={3: 4.0, 11: -2.0}),
    dict(presence_penalty=-1.0, min_tokens=10, stop_token_ids=(5,), logit_bias={EOS: 6.0, 5: 3.0}),
]


def drafting_decoder(model, tokenizer, trie: NGramTrie) -> LookaheadDecoder:
    config = LookaheadConfig(decoding_length=10, branch_length=5, adaptive=False)
    return LookaheadDecoder(model, tokenizer, trie, config, eos_token_ids=(EOS,))


@pytest.mark.parametrize("kernel", LINEAR_KERNELS)
@pytest.mark.parametrize("options", PENALIZED, ids=lambda o: ",".join(o))
def test_greedy_with_penalties_equals_the_reference_with_any_drafts(
    kernel, options, tiny_model, byte_tokenizer
):
    model = tiny_model("llama", linear_kernel=kernel)
    vocab = model.config.vocab_size
    rng = random.Random(str(options))
    params = SamplingParams(max_tokens=MAX_TOKENS, **options)
    accepted = 0
    for case in range(3):
        prompt = repetitive_prompt(rng, vocab)
        expected = reference_greedy(model, prompt, params, (EOS,))
        trie = NGramTrie(capacity=10_000, max_depth=9)
        unpenalized = reference_greedy(model, prompt, SamplingParams(max_tokens=MAX_TOKENS), (EOS,))
        # right drafts, the unpenalized continuation (adversarial: plausible but wrong), noise
        for sequence in (expected, unpenalized, [rng.randrange(vocab) for _ in range(30)]):
            trie.insert(prompt[-3:] + sequence)
        decoder = drafting_decoder(model, byte_tokenizer, trie)
        plain, _ = decoder.generate(prompt, params, LookaheadConfig(use_lookahead=False))
        drafted, stats = decoder.generate(prompt, params)
        assert plain == expected, f"case {case}: plain decoding differs from the reference"
        assert drafted == expected, f"case {case}: lookahead differs from the reference"
        accepted += stats.accepted_draft_tokens
    assert accepted > 0, "the drafts were never accepted: the test would not exercise the paths"


@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=0.9, presence_penalty=1.0, frequency_penalty=0.5),
        dict(temperature=1.2, min_p=0.1, top_k=-1, repetition_penalty=1.3),
        dict(temperature=0.8, top_k=8, top_p=0.9, logit_bias={9: 3.0}, min_tokens=6),
    ],
)
def test_seeded_sampling_with_vllm_parameters_is_the_same_with_and_without_drafts(
    options, tiny_model, byte_tokenizer
):
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # sharp distributions, so that drafts get accepted
    prompt = [10, 20, 30, 40, 10, 20]
    trie = NGramTrie(capacity=10_000, max_depth=9)
    decoder = drafting_decoder(model, byte_tokenizer, trie)
    for seed in (0, 2**64 - 1, -5):
        trie.insert(prompt[-3:] + reference_greedy(model, prompt, SamplingParams(max_tokens=12), (EOS,)))
        params = SamplingParams(max_tokens=12, seed=seed, **options)
        plain, _ = decoder.generate(prompt, params, LookaheadConfig(use_lookahead=False))
        drafted, _ = decoder.generate(prompt, params)
        assert drafted == plain, f"seed {seed}"


def test_integer_temperature_and_penalty_work_in_the_library(tiny_model, byte_tokenizer):
    decoder = LookaheadDecoder(tiny_model("llama"), byte_tokenizer)
    ids, _ = decoder.generate(
        [1, 2, 3], SamplingParams(max_tokens=4, temperature=1, repetition_penalty=2, seed=1)
    )
    assert len(ids) == 4


def test_stop_token_ids_end_the_output_and_their_text_is_left_out(tiny_model, byte_tokenizer):
    model = tiny_model("llama")
    prompt = [1, 2, 3, 4]
    decoder = LookaheadDecoder(model, byte_tokenizer)
    free, _ = decoder.generate(prompt, SamplingParams(max_tokens=12))
    stop = free[5]
    gen = decoder.start(prompt, SamplingParams(max_tokens=12, stop_token_ids=(stop,)))
    text = ""
    while not gen.finished:
        text += gen.step().text
    assert gen.output_ids == free[: free.index(stop) + 1] and gen.finish_reason == "stop"
    assert text == byte_tokenizer.decode(gen.output_ids[:-1])
