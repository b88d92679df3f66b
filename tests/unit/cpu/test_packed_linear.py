"""The packed linear kernel: same results as nn.Linear, independent of the batch, exact integer forms."""

from __future__ import annotations

import copy
import random
import re
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.cpu import apply_fast_path, integer_forms
from lookahead.cpu import extension as extension_module
from lookahead.cpu.extension import (
    VARIANT_ENV,
    FastPathUnavailable,
    Variant,
    load_extension,
    runnable_variants,
)
from lookahead.cpu.integer_forms import cached_integer_form, exact_integer_form
from lookahead.cpu.packed_linear import PackedLinear, _pack_columns
from lookahead.models.loading import apply_execution_path
from tests.helpers import CPU_VARIANTS, dequantised, plain_greedy, quantise_in_place, repetitive_prompt


@pytest.fixture(params=CPU_VARIANTS)
def variant(request: pytest.FixtureRequest) -> Variant:
    """Each variant of the kernel this CPU runs."""
    return request.param


@pytest.fixture
def extension(variant: Variant) -> Any:
    return load_extension(variant)


def apply_linear_kernel(model: nn.Module, kernel: str) -> str:
    return apply_execution_path(model, kernel)[0]


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


def gguf_dequantised(quantisation: str, rows: int, inputs: int, seed: int) -> torch.Tensor:
    """fp32 weights exactly as gguf's own dequantiser (which transformers loads GGUF files with)
    makes them from random blocks of a ggml quantisation type, its scales fp16 values of a
    realistic size, with the signs and ranges ggml's quantisers give them."""
    kind = GGMLQuantizationType[quantisation]
    block_inputs, block_bytes = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, inputs // block_inputs, block_bytes), dtype=np.uint8)
    halves = rng.uniform(1e-4, 2e-2, size=raw.shape[:2] + (2,)) * rng.choice(
        [-1, 1], size=raw.shape[:2] + (2,)
    )
    halves = halves.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 4)
    if quantisation == "Q4_K":  # d and dmin lead the block, both positive in ggml's quantiser
        raw[..., :4] = np.abs(halves.view(np.float16)).view(np.uint8)
    elif quantisation == "Q6_K":  # d ends the block
        raw[..., -2:] = halves[..., :2]
    elif quantisation == "Q4_1":  # d >= 0 and m lead the block; q spans 0..15, min and max define d
        raw[..., :2] = np.abs(halves[..., :2].view(np.float16)).view(np.uint8)
        raw[..., 2:4] = halves[..., 2:4]
        raw[..., 4] &= 0xF0
        raw[..., 5] |= 0x0F
    elif quantisation == "Q8_0":  # d leads the block; |q| <= 127, the largest one 127
        raw[..., :2] = halves[..., :2]
        q = raw[..., 2:].view(np.int8)
        q[q == -128] = -127
        q[..., 0] = 127
    else:  # Q5_0: d leads the block; the value of largest magnitude gets q - 16 = -16
        raw[..., :2] = halves[..., :2]
        raw[..., 2] &= 0xFE  # the high bit of value 0
        raw[..., 6] &= 0xF0  # its low nibble
    weights = dequantize(raw.reshape(rows, -1), kind)
    return torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32))


# ggml type -> (inputs per scale, scale dtype, integer form)
QUANTISATIONS = {
    "Q4_1": (32, torch.float16, "int4"),
    "Q8_0": (32, torch.float16, "int8"),
    "Q5_0": (32, torch.float16, "int8"),
    "Q4_K": (32, torch.float32, "int4"),
    "Q6_K": (16, torch.float32, "int8"),
}


@pytest.mark.parametrize("quantisation", list(QUANTISATIONS))
def test_integer_forms_rebuild_ggml_dequantised_weights_bit_for_bit(quantisation: str, extension) -> None:
    weight = gguf_dequantised(quantisation, 48, 512, seed=len(quantisation))
    form = exact_integer_form(weight)
    assert form is not None
    group, scale_dtype, kind = QUANTISATIONS[quantisation]
    assert (form.group, form.d.dtype, form.m.dtype) == (group, scale_dtype, scale_dtype)
    # The kernel's rebuild: one rounding of d * q + m (exact in float64 for these sizes).
    d64, m64 = (t.double().repeat_interleave(group, dim=1) for t in (form.d, form.m))
    rebuilt = (d64 * form.q.double() + m64).float()
    assert torch.equal(rebuilt.view(torch.int32), weight.view(torch.int32))
    packed = packed_from(weight, extension)
    assert packed.weights.form == kind
    per_weight = 1 if kind == "int8" else 0.5
    assert packed.weights.q_packed.numel() == 48 * 512 * per_weight
    # The kernel on the integer form returns exactly what it returns on the fp32 form, with weights
    # rebuilt as they stream (few row tiles) or once per group of blocks (many).
    fp32 = extension.PackedMatrix("fp32", _pack_columns(weight), None, None, None, 48)
    for rows in (1, 9, 30, 120):
        x = torch.randn(rows, 512)
        assert torch.equal(packed(x), fp32(x)), f"{rows} rows"


