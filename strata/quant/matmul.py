"""W applied to T activation rows at once on the CPU: each block of weight rows is read from memory once for all T.

    out = matmul(w, wt, x)          # w as matvec_prepared takes it, (rows, ·); x float32 (T, n) -> out (T, rows)

Row t of out is bit for bit matvec(w, wt, x[t], exact): x[t]'s activation is made by the njit functions
prepare_activation runs (through strata.quant.experts' _prep), and every (row block, t) is the kernel call
matvec_prepared makes, or in exact mode the same dequantize + float64 dot (each block dequantized once for all
T). F16 and BF16 run mv_f16 / mv_bf16 on x rounded as prepare_activation rounds it; F32 runs mv_f32 as matvec
does, not BLAS, whose blocking would make a row's rounding depend on T.

One compiled parallel loop per matrix, compiled once per weight type and mode (code = 2 * ggml type + exact, a
literal, so numba's on-disk cache serves it: see strata.quant.experts): the threads claim the T activations, a
row an item, wait for all of them, then claim items of `per` weight rows (~BLOCK_BYTES), each applied to all T
rows while it is in L1/L2. Work under SERIAL_BYTES of weights (T * rows * row_bytes) runs on one thread: numba's
pool sleeps between calls and a second thread joins ~70 us late (2-vCPU dev VM), when one thread is about done
with 1 MB, and when the host's other vCPU is busy the call's end waits out a worker it has descheduled (a 4-row
step's LM head, 3.4 MB, under other jobs' load: 0.43 ms on average on two threads, 0.28 ms on one). Launches take
strata.quant.experts' process-wide lock; the GIL is released while the loop runs.

numba's on-disk cache is keyed on this file only: after editing experts.py, kernels.py, dequant.py or
activation.py, delete strata/quant/__pycache__.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange
from numba.core import types
from numba.extending import overload

from strata.quant import kernels as K
from strata.quant.experts import (_JIT, _LAUNCH, _PARALLEL, _alloc, _apply, _claim, _ops, _prep_all, _use_threads,
                                  max_threads)
from strata.quant.formats import F16_TO_F32, FLOAT_TYPES, QType, qtype
from strata.quant.matvec import _KERNELS as _MATVEC
from strata.quant.matvec import _weights
from strata.quant.simd import HAS_AVX2

BLOCK_BYTES = 16 << 10              # weight bytes of one work item: stays in L1/L2 while the T rows pass over it
SERIAL_BYTES = 4 << 20              # below this many weight bytes x T, one thread
f32 = np.float32


# ---- float weights: the block applied to every row of v, by the type's kernel or (exact) as float32 once --------
# (rows r0:r1 as float32, the values dequantize gives)

@njit(**_JIT)
def _f32_rows(w, r0, r1, t):
    return w[r0:r1]


@njit(**_JIT)
def _f16_rows(w, r0, r1, t):
    y = np.empty((r1 - r0, w.shape[1]), f32)
    for i in range(r1 - r0):
        for j in range(w.shape[1]):
            y[i, j] = t[w[r0 + i, j]]
    return y


@njit(**_JIT)
def _bf16_rows(w, r0, r1, t):
    y = np.empty((r1 - r0, w.shape[1]), np.uint32)
    for i in range(r1 - r0):
        for j in range(w.shape[1]):
            y[i, j] = np.uint32(w[r0 + i, j]) << 16
    return y.view(f32)


_AS_F32 = {QType.F32: _f32_rows, QType.F16: _f16_rows, QType.BF16: _bf16_rows}


def _fapply(code, w, r0, r1, v, out, t):
    """out[p, r] = w[r] . v[p] for r0 <= r < r1 and every p (float weights; t: F16_TO_F32)."""


@overload(_fapply, prefer_literal=True)
def _fapply_impl(code, w, r0, r1, v, out, t):
    if not isinstance(code, types.IntegerLiteral):
        return None                                # numba tries the literal next
    wt, exact = QType(code.literal_value // 2), bool(code.literal_value % 2)
    if exact:                                      # matvec_prepared's exact mode: dequantize, float64 dots
        as_f32 = _AS_F32[wt]

        def impl(code, w, r0, r1, v, out, t):
            y = as_f32(w, r0, r1, t)
            for p in range(v.shape[0]):
                K.dot_rows_f64(y, v[p], out[p], r0)
    elif wt == QType.F16:
        def impl(code, w, r0, r1, v, out, t):
            for p in range(v.shape[0]):
                K.mv_f16(w, v[p], out[p], r0, r1, t)
    elif wt == QType.BF16:
        def impl(code, w, r0, r1, v, out, t):
            for p in range(v.shape[0]):
                K.mv_bf16(w, v[p], out[p], r0, r1)
    else:
        def impl(code, w, r0, r1, v, out, t):
            for p in range(v.shape[0]):
                K.mv_f32(w, v[p], out[p], r0, r1)
    return impl


# ---- one compiled call per type and mode ------------------------------------------------------------------------

def _make(code: int):
    """The parallel matmul of one weight type and mode; code is a closure constant (a literal to numba)."""
    if QType(code // 2) in FLOAT_TYPES:
        @njit(parallel=_PARALLEL, **_JIT)
        def float_mm(w, v, out, per, t, nt):
            # w: float32 or uint16 bits (rows, n); v: (T, n), x as the type's kernel takes it; out: (T, rows)
            rows = out.shape[1]
            nblk = -(-rows // per)
            items = np.zeros(1, np.int64)
            for _ in prange(nt):
                i = _claim(items, 0)
                while i < nblk:
                    r0 = i * per
                    _fapply(code, w, r0, min(rows, r0 + per), v, out, t)
                    i = _claim(items, 0)
        return float_mm

    @njit(parallel=_PARALLEL, **_JIT)
    def quant_mm(w, x, out, per, t, tables, nt):
        # w: uint8 (rows, rb); x: (T, n); out: (T, rows)
        n_t, rows = out.shape
        q, d, aux, v = _alloc(code, n_t, x.shape[1])
        own, every = np.arange(n_t), np.ones(n_t, np.bool_)
        nblk = -(-rows // per)
        items = np.zeros(3, np.int64)
        for _ in prange(nt):
            _prep_all(code, x, every, q, d, aux, v, items)     # the T activations, a row an item
            i = _claim(items, 2)
            while i < nblk:
                r0 = i * per
                _apply(code, w, r0, min(rows, r0 + per), q, d, aux, v, own, out, 0, n_t, t, tables)
                i = _claim(items, 2)
    return quant_mm


class _Kind(NamedTuple):
    """What a call needs per weight type and mode, made once."""
    fn: object             # the compiled parallel loop
    tables: tuple          # its arguments after the fp16 table: (the kernel's tables,) for quantized types
    round_x: object        # None, or x (T, n) -> x rounded as prepare_activation rounds it for the float kernel


_KINDS: dict[tuple[QType, bool], _Kind] = {}


def _kind(wt: QType, exact: bool) -> _Kind:
    if not exact and wt not in FLOAT_TYPES:
        if wt not in _MATVEC:
            raise ValueError(f"no matvec kernel for {wt.name} weights")
        if not HAS_AVX2:
            raise RuntimeError("strata's quantized matvec kernels need an x86-64 CPU with AVX2 and F16C")
    round_x = None
    if not exact and wt == QType.F16:
        round_x = _f16_round
    elif not exact and wt == QType.BF16:
        round_x = _bf16_round
    code = 2 * int(wt) + int(exact)
    kind = _Kind(_make(code), () if wt in FLOAT_TYPES else (_ops(wt, exact).tables,), round_x)
    _KINDS[wt, exact] = kind
    return kind


def _f16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(f32)


@njit(**_JIT)
def _bf16_round(x):
    """x (T, n) rounded to bf16, as float32: quantize.bf16_round_bits (ggml_compute_fp32_to_bf16: a NaN made
    quiet, else round to nearest even), one compiled pass instead of numpy's eight."""
    src = x.view(np.uint32)
    bits = np.empty(x.shape, np.uint32)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            n = np.uint64(src[i, j])
            if n & np.uint64(0x7FFFFFFF) > np.uint64(0x7F800000):
                n = (n & np.uint64(0xFFFF0000)) | np.uint64(0x00400000)
            n = (n + np.uint64(0x7FFF) + ((n >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
            bits[i, j] = np.uint32(n << np.uint64(16))
    return bits.view(f32)


def _rows_per_item(rows: int, rb: int, nt: int) -> int:
    """Rows per work item: ~BLOCK_BYTES of weights, but at least 4 items a thread when threaded; multiples of 8."""
    per = max(8, BLOCK_BYTES // rb)
    if nt > 1:
        per = min(per, max(8, -(-rows // (4 * nt))))
    return -(-per // 8) * 8


def matmul(w_raw: np.ndarray, wt: int, x: np.ndarray, exact: bool = False, out: np.ndarray | None = None,
           n_threads: int | None = None) -> np.ndarray:
    """out[t] = W x[t] for every row of x (float32 (T, n)), bit for bit matvec(w_raw, wt, x[t], exact), in one call.

    w_raw: as matvec_prepared takes it (uint8 (rows, row_bytes), or the typed (rows, n) array of F32/F16/BF16);
    out: float32 (T, rows) C-contiguous, allocated when None; n_threads: default max_threads(). Returns out.
    """
    wt = qtype(wt)
    kind = _KINDS.get((wt, exact)) or _kind(wt, exact)
    if type(x) is not np.ndarray or x.dtype != f32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, f32)
    if x.ndim != 2:
        raise ValueError(f"x must be float32 (T, n), got shape {x.shape}")
    n_t, n = x.shape
    w = _weights(w_raw, wt, n)                     # ValueError unless rows of n
    rows, rb = w.shape[0], w.shape[1] * w.itemsize
    if out is None:
        out = np.empty((n_t, rows), f32)
    elif out.shape != (n_t, rows) or out.dtype != f32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be float32 ({n_t}, {rows}) C-contiguous, got {out.dtype} {out.shape}")
    if n_t == 0 or rows == 0:
        return out
    if kind.round_x is not None:
        x = kind.round_x(x)
    nt = 1 if n_t * rows * rb < SERIAL_BYTES else max(1, min(n_threads or max_threads(), max_threads()))
    with _LAUNCH:
        _use_threads(nt)
        kind.fn(w, x, out, _rows_per_item(rows, rb, nt), F16_TO_F32, *kind.tables, nt)
    return out
