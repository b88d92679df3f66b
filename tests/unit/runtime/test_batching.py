"""Continuous batching is lossless: requests stepped together emit what they emit alone."""

from __future__ import annotations

import random
import sys
import threading
from typing import Any

import pytest
import torch

from lookahead import Draft, LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.runtime import kv_pool
from lookahead.runtime.kv_pool import KVCacheFull, KVPool
from tests.helpers import LINEAR_KERNELS, model_eos_ids, plain_greedy, repetitive_prompt


def run_concurrently(decoder: LookaheadDecoder, requests: list[tuple[list[int], SamplingParams, int]]):
    """Start request i at engine iteration requests[i][2]; step all running ones together."""
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    running: dict[int, object] = {}
    outputs: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    batch_sizes = []
    iteration = 0
    while pending or running:
        while pending and requests[pending[0]][2] <= iteration:
            i = pending.pop(0)
            running[i] = decoder.start(requests[i][0], requests[i][1])
        if running:
            order = list(running)
            batch_sizes.append(len(order))
            for i, out in zip(order, decoder.step([running[i] for i in order])):
                outputs[i] += out.token_ids
                if out.finish_reason:
                    del running[i]
        iteration += 1
    return outputs, batch_sizes


@pytest.mark.parametrize("kernel", LINEAR_KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_requests_joining_at_different_times_match_running_alone(
    arch, kernel, tiny_model, byte_tokenizer
) -> None:
    model = tiny_model(arch, linear_kernel=kernel)
    rng = random.Random(arch)
    requests = []
    for i in range(5):
        prompt = repetitive_prompt(rng, model.config.vocab_size) * (1 + i % 2)
        requests.append((prompt, SamplingParams(max_tokens=8 + 5 * i), 3 * i))
    trie = NGramTrie(capacity=10_000, max_depth=9)
    for prompt, params, _ in requests:  # right drafts for some requests, so accepted lengths differ
        trie.insert(prompt[-3:] + plain_greedy(model, prompt, params.max_tokens)[:6])
    config = LookaheadConfig(decoding_length=8, branch_length=5, adaptive=False)
    decoder = LookaheadDecoder(model, byte_tokenizer, trie, config, step_token_budget=24)
    outputs, batch_sizes = run_concurrently(decoder, requests)
    assert max(batch_sizes) >= 3
    for i, (prompt, params, _) in enumerate(requests):
        assert outputs[i] == plain_greedy(model, prompt, params.max_tokens), f"request {i}"
    assert len(decoder.runner.pool.owners) <= max(batch_sizes) + 1  # finished requests' slots are reused
    assert all(owner is None for owner in decoder.runner.pool.owners)


@pytest.mark.parametrize("kernel", LINEAR_KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_random_mixes_of_prompt_chunks_and_draft_widths_match_running_alone(
    arch, kernel, tiny_model, byte_tokenizer
) -> None:
    """Long prompts read in chunks beside running requests whose drafts differ in width; requests
    join and leave at random: every output is plain greedy decoding's."""
    model = (
        tiny_model(arch, linear_kernel=kernel, sliding_window=24)
        if arch == "mistral"
        else tiny_model(arch, linear_kernel=kernel)
    )
    rng = random.Random(f"{arch}-{kernel}")
    requests = []
    for i in range(7):
        prompt = repetitive_prompt(rng, model.config.vocab_size) * rng.choice([1, 2, 6])
        requests.append((prompt, SamplingParams(max_tokens=rng.randrange(4, 20)), rng.randrange(12)))
    trie = NGramTrie(capacity=10_000, max_depth=9)
    for prompt, params, _ in requests[::2]:  # likely drafts for some requests, none for the others
        trie.insert(prompt[-3:] + plain_greedy(model, prompt, params.max_tokens)[:8])
    config = LookaheadConfig(decoding_length=10, branch_length=6, adaptive=False)
    decoder = LookaheadDecoder(
        model, byte_tokenizer, trie, config, model_eos_ids(model), step_token_budget=32
    )  # stops at the model's EOS, as plain_greedy does
    outputs, batch_sizes = run_concurrently(decoder, requests)
    assert max(batch_sizes) >= 3
    for i, (prompt, params, _) in enumerate(requests):
        assert outputs[i] == plain_greedy(model, prompt, params.max_tokens), f"request {i}"
    assert all(owner is None for owner in decoder.runner.pool.owners)


def test_a_long_prompt_is_read_in_chunks_while_a_stream_goes_on(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    decoder = LookaheadDecoder(model, byte_tokenizer, step_token_budget=16)
    plain = LookaheadConfig(use_lookahead=False)  # no drafts: every chunk is 15 tokens
    running = decoder.start([5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True), plain)
    decoder.step([running])
    long = decoder.start(list(range(1, 200)), SamplingParams(max_tokens=4, ignore_eos=True))
    steps = 0
    while not long.output_ids:
        outputs = decoder.step([running, long])
        assert len(outputs[0].token_ids) >= 1  # the stream emits at every step the prompt is read in
        steps += 1
    assert steps == -(-198 // 15)  # 15 prompt tokens a step beside the stream's root
    assert long.stats.prefill_seconds > 0
    assert running.output_ids == plain_greedy(model, [5, 6, 7], 30)[: len(running.output_ids)]
    alone = decoder.start(list(range(1, 200)), SamplingParams(max_tokens=4, ignore_eos=True))
    running.close()
    long.close()
    assert decoder.step([alone])[0].token_ids  # no stream to stall: the prompt is read whole


def test_only_prompt_tokens_still_to_read_are_priced_beside_the_drafts(
    tiny_model, byte_tokenizer, monkeypatch
) -> None:
    from lookahead.runtime import scheduler

    seen: list[int] = []
    starts: list[list[int]] = []
    plan_step = scheduler.plan_step

    def recorded(*args, other_tokens=0, **kwargs):
        seen.append(other_tokens)
        starts.append(kwargs["starts"])
        return plan_step(*args, other_tokens=other_tokens, **kwargs)

    monkeypatch.setattr(scheduler, "plan_step", recorded)
    decoder = LookaheadDecoder(tiny_model("llama"), byte_tokenizer, step_token_budget=64)
    gen = decoder.start(list(range(1, 30)), SamplingParams(max_tokens=6, ignore_eos=True))
    lengths = []
    while not gen.finished:
        lengths.append(len(gen.ids))
        gen.step()
    assert seen[0] == 28 and set(seen[1:]) == {0}  # the prompt, then nothing but the drafts
    # each root's draft is priced for the cached entries before the root: all of the text so far
    assert starts == [[length - 1] for length in lengths]


def test_seeded_sampling_in_a_batch_matches_sampling_alone(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    rng = random.Random(3)
    requests = [
        (repetitive_prompt(rng, 256), SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=i), i)
        for i in range(4)
    ]
    alone = LookaheadDecoder(model, byte_tokenizer, NGramTrie(capacity=10_000, max_depth=16))
    expected = [alone.generate(prompt, params)[0] for prompt, params, _ in requests]
    together = LookaheadDecoder(model, byte_tokenizer, NGramTrie(capacity=10_000, max_depth=16))
    outputs, _ = run_concurrently(together, requests)
    assert [outputs[i] for i in range(4)] == expected


def test_plain_and_speculative_requests_share_a_batch(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    prompt = [7, 8, 9, 10, 7, 8]
    expected = plain_greedy(model, prompt, 16)
    trie = NGramTrie(capacity=1000, max_depth=9)
    trie.insert(prompt[-3:] + expected)
    decoder = LookaheadDecoder(model, byte_tokenizer, trie, LookaheadConfig(adaptive=False))
    plain = decoder.start(prompt, SamplingParams(max_tokens=16), LookaheadConfig(use_lookahead=False))
    drafted = decoder.start(prompt, SamplingParams(max_tokens=16))
    while not (plain.finished and drafted.finished):
        decoder.step([g for g in (plain, drafted) if not g.finished])
    assert plain.output_ids == drafted.output_ids == expected
    assert plain.stats.draft_tokens == 0 and plain.stats.steps == 15
    assert drafted.stats.accepted_draft_tokens > 0 and drafted.stats.steps < 15


def test_the_optional_cap_switches_speculation_off_above_a_batch_size(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    prompt = [7, 8, 9, 10, 7, 8]
    trie = NGramTrie(capacity=1000, max_depth=9)
    trie.insert(prompt[-3:] + plain_greedy(model, prompt, 10))
    decoder = LookaheadDecoder(
        model, byte_tokenizer, trie, LookaheadConfig(adaptive=False), max_speculative_batch=2
    )
    alone = decoder.start(prompt, SamplingParams(max_tokens=10))
    decoder.step([alone])
    assert alone.stats.draft_tokens > 0  # the prompt's last chunk carries a draft
    alone.close()
    gens = [decoder.start(prompt, SamplingParams(max_tokens=10)) for _ in range(3)]
    while not all(g.finished for g in gens):
        decoder.step([g for g in gens if not g.finished])
    # no draft is fed in a step above the cap, nor retrieved only to be dropped
    assert [(g.stats.draft_tokens, len(g.stats.retrieval_seconds)) for g in gens] == [(0, 0)] * 3
    assert all(g.stats.steps > 0 for g in gens)
    assert all(g.output_ids == plain_greedy(model, prompt, 10) for g in gens)


@pytest.mark.parametrize("kernel", LINEAR_KERNELS)
def test_a_segment_gives_the_same_logits_whatever_shares_its_forward(
    kernel, tiny_model, byte_tokenizer
) -> None:
    decoder = LookaheadDecoder(tiny_model("llama", linear_kernel=kernel), byte_tokenizer)
    assert decoder.runner.head_of_hidden is not None
    gens = [
        decoder.start(prompt, SamplingParams(max_tokens=8))
        for prompt in ([5, 6, 7], [9, 10, 11, 12, 13], [40, 41, 42, 43, 44, 45, 46])
    ]
    decoder.step(gens)  # every prompt read: slots 0, 1 and 2
    drafts = [
        Draft([gens[0].ids[-1], 1, 2, 3], [-1, 0, 1, 1]),
        Draft.root_only(gens[1].ids[-1]),
        Draft([gens[2].ids[-1], 4, 5], [-1, 0, 1]),
    ]
    lengths = [len(gen.ids) - 1 for gen in gens]
    with torch.inference_mode():
        together = decoder.runner.forward_drafts(drafts, lengths)
        alone = [decoder.runner.forward_drafts([drafts[i]], [lengths[i]], slots=[i])[0] for i in range(3)]
        decoder.runner.head_of_hidden = None  # the model's own output layer over every row
        whole = decoder.runner.forward_drafts(drafts, lengths)
    assert [rows.shape[0] for rows in together] == [4, 1, 3]
    # the packed kernel's rows and the lean layers' per-segment attention do not depend on what
    # else a forward holds; transformers' layers read the segments side by side (summation order)
    exact = kernel != "stock"
    for mine, theirs, full in zip(together, alone, whole):
        torch.testing.assert_close(mine, theirs, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)
        torch.testing.assert_close(mine, full, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)


class _Log:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def log_info(self, message: str) -> None:
        pass

    log_warn = log_info

    def log_error(self, message: str) -> None:
        self.errors.append(message)


@pytest.mark.parametrize("where", ["select", "decode"])
def test_one_failing_request_in_a_batched_step_leaves_the_others_as_if_alone(
    where, tiny_model, byte_tokenizer
):
    """Its sampler (or its detokenizer) raises at its third step; the batch goes on unchanged."""
    from backend.engine import Engine, FailureCode, RequestState
    from backend.request import GenerationRequest

    model = tiny_model("llama")
    prompts = {"a": [5, 6, 7, 5, 6], "b": [9, 8, 9, 8, 9], "c": [3, 1, 4, 1, 5]}
    params = {name: SamplingParams(max_tokens=10, temperature=0.9, seed=i) for i, name in enumerate(prompts)}
    params["c"] = SamplingParams(max_tokens=3, temperature=0.9, seed=2)  # finishes in the step b fails in
    alone = {}
    for name, prompt in prompts.items():
        decoder = LookaheadDecoder(model, byte_tokenizer, NGramTrie(10_000, 9))
        gen = decoder.start(prompt, params[name])
        text = ""
        while not gen.finished:
            text += gen.step().text
        alone[name] = (gen.output_ids, text)

    decoder = LookaheadDecoder(model, byte_tokenizer, NGramTrie(10_000, 9), max_speculative_batch=3)
    start = decoder.start

    def start_with_a_fault(prompt_ids, sampling, lookahead=None, request_id="", grammar=None, **options):
        gen = start(prompt_ids, sampling, lookahead, request_id, grammar, **options)
        if list(prompt_ids) == prompts["b"]:
            target = gen.selector if where == "select" else gen.detokenizer
            name = "select" if where == "select" else "_decode"
            original, calls = getattr(target, name), []

            def faulty(*args):
                calls.append(1)
                if len(calls) >= (3 if where == "select" else 4):  # broken from then on
                    raise RuntimeError("broken request")
                return original(*args)

            setattr(target, name, faulty)
        return gen

    decoder.start = start_with_a_fault
    updates, finals = [], threading.Semaphore(0)

    def emit(update):
        updates.append(update)
        if update.final:
            finals.release()

    engine = Engine(decoder, emit, _Log())
    states = {}
    for name, prompt in prompts.items():
        states[name] = RequestState(id=name, sender=None)
        states[name].request = GenerationRequest(
            prompt="",
            prompt_ids=tuple(prompt),
            sampling=params[name],
            lookahead=LookaheadConfig(),
            stream=True,
            prepend_input=False,
        )
        engine.submit(states[name])
    engine.start()
    for _ in prompts:
        assert finals.acquire(timeout=60)
    engine.stop()
    by_name = {name: [u for u in updates if u.state is state] for name, state in states.items()}
    assert by_name["b"][-1].failure is FailureCode.INTERNAL and "broken request" in by_name["b"][-1].message
    for name in ("a", "c"):
        assert by_name[name][-1].failure is None, by_name[name][-1].message
        assert "".join(u.text for u in by_name[name]) == alone[name][1]
        assert states[name].generation.output_ids == alone[name][0]


def test_the_pool_is_freed_when_idle_and_requests_beyond_kv_cache_bytes_are_refused(
    tiny_model, byte_tokenizer
):
    model = tiny_model("llama")
    decoder = LookaheadDecoder(model, byte_tokenizer, kv_cache_bytes=0)
    per_token = decoder.kv_bytes_per_token
    assert per_token == 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x fp32
    gen = decoder.start([1, 2, 3], SamplingParams(max_tokens=4))
    while not gen.finished:
        gen.step()
    pool = decoder.runner.pool
    assert pool.keys == [] and pool.nbytes == 0  # nothing runs: the memory went back
    # A slot of 256 entries (the least the pool allocates), and the one layer buffer a growth copies.
    slot = 256 * (per_token + 2 * 16 * 4)
    bounded = LookaheadDecoder(model, byte_tokenizer, kv_cache_bytes=slot)
    with pytest.raises(ValueError, match="need .* bytes of KV cache, more than kv_cache_bytes"):
        bounded.start([1, 2, 3], SamplingParams(max_tokens=200))  # 3 + 200 + 64 (one draft) entries
    bounded.start([1, 2, 3], SamplingParams(max_tokens=100))
    assert (
        bounded.fits([40]) and bounded.fits([256]) and not bounded.fits([257]) and not bounded.fits([40, 40])
    )


def live_pool_bytes(monkeypatch: pytest.MonkeyPatch, pool: KVPool) -> list[int]:
    """[the most bytes of pool buffers alive at once]: measured at each buffer the pool allocates,
    the new one and the ones the pool still holds (a resize's old layers included)."""
    peak = [0]
    zeros, new_zeros = torch.zeros, torch.Tensor.new_zeros

    def counted(tensor: torch.Tensor) -> torch.Tensor:
        if sys._getframe(2).f_globals["__name__"] == kv_pool.__name__:
            peak[0] = max(peak[0], pool.nbytes + tensor.nbytes)
        return tensor

    monkeypatch.setattr(torch, "zeros", lambda *a, **k: counted(zeros(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_zeros", lambda self, *a, **k: counted(new_zeros(self, *a, **k)))
    return peak


def step_running(decoder: LookaheadDecoder, running: dict[int, Any], outputs: dict[int, list[int]]) -> None:
    """One step of every running request: each one's tokens go to its outputs, and finished ones
    leave `running`."""
    order = list(running)
    for i, out in zip(order, decoder.step([running[i] for i in order])):
        assert out.error is None, out.error
        outputs[i] += out.token_ids
        if out.finish_reason:
            del running[i]


def test_requests_admitted_by_fits_never_take_the_pool_past_kv_cache_bytes(
    tiny_model, byte_tokenizer, monkeypatch
):
    """The engine's admission (decoder.fits), requests of every length joining and leaving: the
    live pool buffers, a growth's old and new ones together, stay within the bound, and every
    output is still plain greedy decoding's (slots move when others leave)."""
    model = tiny_model("llama")
    config = LookaheadConfig(decoding_length=8, branch_length=5, adaptive=False)
    per_token = LookaheadDecoder(model, byte_tokenizer).kv_bytes_per_token
    bound = 1200 * per_token
    decoder = LookaheadDecoder(model, byte_tokenizer, NGramTrie(10_000, 9), config, kv_cache_bytes=bound)
    assert decoder.eos_token_ids == ()
    peak = live_pool_bytes(monkeypatch, decoder.runner.pool)
    rng = random.Random(7)
    requests = []
    for _ in range(12):
        prompt = repetitive_prompt(rng, model.config.vocab_size) * rng.choice([1, 3, 12])
        requests.append((prompt[:300], SamplingParams(max_tokens=rng.randrange(4, 120))))
    waiting, running, outputs, most = list(range(len(requests))), {}, {}, 0
    while waiting or running:
        while waiting:
            prompt, params = requests[waiting[0]]
            longest = [
                decoder.longest(len(p), s, config) for p, s in (requests[i] for i in [*running, waiting[0]])
            ]
            if running and not decoder.fits(longest):
                break
            i = waiting.pop(0)
            running[i], outputs[i] = decoder.start(prompt, params), []
        most = max(most, len(running))
        step_running(decoder, running, outputs)
    assert most >= 3  # requests did run together
    assert 0 < peak[0] <= bound
    for i, (prompt, params) in enumerate(requests):  # transformers stops at the tiny model's eos (2)
        expected = plain_greedy(model, prompt, params.max_tokens)
        assert outputs[i][: len(expected)] == expected, f"request {i}"


def test_a_request_past_kv_cache_bytes_fails_alone_before_anything_is_allocated(
    tiny_model, byte_tokenizer, monkeypatch
):
    """A caller that ignores fits(): the newcomer's slot is refused (KVCacheFull, its own error)
    with the pool unchanged, and the running request goes on."""
    model = tiny_model("llama")
    config = LookaheadConfig(use_lookahead=False)
    per_token = LookaheadDecoder(model, byte_tokenizer).kv_bytes_per_token
    bound = 400 * per_token  # one slot of 256 entries; not two
    decoder = LookaheadDecoder(model, byte_tokenizer, config=config, kv_cache_bytes=bound)
    peak = live_pool_bytes(monkeypatch, decoder.runner.pool)
    short = decoder.start([1, 2, 3], SamplingParams(max_tokens=20), config)
    ids = decoder.step([short])[0].token_ids
    held = decoder.runner.pool.nbytes
    other = decoder.start([4, 5, 6], SamplingParams(max_tokens=20), config)
    first, refused = decoder.step([short, other])
    assert isinstance(refused.error, KVCacheFull) and refused.finish_reason == "error"
    assert "more than the 204800 of kv_cache_bytes" in str(refused.error)
    assert first.error is None and decoder.runner.pool.nbytes == held and peak[0] <= bound
    ids += first.token_ids
    while not short.finished:
        ids += decoder.step([short])[0].token_ids
    assert ids == plain_greedy(model, [1, 2, 3], 20)


def test_the_longest_prompt_follows_the_context_length_within_kv_cache_bytes(tiny_model, byte_tokenizer):
    model = tiny_model("llama")
    lookahead = LookaheadConfig()
    unbounded = LookaheadDecoder(model, byte_tokenizer, kv_cache_bytes=0)
    assert unbounded.longest_prompt(lookahead) == model.config.max_position_embeddings - 1
    slot = 256 * (unbounded.kv_bytes_per_token + 2 * 16 * 4)  # one slot of 256 entries (see above)
    bounded = LookaheadDecoder(model, byte_tokenizer, kv_cache_bytes=slot)
    longest = bounded.longest_prompt(lookahead)
    assert longest == 256 - 1 - lookahead.decoding_length  # the prompt, one output token, one draft
    bounded.check_request(longest, SamplingParams(max_tokens=1), lookahead)
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        bounded.check_request(longest + 1, SamplingParams(max_tokens=1), lookahead)


def test_requests_joining_together_get_their_slots_in_one_allocation(tiny_model, byte_tokenizer, monkeypatch):
    """Admitted one by one, each newcomer would copy the pool's buffers again; outputs as alone."""
    model = tiny_model("llama")
    decoder = LookaheadDecoder(model, byte_tokenizer, NGramTrie(10_000, 9))
    running = {0: decoder.start([1, 2, 3], SamplingParams(max_tokens=30))}
    outputs = {0: decoder.step([running[0]])[0].token_ids}
    allocations = []
    for name in ("_allocate", "_resize"):
        allocate = getattr(KVPool, name)
        monkeypatch.setattr(
            KVPool,
            name,
            lambda pool, _allocate=allocate, _name=name, **sizes: [
                allocations.append(_name),
                _allocate(pool, **sizes),
            ],
        )
    prompts = {i: [4 + i, 5, 6, 7] for i in range(1, 6)}
    for i, prompt in prompts.items():
        running[i], outputs[i] = decoder.start(prompt, SamplingParams(max_tokens=30)), []
    while running:
        step_running(decoder, running, outputs)
    assert allocations == ["_resize"]  # six slots at once, of the 256 entries every request needed
    for i, prompt in {0: [1, 2, 3], **prompts}.items():
        expected = plain_greedy(model, prompt, 30)
        assert outputs[i][: len(expected)] == expected, f"request {i}"
