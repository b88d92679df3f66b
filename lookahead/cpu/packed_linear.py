"""fp32 linear layers packed once for the fast CPU kernels (csrc/packed_linear.cpp, csrc/integer_linear.cpp).

Stock fp32 linear layers re-pack their weights on every matrix-matrix call, so verifying a
16-token draft tree costs about 2x a one-token step. `pack_linear_layers` swaps every fp32
`nn.Linear` of a model for a `PackedLinear` whose weights are packed once for the kernel.
Weights that are exactly a dequantised 4- to 8-bit checkpoint (integer_forms.py: the default
model's Q4_1, Qwen's Q4_K, Q5_0, Q6_K and Q8_0) are kept as integers and fp16 or fp32 scales
the kernel rebuilds them from bit for bit: a byte per weight (int8 form), or half a byte where
every integer is in 0..15 (int4 form), plus the scales, so a step streams a sixth to a third of
the fp32 bytes. For the integer kernel a form takes as few bits as hold its integers (int5, int6:
a nibble and one or two planes of high bits) and keeps a K-quant's scales as their file does
(ScaleFactors), so a step streams about what the file holds. A caller that knows a layer's form
(a GGUF file's blocks: KnownForms) hands it over instead, and that weight never exists in fp32.

Two kinds of activations meet those integers. fp32 activations ("packed" kernel): the kernel
rebuilds every weight bit for bit and computes what nn.Linear computes, to the rounding of one
fused multiply-add chain. int8 activations ("integer" kernel, where the weights have an integer
form and a multiple of 32 inputs): each row is quantised per block of 32 and multiplied in
integers, as llama.cpp does (csrc/integer_linear.h has the arithmetic). Either way a row's
result does not depend on the other rows fed with it, so plain and speculative decoding on one
path produce the same logits bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch
from torch import nn

from .integer_forms import IntegerForm, ScaleFactors, cached_integer_form

_LANES = 16  # outputs per packed block, as in csrc/packed_linear.cpp
_ACTIVATION_BLOCK = 32  # inputs per activation scale of the integer kernel
ACTIVATIONS = ("fp32", "int8")


class LogicalForm(Protocol):
    """An integer form given by the caller (a GGUF file's blocks): weight == fl(d * q + m), and
    optionally `factors` (ScaleFactors) of d and m."""

    q: torch.Tensor  # integer [N, K], int8 range
    d: torch.Tensor  # [N, K // group], fp16 or fp32
    m: torch.Tensor
    group: int  # 16 or 32


# What a caller knows of a linear layer's weight: a form, built when its matrix is packed (one at a
# time, so no more than one matrix's integers are unpacked at once), or None: fp32 as it is, no
# search. Layers it does not name are searched (integer_forms.py).
KnownForms = Mapping[nn.Linear, Callable[[], LogicalForm] | None]


# Sibling layers that always read the same input (attention q/k/v, MLP gate/up): packed as one
# matrix, one kernel call serves all of them, which halves the calls of a forward.
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class PackedWeights(nn.Module):
    """The weights of one or more fp32 linear layers (same input) packed for the kernel.

    Kept as integer blocks (`form` int8 or int4) when exactly representable, else as fp32.
    activations "int8" multiplies an integer form with quantised activations where it can (a
    multiple of 32 inputs), else fp32 activations are used. Fused siblings share one kernel call:
    the product is kept, keyed by the input tensor's identity, until every sibling has taken it.
    """

    def __init__(
        self,
        linears: list[nn.Linear],
        extension: ModuleType,
        known: KnownForms | None = None,
        *,
        activations: str = "fp32",
    ):
        super().__init__()
        form = _form_of(linears, known or {})
        weight = None if form is not None else torch.cat([linear.weight.detach() for linear in linears])
        biases = [linear.bias for linear in linears]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self._pack(weight if form is None else form, bias, extension, activations, len(linears))

    @classmethod
    def of(
        cls,
        weights: IntegerForm | torch.Tensor,
        bias: torch.Tensor | None,
        extension: ModuleType,
        activations: str = "fp32",
    ) -> PackedWeights:
        """One matrix packed from an integer form or fp32 weights [N, K] (and its bias)."""
        packed = cls.__new__(cls)
        nn.Module.__init__(packed)
        packed._pack(weights, bias, extension, activations, 1)
        return packed

    def _pack(
        self,
        weights: IntegerForm | torch.Tensor,
        bias: torch.Tensor | None,
        extension: ModuleType,
        activations: str,
        siblings: int,
    ) -> None:
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {activations!r}")
        integer = isinstance(weights, IntegerForm)
        self.out_features, self.in_features = weights.q.shape if integer else weights.shape
        multiple = self.in_features % _ACTIVATION_BLOCK == 0
        self.activations = "int8" if activations == "int8" and integer and multiple else "fp32"
        if not integer:
            self.form = "fp32"
            self.register_buffer("weight_packed", _pack_columns(weights.detach().float()))
        else:
            zero_point = 0
            if self.activations == "int8":
                self.form, zero_point = _smallest_form(weights.q)
                stored = weights.q  # the integers as stored: q + zero point
                if zero_point:
                    stored = (stored.to(torch.int16) + zero_point).to(torch.uint8)
                nibbles = self.form != "int8"
                q_packed = _pack_quads(stored & 15 if nibbles else stored, nibbles=nibbles)
                if self.form in ("int5", "int6"):
                    self.register_buffer("high_packed", _pack_high_bits(stored >> 4, int(self.form[3]) - 4))
            else:
                self.form = "int4" if weights.nibbles else "int8"
                q_packed = _pack_columns(weights.q)
                if self.form == "int4":  # inputs 2k and 2k + 1 share a byte, low nibble first
                    q_packed = (q_packed[:, 0::2] | (q_packed[:, 1::2] << 4)).view(torch.uint8)
            self.register_buffer("q_packed", q_packed)
            factors = _exact_factors(weights) if self.activations == "int8" else None
            scales = (weights.d, weights.m) if factors is None else (factors.d_sub, factors.m_sub)
            self.register_buffer("d_packed", _pack_columns(scales[0]))
            self.register_buffer("m_packed", _pack_columns(scales[1]))
            if factors is not None:
                self.register_buffer("d_super_packed", _pack_columns(factors.d_super))
                self.register_buffer("m_super_packed", _pack_columns(factors.m_super))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        integer = self.form != "fp32"
        self.matrix = extension.PackedMatrix(  # holds the buffers above, not copies
            self.form,
            self.q_packed if integer else self.weight_packed,
            self.d_packed if integer else None,
            self.m_packed if integer else None,
            self.bias,
            self.out_features,
            self.activations,
            high=getattr(self, "high_packed", None),
            zero_point=zero_point if integer else 0,
            d_super=getattr(self, "d_super_packed", None),
            m_super=getattr(self, "m_super_packed", None),
        )
        self._siblings = siblings
        self._shared: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, product)
        self._takers_left = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._shared is not None and self._shared[0] is x:
            product = self._shared[1]
            self._takers_left -= 1
            if self._takers_left == 0:
                self._shared = None
            return product
        y = self.product(x.reshape(-1, self.in_features).contiguous())
        y = y.view(*x.shape[:-1], self.out_features)
        if self._siblings > 1:
            self._shared, self._takers_left = (x, y), self._siblings - 1
        return y

    def streamed_bytes(self) -> int:
        """The bytes one forward reads of this matrix: the weights, their scales, the offsets where
        some are not zero (the kernel skips them otherwise, csrc/packed_linear.cpp), the bias."""
        if self.form == "fp32":
            buffers = [self.weight_packed]
        else:
            extras = ("high_packed", "d_super_packed")
            buffers = [self.q_packed, self.d_packed] + [getattr(self, n) for n in extras if hasattr(self, n)]
            if bool(self.m_packed.abs().max() != 0):
                buffers.append(self.m_packed)
                if hasattr(self, "m_super_packed"):
                    buffers.append(self.m_super_packed)
        if self.bias is not None:
            buffers.append(self.bias)
        return sum(b.numel() * b.element_size() for b in buffers)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, in_features] (contiguous) @ W^T + bias: [M, out_features], every sibling's outputs."""
        return self.matrix(rows)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.form}, "
            f"{self.activations} activations"
        )


