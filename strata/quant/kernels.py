"""Row-range matvec kernels, one per weight format: out[r] = dot(w[r], x) for r0 <= r < r1.

Each works on the weight blocks in place (no dequantized copy) against the activation of activation.py,
with ggml's integer block sums (see ggml-cpu/quants.c *_generic): the formats that carry model weights at
scale (Q8_0, Q4_0, IQ4_NL, Q2_0, Q4_K, Q5_K, Q6_K, IQ4_XS) through the AVX2 intrinsics of simd.py, the others as
plain scalar transcriptions of the generic vec_dot. Float accumulation runs in 8 float32 lanes summed at
the end (as ggml's AVX2 kernels do), so results equal ggml's to float rounding, not bit for bit.

Signature of every quantized kernel: (w uint8 (rows, row_bytes), q int8 (n,), d float32, aux, out float32
(rows,), r0, r1, t (fp16 table), *tables). All release the GIL.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from strata.quant.dequant import le32, q3k_scale
from strata.quant.simd import (dot_iq4_nl, dot_iq4_pair, dot_q2_0_one, dot_q2_0_pair, dot_q2_0_quad, dot_q4_0,
                               dot_q8_0, fhsum, fmadd_i, fmadd_i_pair, fmadd_q2_0_quad, fzero, iadd, izero,
                               q4_k_superblock, q5_k_superblock, q6_k_superblock)

_JIT = dict(nogil=True, cache=True, fastmath=False)
f32 = np.float32


# ---- Q8_0-activation formats (32-element blocks, one fp16 scale) -------------------------------------

@njit(**_JIT)
def mv_q8_0(w, q, d, aux, out, r0, r1, t):
    w16 = w.view(np.uint16)
    for r in range(r0, r1):
        row = w[r]
        acc = fzero()
        for b in range(d.shape[0]):
            acc = fmadd_i(acc, dot_q8_0(row, 34 * b + 2, q, 32 * b), t[w16[r, 17 * b]] * d[b])
        out[r] = fhsum(acc)


@njit(**_JIT)
def mv_q4_0(w, q, d, aux, out, r0, r1, t):
    w16 = w.view(np.uint16)
    for r in range(r0, r1):
        row = w[r]
        acc = fzero()
        for b in range(d.shape[0]):
            acc = fmadd_i(acc, dot_q4_0(row, 18 * b + 2, q, 32 * b), t[w16[r, 9 * b]] * d[b])
        out[r] = fhsum(acc)


@njit(**_JIT)
def mv_iq4_nl(w, q, d, aux, out, r0, r1, t):
    w16 = w.view(np.uint16)
    for r in range(r0, r1):
        row = w[r]
        acc = fzero()
        for b in range(d.shape[0]):
            acc = fmadd_i(acc, dot_iq4_nl(row, 18 * b + 2, q, 32 * b), t[w16[r, 9 * b]] * d[b])
        out[r] = fhsum(acc)


@njit(**_JIT)
def mv_q5_0(w, q, d, aux, out, r0, r1, t):
    for r in range(r0, r1):
        row = w[r]
        sumf = f32(0.0)
        for b in range(d.shape[0]):
            o = 22 * b
            qh = le32(row, o + 2)
            s = 0
            for j in range(16):
                x0 = (np.int64(row[o + 6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16
                x1 = (np.int64(row[o + 6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16
                s += x0 * q[32 * b + j] + x1 * q[32 * b + 16 + j]
            sumf += (t[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)] * d[b]) * f32(s)
        out[r] = sumf


@njit(**_JIT)
def _mv_x_1(w, q, d, s8, out, r0, r1, t, five):
    """Q4_1 (five=False) / Q5_1: sum (dx*dy) * sumi + m * s, s from the Q8_1 activation."""
    bsz = 24 if five else 20
    qo = 8 if five else 4
    for r in range(r0, r1):
        row = w[r]
        sumf = f32(0.0)
        for b in range(d.shape[0]):
            o = bsz * b
            qh = 0
            if five:
                qh = le32(row, o + 4)
            s = 0
            for j in range(16):
                x0 = np.int64(row[o + qo + j] & 15) | (((qh >> j) & 1) << 4)
                x1 = np.int64(row[o + qo + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)
                s += x0 * q[32 * b + j] + x1 * q[32 * b + 16 + j]
            dx = t[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]
            mx = t[np.int64(row[o + 2]) | (np.int64(row[o + 3]) << 8)]
            sumf += (dx * d[b]) * f32(s) + mx * s8[b]
        out[r] = sumf


@njit(**_JIT)
def mv_q4_1(w, q, d, aux, out, r0, r1, t):
    _mv_x_1(w, q, d, aux[0], out, r0, r1, t, False)


@njit(**_JIT)
def mv_q5_1(w, q, d, aux, out, r0, r1, t):
    _mv_x_1(w, q, d, aux[0], out, r0, r1, t, True)


@njit(**_JIT)
def mv_q2_0(w, q, d, aux, out, r0, r1, t):
    """aux = (dv, off): per-lane Q8_0 scales and block sums of activation.py: 8 lanes per group of four
    Q2_0 blocks, then for a remaining pair and a remaining lone block."""
    dv, off = aux
    w16 = w.view(np.uint16)
    nb = w.shape[1] // 18
    nquad = nb // 4
    for r in range(r0, r1):
        row = w[r]
        acc = fzero()
        for p in range(nquad):
            v = dot_q2_0_quad(row, 72 * p, q, 256 * p, off, 8 * p)
            acc = fmadd_q2_0_quad(acc, v, dv, 8 * p, row, 72 * p)
        g = nquad                                  # lane group of the tail
        b = 4 * nquad                              # first tail block
        if nb - b >= 2:
            v = dot_q2_0_pair(row, 18 * b, q, 64 * b, off, 8 * g)
            acc = fmadd_i_pair(acc, v, dv, 8 * g, t[w16[r, 9 * b]], t[w16[r, 9 * b + 9]])
            g += 1
            b += 2
        if nb - b == 1:
            v = dot_q2_0_one(row, 18 * b, q, 64 * b, off, 8 * g)
            dw = t[w16[r, 9 * b]]
            acc = fmadd_i_pair(acc, v, dv, 8 * g, dw, dw)
        out[r] = fhsum(acc)


# ---- Q8_K-activation formats (256-element super-blocks) ------------------------------------------------

@njit(**_JIT)
def mv_q4_k(w, q, d, aux, out, r0, r1, t):
    bsums = aux[0]
    w16 = w.view(np.uint16)
    for r in range(r0, r1):
        row = w[r]
        acc = fzero()
        for i in range(d.shape[0]):
            acc = q4_k_superblock(acc, row, 144 * i, q, 256 * i, bsums, 16 * i,
                                  t[w16[r, 72 * i]] * d[i], t[w16[r, 72 * i + 1]] * d[i])
        out[r] = fhsum(acc)


@njit(**_JIT)
def mv_iq4_xs(w, q, d, aux, out, r0, r1, t):
    w16 = w.view(np.uint16)
    for r in range(r0, r1):
        row = w[r]
        acc = fzero()
        for i in range(d.shape[0]):
            o = 136 * i
            sh = np.int64(w16[r, 68 * i + 1])
            isum = izero()
            for p in range(4):
                sl = np.int64(row[o + 4 + p])
                ls0 = ((sl & 15) | (((sh >> (4 * p)) & 3) << 4)) - 32
                ls1 = ((sl >> 4) | (((sh >> (4 * p + 2)) & 3) << 4)) - 32
                isum = iadd(isum, dot_iq4_pair(row, o + 8 + 32 * p, q, 256 * i + 64 * p, ls0, ls1))
            acc = fmadd_i(acc, isum, t[w16[r, 68 * i]] * d[i])
        out[r] = fhsum(acc)


@njit(**_JIT)
def mv_q2_k(w, q, d, aux, out, r0, r1, t):
    bsums = aux[0]
    for r in range(r0, r1):
        row = w[r]
        sumf = f32(0.0)
        for i in range(d.shape[0]):
            o = 84 * i
            summs = 0
            for j in range(16):
                summs += bsums[16 * i + j] * np.int64(row[o + j] >> 4)
            isum = 0
            for g in range(16):
                q0 = o + 16 + 32 * (g // 8) + 16 * (g % 2)
                sh = 2 * ((g % 8) // 2)
                s = 0
                for l in range(16):
                    s += q[256 * i + 16 * g + l] * np.int64((row[q0 + l] >> sh) & 3)
                isum += np.int64(row[o + g] & 15) * s
            dall = d[i] * t[np.int64(row[o + 80]) | (np.int64(row[o + 81]) << 8)]
            dmin = d[i] * t[np.int64(row[o + 82]) | (np.int64(row[o + 83]) << 8)]
            sumf += dall * f32(isum) - dmin * f32(summs)
        out[r] = sumf


@njit(**_JIT)
def mv_q3_k(w, q, d, aux, out, r0, r1, t):
    for r in range(r0, r1):
        row = w[r]
        sumf = f32(0.0)
        for i in range(d.shape[0]):
            o = 110 * i
            isum = 0
            for g in range(16):
                q0 = o + 32 + 32 * (g // 8) + 16 * (g % 2)
                h0 = o + 16 * (g % 2)
                sh = 2 * ((g % 8) // 2)
                hb = (g % 8) // 2 + 4 * (g // 8)
                s = 0
                for l in range(16):
                    v = np.int64((row[q0 + l] >> sh) & 3) - (0 if (row[h0 + l] >> hb) & 1 else 4)
                    s += q[256 * i + 16 * g + l] * v
                isum += q3k_scale(row[o:o + 110], g) * s
            sumf += (t[np.int64(row[o + 108]) | (np.int64(row[o + 109]) << 8)] * d[i]) * f32(isum)
        out[r] = sumf


@njit(**_JIT)
def mv_q5_k(w, q, d, aux, out, r0, r1, t):
    bsums = aux[0]
    w16 = w.view(np.uint16)
    for r in range(r0, r1):
        row = w[r]
        acc = fzero()
        for i in range(d.shape[0]):
            acc = q5_k_superblock(acc, row, 176 * i, q, 256 * i, bsums, 16 * i,
                                  t[w16[r, 88 * i]] * d[i], t[w16[r, 88 * i + 1]] * d[i])
        out[r] = fhsum(acc)


@njit(**_JIT)
def mv_q6_k(w, q, d, aux, out, r0, r1, t):
    bsums = aux[0]
    w16 = w.view(np.uint16)
    for r in range(r0, r1):
        row = w[r]
        acc = fzero()
        for i in range(d.shape[0]):
            acc = q6_k_superblock(acc, row, 210 * i, q, 256 * i, bsums, 16 * i, t[w16[r, 105 * i + 104]] * d[i])
        out[r] = fhsum(acc)


@njit(**_JIT)
def _sg(s, j):
    return -1 if (s >> j) & 1 else 1


@njit(**_JIT)
def mv_iq2_xxs(w, q, d, aux, out, r0, r1, t, grid, ksigns):
    for r in range(r0, r1):
        row = w[r]
        sumf = f32(0.0)
        for i in range(d.shape[0]):
            o = 66 * i
            bsum = 0
            for ib in range(8):
                a = o + 2 + 8 * ib
                a1 = le32(row, a + 4)
                s = 0
                for l in range(4):
                    g = grid[row[a + l]]
                    sg = ksigns[(a1 >> (7 * l)) & 127]
                    for j in range(8):
                        s += np.int64(g[j]) * q[256 * i + 32 * ib + 8 * l + j] * _sg(sg, j)
                bsum += s * (2 * (a1 >> 28) + 1)
            sumf += (t[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)] * d[i]) * f32(bsum)
        out[r] = f32(0.125) * sumf


@njit(**_JIT)
def mv_iq2_xs(w, q, d, aux, out, r0, r1, t, grid, ksigns):
    for r in range(r0, r1):
        row = w[r]
        sumf = f32(0.0)
        for i in range(d.shape[0]):
            o = 74 * i
            bsum = 0
            for ib in range(8):
                sc = np.int64(row[o + 66 + ib])
                for half in range(2):
                    s = 0
                    for l in range(2 * half, 2 * half + 2):
                        qv = np.int64(row[o + 2 + 8 * ib + 2 * l]) | (np.int64(row[o + 3 + 8 * ib + 2 * l]) << 8)
                        g = grid[qv & 511]
                        sg = ksigns[qv >> 9]
                        for j in range(8):
                            s += np.int64(g[j]) * q[256 * i + 32 * ib + 8 * l + j] * _sg(sg, j)
                    bsum += s * (2 * ((sc >> (4 * half)) & 15) + 1)
            sumf += (t[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)] * d[i]) * f32(bsum)
        out[r] = f32(0.125) * sumf


@njit(**_JIT)
def mv_iq2_s(w, q, d, aux, out, r0, r1, t, grid):
    for r in range(r0, r1):
        row = w[r]
        sumf = f32(0.0)
        for i in range(d.shape[0]):
            o = 82 * i
            bsum = 0
            for ib in range(8):
                sc = np.int64(row[o + 74 + ib])
                qh = np.int64(row[o + 66 + ib])
                for half in range(2):
                    s = 0
                    for l in range(2 * half, 2 * half + 2):
                        g = grid[np.int64(row[o + 2 + 4 * ib + l]) | (((qh >> (2 * l)) & 3) << 8)]
                        sg = row[o + 34 + 4 * ib + l]
                        for j in range(8):
                            s += np.int64(g[j]) * q[256 * i + 32 * ib + 8 * l + j] * _sg(sg, j)
                    bsum += s * (2 * ((sc >> (4 * half)) & 15) + 1)
            sumf += (t[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)] * d[i]) * f32(bsum)
        out[r] = f32(0.125) * sumf


@njit(**_JIT)
def mv_iq3_xxs(w, q, d, aux, out, r0, r1, t, grid, ksigns):
    for r in range(r0, r1):
        row = w[r]
        sumf = f32(0.0)
        for i in range(d.shape[0]):
            o = 98 * i
            bsum = 0
            for ib in range(8):
                a = o + 66 + 4 * ib
                a32 = le32(row, a)
                s = 0
                for l in range(4):
                    sg = ksigns[(a32 >> (7 * l)) & 127]
                    g1 = grid[row[o + 2 + 8 * ib + 2 * l]]
                    g2 = grid[row[o + 3 + 8 * ib + 2 * l]]
                    y0 = 256 * i + 32 * ib + 8 * l
                    for j in range(4):
                        s += np.int64(g1[j]) * q[y0 + j] * _sg(sg, j)
                        s += np.int64(g2[j]) * q[y0 + 4 + j] * _sg(sg, j + 4)
                bsum += s * (2 * (a32 >> 28) + 1)
            sumf += (t[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)] * d[i]) * f32(bsum)
        out[r] = f32(0.25) * sumf


@njit(**_JIT)
def mv_iq3_s(w, q, d, aux, out, r0, r1, t, grid):
    for r in range(r0, r1):
        row = w[r]
        sumf = f32(0.0)
        for i in range(d.shape[0]):
            o = 110 * i
            bsum = 0
            for ib in range(8):
                sc = np.int64(row[o + 106 + ib // 2])
                ls = 2 * ((sc >> (4 * (ib % 2))) & 15) + 1
                qh = np.int64(row[o + 66 + ib])
                s = 0
                for l in range(4):
                    sg = row[o + 74 + 4 * ib + l]
                    g1 = grid[np.int64(row[o + 2 + 8 * ib + 2 * l]) | (((qh >> (2 * l)) & 1) << 8)]
                    g2 = grid[np.int64(row[o + 3 + 8 * ib + 2 * l]) | (((qh >> (2 * l + 1)) & 1) << 8)]
                    y0 = 256 * i + 32 * ib + 8 * l
                    for j in range(4):
                        s += np.int64(g1[j]) * q[y0 + j] * _sg(sg, j)
                        s += np.int64(g2[j]) * q[y0 + 4 + j] * _sg(sg, j + 4)
                bsum += s * ls
            sumf += (t[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)] * d[i]) * f32(bsum)
        out[r] = sumf


# ---- float weights: plain products summed in float32 lanes (reassociation lets LLVM vectorize) ---------

_FJIT = dict(nogil=True, cache=True, fastmath={"reassoc", "contract"})


@njit(**_FJIT)
def mv_f32(w, v, out, r0, r1):
    for r in range(r0, r1):
        s = f32(0.0)
        for j in range(v.shape[0]):
            s += w[r, j] * v[j]
        out[r] = s


@njit(**_FJIT)
def mv_f16(w, v, out, r0, r1, t):
    """w: uint16 fp16 bits (rows, n); v: x rounded to fp16, as float32."""
    for r in range(r0, r1):
        s = f32(0.0)
        for j in range(v.shape[0]):
            s += t[w[r, j]] * v[j]
        out[r] = s


@njit(**_FJIT)
def mv_bf16(w, v, out, r0, r1):
    """w: uint16 bf16 bits (rows, n); v: x rounded to bf16, as float32."""
    tmp = np.empty(v.shape[0], np.uint32)
    wf = tmp.view(np.float32)
    for r in range(r0, r1):
        for j in range(v.shape[0]):
            tmp[j] = np.uint32(w[r, j]) << 16
        s = f32(0.0)
        for j in range(v.shape[0]):
            s += wf[j] * v[j]
        out[r] = s


@njit(nogil=True, cache=True, fastmath=False)
def dot_rows_f64(wf, x, out, r0):
    """Exact mode: out[r0 + i] = sum_j f64(wf[i, j]) * f64(x[j]), in order."""
    for i in range(wf.shape[0]):
        s = 0.0
        for j in range(x.shape[0]):
            s += np.float64(wf[i, j]) * np.float64(x[j])
        out[r0 + i] = s
