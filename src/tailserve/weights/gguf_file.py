"""The GGUF container: metadata and tensor directory parsed straight from a memory map.

Tensor data stays in the map as raw bytes (quantized blocks are never expanded here); string arrays
(the vocabulary, the merges) are read in one pass, which is what keeps a cold start in seconds.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tailserve.errors import ModelLoadError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# ggml tensor types: id -> (name, elements per block, bytes per block). Others are looked up in `gguf`.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    30: ("BF16", 1, 2),
}
# GGUF metadata value types -> struct format (scalars) ; 8 = string, 9 = array.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's directory entry and its raw bytes, one row of blocks per output row."""

    name: str
    type_id: int
    type_name: str
    shape: tuple[int, ...]  # row-major (Hugging Face order): [rows, cols] for matrices
    data: np.ndarray  # uint8 [rows, bytes_per_row], a view into the file map


@dataclass
class GGUFFile:
    """A parsed GGUF file: metadata by key and tensors by GGUF name, in file order."""

    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


def read_gguf(path: Path) -> GGUFFile:
    """Parse the header, metadata and tensor directory; tensor bytes stay mapped, not copied."""
    try:
        with path.open("rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
    if buf[:4] != _MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic)")
    try:
        return _parse(buf, path)
    except (struct.error, IndexError, ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: corrupt GGUF header: {exc}") from exc


def _parse(buf: mmap.mmap, path: Path) -> GGUFFile:
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ModelLoadError(f"{path}: GGUF version {version} is too old (2 or newer is read)")
    reader = _Cursor(buf, 24)
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = reader.string()
        metadata[key] = reader.value(reader.u32())
    infos = []
    for _ in range(num_tensors):
        name = reader.string()
        dims = [reader.u64() for _ in range(reader.u32())]
        infos.append((name, dims, reader.u32(), reader.u64()))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-reader.pos // alignment) * alignment
    raw = np.frombuffer(buf, dtype=np.uint8)
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, type_id, offset in infos:
        type_name, block, block_bytes = _type_info(type_id)
        shape = tuple(int(d) for d in reversed(dims))  # GGUF lists dims fastest-first
        cols = shape[-1]
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        if cols % block:
            raise ModelLoadError(f"{path}: tensor {name} row of {cols} is not whole {type_name} blocks")
        row_bytes = cols // block * block_bytes
        start = data_start + offset
        data = raw[start : start + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = GGUFTensor(name, type_id, type_name, shape, data)
    return GGUFFile(metadata, tensors)


def _type_info(type_id: int) -> tuple[str, int, int]:
    if type_id in GGML_TYPES:
        return GGML_TYPES[type_id]
    import gguf  # only for types we do not handle natively

    try:
        kind = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        raise ModelLoadError(f"unknown GGML tensor type {type_id}") from None
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    return kind.name, int(block), int(block_bytes)


class _Cursor:
    """Sequential little-endian reads over the map."""

    def __init__(self, buf: mmap.mmap, pos: int) -> None:
        self.buf = buf
        self.pos = pos

    def u32(self) -> int:
        (v,) = struct.unpack_from("<I", self.buf, self.pos)
        self.pos += 4
        return int(v)

    def u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self.buf, self.pos)
        self.pos += 8
        return int(v)

    def string(self) -> str:
        n = self.u64()
        s = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, count: int) -> list[str]:
        """`count` length-prefixed strings (a vocabulary: ~100k of them), in one tight loop."""
        buf, pos = self.buf, self.pos
        out: list[str] = []
        unpack = struct.Struct("<Q").unpack_from
        append = out.append
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.u32(), self.u64()
            if elem == _STRING:
                return self.strings(count)
            if elem == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMPY[elem])
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return arr.tolist()
        fmt = _SCALARS[kind]
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v
