"""A kernel launch whose arguments are packed once into ctypes memory and then enqueued as often as needed.

Packing 16 pointers from a tuple costs 14 us per launch, a pre-packed launch 5.9 us (MACHINES.md); and inside a
graph the arguments are copied into the node at capture and never re-read, so they must not change anyway:
per-step values are data in device buffers, never arguments.
"""

from __future__ import annotations

import ctypes

import numpy as np

from strata.cuda.driver import Stream, check, cu

SMEM_DEFAULT_LIMIT = 48 * 1024


def P(x) -> ctypes.c_uint64:
    """A device pointer argument (a DevArray, DevMat, int address or None for null)."""
    if x is None:
        return ctypes.c_uint64(0)
    return ctypes.c_uint64(x if isinstance(x, int) else x.ptr)


def I(x: int) -> ctypes.c_int32:
    return ctypes.c_int32(int(x))


def F(x: float) -> ctypes.c_float:
    return ctypes.c_float(float(x))


class Launch:
    """fn<<<grid, block, smem>>>(args), args made with P / I / F in the kernel's parameter order."""

    def __init__(self, fn, name: str, grid, block, smem: int, args: list):
        self.fn, self.name = fn, name
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        self.smem = int(smem)
        if any(g < 1 for g in self.grid) or any(b < 1 for b in self.block):
            raise ValueError(f"{name}: empty launch grid {self.grid} block {self.block}")
        if self.block[0] * self.block[1] * self.block[2] > 1024:
            raise ValueError(f"{name}: {self.block} is more than 1024 threads")
        if self.smem > SMEM_DEFAULT_LIMIT:
            check(cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        self.smem), f"cuFuncSetAttribute({name}, {self.smem} B shared)")
        self._vals = list(args)
        self._ptrs = (ctypes.c_void_p * max(len(args), 1))(*[ctypes.addressof(v) for v in self._vals])

    def enqueue(self, stream: Stream) -> None:
        check(cu.cuLaunchKernel(self.fn, *self.grid, *self.block, self.smem, stream.handle,
                                ctypes.addressof(self._ptrs), 0), f"cuLaunchKernel({self.name})")


def need(a, what: str, size: int, dtype=np.float32):
    """The wrappers' shape/dtype check: `a` (a DevArray) must be `dtype` and hold at least `size` values."""
    if a.dtype != np.dtype(dtype):
        raise ValueError(f"{what}: '{a.name}' is {a.dtype}, the kernel reads {np.dtype(dtype)}")
    if a.size < size:
        raise ValueError(f"{what}: '{a.name}' holds {a.size} values, the kernel touches {size}")
    return a


class CopyH2D:
    """A copy from pinned staging (fixed host address) into the arena, enqueued like a launch: inside a graph
    it is a memcpy node that re-reads the staging bytes on every replay."""

    def __init__(self, name: str, dst, src_ptr: int, nbytes: int):
        self.name, self.dst, self.src_ptr, self.nbytes = name, dst, src_ptr, nbytes

    def enqueue(self, stream: Stream) -> None:
        check(cu.cuMemcpyHtoDAsync(self.dst.ptr, self.src_ptr, self.nbytes, stream.handle),
              f"cuMemcpyHtoDAsync({self.name}, {self.nbytes} B)")
