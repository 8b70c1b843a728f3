"""float32 -> block formats.

F16, BF16, Q8_0, Q4_0 and Q5_0 repeat gguf-py's vectorized quantizers operation for operation, so their
bytes equal `gguf.quants.quantize`'s. Q2_0 is ggml's quantize_row_q2_0_ref (gguf has no Q2_0). Q4_K,
Q5_K, Q6_K, IQ4_NL and IQ4_XS are numba transcriptions of ggml's reference quantizers without importance
weights (quantize_row_q4_K_ref, quantize_row_q5_K_ref, quantize_row_q6_K_ref, quantize_iq4_nl /
quantize_iq4_xs with quant_weights = NULL, i.e. llama-quantize without an imatrix, ntry = 7).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from strata.quant.formats import KVALUES_IQ4NL, QK_K, QType, block_size, qtype, row_bytes
from strata.quant.half import f16_decode, f16_encode

_JIT = dict(nogil=True, cache=True, fastmath=False)
f32 = np.float32
_MAGIC = f32(12582912.0)


def _roundf(v: np.ndarray) -> np.ndarray:
    """Round half away from zero (C roundf), exactly, as gguf-py's np_roundf."""
    a = np.abs(v)
    fl = np.floor(a)
    return np.sign(v) * (fl + np.floor(2 * (a - fl)))


