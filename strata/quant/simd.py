"""AVX2 building blocks for the quantized matvec kernels, as numba intrinsics.

numba's auto-vectorizer does not turn the per-block int8 dot products of ggml's formats into SIMD (it
widens to int64 and unrolls), so the inner block work is written as LLVM IR with the same AVX2
instructions ggml's x86 kernels use: pmaddubsw (u8 x i8 -> i16 pairs), pmaddwd (i16 -> i32 pairs),
psignb, pshufb. Two register types cross into numba code: F32x8 (a float accumulator) and I32x8 (integer
partial sums); everything else stays inside one intrinsic. No saturation can occur: every caller keeps
|u8 * i8 + u8 * i8| <= 2*128*127 < 32768 (activations are in [-127, 127]).

Each dot_* returns lane sums whose total is exactly ggml's integer block sum; lanes keep blocks that need
different float scales apart, as the docstrings say.

numba's on-disk cache (cache=True) is keyed on the source file of the cached function only: after
editing this file, half.py or the helpers kernels.py takes from dequant.py, delete
strata/quant/__pycache__ or the kernels keep the old code.
"""

from __future__ import annotations

import llvmlite.binding as _llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from strata.quant.formats import KVALUES_IQ4NL

_FEATURES = set(_llvm.get_host_cpu_features().flatten().split(","))
HAS_AVX2 = {"+avx2", "+f16c"} <= _FEATURES      # x86-64-v3; fmadd_q2_0_quad converts fp16 with vcvtph2ps

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_V16I8, _V32I8 = ir.VectorType(_I8, 16), ir.VectorType(_I8, 32)
_V16I16, _V8I32, _V8F32 = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8), ir.VectorType(_F32, 8)


class F32x8Type(types.Type):
    def __init__(self):
        super().__init__(name="F32x8")


class I32x8Type(types.Type):
    def __init__(self):
        super().__init__(name="I32x8")


f32x8 = F32x8Type()
i32x8 = I32x8Type()


@register_model(F32x8Type)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V8F32)


@register_model(I32x8Type)
class _I32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V8I32)


# ---- IR helpers ----------------------------------------------------------------------------------------

def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _ptr(context, builder, aryty, ary, off, offty):
    """Address of element `off` of a 1-D array."""
    data = context.make_array(aryty)(context, builder, value=ary).data
    return builder.gep(data, [context.cast(builder, off, offty, types.intp)])


def _load(builder, ptr, vty, extra=0):
    if extra:
        ptr = builder.gep(ptr, [ir.Constant(ir.IntType(64), extra)])
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=1)


def _splat(builder, val, vty):
    v = builder.insert_element(ir.Constant(vty, None), val, ir.Constant(_I32, 0))
    zeros = ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count)
    return builder.shuffle_vector(v, ir.Constant(vty, None), zeros)


def _concat16(builder, lo, hi):
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))


def _maddubs(builder, u, s):
    return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [u, s])


def _madd(builder, a, b):
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [a, b])


def _sign(builder, a, b):
    return _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [a, b])


def _sdot(builder, w, y):
    """Signed int8 x int8 -> 16 i16 pair sums (ggml's mul_sum_i8_pairs: |w| x sign(y, w))."""
    return _maddubs(builder, _sign(builder, w, w), _sign(builder, y, w))


_KV32 = ir.Constant(_V32I8, [int(v) for v in KVALUES_IQ4NL] * 2)   # pshufb table, once per 128-bit lane
_I64 = ir.IntType(64)


def _ones16():
    return ir.Constant(_V16I16, [1] * 16)


def _i16(builder, context, val, ty):
    return builder.trunc(context.cast(builder, val, ty, types.int64), _I16)


# ---- register ops --------------------------------------------------------------------------------------

@intrinsic
def fzero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_V8F32, None)
    return f32x8(), codegen


@intrinsic
def izero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_V8I32, None)
    return i32x8(), codegen


@intrinsic
def iadd(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])
    return i32x8(i32x8, i32x8), codegen