class PackedLinear(nn.Module):
    """Drop-in for one `nn.Linear`: outputs [start, stop) of a (possibly shared) `PackedWeights`."""

    def __init__(self, weights: PackedWeights, start: int, stop: int):
        super().__init__()
        self.weights, self.start, self.stop = weights, start, stop
        self.in_features, self.out_features = weights.in_features, stop - start

    @classmethod
    def from_linear(cls, linear: nn.Linear, extension: ModuleType, activations: str = "fp32") -> PackedLinear:
        return cls(PackedWeights([linear], extension, activations=activations), 0, linear.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weights(x)
        return y if self.out_features == y.shape[-1] else y[..., self.start : self.stop]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _pack_columns(matrix: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [ceil(N / 16), C, 16]: each block of 16 outputs k-major, zero-padded."""
    padded = _padded_rows(matrix)
    return padded.view(-1, _LANES, matrix.shape[1]).transpose(1, 2).contiguous()


def _pack_quads(q: torch.Tensor, nibbles: bool) -> torch.Tensor:
    """Integers q [N, K] laid out for the integer kernel's dot products (csrc/integer_linear.h):
    int8 [ceil(N / 16), K / 4, 16, 4], each output's four consecutive inputs side by side; with
    `nibbles` (q in 0..15) uint8 [ceil(N / 16), K / 8, 16, 4], inputs k + i and k + 4 + i sharing
    byte i, low nibble first."""
    padded = _padded_rows(q)
    inputs = q.shape[1]
    if not nibbles:
        return padded.view(-1, _LANES, inputs // 4, 4).transpose(1, 2).contiguous()
    octets = padded.view(-1, _LANES, inputs // 8, 2, 4).to(torch.uint8)
    merged = octets[:, :, :, 0] | (octets[:, :, :, 1] << 4)
    return merged.transpose(1, 2).contiguous()


def _smallest_form(q: torch.Tensor) -> tuple[str, int]:
    """The fewest bits that hold q for the integer kernel: (form, zero point), the integers stored
    being q + zero point, unsigned in all but int8 (csrc/integer_linear.h)."""
    low, high = int(q.min()), int(q.max())
    if low >= 0 and high <= 15:
        return "int4", 0
    for bits in (5, 6):
        zero_point = 0 if low >= 0 else 1 << (bits - 1)
        if low + zero_point >= 0 and high + zero_point < 1 << bits:
            return f"int{bits}", zero_point
    return "int8", 0


def _pack_high_bits(high: torch.Tensor, planes: int) -> torch.Tensor:
    """The bits above the nibbles, high [N, K] < 2^planes, as the int5 / int6 forms keep them
    (csrc/integer_linear.h): per block of 16 outputs, one 64-byte vector per 32 // planes inputs;
    in it, each four-input half of a chunk of 8 as the int4 form places its bytes, half h of the
    vector's 8 // planes at bit (4 + planes * h) % 8. uint8 [ceil(N / 16), K * planes / 32, 64]."""
    padded = _padded_rows(high).to(torch.uint8)
    inputs = high.shape[1]
    per_vector = 8 // planes  # halves
    # [blocks, 16 outputs, K / 4 halves, 4 inputs] -> [blocks, halves, 64 bytes (output, input)]
    halves = padded.view(-1, _LANES, inputs // 4, 4).transpose(1, 2).reshape(-1, inputs // 4, 4 * _LANES)
    halves = halves.view(halves.shape[0], -1, per_vector, 4 * _LANES)
    vectors = torch.zeros(halves.shape[0], halves.shape[1], 4 * _LANES, dtype=torch.uint8)
    for h in range(per_vector):
        vectors |= halves[:, :, h] << ((4 + planes * h) % 8)
    return vectors


def _exact_factors(form: IntegerForm) -> ScaleFactors | None:
    """The form's scale factors where it has them and they give its d and m exactly (as the kernel
    multiplies them, in fp32), else None: the kernel reads d and m themselves."""
    factors = form.factors
    if factors is None or form.q.shape[1] % 256:
        return None
    per_super = 256 // form.group

    def product(super_: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
        return super_.float().repeat_interleave(per_super, dim=1) * sub.float()

    exact = all(
        sub.dtype == torch.int8
        and super_.dtype == torch.float16
        and sub.shape == scale.shape
        and bool((product(super_, sub) == scale.float()).all())
        for super_, sub, scale in (
            (factors.d_super, factors.d_sub, form.d),
            (factors.m_super, factors.m_sub, form.m),
        )
    )
    return factors if exact else None


def _padded_rows(matrix: torch.Tensor) -> torch.Tensor:
    """`matrix` [N, C] with zero rows added up to a multiple of 16."""
    outputs, columns = matrix.shape
    padded = matrix.new_zeros(-(-outputs // _LANES) * _LANES, columns)
    padded[:outputs] = matrix
    return padded


def pack_linear_layers(
    model: nn.Module, extension: ModuleType, known: KnownForms | None = None, *, activations: str = "fp32"
) -> None:
    """Replace every fp32 `nn.Linear` of `model` in place by a `PackedLinear` on `extension`'s kernel,
    with `activations` fp32 or int8 (where a matrix has an integer form); `known`: the forms the
    caller knows (a layer it names may have an empty weight on the meta device). The largest
    matrices first: packing one holds its unpacked integers for a while, best done while little
    else is held."""
    groups = linear_groups(model, known)
    groups.sort(key=lambda group: -sum(linear.weight.numel() for linear in group[1].values()))
    for parent, linears in groups:
        weights, start = PackedWeights(list(linears.values()), extension, known, activations=activations), 0
        for name, linear in linears.items():
            setattr(parent, name, PackedLinear(weights, start, start + linear.out_features))
            start += linear.out_features


def integer_activations(model: nn.Module) -> bool:
    """Whether some packed layer of `model` multiplies int8 activations."""
    return any(isinstance(m, PackedWeights) and m.activations == "int8" for m in model.modules())


def linear_groups(
    model: nn.Module, known: KnownForms | None = None
) -> list[tuple[nn.Module, dict[str, nn.Linear]]]:
    """The fp32 `nn.Linear`s of `model` as they are packed: fused siblings together (unless `known`
    gives some of them a form and others none), the others alone; each group with its parent module
    and by attribute name."""
    found = []
    for parent in model.modules():
        children = {
            name: child
            for name, child in parent.named_children()
            if type(child) is nn.Linear and child.weight.dtype == torch.float32
        }
        groups = [
            names for names in FUSED_SIBLINGS if _fusable([children.get(n) for n in names], known or {})
        ]
        grouped = {name for names in groups for name in names}
        groups += [(name,) for name in children if name not in grouped]
        found += [(parent, {name: children[name] for name in names}) for names in groups]
    return found


def search_integer_forms(model: nn.Module, progress: Callable[[int, int], None] | None = None) -> None:
    """Find the integer form of every matrix `pack_linear_layers` would pack, so that later loads
    of the same weights read them from the cache; progress(done, total) after each one."""
    groups = linear_groups(model)
    for done, (_, linears) in enumerate(groups, 1):
        cached_integer_form(torch.cat([linear.weight.detach() for linear in linears.values()]))
        if progress is not None:
            progress(done, len(groups))


def _fusable(linears: list[nn.Linear | None], known: KnownForms) -> bool:
    present = [linear for linear in linears if linear is not None]
    return (
        len(present) == len(linears)
        and len({linear.in_features for linear in present}) == 1
        and len({linear.bias is None for linear in present}) == 1
        and len({_knowledge(linear, known) for linear in present}) == 1
    )


def _knowledge(linear: nn.Linear, known: KnownForms) -> str:
    if linear not in known:
        return "search"
    return "fp32" if known[linear] is None else "form"


def _form_of(linears: list[nn.Linear], known: KnownForms) -> IntegerForm | None:
    """The integer form of the linears' weights stacked by rows: the caller's forms joined, or
    found by searching the weights; None: fp32."""
    knowledge = _knowledge(linears[0], known)
    if knowledge == "fp32":
        return None
    if knowledge == "search":
        return cached_integer_form(torch.cat([linear.weight.detach() for linear in linears]))
    return _joined([known[linear]() for linear in linears])


def _joined(forms: list[LogicalForm]) -> IntegerForm:
    """Forms stacked by rows in their common shape: the smallest group (a (d, m) repeated over the
    groups it spans), fp32 scales unless all are fp16 (fp16 -> fp32 is exact)."""
    if len(forms) == 1:
        form = forms[0]
        return IntegerForm(form.q.to(torch.int8), form.d, form.m, form.group, getattr(form, "factors", None))
    group = min(form.group for form in forms)
    half = all(form.d.dtype == torch.float16 for form in forms)
    scale = torch.float16 if half else torch.float32

    def widened(scales: torch.Tensor, form: LogicalForm, dtype: torch.dtype = scale) -> torch.Tensor:
        return scales.to(dtype).repeat_interleave(form.group // group, dim=1)

    factors = None
    if all(getattr(form, "factors", None) is not None for form in forms):
        factors = _Factors(
            torch.cat([form.factors.d_super for form in forms]),
            torch.cat([widened(form.factors.d_sub, form, torch.int8) for form in forms]),
            torch.cat([form.factors.m_super for form in forms]),
            torch.cat([widened(form.factors.m_sub, form, torch.int8) for form in forms]),
        )
    return IntegerForm(
        torch.cat([form.q.to(torch.int8) for form in forms]),
        torch.cat([widened(form.d, form) for form in forms]),
        torch.cat([widened(form.m, form) for form in forms]),
        group,
        factors,
    )


@dataclass(frozen=True)
class _Factors:
    """Scale factors of forms joined by rows (ScaleFactors)."""

    d_super: torch.Tensor
    d_sub: torch.Tensor
    m_super: torch.Tensor
    m_sub: torch.Tensor
