"""GGUF's quantised blocks read as integer forms: each weight is fl(d * q + m) for a small integer q.

For these block types gguf's dequantisation (gguf.quants, which transformers loads GGUF files
with) computes every weight from an integer q and a scale d and offset m shared by a group of 16
or 32 inputs, in one rounding. Unpacked into q and a (d, m) per group, the blocks are what the
packed kernel (lookahead/cpu) rebuilds weights from with one fused multiply-add, so a model runs
on its file's own integers: no fp32 copy of its weights, and nothing to search for.

| type | q | group | d, m | form: fp32 / int8 activations |
|---|---|---|---|---|
| Q4_0 | 0..15 | 32 | d, m = -8 d (fp16) | int4 |
| Q4_1 | 0..15 | 32 | d, m (fp16) | int4 |
| Q5_0 | -16..15 | 32 | d, m = -0.0 (fp16) | int8 / int5 |
| Q5_1 | 0..31 | 32 | d, m (fp16) | int8 / int5 |
| Q8_0 | -128..127 | 32 | d, m = -0.0 (fp16) | int8 |
| Q2_K | 0..3 | 16 | d = d * scale, m = -dmin * min (fp32) | int4 |
| Q3_K | 0..7 | 16 | d = d * (scale - 32), m = -4 d (fp32) | int4 |
| Q4_K | 0..15 | 32 | d = d * scale, m = -dmin * min (fp32) | int4 |
| Q5_K | 0..31 | 32 | d = d * scale, m = -dmin * min (fp32) | int8 / int5 |
| Q6_K | -32..31 | 16 | d = d * scale, m = -0.0 (fp32) | int8 / int6 |

With int8 activations the integer kernel keeps q in as few bits as hold it (int5 and int6: a nibble
plus one or two planes of high bits), and the K-quants' scales as the file does: their factors, an
fp16 per block of 256 inputs (d, -dmin) times a small integer per group (scale, min), which the
kernel multiplies out exactly (`SuperScales`). The fp32-activation kernel reads d and m themselves.

Exactness: every d and m above is exact in its format (an fp16 times a 4- to 8-bit integer fits
fp32's 24 bits), and so is every product d * q but Q6_K's (up to 25 bits): there m = -0.0, and
fl(d * q + m) is gguf's fl(d * q). So each weight is gguf's value bit for bit, with one
exception: in the int4 forms of Q4_0 and Q3_K the offset m turns q = 8 (4) into +0.0 where gguf
computes d * 0 = -0.0 for a negative d. No output can tell: the kernel's sums start from +0.0,
and adding either zero to a sum leaves it as it is. Other types have no integer form here (their
weights go through fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

_ROWS_PER_CHUNK = 1024  # rows unpacked at once: bounds the temporaries of a large matrix


@dataclass(frozen=True)
class SuperScales:
    """A K-quant's scales as its file keeps them: d == d_super * d_sub and m == m_super * m_sub
    exactly, an fp16 per block of 256 inputs times a small integer per group."""

    d_super: torch.Tensor  # fp16 [N, K // 256]
    d_sub: torch.Tensor  # int8 [N, K // group]
    m_super: torch.Tensor
    m_sub: torch.Tensor

    def permuted(self, rows: torch.Tensor) -> SuperScales:
        return SuperScales(self.d_super[rows], self.d_sub[rows], self.m_super[rows], self.m_sub[rows])


@dataclass(frozen=True)
class BlockForm:
    """weight == fl(d * q + m), with d and m repeated over each `group` inputs of a row; for the
    K-quants also the factors of d and m."""

    q: torch.Tensor  # int8 [N, K]
    d: torch.Tensor  # [N, K // group], fp16 or fp32
    m: torch.Tensor
    group: int
    factors: SuperScales | None = None

    def permuted(self, rows: torch.Tensor) -> BlockForm:
        """The form of the weight whose row i is this weight's row rows[i]."""
        factors = None if self.factors is None else self.factors.permuted(rows)
        return BlockForm(self.q[rows], self.d[rows], self.m[rows], self.group, factors)


@dataclass(frozen=True)
class _Unpacker:
    group: int
    half: bool  # fp16 scales, else fp32
    unpack: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]  # blocks -> q, d, m
    # blocks -> (d_super, d_sub, m_super, m_sub), one super-scale per block (K-quants)
    factors: Callable[[np.ndarray], tuple[np.ndarray, ...]] | None = None