@intrinsic
def fmadd_i(typingctx, acc, v, s):
    """acc + float(v) * s"""
    def codegen(context, builder, sig, args):
        acc, v, s = args
        s = context.cast(builder, s, sig.args[2], types.float32)
        return builder.fadd(acc, builder.fmul(builder.sitofp(v, _V8F32), _splat(builder, s, _V8F32)))
    return f32x8(f32x8, i32x8, s), codegen


@intrinsic
def fmadd_i_pair(typingctx, acc, v, dv, doff, sa, sb):
    """acc + float(v) * dv[doff:doff+8] * [sa]*4 ++ [sb]*4   (two blocks' weight scales in the two halves)"""
    def codegen(context, builder, sig, args):
        acc, v, dv, doff, sa, sb = args
        d = _load(builder, _ptr(context, builder, sig.args[2], dv, doff, sig.args[3]), _V8F32)
        sa = _splat(builder, context.cast(builder, sa, sig.args[4], types.float32), _V8F32)
        sb = _splat(builder, context.cast(builder, sb, sig.args[5], types.float32), _V8F32)
        s = builder.shuffle_vector(sa, sb, ir.Constant(ir.VectorType(_I32, 8), [0, 1, 2, 3, 12, 13, 14, 15]))
        return builder.fadd(acc, builder.fmul(builder.fmul(builder.sitofp(v, _V8F32), d), s))
    return f32x8(f32x8, i32x8, dv, doff, sa, sb), codegen


@intrinsic
def fhsum(typingctx, acc):
    """Sum of the 8 lanes, pairwise in a fixed order (deterministic)."""
    def codegen(context, builder, sig, args):
        v = args[0]
        for width in (4, 2, 1):
            idx = ir.VectorType(_I32, 8)
            hi = builder.shuffle_vector(v, v, ir.Constant(idx, [width + i if i < width else i for i in range(8)]))
            v = builder.fadd(v, hi)
        return builder.extract_element(v, ir.Constant(_I32, 0))
    return types.float32(f32x8), codegen


# ---- block dot products --------------------------------------------------------------------------------

@intrinsic
def dot_q8_0(typingctx, w, wo, y, yo):
    """sum_j int8(w[wo+j]) * y[yo+j], j < 32"""
    def codegen(context, builder, sig, args):
        w, wo, y, yo = args
        a = _load(builder, _ptr(context, builder, sig.args[0], w, wo, sig.args[1]), _V32I8)
        b = _load(builder, _ptr(context, builder, sig.args[2], y, yo, sig.args[3]), _V32I8)
        return _madd(builder, _sdot(builder, a, b), _ones16())
    return i32x8(w, wo, y, yo), codegen


def _nibbles(builder, context, sig, w, wo):
    """16 bytes at w[wo:] -> <32 x i8>: low nibbles (elements 0..15), then high nibbles (16..31)."""
    q = _load(builder, _ptr(context, builder, sig.args[0], w, wo, sig.args[1]), _V16I8)
    lo = builder.and_(q, ir.Constant(_V16I8, [15] * 16))
    hi = builder.lshr(q, ir.Constant(_V16I8, [4] * 16))
    return _concat16(builder, lo, hi)


@intrinsic
def dot_q4_0(typingctx, w, wo, y, yo):
    """Q4_0 codes at w[wo:wo+16] (nibble - 8) against y[yo:yo+32]."""
    def codegen(context, builder, sig, args):
        w, wo, y, yo = args
        c = builder.sub(_nibbles(builder, context, sig, w, wo), ir.Constant(_V32I8, [8] * 32))
        b = _load(builder, _ptr(context, builder, sig.args[2], y, yo, sig.args[3]), _V32I8)
        return _madd(builder, _sdot(builder, c, b), _ones16())
    return i32x8(w, wo, y, yo), codegen


@intrinsic
def dot_iq4_nl(typingctx, w, wo, y, yo):
    """IQ4_NL codes at w[wo:wo+16] (kvalues_iq4nl[nibble]) against y[yo:yo+32]."""
    def codegen(context, builder, sig, args):
        w, wo, y, yo = args
        c = _call(builder, "llvm.x86.avx2.pshuf.b", _V32I8, [_KV32, _nibbles(builder, context, sig, w, wo)])
        b = _load(builder, _ptr(context, builder, sig.args[2], y, yo, sig.args[3]), _V32I8)
        return _madd(builder, _sdot(builder, c, b), _ones16())
    return i32x8(w, wo, y, yo), codegen


