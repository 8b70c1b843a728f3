"""Fixed-size host memory cells carved from large chunks, returned to a free list when nothing refers to them.

The CUDA backend hands the expert store cells of pinned memory (strata.cuda.backend.CudaBackend.host_alloc), so an
upload is one DMA from the blob itself: no staging copy, no wait for a staging buffer. A cell goes back to the free
list only when the array given out and every view of it are gone (weakref.finalize on the array), so a blob that
the store evicted while a CPU batch still reads it, or while a DMA from it is in flight (the backend keeps a
reference until the copy's event has completed), keeps its memory until then.

`chunk_alloc(nbytes)` returns (address, keepalive): the chunk's memory, and an object holding it (freed when the
Cells are closed). The CPU tests use numpy chunks; the CUDA backend uses cuMemHostAlloc.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from typing import Callable

import numpy as np

CHUNK_BYTES = 256 << 20        # one cuMemHostAlloc pins this much at a time (a few ms)


class Cells:
    def __init__(self, cell_bytes: int, chunk_alloc: Callable[[int], tuple[int, object]],
                 chunk_bytes: int = CHUNK_BYTES, align: int = 4096):
        if cell_bytes <= 0:
            raise ValueError(f"cells of {cell_bytes} bytes")
        self.cell_bytes = -(-cell_bytes // align) * align
        self.per_chunk = max(1, chunk_bytes // self.cell_bytes)
        self._alloc = chunk_alloc
        self._chunks: list[tuple[int, int, object]] = []      # (address, nbytes, keepalive)
        self._starts: list[int] = []                           # chunk addresses, sorted (owns: bisect)
        self._ends: list[int] = []
        self._free: list[int] = []                             # addresses of free cells
        self._lock = threading.Lock()
        self.live = 0

    @property
    def nbytes(self) -> int:
        """Bytes held in chunks (live and free cells)."""
        return sum(n for _, n, _ in self._chunks)

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of nbytes (<= cell_bytes) in a cell; the cell is free again once the array is gone."""
        if nbytes > self.cell_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a cell of {self.cell_bytes}")
        with self._lock:
            if not self._free:
                n = self.per_chunk * self.cell_bytes
                addr, keep = self._alloc(n)
                self._chunks.append((int(addr), n, keep))
                at = bisect.bisect(self._starts, int(addr))
                self._starts.insert(at, int(addr))
                self._ends.insert(at, int(addr) + n)
                self._free.extend(int(addr) + i * self.cell_bytes for i in range(self.per_chunk - 1, -1, -1))
            addr = self._free.pop()
            self.live += 1
        owner = _Cell(addr, nbytes)
        weakref.finalize(owner, self._give_back, addr)      # runs once owner, the array and every view are gone
        return np.asarray(owner)

    def _give_back(self, addr: int) -> None:
        with self._lock:
            self._free.append(addr)
            self.live -= 1

    def owns(self, a: np.ndarray) -> bool:
        """a's memory lies inside one of the chunks."""
        return self.owns_span(a.__array_interface__["data"][0], a.nbytes)

    def owns_span(self, p: int, nbytes: int) -> bool:
        """Bytes [p, p + nbytes) lie inside one of the chunks."""
        i = bisect.bisect(self._starts, p) - 1
        return i >= 0 and p + nbytes <= self._ends[i]

    def close(self, free: Callable[[object], None] = lambda keep: None) -> None:
        with self._lock:
            chunks, self._chunks, self._free, self._starts, self._ends = self._chunks, [], [], [], []
        for _, _, keep in chunks:
            free(keep)


class _Cell:
    """The owner of a cell's array: every view made from it keeps it (and so the cell) alive."""

    def __init__(self, addr: int, nbytes: int):
        self.__array_interface__ = {"data": (addr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


def numpy_chunks(nbytes: int) -> tuple[int, object]:
    """chunk_alloc for plain host memory (tests, the CPU backend)."""
    a = np.empty(nbytes, np.uint8)
    return a.ctypes.data, a
