"""The doorbell: mapped pinned host memory that the router kernel inside pre[l] writes and the host polls.

Layout (bytes): [0, 4) seq (u32), alone on its line; [256, 256 + 4 rows E) x (rows, E f32, the MoE inputs);
then ids (rows, k i32) and weights (rows, k f32), rows the most a step carries. The kernel writes the payload, fences system-wide, then stores seq = the token's ring base +
layer; the host reads seq, and only after seeing its value reads the payload (x86 keeps loads in order).
"""

from __future__ import annotations

import numpy as np

from strata.cuda import driver as drv
from strata.kernels.moe import DoorbellPtrs

X_OFFSET = 256


class Doorbell:
    def __init__(self, E: int, k: int, rows: int = 1):
        self.E, self.k, self.rows = E, k, rows
        ids_off = X_OFFSET + 4 * rows * E
        wts_off = ids_off + 4 * rows * k
        self.buf = drv.HostBuffer(wts_off + 4 * rows * k, mapped=True, what="doorbell")
        self.seq = self.buf.array(np.uint32, (1,), 0)
        self.x = self.buf.array(np.float32, (rows, E), X_OFFSET)
        self.ids = self.buf.array(np.int32, (rows, k), ids_off)
        self.wts = self.buf.array(np.float32, (rows, k), wts_off)
        self.seq[0] = 0
        d = self.buf.dptr
        self.ptrs = DoorbellPtrs(d + X_OFFSET, d + ids_off, d + wts_off, d)

    def value(self) -> int:
        return int(self.seq[0])

    def payload(self, n: int = 1, x: bool = True) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """The first n rows: x (n, E) (None without `x`: 42 MB at 4096 rows of the flash model, 3-4 ms of the
        host's time, for a step that never reads it), ids (n, k), weights (n, k)."""
        return self.x[:n].copy() if x else None, self.ids[:n].copy(), self.wts[:n].copy()

    def free(self) -> None:
        self.buf.free()
