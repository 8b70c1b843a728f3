"""PLE row reads: a step's rows of `per_layer_token_embd` (16 per token, deduplicated over the step) read from the
GGUF with pread, then dequantized.

The table (28.8 GB at the real geometry) is read by rows at their file offsets, not through the mapping, so a
step's reads can be issued together on an I/O thread as soon as its tokens are known: POSIX_FADV_WILLNEED on
every row first puts all of them in flight at once, instead of one read at a time at queue depth 1 (33 us each).
A read error, a short read, or a file changed since it was opened (FileGuard: size, mtime) is an OSError naming the
file, which fails the requests of the step that needed the rows.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from strata.host.trace import clock
from strata.model.gguf_file import FileGuard, TensorInfo
from strata.quant import dequantize


@dataclass(frozen=True)
class PleRows:
    """Table rows read for a step, and how the read went."""
    e: np.ndarray          # (U, row) float32: the rows, dequantized, in the order asked for
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
        self.guard = FileGuard(self.fd, path)

    def start(self, rows: np.ndarray) -> Future:
        """Begin reading table rows `rows` (U,) (a step's, deduplicated); the future gives PleRows."""
        return self.pool.submit(self.read_rows, np.asarray(rows, np.int64))

    def read_rows(self, rows: np.ndarray) -> PleRows:
        t0 = clock()
        self.guard.check()
        offsets = [self.base + int(r) * self.row_bytes for r in rows]
        for off in offsets:                  # every read in flight at once: the kernel queues them all
            os.posix_fadvise(self.fd, off, self.row_bytes, os.POSIX_FADV_WILLNEED)
        raw = np.empty((len(rows), self.row_bytes), np.uint8)          # (U, row_bytes)
        for i, (r, off) in enumerate(zip(rows, offsets)):
            pread_into(self.fd, raw[i], off, self.path, f"reading PLE table row {int(r)}")
        e = dequantize(raw, self.qtype).reshape(len(rows), -1).astype(np.float32, copy=False)
        return PleRows(e, raw.nbytes, t0, clock())

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
