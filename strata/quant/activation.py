"""The activation side of a matvec: x quantized once, the way llama.cpp's CPU backend does before vec_dot.

Which format x is converted to is ACT_TYPE[weight type] (ggml's vec_dot_type). The conversions follow the
x86 build of ggml-cpu:
  Q8_0, Q8_1  quantize_row_q8_0 / _q8_1 (AVX2): d = amax/127 stored as fp16, q = round-half-even(x * 127/amax)
              (the id is 127/amax, not 1/fp16(d)); Q8_1 adds s = fp16(d_f32 * sum q).
  Q8_K        quantize_row_q8_K_ref (x86 uses the reference): max = signed value of largest |x|,
              q = nearest_int(-127/max * x) capped at 127, d = 1/iscale kept as float32, bsums per 16.
  F16, BF16   round to nearest even (ggml_cpu_fp32_to_fp16 / ggml_compute_fp32_to_bf16).
The integer values are ggml's; only their order in memory is changed, per weight type, to what that
type's SIMD kernel loads (the _layout_* functions). exact=True keeps x in float32 (the f64 reference mode).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from strata.quant.formats import ACT_TYPE, QK_K, QType, block_size, qtype
from strata.quant.half import f16_round
from strata.quant.quantize import bf16_round_bits
from strata.quant.simd import absmax32, perm_iq4_pair, perm_q2_0_one, perm_q2_0_pair, quant32

_JIT = dict(nogil=True, cache=True, fastmath=False)


class Act(NamedTuple):
    """x prepared for weights of type `wt`.

    q: int8 (n,) quantized x, in the order the kernel of `wt` reads; d: float32 scales (per 32 for
    Q8_0/Q8_1, per 256 for Q8_K); aux: per-type extras (Q8_1 sums s as float32, Q8_K bsums as int16,
    Q2_0 per-lane scales/offsets); v: float32 (n,) x as the float types see it (rounded to fp16/bf16),
    or x itself when exact.
    """

    wt: QType
    atype: QType
    exact: bool
    n: int
    q: np.ndarray
    d: np.ndarray
    aux: tuple
    v: np.ndarray


@njit(**_JIT)
def _q8_0(x, q, d, s, sums):
    """x: f32 (n,) -> q int8 (n,), d f32 (n/32,) fp16-rounded, s f32 (n/32,) = fp16(d_f32 * sum q),
    sums int32 (n/32,) = sum q."""
    for b in range(x.shape[0] // 32):
        amax = absmax32(x, 32 * b)
        d[b] = amax / np.float32(127.0)
        idv = np.float32(127.0) / amax if amax != np.float32(0.0) else np.float32(0.0)
        lo, hi = quant32(x, 32 * b, idv, q, 32 * b)
        sums[b] = lo + hi
        s[b] = d[b] * np.float32(lo + hi)
    f16_round(d)
    f16_round(s)


@njit(**_JIT)
def _q8_k(x, q, d, bsums):
    """x: f32 (n,) -> q int8 (n,), d f32 (n/256,), bsums int16 (n/16,) (block_q8_K's int16 sums)."""
    for b in range(x.shape[0] // QK_K):
        o = QK_K * b
        amax = np.float32(0.0)
        for c in range(8):
            amax = max(amax, absmax32(x, o + 32 * c))
        if amax == np.float32(0.0):
            d[b] = 0.0
            q[o:o + QK_K] = 0
            bsums[16 * b:16 * b + 16] = 0
            continue
        j = 0
        while j < QK_K - 1 and abs(x[o + j]) != amax:   # the first element of largest |x| sets the sign
            j += 1
        iscale = np.float32(-127.0) / x[o + j]
        for c in range(8):
            bsums[16 * b + 2 * c], bsums[16 * b + 2 * c + 1] = quant32(x, o + 32 * c, iscale, q, o + 32 * c)
        d[b] = np.float32(1.0) / iscale


@njit(**_JIT)
def _layout_q2_0(q, d, sums, qp, dv, off):
    """Q8_0 activation -> what mv_q2_0 reads: qp int8 (n,); dv f32 / off i32, 8 lanes per group.

    qp: per pair of Q2_0 blocks a, b, for shift s, a's q[4k+s] (k < 16) then b's; a lone last block, per
    s, q[4k+s]. Lane groups: one per four blocks a, b, c, d holding Q8_0 blocks (a.lo, a.hi, c.lo, c.hi,
    b.lo, b.hi, d.lo, d.hi) with their sums; then a remaining pair (a.lo, a.lo, a.hi, a.hi, b.lo, b.lo,
    b.hi, b.hi) and a lone block (lo, lo, hi, hi, lo, lo, hi, hi), each block's sum in one lane only.
    """
    nb = q.shape[0] // 64
    for p in range((nb + 1) // 2):
        if 2 * p + 1 < nb:
            perm_q2_0_pair(q, 128 * p, qp, 128 * p)
        else:
            perm_q2_0_one(q, 128 * p, qp, 128 * p)
    g = 0
    for p4 in range(nb // 4):
        for lane in range(8):
            blk = 8 * p4 + (0, 1, 4, 5, 2, 3, 6, 7)[lane]
            dv[8 * g + lane] = d[blk]
            off[8 * g + lane] = sums[blk]
        g += 1
    b = 4 * (nb // 4)
    if nb - b >= 2:
        for lane in range(8):
            blk = 2 * b + lane // 2
            dv[8 * g + lane] = d[blk]
            off[8 * g + lane] = sums[blk] if lane % 2 == 0 else 0
        g += 1
        b += 2
    if nb - b == 1:
        for lane in range(8):
            blk = 2 * b + (lane // 2) % 2
            dv[8 * g + lane] = d[blk]
            off[8 * g + lane] = sums[blk] if lane % 2 == 0 and lane < 4 else 0


@njit(**_JIT)
def _layout_iq4_xs(q, qp):
    """Q8_K activation -> dot_iq4_pair's order: per 64, (s0[0:16], s1[0:16], s0[16:32], s1[16:32])."""
    for p in range(q.shape[0] // 64):
        perm_iq4_pair(q, 64 * p, qp, 64 * p)


@njit(**_JIT)
def _q2_0_act(x, q, d, s, sums, qp, dv, off):
    _q8_0(x, q, d, s, sums)
    _layout_q2_0(q, d, sums, qp, dv, off)


@njit(**_JIT)
def _iq4_xs_act(x, q, d, bsums, qp):
    _q8_k(x, q, d, bsums)
    _layout_iq4_xs(q, qp)


def _order(wt: QType, n: int) -> np.ndarray:
    """Position p of a permuted activation holds x[order[p]] (the layouts above, restated with numpy)."""
    idx = np.arange(n, dtype=np.int64)
    if wt == QType.IQ4_XS:
        return idx.reshape(-1, 2, 2, 16).transpose(0, 2, 1, 3).reshape(-1)
    nb = n // 64
    parts = [idx[128 * p:128 * p + 128].reshape(2, 16, 4).transpose(2, 0, 1).reshape(-1) for p in range(nb // 2)]
    if nb % 2:
        parts.append(idx[n - 64:].reshape(16, 4).T.reshape(-1))
    return np.concatenate(parts)


def activation_values(act: Act) -> np.ndarray:
    """The activation as the kernels see it, in x's order, as float64: q * d for the quantized types."""
    if act.atype in (QType.F32, QType.F16, QType.BF16):
        return act.v.astype(np.float64)
    q = act.q
    if act.wt in (QType.Q2_0, QType.IQ4_XS):
        q = np.empty_like(act.q)
        q[_order(act.wt, act.n)] = act.q
    per = QK_K if act.atype == QType.Q8_K else 32
    return q.astype(np.float64) * np.repeat(act.d.astype(np.float64), per)


def prepare_activation(x: np.ndarray, wt: int, exact: bool = False) -> Act:
    """Quantize x (float32 (n,)) once for weights of type `wt` (see the module doc); exact keeps float32."""
    wt = qtype(wt)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    n = x.shape[0]
    if n % block_size(wt):
        raise ValueError(f"activation length {n} is not a multiple of the {wt.name} block size {block_size(wt)}")
    at = QType.F32 if exact else ACT_TYPE[wt]
    if at in (QType.F32, QType.F16, QType.BF16):
        v = x
        if at == QType.F16:
            v = x.astype(np.float16).astype(np.float32)
        elif at == QType.BF16:
            v = (bf16_round_bits(x).astype(np.uint32) << 16).view(np.float32)
        return Act(wt, at, exact, n, _NO_Q, _NO_D, (), v)
    q = np.empty(n, np.int8)
    if at == QType.Q8_K:
        d = np.empty(n // QK_K, np.float32)
        bsums = np.empty(n // 16, np.int16)
        aux = (bsums,)
        if wt == QType.IQ4_XS:
            qp = np.empty(n, np.int8)
            _iq4_xs_act(x, q, d, bsums, qp)
            q = qp
        else:
            _q8_k(x, q, d, bsums)
    else:
        d = np.empty(n // 32, np.float32)
        s = np.empty(n // 32, np.float32)
        sums = np.empty(n // 32, np.int32)
        aux = (s,) if at == QType.Q8_1 else ()
        if wt == QType.Q2_0:
            nb = n // 64
            groups = nb // 4 + (nb % 4) // 2 + nb % 2
            qp = np.empty(n, np.int8)
            dv = np.empty(8 * groups, np.float32)
            off = np.empty(8 * groups, np.int32)
            _q2_0_act(x, q, d, s, sums, qp, dv, off)
            q, aux = qp, (dv, off)
        else:
            _q8_0(x, q, d, s, sums)
    return Act(wt, at, False, n, q, d, aux, x)


_NO_Q = np.empty(0, np.int8)
_NO_D = np.empty(0, np.float32)
