"""Integer forms of fp32 weights that rebuild them bit for bit: q and one (d, m) per group of inputs.

A model dequantised from a 4- to 8-bit checkpoint (a GGUF file) holds fp32 weights that are each
exactly fl(d * q + m) for a small integer q and one scale d and offset m shared by a group of
consecutive inputs. Keeping q (a byte, or half a byte for 0..15) and the scales instead of the
fp32 values cuts what a forward streams from memory 3-6 fold; the kernel rebuilds each weight with
one fused multiply-add. Nothing here trusts the checkpoint's format: every group's (d, q, m) is
found from the weights themselves and kept only if it rebuilds every one of them exactly, as the
kernel computes it; otherwise the matrix stays fp32.

The families tried, by the way their quantisers define d (ggml's block formats):
- Q4_1: d = (max - min) / 15 and m = min, fp16; q in 0..15.
- Q8_0, Q5_0: d = max|w| / 127 or / 16, m = 0, fp16.
- Q4_K: d = fl(d_fp16 * 6-bit scale), m = -fl(dmin_fp16 * 6-bit min), fp32; q in 0..15 over a
  range that its quantiser may leave partly unused, so d = (max - min) / k for k = 15 down to 1.
- Q6_K: d = fl(d_fp16 * 8-bit scale), m = 0, fp32, one per 16 inputs; q in -32..32 with the
  largest |q| between 16 and 32.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..cache_dirs import packed_dir

# Where found forms are kept, by the digest of the weights they rebuild (and matrices that have
# none, by the same key), so that a model's later loads skip the search.
FORMS_DIR = packed_dir()
# Part of every key: a search that finds more forms must not read an older search's "none".
_SEARCH_VERSION = "1"

# (d, m) candidates for groups [G, g] of weights (float64): each a pair of [G, 1] float64 tensors
Candidates = Callable[[torch.Tensor], Iterator[tuple[torch.Tensor, torch.Tensor]]]


class ScaleFactors(Protocol):
    """d == d_super * d_sub and m == m_super * m_sub exactly: an fp16 super-scale per 256 inputs
    times an int8 sub-scale per group, as K-quant files keep their scales."""

    d_super: torch.Tensor  # fp16 [N, K // 256]
    d_sub: torch.Tensor  # int8 [N, K // group]
    m_super: torch.Tensor
    m_sub: torch.Tensor


@dataclass(frozen=True)
class IntegerForm:
    """weight == fl(d * q + m) bit for bit, with d and m repeated over each `group` inputs;
    `factors`, where known, the factors of d and m."""

    q: torch.Tensor  # int8 [N, K]
    d: torch.Tensor  # [N, K // group], fp16 or fp32
    m: torch.Tensor
    group: int
    factors: ScaleFactors | None = None

    @property
    def nibbles(self) -> bool:
        """Whether every q fits in 0..15 (two to a byte)."""
        return bool(self.q.min() >= 0 and self.q.max() <= 15)  # no temporary the size of q


@dataclass(frozen=True)
class _Family:
    name: str
    group: int
    half: bool  # fp16 scales (else fp32)
    q_min: int
    q_max: int
    candidates: Candidates


def _nudged(values: torch.Tensor, ulps: int, half: bool) -> torch.Tensor:
    """`values` rounded to fp16 or fp32 and moved by `ulps` units in the last place, as float64."""
    if half:
        return (values.half().view(torch.int16) + ulps).view(torch.float16).double()
    return (values.float().view(torch.int32) + ulps).view(torch.float32).double()


def _best_divisor(values: torch.Tensor, extent: torch.Tensor, divisors: tuple[int, ...]) -> torch.Tensor:
    """Per group, the number of quantisation steps `extent` spans: the smallest k of `divisors`
    for which values / (extent / k) are all integers up to rounding (a multiple of the true
    count would be one too), else the k that comes closest. [G, 1] float64."""
    if len(divisors) == 1:
        return torch.full_like(extent, divisors[0])
    unit = values / torch.where(extent == 0, torch.ones_like(extent), extent)  # in [-1, 1]
    best, best_error = torch.zeros_like(extent), torch.full_like(extent, torch.inf)
    found = torch.zeros_like(extent, dtype=torch.bool)
    for k in sorted(divisors):  # a pass per k over [G, g]: no [G, len(divisors), g] temporary
        scaled = unit * k
        error = (scaled - torch.round(scaled)).abs().amax(-1, keepdim=True)
        take = ~found & ((error < 1e-3) | (error < best_error))
        best = torch.where(take, float(k), best)
        best_error = torch.where(take, error, best_error)
        found |= error < 1e-3
    return best


def _ranged(divisors: tuple[int, ...], ulps: tuple[int, ...], half: bool) -> Candidates:
    """d = (max - min) / k, m = min, for each group's likeliest k of `divisors`."""

    def candidates(groups: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        k = _best_divisor(groups - low, high - low, divisors)
        for ulp in ulps:
            yield _nudged((high - low) / k, ulp, half), low

    return candidates


def _symmetric(divisors: tuple[int, ...], ulps: tuple[int, ...], half: bool) -> Candidates:
    """d = +-max|w| / k, m = -0.0, for each group's likeliest k of `divisors`: with m = -0.0 a q of
    0 rebuilds a zero with the sign of d, as the quantiser's d * 0 gave it."""

    def candidates(groups: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        magnitude = groups.abs().amax(-1, keepdim=True)
        k = _best_divisor(groups, magnitude, divisors)
        negative_zero = torch.full_like(magnitude, -0.0)
        for ulp in ulps:
            d = _nudged(magnitude / k, ulp, half)
            yield d, negative_zero
            yield -d, negative_zero

    return candidates


_ULPS = (0, 1, -1, 2, -2)
FAMILIES = (
    _Family("q4_1", 32, True, 0, 15, _ranged((15,), _ULPS, half=True)),
    _Family("q8_0", 32, True, -128, 127, _symmetric((127,), _ULPS, half=True)),
    _Family("q5_0", 32, True, -16, 16, _symmetric((16,), _ULPS, half=True)),
    _Family("q4_k", 32, False, 0, 15, _ranged(tuple(range(15, 0, -1)), _ULPS, half=False)),
    _Family("q6_k", 16, False, -32, 32, _symmetric(tuple(range(32, 15, -1)), (0, 1, -1), half=False)),
)


def _fit(
    groups: torch.Tensor, d: torch.Tensor, m: torch.Tensor, family: _Family
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [G, g], hit [G]): q for these (d, m), and whether it rebuilds each whole group exactly.

    The kernel computes fl(d * q + m) in one rounding; in float64 the product of an fp32 d and a
    small q is exact, and the sum is exact too where subtracting either term gives back the other,
    so rounding that sum to fp32 is what the kernel computes. An fp16 scale's product with |q| <=
    255 is exact in fp32 already, so there fl(fl(d * q) + m) is the same value.
    """
    zero = d == 0  # a group of zeros: d = -0.0 gives each the sign its q asks for
    d = torch.where(zero, torch.full_like(d, -0.0), d)
    if family.q_min < 0:  # -0.0 * 1 + m = -0.0, -0.0 * -1 + m = +0.0 when m = -0.0
        zero_q = torch.where(torch.signbit(groups), 1.0, -1.0)
    else:  # -0.0 * 0 + m = m: the group's zeros all have m's sign
        zero_q = torch.zeros_like(groups)
    q = torch.round((groups - m) / torch.where(zero, torch.ones_like(d), d))
    q = (
        torch.where(zero, zero_q, q.clamp(family.q_min, family.q_max)) + 0.0
    )  # the kernel's q is an integer: no -0.0
    product = d * q
    total = product + m
    exact = ((total - product) == m) & ((total - m) == product)
    hit = (total.float().view(torch.int32) == groups.float().view(torch.int32)) & exact
    hit = hit.all(-1)
    if family.half:
        hit &= (m.half().double() == m).squeeze(-1)
    return q, d, hit


def _fit_groups(rows: torch.Tensor, families: list[_Family]) -> tuple[torch.Tensor, ...] | None:
    """(q, d, m, half) for rows [R, K] cut into groups of the families' size, each group taking the
    first candidate of the first family that rebuilds it; None if some group has none."""
    groups = rows.double().reshape(-1, families[0].group)
    q = torch.zeros(groups.shape, dtype=torch.int8)
    d = torch.zeros(groups.shape[0], 1, dtype=torch.float64)
    m = torch.zeros_like(d)
    half = torch.zeros(groups.shape[0], dtype=torch.bool)
    done = torch.zeros(groups.shape[0], dtype=torch.bool)
    for family in families:
        for d_all, m_all in family.candidates(groups):  # one candidate per group
            open_ = (~done).nonzero().squeeze(-1)  # after the first candidates, a few groups at most
            q_try, d_try, hit = _fit(groups[open_], d_all[open_], m_all[open_], family)
            found = open_[hit]
            q[found] = q_try[hit].to(torch.int8)
            d[found], m[found], half[found], done[found] = d_try[hit], m_all[found], family.half, True
            if bool(done.all()):
                return q, d, m, half
    return None


def exact_integer_form(
    weight: torch.Tensor, chunk_rows: int = 4096, sample_rows: int = 64
) -> IntegerForm | None:
    """An integer form of the fp32 matrix `weight` [N, K] that rebuilds it bit for bit, else None.

    A matrix comes from one quantiser, so a sample of its rows tells which families fit (most hits
    first) or that none covers it; then every group of the matrix is fitted, the sample's best
    family first.
    """
    rows, inputs = weight.shape
    if weight.dtype != torch.float32 or not rows:
        return None
    by_size: dict[int, list[_Family]] = {}
    for family in FAMILIES:
        by_size.setdefault(family.group, []).append(family)
    sample = weight[torch.linspace(0, rows - 1, min(rows, sample_rows)).long()]
    for group, families in sorted(by_size.items(), reverse=True):  # fewer scales first
        if inputs % group:
            continue
        if _families_by_fit(sample[:2], families) is None:  # a quick no for most other quantisers
            continue
        order = _families_by_fit(sample, families)
        if order is None:
            continue
        parts = []
        for start in range(0, rows, chunk_rows):
            part = _fit_groups(weight[start : start + chunk_rows], order)
            if part is None:
                break
            parts.append(part)
        else:
            q, d, m, half = (torch.cat(column) for column in zip(*parts))
            scale_dtype = torch.float16 if bool(half.all()) else torch.float32
            shape = (rows, inputs // group)
            return IntegerForm(
                q.reshape(rows, inputs),
                d.reshape(shape).to(scale_dtype),
                m.reshape(shape).to(scale_dtype),
                group,
            )
    return None


def _families_by_fit(sample: torch.Tensor, families: list[_Family]) -> list[_Family] | None:
    """The families that rebuild some groups of `sample`, most first; None unless together they
    rebuild all of them."""
    groups = sample.double().reshape(-1, families[0].group)
    covered = torch.zeros(groups.shape[0], dtype=torch.bool)
    hits = {}
    for family in families:
        rebuilt = torch.zeros_like(covered)
        for d, m in family.candidates(groups):
            open_ = (~rebuilt).nonzero().squeeze(-1)
            rebuilt[open_[_fit(groups[open_], d[open_], m[open_], family)[2]]] = True
            if bool(rebuilt.all()):
                break
        hits[family.name] = int(rebuilt.sum())
        covered |= rebuilt
    if not bool(covered.all()):
        return None
    return sorted((f for f in families if hits[f.name]), key=lambda f: -hits[f.name])


def cached_integer_form(weight: torch.Tensor) -> IntegerForm | None:
    """`exact_integer_form(weight)`, kept in FORMS_DIR under the digest of the weights' bytes: a
    content address, so an entry only ever answers for the very same matrix. An unreadable entry
    is searched again and replaced."""
    weight = weight.detach().contiguous()
    digest = hashlib.blake2b(weight.numpy().view("uint8").data, digest_size=20)
    digest.update(f"{tuple(weight.shape)} v{_SEARCH_VERSION}".encode())
    path = FORMS_DIR / f"{digest.hexdigest()}.safetensors"
    try:
        return _read_form(path)
    except (OSError, SafetensorError, KeyError, ValueError):
        pass
    form = exact_integer_form(weight)
    try:
        _write_form(path, form)
    except OSError:
        pass  # a read-only cache: every load searches again
    return form


def _read_form(path: Path) -> IntegerForm | None:
    with open(path, "rb") as file:
        header_length = int.from_bytes(file.read(8), "little")
        metadata = json.loads(file.read(header_length)).get("__metadata__", {})
    if metadata.get("form") == "none":
        return None
    tensors = load_file(path)
    return IntegerForm(tensors["q"], tensors["d"], tensors["m"], int(metadata["group"]))


def _write_form(path: Path, form: IntegerForm | None) -> None:
    """Atomically: a concurrent reader sees the whole entry or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        if form is None:
            save_file({}, temporary, metadata={"form": "none"})
        else:
            save_file({"q": form.q, "d": form.d, "m": form.m}, temporary, metadata={"group": str(form.group)})
        os.replace(temporary, path)
    finally:
        Path(temporary).unlink(missing_ok=True)
