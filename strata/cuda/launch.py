"""A kernel launch whose arguments are packed once into ctypes memory and then enqueued as often as needed.

Packing 16 pointers from a tuple costs 14 us per launch, a pre-packed launch 5.9 us (MACHINES.md); and inside a
graph the arguments are copied into the node at capture and never re-read, so they must not change anyway:
per-step values are data in device buffers, never arguments.

Programmatic dependent launch (PDL): a kernel enqueued right after another kernel on the same stream carries
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, so its CTAs are scheduled while its predecessor finishes;
every kernel starts with griddepcontrol.wait (common.cuh pdl_begin), which returns once the predecessor has
completed and its writes are visible, so the data dependencies are those of plain stream order. Captured into a
graph, the edge becomes a programmatic one. A kernel that follows anything else on its stream (a copy, an event, a
wait, a graph launch, the start of a capture) is launched plainly. STRATA_PDL=0 turns PDL off; probe_pdl() turns it
off when the driver refuses it; pdl_status() says which.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from strata.cuda.driver import CudaError, Stream, check, cu

SMEM_DEFAULT_LIMIT = 48 * 1024
_PDL = {"on": os.environ.get("STRATA_PDL", "1") != "0", "probed": False,
        "why": "off (STRATA_PDL=0)" if os.environ.get("STRATA_PDL", "1") == "0" else "on"}


def pdl_on() -> bool:
    return _PDL["on"]


def set_pdl(on: bool, why: str) -> None:
    _PDL["on"], _PDL["why"] = bool(on), why


def pdl_status() -> str:
    return "programmatic dependent launch " + _PDL["why"]


def P(x) -> ctypes.c_uint64:
    """A device pointer argument (a DevArray, DevMat, int address or None for null)."""
    if x is None:
        return ctypes.c_uint64(0)
    return ctypes.c_uint64(x if isinstance(x, int) else x.ptr)


def I(x: int) -> ctypes.c_int32:
    return ctypes.c_int32(int(x))


def F(x: float) -> ctypes.c_float:
    return ctypes.c_float(float(x))


_SMEM_SET: dict[int, int] = {}     # function handle -> the dynamic shared limit set on it


def allow_smem(fn, name: str, smem: int) -> None:
    """Let `fn` take `smem` bytes of dynamic shared memory. The limit is the function's, not a launch's: only ever
    raised, so every launch built keeps its room."""
    if smem > max(SMEM_DEFAULT_LIMIT, _SMEM_SET.get(int(fn), 0)):
        check(cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    smem), f"cuFuncSetAttribute({name}, {smem} B shared)")
        _SMEM_SET[int(fn)] = smem


def resident_ctas(fn, name: str, threads: int, smem: int) -> int:
    """CTAs of `fn` (threads each, smem dynamic shared bytes) the current device holds at once: the grid of a
    kernel whose CTAs loop over its work."""
    allow_smem(fn, name, smem)
    per_sm = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, smem), f"occupancy of {name}")
    dev = check(cu.cuCtxGetDevice(), "cuCtxGetDevice")
    n_sm = check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
                 "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)")
    if per_sm < 1:
        raise CudaError(f"{name}: {threads} threads with {smem} B of shared memory do not fit one multiprocessor")
    return int(per_sm) * int(n_sm)


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
        allow_smem(fn, name, self.smem)
        self._vals = list(args)
        self._ptrs = (ctypes.c_void_p * max(len(args), 1))(*[ctypes.addressof(v) for v in self._vals])
        self._cfg = None

    def _config(self):
        if self._cfg is None:
            c = cu.CUlaunchConfig()
            c.gridDimX, c.gridDimY, c.gridDimZ = self.grid
            c.blockDimX, c.blockDimY, c.blockDimZ = self.block
            c.sharedMemBytes = self.smem
            a = cu.CUlaunchAttribute()
            a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            c.attrs = [a]
            c.numAttrs = 1
            self._cfg = c
        return self._cfg

    def enqueue(self, stream: Stream) -> None:
        if _PDL["on"] and getattr(stream, "prev_kernel", False):
            cfg = self._config()
            cfg.hStream = stream.handle
            check(cu.cuLaunchKernelEx(cfg, self.fn, ctypes.addressof(self._ptrs), 0),
                  f"cuLaunchKernelEx({self.name}, programmatic)")
        else:
            check(cu.cuLaunchKernel(self.fn, *self.grid, *self.block, self.smem, stream.handle,
                                    ctypes.addressof(self._ptrs), 0), f"cuLaunchKernel({self.name})")
        stream.prev_kernel = True


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
        stream.prev_kernel = False


def probe_pdl(fn_a, fn_b) -> None:
    """Once per process: a kernel pair launched with PDL, eagerly and from a captured graph, must run and give
    the right values; otherwise PDL is turned off for the process (pdl_status() has the error)."""
    if not _PDL["on"] or _PDL["probed"]:
        return
    _PDL["probed"] = True
    from strata.cuda.graphs import Graph
    n = 1 << 15
    buf, stream, graph = 0, None, None
    try:
        buf = int(check(cu.cuMemAlloc(8 * n), "cuMemAlloc(PDL probe)"))
        stream = Stream()
        grid = ((n + 255) // 256,)
        a = Launch(fn_a, "pdl_probe_a", grid, (256,), 0, [P(buf), I(n), I(4000)])
        b = Launch(fn_b, "pdl_probe_b", grid, (256,), 0, [P(buf), P(buf + 4 * n), I(n)])
        want = np.arange(n, dtype=np.float32) + 1
        for use_graph in (False, True):
            check(cu.cuMemsetD8Async(buf, 0xFF, 8 * n, stream.handle), "cuMemsetD8Async(PDL probe)")
            stream.prev_kernel = False
            if use_graph:
                graph = Graph("pdl probe", stream, lambda: (a.enqueue(stream), b.enqueue(stream)), fallback=False)
                graph.launch(stream)
            else:
                a.enqueue(stream)
                b.enqueue(stream)
            stream.synchronize("PDL probe")
            got = np.empty(n, np.float32)
            check(cu.cuMemcpyDtoH(got.ctypes.data, buf + 4 * n, 4 * n), "cuMemcpyDtoH(PDL probe)")
            if not np.array_equal(got, want):
                raise CudaError(f"PDL probe ({'graph' if use_graph else 'eager'}): "
                                f"{int((got != want).sum())} of {n} values wrong")
        set_pdl(True, "on (probed)")
    except CudaError as e:
        set_pdl(False, f"off: {e}")
    finally:
        if graph is not None:
            try:
                graph.destroy()
            except CudaError:
                pass
        if stream is not None:
            stream.destroy()
        if buf:
            cu.cuMemFree(buf)
