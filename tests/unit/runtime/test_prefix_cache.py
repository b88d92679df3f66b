"""Prefix cache: bounded LRU of prompts' KV; a cached prefix gives the logits of a recomputed one."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.models.chat import apply_chat_template
from lookahead.runtime.prefix_cache import PrefixCache
from tests.helpers import LINEAR_KERNELS, TINY_ARCHITECTURES, plain_greedy


def prefilled(model: Any, prompt: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's keys and values of a plain prefill of `prompt`."""
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def as_cache(found: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values)):
        assert k.shape[2] == v.shape[2] == found
        cache.update(k, v, layer)
    return cache


def assert_same_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to the attention kernel's summation order, which depends on how many rows it is fed
    (a plain prefill and the decoder's own steps differ from each other as much)."""
    assert (actual - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item())
    assert int(actual.argmax()) == int(expected.argmax())


def last_logits(model: Any, tokens: list[int], cache: DynamicCache | None = None) -> torch.Tensor:
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([tokens]), cache=cache or DynamicCache(), use_cache=True)
    return out.logits[0, -1]


@pytest.mark.parametrize("kernel", LINEAR_KERNELS)
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_a_cached_prefix_gives_the_logits_of_a_full_prefill(arch: str, kernel: str, tiny_model) -> None:
    model = tiny_model(arch, linear_kernel=kernel)
    rng = random.Random(arch)
    shared = [rng.randrange(256) for _ in range(40)]
    first, second = shared + [1, 2, 3], shared + [rng.randrange(256) for _ in range(25)]
    cache = PrefixCache(capacity=1000)
    cache.store(first, *prefilled(model, first))
    found, *entries = cache.lookup(second)
    prefix = as_cache(found, *entries)
    assert found == len(shared) and prefix.get_seq_length() == len(shared)
    assert_same_logits(last_logits(model, second[found:], prefix), last_logits(model, second))


def test_the_real_model_reuses_its_chat_system_prompt(default_model) -> None:
    model, tokenizer = default_model.model, default_model.tokenizer
    first = apply_chat_template(tokenizer, "Write a haiku about rain.")
    second = apply_chat_template(tokenizer, "What is 17 times 23?")
    cache = PrefixCache(capacity=1000)
    cache.store(first, *prefilled(model, first))
    found, *entries = cache.lookup(second)
    prefix = as_cache(found, *entries)
    assert found >= 20  # the template's system prompt and the user turn's opening
    assert_same_logits(last_logits(model, second[found:], prefix), last_logits(model, second))


def test_lookup_takes_the_longest_prefix_but_always_leaves_the_last_token(tiny_model) -> None:
    model = tiny_model("llama")
    cache = PrefixCache(capacity=1000)
    assert cache.lookup([1, 2, 3])[0] == 0
    cache.store([1, 2, 3, 4, 5], *prefilled(model, [1, 2, 3, 4, 5]))
    cache.store([1, 2, 9, 9], *prefilled(model, [1, 2, 9, 9]))
    assert cache.lookup([1, 2, 3, 4, 7])[0] == 4
    assert cache.lookup([1, 2, 9, 9])[0] == 3  # the whole prompt is cached, its last token is fed again
    assert cache.lookup([1, 2, 3, 4, 5, 6])[0] == 5
    assert cache.lookup([7, 1, 2])[0] == 0
    assert cache.lookup([1])[0] == 0


def test_the_token_bound_holds_and_the_least_recently_used_prompt_goes_first(tiny_model) -> None:
    model = tiny_model("llama")
    cache = PrefixCache(capacity=10)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    for prompt in (a, b):
        cache.store(prompt, *prefilled(model, prompt))
    assert cache.lookup(a + [0])[0] == 4  # a is now the most recently used
    cache.store(c, *prefilled(model, c))
    assert cache.tokens == 8 <= cache.capacity
    assert cache.lookup(b + [0])[0] == 0
    assert cache.lookup(a + [0])[0] == 4 and cache.lookup(c + [0])[0] == 4
    cache.store(list(range(20, 31)), *prefilled(model, list(range(20, 31))))  # longer than the bound
    assert cache.tokens == 8
    with pytest.raises(ValueError, match="capacity"):
        PrefixCache(capacity=-1)


@pytest.mark.parametrize("capacity", [0, 2048])
def test_the_decoder_prefills_only_what_is_not_cached_and_stays_lossless(
    capacity: int, tiny_model, byte_tokenizer
) -> None:
    model = tiny_model("qwen2")
    decoder = LookaheadDecoder(
        model, byte_tokenizer, NGramTrie(capacity=10_000, max_depth=9), prefix_cache_tokens=capacity
    )
    system = list(b"You are a helpful assistant. ")
    cached = []
    for question in (b"How far is the moon?", b"How far is the sun?", b"Name a prime."):
        prompt = system + list(question)
        ids, stats = decoder.generate(prompt, SamplingParams(max_tokens=12))
        assert ids == plain_greedy(model, prompt, 12)
        cached.append(stats.cached_prompt_tokens)
    if capacity:
        assert cached == [0, len(system) + len(b"How far is the "), len(system)]
    else:
        assert cached == [0, 0, 0] and decoder.runner.prefix_cache.tokens == 0