def _q2_codes(builder, v):
    """v: 32 code bytes -> four <32 x i8> vectors of 2-bit codes (shift 0, 2, 4, 6)."""
    m3 = ir.Constant(_V32I8, [3] * 32)
    return [builder.and_(builder.lshr(v, ir.Constant(_V32I8, [2 * s] * 32)) if s else v, m3) for s in range(4)]


@intrinsic
def dot_q2_0_pair(typingctx, w, wo, y, yo, off, oo):
    """Two consecutive Q2_0 blocks at w[wo:wo+36] against 128 permuted activation bytes at y[yo:]
    (for shift s: 16 bytes of block a, then 16 of block b, each y[4k+s]). Lanes: (a.lo, a.lo, a.hi, a.hi,
    b.lo, b.lo, b.hi, b.hi) for the four Q8_0 sub-blocks; off[oo:oo+8] (the Q8_0 block sums, for the -1
    offset of the codes) is subtracted."""
    def codegen(context, builder, sig, args):
        w, wo, y, yo, off, oo = args
        p = _q2_0_pair_sums(builder, context, sig, w, wo, y, yo, 0, 0)
        o = _load(builder, _ptr(context, builder, sig.args[4], off, oo, sig.args[5]), _V8I32)
        return builder.sub(p, o)
    return i32x8(w, wo, y, yo, off, oo), codegen


def _q2_0_pair_sums(builder, context, sig, w, wo, y, yo, wextra, yextra):
    """Pair of Q2_0 blocks at w[wo+wextra:] vs 128 activation bytes at y[yo+yextra:] -> <8 x i32> lane
    pairs (a.lo, a.lo, a.hi, a.hi, b.lo, b.lo, b.hi, b.hi), each pair summing to one Q8_0 sub-block."""
    pw = _ptr(context, builder, sig.args[0], w, wo, sig.args[1])
    v = _concat16(builder, _load(builder, pw, _V16I8, wextra + 2), _load(builder, pw, _V16I8, wextra + 20))
    py = _ptr(context, builder, sig.args[2], y, yo, sig.args[3])
    c = _q2_codes(builder, v)
    p = _maddubs(builder, c[0], _load(builder, py, _V32I8, yextra))
    for s in range(1, 4):
        p = builder.add(p, _maddubs(builder, c[s], _load(builder, py, _V32I8, yextra + 32 * s)))
    return _madd(builder, p, _ones16())


@intrinsic
def dot_q2_0_quad(typingctx, w, wo, y, yo, off, oo):
    """Four consecutive Q2_0 blocks a, b, c, d at w[wo:wo+72] against 256 activation bytes (two pairs in
    dot_q2_0_pair's order). Lanes: the Q8_0 sub-blocks (a.lo, a.hi, c.lo, c.hi, b.lo, b.hi, d.lo, d.hi),
    each minus its block sum off[oo + lane]."""
    def codegen(context, builder, sig, args):
        w, wo, y, yo, off, oo = args
        ab = _q2_0_pair_sums(builder, context, sig, w, wo, y, yo, 0, 0)
        cd = _q2_0_pair_sums(builder, context, sig, w, wo, y, yo, 36, 128)
        h = _call(builder, "llvm.x86.avx2.phadd.d", _V8I32, [ab, cd])
        o = _load(builder, _ptr(context, builder, sig.args[4], off, oo, sig.args[5]), _V8I32)
        return builder.sub(h, o)
    return i32x8(w, wo, y, yo, off, oo), codegen


