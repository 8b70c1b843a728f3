"""CUDA kernels: the sources (*.cu, sharing common.cuh and quant.cuh), their NVRTC build (build.py) and one thin
wrapper module per group (gemv, hc, gdn, qsa, moe, ple) that checks shapes and packs a launch once."""

from __future__ import annotations

from strata.kernels.build import SOURCES, Module


class Kernels:
    """Every kernel source loaded for one device (its context current): `k.fn("gemv", "gemv_jobs")`."""

    def __init__(self, arch: int):
        self.modules = {name: Module(name, arch) for name in SOURCES}
        from strata.cuda.launch import probe_pdl
        probe_pdl(self.fn("gemv", "pdl_probe_a"), self.fn("gemv", "pdl_probe_b"))

    def fn(self, module: str, name: str):
        return self.modules[module].function(name)
