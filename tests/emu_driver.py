"""The CUDA driver's stand-in for the CPU: the whole CUDA backend (its arena, graphs, streams, events, doorbell and
every kernel) runs on this machine, the kernels through the emulator (tests/kernel_emu.h), so that CI tests the
backend's own code (the batch plan, the graphs' contents, the host protocol) and not only each kernel alone.

`install(monkeypatch, cache)` puts `EmuDriver` where strata.cuda's modules read `cu` and makes every kernel module
an emulator build. Device memory is host memory, so a device address is a host address (as in EmuRig).

Semantics kept from the driver, since they are what the backend's correctness rests on:
- The first stream created (the backend's compute stream, whose kernels write the doorbell the host polls through
  mapped memory) runs its work when it is enqueued. Every other stream's work waits until something needs it: a
  stream waiting on one of its events, the host querying or synchronizing such an event or the stream, a context
  synchronize, a free. So work on a side stream (expert uploads, streamed layers, promotions) runs as late as the
  driver may run it, and a missing event wait, or a host buffer reused before its copy is known done, gives wrong
  numbers here instead of a race that happens to pass. (lazy=False: every stream at once, in enqueue order.)
- Capture records each enqueue into the capturing graph instead of running it; a stream that waits on an event
  recorded by a capturing stream joins that capture (a forked branch), as the driver's capture does. Launching
  the graph replays its nodes in the order captured.
- A captured kernel keeps the argument values it had at capture (copied, by the kernel's parameter sizes): a
  replay never re-reads the host's argument memory. A captured copy re-reads its source on every replay.
- Memory and handles are checked: a free of an unknown pointer, a copy outside any allocation or mapped host
  buffer, a launch with an unknown function or on a destroyed stream raise CUDA_ERROR_INVALID_VALUE.
"""

from __future__ import annotations

import ctypes
import enum
import threading
import time
from types import SimpleNamespace

import numpy as np


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901


