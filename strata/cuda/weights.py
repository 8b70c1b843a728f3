"""The model's weights in the kernels' formats, and their upload into the arena through pinned staging.

A matrix keeps its file format when quant.cuh has a decoder for it (the f32 path reads the blocks as they are);
float rows are padded to a multiple of 8 elements so that every row is whole 16-byte parts; any other type is
converted at load to F16 (exact for the dequantized value only up to fp16's 11 bits: the log says which tensors).
"""

from __future__ import annotations

import numpy as np

from strata.cuda import driver as drv
from strata.cuda.arena import DevArray
from strata.kernels.gemv import KERNEL_TYPES, device_row_bytes
from strata.quant.dequant import dequantize
from strata.quant.formats import QType, row_bytes

STAGE_BYTES = 64 << 20


def device_type(qt: int) -> QType:
    qt = QType(qt)
    return qt if qt in KERNEL_TYPES else QType.F16


def as_rows(raw, n_rows: int) -> np.ndarray:
    """A matrix's bytes as uint8 (n_rows, bytes per row): a Mat, its .raw, or any numpy view (no copy if it can)."""
    raw = getattr(raw, "raw", raw)
    a = np.ascontiguousarray(raw)
    return a.view(np.uint8).reshape(n_rows, -1)


def device_rows(raw, qt: int, n_rows: int, n_in: int) -> np.ndarray:
    """uint8 (n_rows, device_row_bytes) in the device format of qt (a view of raw when nothing changes)."""
    qt, dt = QType(qt), device_type(qt)
    src = as_rows(raw, n_rows)
    if src.shape[1] != row_bytes(qt, n_in):
        raise ValueError(f"{qt.name} rows of {n_in} take {row_bytes(qt, n_in)} bytes, got {src.shape[1]}")
    rb = device_row_bytes(dt, n_in)
    if dt == qt and src.shape[1] == rb:
        return src
    if dt == qt:                                   # a float type: pad the rows
        out = np.zeros((n_rows, rb), np.uint8)
        out[:, :src.shape[1]] = src
        return out
    vals = dequantize(src, qt).reshape(n_rows, n_in).astype(np.float16)
    out = np.zeros((n_rows, rb), np.uint8)
    out[:, :2 * n_in] = vals.view(np.uint8)
    return out


def conversion_note(name: str, qt: int) -> str | None:
    qt = QType(qt)
    if qt in KERNEL_TYPES:
        return None
    return f"{name}: {qt.name} has no CUDA kernel; converted to F16 at load (values rounded to fp16)"


class Uploader:
    """Host arrays -> device through two pinned staging buffers, so reading the mapping overlaps the DMA."""

    def __init__(self, stream: drv.Stream, stage_bytes: int = STAGE_BYTES):
        self.stream = stream
        self.bufs = [drv.HostBuffer(stage_bytes, what="upload staging") for _ in range(2)]
        self.events = [drv.Event() for _ in range(2)]
        self.used = [False, False]
        self.turn = 0
        self.bytes = 0

    def put(self, dst: DevArray, src: np.ndarray, dst_offset: int = 0) -> None:
        flat = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        if dst_offset + flat.nbytes > dst.nbytes:
            raise ValueError(f"upload of {flat.nbytes} B at {dst_offset} overflows '{dst.name}' ({dst.nbytes} B)")
        step = self.bufs[0].nbytes
        for o in range(0, flat.nbytes, step):
            chunk = flat[o:o + step]
            i = self.turn
            if self.used[i]:
                self.events[i].synchronize("upload staging reuse")
            self.bufs[i].array(np.uint8, (chunk.nbytes,))[:] = chunk
            drv.memcpy_htod_async(dst.ptr + dst_offset + o, self.bufs[i].ptr, chunk.nbytes, self.stream,
                                  f"weights -> {dst.name}")
            self.events[i].record(self.stream)
            self.used[i] = True
            self.turn = 1 - i
        self.bytes += flat.nbytes

    def finish(self) -> None:
        self.stream.synchronize("weight upload")
        for b in self.bufs:
            b.free()
        for e in self.events:
            e.destroy()
