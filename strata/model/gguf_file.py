"""Read a GGUF file: metadata and a table of memory-mapped tensors, never copied.

The format comes from the `gguf` package (magic, value types, alignment key). Its `GGUFReader` is not used
because gguf 0.19 raises `ValueError: 42 is not a valid GGMLQuantizationType` on any file holding a Q2_0
tensor, and the experts of this model ship in Q2_0. Every read is bounds-checked so a truncated or foreign
file fails with one `GGUFError` naming what was being read, not a traceback from inside numpy.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType

from strata.quant import QType, block_size, type_size


class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message names the file and the key or tensor."""


# little-endian scalar formats by GGUF value type
_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}
_NP_SCALAR = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16, GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.UINT64: np.uint64, GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.FLOAT64: np.float64,
    GGUFValueType.BOOL: np.bool_,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file. `shape` is ggml order (fastest dimension first); `data` is a read-only view."""

    name: str
    shape: tuple[int, ...]      # ggml ne: ne[0] is the row length
    qtype: QType
    offset: int                 # absolute byte offset in the file
    nbytes: int
    data: np.ndarray            # uint8 (nbytes,), a view of the mapping

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def np_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def row_bytes(self) -> int:
        return self.shape[0] // block_size(self.qtype) * type_size(self.qtype)

    def rows(self) -> np.ndarray:
        """The bytes as (n_rows, row_bytes): one ggml row (one output neuron of a matrix) per numpy row."""
        return self.data.reshape(-1, self.row_bytes)


class _Cursor:
    def __init__(self, buf: memoryview, path: str):
        self.buf, self.pos, self.path = buf, 0, path
        self.what = "the header"

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise GGUFError(
                f"{self.path}: file ends at byte {len(self.buf)} while reading {self.what} "
                f"(needs bytes {self.pos}..{end}): the file is truncated or not GGUF")
        view = self.buf[self.pos:end]
        self.pos = end
        return view

    def scalar(self, vtype: GGUFValueType) -> Any:
        fmt = _SCALAR[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def u32(self) -> int:
        return self.scalar(GGUFValueType.UINT32)

    def u64(self) -> int:
        return self.scalar(GGUFValueType.UINT64)

    def string(self) -> str:
        n = self.u64()
        raw = bytes(self.take(n))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {self.what} holds a string that is not UTF-8 ({e})") from None

    def value(self, vtype: int) -> Any:
        try:
            vt = GGUFValueType(vtype)
        except ValueError:
            raise GGUFError(f"{self.path}: {self.what} has unknown value type {vtype}") from None
        if vt == GGUFValueType.STRING:
            return self.string()
        if vt == GGUFValueType.ARRAY:
            et, n = self.u32(), self.u64()
            try:
                et = GGUFValueType(et)
            except ValueError:
                raise GGUFError(f"{self.path}: {self.what} is an array of unknown type {et}") from None
            if et in _NP_SCALAR:
                width = np.dtype(_NP_SCALAR[et]).itemsize
                arr = np.frombuffer(self.take(n * width), dtype=np.dtype(_NP_SCALAR[et]).newbyteorder("<"))
                return arr.tolist()
            return [self.value(et) for _ in range(n)]
        return self.scalar(vt)


class GGUFFile:
    """A GGUF file opened read-only: `.metadata` (key -> value) and `.tensors` (name -> TensorInfo)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        p = Path(path)
        if not p.exists():
            raise GGUFError(f"{self.path}: no such file")
        if p.is_dir():
            raise GGUFError(f"{self.path}: is a directory, expected a .gguf file")
        size = p.stat().st_size
        if size < 24:
            raise GGUFError(f"{self.path}: {size} bytes is too short to be a GGUF file")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map), self.path)

        cur.what = "the magic number"
        magic = cur.u32()
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic:#010x}, expected {GGUF_MAGIC:#010x} 'GGUF')")
        cur.what = "the version"
        self.version = cur.u32()
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (2 or 3)")
        cur.what = "the tensor and key counts"
        n_tensors, n_kv = cur.u64(), cur.u64()
        if n_tensors > size or n_kv > size:
            raise GGUFError(f"{self.path}: header claims {n_tensors} tensors and {n_kv} keys: corrupt file")

        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}  # (type, array element type)
        for i in range(n_kv):
            cur.what = f"metadata key #{i}"
            key = cur.string()
            cur.what = f"metadata key '{key}'"
            vtype = cur.u32()
            sub = None
            if vtype == GGUFValueType.ARRAY and cur.pos + 4 <= len(cur.buf):
                sub = GGUFValueType(struct.unpack_from("<I", cur.buf, cur.pos)[0])
            self.metadata[key] = cur.value(vtype)
            self.value_types[key] = (GGUFValueType(vtype), sub)

        infos = []
        for i in range(n_tensors):
            cur.what = f"tensor info #{i}"
            name = cur.string()
            cur.what = f"the info of tensor '{name}'"
            n_dims = cur.u32()
            if not 1 <= n_dims <= 4:
                raise GGUFError(f"{self.path}: tensor '{name}' has {n_dims} dimensions (1..4 allowed)")
            shape = tuple(cur.u64() for _ in range(n_dims))
            raw_type, offset = cur.u32(), cur.u64()
            infos.append((name, shape, raw_type, offset))

        align = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise GGUFError(f"{self.path}: general.alignment = {align!r} is not a power of two")
        self.alignment = align
        self.data_offset = (cur.pos + align - 1) // align * align

        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, raw_type, offset in infos:
            try:
                qt = QType(raw_type)
            except ValueError:
                raise GGUFError(f"{self.path}: tensor '{name}' has ggml type {raw_type}, which strata does not "
                                f"support (supported: {', '.join(t.name for t in QType)})") from None
            if shape[0] % block_size(qt):
                raise GGUFError(f"{self.path}: tensor '{name}' rows of {shape[0]} are not a multiple of "
                                f"{qt.name}'s block of {block_size(qt)}")
            n_el = int(np.prod(shape, dtype=np.int64))
            nbytes = n_el // block_size(qt) * type_size(qt)
            start = self.data_offset + offset
            if start + nbytes > size:
                raise GGUFError(f"{self.path}: tensor '{name}' ({qt.name}, {nbytes} bytes at {start}) extends "
                                f"past the end of the file ({size} bytes): the file is truncated")
            if name in self.tensors:
                raise GGUFError(f"{self.path}: tensor '{name}' appears twice")
            self.tensors[name] = TensorInfo(name, shape, qt, start, nbytes, self._map[start:start + nbytes])

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: missing tensor '{name}'") from None

    @property
    def size(self) -> int:
        return int(self._map.shape[0])
