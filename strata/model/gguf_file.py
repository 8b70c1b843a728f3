"""Read a GGUF file: metadata and a table of memory-mapped tensors, never copied.

The format comes from the `gguf` package (magic, value types, alignment key). Its `GGUFReader` is not used
because gguf 0.19 raises `ValueError: 42 is not a valid GGMLQuantizationType` on any file holding a Q2_0
tensor, and the experts of this model ship in Q2_0. Every read is bounds-checked so a truncated or foreign
file fails with one `GGUFError` naming what was being read, not a traceback from inside numpy.

The layout is checked as strictly as llama.cpp's `gguf_init_from_file` checks it, and a little more: keys and
tensor names unique, no nested arrays, `general.alignment` a uint32 power of two, every tensor's data offset a
multiple of it and exactly where the previous tensor's padded data ends (in table order, so no overlap and no
gap), element counts within int64, and no bytes past the last tensor's padded data (a changed alignment shifts
every tensor: that is how it shows).

The dense weights are used through the mapping, so a file truncated while mapped would kill the process with
SIGBUS on the first touch of a page past its new end: `FileGuard.check()` (size and mtime against what was
opened) runs before every use of mapped or read data, and turns a changed file into an OSError.
"""

from __future__ import annotations

import os
import struct
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType

from strata.quant import QType, block_size, type_size

GGML_MAX_NAME = 64          # llama.cpp's tensor name buffer, terminator included
INT64_MAX = (1 << 63) - 1


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