@intrinsic
def fmadd_q2_0_quad(typingctx, acc, v, dv, doff, w, wo):
    """acc + float(v) * dv[doff:doff+8] * (da, da, dc, dc, db, db, dd, dd), the fp16 scales of the four
    Q2_0 blocks at w[wo:] converted with vcvtph2ps."""
    def codegen(context, builder, sig, args):
        acc, v, dv, doff, w, wo = args
        pw = _ptr(context, builder, sig.args[4], w, wo, sig.args[5])
        h = ir.Constant(ir.VectorType(_I16, 8), None)
        for k in range(4):
            dk = builder.load(builder.bitcast(builder.gep(pw, [ir.Constant(_I64, 18 * k)]), _I16.as_pointer()), align=1)
            h = builder.insert_element(h, dk, ir.Constant(_I32, k))
        f = builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 8)), _V8F32)
        dw = builder.shuffle_vector(f, f, ir.Constant(ir.VectorType(_I32, 8), [0, 0, 2, 2, 1, 1, 3, 3]))
        d = _load(builder, _ptr(context, builder, sig.args[2], dv, doff, sig.args[3]), _V8F32)
        return builder.fadd(acc, builder.fmul(builder.fmul(builder.sitofp(v, _V8F32), d), dw))
    return f32x8(f32x8, i32x8, dv, doff, w, wo), codegen


@intrinsic
def dot_q2_0_one(typingctx, w, wo, y, yo, off, oo):
    """One Q2_0 block at w[wo:wo+18] against 64 permuted activation bytes (16 per shift). Lanes:
    (lo, lo, hi, hi, lo, lo, hi, hi); off[oo:oo+8] is subtracted."""
    def codegen(context, builder, sig, args):
        w, wo, y, yo, off, oo = args
        q = _load(builder, _ptr(context, builder, sig.args[0], w, wo, sig.args[1]), _V16I8, 2)
        m3 = ir.Constant(_V32I8, [3] * 32)
        sh = [builder.lshr(q, ir.Constant(_V16I8, [2 * s] * 16)) if s else q for s in range(4)]
        c01 = builder.and_(_concat16(builder, sh[0], sh[1]), m3)
        c23 = builder.and_(_concat16(builder, sh[2], sh[3]), m3)
        py = _ptr(context, builder, sig.args[2], y, yo, sig.args[3])
        p = builder.add(_maddubs(builder, c01, _load(builder, py, _V32I8)),
                        _maddubs(builder, c23, _load(builder, py, _V32I8, 32)))
        o = _load(builder, _ptr(context, builder, sig.args[4], off, oo, sig.args[5]), _V8I32)
        return builder.sub(_madd(builder, p, _ones16()), o)
    return i32x8(w, wo, y, yo, off, oo), codegen


@intrinsic
def dot_iq4_pair(typingctx, w, wo, y, yo, ls0, ls1):
    """Two IQ4 32-element sub-blocks (16 code bytes each) at w[wo:wo+32], against 64 activation bytes
    permuted as (s0[0:16], s1[0:16], s0[16:32], s1[16:32]): ls0 * dot(s0) + ls1 * dot(s1) (|ls| <= 32)."""
    def codegen(context, builder, sig, args):
        w, wo, y, yo, ls0, ls1 = args
        v = _load(builder, _ptr(context, builder, sig.args[0], w, wo, sig.args[1]), _V32I8)
        m15 = ir.Constant(_V32I8, [15] * 32)
        shuf = "llvm.x86.avx2.pshuf.b"
        lo = _call(builder, shuf, _V32I8, [_KV32, builder.and_(v, m15)])
        hi = _call(builder, shuf, _V32I8, [_KV32, builder.and_(builder.lshr(v, ir.Constant(_V32I8, [4] * 32)), m15)])
        py = _ptr(context, builder, sig.args[2], y, yo, sig.args[3])
        plo = _sdot(builder, lo, _load(builder, py, _V32I8))
        phi = _sdot(builder, hi, _load(builder, py, _V32I8, 32))
        s0 = _splat(builder, _i16(builder, context, ls0, sig.args[4]), _V16I16)
        s1 = _splat(builder, _i16(builder, context, ls1, sig.args[5]), _V16I16)
        s = builder.shuffle_vector(s0, s1, ir.Constant(ir.VectorType(_I32, 16), list(range(8)) + list(range(24, 32))))
        return builder.add(_madd(builder, plo, s), _madd(builder, phi, s))
    return i32x8(w, wo, y, yo, ls0, ls1), codegen


def _u32_at(builder, ptr, off):
    return builder.load(builder.bitcast(builder.gep(ptr, [ir.Constant(_I64, off)]), _I32.as_pointer()), align=1)