def test_a_request_with_learn_off_leaves_no_trace_in_the_prefix_cache(tiny_model, byte_tokenizer) -> None:
    """Its prompt is not stored (a later request cannot find it by timing), and it reads nothing the
    learning requests stored: no match crosses the two scopes, and it stays lossless."""
    model = tiny_model("qwen2")
    decoder = LookaheadDecoder(model, byte_tokenizer, NGramTrie(capacity=10_000, max_depth=9))
    private = LookaheadConfig(learn=False)
    system = list(b"You are a helpful assistant. ")
    secret = system + list(b"My password is hunter2.")
    ids, stats = decoder.generate(secret, SamplingParams(max_tokens=8), private)
    assert ids == plain_greedy(model, secret, 8) and stats.cached_prompt_tokens == 0
    assert decoder.runner.prefix_cache.tokens == 0
    probe = system + list(b"My password is hunter3.")
    assert decoder.generate(probe, SamplingParams(max_tokens=8))[1].cached_prompt_tokens == 0

    shared, other = list(b"Shared question one?"), list(b"Another shared one?")
    for prompt in (shared, other):
        decoder.generate(prompt, SamplingParams(max_tokens=4))
    held = list(decoder.runner.prefix_cache._entries)
    ids, read = decoder.generate(shared + list(b" more"), SamplingParams(max_tokens=8), private)
    assert read.cached_prompt_tokens == 0 and ids == plain_greedy(model, shared + list(b" more"), 8)
    assert list(decoder.runner.prefix_cache._entries) == held  # neither stored nor moved
    assert decoder.generate(shared + list(b" more"), SamplingParams(max_tokens=8))[
        1
    ].cached_prompt_tokens == len(shared)  # a learning request reads it


def test_the_bound_counts_every_position_an_entry_holds(tiny_model) -> None:
    model = tiny_model("llama")
    cache = PrefixCache(capacity=10)
    prompt = [1, 2, 3, 4]
    held = prefilled(model, prompt + [5, 6, 7])  # tensors holding 3 positions past the prompt
    cache.store(prompt, *held)
    assert cache.tokens == 7
    cache.store([8, 9, 10, 11], *prefilled(model, [8, 9, 10, 11]))
    assert cache.tokens == 4 <= cache.capacity  # 7 + 4 would not fit: the first entry went
    assert cache.lookup(prompt + [0])[0] == 0


def test_a_conversations_next_turn_finds_the_last_answer_cached(tiny_model, byte_tokenizer) -> None:
    """A finished request leaves its prompt and its output: the next turn, which sends both back
    with a new question, prefills only the new question, and stays lossless."""
    model = tiny_model("qwen2")
    decoder = LookaheadDecoder(model, byte_tokenizer, NGramTrie(capacity=10_000, max_depth=9))
    first = list(b"User: name three colors.\nAssistant:")
    answer, _ = decoder.generate(first, SamplingParams(max_tokens=10))
    assert list(decoder.runner.prefix_cache._entries) == [tuple(first + answer[:-1])]  # the prompt's went
    second = first + answer + list(b"\nUser: and three more?\nAssistant:")
    ids, stats = decoder.generate(second, SamplingParams(max_tokens=10))
    assert stats.cached_prompt_tokens == len(first) + len(answer) - 1
    assert ids == plain_greedy(model, second, 10)
    cancelled = decoder.start(list(b"User: a cancelled one.\nAssistant:"), SamplingParams(max_tokens=10))
    cancelled.step()
    cancelled.step()
    cancelled.close()
    assert all(len(key) != len(cancelled.ids) - 1 for key in decoder.runner.prefix_cache._entries)


def test_a_running_requests_prompt_is_shared_uncopied_until_it_leaves(tiny_model, byte_tokenizer) -> None:
    """Its entry reads the request's own slot, wherever packing moves it; a request that leaves
    before its end leaves a copy of its prompt; lossless throughout."""
    model = tiny_model("qwen2")
    decoder = LookaheadDecoder(model, byte_tokenizer, NGramTrie(capacity=10_000, max_depth=9))
    cache = decoder.runner.prefix_cache
    system = list(b"You are a helpful assistant. ")
    left, running = (
        decoder.start(system + list(question), SamplingParams(max_tokens=16))
        for question in (b"Bye.", b"How far is the moon?")
    )
    decoder.step([left, running])  # both read their prompts, into slots 0 and 1
    assert not left.finished and decoder.runner.slot_of(running) == 1
    assert cache.holds(left.ids[: left.prompt_len]) and cache.holds(running.ids[: running.prompt_len])
    assert cache.tokens == 0  # no copy: the entries read the requests' slots
    left.close()
    assert cache.tokens == left.prompt_len  # it left: its prompt's entry is a copy now
    running.step()
    assert decoder.runner.slot_of(running) == 0  # packing moved it into the slot left free
    other = decoder.start(list(b"Something else entirely."), SamplingParams(max_tokens=4))
    other.step()
    assert decoder.runner.slot_of(other) == 1  # over what the moved request left there
    follow = running.ids[: running.prompt_len] + list(b" And the sun?")
    ids, stats = decoder.generate(follow, SamplingParams(max_tokens=10))
    assert stats.cached_prompt_tokens == running.prompt_len
    assert ids == plain_greedy(model, follow, 10)
    while not running.finished:
        running.step()
    assert running.output_ids == plain_greedy(model, running.ids[: running.prompt_len], 16)