def bf16_round_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), ggml_compute_fp32_to_bf16: NaN made quiet, else round to nearest even."""
    n = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    n = np.where((n & 0x7FFFFFFF) > 0x7F800000, (n & np.uint32(0xFFFF0000)) | np.uint32(0x00400000), n)
    return ((n.astype(np.uint64) + (0x7FFF + ((n >> 16) & 1))) >> 16).astype(np.uint16)


def _fp16_bytes(d: np.ndarray) -> np.ndarray:
    return d.astype(np.float16).view(np.uint8)


def _q8_0(b: np.ndarray) -> np.ndarray:
    d = np.abs(b).max(axis=1, keepdims=True) / 127
    with np.errstate(divide="ignore"):
        idv = np.where(d == 0, 0, 1 / d)
    qs = _roundf(b * idv).astype(np.int8).view(np.uint8)
    return np.concatenate([_fp16_bytes(d), qs], axis=1)


def _absmax_signed(b: np.ndarray) -> np.ndarray:
    return np.take_along_axis(b, np.abs(b).argmax(axis=-1, keepdims=True), axis=-1)


def _q4_0(b: np.ndarray) -> np.ndarray:
    d = _absmax_signed(b) / -8
    with np.errstate(divide="ignore"):
        idv = np.where(d == 0, 0, 1 / d)
    qs = np.trunc((b * idv) + np.float32(8.5), dtype=np.float32).astype(np.uint8).clip(0, 15)
    qs = qs[:, :16] | (qs[:, 16:] << np.uint8(4))
    return np.concatenate([_fp16_bytes(d), qs], axis=1)


def _q5_0(b: np.ndarray) -> np.ndarray:
    d = _absmax_signed(b) / -16
    with np.errstate(divide="ignore"):
        idv = np.where(d == 0, 0, 1 / d)
    q = np.trunc((b * idv) + np.float32(16.5), dtype=np.float32).astype(np.uint8).clip(0, 31)
    qs = (q[:, :16] & np.uint8(0x0F)) | (q[:, 16:] << np.uint8(4))
    qh = np.packbits(q >> np.uint8(4), axis=-1, bitorder="little")
    return np.concatenate([_fp16_bytes(d), qh, qs], axis=1)


def _q2_0(b: np.ndarray) -> np.ndarray:
    d = np.abs(b).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        idv = np.where(d > 0, 1 / d, 0).astype(np.float32)
    q = (np.clip(_roundf(b * idv) + 1, 0, 3).astype(np.uint8)).reshape(-1, 16, 4)
    qs = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return np.concatenate([_fp16_bytes(d), qs.astype(np.uint8)], axis=1)


# ---- numba transcriptions of ggml's reference quantizers -----------------------------------------------

@njit(**_JIT)
def _nearest_int(v):
    return np.int64((f32(v) + _MAGIC) - _MAGIC)


@njit(**_JIT)
def _store_f16(dst, a, b):
    """Write a (and b, if dst has 4 bytes) as fp16 into dst; return both rounded to fp16."""
    v = np.array([a, b], np.float32)
    h = np.empty(2, np.uint16)
    f16_encode(v, h)
    hb = h.view(np.uint8)
    for k in range(dst.shape[0]):
        dst[k] = hb[k]
    f16_decode(h, v)
    return v[0], v[1]


@njit(**_JIT)
def _make_qkx2(x, w, L, Laux, nmax, rmin, rdelta, nstep):
    """make_qkx2_quants(use_mad=false) -> (scale, -min); L gets the codes."""
    n = x.shape[0]
    mn = x[0]
    mx = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        mn = min(mn, x[i])
        mx = max(mx, x[i])
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > 0:
        mn = f32(0.0)
    if mx == mn:
        L[:] = 0
        return f32(0.0), -mn
    iscale = f32(nmax) / (mx - mn)
    scale = f32(1.0) / iscale
    best_error = f32(0.0)
    for i in range(n):
        L[i] = max(0, min(nmax, _nearest_int(iscale * (x[i] - mn))))
        diff = scale * f32(L[i]) + mn - x[i]
        best_error += w[i] * (diff * diff)
    for st in range(nstep + 1):
        iscale = (rmin + rdelta * f32(st) + f32(nmax)) / (mx - mn)
        sum_l = f32(0.0)
        sum_l2 = f32(0.0)
        sum_xl = f32(0.0)
        for i in range(n):
            li = max(0, min(nmax, _nearest_int(iscale * (x[i] - mn))))
            Laux[i] = li
            fl = f32(li)
            sum_l += w[i] * fl
            sum_l2 += w[i] * fl * fl
            sum_xl += w[i] * fl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = f32(0.0)
                this_scale = sum_xl / sum_l2
            cur = f32(0.0)
            for i in range(n):
                diff = this_scale * f32(Laux[i]) + this_min - x[i]
                cur += w[i] * (diff * diff)
            if cur < best_error:
                L[:] = Laux
                best_error = cur
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(**_JIT)
def _k_scales_codes(xb, yb, L, Laux, w, scales, mins, nmax, rmin, nstep):
    """The Q4_K / Q5_K block body (quantize_row_q4_K_ref / q5_K_ref): 8 sub-blocks of 32, each a (scale, min) by
    make_qkx2, those as 6-bit codes with d, dmin into yb[0:16], then every element's code (0 .. nmax) into L."""
    max_scale = f32(0.0)
    max_min = f32(0.0)
    for j in range(8):
        s2 = f32(0.0)
        for l in range(32):
            s2 += xb[32 * j + l] * xb[32 * j + l]
        av = np.sqrt(s2 / f32(32.0))
        for l in range(32):
            w[l] = av + abs(xb[32 * j + l])
        scales[j], mins[j] = _make_qkx2(xb[32 * j:32 * j + 32], w, L[32 * j:32 * j + 32], Laux, nmax, rmin,
                                        f32(0.1), nstep)
        max_scale = max(max_scale, scales[j])
        max_min = max(max_min, mins[j])
    inv_scale = f32(63.0) / max_scale if max_scale > 0 else f32(0.0)
    inv_min = f32(63.0) / max_min if max_min > 0 else f32(0.0)
    for j in range(8):
        ls = min(63, _nearest_int(inv_scale * scales[j]) & 255)
        lm = min(63, _nearest_int(inv_min * mins[j]) & 255)
        if j < 4:
            yb[4 + j] = ls
            yb[8 + j] = lm
        else:
            yb[8 + j] = (ls & 15) | ((lm & 15) << 4)
            yb[j] |= (ls >> 4) << 6
            yb[4 + j] |= (lm >> 4) << 6
    d, dmin = _store_f16(yb[0:4], max_scale / f32(63.0), max_min / f32(63.0))
    for j in range(8):
        if j < 4:
            sc = yb[4 + j] & 63
            m = yb[8 + j] & 63
        else:
            sc = (yb[8 + j] & 15) | ((yb[j] >> 6) << 4)
            m = (yb[8 + j] >> 4) | ((yb[4 + j] >> 6) << 4)
        dl = d * f32(sc)
        if dl == 0:
            continue
        dm = dmin * f32(m)
        for l in range(32):
            L[32 * j + l] = max(0, min(nmax, _nearest_int((xb[32 * j + l] + dm) / dl)))


