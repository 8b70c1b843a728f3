"""Block formats -> float32.

One numba kernel per format, each a transcription of gguf-py's `dequantize_blocks` (itself ggml's
dequantize_row_*), keeping its float32 operation order so the result is bit-identical to
`gguf.quants.dequantize`: e.g. Q4_K is (d*sc)*q - (dmin*m), IQ2_XXS is ((d*(0.5+ls))*0.25*grid)*(+-1.0).
Sign flips are multiplications by -1.0, as in gguf, not negations (they differ on NaN).
fastmath stays off: no FMA contraction, no reassociation.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from strata.quant.formats import (F16_TO_F32, FLOAT_TYPES, KVALUES_IQ4NL, QType, block_size, qtype, readonly,
                                  type_size)
from strata.quant.grids import IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS

_JIT = dict(nogil=True, cache=True, fastmath=False)
f32 = np.float32


@njit(**_JIT)
def _h(t, b, o):
    """fp16 at byte offset o of block b, as float32."""
    return t[np.int64(b[o]) | (np.int64(b[o + 1]) << 8)]


@njit(**_JIT)
def _dq_q4_0(x, y, t):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        for j in range(16):
            y[i, j] = d * f32(np.int64(b[2 + j] & 15) - 8)
            y[i, j + 16] = d * f32(np.int64(b[2 + j] >> 4) - 8)


@njit(**_JIT)
def _dq_q4_1(x, y, t):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        m = _h(t, b, 2)
        for j in range(16):
            y[i, j] = d * f32(b[4 + j] & 15) + m
            y[i, j + 16] = d * f32(b[4 + j] >> 4) + m


@njit(**_JIT)
def le32(b, o):
    """Little-endian uint32 at byte o, as int64."""
    return np.int64(b[o]) | (np.int64(b[o + 1]) << 8) | (np.int64(b[o + 2]) << 16) | (np.int64(b[o + 3]) << 24)


@njit(**_JIT)
def _dq_q5_0(x, y, t):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        qh = le32(b, 2)
        for j in range(16):
            lo = np.int64(b[6 + j] & 15) | (((qh >> j) & 1) << 4)
            hi = np.int64(b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)
            y[i, j] = d * f32(lo - 16)
            y[i, j + 16] = d * f32(hi - 16)


@njit(**_JIT)
def _dq_q5_1(x, y, t):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        m = _h(t, b, 2)
        qh = le32(b, 4)
        for j in range(16):
            lo = np.int64(b[8 + j] & 15) | (((qh >> j) & 1) << 4)
            hi = np.int64(b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)
            y[i, j] = d * f32(lo) + m
            y[i, j + 16] = d * f32(hi) + m


@njit(**_JIT)
def _dq_q8_0(x, y, t):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        for j in range(32):
            y[i, j] = f32(np.int8(b[2 + j])) * d


@njit(**_JIT)
def _dq_q8_1(x, y, t):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        for j in range(32):
            y[i, j] = f32(np.int8(b[4 + j])) * d


@njit(**_JIT)
def _dq_q2_0(x, y, t):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        for j in range(64):
            y[i, j] = f32(np.int64((b[2 + j // 4] >> (2 * (j % 4))) & 3) - 1) * d


@njit(**_JIT)
def _dq_q2_k(x, y, t):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 80)
        dmin = _h(t, b, 82)
        for g in range(16):                       # 16 groups of 16: qs chunk g//8, shift 2*((g%8)//2)
            sc = b[g]
            dl = d * f32(sc & 15)
            ml = dmin * f32(sc >> 4)
            q0 = 16 + 32 * (g // 8) + 16 * (g % 2)
            sh = 2 * ((g % 8) // 2)
            for l in range(16):
                y[i, 16 * g + l] = dl * f32((b[q0 + l] >> sh) & 3) - ml


@njit(**_JIT)
def _k_scale_min(b, o, j):
    """6-bit (scale, min) j of the 12 packed bytes at o (get_scale_min_k4)."""
    if j < 4:
        return np.int64(b[o + j] & 63), np.int64(b[o + j + 4] & 63)
    sc = np.int64(b[o + j + 4] & 15) | (np.int64(b[o + j - 4] >> 6) << 4)
    m = np.int64(b[o + j + 4] >> 4) | (np.int64(b[o + j] >> 6) << 4)
    return sc, m


@njit(**_JIT)
def q3k_scale(b, j):
    """6-bit scale j of Q3_K (scales at 96..107), minus 32."""
    lo = np.int64(b[96 + (j % 8)] >> (4 * (j // 8))) & 15
    hi = (np.int64(b[104 + (j % 4)]) >> (2 * (j // 4))) & 3
    return (lo | (hi << 4)) - 32


@njit(**_JIT)
def _dq_q3_k(x, y, t):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 108)
        for g in range(16):
            dl = d * f32(q3k_scale(b, g))
            q0 = 32 + 32 * (g // 8) + 16 * (g % 2)
            h0 = 16 * (g % 2)
            sh = 2 * ((g % 8) // 2)
            hb = (g % 8) // 2 + 4 * (g // 8)      # hmask bit: one per (128-chunk, shift)
            for l in range(16):
                q = np.int64((b[q0 + l] >> sh) & 3)
                if ((b[h0 + l] >> hb) & 1) == 0:
                    q -= 4
                y[i, 16 * g + l] = dl * f32(q)


@njit(**_JIT)
def _dq_q4_k(x, y, t):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        dmin = _h(t, b, 2)
        for s in range(8):
            sc, m = _k_scale_min(b, 4, s)
            dl = d * f32(sc)
            ml = dmin * f32(m)
            q0 = 16 + 32 * (s // 2)
            sh = 4 * (s % 2)
            for l in range(32):
                y[i, 32 * s + l] = dl * f32((b[q0 + l] >> sh) & 15) - ml


@njit(**_JIT)
def _dq_q5_k(x, y, t):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        dmin = _h(t, b, 2)
        for s in range(8):
            sc, m = _k_scale_min(b, 4, s)
            dl = d * f32(sc)
            ml = dmin * f32(m)
            q0 = 48 + 32 * (s // 2)
            sh = 4 * (s % 2)
            for l in range(32):
                q = np.int64((b[q0 + l] >> sh) & 15) | (np.int64((b[16 + l] >> s) & 1) << 4)
                y[i, 32 * s + l] = dl * f32(q) - ml


@njit(**_JIT)
def _dq_q6_k(x, y, t):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 208)
        for g in range(16):                       # element e = 128*h + 32*k + l, group g = e // 16
            dl = d * f32(np.int8(b[192 + g]))
            h = g // 8
            k = (g % 8) // 2
            for l0 in range(16):
                l = 16 * (g % 2) + l0
                ql = b[64 * h + 32 * (k % 2) + l]
                lo = np.int64(ql >> (4 * (k // 2))) & 15
                hi = np.int64(b[128 + 32 * h + l] >> (2 * k)) & 3
                y[i, 16 * g + l0] = dl * f32((lo | (hi << 4)) - 32)


@njit(**_JIT)
def _dq_q8_k(x, y, t):
    for i in range(x.shape[0]):
        b = x[i]
        d = x[i, 0:4].view(np.float32)[0]
        for j in range(256):
            y[i, j] = d * f32(np.int8(b[4 + j]))


@njit(**_JIT)
def _u32(b, o):
    return np.uint32(b[o]) | (np.uint32(b[o + 1]) << 8) | (np.uint32(b[o + 2]) << 16) | (np.uint32(b[o + 3]) << 24)


@njit(**_JIT)
def _sgn(s, j):
    return f32(-1.0) if (s >> j) & 1 else f32(1.0)


@njit(**_JIT)
def _dq_iq2_xxs(x, y, t, grid, ksigns):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        for ib in range(8):
            o = 2 + 8 * ib
            a1 = _u32(b, o + 4)
            db = d * (f32(0.5) + f32(a1 >> 28)) * f32(0.25)
            for l in range(4):
                g = grid[b[o + l]]
                s = ksigns[(a1 >> (7 * l)) & 127]
                for j in range(8):
                    y[i, 32 * ib + 8 * l + j] = db * f32(g[j]) * _sgn(s, j)


@njit(**_JIT)
def _dq_iq2_xs(x, y, t, grid, ksigns):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        for ib in range(8):
            sc = b[66 + ib]
            for l in range(4):
                ls = (sc & 15) if l < 2 else (sc >> 4)
                db = d * (f32(0.5) + f32(ls)) * f32(0.25)
                q = np.int64(b[2 + 8 * ib + 2 * l]) | (np.int64(b[3 + 8 * ib + 2 * l]) << 8)
                g = grid[q & 511]
                s = ksigns[q >> 9]
                for j in range(8):
                    y[i, 32 * ib + 8 * l + j] = db * f32(g[j]) * _sgn(s, j)


@njit(**_JIT)
def _dq_iq2_s(x, y, t, grid):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        for ib in range(8):
            sc = b[74 + ib]
            qh = np.int64(b[66 + ib])
            for l in range(4):
                ls = (sc & 15) if l < 2 else (sc >> 4)
                db = d * (f32(0.5) + f32(ls)) * f32(0.25)
                g = grid[np.int64(b[2 + 4 * ib + l]) | (((qh >> (2 * l)) & 3) << 8)]
                s = b[34 + 4 * ib + l]
                for j in range(8):
                    y[i, 32 * ib + 8 * l + j] = db * f32(g[j]) * _sgn(s, j)


@njit(**_JIT)
def _dq_iq3_xxs(x, y, t, grid, ksigns):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        for ib in range(8):
            a = _u32(b, 66 + 4 * ib)
            db = d * (f32(0.5) + f32(a >> 28)) * f32(0.5)
            for l in range(4):
                s = ksigns[(a >> (7 * l)) & 127]
                g1 = grid[b[2 + 8 * ib + 2 * l]]
                g2 = grid[b[3 + 8 * ib + 2 * l]]
                for j in range(4):
                    y[i, 32 * ib + 8 * l + j] = db * f32(g1[j]) * _sgn(s, j)
                    y[i, 32 * ib + 8 * l + 4 + j] = db * f32(g2[j]) * _sgn(s, j + 4)


@njit(**_JIT)
def _dq_iq3_s(x, y, t, grid):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        for ib in range(8):
            sc = b[106 + ib // 2]
            ls = (sc & 15) if ib % 2 == 0 else (sc >> 4)
            db = d * f32(1 + 2 * np.int64(ls))
            qh = np.int64(b[66 + ib])
            for l in range(4):
                s = b[74 + 4 * ib + l]
                g1 = grid[np.int64(b[2 + 8 * ib + 2 * l]) | (((qh >> (2 * l)) & 1) << 8)]
                g2 = grid[np.int64(b[3 + 8 * ib + 2 * l]) | (((qh >> (2 * l + 1)) & 1) << 8)]
                for j in range(4):
                    y[i, 32 * ib + 8 * l + j] = db * f32(g1[j]) * _sgn(s, j)
                    y[i, 32 * ib + 8 * l + 4 + j] = db * f32(g2[j]) * _sgn(s, j + 4)


@njit(**_JIT)
def _dq_iq4_nl(x, y, t, kv):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        for j in range(16):
            y[i, j] = d * f32(kv[b[2 + j] & 15])
            y[i, j + 16] = d * f32(kv[b[2 + j] >> 4])


@njit(**_JIT)
def _dq_iq4_xs(x, y, t, kv):
    for i in range(x.shape[0]):
        b = x[i]
        d = _h(t, b, 0)
        sh = np.int64(b[2]) | (np.int64(b[3]) << 8)
        for ib in range(8):
            ls = (np.int64(b[4 + ib // 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4)
            dl = d * f32(ls - 32)
            for j in range(16):
                q = b[8 + 16 * ib + j]
                y[i, 32 * ib + j] = dl * f32(kv[q & 15])
                y[i, 32 * ib + 16 + j] = dl * f32(kv[q >> 4])


_KERNELS = {
    QType.Q4_0: (_dq_q4_0, ()),
    QType.Q4_1: (_dq_q4_1, ()),
    QType.Q5_0: (_dq_q5_0, ()),
    QType.Q5_1: (_dq_q5_1, ()),
    QType.Q8_0: (_dq_q8_0, ()),
    QType.Q8_1: (_dq_q8_1, ()),
    QType.Q2_0: (_dq_q2_0, ()),
    QType.Q2_K: (_dq_q2_k, ()),
    QType.Q3_K: (_dq_q3_k, ()),
    QType.Q4_K: (_dq_q4_k, ()),
    QType.Q5_K: (_dq_q5_k, ()),
    QType.Q6_K: (_dq_q6_k, ()),
    QType.Q8_K: (_dq_q8_k, ()),
    QType.IQ2_XXS: (_dq_iq2_xxs, (IQ2XXS_GRID, KSIGNS)),
    QType.IQ2_XS: (_dq_iq2_xs, (IQ2XS_GRID, KSIGNS)),
    QType.IQ2_S: (_dq_iq2_s, (IQ2S_GRID,)),
    QType.IQ3_XXS: (_dq_iq3_xxs, (IQ3XXS_GRID, KSIGNS)),
    QType.IQ3_S: (_dq_iq3_s, (IQ3S_GRID,)),
    QType.IQ4_NL: (_dq_iq4_nl, (KVALUES_IQ4NL,)),
    QType.IQ4_XS: (_dq_iq4_xs, (KVALUES_IQ4NL,)),
}


def dequant_blocks_into(blocks: np.ndarray, qt: QType, out: np.ndarray) -> None:
    """blocks: uint8 (nb, type_size) C-contiguous -> out: float32 (nb, block_size). Releases the GIL."""
    fn, tables = _KERNELS[qt]
    fn(blocks, out, F16_TO_F32, *tables)


def _as_bytes(raw: np.ndarray, qt: QType) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raw = np.ascontiguousarray(raw).view(np.uint8)
    return raw if raw.ndim else raw.reshape(1)


def dequantize(raw: np.ndarray, qt: int, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Tensor bytes (uint8, last axis = bytes of a row, or 1-D) -> float32 with last axis = elements.

    F32/F16/BF16 also accept the typed array (float32 / float16 / uint16 bf16 bits). `shape` (numpy order,
    last axis = row length) reshapes the result, e.g. to undo a 1-D byte view.
    """
    qt = qtype(qt)
    if qt in FLOAT_TYPES:
        out = _dequant_float(raw, qt)
    else:
        if qt not in _KERNELS:
            raise NotImplementedError(f"dequantize: no kernel for {qt.name}")
        raw = _as_bytes(raw, qt)
        ts, bs = type_size(qt), block_size(qt)
        if raw.shape[-1] % ts:
            raise ValueError(f"{qt.name}: {raw.shape[-1]} bytes per row is not a whole number of {ts}-byte blocks")
        blocks = readonly(np.ascontiguousarray(raw).reshape(-1, ts))
        out = np.empty((blocks.shape[0], bs), np.float32)
        dequant_blocks_into(blocks, qt, out)
        out = out.reshape(*raw.shape[:-1], raw.shape[-1] // ts * bs)
    return out.reshape(shape) if shape is not None else out


def _dequant_float(raw: np.ndarray, qt: QType) -> np.ndarray:
    """A new float32 array, from the typed array or its bytes."""
    raw = np.asarray(raw)
    if qt == QType.F32:
        return (raw if raw.dtype == np.float32 else np.ascontiguousarray(raw).view(np.float32)).copy()
    if qt == QType.F16:
        h = raw if raw.dtype == np.float16 else np.ascontiguousarray(raw).view(np.float16)
        return h.astype(np.float32)
    bits = raw if raw.dtype == np.uint16 else np.ascontiguousarray(raw).view(np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def dequantize_rows(raw2d: np.ndarray, qt: int, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` of a 2-D tensor (uint8 (n_rows, row_bytes), or typed for float types) -> float32 (len(rows), n).

    Only the gathered rows are converted: this is the embedding lookup.
    """
    qt = qtype(qt)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    return dequantize(np.asarray(raw2d)[rows], qt)

