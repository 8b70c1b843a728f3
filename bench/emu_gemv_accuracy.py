"""The GEMV kernel's error against float64 per format and kind of x, run on the CPU emulator (tests/kernel_emu.h):
the integer path's accuracy (quant.cuh) beside the float32 matmul of the same dequantized weights.

    python3 bench/emu_gemv_accuracy.py

Needs g++; no GPU. It measures accuracy only (the emulator says nothing about speed)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _pytest.monkeypatch import MonkeyPatch          # noqa: E402

from kernel_emu import EmuKernels, EmuRig             # noqa: E402
from strata.kernels import gemv as kgemv              # noqa: E402
from strata.kernels.gemv import Job                   # noqa: E402
from strata.quant.dequant import dequantize           # noqa: E402
from strata.quant.formats import QType                # noqa: E402
from test_cuda_kernels import random_matrix, rel      # noqa: E402


def main() -> None:
    mp, kern = MonkeyPatch(), EmuKernels(Path(tempfile.mkdtemp(prefix="strata-emu-")))
    n_in, n_out = 512, 40
    print(f"{n_out} x {n_in}; relative error against float64: kernel (float32 matmul of the dequantized weights)")
    for qt in [QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS, QType.BF16]:
        cells = []
        for kind in ("normal", "spread e^+-8", "outlier 500"):
            rng = np.random.default_rng(3)
            raw = random_matrix(qt, n_out, n_in, rng)
            x = rng.standard_normal(n_in).astype(np.float32)
            if kind.startswith("spread"):
                x *= np.exp(rng.uniform(-8, 8, n_in)).astype(np.float32)
            if kind.startswith("outlier"):
                x[7] = 500.0
            rig = EmuRig(kern, mp)
            w, xb, y = rig.mat("w", raw, qt, n_out, n_in), rig.buf("x", (n_in,), value=x), rig.buf("y", (n_out,))
            table = kgemv.job_table("jobs", 1, rig.A.reserve)
            rig.commit()
            rig.run(kgemv.gemv_launch(kern.fn("gemv", "gemv_jobs"), "gemv", table, [Job(w, xb, y)]))
            W = dequantize(raw, qt).reshape(n_out, n_in).astype(np.float64)
            ref = W @ x.astype(np.float64)
            f32 = (W.astype(np.float32) @ x).astype(np.float64)
            cells.append(f"{kind}: {rel(y.download(), ref):.2e} ({rel(f32, ref):.2e})")
            rig.close()
            mp.undo()
        print(f"{qt.name:7s} " + "; ".join(cells))


if __name__ == "__main__":
    main()