@njit(**_JIT)
def _k_scratch():
    """_k_scales_codes' work arrays for one block, allocated once per call of a quantizer: L, Laux, w, scales,
    mins."""
    return (np.empty(QK_K, np.int64), np.empty(32, np.int64), np.empty(32, np.float32), np.empty(8, np.float32),
            np.empty(8, np.float32))


@njit(**_JIT)
def _q4_k(x, y):
    """x: f32 (nb, 256) -> y: uint8 (nb, 144)."""
    L, Laux, w, scales, mins = _k_scratch()
    for i in range(x.shape[0]):
        y[i, :] = 0
        _k_scales_codes(x[i], y[i], L, Laux, w, scales, mins, 15, f32(-1.0), 20)
        for c in range(4):
            for l in range(32):
                y[i, 16 + 32 * c + l] = L[64 * c + l] | (L[64 * c + 32 + l] << 4)


@njit(**_JIT)
def _q5_k(x, y):
    """x: f32 (nb, 256) -> y: uint8 (nb, 176): quantize_row_q5_K_ref, _q4_k's scheme with 5-bit codes."""
    L, Laux, w, scales, mins = _k_scratch()
    for i in range(x.shape[0]):
        y[i, :] = 0
        _k_scales_codes(x[i], y[i], L, Laux, w, scales, mins, 31, f32(-0.5), 15)
        for c in range(4):                           # qh bit 2c (low half) / 2c+1 (high half): the code's bit 4
            for l in range(32):
                lo, hi = L[64 * c + l], L[64 * c + 32 + l]
                if lo > 15:
                    lo -= 16
                    y[i, 16 + l] |= 1 << (2 * c)
                if hi > 15:
                    hi -= 16
                    y[i, 16 + l] |= 2 << (2 * c)
                y[i, 48 + 32 * c + l] = lo | (hi << 4)


@njit(**_JIT)
def _make_qx(x, L, nmax):
    """make_qx_quants(rmse_type=1, qw=NULL) -> scale; L gets codes + nmax."""
    n = x.shape[0]
    mx = f32(0.0)
    amax = f32(0.0)
    for i in range(n):
        if abs(x[i]) > amax:
            amax = abs(x[i])
            mx = x[i]
    if amax < f32(1e-15):
        L[:] = 0
        return f32(0.0)
    iscale = -f32(nmax) / mx
    sumlx = f32(0.0)
    suml2 = f32(0.0)
    for i in range(n):
        li = max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
        L[i] = li + nmax
        w = x[i] * x[i]
        sumlx += w * x[i] * f32(li)
        suml2 += w * f32(li) * f32(li)
    scale = sumlx / suml2 if suml2 != 0 else f32(0.0)
    best = scale * sumlx
    for st in range(-9, 10):
        if st == 0:
            continue
        iscale = -(f32(nmax) + f32(0.1) * f32(st)) / mx
        sumlx = f32(0.0)
        suml2 = f32(0.0)
        for i in range(n):
            li = max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
            w = x[i] * x[i]
            sumlx += w * x[i] * f32(li)
            suml2 += w * f32(li) * f32(li)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(**_JIT)