def _k_superblock(five: bool, doc: str):
    """The Q4_K (five=False) / Q5_K super-block intrinsic: same scales/mins, Q5_K adds a 5th bit per code."""
    qs0 = 48 if five else 16                                                  # Q5_K: qh[32] precede qs

    @intrinsic
    def superblock(typingctx, acc, w, wo, y, yo, bsums, bo, dd, dm):
        return f32x8(f32x8, w, wo, y, yo, bsums, bo, dd, dm), codegen

    def codegen(context, builder, sig, args):
        acc, w, wo, y, yo, bsums, bo, dd, dm = args
        pw = _ptr(context, builder, sig.args[1], w, wo, sig.args[2])
        u0, u1, u2 = (_u32_at(builder, pw, 4 + 4 * k) for k in range(3))
        c = lambda v: ir.Constant(_I32, v)                                   # noqa: E731
        km1, km2, km3 = c(0x3F3F3F3F), c(0x0F0F0F0F), c(0x03030303)
        def hi2(u):                                                          # ((u >> 6) & kmask3) << 4
            return builder.shl(builder.and_(builder.lshr(u, c(6)), km3), c(4))
        t3 = builder.or_(builder.and_(builder.lshr(u2, c(4)), km2), hi2(u1))
        t2 = builder.and_(u1, km1)
        t1 = builder.or_(builder.and_(u2, km2), hi2(u0))
        t0 = builder.and_(u0, km1)
        v4 = ir.Constant(ir.VectorType(_I32, 4), None)
        for k, t in enumerate((t0, t1, t2, t3)):
            v4 = builder.insert_element(v4, t, c(k))
        sm = builder.zext(builder.bitcast(v4, _V16I8), _V16I16)            # lanes 0-7 scales, 8-15 mins
        # mins: sum_j m_j * (bsums[2j] + bsums[2j+1])
        bs = _load(builder, _ptr(context, builder, sig.args[5], bsums, bo, sig.args[6]), _V16I16)
        ev = builder.shuffle_vector(bs, bs, ir.Constant(ir.VectorType(_I32, 8), list(range(0, 16, 2))))
        od = builder.shuffle_vector(bs, bs, ir.Constant(ir.VectorType(_I32, 8), list(range(1, 16, 2))))
        mins = builder.shuffle_vector(sm, sm, ir.Constant(ir.VectorType(_I32, 8), list(range(8, 16))))
        pm = _call(builder, "llvm.x86.sse2.pmadd.wd", ir.VectorType(_I32, 4), [mins, builder.add(ev, od)])
        pm8 = builder.shuffle_vector(pm, ir.Constant(ir.VectorType(_I32, 4), None),
                                     ir.Constant(ir.VectorType(_I32, 8), [0, 1, 2, 3, 4, 5, 6, 7]))
        dmv = _splat(builder, context.cast(builder, dm, sig.args[8], types.float32), _V8F32)
        acc = builder.fsub(acc, builder.fmul(builder.sitofp(pm8, _V8F32), dmv))
        # scales: 4 chunks of 32 bytes, low nibbles with scale 2j, high with 2j+1
        py = _ptr(context, builder, sig.args[3], y, yo, sig.args[4])
        m15 = ir.Constant(_V32I8, [15] * 32)
        isum = None
        qh = _load(builder, pw, _V32I8, 16) if five else None
        for j in range(4):
            v = _load(builder, pw, _V32I8, qs0 + 32 * j)
            lo = builder.and_(v, m15)
            hi = builder.and_(builder.lshr(v, ir.Constant(_V32I8, [4] * 32)), m15)
            if five:                                                          # bit 2j / 2j+1 of qh -> 16
                for half, sub in ((0, 2 * j), (1, 2 * j + 1)):
                    bit = builder.lshr(qh, ir.Constant(_V32I8, [sub] * 32))
                    b16 = builder.shl(builder.and_(bit, ir.Constant(_V32I8, [1] * 32)), ir.Constant(_V32I8, [4] * 32))
                    if half:
                        hi = builder.or_(hi, b16)
                    else:
                        lo = builder.or_(lo, b16)
            s_lo = builder.shuffle_vector(sm, sm, ir.Constant(ir.VectorType(_I32, 16), [2 * j] * 16))
            s_hi = builder.shuffle_vector(sm, sm, ir.Constant(ir.VectorType(_I32, 16), [2 * j + 1] * 16))
            p = builder.add(_madd(builder, _maddubs(builder, lo, _load(builder, py, _V32I8, 64 * j)), s_lo),
                            _madd(builder, _maddubs(builder, hi, _load(builder, py, _V32I8, 64 * j + 32)), s_hi))
            isum = p if isum is None else builder.add(isum, p)
        ddv = _splat(builder, context.cast(builder, dd, sig.args[7], types.float32), _V8F32)
        return builder.fadd(acc, builder.fmul(builder.sitofp(isum, _V8F32), ddv))

    superblock.__doc__ = doc
    return superblock


