"""PLE row reads: a token's 16 rows of `per_layer_token_embd` read from the GGUF with pread, then dequantized.

The table (28.8 GB at the real geometry) is read by rows at their file offsets, not through the mapping, so a
token's reads can be issued together on an I/O thread as soon as the token is known: POSIX_FADV_WILLNEED on
every row first puts all of them in flight at once, instead of 16 reads at queue depth 1 (16 x 33 us).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from strata.host.trace import clock
from strata.model.gguf_file import TensorInfo
from strata.quant import dequantize


@dataclass(frozen=True)
class PleRows:
    """A token's gathered vector and how its read went."""
    e: np.ndarray          # (ple_dim,) float32: the rows dequantized, concatenated in head order
    nbytes: int
    t0: float              # trace clock, the I/O thread's view
    t1: float


def pread_into(fd: int, buf: np.ndarray, offset: int, path: str, what: str) -> None:
    """Fill buf (contiguous uint8) from the file at offset; OSError naming the file and the read on a short read."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise OSError(e.errno, f"{path}: {what} (byte {offset + done}): {e.strerror}") from e
        if n == 0:
            raise OSError(f"{path}: {what}: the file ends at byte {offset + done}, {len(view) - done} bytes short")
        done += n


class PleReader:
    """Reads PLE table rows of one GGUF file; thread-safe (pread shares no file position)."""

    def __init__(self, path: str, table: TensorInfo, pool: ThreadPoolExecutor):
        self.path, self.pool = path, pool
        self.qtype = table.qtype
        self.base, self.row_bytes = table.offset, table.row_bytes      # absolute file offset of row 0
        self.fd = os.open(path, os.O_RDONLY)

    def start(self, rows: np.ndarray) -> Future:
        """Begin reading table rows `rows` (ple_heads,); the future gives PleRows."""
        return self.pool.submit(self.read_rows, np.asarray(rows, np.int64))

    def read_rows(self, rows: np.ndarray) -> PleRows:
        t0 = clock()
        offsets = [self.base + int(r) * self.row_bytes for r in rows]
        for off in offsets:
            os.posix_fadvise(self.fd, off, self.row_bytes, os.POSIX_FADV_WILLNEED)
        raw = np.empty((len(rows), self.row_bytes), np.uint8)          # (ple_heads, row_bytes)
        for i, (r, off) in enumerate(zip(rows, offsets)):
            pread_into(self.fd, raw[i], off, self.path, f"reading PLE table row {int(r)}")
        e = dequantize(raw, self.qtype).reshape(-1).astype(np.float32, copy=False)
        return PleRows(e, raw.nbytes, t0, clock())

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
