"""How far the batched GEMM (3xFP16, strata/kernels/gemm.cu) lands from float64 and from the f32 GEMV as the input
length grows: random valid matrices of the model's formats, unit normal x, per-row relative error
(||y - ref|| / ||ref||), max over the rows, at n_in 512 .. 10240 (the hc reads' 4 x 2560), over few outputs (64-row
tiles) and many (128-row tiles). Needs a GPU.

    python3 bench/gemm_accuracy.py [--rows 64] [--n-out 320,1280]
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
from strata.quant.dequant import dequantize                   # noqa: E402
from strata.quant.formats import QType, row_bytes             # noqa: E402
from strata.quant.quantize import quantize                    # noqa: E402


def rel_rows(out: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.linalg.norm(out - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--n-out", default="320,1280", help="outputs, comma-separated")
    args = ap.parse_args()
    dev = drv.Device.open()
    K = Kernels(dev.arch)
    stream = drv.Stream()
    rng = np.random.default_rng(0)
    T = args.rows
    print(f"device: {dev.name}; {T} rows; max over rows of the relative error")
    print(f"{'type':6s} {'n_out':>5s} {'n_in':>6s} {'GEMM vs f64':>12s} {'GEMV vs f64':>12s} {'GEMM vs GEMV':>13s}"
          f"  kernel")
    cases = [(qt, n_out, n_in) for n_out in map(int, args.n_out.split(","))
             for qt in (QType.Q8_0, QType.F32, QType.IQ4_XS, QType.Q6_K) for n_in in (512, 2560, 6144, 10240)]
    for qt, n_out, n_in in cases:
        W = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
        raw = quantize(W, qt).reshape(n_out, -1)
        Wd = dequantize(raw, qt).reshape(n_out, n_in).astype(np.float64)
        X = rng.standard_normal((T, n_in)).astype(np.float32)
        A = Arena()
        w = A.reserve("w", (n_out * row_bytes(qt, n_in),), np.uint8)
        x, y = A.reserve("x", (T, n_in)), A.reserve("y", (T, n_out))
        gy = A.reserve("gy", (T, n_out))
        nr = A.reserve("n_rows", (1,), np.int32)
        table = kgemm.job_table("jobs", 1, A.reserve)
        gtab = kgemv.job_table("gemv", T, A.reserve)
        A.commit()
        w.upload(device_rows(raw, qt, n_out, n_in).reshape(-1))
        x.upload(X)
        nr.upload(np.array([T], np.int32))
        m = DevMat(w, int(qt), n_out, n_in, row_bytes(qt, n_in))
        gemm = kgemm.gemm_launch(lambda n: K.fn("gemm", n), "gemm", table, [kgemm.GemmJob(m, x, y)], nr, T)
        gemv = kgemv.gemv_launch(K.fn("gemv", "gemv_jobs"), "gemv", gtab,
                                 [kgemv.Job(m, x.row(t), gy.row(t)) for t in range(T)])
        gemm.enqueue(stream)
        gemv.enqueue(stream)
        stream.synchronize("accuracy")
        ref = X.astype(np.float64) @ Wd.T
        out, gout = y.download().astype(np.float64), gy.download().astype(np.float64)
        name = kgemm.kernel_name(T, kgemm.chunk_k([qt]), False, n_out)
        print(f"{qt.name:6s} {n_out:5d} {n_in:6d} {rel_rows(out, ref).max():12.2e} {rel_rows(gout, ref).max():12.2e} "
              f"{rel_rows(out, gout).max():13.2e}  {name}")
        A.free()
    stream.destroy()


if __name__ == "__main__":
    main()
