"""The doorbell: mapped pinned host memory that the router kernel inside pre[l] writes and the host polls.

Layout (bytes): [0, 4) seq (u32), alone on its line; [256, 256 + 4E) x (f32, the MoE input); then ids (k i32)
and weights (k f32). The kernel writes the payload, fences system-wide, then stores seq = the token's ring base +
layer; the host reads seq, and only after seeing its value reads the payload (x86 keeps loads in order).
"""

from __future__ import annotations

import numpy as np

from strata.cuda import driver as drv
from strata.kernels.moe import DoorbellPtrs

X_OFFSET = 256


class Doorbell:
    def __init__(self, E: int, k: int):
        self.E, self.k = E, k
        ids_off = X_OFFSET + 4 * E
        wts_off = ids_off + 4 * k
        self.buf = drv.HostBuffer(wts_off + 4 * k, mapped=True, what="doorbell")
        self.seq = self.buf.array(np.uint32, (1,), 0)
        self.x = self.buf.array(np.float32, (E,), X_OFFSET)
        self.ids = self.buf.array(np.int32, (k,), ids_off)
        self.wts = self.buf.array(np.float32, (k,), wts_off)
        self.seq[0] = 0
        d = self.buf.dptr
        self.ptrs = DoorbellPtrs(d + X_OFFSET, d + ids_off, d + wts_off, d)

    def value(self) -> int:
        return int(self.seq[0])

    def payload(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.x.copy(), self.ids.copy(), self.wts.copy()

    def free(self) -> None:
        self.buf.free()