def test_zeros_keep_their_signs_or_the_matrix_stays_fp32() -> None:
    weight = gguf_dequantised("Q8_0", 4, 64, seed=3)
    weight[1, 32:] = torch.tensor([-0.0, 0.0] * 16)  # a group of zeros of both signs: d = -0.0, q = +-1
    weight[2, 3], weight[2, 4] = -0.0, 0.0
    assert exact_integer_form(weight[:2]) is not None
    # In a group with other values every zero is d * 0 and has the sign of d: mixed signs cannot be.
    assert exact_integer_form(weight) is None
    rebuilt = exact_integer_form(weight[:2])
    d = rebuilt.d.double().repeat_interleave(32, dim=1)
    values = (d * rebuilt.q.double() + rebuilt.m.double().repeat_interleave(32, dim=1)).float()
    assert torch.equal(values.view(torch.int32), weight[:2].view(torch.int32))


def test_ordinary_weights_stay_fp32() -> None:
    assert exact_integer_form(torch.randn(32, 64)) is None
    q41 = gguf_dequantised("Q4_1", 16, 64, seed=0)
    assert exact_integer_form(q41[:, :48]) is None  # inputs not a multiple of 32 (nor of 16, for Q4_1)
    almost = q41.clone()
    almost[3, 7] = torch.nextafter(almost[3, 7], torch.tensor(1.0))  # one weight off by one ulp
    assert exact_integer_form(almost) is None
    # Q4_1-shaped, with a scale and an offset half precision cannot hold: fp32 scales
    q = torch.randint(0, 16, (16, 2, 32), generator=torch.Generator().manual_seed(0)).float()
    q[..., 0], q[..., 1] = 0, 15
    fp32_scales = exact_integer_form((2**-7 * q * (1 + 2**-20) - 0.1).reshape(16, 64))
    assert fp32_scales is not None and fp32_scales.d.dtype == torch.float32 and fp32_scales.nibbles


def test_kernel_choice_and_its_errors(tiny_model) -> None:
    with pytest.raises(ValueError, match="linear_kernel must be one of auto, integer, packed, stock"):
        apply_linear_kernel(tiny_model("llama"), "fast")
    half = tiny_model("llama").to(torch.bfloat16)
    with pytest.raises(FastPathUnavailable, match="fp32 only, not bfloat16"):
        apply_linear_kernel(half, "packed")
    assert apply_execution_path(half, "auto")[:2] == (
        "stock",
        "stock linear layers (the packed kernel is fp32 only, not bfloat16)",
    )
    assert not any(isinstance(module, PackedLinear) for module in half.modules())


def test_auto_packs_every_linear_layer_on_the_chosen_variant(
    variant: Variant, tiny_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VARIANT_ENV, variant.name)
    model = tiny_model("qwen2")  # attention projections with biases
    expected = ("integer", f"integer {variant.name} kernel (int8 activations), fused layers")
    assert apply_execution_path(model, "auto")[:2] == expected
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    assert linears == []
    assert sum(isinstance(module, PackedLinear) for module in model.modules()) == 2 * 7 + 1


