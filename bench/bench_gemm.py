"""The batched step's GEMM (strata/kernels/gemm.cu, 3xFP16 on the tensor cores) against the T=1 GEMV, at the flash
geometry's matrix shapes in the realistic mix: time per launch (median of repeats, warm-up excluded), effective
TFLOP/s (2 T n_out n_in / t), weight GB/s, and the speed-up over T GEMV launches.

    python3 bench/bench_gemm.py [--rows 1,16,64,512,4096] [--reps 20]

Needs a GPU (the device tool's H200). Random weights; the numbers depend on shape and format only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.cuda import driver as drv                        # noqa: E402
from strata.cuda.arena import Arena, DevMat                   # noqa: E402
from strata.cuda.weights import device_rows                   # noqa: E402
from strata.kernels import Kernels                            # noqa: E402
from strata.kernels import gemm as kgemm                      # noqa: E402
from strata.kernels import gemv as kgemv                      # noqa: E402
from strata.quant.formats import QType, row_bytes             # noqa: E402

# (label, type, n_out, n_in): the flash layer's matrices (MODEL.md, synth.REALISTIC)
SHAPES = [("gdn attn_qkv", QType.IQ4_XS, 10240, 2560), ("gdn ssm_out", QType.Q4_K, 2560, 6144),
          ("qsa attn_q", QType.Q4_K, 12288, 2560), ("expert gate", QType.Q2_0, 640, 2560),
          ("expert down", QType.Q2_0, 2560, 640), ("shexp gate", QType.Q5_K, 640, 2560),
          ("hc down", QType.Q8_0, 320, 10240)]


def random_rows(qt: QType, n_out: int, n_in: int, rng) -> np.ndarray:
    raw = rng.integers(0, 256, (n_out, row_bytes(qt, n_in)), dtype=np.uint8)
    # finite fp16 scales: clear the exponent's top bit of every 16-bit word (values stay small and finite)
    w = raw.view(np.uint16)
    w &= np.uint16(0xBBFF)
    return raw


class Launches:
    """Launches enqueued back to back, as one."""

    def __init__(self, launches):
        self.launches = launches

    def enqueue(self, stream) -> None:
        for launch in self.launches:
            launch.enqueue(stream)


def time_launch(launch, stream, reps: int) -> float:
    """Median ms of one launch over reps, after two warm-up launches."""
    for _ in range(2):
        launch.enqueue(stream)
    stream.synchronize("warm-up")
    out = []
    for _ in range(reps):
        a, b = drv.Event(timing=True), drv.Event(timing=True)
        a.record(stream)
        launch.enqueue(stream)
        b.record(stream)
        b.synchronize("bench")
        out.append(b.elapsed_ms(a))
        a.destroy()
        b.destroy()
    return float(np.median(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,512,4096", help="step rows T")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rows = [int(t) for t in args.rows.split(",")]
    dev = drv.Device.open()
    K = Kernels(dev.arch)
    stream = drv.Stream()
    rng = np.random.default_rng(0)
    print(f"device: {dev.name}; GEMM 3xFP16 vs GEMV (f32 path); median of {args.reps}, warm-up excluded")
    from strata.kernels.build import compile_cubin, nvrtc_version, options, target
    text = compile_cubin("gemm", dev.arch, ptx=True).decode(errors="replace")
    print(f"gemm.cu for {target(dev.arch)} by NVRTC {'.'.join(map(str, nvrtc_version()))} ({' '.join(options())}): "
          f"{text.count('wgmma.mma_async')} wgmma, {text.count('mma.sync')} mma.sync in its PTX")
    print(f"{'matrix':14s} {'type':7s} {'n_out x n_in':>13s} {'T':>5s} {'GEMM ms':>9s} {'TFLOP/s':>8s} "
          f"{'T x GEMV ms':>11s} {'speed-up':>8s}")
    for label, qt, n_out, n_in in SHAPES:
        Tm = max(rows)
        A = Arena()
        w = A.reserve("w", (n_out * row_bytes(qt, n_in),), np.uint8)
        x = A.reserve("x", (Tm, n_in))
        y = A.reserve("y", (Tm, n_out))
        nr = A.reserve("n_rows", (1,), np.int32)
        tables = {t: kgemm.job_table(f"jobs{t}", 1, A.reserve) for t in rows}
        bk = kgemm.chunk_k([qt])
        xs = (kgemm.XSplit(A.reserve("xs", (kgemm.xsplit_bytes(n_in, bk, Tm),), np.uint8), n_in, bk, Tm)
              if kgemm.XPREP and dev.arch == 90 and n_out >= kgemm.XPREP_MIN_OUT else None)   # as batch.py
        ws = (kgemm.XSplit(A.reserve("ws", (kgemm.xsplit_bytes(n_in, bk, n_out),), np.uint8), n_in, bk, n_out)
              if kgemm.WPREP and dev.arch == 90 else None)
        gtab = kgemv.job_table("gemv", 1, A.reserve)
        A.commit()
        w.upload(device_rows(random_rows(qt, n_out, n_in, rng), qt, n_out, n_in).reshape(-1))
        x.upload(rng.standard_normal((Tm, n_in)).astype(np.float32))
        m = DevMat(w, int(qt), n_out, n_in, row_bytes(qt, n_in))
        gv = kgemv.gemv_launch(K.fn("gemv", "gemv_jobs"), "gemv", gtab, [kgemv.Job(m, x.row(0), y.row(0))])
        t_gemv = time_launch(gv, stream, args.reps)
        for T in rows:
            nr.upload(np.array([T], np.int32))
            fn = lambda n: K.fn("gemm", n)
            wp = ws is not None and T >= kgemm.WPREP_MIN_ROWS       # as batch.py
            launch = kgemm.gemm_launch(fn, "gemm", tables[T], [kgemm.GemmJob(m, x, y, xs=xs, ws=ws if wp else None)],
                                       nr, T, swz=kgemm.WPREP_GROUP if wp else 0, arch=dev.arch)
            # GEMM_XPREP / GEMM_WPREP: the splits of x and of the weights are part of the product's time
            preps = ([kgemm.xsplit_launch(fn, "x_split", x, n_in, xs, nr, T)] if xs is not None else []) + \
                    ([kgemm.wsplit_launch(fn, "w_split", m, 0, ws)] if wp else [])
            if preps:
                launch = Launches([*preps, launch])
            t = time_launch(launch, stream, args.reps)
            tf = 2 * T * n_out * n_in / (t * 1e-3) / 1e12
            print(f"{label:14s} {qt.name:7s} {n_out:6d}x{n_in:<6d} {T:5d} {t:9.3f} {tf:8.2f} {T * t_gemv:11.3f} "
                  f"{T * t_gemv / t:7.1f}x")
        A.free()
    stream.destroy()


if __name__ == "__main__":
    main()
