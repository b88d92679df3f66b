"""The integer kernel (int8 activations against integer weight forms): exactly the quantised
arithmetic csrc/integer_linear.h defines, on every variant, whatever shares a call."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

from lookahead.cpu.extension import load_extension, runnable_variants
from lookahead.cpu.integer_forms import IntegerForm
from lookahead.cpu.packed_linear import PackedWeights
from tests.helpers import CPU_VARIANTS


@pytest.fixture(params=CPU_VARIANTS)
def extension(request: pytest.FixtureRequest) -> Any:
    return load_extension(request.param)


@dataclass(frozen=True)
class Factors:
    d_super: torch.Tensor
    d_sub: torch.Tensor
    m_super: torch.Tensor
    m_sub: torch.Tensor


# The packed form each kind of random_form takes with int8 activations, and whether its scales
# stay factored.
PACKED_AS = {
    "q4_1": ("int4", False),
    "q8_0": ("int8", False),
    "q6_k": ("int8", False),
    "q4_k": ("int4", False),
    "q5_0": ("int5", False),
    "q5_k": ("int5", True),
    "q4_k_file": ("int4", True),
    "q6_k_file": ("int6", True),
}


def random_form(kind: str, outputs: int, inputs: int, seed: int) -> IntegerForm:
    """An integer form as ggml's formats give them: Q4_1 (int4, fp16 d and m), Q8_0 (int8, fp16 d,
    no offset), Q5_0 (-16..15, fp16 d), Q6_K (int8 in -32..32, fp32 d per 16 inputs) and Q4_K
    (int4, fp32 d and m); and as K-quant files keep them ("_file", Q5_K): q in the file's range,
    d and m an fp16 per 256 inputs times a small integer per group, with those factors."""
    generator = torch.Generator().manual_seed(seed)
    group = 16 if kind.startswith("q6_k") else 32
    shape = (outputs, inputs // group)
    d = torch.rand(shape, generator=generator) * 0.02 + 1e-3
    m = -torch.rand(shape, generator=generator) * 0.1
    if kind in ("q4_k_file", "q5_k", "q6_k_file"):
        supers = (outputs, inputs // 256)
        d_super = (torch.rand(supers, generator=generator) * 1e-3).half()
        m_super = -(torch.rand(supers, generator=generator) * 1e-3).half()
        if kind == "q6_k_file":
            d_sub = torch.randint(-128, 128, shape, generator=generator).to(torch.int8)
            m_super, m_sub = torch.zeros_like(m_super), torch.zeros_like(d_sub)
            q = torch.randint(-32, 32, (outputs, inputs), generator=generator)
        else:
            d_sub = torch.randint(0, 64, shape, generator=generator).to(torch.int8)
            m_sub = torch.randint(0, 64, shape, generator=generator).to(torch.int8)
            q = torch.randint(0, 32 if kind == "q5_k" else 16, (outputs, inputs), generator=generator)
        factors = Factors(d_super, d_sub, m_super, m_sub)

        def product(super_: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
            return super_.float().repeat_interleave(256 // group, dim=1) * sub.float()

        return IntegerForm(q.to(torch.int8), product(d_super, d_sub), product(m_super, m_sub), group, factors)
    if kind == "q4_1":
        q = torch.randint(0, 16, (outputs, inputs), generator=generator)
        return IntegerForm(q.to(torch.int8), d.half(), m.half(), group)
    if kind == "q4_k":
        q = torch.randint(0, 16, (outputs, inputs), generator=generator)
        return IntegerForm(q.to(torch.int8), d * (1 + 2**-20), m * (1 + 2**-19), group)
    low, high = {"q8_0": (-128, 128), "q5_0": (-16, 16), "q6_k": (-32, 33)}[kind]
    q = torch.randint(low, high, (outputs, inputs), generator=generator)
    scale = d.half() if kind in ("q8_0", "q5_0") else d
    return IntegerForm(q.to(torch.int8), scale, torch.full_like(scale, -0.0), group)


def fma32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """a * b + c rounded once to fp32 (ties to even), as a fused multiply-add computes it."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    if exact == 0:
        return np.float32(0.0)
    guess = np.float32(float(exact))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return min(candidates, key=lambda v: (abs(Fraction(float(v)) - exact), int(v.view(np.int32)) & 1))