def integer_form(blocks: np.ndarray, qtype: GGMLQuantizationType) -> BlockForm | None:
    """The integer form of a matrix stored as `blocks` ([N, bytes per row] uint8) of type `qtype`;
    None for a type without one."""
    unpacker = UNPACKERS.get(qtype)
    if unpacker is None:
        return None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, width = blocks.shape
    inputs = width // type_size * block_size
    groups = inputs // unpacker.group
    q = np.empty((rows, inputs), dtype=np.int8)
    d = np.empty((rows, groups), dtype=np.float32)
    m = np.empty((rows, groups), dtype=np.float32)
    factors = None
    if unpacker.factors is not None:
        supers = inputs // block_size
        factors = [np.empty((rows, n), dtype=t) for n, t in ((supers, np.float16), (groups, np.int8)) * 2]
    for start in range(0, rows, _ROWS_PER_CHUNK):
        chunk = np.ascontiguousarray(blocks[start : start + _ROWS_PER_CHUNK]).reshape(-1, type_size)
        q_chunk, d_chunk, m_chunk = unpacker.unpack(chunk)
        stop = start + len(chunk) * block_size // inputs
        q[start:stop] = q_chunk.reshape(stop - start, inputs)
        d[start:stop] = d_chunk.reshape(stop - start, groups)
        m[start:stop] = m_chunk.reshape(stop - start, groups)
        if factors is not None:
            for whole, part in zip(factors, unpacker.factors(chunk), strict=True):
                whole[start:stop] = part.reshape(stop - start, -1)
    if unpacker.half and not (np.abs(m) > np.finfo(np.float16).max).any():  # else -8 d beyond fp16
        d, m = d.astype(np.float16), m.astype(np.float16)  # exact: each was an fp16 or one times 2^k
    return BlockForm(
        torch.from_numpy(q),
        torch.from_numpy(d),
        torch.from_numpy(m),
        unpacker.group,
        None if factors is None else SuperScales(*(torch.from_numpy(f) for f in factors)),
    )


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of each block, as [n, 1] float32."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _bits(packed: np.ndarray, width: int, bits: int) -> np.ndarray:
    """The `bits`-wide fields of each run of `width` bytes: the lowest field of every byte of the
    run, then the next one up, and so on; [n, 8 * bytes / bits]."""
    n = packed.shape[0]
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(1, 1, -1, 1)
    return ((packed.reshape(n, -1, 1, width) >> shifts) & np.uint8((1 << bits) - 1)).reshape(n, -1)


def _minus_zero(d: np.ndarray) -> np.ndarray:
    return np.full_like(d, -0.0)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _half(blocks, 0)
    return _bits(blocks[:, 2:], 16, 4), d, -8 * d


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _bits(blocks[:, 4:], 16, 4), _half(blocks, 0), _half(blocks, 2)


def _q5(blocks: np.ndarray, start: int) -> np.ndarray:
    """Q5_0 / Q5_1's 5-bit q: 4 bytes of high bits at `start`, then the low nibbles."""
    return _bits(blocks[:, start + 4 :], 16, 4) | (_bits(blocks[:, start : start + 4], 1, 1) << np.uint8(4))


def _q5_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _half(blocks, 0)
    return _q5(blocks, 2).astype(np.int8) - np.int8(16), d, _minus_zero(d)


def _q5_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _q5(blocks, 4), _half(blocks, 0), _half(blocks, 2)


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _half(blocks, 0)
    return blocks[:, 2:].view(np.int8), d, _minus_zero(d)


def _q2_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _half(blocks, 80), _half(blocks, 82)
    return _bits(qs, 32, 2), d * (scales & 0xF).astype(np.float32), -(dmin * (scales >> 4).astype(np.float32))


def _q3_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    hmask, qs, packed, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _half(blocks, 108)
    scales = (_bits(packed[:, :8], 8, 4) | (_bits(packed[:, 8:], 4, 2) << np.uint8(4))).astype(np.int8) - 32
    # gguf's q = low bits - 4 * (1 - high bit), in -4..3; kept as q + 4 in 0..7
    q = _bits(qs, 32, 2) + (_bits(hmask, 32, 1) << np.uint8(2))
    dl = d * scales.astype(np.float32)
    return q, dl, -4 * dl


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's (d * scale, -dmin * min) of each of a block's 8 groups of 32."""
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    scales, mins = Q4_K.get_scale_min(blocks[:, 4:16])
    return d * scales.astype(np.float32), -(dmin * mins.astype(np.float32))


def _k_factors(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K's scales as (d, scale, -dmin, min): d * scale and -dmin * min are _k_scales'."""
    scales, mins = Q4_K.get_scale_min(blocks[:, 4:16])
    d, dmin = blocks[:, 0:2].copy().view(np.float16), blocks[:, 2:4].copy().view(np.float16)
    return d, scales.astype(np.int8), -dmin, mins.astype(np.int8)


def _q6_k_factors(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q6_K's scales as (d, scale, 0, 0)."""
    d = blocks[:, 208:210].copy().view(np.float16)
    scales = blocks[:, 192:208].view(np.int8)
    return d, scales, np.zeros_like(d), np.zeros_like(scales)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _bits(blocks[:, 16:], 32, 4), *_k_scales(blocks)


def _q5_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = _bits(blocks[:, 48:], 32, 4) | (_bits(blocks[:, 16:48], 32, 1) << np.uint8(4))
    return q, *_k_scales(blocks)


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scales, d = blocks[:, 192:208].view(np.int8), _half(blocks, 208)
    q = _bits(blocks[:, :128], 64, 4) | (_bits(blocks[:, 128:192], 32, 2) << np.uint8(4))
    q = q.astype(np.int8) - np.int8(32)
    dl = d * scales.astype(np.float32)
    return q, dl, _minus_zero(dl)


_T = GGMLQuantizationType
UNPACKERS: dict[GGMLQuantizationType, _Unpacker] = {
    _T.Q4_0: _Unpacker(32, True, _q4_0),
    _T.Q4_1: _Unpacker(32, True, _q4_1),
    _T.Q5_0: _Unpacker(32, True, _q5_0),
    _T.Q5_1: _Unpacker(32, True, _q5_1),
    _T.Q8_0: _Unpacker(32, True, _q8_0),
    _T.Q2_K: _Unpacker(16, False, _q2_k),
    _T.Q3_K: _Unpacker(16, False, _q3_k),
    _T.Q4_K: _Unpacker(32, False, _q4_k, _k_factors),
    _T.Q5_K: _Unpacker(32, False, _q5_k, _k_factors),
    _T.Q6_K: _Unpacker(16, False, _q6_k, _q6_k_factors),
}