def _q6_k(x, y):
    """x: f32 (nb, 256) -> y: uint8 (nb, 210)."""
    L = np.empty(QK_K, np.int64)
    scales = np.empty(16, np.float32)
    for i in range(x.shape[0]):
        xb = x[i]
        y[i, :] = 0
        max_scale = f32(0.0)
        max_abs = f32(0.0)
        for ib in range(16):
            scales[ib] = _make_qx(xb[16 * ib:16 * ib + 16], L[16 * ib:16 * ib + 16], 32)
            if abs(scales[ib]) > max_abs:
                max_abs = abs(scales[ib])
                max_scale = scales[ib]
        if max_abs < f32(1e-15):
            continue
        iscale = f32(-128.0) / max_scale
        d, _ = _store_f16(y[i, 208:210], f32(1.0) / iscale, f32(0.0))
        for ib in range(16):
            y[i, 192 + ib] = np.uint8(np.int8(min(127, _nearest_int(iscale * scales[ib]))))
        for j in range(16):
            dl = d * f32(np.int8(y[i, 192 + j]))
            if dl == 0:
                continue
            for l in range(16):
                L[16 * j + l] = max(-32, min(31, _nearest_int(xb[16 * j + l] / dl))) + 32
        for h in range(2):
            for l in range(32):
                e = 128 * h + l
                y[i, 64 * h + l] = (L[e] & 15) | ((L[e + 64] & 15) << 4)
                y[i, 64 * h + 32 + l] = (L[e + 32] & 15) | ((L[e + 96] & 15) << 4)
                y[i, 128 + 32 * h + l] = ((L[e] >> 4) | ((L[e + 32] >> 4) << 2)
                                          | ((L[e + 64] >> 4) << 4) | ((L[e + 96] >> 4) << 6))


@njit(**_JIT)
def _best_index(kv, v):
    """best_index_int8: nearest of the 16 sorted levels (lower one on a tie)."""
    if v <= f32(kv[0]):
        return 0
    if v >= f32(kv[15]):
        return 15
    lo = 0
    hi = 15
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if v < f32(kv[mid]):
            hi = mid
        else:
            lo = mid
    return hi - 1 if v - f32(kv[hi - 1]) < f32(kv[hi]) - v else hi


@njit(**_JIT)
def _iq4_block(xb, kv, L, ntry):
    """The per-32 part of quantize_row_iq4_nl_impl (weight = x^2): best scale d, codes in L."""
    amax = f32(0.0)
    mx = f32(0.0)
    for j in range(32):
        if abs(xb[j]) > amax:
            amax = abs(xb[j])
            mx = xb[j]
    if amax < f32(1e-15):
        L[:] = 0
        return f32(0.0)
    d = -mx / f32(kv[0]) if ntry > 0 else mx / f32(kv[0])
    idv = f32(1.0) / d
    sumqx = f32(0.0)
    sumq2 = f32(0.0)
    for j in range(32):
        li = _best_index(kv, idv * xb[j])
        L[j] = li
        qv = f32(kv[li])
        w = xb[j] * xb[j]
        sumqx += w * qv * xb[j]
        sumq2 += w * qv * qv
    d = sumqx / sumq2 if sumq2 > 0 else f32(0.0)
    best = d * sumqx
    for itry in range(-ntry, ntry + 1):
        idv = (f32(itry) + f32(kv[0])) / mx
        sumqx = f32(0.0)
        sumq2 = f32(0.0)
        for j in range(32):
            qv = f32(kv[_best_index(kv, idv * xb[j])])
            w = xb[j] * xb[j]
            sumqx += w * qv * xb[j]
            sumq2 += w * qv * qv
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@njit(**_JIT)
def _iq4_nl(x, y, kv):
    """x: f32 (nb, 32) -> y: uint8 (nb, 18); a lone 32-block keeps its best scale as fp16."""
    L = np.empty(32, np.int64)
    for i in range(x.shape[0]):
        xb = x[i]
        y[i, :] = 0
        d = _iq4_block(xb, kv, L, 7)
        _store_f16(y[i, 0:2], d, f32(0.0))
        idv = f32(1.0) / d if d != 0 else f32(0.0)
        for j in range(32):
            L[j] = _best_index(kv, idv * xb[j])
        for j in range(16):
            y[i, 2 + j] = L[j] | (L[16 + j] << 4)


