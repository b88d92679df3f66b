"""Logprobs as vLLM reports them (the raw logits' log-softmax), equal to plain decoding's, from the
forwards decoding makes anyway."""

from __future__ import annotations

import json

import pytest
import torch

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.runtime.logprobs import Logprob, vllm_json
from tests.helpers import LINEAR_KERNELS, apply_kernel

PROMPT = [10, 20, 30, 40, 10, 20, 30]


def collect(decoder, params, lookahead=None):
    gen = decoder.start(PROMPT, params, lookahead)
    logprobs = []
    while not gen.finished:
        logprobs += gen.step().logprobs or []
    return gen, logprobs


def sharp_decoder(tiny_model, byte_tokenizer, kernel="stock") -> LookaheadDecoder:
    """Sharp distributions (the output layer scaled before the kernel packs it), right drafts."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    apply_kernel(model, kernel)
    plain = LookaheadDecoder(model, byte_tokenizer).generate(PROMPT, SamplingParams(max_tokens=16))[0]
    trie = NGramTrie(capacity=10_000, max_depth=9)
    trie.insert(PROMPT[-3:] + plain)
    config = LookaheadConfig(decoding_length=8, branch_length=4, adaptive=False)
    return LookaheadDecoder(model, byte_tokenizer, trie, config)


@pytest.mark.parametrize("kernel", LINEAR_KERNELS)
def test_logprobs_under_lookahead_equal_plain_decodings_and_the_raw_distribution(
    kernel, tiny_model, byte_tokenizer
):
    decoder = sharp_decoder(tiny_model, byte_tokenizer, kernel)
    params = SamplingParams(max_tokens=16, logprobs=3, repetition_penalty=1.3)
    drafted, drafted_logprobs = collect(decoder, params)
    plain, plain_logprobs = collect(decoder, params, LookaheadConfig(use_lookahead=False))
    assert drafted.stats.accepted_draft_tokens > 0
    assert drafted.output_ids == plain.output_ids and len(drafted_logprobs) == len(drafted.output_ids)
    tolerance = 1e-5  # attention over a tree and over a plain sequence rounds differently
    for token, ours, theirs in zip(drafted.output_ids, drafted_logprobs, plain_logprobs):
        assert (
            list(ours) == list(theirs) and next(iter(ours)) == token
        )  # the chosen token first, then the top 3
        for key in ours:
            assert ours[key].rank == theirs[key].rank
            assert abs(ours[key].logprob - theirs[key].logprob) <= tolerance
    # the raw distribution (before the repetition penalty), from an uncached forward
    with torch.inference_mode():
        logits = decoder.model(input_ids=torch.tensor([PROMPT + drafted.output_ids]), use_cache=False).logits[
            0
        ]
    reference = logits[len(PROMPT) - 1 : -1].float().log_softmax(-1)
    for i, (token, position) in enumerate(zip(drafted.output_ids, drafted_logprobs)):
        assert position[token].logprob == pytest.approx(float(reference[i, token]), abs=1e-4)
        assert position[token].rank == int((reference[i] >= reference[i, token]).sum())
        assert set(position) - {token} <= set(reference[i].topk(3).indices.tolist())
    assert drafted.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for p, t in zip(drafted_logprobs, drafted.output_ids))
    )


def test_prompt_logprobs_score_every_prompt_token(tiny_model, byte_tokenizer):
    decoder = LookaheadDecoder(tiny_model("llama"), byte_tokenizer)
    gen, _ = collect(decoder, SamplingParams(max_tokens=2, prompt_logprobs=2))
    with torch.inference_mode():
        logits = decoder.model(input_ids=torch.tensor([PROMPT]), use_cache=False).logits[0]
    reference = logits.float().log_softmax(-1)
    assert gen.prompt_logprobs[0] is None and len(gen.prompt_logprobs) == len(PROMPT)
    for i, token in enumerate(PROMPT[1:]):
        assert gen.prompt_logprobs[i + 1][token].logprob == pytest.approx(
            float(reference[i, token]), abs=1e-5
        )
    assert json.loads(vllm_json(gen.prompt_logprobs))[0] is None


def test_logprobs_cost_no_extra_forward(tiny_model, byte_tokenizer):
    forwards = []
    for logprobs in (None, 5):
        decoder = sharp_decoder(tiny_model, byte_tokenizer)  # the same state for both runs
        calls = []
        handle = decoder.model.model.register_forward_hook(lambda *args: calls.append(1))
        try:
            collect(decoder, SamplingParams(max_tokens=12, logprobs=logprobs))
        finally:
            handle.remove()
        forwards.append(len(calls))
    assert forwards[0] == forwards[1] > 0


def test_the_vllm_json_form():
    text = vllm_json([{5: Logprob(-0.5, 1, "a"), 9: Logprob(-1.25, 2, "b")}, None])
    assert json.loads(text) == [
        {
            "5": {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
            "9": {"logprob": -1.25, "rank": 2, "decoded_token": "b"},
        },
        None,
    ]
    assert vllm_json(None) == "null"