q4_k_superblock = _k_superblock(False, """acc + one Q4_K super-block (144 bytes at w[wo:]) against Q8_K qs
    y[yo:yo+256] and bsums[bo:bo+16]: float(sum_j sc_j * dot(q_j, y_j)) * dd - float(sum_j m_j * (bsum_2j +
    bsum_2j+1)) * dm, dd = d * y.d, dm = dmin * y.d; scales/mins unpacked with ggml's utmp trick.""")
q5_k_superblock = _k_superblock(True, """q4_k_superblock for Q5_K (176 bytes): codes gain bit j of qh[32].""")



@intrinsic
def q6_k_superblock(typingctx, acc, w, wo, y, yo, bsums, bo, dd):
    """acc + one Q6_K super-block (210 bytes at w[wo:]) against Q8_K qs y[yo:yo+256] and bsums[bo:bo+16]:
    float(sum_g sc_g * (dot(q_g, y_g) - 32 * bsum_g)) * dd, q_g the unsigned 6-bit codes of 16-group g,
    dd = d * y.d. The -32 offset of the codes goes through the bsums, as in ggml's AVX2 kernel."""
    def codegen(context, builder, sig, args):
        acc, w, wo, y, yo, bsums, bo, dd = args
        pw = _ptr(context, builder, sig.args[1], w, wo, sig.args[2])
        py = _ptr(context, builder, sig.args[3], y, yo, sig.args[4])
        sc = builder.sext(_load(builder, pw, _V16I8, 192), _V16I16)           # 16 int8 group scales
        bs = _load(builder, _ptr(context, builder, sig.args[5], bsums, bo, sig.args[6]), _V16I16)
        m15, m3 = ir.Constant(_V32I8, [15] * 32), ir.Constant(_V32I8, [3] * 32)
        sh = lambda v, n: builder.lshr(v, ir.Constant(_V32I8, [n] * 32)) if n else v   # noqa: E731
        isum = builder.mul(_madd(builder, sc, bs), ir.Constant(_V8I32, [-32] * 8))
        for h in range(2):
            ql0 = _load(builder, pw, _V32I8, 64 * h)
            ql1 = _load(builder, pw, _V32I8, 64 * h + 32)
            qh = _load(builder, pw, _V32I8, 128 + 32 * h)
            for k in range(4):
                lo = builder.and_(sh(ql0 if k % 2 == 0 else ql1, 4 * (k // 2)), m15)
                hi = builder.shl(builder.and_(sh(qh, 2 * k), m3), ir.Constant(_V32I8, [4] * 32))
                p = _maddubs(builder, builder.or_(lo, hi), _load(builder, py, _V32I8, 128 * h + 32 * k))
                g = 8 * h + 2 * k                                          # groups g, g+1 in the two halves
                s = builder.shuffle_vector(sc, sc, ir.Constant(ir.VectorType(_I32, 16), [g] * 8 + [g + 1] * 8))
                isum = builder.add(isum, _madd(builder, p, s))
        ddv = _splat(builder, context.cast(builder, dd, sig.args[7], types.float32), _V8F32)
        return builder.fadd(acc, builder.fmul(builder.sitofp(isum, _V8F32), ddv))
    return f32x8(f32x8, w, wo, y, yo, bsums, bo, dd), codegen

# ---- activation quantization (plain LLVM vector IR, no x86 intrinsics) ---------------------------------

def _fvec_load(context, builder, sig, i, ary, off, n):
    return _load(builder, _ptr(context, builder, sig.args[i], ary, off, sig.args[i + 1]), ir.VectorType(_F32, n))


@intrinsic
def absmax32(typingctx, x, xo):
    """max |x[xo:xo+32]| (float32 bit patterns of |v| order like the values; NaN propagates as NaN)."""
    def codegen(context, builder, sig, args):
        v = _fvec_load(context, builder, sig, 0, args[0], args[1], 32)
        v32 = ir.VectorType(_I32, 32)
        bits = builder.and_(builder.bitcast(v, v32), ir.Constant(v32, [0x7FFFFFFF] * 32))
        return builder.bitcast(_call(builder, "llvm.vector.reduce.umax.v32i32", _I32, [bits]), _F32)
    return types.float32(x, xo), codegen


@intrinsic
def quant32(typingctx, x, xo, scale, q, qo):
    """q[qo:qo+32] = min(127, round-half-even(x[xo:xo+32] * scale)); returns the sums of both 16-halves."""
    def codegen(context, builder, sig, args):
        x, xo, scale, q, qo = args
        v = _fvec_load(context, builder, sig, 0, x, xo, 32)
        s = _splat(builder, context.cast(builder, scale, sig.args[2], types.float32), ir.VectorType(_F32, 32))
        r = _call(builder, "llvm.rint.v32f32", ir.VectorType(_F32, 32), [builder.fmul(v, s)])
        i = builder.fptosi(r, ir.VectorType(_I32, 32))
        lim = ir.Constant(ir.VectorType(_I32, 32), [127] * 32)
        i = builder.select(builder.icmp_signed(">", i, lim), lim, i)
        pq = _ptr(context, builder, sig.args[3], q, qo, sig.args[4])
        builder.store(builder.trunc(i, _V32I8), builder.bitcast(pq, _V32I8.as_pointer()), align=1)
        v16 = ir.VectorType(_I32, 16)
        halves = [_call(builder, "llvm.vector.reduce.add.v16i32", _I32,
                        [builder.shuffle_vector(i, i, ir.Constant(v16, list(range(16 * h, 16 * h + 16))))])
                  for h in range(2)]
        return context.make_tuple(builder, sig.return_type, [builder.sext(h, _I64) for h in halves])
    return types.UniTuple(types.int64, 2)(x, xo, scale, q, qo), codegen


def _permute_intrinsic(mask: list[int], doc: str):
    """An intrinsic (src, so, dst, do) -> None: dst[do + p] = src[so + mask[p]] for a fixed byte mask."""
    n = len(mask)
    vt = ir.VectorType(_I8, n)

    @intrinsic
    def permute(typingctx, src, so, dst, do):
        def codegen(context, builder, sig, args):
            v = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1]), vt)
            p = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), mask))
            pd = _ptr(context, builder, sig.args[2], args[2], args[3], sig.args[3])
            builder.store(p, builder.bitcast(pd, vt.as_pointer()), align=1)
            return context.get_dummy_value()
        return types.none(src, so, dst, do), codegen
    permute.__doc__ = doc
    return permute


# Q2_0 pair of 64-blocks a, b: for shift s, a's x[4k+s] (k < 16), then b's; a lone block: per s, x[4k+s]
perm_q2_0_pair = _permute_intrinsic([64 * b + 4 * k + s for s in range(4) for b in range(2) for k in range(16)],
                                    "Q8_0 values of two Q2_0 blocks in dot_q2_0_pair's order")
perm_q2_0_one = _permute_intrinsic([4 * k + s for s in range(4) for k in range(16)],
                                   "Q8_0 values of one Q2_0 block in dot_q2_0_one's order")
# IQ4_XS pair of 32-sub-blocks: (s0[0:16], s1[0:16], s0[16:32], s1[16:32])
perm_iq4_pair = _permute_intrinsic([32 * sb + 16 * h + j for h in range(2) for sb in range(2) for j in range(16)],
                                   "Q8_K values of two IQ4_XS sub-blocks in dot_iq4_pair's order")
