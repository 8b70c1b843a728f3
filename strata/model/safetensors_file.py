"""Read safetensors checkpoints without torch: header JSON, then memory-mapped little-endian arrays, by rows.

`Checkpoint.rows(name, index)` copies the selected rows of a tensor's 2-D view (-1, last dim) into float32 and
then gives the mapping's pages for them back (madvise DONTNEED): a mapped page counts in the process's RSS for
as long as it stays mapped in, and on a machine with free memory the kernel never takes clean page-cache pages
away, so without this one pass over a 200 GB checkpoint would leave 200 GB resident.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_FLOATS = ("F32", "F16", "BF16", "F64")
_FAULT_AROUND = 1 << 16     # a multiple of the page size: madvise takes page-aligned starts


class CheckpointError(ValueError):
    pass


class MappedFile:
    """A file mapped read-only. `view(lo, hi)` is a uint8 view of bytes [lo, hi); `release(lo, hi)` gives the
    pages holding them back to the kernel (the data stays in the page cache; a later read maps it in again)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None

    def view(self, lo: int, hi: int) -> np.ndarray:
        return np.frombuffer(self._mm, np.uint8, hi - lo, lo)

    def release(self, lo: int, hi: int) -> None:
        if self._mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        # a read fault also maps the cached pages around it (Linux "fault-around", 64 KiB windows by default):
        # give back whole windows, or each chunk leaves a few pages mapped and a long pass creeps up by MBs
        start = lo // _FAULT_AROUND * _FAULT_AROUND
        end = min(-(-hi // _FAULT_AROUND) * _FAULT_AROUND, self.size)
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)


@dataclass(frozen=True)
class _Entry:
    file: MappedFile
    dtype: str
    shape: tuple[int, ...]
    lo: int                 # absolute byte offsets in the file
    hi: int

    @property
    def row_len(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1


def _open(path: Path) -> dict[str, _Entry]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise CheckpointError(f"{path}: header of {n} bytes runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: the header is not JSON ({e}): not a safetensors file") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is not a JSON object: not a safetensors file")
    mf = MappedFile(path)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        if 8 + n + hi > size:
            raise CheckpointError(f"{path}: tensor '{name}' runs past the end of the file: truncated")
        dt = info["dtype"]
        if dt in _DTYPES and hi - lo != int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dt]).itemsize:
            raise CheckpointError(f"{path}: tensor '{name}' ({dt} {list(shape)}) has {hi - lo} bytes of data")
        out[name] = _Entry(mf, dt, shape, 8 + n + lo, 8 + n + hi)
    return out


class Checkpoint:
    """All tensors of a transformers checkpoint folder (one file or shards), read by rows without loading them."""

    def __init__(self, folder: str | os.PathLike):
        folder = Path(folder)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder}: no *.safetensors files")
        self._t: dict[str, _Entry] = {}
        for f in files:
            for name, e in _open(f).items():
                if name in self._t:
                    raise CheckpointError(f"tensor '{name}' is in both {self._t[name].file.path} and {f}")
                self._t[name] = e

    def names(self) -> list[str]:
        return list(self._t)

    def __contains__(self, name: str) -> bool:
        return name in self._t

    def _entry(self, name: str) -> _Entry:
        if name not in self._t:
            raise CheckpointError(f"checkpoint has no tensor '{name}'")
        e = self._t[name]
        if e.dtype not in _DTYPES:
            raise CheckpointError(f"tensor '{name}' has dtype {e.dtype}, which strata cannot read")
        return e

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> str:
        return self._entry(name).dtype

    def nbytes(self, name: str) -> int:
        e = self._entry(name)
        return e.hi - e.lo

    def _array(self, e: _Entry) -> np.ndarray:
        """The whole tensor as a (n_rows, row_len) view of the mapping, in its stored dtype (bf16 as uint16)."""
        return e.file.view(e.lo, e.hi).view(np.dtype(_DTYPES[e.dtype]).newbyteorder("<")).reshape(
            e.n_rows, e.row_len)

    def get(self, name: str) -> np.ndarray:
        """A whole tensor as float32 (floats) or int64 (integers): for the small ones (hash constants)."""
        e = self._entry(name)
        if e.dtype in _FLOATS:
            out = self.rows(name, slice(0, e.n_rows))
        else:
            out = self._array(e).astype(np.int64)
            e.file.release(e.lo, e.hi)
        return out.reshape(e.shape)

    def rows(self, name: str, index: slice | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows `index` (a slice with step 1, or row numbers) of a float tensor's 2-D view as float32
        (k, row_len), written into `out` when given (a uint16 `out` takes a BF16 tensor's bits as stored); then
        the pages they were read from are released."""
        e = self._entry(name)
        if e.dtype not in _FLOATS:
            raise CheckpointError(f"tensor '{name}' has dtype {e.dtype}, expected a float tensor")
        a = self._array(e)
        sel = a[index]                                  # a slice stays a view; row numbers gather a copy
        if out is None:
            out = np.empty(sel.shape, np.float32)
        if e.dtype == "BF16" and out.dtype == np.uint16:
            out[...] = sel
        elif e.dtype == "BF16":
            bits = out.view(np.uint32)
            bits[...] = sel
            bits <<= 16                                 # bf16 is the high half of a float32
        else:
            out[...] = sel
        if isinstance(index, slice):
            first, last = index.start or 0, (e.n_rows if index.stop is None else index.stop) - 1
        else:
            first, last = (int(index.min()), int(index.max())) if len(index) else (0, -1)
        rb = e.row_len * a.itemsize
        if last >= first:
            e.file.release(e.lo + first * rb, e.lo + (last + 1) * rb)
        return out
