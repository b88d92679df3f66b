"""The header of a GGUF file: its metadata values and where each tensor's bytes lie, checked.

gguf's own reader turns every entry of every metadata array into a numpy view: seconds for a
150,000-token vocabulary, at every load. This reads the same layout (GGUF versions 2 and 3,
little-endian) and steps over arrays, checking each read against the file's size, so that a bad
file is named with what is wrong with it (`HeaderError`).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_NESTING = 8  # arrays within arrays: real files nest at most 2 deep; the parser recurses per level
_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class HeaderError(ValueError):
    """What is wrong with a file's header, in words (without the file's name)."""


@dataclass(frozen=True)
class Array:
    """A metadata array, stepped over: its item type, length and where its items start."""

    item_type: GGUFValueType
    length: int
    offset: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # rows first: [N, K] for a matrix of N outputs over K inputs
    offset: int  # of its first byte in the file
    n_bytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (of the last dimension)."""
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block_size * type_size


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]  # key -> value (an `Array` for arrays)
    tensors: dict[str, TensorInfo]
    data_offset: int  # where the tensors' bytes start: the header is everything before


def read_strings(path: Path, array: Array) -> list[str]:
    """The items of a string array of a header read from `path` (checked by `read_header`)."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        parser = _Parser(data)
        parser.offset = array.offset
        return [parser._string() for _ in range(array.length)]


def read_header(path: Path) -> GGUFHeader:
    """The checked header of the GGUF file at `path`; HeaderError says what is wrong."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _Parser(data).header()


class _Parser:
    def __init__(self, data: mmap.mmap):
        self.data, self.offset = data, 0

    def header(self) -> GGUFHeader:
        if self._bytes(4) != MAGIC:
            raise HeaderError(f"it does not start with {MAGIC!r}")
        version = self._scalar("<I")
        if version not in VERSIONS:
            raise HeaderError(f"GGUF version {version} is not one this reader reads ({VERSIONS})")
        tensor_count, kv_count = self._scalar("<Q"), self._scalar("<Q")
        metadata = {}
        for _ in range(kv_count):
            key = self._string()
            metadata[key] = self._value(self._type(), key)
        layout: list[tuple[str, GGMLQuantizationType, tuple[int, ...], int]] = []
        for _ in range(tensor_count):
            name = self._string()
            dims = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
            raw_type, offset = self._scalar("<I"), self._scalar("<Q")
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise HeaderError(f"tensor {name} has type {raw_type}, which gguf does not know") from None
            layout.append((name, qtype, tuple(reversed(dims)), offset))
        names = [name for name, *_ in layout]
        if len(set(names)) != len(names):
            raise HeaderError(f"tensor {next(n for n in names if names.count(n) > 1)} appears twice")
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise HeaderError(f"general.alignment {alignment!r} is not a power of two")
        data_offset = -(-self.offset // alignment) * alignment
        tensors = {}
        for name, qtype, shape, offset in layout:
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            elements = 1
            for size in shape:
                elements *= size
            if shape and shape[-1] % block_size:
                raise HeaderError(f"tensor {name} has rows of {shape[-1]}, not whole {qtype.name} blocks")
            n_bytes = elements // block_size * type_size
            start = data_offset + offset
            if start + n_bytes > len(self.data):
                raise self._truncated(start + n_bytes, f"tensor {name} ends at byte")
            tensors[name] = TensorInfo(name, qtype, shape, start, n_bytes)
        return GGUFHeader(metadata, tensors, data_offset)

    def _bytes(self, count: int) -> bytes:
        end = self.offset + count
        if end > len(self.data):
            raise self._truncated(end)
        chunk = self.data[self.offset : end]
        self.offset = end
        return chunk

    def _scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._bytes(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        raw = self._bytes(self._scalar("<Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise HeaderError(f"a string at byte {self.offset - len(raw)} is not UTF-8") from None

    def _type(self) -> GGUFValueType:
        raw = self._scalar("<I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise HeaderError(f"metadata value type {raw} at byte {self.offset - 4} is unknown") from None

    def _value(self, kind: GGUFValueType, key: str, depth: int = 0) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind != GGUFValueType.ARRAY:
            return self._scalar(_SCALARS[kind])
        item_type, length = self._type(), self._scalar("<Q")
        start = self.offset
        if item_type == GGUFValueType.STRING:
            for _ in range(length):
                self.offset += 8 + self._peek_length()
        elif item_type == GGUFValueType.ARRAY:
            if depth + 1 >= MAX_NESTING:
                raise HeaderError(f"metadata {key} nests arrays more than {MAX_NESTING} deep")
            for _ in range(length):
                self._value(GGUFValueType.ARRAY, key, depth + 1)
        else:
            self._bytes(struct.calcsize(_SCALARS[item_type]) * length)
        if self.offset > len(self.data):
            raise self._truncated(self.offset)
        return Array(item_type, length, start)

    def _peek_length(self) -> int:
        """The length of the string at the offset (its 8-byte prefix), without moving."""
        if self.offset + 8 > len(self.data):
            raise self._truncated(self.offset + 8)
        return struct.unpack_from("<Q", self.data, self.offset)[0]

    def _truncated(self, needed: int, what: str = "its header needs bytes up to") -> HeaderError:
        return HeaderError(f"it is truncated: {what} {needed}, the file has {len(self.data)} bytes")
