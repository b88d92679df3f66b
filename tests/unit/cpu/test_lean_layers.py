"""Lean decoder layers: taken only where they give the model's own bits, on every kind of forward."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest
import torch
from torch import nn
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel

from lookahead.algorithm.draft import Draft
from lookahead.cpu import lean_layers
from lookahead.cpu.extension import load_extension, runnable_variants
from lookahead.cpu.lean_layers import LeanDecoderLayer, LeanLlamaDecoderLayer, LeanLlamaModel, use_lean_layers
from lookahead.cpu.packed_linear import PackedWeights, pack_linear_layers
from lookahead.runtime.decoder import LookaheadDecoder
from lookahead.runtime.kv_pool import KVPool, PoolStep
from tests.helpers import CPU_VARIANTS, build_tiny_model, quantise_in_place, tree_logits


@pytest.fixture(params=CPU_VARIANTS)
def extension(request: pytest.FixtureRequest) -> Any:
    return load_extension(request.param)


def is_lean(model: Any) -> list[bool]:
    return [isinstance(layer, LeanDecoderLayer) for layer in model.model.layers]


def forwards(model: Any) -> list[torch.Tensor]:
    """A prefill, a one-token step after it, a draft tree and a padded batch of two."""
    prompt = [5, 17, 33, 2, 250, 9, 41, 7]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        prefill = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits
        step = model(input_ids=torch.tensor([[3]]), cache=cache, use_cache=True).logits
        tree = tree_logits(model, prompt, [7, 8, 9, 10, 11], [-1, 0, 1, 0, 3])
        batch = model(
            input_ids=torch.tensor([prompt, [0, 0] + prompt[:6]]),
            attention_mask=torch.tensor([[1] * 8, [0, 0] + [1] * 6]),
        ).logits
    return [prefill, step, tree, batch]


def packed_tiny_model(architecture: str, extension: Any) -> nn.Module:
    model = build_tiny_model(architecture)
    pack_linear_layers(model, extension)
    return model


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "mistral"])
def test_lean_layers_give_the_bits_of_transformers_layers(architecture: str, extension: Any) -> None:
    model = packed_tiny_model(architecture, extension)
    expected = forwards(model)  # transformers' layers on the same packed kernel
    assert use_lean_layers(model, extension)
    assert all(is_lean(model))
    # one mask for every layer: the inner model's loop runs in C++ (the tiny Mistral has a window)
    assert isinstance(model.model, LeanLlamaModel) == (architecture != "mistral")
    for actual, wanted in zip(forwards(model), expected):
        assert torch.equal(actual, wanted)


def test_other_layer_shapes_keep_transformers_layers(extension: Any) -> None:
    model = packed_tiny_model("gemma", extension)
    assert not use_lean_layers(model, extension)
    assert not any(is_lean(model))


def test_a_lean_forward_that_changes_any_bit_is_refused(
    monkeypatch: pytest.MonkeyPatch, extension: Any
) -> None:
    model = packed_tiny_model("llama", extension)
    original = LeanLlamaDecoderLayer.forward

    def skewed(self: LeanDecoderLayer, *args: Any, **kwargs: Any) -> torch.Tensor:
        return original(self, *args, **kwargs) * (1 + 1e-6)

    monkeypatch.setattr(LeanLlamaDecoderLayer, "forward", skewed)
    assert not use_lean_layers(model, extension)
    assert type(model.model) is LlamaModel  # the inner model is unwrapped again
    assert all(
        type(layer) is LlamaDecoderLayer and not hasattr(layer, "lean") for layer in model.model.layers
    )


@pytest.mark.skipif(not runnable_variants(), reason="no variant of the fast CPU path runs on this CPU")
def test_the_default_model_runs_lean_layers_and_a_lean_inner_model(default_model: Any) -> None:
    assert all(is_lean(default_model.model)) and isinstance(default_model.model.model, LeanLlamaModel)


def test_a_lean_llama_hands_other_calls_to_transformers(extension: Any) -> None:
    model = packed_tiny_model("llama", extension)
    assert use_lean_layers(model, extension)
    ids = torch.tensor([[5, 17, 33, 2]])
    with torch.inference_mode():
        plain = model(input_ids=ids)
        with_hidden = model(input_ids=ids, output_hidden_states=True)  # not a lean call: stock module
    assert with_hidden.hidden_states is not None and len(with_hidden.hidden_states) == 3
    assert torch.equal(plain.logits, with_hidden.logits)


@pytest.mark.parametrize("layout", ["one segment", "ragged", "batched"])
def test_the_pool_step_writes_and_reads_the_same_in_python_and_cpp(layout: str, extension: Any) -> None:
    generator = torch.Generator().manual_seed(1)
    buffers = [torch.randn(3, 2, 16, 4, generator=generator) for _ in range(2)]
    if layout == "batched":
        rows, q = 2, 3
        step = PoolStep.batched([4, 9], q, torch.device("cpu"))
    elif layout == "ragged":
        rows, q = 1, 7
        step = PoolStep.ragged([2, 0, 1], [5, 9, 0], [3, 1, 3])
    else:
        rows, q = 1, 3
        step = PoolStep.ragged([1], [5], [3])
    keys, values = (torch.randn(rows, 2, q, 4, generator=generator) for _ in range(2))
    python_buffers = [b.clone() for b in buffers]
    cpp_buffers = [b.clone() for b in buffers]
    python_reads = step.write_and_read(*python_buffers, keys, values)
    twin = extension.PoolStep(step.segments, step.slots, step.positions, step.read_length)
    cpp_reads = twin.write_and_read(*cpp_buffers, keys, values)
    for python, cpp in zip([*python_buffers, *python_reads], [*cpp_buffers, *cpp_reads]):
        assert torch.equal(python, cpp)
    assert not torch.equal(python_buffers[0], buffers[0])  # something was written
    if layout == "ragged":  # each segment reads its own slot up to its end, side by side
        assert python_reads[0].shape == (1, 2, 8 + 10 + 3, 4)
        assert torch.equal(python_reads[0][0, :, 8 + 9], keys[0, :, 3])


def test_a_step_on_the_kv_pool_runs_every_layer_in_one_call_with_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, extension: Any, byte_tokenizer: Any
) -> None:
    model = packed_tiny_model("llama", extension)
    assert use_lean_layers(model, extension)
    decoder = LookaheadDecoder(model, byte_tokenizer)
    gen = decoder.start([5, 6, 7, 8, 9])
    decoder.step([gen])  # the prefill puts the prompt in the pool
    draft = Draft([gen.ids[-1], 1, 2, 3], [-1, 0, 1, 1])
    python_writes: list[int] = []
    write_and_read = PoolStep.write_and_read

    def counted(step: PoolStep, *args: Any) -> Any:
        python_writes.append(1)
        return write_and_read(step, *args)

    monkeypatch.setattr(PoolStep, "write_and_read", counted)
    with torch.inference_mode():
        (stacked,) = decoder.runner.forward_drafts([draft], [len(gen.ids) - 1])
        assert python_writes == []  # the pool was written from C++
        monkeypatch.setattr(lean_layers, "StepCache", type("NotAStepCache", (), {}))
        (layered,) = decoder.runner.forward_drafts([draft], [len(gen.ids) - 1])
    assert len(python_writes) == decoder.model.config.num_hidden_layers
    assert torch.equal(stacked, layered)
    assert isinstance(decoder.runner.pool, KVPool)


def integer_tiny_model(architecture: str, extension: Any, **config: Any) -> nn.Module:
    model = build_tiny_model(architecture, **config)
    quantise_in_place(model, bits=4)
    pack_linear_layers(model, extension, activations="int8")
    return model


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_the_integer_kernel_runs_fused_layers_close_to_the_lean_ones(
    architecture: str, extension: Any
) -> None:
    model = integer_tiny_model(architecture, extension)
    assert use_lean_layers(model, extension, fused=True)
    lean = model.model
    assert type(lean.stack).__name__ == "FusedStack"
    exact = lean_layers._stack_probe(lean, extension.LeanStack([layer.lean for layer in lean.layers]))
    fused = lean_layers._stack_probe(lean, lean.stack)
    distance = float((fused - exact).norm() / exact.norm())
    assert 0 < distance < 1e-4  # its own rounding, nowhere near a different computation


def long_history_probe(
    lean: LeanLlamaModel, stack: Any, history: int, pool: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """Hidden states of a stack over `pool` (default: a fresh fp32 one, its layers' keys then
    their values): a causal chunk of `history` tokens, then a 3-node tree (a root and two
    children) after it."""
    layers, vocab = len(lean.layers), lean.embed_tokens.num_embeddings
    if pool is None:
        pool = [torch.zeros(1, lean.config.num_key_value_heads, history + 3, 16) for _ in range(2 * layers)]
    outputs = []
    with torch.inference_mode():
        for tokens, positions, visible in (
            (
                [(7 * i + 3) % vocab for i in range(history)],
                list(range(history)),
                torch.ones(history, history).tril(),
            ),
            (
                [31, 32, 33],
                [history, history + 1, history + 1],
                torch.tensor([[1.0, 0, 0], [1, 1, 0], [1, 0, 1]]),
            ),
        ):
            start = positions[0]
            hidden = lean.embed_tokens(torch.tensor([tokens]))
            cos, sin = lean.rotary_emb(hidden, position_ids=torch.tensor([positions]))
            seen = torch.cat([torch.ones(len(tokens), start), visible], 1)
            mask = torch.zeros(1, 1, *seen.shape).masked_fill_(
                seen[None, None] == 0, torch.finfo(torch.float32).min
            )
            step = lean.pool_step(torch.tensor([[0, start, len(tokens)]]), None, None, start + len(tokens))
            outputs.append(stack(hidden, cos, sin, mask, pool[:layers], pool[layers:], step)[0])
    return torch.cat(outputs)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_a_long_history_attends_across_softmax_spans_as_the_lean_stack_does(
    architecture: str, extension: Any
) -> None:
    """The fused stack's softmax runs over spans of 1,024 entries and merges them; over a 1,100-entry
    history a causal chunk and a tree after it land where the lean stack's single softmax does
    (exact matrices, so that only the attention's rounding differs)."""
    model = build_tiny_model(architecture, max_position_embeddings=2048)
    pack_linear_layers(model, extension)
    assert use_lean_layers(model, extension, fused=True)
    lean = model.model
    assert type(lean.stack).__name__ == "FusedStack"
    exact = long_history_probe(lean, extension.LeanStack([layer.lean for layer in lean.layers]), 1100)
    fused = long_history_probe(lean, lean.stack, 1100)
    assert exact.shape == fused.shape == (1103, lean.config.hidden_size)
    distance = (fused - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert float(distance[1024:].max()) < 1e-6  # the rows that merge two spans


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_a_pool_of_halves_holds_each_entry_rounded_to_the_nearest_half(
    architecture: str, extension: Any
) -> None:
    """On a pool of fp16 buffers the fused stack stores each key and value as the IEEE half nearest
    its fp32 value: the first layer's entries, which no rounded entry has touched yet, are the fp32
    pool's rounded; the later layers read rounded entries, so the outputs move, by rounding only."""
    model = integer_tiny_model(architecture, extension)
    assert use_lean_layers(model, extension, fused=True)
    lean = model.model
    assert lean.reads_half_pool
    heads, layers = lean.config.num_key_value_heads, len(lean.layers)
    pools = {
        dtype: [torch.zeros(1, heads, 303, 16, dtype=dtype) for _ in range(2 * layers)]
        for dtype in (torch.float32, torch.float16)
    }
    outputs = {dtype: long_history_probe(lean, lean.stack, 300, pool) for dtype, pool in pools.items()}
    full, half = pools[torch.float32], pools[torch.float16]
    assert torch.equal(half[0], full[0].half()) and torch.equal(half[layers], full[layers].half())
    assert not torch.equal(half[layers - 1], full[layers - 1].half())  # read rounded entries before
    distance = (outputs[torch.float16] - outputs[torch.float32]).norm() / outputs[torch.float32].norm()
    assert 0 < float(distance) < 1e-2


def test_a_pool_of_halves_that_moves_the_load_probe_too_far_is_not_taken(
    monkeypatch: pytest.MonkeyPatch, extension: Any
) -> None:
    monkeypatch.setattr(lean_layers, "HALF_POOL_TOLERANCE", 0.0)  # its rounding counts as too far
    model = integer_tiny_model("llama", extension)
    assert use_lean_layers(model, extension, fused=True)
    assert type(model.model.stack).__name__ == "FusedStack"
    assert not model.model.reads_half_pool


def test_a_kv_pool_of_halves_is_refused_where_the_layers_cannot_read_one() -> None:
    from lookahead.runtime.runner import ModelRunner

    stock = build_tiny_model("llama")
    with pytest.raises(ValueError, match="kv_cache_dtype float16 needs the integer path's fused layers"):
        ModelRunner(stock, prefix_cache_tokens=0, kv_cache_bytes=0, kv_cache_dtype="float16")
    runner = ModelRunner(stock, prefix_cache_tokens=0, kv_cache_bytes=0, kv_cache_dtype="model")
    assert runner.kv_layout.dtype == torch.float32


def test_a_fused_stack_that_computes_something_else_is_refused(
    monkeypatch: pytest.MonkeyPatch, extension: Any
) -> None:
    model = integer_tiny_model("llama", extension)
    monkeypatch.setattr(lean_layers, "FUSED_TOLERANCE", 1e-12)  # its rounding counts as a difference
    assert use_lean_layers(model, extension, fused=True)
    assert type(model.model.stack).__name__ == "LeanStack"
    sliding = integer_tiny_model("mistral", extension)  # a window: transformers' masks, per-layer calls
    assert use_lean_layers(sliding, extension, fused=True)
    assert not isinstance(sliding.model, LeanLlamaModel)


@pytest.mark.skipif(not runnable_variants(), reason="no variant of the fast CPU path runs on this CPU")
def test_the_default_model_on_the_integer_kernel_runs_fused_layers_on_int8_activations() -> None:
    from lookahead.models.loading import load_model

    loaded = load_model(linear_kernel="integer")
    assert loaded.linear_kernel == "integer" and loaded.execution.startswith("integer ")
    assert type(loaded.model.model.stack).__name__ == "FusedStack"
    packed = [m for m in loaded.model.modules() if isinstance(m, PackedWeights)]
    assert len(packed) == 4 * loaded.model.config.num_hidden_layers + 1
    assert all(m.activations == "int8" for m in packed)


@pytest.mark.skipif(not runnable_variants(), reason="no variant of the fast CPU path runs on this CPU")
@pytest.mark.parametrize("kv_cache_dtype", ["model", "float16"])
@pytest.mark.parametrize("history", [40, 1020, 2100])
def test_every_node_of_a_wide_tree_gets_plain_decodings_bits_on_the_fused_stack(
    history: int, kv_cache_dtype: str
) -> None:
    """Attention units share keys across rows and heads; each node must still see exactly what
    plain decoding of its branch sees, bit for bit. A 40-token history: full and partial blocks of
    16 keys; 20 nodes: units of several rows, own entries past the shared history. 1020: a softmax
    span of 1,024 entries that ends inside the tree. 2100: one that ends inside the shared history,
    which is long enough that plain decoding's three units are split by spans over two threads.
    On a pool of halves too."""
    from lookahead.models.loading import load_model
    from lookahead.runtime.runner import ModelRunner

    loaded = load_model(linear_kernel="integer")
    assert type(loaded.model.model.stack).__name__ == "FusedStack"
    runner = ModelRunner(loaded.model, prefix_cache_tokens=0, kv_cache_bytes=0, kv_cache_dtype=kv_cache_dtype)
    prompt = [(37 * i + 11) % 5000 + 100 for i in range(history)]
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 9, 10, 11, 12, 13, 14]
    tokens = [(53 * i + 7) % 4000 + 300 for i in range(len(parents))]
    with torch.inference_mode(), runner.scratch_slot() as slot:
        runner.forward_drafts([Draft(prompt, [-1, *range(len(prompt) - 1)])], [0], [slot])
        assert runner.pool.keys[0].dtype == (torch.float16 if kv_cache_dtype == "float16" else torch.float32)
        tree = runner.forward_drafts([Draft(tokens, parents)], [len(prompt)], [slot])[0].clone()
        for node in range(len(parents)):
            branch = [node]
            while parents[branch[-1]] >= 0:
                branch.append(parents[branch[-1]])
            length = len(prompt)
            for step in reversed(branch):  # plain decoding: one token a forward, root first
                plain = runner.forward_drafts([Draft.root_only(tokens[step])], [length], [slot])[0]
                length += 1
            assert torch.equal(plain[0], tree[node]), f"node {node} differs from plain decoding"


@pytest.mark.skipif(not runnable_variants(), reason="no variant of the fast CPU path runs on this CPU")
@pytest.mark.parametrize("history_length", [300, 2100])
def test_the_fused_stack_gives_the_same_bits_whatever_the_teams_size(history_length: int) -> None:
    """Threads share out matrix columns and attention units (weighted by the entries each reads),
    never a sum: a step of a long causal prompt chunk beside a tree over another slot's history,
    comes out bit for bit the same on 1, 2 and 3 threads; so does one token after the history, whose
    units two threads split by softmax spans of 1,024 entries past 2,048 entries."""
    from lookahead.models.loading import load_model
    from lookahead.runtime.runner import ModelRunner

    loaded = load_model(linear_kernel="integer")
    assert type(loaded.model.model.stack).__name__ == "FusedStack"
    runner = ModelRunner(loaded.model, prefix_cache_tokens=0, kv_cache_bytes=0)
    history = [(31 * i + 5) % 5000 + 100 for i in range(history_length)]
    chunk = [(17 * i + 3) % 5000 + 100 for i in range(270)]
    parents = [-1, 0, 0, 1, 2, 2, 4]
    tree = [(53 * i + 7) % 4000 + 300 for i in range(len(parents))]
    threads = torch.get_num_threads()
    results = []
    try:
        with torch.inference_mode(), runner.scratch_slot() as first, runner.scratch_slot() as second:
            runner.forward_drafts([Draft(history, [-1, *range(len(history) - 1)])], [0], [second])
            for team in (1, 2, 3):
                torch.set_num_threads(team)
                out = runner.forward_drafts(
                    [Draft(chunk, [-1, *range(len(chunk) - 1)]), Draft(tree, parents)],
                    [0, len(history)],
                    [first, second],
                )
                (plain,) = runner.forward_drafts([Draft.root_only(4321)], [len(history)], [second])
                results.append([rows.clone() for rows in out] + [plain.clone()])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.skipif(not runnable_variants(), reason="no variant of the fast CPU path runs on this CPU")
def test_the_fused_stack_reads_each_rows_lists_with_the_bits_of_the_mask() -> None:
    """A ragged step on the fused stack carries each row's own columns instead of a mask: a prompt
    chunk that ends in a draft, a tree after another slot's history and a chunk that does not end
    its prompt give the logits and KV entries the dense mask gives, bit for bit."""
    from lookahead.models.loading import load_model
    from lookahead.runtime.runner import ModelRunner, Work
    from lookahead.runtime.step_inputs import Segment

    loaded = load_model(linear_kernel="integer")
    lean = loaded.model.model
    assert lean.reads_row_lists
    runner = ModelRunner(loaded.model, prefix_cache_tokens=0, kv_cache_bytes=0)
    assert runner.reads_row_lists
    history = [(31 * i + 5) % 5000 + 100 for i in range(300)]
    chunk = [(17 * i + 3) % 5000 + 100 for i in range(40)]
    results = {}
    with ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        slots = [stack.enter_context(runner.scratch_slot()) for _ in range(3)]
        runner.forward_drafts([Draft(history, [-1, *range(len(history) - 1)])], [0], [slots[1]])
        segments = [
            Segment(slots[0], 0, chunk, Draft([7, 8, 9], [-1, 0, 0])),
            Segment(slots[1], len(history), [], Draft([300, 301, 302, 303, 304], [-1, 0, 0, 1, 3])),
            Segment(slots[2], 0, chunk[:25], None),
        ]
        works = [Work(runner.pool.owners[segment.slot], segment) for segment in segments]
        for reads_lists in (True, False):
            lean.reads_row_lists = reads_lists
            rows = runner.forward_segments(works)
            keys = [buffer[slots].clone() for buffer in runner.pool.keys + runner.pool.values]
            results[reads_lists] = ([r.clone() for r in rows if r is not None], keys)
        lean.reads_row_lists = True
    (rows_lists, keys_lists), (rows_mask, keys_mask) = results[True], results[False]
    assert len(rows_lists) == len(rows_mask) == 2
    assert all(torch.equal(a, b) for a, b in zip(rows_lists, rows_mask))
    assert all(torch.equal(a, b) for a, b in zip(keys_lists, keys_mask))


@pytest.mark.skipif(not runnable_variants(), reason="no variant of the fast CPU path runs on this CPU")
def test_the_fused_stack_applies_the_final_norm_as_the_model_does() -> None:
    """On the decoder's pool the fused stack runs the model's final RMSNorm inside its parallel
    region; the logits stay those of the model's own norm after the stack, to rounding."""
    from lookahead.models.loading import load_model
    from lookahead.runtime.runner import ModelRunner

    loaded = load_model(linear_kernel="integer")
    lean = loaded.model.model
    assert lean.stack_norms_output
    runner = ModelRunner(loaded.model, prefix_cache_tokens=0, kv_cache_bytes=0)
    history = [(31 * i + 5) % 5000 + 100 for i in range(200)]
    tree = Draft([300, 301, 302, 303, 304], [-1, 0, 0, 1, 3])
    logits = {}
    with torch.inference_mode(), runner.scratch_slot() as slot:
        runner.forward_drafts([Draft(history, [-1, *range(len(history) - 1)])], [0], [slot])
        for in_stack in (True, False):
            lean.stack_norms_output = in_stack
            logits[in_stack] = runner.forward_drafts([tree], [len(history)], [slot])[0].clone()
        lean.stack_norms_output = True
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))