CUdevice_attribute = enum.IntEnum("CUdevice_attribute", {
    "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT": 16, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR": 75,
    "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR": 76, "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 97})
CUstream_flags = enum.IntEnum("CUstream_flags", {"CU_STREAM_DEFAULT": 0, "CU_STREAM_NON_BLOCKING": 1})
CUevent_flags = enum.IntEnum("CUevent_flags", {"CU_EVENT_DEFAULT": 0, "CU_EVENT_DISABLE_TIMING": 2})
CUstreamCaptureMode = enum.IntEnum("CUstreamCaptureMode", {"CU_STREAM_CAPTURE_MODE_GLOBAL": 0,
                                                           "CU_STREAM_CAPTURE_MODE_THREAD_LOCAL": 1})
CUfunction_attribute = enum.IntEnum("CUfunction_attribute", {"CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES": 8})
CUlaunchAttributeID = enum.IntEnum("CUlaunchAttributeID",
                                   {"CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION": 5})


class CUlaunchAttribute:
    def __init__(self):
        self.id = None
        self.value = SimpleNamespace(programmaticStreamSerializationAllowed=0)


class CUlaunchConfig:
    def __init__(self):
        self.gridDimX = self.gridDimY = self.gridDimZ = 1
        self.blockDimX = self.blockDimY = self.blockDimZ = 1
        self.sharedMemBytes = 0
        self.hStream = None
        self.attrs, self.numAttrs = [], 0


CUmemcpySrcAccessOrder = enum.IntEnum("CUmemcpySrcAccessOrder", {
    "CU_MEMCPY_SRC_ACCESS_ORDER_INVALID": 0, "CU_MEMCPY_SRC_ACCESS_ORDER_STREAM": 1,
    "CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL": 2, "CU_MEMCPY_SRC_ACCESS_ORDER_ANY": 3})
CUmemcpyFlags = enum.IntEnum("CUmemcpyFlags", {"CU_MEMCPY_FLAG_DEFAULT": 0,
                                               "CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE": 1})


class CUdeviceptr:
    """The bindings' pointer type: list arguments of pointers take these, not ints."""
    def __init__(self, value: int = 0):
        self.value = int(value)

    def __int__(self) -> int:
        return self.value


class CUmemcpyAttributes:
    def __init__(self):
        self.srcAccessOrder = CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_INVALID
        self.flags = CUmemcpyFlags.CU_MEMCPY_FLAG_DEFAULT


OK = CUresult.CUDA_SUCCESS
BAD = CUresult.CUDA_ERROR_INVALID_VALUE


class Failed(Exception):
    def __init__(self, res: CUresult, why: str):
        super().__init__(why)
        self.res = res


class _Stream:
    def __init__(self, eager: bool):
        self.capture = None          # the _Graph this stream's enqueues go to while capturing
        self.alive = True
        self.eager = eager           # runs its work at once, else when something needs it (flush)
        self.pending: list = []      # work enqueued, not run yet
        self.issued = 0              # work ever enqueued (an event's mark counts up to its record)


class _Event:
    def __init__(self):
        self.t = None                # host time its record ran at (elapsed times between events)
        self.capture = None          # the capture it was recorded in, if any (a fork point)
        self.stream, self.mark = None, 0     # its last record: the stream, and that stream's work up to it


class _Graph:
    def __init__(self, origin: _Stream):
        self.origin, self.nodes, self.streams = origin, [], {origin}
        self.active = True


class _Exec:
    def __init__(self, graph: _Graph):
        self.nodes = list(graph.nodes)


class EmuDriver:
    """What strata.cuda uses of cuda.bindings.driver, over host memory and the kernel emulator."""

    CUresult = CUresult
    CUdevice_attribute = CUdevice_attribute
    CUstream_flags = CUstream_flags
    CUevent_flags = CUevent_flags
    CUstreamCaptureMode = CUstreamCaptureMode
    CUfunction_attribute = CUfunction_attribute
    CUlaunchAttributeID = CUlaunchAttributeID
    CUlaunchAttribute = CUlaunchAttribute
    CUlaunchConfig = CUlaunchConfig
    CUmemcpySrcAccessOrder = CUmemcpySrcAccessOrder
    CUmemcpyFlags = CUmemcpyFlags
    CUdeviceptr = CUdeviceptr
    CUmemcpyAttributes = CUmemcpyAttributes
    CU_MEMHOSTALLOC_PORTABLE = 1
    CU_MEMHOSTALLOC_DEVICEMAP = 2

    def __init__(self, total: int = 3 << 30, context: int = 512 << 20, n_sm: int = 2, arch: int = 90,
                 ctas_per_sm: int = 1, lazy: bool = True):
        """total: the device's memory (cuMemGetInfo), of which `context` is in use from the start (as a CUDA
        context and its modules hold ~0.5 GiB: what a budget that counts the device must leave); n_sm x
        ctas_per_sm: the CTAs a kernel whose CTAs walk their work gets (few, so each walks several tiles)."""
        self.total, self.n_sm, self.arch, self.ctas_per_sm = total, n_sm, arch, ctas_per_sm
        self.lock = threading.RLock()
        self.device_mem: dict[int, np.ndarray] = {}     # address -> its backing array
        self.host_mem: dict[int, np.ndarray] = {}
        self.used = context
        self.lazy = lazy
        self.streams: list[_Stream] = []

    # ---- plumbing -------------------------------------------------------------------------------------------
    def __getattr__(self, name):
        if name.startswith("cu"):
            raise AttributeError(f"the emulated driver has no {name}: add it to tests/emu_driver.py")
        raise AttributeError(name)

    def _call(self, fn, *args):
        with self.lock:
            try:
                out = fn(*args)
            except Failed as e:
                return (e.res,)
        if out is None:
            return (OK,)
        return (OK, *out) if isinstance(out, tuple) else (OK, out)

    def _alloc(self, table: dict, nbytes: int) -> int:
        a = np.zeros(max(int(nbytes), 1) + 256, np.uint8)
        ptr = (a.ctypes.data + 255) // 256 * 256
        table[ptr] = a
        return ptr

    def _inside(self, ptr: int, nbytes: int) -> bool:
        for table in (self.device_mem, self.host_mem):
            for p, a in table.items():
                if p <= ptr and ptr + nbytes <= a.ctypes.data + a.nbytes:
                    return True
        return False

    def _check_range(self, ptr: int, nbytes: int, what: str) -> None:
        if nbytes and not self._inside(int(ptr), int(nbytes)):
            raise Failed(BAD, f"{what}: [{ptr:#x}, +{nbytes}) is in no allocation")

    def _enqueue(self, stream, node) -> None:
        s = self._stream(stream)
        if s.capture is not None:
            s.capture.nodes.append(node)
            return
        s.issued += 1
        if s.eager:
            self._run(node)
        else:
            s.pending.append(node)

    def _flush(self, s: _Stream | None, upto: int | None = None) -> None:
        """Run stream s's pending work up to its `upto`-th enqueue (all of it: None); s None: every stream's."""
        for st in ([s] if s is not None else self.streams):
            n = len(st.pending) if upto is None else max(0, len(st.pending) - (st.issued - upto))
            todo, st.pending = st.pending[:n], st.pending[n:]
            for node in todo:
                self._run(node)

    def _stream(self, s) -> _Stream:
        if not isinstance(s, _Stream) or not s.alive:
            raise Failed(CUresult.CUDA_ERROR_INVALID_HANDLE, "not a live stream")
        return s

    def _run(self, node) -> None:
        kind = node[0]
        if kind == "kernel":
            _, fn, grid, block, smem, params, _args = node
            fn.entry(*grid, *block, smem, params)
        elif kind == "copy":
            _, dst, src, n = node
            ctypes.memmove(dst, src, n)
        elif kind == "set":
            _, dst, value, n = node
            ctypes.memset(dst, value, n)
        elif kind == "graph":
            for n in node[1].nodes:
                self._run(n)
        elif kind == "event":
            node[1].t = time.perf_counter()

    def _kernel_node(self, fn, grid, block, smem, params: int, capturing: bool):
        if not hasattr(fn, "entry"):
            raise Failed(CUresult.CUDA_ERROR_INVALID_HANDLE, "not an emulator kernel")
        f = fn
        if capturing:
            # the graph keeps the arguments' values as they are now (a copy per parameter, by its size)
            ptrs = (ctypes.c_void_p * max(len(f.arg_sizes), 1)).from_address(params)
            vals = [ctypes.create_string_buffer(ctypes.string_at(ptrs[i], n), max(n, 8))
                    for i, n in enumerate(f.arg_sizes)]
            arr = (ctypes.c_void_p * max(len(vals), 1))(*[ctypes.addressof(v) for v in vals])
            keep = (arr, vals)
            params = ctypes.addressof(arr)
        else:
            keep = None
        return ("kernel", f, tuple(grid), tuple(block), int(smem), params, keep)    # keep: a capture's copies

    # ---- device and context -----------------------------------------------------------------------------------
    def cuInit(self, flags):
        return (OK,)

    def cuDeviceGetCount(self):
        return (OK, 1)

    def cuDeviceGet(self, i):
        return (OK, 0) if i == 0 else (BAD,)

    def cuDevicePrimaryCtxRetain(self, dev):
        return (OK, "ctx")

    def cuCtxSetCurrent(self, ctx):
        return (OK,)

    def cuCtxGetDevice(self):
        return (OK, 0)

    def cuDeviceGetName(self, n, dev):
        return (OK, b"kernel emulator (CPU)\0")

    def cuDeviceGetAttribute(self, a, dev):
        A = CUdevice_attribute
        v = {A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: self.n_sm,
             A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: self.arch // 10,
             A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: self.arch % 10,
             A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 227 * 1024}
        return (OK, v[a]) if a in v else (BAD,)

    def cuMemGetInfo(self):
        with self.lock:
            return (OK, self.total - self.used, self.total)

    def cuCtxSynchronize(self):
        return self._call(lambda: self._flush(None))

    def cuGetErrorName(self, res):
        try:
            return (OK, CUresult(res).name.encode())
        except ValueError:
            return (BAD, None)

    # ---- memory -----------------------------------------------------------------------------------------------
    def cuMemAlloc(self, nbytes):
        def f():
            if self.used + nbytes > self.total:
                raise Failed(CUresult.CUDA_ERROR_OUT_OF_MEMORY, "out of memory")
            self.used += int(nbytes)
            return self._alloc(self.device_mem, nbytes)
        return self._call(f)

    def cuMemFree(self, ptr):
        def f():
            self._flush(None)                 # the driver's free waits for the device's work
            a = self.device_mem.pop(int(ptr), None)
            if a is None:
                raise Failed(BAD, "free of an unknown pointer")
            self.used -= a.nbytes - 256
        return self._call(f)

    def cuMemHostAlloc(self, nbytes, flags):
        return self._call(lambda: self._alloc(self.host_mem, nbytes))

    def cuMemHostGetDevicePointer(self, ptr, flags):
        return (OK, int(ptr)) if int(ptr) in self.host_mem else (BAD,)

    def cuMemFreeHost(self, ptr):
        def f():
            self._flush(None)
            if self.host_mem.pop(int(ptr), None) is None:
                raise Failed(BAD, "free of an unknown host pointer")
        return self._call(f)

    def _copy(self, dst, src, n, stream=None, to_device=True):
        """A copy whose device side (dst to the device, else src) must lie in an allocation or a mapped host
        buffer; the host side is any host memory, as the driver takes pageable memory too."""
        def f():
            self._check_range(dst if to_device else src, n, "copy's device side")
            node = ("copy", int(dst), int(src), int(n))
            if stream is None:
                self._run(node)
            else:
                self._enqueue(stream, node)
        return self._call(f)

    def cuMemcpyHtoD(self, dst, src, n):
        return self._copy(dst, src, n)

    def cuMemcpyDtoH(self, dst, src, n):
        return self._copy(dst, src, n, to_device=False)

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        return self._copy(dst, src, n, stream)

    def cuMemcpyDtoHAsync(self, dst, src, n, stream):
        return self._copy(dst, src, n, stream, to_device=False)

    def cuMemcpyBatchAsync(self, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, stream):
        """Checked as the driver documents it (equal lengths, a valid source order for every copy, pointers as
        CUdeviceptr); the copies are enqueued in reverse, since a batch promises no order among its copies."""
        def f():
            if not len(dsts) == len(srcs) == len(sizes) == count or count < 1:
                raise Failed(BAD, "batch copy: dsts, srcs, sizes and count disagree")
            if not len(attrs) == len(attrs_idxs) == num_attrs or num_attrs < 1 or attrs_idxs[0] != 0 or \
                    any(b <= a for a, b in zip(attrs_idxs, attrs_idxs[1:])) or attrs_idxs[-1] >= count:
                raise Failed(BAD, "batch copy: attrs and attrsIdxs")
            if any(a.srcAccessOrder == CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_INVALID for a in attrs):
                raise Failed(BAD, "batch copy: a copy without a source access order")
            if not all(isinstance(p, CUdeviceptr) for p in (*dsts, *srcs)):
                raise TypeError("batch copy: dsts and srcs take CUdeviceptr")
            for d, n in zip(dsts, sizes):
                self._check_range(int(d), n, "batch copy's device side")
            for d, s_, n in reversed(list(zip(dsts, srcs, sizes))):
                self._enqueue(stream, ("copy", int(d), int(s_), int(n)))
        return self._call(f)

    def cuMemsetD8Async(self, dst, value, n, stream):
        def f():
            self._check_range(dst, n, "memset")
            self._enqueue(stream, ("set", int(dst), int(value), int(n)))
        return self._call(f)

    # ---- streams, events, graphs --------------------------------------------------------------------------------
    def cuStreamCreate(self, flags):
        with self.lock:
            st = _Stream(eager=not self.lazy or not self.streams)
            self.streams.append(st)
            return (OK, st)

    def cuCtxGetStreamPriorityRange(self):
        return (OK, 0, -5)           # (least, greatest), as an H100 reports them

    def cuStreamCreateWithPriority(self, flags, priority):
        # priority orders the block scheduler's placement only; the emulator runs streams in dependency order
        if not -5 <= int(priority) <= 0:
            return (BAD,)
        return self.cuStreamCreate(flags)

    def cuStreamDestroy(self, s):
        def f():
            st = self._stream(s)
            self._flush(st)                   # its work completes, as the driver's does
            st.alive = False
            self.streams.remove(st)
        return self._call(f)

    def cuStreamSynchronize(self, s):
        def f():
            st = self._stream(s)
            if st.capture is not None:
                raise Failed(CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "sync while capturing")
            self._flush(st)
        return self._call(f)

    def cuEventCreate(self, flags):
        return (OK, _Event())

    def cuEventDestroy(self, e):
        return (OK,)

    def cuEventRecord(self, e, s):
        def f():
            st = self._stream(s)
            e.capture = st.capture
            if st.capture is None:
                self._enqueue(st, ("event", e))
                e.stream, e.mark = st, st.issued
        return self._call(f)

    def _reached(self, e) -> None:
        if e.stream is not None and e.stream.alive:
            self._flush(e.stream, e.mark)

    def cuEventQuery(self, e):
        return self._call(self._reached, e)

    def cuEventSynchronize(self, e):
        return self._call(self._reached, e)

    def cuEventElapsedTime(self, a, b):
        if a.stream is None or b.stream is None:
            return (BAD,)                     # never recorded
        if a.t is None or b.t is None:
            return (CUresult.CUDA_ERROR_NOT_READY,)      # recorded, its work not run yet
        return (OK, 1000.0 * (b.t - a.t))

    def cuStreamWaitEvent(self, s, e, flags):
        def f():
            st = self._stream(s)
            if e.capture is not None and e.capture.active and st.capture is None:   # a fork: it joins the capture
                st.capture = e.capture
                e.capture.streams.add(st)
            elif e.capture is None:
                self._reached(e)             # its work runs now, before anything st enqueues after the wait
        return self._call(f)

    def cuStreamBeginCapture(self, s, mode):
        def f():
            st = self._stream(s)
            if st.capture is not None:
                raise Failed(BAD, "already capturing")
            st.capture = _Graph(st)
        return self._call(f)

    def cuStreamEndCapture(self, s):
        def f():
            st = self._stream(s)
            g = st.capture
            if g is None or g.origin is not st:
                raise Failed(BAD, "not capturing on this stream")
            for other in g.streams:
                other.capture = None
            g.active = False
            return g
        return self._call(f)

    def cuGraphGetNodes(self, g, n):
        return (OK, None, len(g.nodes))

    def cuGraphInstantiate(self, g, flags):
        return (OK, _Exec(g))

    def cuGraphLaunch(self, ex, s):
        return self._call(lambda: self._enqueue(s, ("graph", ex)))

    def cuGraphExecDestroy(self, ex):
        return (OK,)

    def cuGraphDestroy(self, g):
        return (OK,)

    # ---- kernels ------------------------------------------------------------------------------------------------
    def cuFuncSetAttribute(self, fn, attr, value):
        return (OK,)

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, fn, threads, smem):
        return (OK, self.ctas_per_sm)

    def _launch(self, fn, grid, block, smem, stream, params):
        def f():
            st = self._stream(stream)
            self._enqueue(st, self._kernel_node(fn, grid, block, smem, int(params), st.capture is not None))
        return self._call(f)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        return self._launch(fn, (gx, gy, gz), (bx, by, bz), smem, stream, params)

    def cuLaunchKernelEx(self, cfg, fn, params, extra):
        return self._launch(fn, (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ),
                            (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ), cfg.sharedMemBytes, cfg.hStream, params)


class EmuModule:
    """strata.kernels.build.Module's stand-in: the source's emulator build; functions by name."""

    def __init__(self, kernels, name: str):
        self.kernels, self.name = kernels, name

    def function(self, fname: str):
        return self.kernels.fn(self.name, fname)


def install(monkeypatch, cache, **device) -> EmuDriver:
    """The emulated driver in place of cuda.bindings.driver for strata.cuda (and the kernel builds), for the
    duration of a test (monkeypatch undoes it)."""
    import strata.kernels as K
    from kernel_emu import EmuKernels
    from strata.cuda import arena, driver, graphs, launch

    cu = EmuDriver(**device)
    for mod in (driver, arena, graphs, launch):
        monkeypatch.setattr(mod, "cu", cu)
    kernels = EmuKernels(cache)
    monkeypatch.setattr(K, "Module", lambda name, arch: EmuModule(kernels, name))     # what Kernels loads
    monkeypatch.setattr(launch, "_SMEM_SET", {})
    monkeypatch.setattr(launch, "_PDL", dict(launch._PDL, probed=False))
    monkeypatch.setattr(driver.CopyBatch, "ok", None)          # probed again against this driver
    return cu
