"""Read safetensors checkpoints without torch: header JSON, then memory-mapped little-endian arrays."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class CheckpointError(ValueError):
    pass


def _open(path: Path) -> dict[str, tuple[np.memmap, str, list[int], int, int]]:
    with open(path, "rb") as f:
        raw = f.read(8)
    if len(raw) < 8:
        raise CheckpointError(f"{path}: too short to be a safetensors file")
    (n,) = struct.unpack("<Q", raw)
    size = path.stat().st_size
    if 8 + n > size:
        raise CheckpointError(f"{path}: header of {n} bytes runs past the end of the file ({size} bytes)")
    with open(path, "rb") as f:
        f.seek(8)
        header = json.loads(f.read(n))
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        if 8 + n + hi > size:
            raise CheckpointError(f"{path}: tensor '{name}' runs past the end of the file: truncated")
        out[name] = (mm, info["dtype"], info["shape"], 8 + n + lo, 8 + n + hi)
    return out


class Checkpoint:
    """All tensors of a transformers checkpoint folder (one file or an index of shards)."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder}: no *.safetensors files")
        self._t: dict = {}
        for f in files:
            self._t.update(_open(f))

    def names(self) -> list[str]:
        return list(self._t)

    def __contains__(self, name: str) -> bool:
        return name in self._t

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 (floats) or int64 (integers)."""
        if name not in self._t:
            raise CheckpointError(f"checkpoint has no tensor '{name}'")
        mm, dt, shape, lo, hi = self._t[name]
        if dt not in _DTYPES:
            raise CheckpointError(f"tensor '{name}' has dtype {dt}, which strata cannot read")
        a = mm[lo:hi].view(np.dtype(_DTYPES[dt]).newbyteorder("<")).reshape(shape)
        if dt == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        if a.dtype.kind in "iub":
            return a.astype(np.int64)
        return a.astype(np.float32)