def quantised(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row per block of 32: d = max|x| / 127, q = round(x * (1 / d)), ties to even (fp32)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(blocks).max(-1) / np.float32(127)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(
        np.float32
    )
    q = np.rint(blocks * inverse[..., None]).astype(np.int64)
    return q.reshape(x.shape), d.astype(np.float32)


def reference(form: IntegerForm, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The integer kernel's result, computed from its definition."""
    qx, dx = quantised(x.numpy())
    qw = form.q.numpy().astype(np.int64)
    dw, mw = form.d.float().numpy(), form.m.float().numpy()
    group = form.group
    groups = qw.shape[1] // group
    offsets = bool((mw != 0).any())
    out = np.zeros((x.shape[0], qw.shape[0]), dtype=np.float32)
    for r in range(x.shape[0]):
        for n in range(qw.shape[0]):
            acc = np.float32(0.0)
            for g in range(groups):
                span = slice(g * group, (g + 1) * group)
                scale_x = dx[r, g * group // 32]
                dot = int((qw[n, span] * qx[r, span]).sum())
                acc = fma32(np.float32(dw[n, g]) * scale_x, np.float32(dot), acc)
                if offsets:
                    acc = fma32(np.float32(mw[n, g]), scale_x * np.float32(int(qx[r, span].sum())), acc)
            out[r, n] = acc if bias is None else acc + np.float32(bias[n])
    return torch.from_numpy(out)


@pytest.mark.parametrize("kind", list(PACKED_AS))
def test_the_kernel_computes_the_quantised_arithmetic_bit_for_bit(kind: str, extension: Any) -> None:
    form = random_form(kind, outputs=37, inputs=256, seed=len(kind))
    bias = torch.randn(37) if kind in ("q4_1", "q6_k", "q5_0", "q5_k") else None
    packed = PackedWeights.of(form, bias, extension, activations="int8")
    stored, factored = PACKED_AS[kind]
    assert (packed.form, packed.activations) == (stored, "int8")
    assert hasattr(packed, "d_super_packed") == factored
    x = torch.randn(5, 256) * torch.logspace(-2, 1, 256)
    x[1, 32:64] = 0.0  # a block of zeros: d = 0
    got = packed.product(x)
    assert torch.equal(got.view(torch.int32), reference(form, x, bias).view(torch.int32))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q6_k", "q5_0", "q5_k", "q4_k_file", "q6_k_file"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kind: str, extension: Any) -> None:
    form = random_form(kind, outputs=300, inputs=256, seed=2)
    packed = PackedWeights.of(form, None, extension, activations="int8")
    x = torch.randn(70, 256)
    together = packed.product(x)
    for count in (1, 2, 3, 5, 7, 16, 33):
        assert torch.equal(packed.product(x[:count]), together[:count]), f"{count} rows"
    shuffled = torch.randperm(70, generator=torch.Generator().manual_seed(0))
    assert torch.equal(packed.product(x[shuffled]), together[shuffled])
    assert torch.equal(torch.cat([packed.product(row[None]) for row in x]), together)


@pytest.mark.skipif(len(runnable_variants()) < 2, reason="this CPU runs only one variant of the kernel")
@pytest.mark.parametrize("kind", list(PACKED_AS))
def test_every_variant_computes_the_same_integer_bits(kind: str) -> None:
    form = random_form(kind, outputs=100, inputs=256, seed=7)
    x = torch.randn(40, 256)
    results = []
    for variant in runnable_variants():
        packed = PackedWeights.of(
            form,
            torch.randn(100, generator=torch.Generator().manual_seed(1)),
            load_extension(variant),
            "int8",
        )
        results.append([packed.product(x[:rows]) for rows in (1, 2, 3, 6, 13, 40)])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_weights_without_an_integer_form_or_a_multiple_of_32_inputs_keep_fp32_activations(
    extension: Any,
) -> None:
    assert PackedWeights.of(torch.randn(20, 64), None, extension, "int8").activations == "fp32"
    form = random_form("q6_k", outputs=20, inputs=48, seed=1)  # 48 inputs: groups of 16, not of 32
    packed = PackedWeights.of(form, None, extension, "int8")
    assert (packed.form, packed.activations) == ("int8", "fp32")
    with pytest.raises(ValueError, match="activations must be one of fp32, int8, not 'int4'"):
        PackedWeights.of(form, None, extension, "int4")
