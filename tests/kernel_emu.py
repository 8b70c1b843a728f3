"""The CUDA kernels' sources run on the CPU (tests/kernel_emu.h): a test rig with the GPU rig's interface, so that
a kernel test runs unchanged on the GPU and here.

A kernel file is compiled by g++ as C++ with kernel_emu.h first (one shared library per file and source hash,
cached under pytest's cache dir), each `extern "C" __global__` kernel wrapped as `emu_<name>`. The arena is host
memory, so device pointers are host addresses and the kernels' job tables work as they are; a Launch built by the
kernel wrappers (strata/kernels/*.py) runs through its packed arguments exactly as cuLaunchKernel takes them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from strata.cuda.arena import ALIGN, Arena, DevMat
from strata.cuda.driver import HostBuffer
from strata.cuda.weights import device_rows
from strata.kernels.build import options
from strata.kernels.gemv import device_row_bytes
from strata.quant.formats import QType

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "strata" / "kernels"
HEADER = Path(__file__).resolve().with_name("kernel_emu.h")
# in the preprocessed source (macros expanded, __global__ and __launch_bounds__ gone): every extern "C" function of a
# kernel file is a kernel
_KERNEL_RE = re.compile(r'extern\s+"C"\s+void\s+(\w+)\s*\(')


def why_not() -> str | None:
    """None when the emulator can be built here, else the reason."""
    return None if shutil.which("g++") else "no g++ on this machine"


def build(module: str, cache: Path) -> ctypes.CDLL:
    """strata/kernels/<module>.cu compiled for the CPU with $STRATA_KERNEL_DEFINES, as NVRTC builds it (cached by
    the hash of every source it can include and of those defines)."""
    src = KERNELS / f"{module}.cu"
    defines = [o for o in options() if o.startswith("-D")]      # $STRATA_KERNEL_DEFINES, as NVRTC gets them
    h = hashlib.sha256(HEADER.read_bytes() + HEADER.with_name("kernel_emu_fiber.h").read_bytes()
                       + " ".join(defines).encode())
    for p in sorted(KERNELS.glob("*.cu*")):
        h.update(p.read_bytes())
    so = cache / f"{module}-{h.hexdigest()[:16]}.so"
    base = ["g++", "-std=c++20", "-w", *defines, "-include", str(HEADER), "-I", str(KERNELS)]
    pre = subprocess.run(base + ["-E", "-x", "c++", str(src)], capture_output=True, text=True)
    if pre.returncode:
        raise RuntimeError(f"preprocessing {src.name} for the CPU emulator failed:\n{pre.stderr[-4000:]}")
    names = sorted(set(_KERNEL_RE.findall(pre.stdout)))
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # per-process names: test workers (pytest -n) share the cache and may build the same module at once; the
        # last replace wins with identical bytes
        cpp = cache / f"{module}-emu-{os.getpid()}.cpp"
        cpp.write_text(f'#include "{src}"\n' + "".join(f"EMU_ENTRY({n})\n" for n in names))
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        r = subprocess.run(base + ["-O1", "-shared", "-fPIC", "-pthread", str(cpp), "-o", str(tmp)],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"compiling {src.name} for the CPU emulator failed:\n{r.stderr[-4000:]}")
        tmp.replace(so)
    lib = ctypes.CDLL(str(so))
    for n in names:
        f = getattr(lib, f"emu_{n}")
        f.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_size_t, ctypes.c_void_p]
        f.restype = ctypes.c_int
    lib.emu_error.restype = ctypes.c_char_p
    return lib


class EmuFn:
    """A kernel of a compiled module: what Kernels.fn returns on the GPU, here the emulator's entry."""

    def __init__(self, lib: ctypes.CDLL, name: str):
        self._entry, self._error, self.name = getattr(lib, f"emu_{name}"), lib.emu_error, name
        sizes = (ctypes.c_size_t * 64)()
        n = getattr(lib, f"emu_args_{name}")(sizes)
        self.arg_sizes = [int(sizes[i]) for i in range(n)]     # what a graph copies at capture

    def entry(self, gx, gy, gz, bx, by, bz, smem, args) -> None:
        """Run the kernel (kernel_emu.h EMU_ENTRY); a CTA that wrote past its shared memory raises."""
        if self._entry(gx, gy, gz, bx, by, bz, smem, args):
            raise RuntimeError(f"{self.name}: {self._error().decode()}")

    def __int__(self) -> int:
        return id(self)


