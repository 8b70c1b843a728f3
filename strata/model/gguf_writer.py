"""Write a GGUF file with bounded memory: tensors are declared first, then streamed in order, chunk by chunk.

The `gguf` package's GGUFWriter wants each tensor as one array and cannot declare Q2_0 (type 42, absent
from gguf 0.19), so this writer takes raw block bytes, or a callable yielding them, for any strata QType.
Value types follow llama.cpp's gguf-py writer (uint32 scalars, int32/bool/uint64 arrays), because
llama.cpp's loader checks them.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, GGUFValueType

from strata.quant import QType, block_size, type_size

_FMT = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d", GGUFValueType.BOOL: "<?",
}

# A tensor's bytes: an array (any dtype, written as its raw bytes) or a callable yielding chunks in order.
TensorSource = np.ndarray | Callable[[], Iterable[np.ndarray | bytes]]


@dataclass
class _Pending:
    name: str
    shape: tuple[int, ...]    # ggml order
    qtype: QType
    nbytes: int
    source: TensorSource


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(vtype: GGUFValueType, value: Any, sub: GGUFValueType | None = None) -> bytes:
    if vtype == GGUFValueType.STRING:
        return _string(value)
    if vtype == GGUFValueType.ARRAY:
        if sub is None:
            raise ValueError("an array needs its element type")
        head = struct.pack("<IQ", sub, len(value))
        if sub == GGUFValueType.STRING:
            return head + b"".join(_string(v) for v in value)
        return head + b"".join(struct.pack(_FMT[sub], v) for v in value)
    return struct.pack(_FMT[vtype], value)


class GGUFStreamWriter:
    """Declare metadata and tensors, then `write()` streams the file; memory stays at one chunk."""

    def __init__(self, path: str | os.PathLike, alignment: int = GGUF_DEFAULT_ALIGNMENT):
        self.path = str(path)
        self.alignment = alignment
        self._kv: list[bytes] = []
        self._keys: set[str] = set()
        self._tensors: list[_Pending] = []
        if alignment != GGUF_DEFAULT_ALIGNMENT:
            self.add("general.alignment", GGUFValueType.UINT32, alignment)

    def add(self, key: str, vtype: GGUFValueType, value: Any, sub: GGUFValueType | None = None) -> None:
        if key in self._keys:
            raise ValueError(f"metadata key '{key}' added twice")
        self._keys.add(key)
        self._kv.append(_string(key) + struct.pack("<I", vtype) + _value(vtype, value, sub))

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def add_tensor(self, name: str, shape: Sequence[int], qtype: QType, source: TensorSource) -> None:
        """`shape` is ggml order (row length first). An array source is checked against it now."""
        shape = tuple(int(d) for d in shape)
        if shape[0] % block_size(qtype):
            raise ValueError(f"tensor '{name}': row of {shape[0]} is not a multiple of {qtype.name}'s block")
        nbytes = int(np.prod(shape, dtype=np.int64)) // block_size(qtype) * type_size(qtype)
        if isinstance(source, np.ndarray) and source.nbytes != nbytes:
            raise ValueError(f"tensor '{name}': {source.nbytes} bytes given, {qtype.name} {list(shape)} needs {nbytes}")
        if any(t.name == name for t in self._tensors):
            raise ValueError(f"tensor '{name}' added twice")
        self._tensors.append(_Pending(name, shape, QType(qtype), nbytes, source))

    def _pad(self, n: int) -> int:
        return (n + self.alignment - 1) // self.alignment * self.alignment

    def write(self, progress: Callable[[str, int, int], None] | None = None) -> int:
        """Write everything; `progress(name, bytes_done, bytes_total)` after each chunk of tensor data (so a
        tensor of many GB still shows movement), bytes_done == bytes_total once. Returns the file size."""
        infos, offset = [], 0
        for t in self._tensors:
            infos.append(_string(t.name) + struct.pack("<I", len(t.shape))
                         + b"".join(struct.pack("<Q", d) for d in t.shape) + struct.pack("<IQ", t.qtype, offset))
            offset = self._pad(offset + t.nbytes)
        total = offset
        header = struct.pack("<IIQQ", GGUF_MAGIC, GGUF_VERSION, len(self._tensors), len(self._kv))
        head = header + b"".join(self._kv) + b"".join(infos)
        tmp = self.path + ".partial"
        done = 0
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(b"\0" * (self._pad(len(head)) - len(head)))
                for t in self._tensors:
                    written = 0
                    chunks = [t.source] if isinstance(t.source, np.ndarray) else t.source()
                    for chunk in chunks:
                        if isinstance(chunk, np.ndarray):
                            chunk = np.ascontiguousarray(chunk)
                        mv = memoryview(chunk).cast("B")
                        f.write(mv)
                        written += mv.nbytes
                        if written > t.nbytes:
                            break
                        if progress and written < t.nbytes:
                            progress(t.name, done + written, total)
                    if written != t.nbytes:
                        raise ValueError(f"tensor '{t.name}': its source produced {written} bytes, "
                                         f"expected {t.nbytes}")
                    f.write(b"\0" * (self._pad(written) - written))
                    done = self._pad(done + t.nbytes)
                    if progress:
                        progress(t.name, done, total)
        except BaseException:
            # a failed or interrupted write leaves no partial file behind (it can be hundreds of GB)
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        # the file appears under its name only when complete, so a crash never leaves a plausible truncated model
        os.replace(tmp, self.path)
        return os.path.getsize(self.path)
