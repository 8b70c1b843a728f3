"""NVRTC build of the kernel sources: compiled at first use for the device's architecture (sm_90a on the H200) to
a cubin, cached on disk by source hash, arch, options and NVRTC version ($STRATA_CACHE or ~/.cache/strata, in
kernels/), loaded with cuModuleLoadData.

Cubins, not PTX: a cubin from a newer NVRTC loads on an older driver of the same major version, PTX would need
the driver's JIT to understand the newer ISA. The sources include only common.cuh / quant.cuh (passed to NVRTC
as named headers) and decode fp16 with PTX, so no toolkit header directory is needed.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = ("gemv", "gemm", "hc", "gdn", "qsa", "moe", "ple")
HEADERS = ("common.cuh", "quant.cuh", "gemm.cuh")
# -lineinfo keeps source lines in the SASS for profilers; no fast-math (accuracy is the contract)
OPTIONS = ("-std=c++17", "-lineinfo")


def options() -> tuple[str, ...]:
    """OPTIONS, plus -D NAME=VALUE for each word of $STRATA_KERNEL_DEFINES: the benches build a kernel's
    compile-time variants with it (bench/gpu_check.py --phases gemv under GEMV_MIN_CTAS=2, 3, 4)."""
    return OPTIONS + tuple("-D" + d for d in os.environ.get("STRATA_KERNEL_DEFINES", "").split())


def define(name: str, default: int) -> int:
    """The value a -D option of $STRATA_KERNEL_DEFINES gives `name`, else the source's default: for the launch
    geometry that has to agree with a compile-time constant (qsa.cu's QSA_HW)."""
    for d in os.environ.get("STRATA_KERNEL_DEFINES", "").split():
        key, _, value = d.partition("=")
        if key == name:
            return int(value)
    return default


class KernelBuildError(RuntimeError):
    """NVRTC refused a source: the message holds its log."""


def _nvrtc():
    from cuda.bindings import nvrtc
    return nvrtc


def _check(ret, call: str, log_of=None):
    nvrtc = _nvrtc()
    res, *vals = ret if isinstance(ret, tuple) else (ret,)
    if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KernelBuildError(f"{call}: {res.name}" + (f"\n{log_of()}" if log_of else ""))
    return vals[0] if len(vals) == 1 else (tuple(vals) if vals else None)


def nvrtc_version() -> tuple[int, int]:
    return _check(_nvrtc().nvrtcVersion(), "nvrtcVersion")


def source_text(name: str) -> str:
    return (HERE / f"{name}.cu").read_text()


def _headers() -> list[tuple[bytes, bytes]]:
    return [((HERE / h).read_bytes(), h.encode()) for h in HEADERS]


def cache_key(name: str, arch: int) -> str:
    h = hashlib.sha256()
    h.update(source_text(name).encode())
    for src, hname in _headers():
        h.update(hname + b"\0" + src)
    h.update(f"{target(arch)}|{'|'.join(options())}|nvrtc {nvrtc_version()}".encode())
    return h.hexdigest()[:24]


def target(arch: int) -> str:
    """NVRTC's target for a device of compute capability arch (90 for 9.0): Hopper's own sm_90a, whose cubins run
    on 9.0 devices only and have its warpgroup MMA (gemm.cuh's tile uses it there), else sm_<arch>."""
    return "sm_90a" if arch == 90 else f"sm_{arch}"


def compile_cubin(name: str, arch: int, ptx: bool = False) -> bytes:
    """NVRTC -> cubin for sm_<arch> (ptx: the PTX instead, to see what a build holds); KernelBuildError with the
    compiler's log on failure."""
    nvrtc = _nvrtc()
    headers = _headers()
    prog = _check(nvrtc.nvrtcCreateProgram(source_text(name).encode(), f"{name}.cu".encode(), len(headers),
                                           [s for s, _ in headers], [n for _, n in headers]),
                  f"nvrtcCreateProgram({name}.cu)")

    def log() -> str:
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        return buf.decode(errors="replace").rstrip("\0 \n")

    opts = [f"--gpu-architecture={target(arch)}".encode(), *(o.encode() for o in options())]
    try:
        _check(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), f"nvrtcCompileProgram({name}.cu, {target(arch)})", log)
        get_size, get = ((nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if ptx
                         else (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN))
        size = _check(get_size(prog), get_size.__name__)
        cubin = b" " * size
        _check(get(prog, cubin), get.__name__)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return cubin


def cubin(name: str, arch: int, cache: str | os.PathLike | None = None) -> bytes:
    """The cached cubin of kernels/<name>.cu for sm_<arch>, compiled on a miss."""
    if name not in SOURCES:
        raise KernelBuildError(f"no kernel source '{name}': one of {', '.join(SOURCES)}")
    if cache is None:
        from strata.cuda.driver import cache_root
        cache = cache_root()
    folder = Path(cache) / "kernels"
    path = folder / f"{name}-sm{arch}-{cache_key(name, arch)}.cubin"
    if path.exists():
        return path.read_bytes()
    data = compile_cubin(name, arch)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)          # atomic: a concurrent reader never sees half a file
    return data


class Module:
    """A loaded kernel source: `.function(name)` gives its CUfunction (context must be current)."""

    def __init__(self, name: str, arch: int):
        from strata.cuda.driver import check, cu
        self.name = name
        self.handle = check(cu.cuModuleLoadData(cubin(name, arch)), f"cuModuleLoadData({name}.cu, sm_{arch})")
        self._functions: dict[str, object] = {}

    def function(self, fname: str):
        from strata.cuda.driver import check, cu
        if fname not in self._functions:
            self._functions[fname] = check(cu.cuModuleGetFunction(self.handle, fname.encode()),
                                           f"cuModuleGetFunction({self.name}.cu: {fname})")
        return self._functions[fname]