class FileGuard:
    """A file's size and mtime when it was opened; `check()` raises OSError once either differs.

    Pages of a mapping past a truncated file's end raise SIGBUS, which Python cannot turn into an exception, and a
    file rewritten in place silently changes the weights: whoever uses mapped or read data checks first.
    """

    def __init__(self, fd: int, path: str):
        st = os.fstat(fd)
        self.fd, self.path, self.size, self.mtime_ns = fd, path, st.st_size, st.st_mtime_ns

    def check(self) -> None:
        st = os.fstat(self.fd)
        if st.st_size != self.size or st.st_mtime_ns != self.mtime_ns:
            what = (f"truncated from {self.size} to {st.st_size} bytes" if st.st_size < self.size else
                    f"resized from {self.size} to {st.st_size} bytes" if st.st_size != self.size else
                    "modified (same size, new mtime)")
            raise OSError(f"{self.path}: the model file was {what} while in use; strata reads it in place and "
                          f"needs it unchanged: restart with the new file")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file. `shape` is ggml order (fastest dimension first); `data` is a read-only view."""

    name: str
    shape: tuple[int, ...]      # ggml ne: ne[0] is the row length
    qtype: QType
    offset: int                 # absolute byte offset in the file
    nbytes: int
    data: np.ndarray            # uint8 (nbytes,), a view of the mapping
    guard: FileGuard | None = field(default=None, compare=False, repr=False)   # checked before the data is used

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

    def vtype(self, raw: int, of: str = "") -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFError(f"{self.path}: {self.what} has unknown value type {raw}{of}") from None

    def value(self) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
        """(value, its type, the array element type or None)."""
        vt = self.vtype(self.u32())
        if vt == GGUFValueType.STRING:
            return self.string(), vt, None
        if vt != GGUFValueType.ARRAY:
            return self.scalar(vt), vt, None
        et = self.vtype(self.u32(), " for its array elements")
        n = self.u64()
        if et == GGUFValueType.ARRAY:
            raise GGUFError(f"{self.path}: {self.what} is an array of arrays, which GGUF does not allow")
        if et == GGUFValueType.STRING:
            return [self.string() for _ in range(n)], vt, et
        width = np.dtype(_NP_SCALAR[et]).itemsize
        arr = np.frombuffer(self.take(n * width), dtype=np.dtype(_NP_SCALAR[et]).newbyteorder("<"))
        return arr.tolist(), vt, et


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class GGUFFile:
    """A GGUF file opened read-only: `.metadata` (key -> value) and `.tensors` (name -> TensorInfo)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        p = Path(path)
        if not p.exists():
            raise GGUFError(f"{self.path}: no such file")
        if p.is_dir():
            raise GGUFError(f"{self.path}: is a directory, expected a .gguf file")
        if not p.is_file():                           # a FIFO would block the open, a device has no size
            raise GGUFError(f"{self.path}: is not a regular file, expected a .gguf file")
        fd = os.open(self.path, os.O_RDONLY)
        self.guard = FileGuard(fd, self.path)
        weakref.finalize(self.guard, os.close, fd)     # the fd lives as long as anything that checks it
        size = self.guard.size
        if size < 24:
            raise GGUFError(f"{self.path}: {size} bytes is too short to be a GGUF file")
        with os.fdopen(os.dup(fd), "rb") as f:      # the mapping and the guard see the same inode
            self._map = np.memmap(f, dtype=np.uint8, mode="r")
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
        first: dict[str, int] = {}
        for i in range(n_kv):
            cur.what = f"metadata key #{i}"
            key = cur.string()
            if key in first:
                # llama.cpp refuses these; a reader that kept the last one would run a model nobody wrote
                raise GGUFError(f"{self.path}: metadata key {key!r} appears twice (keys #{first[key]} and #{i})")
            first[key] = i
            cur.what = f"metadata key {key!r}"
            value, vt, sub = cur.value()
            self.metadata[key] = value
            self.value_types[key] = (vt, sub)

        infos = []
        for i in range(n_tensors):
            cur.what = f"tensor info #{i}"
            name = cur.string()
            cur.what = f"the info of tensor {name!r}"
            if len(name.encode()) >= GGML_MAX_NAME:
                raise GGUFError(f"{self.path}: tensor name {name[:80]!r} is {len(name.encode())} bytes, at most "
                                f"{GGML_MAX_NAME - 1} allowed")
            n_dims = cur.u32()
            if not 1 <= n_dims <= 4:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (1..4 allowed)")
            shape = tuple(cur.u64() for _ in range(n_dims))
            raw_type, offset = cur.u32(), cur.u64()
            infos.append((name, shape, raw_type, offset))

        align = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if "general.alignment" in self.metadata and self.value_types["general.alignment"][0] != GGUFValueType.UINT32:
            raise GGUFError(f"{self.path}: general.alignment is stored as "
                            f"{self.value_types['general.alignment'][0].name}, expected UINT32")
        if align <= 0 or align & (align - 1):
            raise GGUFError(f"{self.path}: general.alignment = {align!r} is not a power of two")
        self.alignment = align
        self.data_offset = _pad(cur.pos, align)

        self.tensors: dict[str, TensorInfo] = {}
        expected = 0                    # where the next tensor's data must start, relative to data_offset
        for name, shape, raw_type, offset in infos:
            try:
                qt = QType(raw_type)
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {name!r} has ggml type {raw_type}, which strata does not "
                                f"support (supported: {', '.join(t.name for t in QType)})") from None
            if name in self.tensors:
                raise GGUFError(f"{self.path}: tensor {name!r} appears twice")
            n_el = 1
            for d in shape:
                n_el *= d
            if n_el > INT64_MAX:
                raise GGUFError(f"{self.path}: tensor {name!r} has ggml shape {list(shape)}: {n_el} elements "
                                f"overflow int64")
            if shape[0] % block_size(qt):
                raise GGUFError(f"{self.path}: tensor {name!r} rows of {shape[0]} are not a multiple of "
                                f"{qt.name}'s block of {block_size(qt)}")
            nbytes = n_el // block_size(qt) * type_size(qt)
            if offset % align:
                raise GGUFError(f"{self.path}: tensor {name!r} has data offset {offset}, not a multiple of "
                                f"general.alignment = {align}")
            if offset != expected:
                raise GGUFError(f"{self.path}: tensor {name!r} has data offset {offset}, expected {expected}: each "
                                f"tensor's data must follow the previous one's in table order (padded to {align} "
                                f"bytes), without overlap or gap")
            start = self.data_offset + offset
            if start + nbytes > size:
                raise GGUFError(f"{self.path}: tensor {name!r} ({qt.name}, {nbytes} bytes at {start}) extends "
                                f"past the end of the file ({size} bytes): the file is truncated, or the tensor's "
                                f"shape or type is wrong")
            self.tensors[name] = TensorInfo(name, shape, qt, start, nbytes, self._map[start:start + nbytes],
                                            self.guard)
            expected = _pad(offset + nbytes, align)
        end = self.data_offset + expected
        if infos and size > end:
            # writers (llama.cpp, gguf-py, strata) end the file at the last tensor's padded data
            raise GGUFError(f"{self.path}: {size - end} bytes follow the last tensor's data (which ends at byte "
                            f"{end}): the tensor table does not describe the file (a changed general.alignment, "
                            f"a changed tensor type or shape?)")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: missing tensor {name!r}") from None

    def check_unchanged(self) -> None:
        """OSError when the file's size or mtime changed since it was opened (see FileGuard)."""
        self.guard.check()

    @property
    def size(self) -> int:
        return int(self._map.shape[0])
