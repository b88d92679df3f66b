"""The packed linear kernel: same results as nn.Linear, independent of the batch, exact integer forms."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
from torch import nn

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.cpu.extension import FastPathUnavailable, load_extension
from lookahead.cpu.packed_linear import PackedLinear, _pack_columns, exact_int8_blocks
from lookahead.models.loading import apply_execution_path
from tests.helpers import CPU_VARIANTS, plain_greedy, repetitive_prompt


@pytest.fixture(params=CPU_VARIANTS)
def extension(request: pytest.FixtureRequest) -> Any:
    """Each variant of the kernel this CPU runs."""
    return load_extension(request.param)


def apply_linear_kernel(model: nn.Module, kernel: str) -> str:
    return apply_execution_path(model, kernel)[0]


def dequantised(rows: int, inputs: int, bits: int, seed: int) -> torch.Tensor:
    """Weights as a Q4_1 (bits=4: d * q + m, q in 0..15) or Q8_0 (bits=8: d * q) checkpoint dequantises.

    As those quantisers do, every group of 32 spans the full q range (its extremes define d).
    """
    generator = torch.Generator().manual_seed(seed)
    groups = inputs // 32
    d = (torch.rand(rows, groups, 1, generator=generator) * 0.01 + 1e-4).half().float()
    if bits == 4:
        q = torch.randint(0, 16, (rows, groups, 32), generator=generator).float()
        q[..., 0], q[..., 1] = 0, 15
        m = -(torch.rand(rows, groups, 1, generator=generator) * 0.1).half().float()
        return (d * q + m).reshape(rows, inputs)
    q = torch.randint(-127, 128, (rows, groups, 32), generator=generator).float()
    q[..., 0] = 127
    return (d * q).reshape(rows, inputs)


@pytest.mark.parametrize("outputs, inputs, bias", [(100, 96, True), (576, 576, False), (49, 64, True)])
def test_packed_linear_computes_what_nn_linear_does(outputs: int, inputs: int, bias: bool, extension) -> None:
    torch.manual_seed(outputs)
    linear = nn.Linear(inputs, outputs, bias=bias)
    packed = PackedLinear.from_linear(linear, extension)
    for shape in [(1, inputs), (3, 5, inputs), (40, inputs)]:
        x = torch.randn(shape)
        got = packed(x)
        assert got.shape == (*shape[:-1], outputs)
        torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)


def packed_from(weight: torch.Tensor, extension: Any) -> PackedLinear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    return PackedLinear.from_linear(linear, extension)


@pytest.mark.parametrize("form", ["fp32", "int8", "int4"])
def test_each_rows_result_does_not_depend_on_the_other_rows(form: str, extension) -> None:
    weight = torch.randn(200, 128) if form == "fp32" else dequantised(200, 128, int(form[3:]), seed=1)
    packed = packed_from(weight, extension)
    assert packed.weights.form == form
    x = torch.randn(100, 128)  # 100 rows: 9 row tiles, enough for integer blocks to be rebuilt once
    together = packed(x)
    for count in (1, 2, 5, 16, 33, 99):
        assert torch.equal(packed(x[:count]), together[:count]), f"{count} rows"
    assert torch.equal(torch.stack([packed(row[None])[0] for row in x]), together)


@pytest.mark.parametrize("bits", [4, 8])
def test_integer_forms_rebuild_dequantised_weights_bit_for_bit(bits: int, extension) -> None:
    weight = dequantised(64, 96, bits, seed=bits)
    blocks = exact_int8_blocks(weight)
    assert blocks is not None
    q, d, m = blocks
    assert d.dtype == m.dtype == torch.float16
    rebuilt = d.float().repeat_interleave(32, dim=1) * q.float() + m.float().repeat_interleave(32, dim=1)
    assert torch.equal(rebuilt.view(torch.int32), weight.view(torch.int32))
    packed = packed_from(weight, extension)
    assert packed.weights.form == f"int{bits}"
    assert packed.weights.q_packed.numel() == 64 * 96 * bits // 8  # a byte, or half a byte, per weight
    # The kernel on the integer form returns exactly what it returns on the fp32 form, with weights
    # rebuilt as they stream (few row tiles) or once per group of blocks (many, here 10).
    for rows in (1, 9, 30, 120):
        x = torch.randn(rows, 96)
        assert torch.equal(packed(x), extension.fp32_linear(x, _pack_columns(weight), 64)), f"{rows} rows"


def test_ordinary_weights_stay_fp32() -> None:
    assert exact_int8_blocks(torch.randn(32, 64)) is None
    assert exact_int8_blocks(dequantised(16, 64, 4, seed=0)[:, :48]) is None  # inputs not a multiple of 32
    almost = dequantised(16, 64, 4, seed=0)
    almost[3, 7] = torch.nextafter(almost[3, 7], torch.tensor(1.0))  # one weight off by one ulp
    assert exact_int8_blocks(almost) is None
    # Q4_1-shaped, but with an offset half precision cannot hold (the kernel reads fp16 scales)
    q = torch.randint(0, 16, (16, 2, 32), generator=torch.Generator().manual_seed(0)).float()
    q[..., 0], q[..., 1] = 0, 15
    assert exact_int8_blocks((2**-7 * q - 0.1).reshape(16, 64)) is None


def test_kernel_choice_and_its_errors(tiny_model) -> None:
    with pytest.raises(ValueError, match="linear_kernel must be one of auto, packed, stock"):
        apply_linear_kernel(tiny_model("llama"), "fast")
    half = tiny_model("llama").to(torch.bfloat16)
    with pytest.raises(FastPathUnavailable, match="fp32 only, not bfloat16"):
        apply_linear_kernel(half, "packed")
    assert apply_linear_kernel(half, "auto") == "stock"
    assert not any(isinstance(module, PackedLinear) for module in half.modules())
    model = tiny_model("qwen2")  # attention projections with biases
    assert apply_linear_kernel(model, "auto") == "packed"
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    assert linears == []
    assert sum(isinstance(module, PackedLinear) for module in model.modules()) == 2 * 7 + 1


def quantise_in_place(model: nn.Module, bits: int) -> None:
    """Give every linear layer Q4_1- or Q8_0-dequantised weights, so that packing picks an integer form."""
    for index, module in enumerate(m for m in model.modules() if isinstance(m, nn.Linear)):
        outputs, inputs = module.weight.shape
        module.weight.data.copy_(dequantised(outputs, inputs, bits, seed=index) * 4)


@pytest.mark.parametrize("weights", ["fp32", "int8", "int4"])
def test_lookahead_on_the_packed_path_is_lossless(weights: str, tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama", tie_word_embeddings=False)
    if weights != "fp32":
        quantise_in_place(model, int(weights[3:]))
    apply_linear_kernel(model, "packed")
    packed = [module for module in model.modules() if isinstance(module, PackedLinear)]
    assert packed and all(module.weights.form == weights for module in packed)
    model.generation_config.eos_token_id = None  # both decode all 24 tokens, whatever they are
    rng = random.Random(weights)
    vocab = model.config.vocab_size
    for case in range(4):
        prompt = repetitive_prompt(rng, vocab)
        expected = plain_greedy(model, prompt, 24)  # transformers' generate on the same packed layers
        trie = NGramTrie(capacity=10_000, max_depth=9)
        truth = prompt[-3:] + expected
        trie.insert([t if i % 4 else (t + 1) % vocab for i, t in enumerate(truth)] if case % 2 else truth)
        for _ in range(5):
            trie.insert([rng.randrange(vocab) for _ in range(20)])
        config = LookaheadConfig(decoding_length=12, branch_length=5, decoding_mode="hier", adaptive=False)
        ids, stats = LookaheadDecoder(model, byte_tokenizer, trie, config).generate(
            prompt, SamplingParams(max_tokens=24, ignore_eos=True)
        )
        assert ids == expected
        assert stats.accepted_draft_tokens > 0


def test_fused_siblings_share_one_product_but_never_a_stale_one(tiny_model) -> None:
    model = tiny_model("llama")
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    names = {attention: ("q_proj", "k_proj", "v_proj", "o_proj"), mlp: ("gate_proj", "up_proj", "down_proj")}
    originals = {
        (parent, name): copy.deepcopy(getattr(parent, name)) for parent in names for name in names[parent]
    }
    apply_linear_kernel(model, "packed")
    assert len({getattr(attention, name).weights for name in ("q_proj", "k_proj", "v_proj")}) == 1
    assert len({getattr(mlp, name).weights for name in ("gate_proj", "up_proj")}) == 1
    assert attention.o_proj.weights is not attention.q_proj.weights
    x, other = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    calls = [("q_proj", x), ("k_proj", other), ("v_proj", x), ("k_proj", x), ("q_proj", x.clone())]
    for name, inputs in calls:
        expected = originals[(attention, name)](inputs)
        torch.testing.assert_close(getattr(attention, name)(inputs), expected, rtol=1e-5, atol=1e-5)
    for name in ("up_proj", "gate_proj"):
        expected = originals[(mlp, name)](other)
        torch.testing.assert_close(getattr(mlp, name)(other), expected, rtol=1e-5, atol=1e-5)
    # Once every sibling took the shared product, nothing keeps it (or its input) alive.
    hidden = torch.randn(1, 3, 64)
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(attention, name)(hidden)
    assert attention.q_proj.weights._shared is None
