"""The CUDA driver through cuda-bindings: every call checked, every failure a BackendError naming the call and
the CUresult. Context, streams, events, pinned and mapped host memory.

Only the driver API is used (no runtime): one primary context on device 0, made current on the calling thread.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np

from strata.host.backend import BackendError

try:
    from cuda.bindings import driver as cu
except ImportError as e:         # the package is optional: pip install -e '.[cuda]'
    cu = None
    _IMPORT_ERROR = e
else:
    _IMPORT_ERROR = None


class CudaError(BackendError):
    """A driver call failed: the message names the call and the CUresult."""


def _name(res) -> str:
    err, name = cu.cuGetErrorName(res)
    return name.decode() if err == cu.CUresult.CUDA_SUCCESS and name else str(res)


def check(ret, call: str, *args):
    """ret is a cuda-bindings return tuple (CUresult, *values): the values, or CudaError naming the call:
    `call % args` (formatted only on a failure: the hot paths pass their numbers, not a message)."""
    res, *vals = ret if isinstance(ret, tuple) else (ret,)
    if res != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(f"{call % args if args else call}: {_name(res)}")
    return vals[0] if len(vals) == 1 else (tuple(vals) if vals else None)


def available() -> str | None:
    """None when a CUDA device can be used, else the reason it cannot (for skips and errors)."""
    if cu is None:
        return f"cuda-bindings is not installed ({_IMPORT_ERROR})"
    try:
        (res,) = cu.cuInit(0)
    except Exception as e:          # libcuda missing: cuda-bindings raises at the first call
        return f"the CUDA driver could not be loaded: {e}"
    if res != cu.CUresult.CUDA_SUCCESS:
        return f"cuInit: {_name(res)} (no NVIDIA GPU or driver)"
    res, n = cu.cuDeviceGetCount()
    if res != cu.CUresult.CUDA_SUCCESS or n < 1:
        return "no CUDA device"
    return None


@dataclass
class Device:
    """Device 0 with its primary context current on this thread."""
    dev: object
    ctx: object
    name: str
    arch: int          # compute capability, e.g. 90
    n_sm: int
    max_smem_optin: int

    @classmethod
    def open(cls) -> "Device":
        why = available()
        if why is not None:
            raise CudaError(f"no usable GPU: {why}")
        dev = check(cu.cuDeviceGet(0), "cuDeviceGet(0)")
        ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        A = cu.CUdevice_attribute
        attr = lambda a: check(cu.cuDeviceGetAttribute(a, dev), f"cuDeviceGetAttribute({a.name})")
        name = check(cu.cuDeviceGetName(256, dev), "cuDeviceGetName").split(b"\0")[0].decode()
        arch = 10 * attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) + attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        return cls(dev, ctx, name, arch, attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
                   attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN))

    def make_current(self) -> None:
        check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def mem_info(self) -> tuple[int, int]:
        free, total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def synchronize(self) -> None:
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")


class Stream:
    """A non-blocking stream (it never waits for the legacy default stream)."""

    def __init__(self, high_priority: bool = False):
        """high_priority: the device's greatest stream priority, whose pending CTAs the block scheduler places
        before other streams' (a graph launched into it runs at that priority)."""
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        if high_priority:
            _, greatest = check(cu.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
            self.handle = check(cu.cuStreamCreateWithPriority(flags, greatest), "cuStreamCreateWithPriority")
        else:
            self.handle = check(cu.cuStreamCreate(flags), "cuStreamCreate")
        self.prev_kernel = False        # the last thing enqueued was a kernel (strata.cuda.launch: PDL)

    def synchronize(self, what: str = "", *args) -> None:
        check(cu.cuStreamSynchronize(self.handle), "cuStreamSynchronize (" + what + ")" if what else
              "cuStreamSynchronize", *args)

    def wait(self, ev: "Event") -> None:
        check(cu.cuStreamWaitEvent(self.handle, ev.handle, 0), "cuStreamWaitEvent")
        self.prev_kernel = False

    def destroy(self) -> None:
        check(cu.cuStreamDestroy(self.handle), "cuStreamDestroy")


class Event:
    """timing=False events are the cheap ones polled by the doorbell loop."""

    def __init__(self, timing: bool = False):
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check(cu.cuEventCreate(flags), "cuEventCreate")

    def record(self, stream: Stream) -> None:
        check(cu.cuEventRecord(self.handle, stream.handle), "cuEventRecord")
        stream.prev_kernel = False

    def query(self, what: str, *args) -> bool:
        """True when all work before the record has completed; never blocks. what % args names it on a failure."""
        (res,) = cu.cuEventQuery(self.handle)
        if res == cu.CUresult.CUDA_SUCCESS:
            return True
        if res == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise CudaError(f"cuEventQuery ({what % args if args else what}): {_name(res)}")

    def synchronize(self, what: str, *args) -> None:
        check(cu.cuEventSynchronize(self.handle), "cuEventSynchronize (" + what + ")", *args)

    def elapsed_ms(self, start: "Event") -> float:
        return float(check(cu.cuEventElapsedTime(start.handle, self.handle), "cuEventElapsedTime"))

    def destroy(self) -> None:
        check(cu.cuEventDestroy(self.handle), "cuEventDestroy")


class HostBuffer:
    """Pinned host memory (cuMemHostAlloc, PORTABLE); `mapped` also maps it into the device's address space.

    `.array(dtype, shape, offset)` is a numpy view of the bytes (no copy); `.dptr` the device address when mapped.
    """

    def __init__(self, nbytes: int, mapped: bool = False, what: str = "pinned"):
        flags = cu.CU_MEMHOSTALLOC_PORTABLE | (cu.CU_MEMHOSTALLOC_DEVICEMAP if mapped else 0)
        self.nbytes = nbytes
        self.ptr = int(check(cu.cuMemHostAlloc(max(nbytes, 1), flags), f"cuMemHostAlloc({nbytes}, {what})"))
        self.dptr = int(check(cu.cuMemHostGetDevicePointer(self.ptr, 0), "cuMemHostGetDevicePointer")) if mapped else 0
        self._buf = (ctypes.c_uint8 * max(nbytes, 1)).from_address(self.ptr)

    def array(self, dtype, shape, offset: int = 0) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offset + n > self.nbytes:
            raise ValueError(f"pinned view of {n} bytes at {offset} exceeds the buffer's {self.nbytes}")
        return np.frombuffer(self._buf, dtype=dtype, count=n // dtype.itemsize, offset=offset).reshape(shape)

    def free(self) -> None:
        if self.ptr:
            check(cu.cuMemFreeHost(self.ptr), "cuMemFreeHost")
            self.ptr = 0


def _copy_failed(call: str, res, what: str, args: tuple, nbytes: int):
    raise CudaError(f"{call} ({what % args if args else what}, {nbytes} B): {_name(res)}")


def memcpy_htod_async(dst: int, src_ptr: int, nbytes: int, stream: Stream, what: str, *args) -> None:
    """what % args names the copy in the error (formatted only then)."""
    (res,) = cu.cuMemcpyHtoDAsync(dst, src_ptr, nbytes, stream.handle)
    if res != cu.CUresult.CUDA_SUCCESS:
        _copy_failed("cuMemcpyHtoDAsync", res, what, args, nbytes)
    stream.prev_kernel = False


class CopyBatch:
    """Host-to-device copies enqueued by one driver call (cuMemcpyBatchAsync, CUDA 12.8+): a streamed layer's
    hundreds of expert copies cost the loop's thread one call, not one each. `probe()` (once per process, with a
    context current) copies through it and reads the bytes back; where the driver or the bindings lack it, or the
    check fails, every batch goes as one cuMemcpyHtoDAsync a copy and `why` says so."""

    ok: bool | None = None
    why = "not probed"

    @classmethod
    def probe(cls) -> bool:
        if cls.ok is None:
            cls.ok, cls.why = cls._probe()
        return cls.ok

    @classmethod
    def _probe(cls) -> tuple[bool, str]:
        if not hasattr(cu, "cuMemcpyBatchAsync"):
            return False, "cuda-bindings has no cuMemcpyBatchAsync"
        n = 64
        host = HostBuffer(2 * n, what="batch copy probe")
        stream = Stream()
        dev = check(cu.cuMemAlloc(2 * n), "cuMemAlloc(batch copy probe)")
        try:
            src = host.array(np.uint8, (2 * n,))
            src[:] = np.arange(2 * n, dtype=np.uint8)
            try:         # the halves swapped: each copy lands where its own pointers say
                cls._enqueue([int(dev) + n, int(dev)], [host.ptr, host.ptr + n], [n, n], stream)
            except (CudaError, TypeError, ValueError) as e:
                return False, f"cuMemcpyBatchAsync failed ({e})"
            stream.synchronize("batch copy probe")
            back = np.empty(2 * n, np.uint8)
            check(cu.cuMemcpyDtoH(back.ctypes.data, dev, 2 * n), "cuMemcpyDtoH(batch copy probe)")
            if not (np.array_equal(back[:n], src[n:]) and np.array_equal(back[n:], src[:n])):
                return False, "cuMemcpyBatchAsync copied the wrong bytes"
            return True, "one cuMemcpyBatchAsync a batch"
        finally:
            check(cu.cuMemFree(dev), "cuMemFree(batch copy probe)")
            stream.destroy()
            host.free()

    @staticmethod
    def _enqueue(dsts, srcs, sizes, stream: "Stream") -> None:
        attr = cu.CUmemcpyAttributes()   # source read in stream order: the blob is pinned and lives until done
        attr.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attr.flags = cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        ptr = cu.CUdeviceptr
        check(cu.cuMemcpyBatchAsync([ptr(d) for d in dsts], [ptr(s) for s in srcs], list(sizes), len(sizes),
                                    [attr], [0], 1, stream.handle), "cuMemcpyBatchAsync (%d copies)", len(sizes))

    def __init__(self, stream: "Stream"):
        self.stream = stream                 # where the batch is enqueued
        self.dsts: list[int] = []
        self.srcs: list[int] = []
        self.sizes: list[int] = []
        self._at: set[int] = set()

    def add(self, dst: int, src_ptr: int, nbytes: int) -> None:
        """A copy to dst. A batch's copies run in no given order, so one to a destination a pending copy starts at
        (a cache slot loaded twice: an expert promoted, then evicted by a later layer's) first flushes the batch,
        keeping the second write last. Every copy into a slot starts at the slot's base."""
        if dst in self._at:
            self.flush("expert copies to the same slot")
        self._at.add(dst)
        self.dsts.append(dst)
        self.srcs.append(src_ptr)
        self.sizes.append(nbytes)

    def __len__(self) -> int:
        return len(self.sizes)

    def flush(self, what: str, *args) -> None:
        """Enqueue the copies added since the last flush; what % args names them in an error."""
        if not self.sizes:
            return
        dsts, srcs, sizes = self.dsts, self.srcs, self.sizes
        self.dsts, self.srcs, self.sizes = [], [], []      # a failed batch is not retried by the next flush
        self._at = set()
        if self.ok:
            try:
                self._enqueue(dsts, srcs, sizes, self.stream)
            except CudaError as e:
                raise CudaError(f"{e} ({what % args if args else what}, {sum(sizes)} B)") from None
            self.stream.prev_kernel = False
        else:
            for d, s, n in zip(dsts, srcs, sizes):
                memcpy_htod_async(d, s, n, self.stream, what, *args)


def memcpy_dtoh_async(dst_ptr: int, src: int, nbytes: int, stream: Stream, what: str, *args) -> None:
    (res,) = cu.cuMemcpyDtoHAsync(dst_ptr, src, nbytes, stream.handle)
    if res != cu.CUresult.CUDA_SUCCESS:
        _copy_failed("cuMemcpyDtoHAsync", res, what, args, nbytes)
    stream.prev_kernel = False


def memset_async(dst: int, nbytes: int, stream: Stream, what: str, value: int = 0) -> None:
    (res,) = cu.cuMemsetD8Async(dst, value, nbytes, stream.handle)
    if res != cu.CUresult.CUDA_SUCCESS:
        _copy_failed("cuMemsetD8Async", res, what, (), nbytes)
    stream.prev_kernel = False


def cache_root() -> str:
    """$STRATA_CACHE or ~/.cache/strata (the kernels' cubins go to its kernels/ subfolder)."""
    return os.environ.get("STRATA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "strata")