@njit(**_JIT)
def _iq4_xs(x, y, kv):
    """x: f32 (nb, 256) -> y: uint8 (nb, 136)."""
    L = np.empty(QK_K, np.int64)
    scales = np.empty(8, np.float32)
    for i in range(x.shape[0]):
        xb = x[i]
        y[i, :] = 0
        max_scale = f32(0.0)
        amax_scale = f32(0.0)
        for ib in range(8):
            scales[ib] = _iq4_block(xb[32 * ib:32 * ib + 32], kv, L[32 * ib:32 * ib + 32], 7)
            if abs(scales[ib]) > amax_scale:
                amax_scale = abs(scales[ib])
                max_scale = scales[ib]
        d = -max_scale / f32(32.0)
        _store_f16(y[i, 0:2], d, f32(0.0))
        idv = f32(1.0) / d if d != 0 else f32(0.0)
        sh = 0
        for ib in range(8):
            li = max(-32, min(31, _nearest_int(idv * scales[ib])))
            dl = d * f32(li)
            idl = f32(1.0) / dl if dl != 0 else f32(0.0)
            for j in range(32):
                L[32 * ib + j] = _best_index(kv, idl * xb[32 * ib + j])
            li += 32
            y[i, 4 + ib // 2] |= (li & 15) << (4 * (ib % 2))
            sh |= (li >> 4) << (2 * ib)
        y[i, 2] = sh & 255
        y[i, 3] = sh >> 8
        for ib in range(8):
            for j in range(16):
                y[i, 8 + 16 * ib + j] = L[32 * ib + j] | (L[32 * ib + 16 + j] << 4)


def _numba(fn, ts, *tables):
    def run(b: np.ndarray) -> np.ndarray:
        out = np.empty((b.shape[0], ts), np.uint8)
        fn(np.ascontiguousarray(b), out, *tables)
        return out
    return run


# block quantizers: float32 (nblocks, block_size) -> uint8 (nblocks, type_size)
_BLOCK_QUANTIZERS = {
    QType.Q8_0: _q8_0,
    QType.Q4_0: _q4_0,
    QType.Q5_0: _q5_0,
    QType.Q2_0: _q2_0,
    QType.Q4_K: _numba(_q4_k, 144),
    QType.Q5_K: _numba(_q5_k, 176),
    QType.Q6_K: _numba(_q6_k, 210),
    QType.IQ4_NL: _numba(_iq4_nl, 18, KVALUES_IQ4NL),
    QType.IQ4_XS: _numba(_iq4_xs, 136, KVALUES_IQ4NL),
}

QUANTIZABLE = (QType.F32, QType.F16, QType.BF16, *_BLOCK_QUANTIZERS)


def quantize(x: np.ndarray, qt: int) -> np.ndarray:
    """float32 (..., n) -> uint8 (..., row_bytes(qt, n)). ValueError for a type without a quantizer here."""
    qt = qtype(qt)
    x = np.asarray(x, dtype=np.float32)
    n = x.shape[-1]
    nbytes = row_bytes(qt, n)
    lead = x.shape[:-1]
    if qt == QType.F32:
        raw = x.copy()
    elif qt == QType.F16:
        raw = x.astype(np.float16)
    elif qt == QType.BF16:
        raw = bf16_round_bits(x)
    elif qt in _BLOCK_QUANTIZERS:
        raw = _BLOCK_QUANTIZERS[qt](x.reshape(-1, block_size(qt)))
    else:
        raise ValueError(f"no quantizer for {qt.name}; available: {', '.join(t.name for t in QUANTIZABLE)}")
    return np.ascontiguousarray(raw).view(np.uint8).reshape(*lead, nbytes)
