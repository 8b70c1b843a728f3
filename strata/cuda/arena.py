"""One device allocation carved into every buffer the session uses, so each has a fixed address for its life.

    arena = Arena()
    R = arena.reserve("R", (hc, E), np.float32)    # offsets only: nothing allocated yet
    ...
    arena.commit()                                  # one cuMemAlloc of the total; every DevArray now has .ptr
    arena.zero(stream)                              # fresh memory, every pad byte zero

Graphs capture addresses, never re-read them: an address that changed after capture would be replayed stale,
so nothing is reserved after commit() and nothing is ever freed but the whole arena.

A Section is a run of buffers whose span is placed later inside one larger reservation (Arena.place): the batched
step's activations sit right after the expert cache's slots, in the same buffer, so that between batched steps
their bytes can serve as more slots (strata.cuda.backend: lent_slots).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata.cuda import driver as drv
from strata.cuda.driver import CudaError, check, cu

ALIGN = 256


@dataclass
class DevArray:
    """A typed region of the arena: shape, dtype, byte offset."""
    arena: "Arena"
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype
    section: "Section | None" = None     # offset counts from the section's start, wherever it is placed

    @property
    def ptr(self) -> int:
        if self.arena.base == 0:
            raise CudaError(f"device buffer '{self.name}' used before the arena was committed")
        if self.section is None:
            return self.arena.base + self.offset
        if self.section.offset is None:
            raise CudaError(f"device buffer '{self.name}' used before its section '{self.section.name}' was placed")
        return self.arena.base + self.section.offset + self.offset

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def view(self, name: str, byte_offset: int, shape, dtype) -> "DevArray":
        """A typed window of this buffer's bytes (same memory)."""
        v = DevArray(self.arena, f"{self.name}.{name}", self.offset + byte_offset, tuple(shape), np.dtype(dtype),
                     self.section)
        if byte_offset + v.nbytes > self.nbytes:
            raise ValueError(f"view '{v.name}' ends past '{self.name}' ({byte_offset + v.nbytes} > {self.nbytes})")
        return v

    def row(self, i: int) -> "DevArray":
        """Row i of the first axis, as its own array (same memory)."""
        rest = self.shape[1:]
        n = int(np.prod(rest, dtype=np.int64)) * self.dtype.itemsize
        return DevArray(self.arena, f"{self.name}[{i}]", self.offset + i * n, rest, self.dtype, self.section)

    # synchronous host transfers: setup and tests only, never inside the token loop
    def upload(self, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a)
        if a.nbytes > self.nbytes:
            raise ValueError(f"upload to '{self.name}': {a.nbytes} bytes into {self.nbytes}")
        check(cu.cuMemcpyHtoD(self.ptr, a.ctypes.data, a.nbytes), f"cuMemcpyHtoD({self.name}, {a.nbytes} B)")
        # a pageable copy may return before its DMA lands, and our streams do not wait for the legacy one
        check(cu.cuCtxSynchronize(), f"cuCtxSynchronize (after uploading {self.name})")

    def download(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        check(cu.cuMemcpyDtoH(out.ctypes.data, self.ptr, self.nbytes), f"cuMemcpyDtoH({self.name}, {self.nbytes} B)")
        return out


@dataclass
class DevMat:
    """A weight matrix on the device in a kernel's format: n_mat stacked matrices of n_out rows of row_bytes.

    `qtype` is the ggml type id the kernels decode (the file's, or the one it was converted to at load).
    """
    buf: DevArray
    qtype: int
    n_out: int
    n_in: int
    row_bytes: int
    n_mat: int = 1

    @property
    def mat_bytes(self) -> int:
        return self.n_out * self.row_bytes

    @property
    def ptr(self) -> int:
        return self.buf.ptr


@dataclass
class Section:
    """Buffers reserved one after another (Arena.reserve(..., section=)), their span `total` bytes placed as a
    whole once the reservation that holds it exists (Arena.place); offset: from the arena's base, then."""
    name: str
    total: int = 0
    offset: int | None = None


def _padded(nbytes: int) -> int:
    # 32 spare bytes keep 16-byte vector reads of a padded tail inside the buffer
    return (nbytes + 32 + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Arena:
    base: int = 0
    total: int = 0
    items: list[DevArray] = field(default_factory=list)

    def reserve(self, name: str, shape, dtype=np.float32, section: Section | None = None) -> DevArray:
        if self.base:
            raise CudaError(f"reserve('{name}') after commit: every buffer must exist before graphs are captured")
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        dtype = np.dtype(dtype)
        if section is not None:
            if section.offset is not None:
                raise CudaError(f"reserve('{name}') in section '{section.name}' after it was placed")
            a = DevArray(self, name, section.total, shape, dtype, section)
            section.total += _padded(a.nbytes)
        else:
            a = DevArray(self, name, self.total, shape, dtype)
            self.total += _padded(a.nbytes)
        self.items.append(a)
        return a

    def place(self, section: Section, into: DevArray, byte_offset: int) -> None:
        """The section's buffers from byte_offset of `into` on (a reservation sized to hold them)."""
        if section.offset is not None:
            raise CudaError(f"section '{section.name}' is placed once")
        if into.section is not None or byte_offset % ALIGN or byte_offset + section.total > into.nbytes:
            raise CudaError(f"section '{section.name}' ({section.total} B) does not fit '{into.name}' at "
                            f"{byte_offset} ({into.nbytes} B, {ALIGN}-aligned offsets)")
        section.offset = into.offset + byte_offset

    def commit(self) -> None:
        if self.base:
            raise CudaError("the arena is committed once")
        self.base = int(check(cu.cuMemAlloc(max(self.total, ALIGN)), f"cuMemAlloc({self.total} B arena)"))

    def zero(self, stream: drv.Stream) -> None:
        """Every byte zero, finished before returning (synchronous uploads that follow must land after it)."""
        drv.memset_async(self.base, self.total, stream, "arena")
        stream.synchronize("arena zero")

    def free(self) -> None:
        if self.base:
            check(cu.cuMemFree(self.base), "cuMemFree(arena)")
            self.base = 0