class EmuKernels:
    def __init__(self, cache: Path):
        self.cache, self.libs = cache, {}

    def fn(self, module: str, name: str) -> EmuFn:
        if module not in self.libs:
            self.libs[module] = build(module, self.cache)
        return EmuFn(self.libs[module], name)


class ArenaRig:
    """What a kernel test does with its buffers, on either rig: reserve, fill at commit, poison; `k.fn` names a
    kernel, `run` launches, `download` reads back."""

    def __init__(self, kern):
        self.k = kern
        self.A = Arena()
        self.fills: list = []

    def buf(self, name, shape, dtype=np.float32, value=None):
        a = self.A.reserve(name, shape, dtype)
        if value is not None:
            self.fills.append((a, np.asarray(value, dtype).reshape(a.shape)))
        return a

    def mat(self, name, raw: np.ndarray, qt: QType, n_out: int, n_in: int, n_mat: int = 1) -> DevMat:
        rows = device_rows(raw, qt, n_out * n_mat, n_in)
        a = self.buf(name, (rows.size,), np.uint8, rows.reshape(-1))
        return DevMat(a, int(qt), n_out, n_in, device_row_bytes(qt, n_in), n_mat)

    def poison(self, *arrays):
        for a in arrays:
            a.upload(np.full(a.shape, np.nan, a.dtype) if a.dtype.kind == "f" else np.full(a.shape, -7, a.dtype))


class EmuRig(ArenaRig):
    """The GPU test rig (tests/test_cuda_kernels.py Rig) over host memory and the emulator. `ctas` is what the
    wrappers get as the GPU's resident CTAs (strata.cuda.launch.resident_ctas): few, so that a kernel whose CTAs
    walk their work takes several steps each."""

    def __init__(self, kern: EmuKernels, monkeypatch, ctas: int = 3):
        from strata.cuda import arena, driver, launch
        from strata.kernels import gemv
        super().__init__(kern)
        self._host = None
        self.dev = SimpleNamespace(n_sm=2, arch=90)        # the emulator builds the kernels' sm_90 paths
        monkeypatch.setattr(driver, "HostBuffer", EmuHostBuffer)
        monkeypatch.setattr(launch, "allow_smem", lambda fn, name, smem: None)
        monkeypatch.setattr(gemv, "resident_ctas", lambda fn, name, threads, smem: ctas)
        monkeypatch.setattr(arena.DevArray, "upload", _upload)
        monkeypatch.setattr(arena.DevArray, "download", _download)

    def commit(self):
        self._host = np.zeros(self.A.total + 2 * ALIGN, np.uint8)
        addr = self._host.ctypes.data
        self.A.base = (addr + ALIGN - 1) // ALIGN * ALIGN
        for a, v in self.fills:
            a.upload(v)

    def run(self, *launches):
        for l in launches:
            l.fn.entry(*l.grid, *l.block, l.smem, ctypes.addressof(l._ptrs))

    def close(self):
        self.A.base = 0
        self._host = None


class EmuHostBuffer(HostBuffer):
    """Pinned host memory's stand-in: host memory is the emulator's device memory, so "mapped" is the same address."""

    def __init__(self, nbytes: int, mapped: bool = False, what: str = "pinned"):
        self._mem = np.zeros(max(nbytes, 1) + 64, np.uint8)
        self.nbytes = nbytes
        self.ptr = (self._mem.ctypes.data + 63) // 64 * 64
        self.dptr = self.ptr if mapped else 0
        self._buf = (ctypes.c_uint8 * max(nbytes, 1)).from_address(self.ptr)

    def free(self) -> None:
        self.ptr = 0


def _upload(self, a: np.ndarray) -> None:
    a = np.ascontiguousarray(a)
    if a.nbytes > self.nbytes:
        raise ValueError(f"upload to '{self.name}': {a.nbytes} bytes into {self.nbytes}")
    ctypes.memmove(self.ptr, a.ctypes.data, a.nbytes)


def _download(self) -> np.ndarray:
    out = np.empty(self.shape, self.dtype)
    ctypes.memmove(out.ctypes.data, self.ptr, self.nbytes)
    return out