@pytest.mark.parametrize(
    ("machine", "flags", "reason"),
    [
        ("aarch64", {"neon"}, "the fast CPU path needs an x86-64 CPU, this one is aarch64"),
        ("x86_64", {"sse4_2", "avx"}, "avx2+f16c+fma; this one has none of them"),
        ("x86_64", {"avx2", "fma"}, "avx2+f16c+fma; this one has avx2+fma"),
    ],
)
def test_a_cpu_without_either_set_gets_the_stock_layers_and_the_reason(
    machine: str, flags: set[str], reason: str, tiny_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(extension_module.platform, "machine", lambda: machine)
    monkeypatch.setattr(extension_module, "cpu_flags", lambda: frozenset(flags))
    model = tiny_model("llama")
    kernel, execution, prior = apply_execution_path(model, "auto")
    assert (kernel, prior) == ("stock", None)
    assert execution.startswith("stock linear layers (") and reason in execution
    with pytest.raises(FastPathUnavailable, match=re.escape(reason)):
        apply_execution_path(model, "packed")


def test_a_forced_variant_must_exist_and_run(tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VARIANT_ENV, "avx9")
    with pytest.raises(FastPathUnavailable, match="unknown CPU variant 'avx9': one of avx512, avxvnni, avx2"):
        apply_execution_path(tiny_model("llama"), "packed")
    monkeypatch.setenv(VARIANT_ENV, "avx512")
    monkeypatch.setattr(extension_module, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    with pytest.raises(FastPathUnavailable, match="LOOKAHEAD_CPU_VARIANT=avx512: this CPU cannot run it"):
        apply_execution_path(tiny_model("llama"), "packed")


@pytest.mark.parametrize("weights", ["fp32", "int8", "int4"])
def test_lookahead_on_the_packed_path_is_lossless(
    weights: str, variant: Variant, tiny_model, byte_tokenizer
) -> None:
    model = tiny_model("llama", tie_word_embeddings=False)
    if weights != "fp32":
        quantise_in_place(model, int(weights[3:]))
    apply_fast_path(model, "packed", variant)
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


@pytest.mark.skipif(len(runnable_variants()) < 2, reason="this CPU runs only one variant of the kernel")
@pytest.mark.parametrize("form", ["fp32", "int8", "int4"])
def test_every_variant_computes_the_same_bits(form: str) -> None:
    weight = torch.randn(300, 192) if form == "fp32" else dequantised(300, 192, int(form[3:]), seed=7)
    x = torch.randn(70, 192)
    results = []
    for runnable in runnable_variants():
        packed = packed_from(weight, load_extension(runnable))
        assert packed.weights.form == form
        results.append([packed(x[:rows]) for rows in (1, 2, 3, 5, 8, 13, 70)])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_found_forms_are_kept_by_the_weights_digest_and_searched_again_when_unreadable(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(integer_forms, "FORMS_DIR", tmp_path)
    quantised, ordinary = gguf_dequantised("Q4_K", 8, 256, seed=5), torch.randn(8, 256)
    found, none = cached_integer_form(quantised), cached_integer_form(ordinary)
    assert found is not None and none is None
    assert len(list(tmp_path.glob("*.safetensors"))) == 2

    def no_search(weight: torch.Tensor) -> None:
        raise AssertionError("searched although the form was kept")

    with monkeypatch.context() as patched:
        patched.setattr(integer_forms, "exact_integer_form", no_search)
        again = cached_integer_form(quantised.clone())
        assert cached_integer_form(ordinary) is None
    assert again is not None and again.group == found.group
    assert all(torch.equal(a, b) for a, b in zip((again.q, again.d, again.m), (found.q, found.d, found.m)))
    for entry in tmp_path.glob("*.safetensors"):
        entry.write_bytes(b"\x00" * 12)  # unreadable: searched again and replaced
    assert cached_integer_form(quantised) is not None and cached_integer_form(ordinary) is None
    assert all(entry.stat().st_size > 12 for entry in tmp_path.glob("*.safetensors"))
    other = quantised.clone()
    other[0, 0] = torch.nextafter(other[0, 0], torch.tensor(1.0))  # one bit: another entry
    assert cached_integer_form(other) is None
    assert len(list(tmp_path.glob("*.safetensors"))) == 3


def test_streamed_bytes_count_what_the_kernel_reads(extension) -> None:
    """The roofline's memory floor: an int8 form without offsets streams q and its scales, not the
    zero offsets the kernel skips; an int4 form with offsets streams them too; fp32 its weights."""
    int8 = packed_from(dequantised(64, 128, 8, seed=2), extension).weights
    d_bytes = int8.d_packed.numel() * int8.d_packed.element_size()
    assert int8.form == "int8" and not bool(int8.m_packed.any())
    assert int8.streamed_bytes() == 64 * 128 + d_bytes
    int4 = packed_from(dequantised(64, 128, 4, seed=2), extension).weights
    assert int4.form == "int4" and bool(int4.m_packed.any())
    assert int4.streamed_bytes() == 64 * 128 // 2 + 2 * d_bytes
    fp32 = packed_from(torch.randn(64, 128), extension).weights
    assert fp32.streamed_bytes() == 64 * 128 * 4
