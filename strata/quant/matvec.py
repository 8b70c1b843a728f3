"""y = W x for one activation vector, W stored in a ggml block format: the CPU expert/dense matvec.

    act = prepare_activation(x, wt)                  # quantize x once (llama.cpp's vec_dot_type)
    y = matvec_prepared(w, wt, act)                  # w: uint8 (rows, row_bytes), e.g. a GGUF tensor view
    matvec_prepared(w, wt, act, out, r0, r1)         # only rows [r0, r1): the unit of a thread split
    y = matvec_parallel(w, wt, x, pool=pool)         # rows split over a thread pool (kernels release the GIL)

exact=True swaps the quantized activation for float32 x and sums products of the dequantized weights in
float64 (a few rows dequantized at a time into a scratch block): the reference mode tests compare against.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from strata.quant import kernels as K
from strata.quant.activation import Act, prepare_activation
from strata.quant.dequant import dequantize
from strata.quant.formats import F16_TO_F32, FLOAT_TYPES, QType, qtype, readonly, row_bytes
from strata.quant.grids import IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS
from strata.quant.simd import HAS_AVX2

# weight type -> (kernel, extra tables)
_KERNELS = {
    QType.Q8_0: (K.mv_q8_0, ()),
    QType.Q4_0: (K.mv_q4_0, ()),
    QType.Q4_1: (K.mv_q4_1, ()),
    QType.Q5_0: (K.mv_q5_0, ()),
    QType.Q5_1: (K.mv_q5_1, ()),
    QType.IQ4_NL: (K.mv_iq4_nl, ()),
    QType.Q2_0: (K.mv_q2_0, ()),
    QType.Q2_K: (K.mv_q2_k, ()),
    QType.Q3_K: (K.mv_q3_k, ()),
    QType.Q4_K: (K.mv_q4_k, ()),
    QType.Q5_K: (K.mv_q5_k, ()),
    QType.Q6_K: (K.mv_q6_k, ()),
    QType.IQ4_XS: (K.mv_iq4_xs, ()),
    QType.IQ2_XXS: (K.mv_iq2_xxs, (IQ2XXS_GRID, KSIGNS)),
    QType.IQ2_XS: (K.mv_iq2_xs, (IQ2XS_GRID, KSIGNS)),
    QType.IQ2_S: (K.mv_iq2_s, (IQ2S_GRID,)),
    QType.IQ3_XXS: (K.mv_iq3_xxs, (IQ3XXS_GRID, KSIGNS)),
    QType.IQ3_S: (K.mv_iq3_s, (IQ3S_GRID,)),
}
_FLOAT_DTYPE = {QType.F32: np.float32, QType.F16: np.uint16, QType.BF16: np.uint16}
_EXACT_CHUNK_BYTES = 1 << 18    # float32 scratch per exact-mode step


def _weights(w: np.ndarray, wt: QType, n: int) -> np.ndarray:
    """w as the 2-D C-contiguous read-only array the kernels take (a plain ndarray: a memmap subclass would cost the
    kernel dispatch a slow type check); ValueError when it does not hold rows of n."""
    want = _FLOAT_DTYPE.get(wt, np.uint8)
    if (isinstance(w, np.ndarray) and w.ndim == 2 and not w.flags.writeable and w.flags.c_contiguous
            and w.dtype in (want, np.uint8) and w.shape[1] * w.itemsize == row_bytes(wt, n)):
        # already as the kernels want it (a GGUF mapping view), maybe as bytes of a float type
        return w if type(w) is np.ndarray and w.dtype == want else w.view(want, np.ndarray)
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"weights must be 2-D (rows, row_bytes), got shape {w.shape}")
    if wt in FLOAT_TYPES:
        if w.dtype == np.float16 and wt == QType.F16:
            w = w.view(np.uint16)
        elif w.dtype == np.uint8:
            w = np.ascontiguousarray(w).view(want)
        elif w.dtype != want:
            raise ValueError(f"{wt.name} weights must be uint8 bytes or {np.dtype(want).name}, got {w.dtype}")
    elif w.dtype != np.uint8:
        raise ValueError(f"{wt.name} weights must be uint8 bytes, got {w.dtype}")
    if w.shape[1] * w.itemsize != row_bytes(wt, n):
        raise ValueError(f"{wt.name} rows of {n} elements take {row_bytes(wt, n)} bytes, "
                         f"weights have {w.shape[1] * w.itemsize}")
    return readonly(np.ascontiguousarray(w))


def matvec_prepared(w_raw: np.ndarray, wt: int, act: Act, out: np.ndarray | None = None,
                    row_start: int = 0, row_end: int | None = None) -> np.ndarray:
    """out[r] = W[r] . x for row_start <= r < row_end (default all); other rows of out are left untouched.

    w_raw: uint8 (rows, row_bytes) or, for F32/F16/BF16, the typed (rows, n) array; act from
    prepare_activation(x, wt). Returns out (float32 (rows,), allocated when None).
    """
    wt = qtype(wt)
    if act.wt != wt:
        raise ValueError(f"activation was prepared for {act.wt.name} weights, not {wt.name}")
    w = _weights(w_raw, wt, act.n)
    rows = w.shape[0]
    if out is None:
        out = np.empty(rows, np.float32)
    elif out.shape != (rows,) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be float32 ({rows},) contiguous, got {out.dtype} {out.shape}")
    r1 = rows if row_end is None else int(row_end)
    r0 = int(row_start)
    if not 0 <= r0 <= r1 <= rows:
        raise ValueError(f"row range [{r0}, {r1}) outside 0..{rows}")
    if act.exact:
        step = max(1, _EXACT_CHUNK_BYTES // (4 * act.n))
        for a in range(r0, r1, step):
            K.dot_rows_f64(dequantize(w[a:min(r1, a + step)], wt), act.v, out, a)
    elif wt == QType.F32:
        K.mv_f32(w, act.v, out, r0, r1)
    elif wt == QType.F16:
        K.mv_f16(w, act.v, out, r0, r1, F16_TO_F32)
    elif wt == QType.BF16:
        K.mv_bf16(w, act.v, out, r0, r1)
    else:
        if not HAS_AVX2:
            raise RuntimeError("strata's quantized matvec kernels need an x86-64 CPU with AVX2 and F16C")
        fn, tables = _KERNELS[wt]
        fn(w, act.q, act.d, act.aux, out, r0, r1, F16_TO_F32, *tables)
    return out


def matvec(w_raw: np.ndarray, wt: int, x: np.ndarray, exact: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """W x on the calling thread."""
    return matvec_prepared(w_raw, wt, prepare_activation(x, wt, exact), out)


_pool: ThreadPoolExecutor | None = None


def default_pool() -> ThreadPoolExecutor:
    """One process-wide pool with a thread per CPU."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="strata-matvec")
    return _pool


def split_rows(rows: int, parts: int, align: int = 8) -> list[tuple[int, int]]:
    """[r0, r1) ranges covering rows, `parts` of them at most, cut on multiples of align."""
    parts = max(1, min(parts, -(-rows // align)))
    cuts = [min(rows, (rows * i // parts + align - 1) // align * align) for i in range(parts)] + [rows]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def matvec_parallel(w_raw: np.ndarray, wt: int, x: np.ndarray, exact: bool = False,
                    pool: ThreadPoolExecutor | None = None, n_threads: int | None = None) -> np.ndarray:
    """W x with the rows split over `pool` (default: default_pool()) in n_threads parts (default: one per CPU)."""
    wt = qtype(wt)
    act = prepare_activation(x, wt, exact)
    w = _weights(w_raw, wt, act.n)
    out = np.empty(w.shape[0], np.float32)
    pool = pool or default_pool()
    jobs = [pool.submit(matvec_prepared, w, wt, act, out, a, b)
            for a, b in split_rows(w.shape[0], n_threads or os.cpu_count() or 1)]
    for j in jobs:
        j.result()
    return out
