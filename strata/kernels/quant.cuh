// quant.cuh: ggml block formats decoded in registers, and the warp-cooperative row dot product built on them.
//
// THE F32 PATH (the GPU's correctness contract): a weight is dequantized to float32 in registers exactly as
// strata.quant.dequantize does (w = a*q + b per group), multiplied by the float32 activation and accumulated in
// float32. Nothing is rounded to a lower-precision activation format, so y matches dequantize(W) @ x (float64)
// to float32 accumulation error (~1e-7 relative), not llama.cpp's vec_dot_type rounding. The GEMVs' integer
// path (below: Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, and Q2_0 in the expert kernels) keeps 23 bits of each group of 32
// of x, not llama.cpp's 8: 2-9e-7 relative on the tests' matrices, the f32 path's 1-2e-7.
//
// A block is split into NP "parts" of EPP elements; a lane takes whole parts, so a row of n blocks is n*NP
// independent work items spread over the lanes of a warp (or of several warps, `lanes` below). A part holds G
// groups of EPP/G elements sharing (a, b), and its elements come in runs of 4 consecutive ones, so x is read
// as float4. Integer codes become floats with the magic-number trick (or with 0x4B000000, subtract 2^23 plus
// the code offset): one logic op and one add, exact, and full rate, unlike I2F.
//
// Type ids are ggml's. Float types are uploaded with rows padded to a multiple of 8 elements (zeros), so a
// "block" of 8 always exists; x is read only below n_in.
#pragma once
#include "common.cuh"

#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ4_NL 20
#define T_IQ4_XS 23
#define T_BF16 30
#define T_Q2_0 42

#define MAGIC_F 8388608.0f      // 2^23

// unsigned code u (< 2^23) minus `off`, as float: exact
__device__ __forceinline__ float ucode(u32 u, float off) { return __uint_as_float(0x4B000000u | u) - (MAGIC_F + off); }

// byte k of w as a signed int8, as float: byte ^ 0x80 is v + 128, placed under the exponent by one PRMT
__device__ __forceinline__ float sbyte(u32 w_xor80, int k) {
    return __uint_as_float(__byte_perm(w_xor80, 0x4B000000u, (u32)k | 0x7650u)) - (MAGIC_F + 128.0f);
}

// kvalues_iq4nl (ggml-common.h) as bytes
#define IQ4NL_T0 0xBFAD9881u      // -127 -104 -83 -65  (bytes 0..3)
#define IQ4NL_T1 0xF6EADDCFu      //  -49  -35 -22 -10
#define IQ4NL_T2 0x26190D01u      //    1   13  25  38
#define IQ4NL_T3 0x71594535u      //   53   69  89 113

// the values of 4 nibbles at once: nibble i of `sel` (bits 4i..4i+3) -> byte i, int8
__device__ __forceinline__ u32 iq4nl_lut4(u32 sel) {
    const u32 lo = __byte_perm(IQ4NL_T0, IQ4NL_T1, sel & 0x7777u);
    const u32 hi = __byte_perm(IQ4NL_T2, IQ4NL_T3, sel & 0x7777u);
    return __byte_perm(lo, hi, 0x3210u | ((sel & 0x8888u) >> 1));
}

// the 4 low (hi=0) or high (hi=1) nibbles of the 4 bytes of w, as a 16-bit byte_perm selector
__device__ __forceinline__ u32 nib_sel(u32 w, int hi) {
    if (hi) w >>= 4;
    return (w & 0xFu) | ((w >> 4) & 0xF0u) | ((w >> 8) & 0xF00u) | ((w >> 12) & 0xF000u);
}

// 6-bit (scale, min) j of the 12 packed bytes at s (get_scale_min_k4)
__device__ __forceinline__ void k_scale_min(const u8* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Q4_K / Q5_K part c's two scale groups: a = d * scale, bb = -dmin * min (the block's d, dmin at bytes 0, 2)
__device__ __forceinline__ void k_scales(const u8* b, int c, float* a, float* bb) {
    const float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
#pragma unroll
    for (int s = 0; s < 2; s++) {
        int sc, m;
        k_scale_min(b + 4, 2 * c + s, sc, m);
        a[s] = d * (float)sc;
        bb[s] = -(dmin * (float)m);
    }
}

// ---- the formats: decode(block, part) -> q[EPP], a[G], b[G]; run(part, r) -> element of q[4r] --------------

struct FQ4_0 {   // 32 el, 18 B: d, qs[16]; el j: low nibble of qs[j], el j+16: high nibble; v = (nib - 8) d
    enum { QK = 32, BB = 18, NP = 4, EPP = 8, G = 1, HAS_B = 0 };
    __device__ static void decode(const u8* b, int p, float* q, float* a, float* bb) {
        const u32 w = ld32_a2(b + 2 + 4 * p);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            q[i] = ucode((w >> (8 * i)) & 15u, 8.0f);
            q[4 + i] = ucode((w >> (8 * i + 4)) & 15u, 8.0f);
        }
        a[0] = h2f(ld16(b));
        bb[0] = 0.0f;
    }
    __device__ static int run(int p, int r) { return 4 * p + 16 * r; }
};

struct FIQ4_NL {  // Q4_0's layout, v = kvalues_iq4nl[nib] d
    enum { QK = 32, BB = 18, NP = 4, EPP = 8, G = 1, HAS_B = 0 };
    __device__ static void decode(const u8* b, int p, float* q, float* a, float* bb) {
        const u32 w = ld32_a2(b + 2 + 4 * p);
        const u32 lo = iq4nl_lut4(nib_sel(w, 0)) ^ 0x80808080u, hi = iq4nl_lut4(nib_sel(w, 1)) ^ 0x80808080u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            q[i] = sbyte(lo, i);
            q[4 + i] = sbyte(hi, i);
        }
        a[0] = h2f(ld16(b));
        bb[0] = 0.0f;
    }
    __device__ static int run(int p, int r) { return 4 * p + 16 * r; }
};

struct FQ4_1 {   // 32 el, 20 B: d, m, qs[16]; v = nib d + m
    enum { QK = 32, BB = 20, NP = 4, EPP = 8, G = 1, HAS_B = 1 };
    __device__ static void decode(const u8* b, int p, float* q, float* a, float* bb) {
        const u32 w = *(const u32*)(b + 4 + 4 * p);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            q[i] = ucode((w >> (8 * i)) & 15u, 0.0f);
            q[4 + i] = ucode((w >> (8 * i + 4)) & 15u, 0.0f);
        }
        a[0] = h2f(ld16(b));
        bb[0] = h2f(ld16(b + 2));
    }
    __device__ static int run(int p, int r) { return 4 * p + 16 * r; }
};

struct FQ5_0 {   // 32 el, 22 B: d, qh (u32), qs[16]; v = ((nib | bit << 4) - 16) d
    enum { QK = 32, BB = 22, NP = 4, EPP = 8, G = 1, HAS_B = 0 };
    __device__ static void decode(const u8* b, int p, float* q, float* a, float* bb) {
        const u32 qh = ld32_a2(b + 2);
        const u32 w = ld32_a2(b + 6 + 4 * p);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int j = 4 * p + i;
            q[i] = ucode(((w >> (8 * i)) & 15u) | (((qh >> j) & 1u) << 4), 16.0f);
            q[4 + i] = ucode(((w >> (8 * i + 4)) & 15u) | (((qh >> (j + 16)) & 1u) << 4), 16.0f);
        }
        a[0] = h2f(ld16(b));
        bb[0] = 0.0f;
    }
    __device__ static int run(int p, int r) { return 4 * p + 16 * r; }
};

struct FQ5_1 {   // 32 el, 24 B: d, m, qh (u32), qs[16]; v = (nib | bit << 4) d + m
    enum { QK = 32, BB = 24, NP = 4, EPP = 8, G = 1, HAS_B = 1 };
    __device__ static void decode(const u8* b, int p, float* q, float* a, float* bb) {
        const u32 qh = *(const u32*)(b + 4);
        const u32 w = *(const u32*)(b + 8 + 4 * p);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int j = 4 * p + i;
            q[i] = ucode(((w >> (8 * i)) & 15u) | (((qh >> j) & 1u) << 4), 0.0f);
            q[4 + i] = ucode(((w >> (8 * i + 4)) & 15u) | (((qh >> (j + 16)) & 1u) << 4), 0.0f);
        }
        a[0] = h2f(ld16(b));
        bb[0] = h2f(ld16(b + 2));
    }
    __device__ static int run(int p, int r) { return 4 * p + 16 * r; }
};

struct FQ8_0 {   // 32 el, 34 B: d, qs[32] int8; v = q d
    enum { QK = 32, BB = 34, NP = 4, EPP = 8, G = 1, HAS_B = 0 };
    __device__ static void decode(const u8* b, int p, float* q, float* a, float* bb) {
        const u32 w0 = ld32_a2(b + 2 + 8 * p) ^ 0x80808080u, w1 = ld32_a2(b + 6 + 8 * p) ^ 0x80808080u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            q[i] = sbyte(w0, i);
            q[4 + i] = sbyte(w1, i);
        }
        a[0] = h2f(ld16(b));
        bb[0] = 0.0f;
    }
    __device__ static int run(int p, int r) { return 8 * p + 4 * r; }
};

struct FQ2_0 {   // 64 el, 18 B: d, qs[16]; el j at bits 2(j%4) of byte j/4 (= bits 2j of the LE words); v = (c - 1) d
    enum { QK = 64, BB = 18, NP = 4, EPP = 16, G = 1, HAS_B = 0 };
    __device__ static void decode(const u8* b, int p, float* q, float* a, float* bb) {
        const u32 w = ld32_a2(b + 2 + 4 * p);
#pragma unroll
        for (int k = 0; k < 16; k++) q[k] = ucode((w >> (2 * k)) & 3u, 1.0f);
        a[0] = h2f(ld16(b));
        bb[0] = 0.0f;
    }
    __device__ static int run(int p, int r) { return 16 * p + 4 * r; }
};

struct FQ2_K {   // 256 el, 84 B: scales[16] (4b sc | 4b min), qs[64] at 16, d at 80, dmin at 82; one part per group of 16
    enum { QK = 256, BB = 84, NP = 16, EPP = 16, G = 1, HAS_B = 1 };
    __device__ static void decode(const u8* b, int g, float* q, float* a, float* bb) {
        const int q0 = 16 + 32 * (g >> 3) + 16 * (g & 1), sh = 2 * ((g & 7) >> 1);
        const u32 sc = b[g];
#pragma unroll
        for (int w = 0; w < 4; w++) {
            const u32 v = *(const u32*)(b + q0 + 4 * w);
#pragma unroll
            for (int i = 0; i < 4; i++) q[4 * w + i] = ucode((v >> (8 * i + sh)) & 3u, 0.0f);
        }
        a[0] = h2f(ld16(b + 80)) * (float)(sc & 15u);
        bb[0] = -(h2f(ld16(b + 82)) * (float)(sc >> 4));
    }
    __device__ static int run(int g, int r) { return 16 * g + 4 * r; }
};

struct FQ3_K {   // 256 el, 110 B: hmask[32], qs[64] at 32, scales[12] at 96 (6 bit, -32), d at 108; part = group of 16
    enum { QK = 256, BB = 110, NP = 16, EPP = 16, G = 1, HAS_B = 0 };
    __device__ static void decode(const u8* b, int g, float* q, float* a, float* bb) {
        const int q0 = 32 + 32 * (g >> 3) + 16 * (g & 1), h0 = 16 * (g & 1);
        const int sh = 2 * ((g & 7) >> 1), hb = ((g & 7) >> 1) + 4 * (g >> 3);
#pragma unroll
        for (int w = 0; w < 4; w++) {
            const u32 v = ld32_a2(b + q0 + 4 * w), h = ld32_a2(b + h0 + 4 * w);
#pragma unroll
            for (int i = 0; i < 4; i++)
                q[4 * w + i] = ucode(((v >> (8 * i + sh)) & 3u) | (((h >> (8 * i + hb)) & 1u) << 2), 4.0f);
        }
        const int lo = (b[96 + (g & 7)] >> (4 * (g >> 3))) & 15, hi = (b[104 + (g & 3)] >> (2 * (g >> 2))) & 3;
        a[0] = h2f(ld16(b + 108)) * (float)((lo | (hi << 4)) - 32);
        bb[0] = 0.0f;
    }
    __device__ static int run(int g, int r) { return 16 * g + 4 * r; }
};

struct FQ4_K {   // 256 el, 144 B: d, dmin, scales[12], qs[128] at 16; part (c, half): 16 qs bytes = 2 sub-blocks x 16 el
    enum { QK = 256, BB = 144, NP = 8, EPP = 32, G = 2, HAS_B = 1 };
    __device__ static void decode(const u8* b, int p, float* q, float* a, float* bb) {
        const int c = p >> 1, hh = p & 1;
        const uint4 v = *(const uint4*)(b + 16 + 32 * c + 16 * hh);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; k++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                q[4 * k + i] = ucode((w[k] >> (8 * i)) & 15u, 0.0f);
                q[16 + 4 * k + i] = ucode((w[k] >> (8 * i + 4)) & 15u, 0.0f);
            }
        k_scales(b, c, a, bb);
    }
    __device__ static int run(int p, int r) { return 64 * (p >> 1) + 16 * (p & 1) + 32 * (r >> 2) + 4 * (r & 3); }
};

struct FQ5_K {   // 256 el, 176 B: d, dmin, scales[12], qh[32] at 16, qs[128] at 48; parts as Q4_K, bit s of qh[l] on top
    enum { QK = 256, BB = 176, NP = 8, EPP = 32, G = 2, HAS_B = 1 };
    __device__ static void decode(const u8* b, int p, float* q, float* a, float* bb) {
        const int c = p >> 1, hh = p & 1;
        const uint4 v = *(const uint4*)(b + 48 + 32 * c + 16 * hh);
        const uint4 hv = *(const uint4*)(b + 16 + 16 * hh);
        const u32 w[4] = {v.x, v.y, v.z, v.w}, h[4] = {hv.x, hv.y, hv.z, hv.w};
#pragma unroll
        for (int k = 0; k < 4; k++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u32 hb = h[k] >> (8 * i + 2 * c);
                q[4 * k + i] = ucode(((w[k] >> (8 * i)) & 15u) | ((hb & 1u) << 4), 0.0f);
                q[16 + 4 * k + i] = ucode(((w[k] >> (8 * i + 4)) & 15u) | ((hb & 2u) << 3), 0.0f);
            }
        k_scales(b, c, a, bb);
    }
    __device__ static int run(int p, int r) { return 64 * (p >> 1) + 16 * (p & 1) + 32 * (r >> 2) + 4 * (r & 3); }
};

struct FQ6_K {   // 256 el, 210 B: ql[128], qh[64] at 128, scales[16] int8 at 192, d at 208
    // element 128h + 32k + l: low 4 bits in ql[64h + 32(k%2) + l] >> 4(k/2), high 2 in qh[32h + l] >> 2k.
    // part p: h = p/4, l in [8(p%4), +8), all four k: 4 groups of 8 elements (scale 8h + 2k + l/16).
    enum { QK = 256, BB = 210, NP = 8, EPP = 32, G = 4, HAS_B = 0 };
    __device__ static void decode(const u8* b, int p, float* q, float* a, float* bb) {
        const int h = p >> 2, l0 = 8 * (p & 3);
        const u32 A0 = ld32_a2(b + 64 * h + l0), A1 = ld32_a2(b + 64 * h + l0 + 4);
        const u32 B0 = ld32_a2(b + 64 * h + 32 + l0), B1 = ld32_a2(b + 64 * h + 32 + l0 + 4);
        const u32 H0 = ld32_a2(b + 128 + 32 * h + l0), H1 = ld32_a2(b + 128 + 32 * h + l0 + 4);
        const u32 ql[2][2] = {{A0, A1}, {B0, B1}}, qh[2] = {H0, H1};
#pragma unroll
        for (int k = 0; k < 4; k++)
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const u32 lo = (ql[k & 1][i >> 2] >> (8 * (i & 3) + 4 * (k >> 1))) & 15u;
                const u32 hi = (qh[i >> 2] >> (8 * (i & 3) + 2 * k)) & 3u;
                q[8 * k + i] = ucode(lo | (hi << 4), 32.0f);
            }
        const float d = h2f(ld16(b + 208));
#pragma unroll
        for (int k = 0; k < 4; k++) {
            a[k] = d * (float)(i8)b[192 + 8 * h + 2 * k + (l0 >> 4)];
            bb[k] = 0.0f;
        }
    }
    __device__ static int run(int p, int r) { return 128 * (p >> 2) + 32 * (r >> 1) + 8 * (p & 3) + 4 * (r & 1); }
};

struct FIQ4_XS {  // 256 el, 136 B: d, scales_h (u16), scales_l[4], qs[128] at 8; part = sub-block of 32
    enum { QK = 256, BB = 136, NP = 8, EPP = 32, G = 1, HAS_B = 0 };
    __device__ static void decode(const u8* b, int ib, float* q, float* a, float* bb) {
        const uint2 v0 = *(const uint2*)(b + 8 + 16 * ib), v1 = *(const uint2*)(b + 16 + 16 * ib);
        const u32 w[4] = {v0.x, v0.y, v1.x, v1.y};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 lo = iq4nl_lut4(nib_sel(w[k], 0)) ^ 0x80808080u, hi = iq4nl_lut4(nib_sel(w[k], 1)) ^ 0x80808080u;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                q[4 * k + i] = sbyte(lo, i);
                q[16 + 4 * k + i] = sbyte(hi, i);
            }
        }
        const int sh = ld16(b + 2);
        const int ls = ((b[4 + (ib >> 1)] >> (4 * (ib & 1))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
        a[0] = h2f(ld16(b)) * (float)(ls - 32);
        bb[0] = 0.0f;
    }
    __device__ static int run(int ib, int r) { return 32 * ib + 4 * r; }
};

// ---- one part written out (the embedding lookup) ------------------------------------------------------

// VEC: ob + each run is 16-byte aligned (the GEMM's shared tile), so a run is one 16-byte store
template <class F, bool VEC = false>
__device__ __forceinline__ void part_deq(const u8* blk, int p, float* ob) {
    float q[F::EPP], a[F::G], b[F::G];
    F::decode(blk, p, q, a, b);
    constexpr int RUNS = F::EPP / 4, RPG = RUNS / F::G;
#pragma unroll
    for (int r = 0; r < RUNS; r++) {
        const int g = r / RPG;
        if (VEC) {
            float4 v;
            v.x = a[g] * q[4 * r] + b[g];
            v.y = a[g] * q[4 * r + 1] + b[g];
            v.z = a[g] * q[4 * r + 2] + b[g];
            v.w = a[g] * q[4 * r + 3] + b[g];
            *(float4*)(ob + F::run(p, r)) = v;
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) ob[F::run(p, r) + i] = a[g] * q[4 * r + i] + b[g];
        }
    }
}

// ---- float formats: 8 elements (16 B for F16/BF16, 32 B for F32) per part ----------------------------------

template <int T>
__device__ __forceinline__ void float8(const u8* w, float* v) {
    if (T == T_F32) {
        const float4 a = *(const float4*)w, c = *(const float4*)(w + 16);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = c.x; v[5] = c.y; v[6] = c.z; v[7] = c.w;
    } else {
        const uint4 u = *(const uint4*)w;
        const u32 h[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = T == T_F16 ? h2f((u16)(h[i] & 0xFFFFu)) : bf2f((u16)(h[i] & 0xFFFFu));
            v[2 * i + 1] = T == T_F16 ? h2f((u16)(h[i] >> 16)) : bf2f((u16)(h[i] >> 16));
        }
    }
}

// ---- a row dequantized into out[0, n_in) (the embedding lookup) ------------------------------------------

template <class F>
__device__ __forceinline__ void row_deq_q(const u8* row, float* out, int n_in, int li, int lt) {
    const int nparts = n_in / F::QK * F::NP;
    for (int i = li; i < nparts; i += lt) {
        const int blk = i / F::NP, p = i % F::NP;
        part_deq<F>(row + (size_t)blk * F::BB, p, out + blk * F::QK);
    }
}

template <int T>
__device__ __forceinline__ void row_deq_f(const u8* row, float* out, int n_in, int li, int lt) {
    constexpr int ES = T == T_F32 ? 4 : 2;
    for (int i = li; i < (n_in + 7) >> 3; i += lt) {
        float v[8];
        float8<T>(row + (size_t)i * 8 * ES, v);
        for (int j = 0; j < 8 && 8 * i + j < n_in; j++) out[8 * i + j] = v[j];
    }
}

__device__ __noinline__ void row_deq(int type, const u8* row, float* out, int n_in, int li, int lt) {
    switch (type) {
        case T_F32: row_deq_f<T_F32>(row, out, n_in, li, lt); return;
        case T_F16: row_deq_f<T_F16>(row, out, n_in, li, lt); return;
        case T_BF16: row_deq_f<T_BF16>(row, out, n_in, li, lt); return;
        case T_Q4_0: row_deq_q<FQ4_0>(row, out, n_in, li, lt); return;
        case T_Q4_1: row_deq_q<FQ4_1>(row, out, n_in, li, lt); return;
        case T_Q5_0: row_deq_q<FQ5_0>(row, out, n_in, li, lt); return;
        case T_Q5_1: row_deq_q<FQ5_1>(row, out, n_in, li, lt); return;
        case T_Q8_0: row_deq_q<FQ8_0>(row, out, n_in, li, lt); return;
        case T_Q2_0: row_deq_q<FQ2_0>(row, out, n_in, li, lt); return;
        case T_Q2_K: row_deq_q<FQ2_K>(row, out, n_in, li, lt); return;
        case T_Q3_K: row_deq_q<FQ3_K>(row, out, n_in, li, lt); return;
        case T_Q4_K: row_deq_q<FQ4_K>(row, out, n_in, li, lt); return;
        case T_Q5_K: row_deq_q<FQ5_K>(row, out, n_in, li, lt); return;
        case T_Q6_K: row_deq_q<FQ6_K>(row, out, n_in, li, lt); return;
        case T_IQ4_NL: row_deq_q<FIQ4_NL>(row, out, n_in, li, lt); return;
        case T_IQ4_XS: row_deq_q<FIQ4_XS>(row, out, n_in, li, lt); return;
    }
}


// ==== THE GEMV CORE: weight tiles staged in shared memory, a thread's x reused across up to 4 rows ===========
//
// A CTA of NT threads takes a tile of up to 4 row sets (RR) of G = NT / TPG rows. The tile's bytes come from
// global memory into shared memory as 16-byte asynchronous copies (cp.async: every copy of a thread in flight at
// once, none of them holding registers; from mapped host memory, batches of plain loads), each byte keeping its
// address mod 16 (a block keeps its alignment).
// Thread (g, l) = (tid / TPG, tid % TPG) takes parts l, l + TPG, ... of row g of every row set: it loads the
// part's x (float4 reads, L1) once and applies it to up to 4 rows with independent accumulators. The TPG partial
// sums of a row meet in a fixed order (xor butterfly in a warp, then the warps in order): results are
// deterministic.
//
// x stays in global memory, read through L1: staged into each CTA's shared memory (measured 2026-12-02) it cost
// more than it saved wherever x is long beside the tile (hc down: 40 KB of x a CTA for 21 KB of weights; 5.9 ->
// 7.1 us), the resident CTAs of an SM no longer sharing one L1 copy of it.
//
// Format structs V*: QK, BB, NP (parts per block, a power of 2), EPP (elements per part), G (scale groups per
// part), HAS_B (a b * sum(x) term per group), IS_FLOAT, run(p, r) (block offset of the part's run r of 4
// consecutive elements) and dot(o, p, xv, sx): part p of the block at shared-memory offset o against xv (the
// part's x in run order); sx[G] the x sums per group (HAS_B formats). Integer codes become floats exactly: the
// code's bits under the exponent of 2^23 (one LOP3 or PRMT), then one FADD or FFMA removes 2^23 (and the code
// offset); a code at bit 4j is scaled back by 16^-j inside that FFMA, so no shift is needed.

// The GEMV-core kernels' resident CTAs per SM (__launch_bounds__): registers, not shared memory, set how many fit
// (~107 registers a thread at 2, 80 with spills at 3). ncu (2026-12-02): 25% occupancy at 2, warps stalled on
// latency with none other to issue; yet 3 measured slower over the whole-token graph (8.28 against 8.14 ms) and
// faster on some matrices only (the LM head, ssm_out): bench/GPU_NOTES.md.
#ifndef GEMV_MIN_CTAS
#define GEMV_MIN_CTAS 2
#endif

#define MAGIC_U 0x4B000000u

__device__ __forceinline__ u32 sm_u16(int o) { return *(const u16*)(SMEM + o); }
__device__ __forceinline__ u32 sm_u32(int o) { return *(const u32*)(SMEM + o); }
__device__ __forceinline__ u32 sm_u32_a2(int o) { return sm_u16(o) | (sm_u16(o + 2) << 16); }

// 8 bytes at a 2-aligned shared offset: three aligned words, realigned by PRMT (reads up to 4 bytes past)
__device__ __forceinline__ void sm_u64_a2(int o, u32& w0, u32& w1) {
    const int a = o & ~3;
    const u32 sel = (o & 2) ? 0x5432u : 0x3210u;
    const u32 A0 = sm_u32(a), A1 = sm_u32(a + 4), A2 = sm_u32(a + 8);
    w0 = __byte_perm(A0, A1, sel);
    w1 = __byte_perm(A1, A2, sel);
}

__device__ __forceinline__ float pow2f(int e) { return __uint_as_float((u32)(127 + e) << 23); }

// mg is MAGIC_U passed in a register (a function argument the compiler cannot fold): then the mask is LOP3's
// one immediate and `mg | (w & mask)` is a single instruction.
// the 4-bit code at bits 4j..4j+3 of w (j <= 3) minus off: (2^23 + c 16^j) 16^-j - (2^(23-4j) + off), exact
__device__ __forceinline__ float nib(u32 w, int j, float off, u32 mg) {
    return fmaf(__uint_as_float(mg | (w & (0xFu << (4 * j)))), pow2f(-4 * j), -(pow2f(23 - 4 * j) + off));
}

// the 2-bit code at bits 2j, 2j+1 of w (j <= 7) minus off, exact likewise
__device__ __forceinline__ float crumb(u32 w, int j, float off, u32 mg) {
    return fmaf(__uint_as_float(mg | (w & (3u << (2 * j)))), pow2f(-2 * j), -(pow2f(23 - 2 * j) + off));
}

// byte k of w (unsigned) minus off, exact
__device__ __forceinline__ float ubyte(u32 w, int k, float off) {
    return __uint_as_float(__byte_perm(w, MAGIC_U, (u32)k | 0x7650u)) - (MAGIC_F + off);
}

// kvalues_iq4nl + 128 for the 4 nibbles in bits 0..15 of sel (result byte i <- nibble i)
__device__ __forceinline__ u32 iq4_lut4b(u32 sel) {
    const u32 lo = __byte_perm(0x3F2D1801u, 0x766A5D4Fu, sel & 0x7777u);
    const u32 hi = __byte_perm(0xA6998D81u, 0xF1D9C5B5u, sel & 0x7777u);
    return __byte_perm(lo, hi, 0x3210u | ((sel & 0x8888u) >> 1));
}

// get_scale_min_k4 for j = 2c and 2c + 1 of the 12 packed bytes at shared offset o (4-aligned), without branches:
// the four 6-bit (scale, min) pairs of j < 4 and of j >= 4 are assembled bytewise, c picks one, then the byte.
__device__ __forceinline__ void k_scales2(int o, int c, int& sc0, int& m0, int& sc1, int& m1) {
    const u32 q0 = sm_u32(o), q1 = sm_u32(o + 4), q2 = sm_u32(o + 8);
    const bool hi = c >= 2;
    const u32 SC = hi ? (q2 & 0x0F0F0F0Fu) | ((q0 >> 2) & 0x30303030u) : q0 & 0x3F3F3F3Fu;
    const u32 M = hi ? ((q2 >> 4) & 0x0F0F0F0Fu) | ((q1 >> 2) & 0x30303030u) : q1 & 0x3F3F3F3Fu;
    const int sh = 16 * (c & 1);
    sc0 = (int)((SC >> sh) & 0xFFu);
    sc1 = (int)((SC >> (sh + 8)) & 0xFFu);
    m0 = (int)((M >> sh) & 0xFFu);
    m1 = (int)((M >> (sh + 8)) & 0xFFu);
}

// Q8_0 part p's 16 int8 (block at shared offset o, 2-aligned) as 4 words, element 4k + i in byte i of word k
__device__ __forceinline__ void q8_0_words(int o, int p, u32 (&w)[4]) {
    const int a = o + 2 + 16 * p, a4 = a & ~3;
    const u32 sel = (a & 2) ? 0x5432u : 0x3210u;
    u32 A[5];
#pragma unroll
    for (int k = 0; k < 5; k++) A[k] = sm_u32(a4 + 4 * k);
#pragma unroll
    for (int k = 0; k < 4; k++) w[k] = __byte_perm(A[k], A[k + 1], sel);
}

// Q6_K part p's 32 six-bit codes (0..63, unsigned; block at shared offset o): q[k][t] holds the part's runs 2k + t,
// one code a byte, each LOP assembling 4; the scale d
__device__ __forceinline__ void q6_k_codes(int o, int p, u32 (&q)[4][2], float& d) {
    const int h = p >> 2, l0 = 8 * (p & 3);
    u32 A0, A1, B0, B1, H0, H1;
    sm_u64_a2(o + 64 * h + l0, A0, A1);
    sm_u64_a2(o + 64 * h + 32 + l0, B0, B1);
    sm_u64_a2(o + 128 + 32 * h + l0, H0, H1);
    const u32 ql[2][2] = {{A0, A1}, {B0, B1}}, qh[2] = {H0, H1};
#pragma unroll
    for (int k = 0; k < 4; k++)
#pragma unroll
        for (int t = 0; t < 2; t++)
            q[k][t] = ((ql[k & 1][t] >> (4 * (k >> 1))) & 0x0F0F0F0Fu) | (((qh[t] >> (2 * k)) & 0x03030303u) << 4);
    d = h2f((u16)sm_u16(o + 208));
}

// Q6_K part p's scale of its runs 2k, 2k + 1 (int8)
__device__ __forceinline__ float q6_k_scale(int o, int p, int k) {
    return (float)(i8)SMEM[o + 192 + 8 * (p >> 2) + 2 * k + ((8 * (p & 3)) >> 4)];
}

// Q6_K part p: the sum over its four scale groups k (runs 2k, 2k + 1) of d scale_k f(k, codes of the two runs), the
// frame the f32 and the integer paths share
template <class Fk>
__device__ __forceinline__ float q6_k_part(int o, int p, Fk f) {
    u32 q[4][2];
    float d;
    q6_k_codes(o, p, q, d);
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; k++) acc += (d * q6_k_scale(o, p, k)) * f(k, q[k]);
    return acc;
}

struct VQ2_0 {   // part: the 16 codes of one word (element k at bits 2k); v = (c - 1) d
    enum { QK = 64, BB = 18, NP = 4, EPP = 16, G = 1, HAS_B = 0, IS_FLOAT = 0 };
    __device__ static int run(int p, int r) { return 16 * p + 4 * r; }
    __device__ static float dot(int o, int p, const float* xv, const float*, u32 mg) {
        const u32 w = sm_u32_a2(o + 2 + 4 * p), h = w >> 16;
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            s0 = fmaf(crumb(w, k, 1.0f, mg), xv[k], s0);
            s1 = fmaf(crumb(h, k, 1.0f, mg), xv[8 + k], s1);
        }
        return h2f((u16)sm_u16(o)) * (s0 + s1);
    }
};

struct VQ8_0 {   // part: 16 of the block's 32 int8 (block 34 B, 2-aligned); v = q d
    enum { QK = 32, BB = 34, NP = 2, EPP = 16, G = 1, HAS_B = 0, IS_FLOAT = 0 };
    __device__ static int run(int p, int r) { return 16 * p + 4 * r; }
    __device__ static float dot(int o, int p, const float* xv, const float*, u32 mg) {
        u32 W[4];
        q8_0_words(o, p, W);
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 w = W[k] ^ 0x80808080u;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if (k & 1) s1 = fmaf(ubyte(w, i, 128.0f), xv[4 * k + i], s1);
                else s0 = fmaf(ubyte(w, i, 128.0f), xv[4 * k + i], s0);
            }
        }
        return h2f((u16)sm_u16(o)) * (s0 + s1);
    }
};

struct VQ4_K {   // parts as FQ4_K: 16 qs bytes = low nibbles (group 0) and high nibbles (group 1)
    enum { QK = 256, BB = 144, NP = 8, EPP = 32, G = 2, HAS_B = 1, IS_FLOAT = 0 };
    __device__ static int run(int p, int r) { return FQ4_K::run(p, r); }
    __device__ static float dot(int o, int p, const float* xv, const float* sx, u32 mg) {
        const int c = p >> 1;
        const uint4 v = *(const uint4*)(SMEM + o + 16 + 32 * c + 16 * (p & 1));
        const u32 w[4] = {v.x, v.y, v.z, v.w};
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 a = w[k], b = w[k] >> 16;
            s0 = fmaf(nib(a, 0, 0.0f, mg), xv[4 * k], s0);
            s1 = fmaf(nib(a, 1, 0.0f, mg), xv[16 + 4 * k], s1);
            s0 = fmaf(nib(a, 2, 0.0f, mg), xv[4 * k + 1], s0);
            s1 = fmaf(nib(a, 3, 0.0f, mg), xv[16 + 4 * k + 1], s1);
            s0 = fmaf(nib(b, 0, 0.0f, mg), xv[4 * k + 2], s0);
            s1 = fmaf(nib(b, 1, 0.0f, mg), xv[16 + 4 * k + 2], s1);
            s0 = fmaf(nib(b, 2, 0.0f, mg), xv[4 * k + 3], s0);
            s1 = fmaf(nib(b, 3, 0.0f, mg), xv[16 + 4 * k + 3], s1);
        }
        const float d = h2f((u16)sm_u16(o)), dmin = h2f((u16)sm_u16(o + 2));
        int sc0, m0, sc1, m1;
        k_scales2(o + 4, c, sc0, m0, sc1, m1);
        return ((d * (float)sc0) * s0 + (-(dmin * (float)m0)) * sx[0]) +
               ((d * (float)sc1) * s1 + (-(dmin * (float)m1)) * sx[1]);
    }
};

struct VQ5_K {   // parts as Q4_K; bit 2c (low nibbles) or 2c+1 (high nibbles) of qh[16 half + byte] on top
    enum { QK = 256, BB = 176, NP = 8, EPP = 32, G = 2, HAS_B = 1, IS_FLOAT = 0 };
    __device__ static int run(int p, int r) { return FQ5_K::run(p, r); }
    __device__ static float dot(int o, int p, const float* xv, const float* sx, u32 mg) {
        const int c = p >> 1, hh = p & 1;
        const uint4 v = *(const uint4*)(SMEM + o + 48 + 32 * c + 16 * hh);
        const uint4 hv = *(const uint4*)(SMEM + o + 16 + 16 * hh);
        const u32 w[4] = {v.x, v.y, v.z, v.w}, h[4] = {hv.x, hv.y, hv.z, hv.w};
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 lo = (w[k] & 0x0F0F0F0Fu) | (((h[k] >> (2 * c)) & 0x01010101u) << 4);
            const u32 hi = ((w[k] >> 4) & 0x0F0F0F0Fu) | (((h[k] >> (2 * c + 1)) & 0x01010101u) << 4);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                s0 = fmaf(ubyte(lo, i, 0.0f), xv[4 * k + i], s0);
                s1 = fmaf(ubyte(hi, i, 0.0f), xv[16 + 4 * k + i], s1);
            }
        }
        const float d = h2f((u16)sm_u16(o)), dmin = h2f((u16)sm_u16(o + 2));
        int sc0, m0, sc1, m1;
        k_scales2(o + 4, c, sc0, m0, sc1, m1);
        return ((d * (float)sc0) * s0 + (-(dmin * (float)m0)) * sx[0]) +
               ((d * (float)sc1) * s1 + (-(dmin * (float)m1)) * sx[1]);
    }
};

struct VQ6_K {   // parts as FQ6_K (block 210 B, 2-aligned); 4 bytes of 6-bit codes assembled per LOP, -32
    enum { QK = 256, BB = 210, NP = 8, EPP = 32, G = 4, HAS_B = 0, IS_FLOAT = 0 };
    __device__ static int run(int p, int r) { return FQ6_K::run(p, r); }
    __device__ static float dot(int o, int p, const float* xv, const float*, u32 mg) {
        return q6_k_part(o, p, [&](int k, const u32 (&q)[2]) {
            float s = 0.0f;
#pragma unroll
            for (int t = 0; t < 2; t++)
#pragma unroll
                for (int i = 0; i < 4; i++) s = fmaf(ubyte(q[t], i, 32.0f), xv[8 * k + 4 * t + i], s);
            return s;
        });
    }
};

// IQ4_XS sub-block ib's scale d (ls - 32), block at shared offset o
__device__ __forceinline__ float iq4_xs_scale(int o, int ib) {
    const int sh = (int)sm_u16(o + 2);
    const int ls = ((SMEM[o + 4 + (ib >> 1)] >> (4 * (ib & 1))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
    return h2f((u16)sm_u16(o)) * (float)(ls - 32);
}

struct VIQ4_XS {  // part = sub-block of 32; the table lookups take the nibbles in their natural order
    enum { QK = 256, BB = 136, NP = 8, EPP = 32, G = 1, HAS_B = 0, IS_FLOAT = 0 };
    __device__ static int run(int ib, int r) { return 32 * ib + 4 * r; }
    __device__ static float dot(int o, int ib, const float* xv, const float*, u32) {
        const uint2 v0 = *(const uint2*)(SMEM + o + 8 + 16 * ib), v1 = *(const uint2*)(SMEM + o + 16 + 16 * ib);
        const u32 w[4] = {v0.x, v0.y, v1.x, v1.y};
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            // nibbles of bytes 0, 1 (then 2, 3): low = element 4k+i, high = element 16+4k+i
            const u32 r0 = iq4_lut4b(w[k]), r1 = iq4_lut4b(w[k] >> 16);
            s0 = fmaf(ubyte(r0, 0, 128.0f), xv[4 * k], s0);
            s1 = fmaf(ubyte(r0, 1, 128.0f), xv[16 + 4 * k], s1);
            s0 = fmaf(ubyte(r0, 2, 128.0f), xv[4 * k + 1], s0);
            s1 = fmaf(ubyte(r0, 3, 128.0f), xv[16 + 4 * k + 1], s1);
            s0 = fmaf(ubyte(r1, 0, 128.0f), xv[4 * k + 2], s0);
            s1 = fmaf(ubyte(r1, 1, 128.0f), xv[16 + 4 * k + 2], s1);
            s0 = fmaf(ubyte(r1, 2, 128.0f), xv[4 * k + 3], s0);
            s1 = fmaf(ubyte(r1, 3, 128.0f), xv[16 + 4 * k + 3], s1);
        }
        return iq4_xs_scale(o, ib) * (s0 + s1);
    }
};

template <int T>
struct VF {      // float rows padded to 8 elements: a "block" of 8, one part
    enum { QK = 8, BB = T == T_F32 ? 32 : 16, NP = 1, EPP = 8, G = 1, HAS_B = 0, IS_FLOAT = 1 };
    __device__ static int run(int, int r) { return 4 * r; }
    __device__ static float dot(int o, int, const float* xv, const float*, u32) {
        float v[8];
        float8<T>(SMEM + o, v);
        return (v[0] * xv[0] + v[1] * xv[1] + v[2] * xv[2] + v[3] * xv[3]) +
               (v[4] * xv[4] + v[5] * xv[5] + v[6] * xv[6] + v[7] * xv[7]);
    }
};

template <class F>
struct VW {      // the rarer formats: the block decoder above, reading shared memory
    enum { QK = F::QK, BB = F::BB, NP = F::NP, EPP = F::EPP, G = F::G, HAS_B = F::HAS_B, IS_FLOAT = 0 };
    __device__ static int run(int p, int r) { return F::run(p, r); }
    __device__ static float dot(int o, int p, const float* xv, const float* sx, u32 mg) {
        float q[F::EPP], a[F::G], b[F::G];
        F::decode(SMEM + o, p, q, a, b);
        constexpr int RPG = F::EPP / 4 / F::G;
        float acc = 0.0f;
#pragma unroll
        for (int g = 0; g < F::G; g++) {
            float s = 0.0f;
#pragma unroll
            for (int rr = 0; rr < RPG; rr++) {
                const int r = g * RPG + rr;
                s += q[4 * r] * xv[4 * r] + q[4 * r + 1] * xv[4 * r + 1] + q[4 * r + 2] * xv[4 * r + 2] +
                     q[4 * r + 3] * xv[4 * r + 3];
            }
            acc += F::HAS_B ? a[g] * s + b[g] * sx[g] : a[g] * s;
        }
        return acc;
    }
};

// A thread's rows (up to 4, sharing its x values) go through one format's dot in a loop, not unrolled: a quarter of
// the code. A launch runs each instruction of it only a few times a warp (a tile is 1-3 parts a thread, a CTA 2-3
// tiles), so the GEMV's warps waited on instruction fetch more than on anything else (no_inst: 27% of attn_qkv's
// stall samples unrolled, 8% in the loop). Launched back to back, each matrix alone is 4-21% slower this way (its
// code stays cached and the loop costs instructions); in the token's graph, where every launch follows other
// kernels' code, the all-VRAM token went from 7.13 to 6.88 ms (H100, bench/RESULTS.md "tenth session").

// row q's offset of o0..o3; the rows a thread takes are the first ones (-1 after them)
__device__ __forceinline__ int row_off(int q, int o0, int o1, int o2, int o3) {
    return q == 0 ? o0 : q == 1 ? o1 : q == 2 ? o2 : o3;
}

// a_q += v
__device__ __forceinline__ void row_add(int q, float v, float& a0, float& a1, float& a2, float& a3) {
    if (q == 0) a0 += v;
    else if (q == 1) a1 += v;
    else if (q == 2) a2 += v;
    else a3 += v;
}

// Rows at shared offsets o0..o3 (-1: no row) against x: this thread's share, parts l, l + tpg, ... One call per
// CTA and format (not inlined: the 16 formats would otherwise multiply the kernels' code).
template <class V>
__device__ __noinline__ float4 group_dot(int o0, int o1, int o2, int o3, const float* __restrict__ x, int n_in, int l,
                                         int tpg, u32 mg) {
    const int nparts = V::IS_FLOAT ? (n_in + 7) >> 3 : n_in / V::QK * V::NP;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    for (int i = l; i < nparts; i += tpg) {
        const int blk = i / V::NP, p = i % V::NP;
        const float* xb = x + blk * V::QK;
        float xv[V::EPP], sx[V::G];
        if (V::IS_FLOAT && 8 * blk + 8 > n_in) {
#pragma unroll
            for (int e = 0; e < 8; e++) xv[e] = 8 * blk + e < n_in ? xb[e] : 0.0f;
        } else {
#pragma unroll
            for (int r = 0; r < V::EPP / 4; r++) {
                const float4 t = *(const float4*)(xb + V::run(p, r));
                xv[4 * r] = t.x;
                xv[4 * r + 1] = t.y;
                xv[4 * r + 2] = t.z;
                xv[4 * r + 3] = t.w;
            }
        }
        if (V::HAS_B) {
            constexpr int RPG = V::EPP / 4 / V::G;
#pragma unroll
            for (int g = 0; g < V::G; g++) {
                float s = 0.0f;
#pragma unroll
                for (int rr = 0; rr < RPG; rr++) {
                    const int r = g * RPG + rr;
                    s += (xv[4 * r] + xv[4 * r + 1]) + (xv[4 * r + 2] + xv[4 * r + 3]);
                }
                sx[g] = s;
            }
        }
        const int bo = blk * V::BB;
#pragma unroll 1
        for (int q = 0; q < 4; q++) {
            const int oq = row_off(q, o0, o1, o2, o3);
            if (oq < 0) break;
            row_add(q, V::dot(oq + bo, p, xv, sx, mg), a0, a1, a2, a3);
        }
    }
    float4 r;
    r.x = a0;
    r.y = a1;
    r.z = a2;
    r.w = a3;
    return r;
}

__device__ __forceinline__ float4 dot_rows(int type, int o0, int o1, int o2, int o3, const float* x, int n_in, int l,
                                           int tpg) {
    const u32 mg = MAGIC_U | ((u32)n_in & 0x80000000u);    // MAGIC_U (n_in > 0), but not a compile-time constant
    switch (type) {
        case T_F32: return group_dot<VF<T_F32>>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
        case T_F16: return group_dot<VF<T_F16>>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
        case T_BF16: return group_dot<VF<T_BF16>>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
        case T_Q4_0: return group_dot<VW<FQ4_0>>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
        case T_Q4_1: return group_dot<VW<FQ4_1>>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
        case T_Q5_0: return group_dot<VW<FQ5_0>>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
        case T_Q5_1: return group_dot<VW<FQ5_1>>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
        case T_Q8_0: return group_dot<VQ8_0>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
        case T_Q2_0: return group_dot<VQ2_0>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
        case T_Q2_K: return group_dot<VW<FQ2_K>>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
        case T_Q3_K: return group_dot<VW<FQ3_K>>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
        case T_Q4_K: return group_dot<VQ4_K>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
        case T_Q5_K: return group_dot<VQ5_K>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
        case T_Q6_K: return group_dot<VQ6_K>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
        case T_IQ4_NL: return group_dot<VW<FIQ4_NL>>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
        case T_IQ4_XS: return group_dot<VIQ4_XS>(o0, o1, o2, o3, x, n_in, l, tpg, mg);
    }
    float4 r;                           // an unknown type poisons the output instead of passing silently
    r.x = r.y = r.z = r.w = __int_as_float(0x7fc00000);
    return r;
}

// ---- the integer path (gemv_jobs, moe_gate_up, moe_down): x as three 8-bit limbs of a 23-bit integer, dp4a ----
//
// Decoding a weight to float32 costs 3-5 instructions (extract, convert, FFMA), which left the GEMVs of the 4-bit
// formats bound by the instruction issue rather than by HBM. Here each group of 32 elements of x is scaled by a power
// of two 2^-s that brings its largest |x| under 2^22 and rounded to an integer q (|x - q 2^s| <= 2^(s-1), about
// 2^-23 of the group's largest |x|: a bit more than the 22 the batched step's 3xFP16 GEMM keeps), q = l0 + 2^8 l1
// + 2^16 l2 in signed bytes; the weights' codes are int8 already or after one or two logic ops, and dp4a takes four of
// them against four elements of one limb. A group's three integer sums are exact; they meet in float32 once a
// group (limbs_f), are scaled by the weight group's scale and 2^s and accumulated in float32 as the f32 path does.
// A group whose x holds an inf or NaN gets a NaN scale, so a non-finite input still comes out non-finite.
//
// The limbs live in shared memory after gemv_jobs' tile ring, made once a CTA for each x (xq_prep): L0, L1, L2
// (n_in bytes each), then the groups' 2^s (n_in / 32 floats), then each 16 elements' sum of q (n_in / 16 floats:
// the K-quants' min terms, Q2_0's offset); gemv.py xq_bytes sizes it. The expert kernels (moe.cu) make the same
// after their tile, in the layout their format reads (xq_layout).

__device__ __forceinline__ int dp4a(u32 a, u32 b, int c) {
#ifdef __CUDACC__
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#else
    return emu_dp4a(a, b, c);
#endif
}

// x (n_in floats, n_in % 32 == 0, 16-byte aligned) into the limbs at shared offset xo, by the whole CTA
// (blockDim.x % 32 == 0): each lane takes 4 consecutive elements, 8 lanes a group. `perm`: each 16 elements' limbs
// stored as a 4 x 4 transpose (element 4b + j at byte 4j + b), the order Q2_0's codes come out of a word in (IQ2_0).
// The loads of XQ_BATCH rounds are issued before any is used: one element a lane a round, each round waiting for
// its own load, put an L2 round trip per 32 elements on every CTA's path (the hc reads' x of 10240 elements: 40 of
// them, ~20 us of a 22 us GEMV on the H100, bench/RESULTS.md "ninth session").
#define XQ_BATCH 4
__device__ __noinline__ void xq_prep(const float* __restrict__ x, int n_in, int xo, bool perm = false) {
    u8* L = SMEM + xo;
    float* sc = (float*)(SMEM + xo + 3 * n_in);
    float* sq = sc + n_in / 32;
    const int n4 = n_in >> 2, nt = blockDim.x, lane = threadIdx.x & 31;
    // c0 is the warp's first quad of a batch: uniform over the warp, so every lane reaches the group reductions
    for (int c0 = threadIdx.x & ~31; c0 < n4; c0 += XQ_BATCH * nt) {
        float4 v[XQ_BATCH];
#pragma unroll
        for (int u = 0; u < XQ_BATCH; u++) {
            const int c = c0 + u * nt + lane;
            v[u] = c < n4 ? ((const float4*)x)[c] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < XQ_BATCH; u++) {
            if (c0 + u * nt >= n4) break;
            const int c = c0 + u * nt + lane;                 // quad c: elements 4c .. 4c + 3; past n4 all zero
            const float f[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
            u32 mb = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) mb = max(mb, __float_as_uint(fabsf(f[k])));  // |x| orders as its bits
            mb = lanes_max_u32<8>(mb);                                               // inf, NaN on top
            const int e = (int)(mb >> 23) - 127;                           // the largest |x| in [2^e, 2^(e+1))
            const int s = max(-126, min(e - 21, 100));                     // |v| 2^-s < 2^22: |l2| <= 64
            int t = 0;
            u32 w0 = 0, w1 = 0, w2 = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float a = fabsf(f[k]);
                const int q = (int)rintf((a <= 3.4e38f ? f[k] : 0.0f) * pow2f(-s));
                const int l0 = ((q + 128) & 255) - 128, r = (q - l0) >> 8;
                const int l1 = ((r + 128) & 255) - 128, l2 = (r - l1) >> 8;
                t += q;
                if (perm) {                                    // element 4c + k: k = its i & 3, c & 3 its (i >> 2) & 3
                    const int j = (4 * c & ~15) | (k << 2) | (c & 3);
                    if (c < n4) {
                        L[j] = (u8)l0;
                        L[n_in + j] = (u8)l1;
                        L[2 * n_in + j] = (u8)l2;
                    }
                } else {
                    w0 |= (u32)(l0 & 255) << (8 * k);
                    w1 |= (u32)(l1 & 255) << (8 * k);
                    w2 |= (u32)(l2 & 255) << (8 * k);
                }
            }
            t = lanes_sum<4>(t);
            if (c < n4) {
                if (!perm) {
                    *(u32*)(L + 4 * c) = w0;
                    *(u32*)(L + n_in + 4 * c) = w1;
                    *(u32*)(L + 2 * n_in + 4 * c) = w2;
                }
                if ((lane & 3) == 0) sq[c >> 2] = (float)t;
                if ((lane & 7) == 0) sc[c >> 3] = mb < 0x7F800000u ? pow2f(s) : __int_as_float(0x7fc00000);
            }
        }
    }
}

// a group's three limb sums -> d[0] + 2^8 d[1] + 2^16 d[2] in float32 (rounded at float32's precision, as the
// f32 path's sums are)
__device__ __forceinline__ float limbs_f(const int (&d)[3]) { return fmaf((float)(d[1] + 256 * d[2]), 256.0f, (float)d[0]); }

// d[k] += the dot product of w's four int8 with limb k of run r
template <int N>
__device__ __forceinline__ void dp4a3(u32 w, const u32 (&xl)[3][N], int r, int (&d)[3]) {
#pragma unroll
    for (int k = 0; k < 3; k++) d[k] = dp4a(w, xl[k][r], d[k]);
}

__device__ __forceinline__ float xq_scale(int xo, int n_in, int e) { return *(const float*)(SMEM + xo + 3 * n_in + 4 * (e >> 5)); }
__device__ __forceinline__ float xq_sum16(int xo, int n_in, int e) {
    return *(const float*)(SMEM + xo + 3 * n_in + 4 * (n_in >> 5) + 4 * (e >> 4));
}

// Integer format structs: V's geometry and run(), XV consecutive runs per vector load of the limbs (4: 16 bytes,
// 2: 8 bytes), and dot(o, p, xl, xo, n_in, e0): part p of the block at shared offset o (block element 0 is x
// element e0) against xl[k][r], limb k of the part's run r.
struct IQ8_0 {
    enum { QK = 32, BB = 34, NP = 2, EPP = 16, XV = 4 };
    __device__ static int run(int p, int r) { return VQ8_0::run(p, r); }
    __device__ static float dot(int o, int p, const u32 (&xl)[3][EPP / 4], int xo, int n_in, int e0) {
        u32 w[4];
        q8_0_words(o, p, w);
        int d[3] = {0, 0, 0};
#pragma unroll
        for (int k = 0; k < 4; k++) dp4a3(w[k], xl, k, d);
        return (h2f((u16)sm_u16(o)) * xq_scale(xo, n_in, e0)) * limbs_f(d);
    }
};

// Q4_K and Q5_K: word k of the part holds run k (group 2c, the low nibbles) and run 4 + k (group 2c + 1)
template <bool Q5>
struct IQ45_K {
    enum { QK = 256, BB = Q5 ? 176 : 144, NP = 8, EPP = 32, XV = 4 };
    __device__ static int run(int p, int r) { return FQ4_K::run(p, r); }
    __device__ static float dot(int o, int p, const u32 (&xl)[3][EPP / 4], int xo, int n_in, int e0) {
        const int c = p >> 1, hh = p & 1;
        const uint4 v = *(const uint4*)(SMEM + o + (Q5 ? 48 : 16) + 32 * c + 16 * hh);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
        u32 h[4] = {0u, 0u, 0u, 0u};
        if (Q5) {
            const uint4 hv = *(const uint4*)(SMEM + o + 16 + 16 * hh);
            h[0] = hv.x;
            h[1] = hv.y;
            h[2] = hv.z;
            h[3] = hv.w;
        }
        int a[3] = {0, 0, 0}, b[3] = {0, 0, 0};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 lo = w[k] & 0x0F0F0F0Fu, hi = (w[k] >> 4) & 0x0F0F0F0Fu;
            if (Q5) {
                lo |= ((h[k] >> (2 * c)) & 0x01010101u) << 4;
                hi |= ((h[k] >> (2 * c + 1)) & 0x01010101u) << 4;
            }
            dp4a3(lo, xl, k, a);
            dp4a3(hi, xl, 4 + k, b);
        }
        const float d = h2f((u16)sm_u16(o)), dmin = h2f((u16)sm_u16(o + 2));
        int sc0, m0, sc1, m1;
        k_scales2(o + 4, c, sc0, m0, sc1, m1);
        const int ea = e0 + 64 * c + 16 * hh, eb = ea + 32;
        return xq_scale(xo, n_in, ea) * ((d * (float)sc0) * limbs_f(a) +
                                         (-(dmin * (float)m0)) * xq_sum16(xo, n_in, ea)) +
               xq_scale(xo, n_in, eb) * ((d * (float)sc1) * limbs_f(b) +
                                         (-(dmin * (float)m1)) * xq_sum16(xo, n_in, eb));
    }
};

// Q6_K: the part's k-th pair of runs (2k, 2k + 1) is 8 elements of scale group 2k + (l0 >> 4) of its half; the
// 6-bit codes minus 32 as signed bytes: (q | 0x80) - 0x20 has no borrow out of a byte, ^ 0x80 is then q - 32
struct IQ6_K {
    enum { QK = 256, BB = 210, NP = 8, EPP = 32, XV = 2 };
    __device__ static int run(int p, int r) { return FQ6_K::run(p, r); }
    __device__ static float dot(int o, int p, const u32 (&xl)[3][EPP / 4], int xo, int n_in, int e0) {
        return q6_k_part(o, p, [&](int k, const u32 (&q)[2]) {
            int s[3] = {0, 0, 0};
#pragma unroll
            for (int t = 0; t < 2; t++) dp4a3(((q[t] | 0x80808080u) - 0x20202020u) ^ 0x80808080u, xl, 2 * k + t, s);
            return xq_scale(xo, n_in, e0 + 128 * (p >> 2) + 32 * k) * limbs_f(s);
        });
    }
};

// IQ4_XS: the table gives word k's 8 values in nibble order (run k's element j, run 4 + k's element j, ...): two
// PRMTs put run k's four into one word and run 4 + k's into another
struct IIQ4_XS {
    enum { QK = 256, BB = 136, NP = 8, EPP = 32, XV = 4 };
    __device__ static int run(int ib, int r) { return VIQ4_XS::run(ib, r); }
    __device__ static float dot(int o, int ib, const u32 (&xl)[3][EPP / 4], int xo, int n_in, int e0) {
        const uint2 v0 = *(const uint2*)(SMEM + o + 8 + 16 * ib), v1 = *(const uint2*)(SMEM + o + 16 + 16 * ib);
        const u32 w[4] = {v0.x, v0.y, v1.x, v1.y};
        int d[3] = {0, 0, 0};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 r0 = iq4nl_lut4(w[k]), r1 = iq4nl_lut4(w[k] >> 16);
            dp4a3(__byte_perm(r0, r1, 0x6420u), xl, k, d);          // run k
            dp4a3(__byte_perm(r0, r1, 0x7531u), xl, 4 + k, d);      // run 4 + k
        }
        return (iq4_xs_scale(o, ib) * xq_scale(xo, n_in, e0 + 32 * ib)) * limbs_f(d);
    }
};

// Q2_0: part p is one word of 16 two-bit codes, element k at bits 2k; (w >> 2j) & 0x03030303 holds elements j,
// j + 4, j + 8, j + 12, which is limb word j of the part in xq_prep's permuted layout; v = (c - 1) d, so the part
// is d 2^s (sum c q - sum q), the second sum the part's 16-element sum
struct IQ2_0 {
    enum { QK = 64, BB = 18, NP = 4, EPP = 16, XV = 4 };
    __device__ static int run(int p, int r) { return VQ2_0::run(p, r); }
    __device__ static float dot(int o, int p, const u32 (&xl)[3][EPP / 4], int xo, int n_in, int e0) {
        const u32 w = sm_u32_a2(o + 2 + 4 * p);
        int d[3] = {0, 0, 0};
#pragma unroll
        for (int j = 0; j < 4; j++) dp4a3((w >> (2 * j)) & 0x03030303u, xl, j, d);
        const int e = e0 + 16 * p;
        return (h2f((u16)sm_u16(o)) * xq_scale(xo, n_in, e)) * (limbs_f(d) - xq_sum16(xo, n_in, e));
    }
};

// group_dot's twin on the limbs at shared offset xo
template <class V>
__device__ __noinline__ float4 group_dot_i(int o0, int o1, int o2, int o3, int xo, int n_in, int l, int tpg) {
    const int nparts = n_in / V::QK * V::NP;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    for (int i = l; i < nparts; i += tpg) {
        const int blk = i / V::NP, p = i % V::NP, e0 = blk * V::QK;
        u32 xl[3][V::EPP / 4];
#pragma unroll
        for (int k = 0; k < 3; k++) {
#pragma unroll
            for (int r = 0; r < V::EPP / 4; r += V::XV) {
                const int a = xo + k * n_in + e0 + V::run(p, r);
                if (V::XV == 4) {
                    const uint4 t = *(const uint4*)(SMEM + a);
                    xl[k][r] = t.x;
                    xl[k][r + 1] = t.y;
                    xl[k][r + 2] = t.z;
                    xl[k][r + 3] = t.w;
                } else {
                    const uint2 t = *(const uint2*)(SMEM + a);
                    xl[k][r] = t.x;
                    xl[k][r + 1] = t.y;
                }
            }
        }
        const int bo = blk * V::BB;
#pragma unroll 1
        for (int q = 0; q < 4; q++) {
            const int oq = row_off(q, o0, o1, o2, o3);
            if (oq < 0) break;
            row_add(q, V::dot(oq + bo, p, xl, xo, n_in, e0), a0, a1, a2, a3);
        }
    }
    return make_float4(a0, a1, a2, a3);
}

// GEMV_INT (default 1): gemv_jobs takes these formats on the integer path; 0 builds the f32 path for every format
// (STRATA_KERNEL_DEFINES=GEMV_INT=0, for the same-run comparison in bench/RESULTS.md)
#ifndef GEMV_INT
#define GEMV_INT 1
#endif

// the formats the integer path takes on x's natural layout (gemv.py INT_TYPES); the rest keep the f32 path
__device__ __forceinline__ bool int_type(int type) {
    return GEMV_INT && (type == T_Q8_0 || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K || type == T_IQ4_XS);
}

// the x layout the integer path of `type` reads (gemv.py xq_layout): 0 none (the f32 path), 1 natural, 2 permuted
// in 16s (Q2_0: the expert kernels only)
__device__ __forceinline__ int xq_layout(int type) { return int_type(type) ? 1 : GEMV_INT && type == T_Q2_0 ? 2 : 0; }


__device__ __forceinline__ float4 dot_rows_i(int type, int o0, int o1, int o2, int o3, int xo, int n_in, int l,
                                             int tpg) {
    switch (type) {
        case T_Q8_0: return group_dot_i<IQ8_0>(o0, o1, o2, o3, xo, n_in, l, tpg);
        case T_Q2_0: return group_dot_i<IQ2_0>(o0, o1, o2, o3, xo, n_in, l, tpg);
        case T_Q4_K: return group_dot_i<IQ45_K<false>>(o0, o1, o2, o3, xo, n_in, l, tpg);
        case T_Q5_K: return group_dot_i<IQ45_K<true>>(o0, o1, o2, o3, xo, n_in, l, tpg);
        case T_Q6_K: return group_dot_i<IQ6_K>(o0, o1, o2, o3, xo, n_in, l, tpg);
        case T_IQ4_XS: return group_dot_i<IIQ4_XS>(o0, o1, o2, o3, xo, n_in, l, tpg);
    }
    float4 r;
    r.x = r.y = r.z = r.w = __int_as_float(0x7fc00000);
    return r;
}

// rows o0..o3 against x: the integer path on the limbs at xo when they are in the layout `type` reads (lay, 0:
// none made), else the f32 path
__device__ __forceinline__ float4 dot_rows_x(int type, int lay, int o0, int o1, int o2, int o3, const float* x, int xo,
                                             int n_in, int l, int tpg) {
    return lay != 0 && xq_layout(type) == lay ? dot_rows_i(type, o0, o1, o2, o3, xo, n_in, l, tpg)
                                              : dot_rows(type, o0, o1, o2, o3, x, n_in, l, tpg);
}

// ---- staging: up to 4 byte ranges of global memory into shared memory --------------------------------------

struct Ranges {
    const u8* src[4];   // global start of each range (any alignment)
    int n[4];           // bytes (0: unused)
    int dst[4];         // 16-aligned shared offset of the range's first chunk; src[k] lands at dst[k] + (src[k] & 15)
};

__device__ __forceinline__ int chunks16(const u8* s, int n) {
    if (n <= 0) return 0;
    const unsigned long long a = (unsigned long long)s & ~15ull, b = ((unsigned long long)s + n + 15) & ~15ull;
    return (int)((b - a) >> 4);
}

// shared offset of src[k]'s byte 0, and the 16-aligned end of range k (where the next one may start)
__device__ __forceinline__ int range_off(const Ranges& R, int k) { return R.dst[k] + (int)((unsigned long long)R.src[k] & 15); }
__device__ __forceinline__ int range_end(const Ranges& R, int k) { return R.dst[k] + 16 * chunks16(R.src[k], R.n[k]); }

// ranges 0 and 1 back to back from shared offset `base` (16-aligned; range 1 may be empty: s1 nullptr, n1 0); 2 and
// 3 unused
__device__ __forceinline__ Ranges ranges2(const u8* s0, int n0, const u8* s1, int n1, int base = 0) {
    Ranges R;
    R.src[0] = s0;
    R.n[0] = n0;
    R.dst[0] = base;
    R.src[1] = s1;
    R.n[1] = n1;
    R.dst[1] = range_end(R, 0) + 16;
    R.src[2] = R.src[3] = nullptr;
    R.n[2] = R.n[3] = 0;
    R.dst[2] = R.dst[3] = 0;
    return R;
}


#define STAGE_BATCH 12      // stage from host memory: 16-byte loads in flight per thread (48 KB per 256 threads)

// chunk i of the ranges' 16-byte chunks: its source (16-aligned) and shared offset
__device__ __forceinline__ void range_chunk(const Ranges& R, int p1, int p2, int p3, int i, const u8*& src,
                                            int& dst) {
    const int k = i < p1 ? 0 : i < p2 ? 1 : i < p3 ? 2 : 3;
    const u8* s = k == 0 ? R.src[0] : k == 1 ? R.src[1] : k == 2 ? R.src[2] : R.src[3];
    const int j = i - (k == 0 ? 0 : k == 1 ? p1 : k == 2 ? p2 : p3);
    dst = (k == 0 ? R.dst[0] : k == 1 ? R.dst[1] : k == 2 ? R.dst[2] : R.dst[3]) + 16 * j;
    src = (const u8*)((unsigned long long)s & ~15ull) + 16 * j;
}

// Every range into shared memory: stage_issue starts the copies, stage_wait waits for this thread's own (the
// caller's __syncthreads for the rest); stage does both.
// `host`: a range may be in mapped host memory (a mapped token's missed experts): then plain 16-byte loads,
// STAGE_BATCH in flight per thread, as registers: cp.async reads of host memory over PCIe were far slower (a
// mapped 24 GiB token's graph 15.5 ms with them, 8.5 with these; H200, 2026-12-02). From device memory cp.async
// is the faster (no register batches: the LM head 342 -> 312 us).
__device__ __forceinline__ void stage_issue(const Ranges& R, bool host = false) {
    const int c0 = chunks16(R.src[0], R.n[0]), c1 = chunks16(R.src[1], R.n[1]), c2 = chunks16(R.src[2], R.n[2]),
              c3 = chunks16(R.src[3], R.n[3]);
    const int p1 = c0, p2 = p1 + c1, p3 = p2 + c2, total = p3 + c3;
    const int nt = blockDim.x;
    const u8* src;
    int dst;
    if (!host) {
        for (int i = threadIdx.x; i < total; i += nt) {
            range_chunk(R, p1, p2, p3, i, src, dst);
            cp_async16(dst, src);
        }
        return;
    }
    for (int base = threadIdx.x; base < total; base += STAGE_BATCH * nt) {
        uint4 v[STAGE_BATCH];
#pragma unroll
        for (int u = 0; u < STAGE_BATCH; u++) {
            if (base + u * nt < total) {
                range_chunk(R, p1, p2, p3, base + u * nt, src, dst);
                v[u] = ld_stream16(src);
            }
        }
#pragma unroll
        for (int u = 0; u < STAGE_BATCH; u++) {
            if (base + u * nt < total) {
                range_chunk(R, p1, p2, p3, base + u * nt, src, dst);
                *(uint4*)(SMEM + dst) = v[u];
            }
        }
    }
}

__device__ __forceinline__ void stage(const Ranges& R, bool host = false) {
    stage_issue(R, host);
    stage_wait();
}

// GEMV_EARLY_STAGE (default 1): the dense GEMVs (gemv_jobs, up_mix) issue their weight copies before pdl_begin,
// overlapping the previous kernel's tail; 0 issues them after it (STRATA_KERNEL_DEFINES=GEMV_EARLY_STAGE=0 builds
// that variant, for the same-run comparison in bench/RESULTS.md).
#ifndef GEMV_EARLY_STAGE
#define GEMV_EARLY_STAGE 1
#endif

// gemv_jobs' shared-memory buffers a CTA cycles its tiles through (gemv.py GEMV_STAGES): 3 lets one barrier a tile
// guard both "tile k landed" and "tile k - 1's buffer is free"
#ifndef GEMV_STAGES
#define GEMV_STAGES 3
#endif

// the constant weights' copies, then pdl_begin (the order GEMV_EARLY_STAGE picks), then this thread's copies done
__device__ __forceinline__ void stage_constant(const Ranges& R) {
    if (GEMV_EARLY_STAGE) {
        stage_issue(R);
        pdl_begin();
    } else {
        pdl_begin();
        stage_issue(R);
    }
    stage_wait();
}

// ---- a row group's partial sums -> the group's sums (fixed order) ---------------------------------------------

// Every thread of each TPG-thread group passes its partials; every thread gets its group's sums. red: shared,
// 4 floats per warp of the CTA. Called by the whole CTA (barriers inside when tpg > 32).
__device__ __forceinline__ float4 group_sum(float4 v, int tpg, float* red) {
    const int lim = tpg < 32 ? tpg : 32;
    for (int o = lim >> 1; o > 0; o >>= 1) {
        v.x += __shfl_xor_sync(FULL_MASK, v.x, o);
        v.y += __shfl_xor_sync(FULL_MASK, v.y, o);
        v.z += __shfl_xor_sync(FULL_MASK, v.z, o);
        v.w += __shfl_xor_sync(FULL_MASK, v.w, o);
    }
    if (tpg > 32) {
        const int warp = threadIdx.x >> 5, nw = tpg >> 5, w0 = (threadIdx.x / tpg) * nw;
        if ((threadIdx.x & 31) == 0) {
            red[4 * warp] = v.x;
            red[4 * warp + 1] = v.y;
            red[4 * warp + 2] = v.z;
            red[4 * warp + 3] = v.w;
        }
        __syncthreads();
        v.x = v.y = v.z = v.w = 0.0f;
        for (int w = 0; w < nw; w++) {
            v.x += red[4 * (w0 + w)];
            v.y += red[4 * (w0 + w) + 1];
            v.z += red[4 * (w0 + w) + 2];
            v.w += red[4 * (w0 + w) + 3];
        }
        __syncthreads();
    }
    return v;
}

__device__ __forceinline__ float f4get(const float4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

// The geometry word of a job (gemv.py Geom.word): bits 0-3 log2(TPG), bits 4-6 rows per thread (1, 2 or 4).
__device__ __forceinline__ int geom_tpg(int geom) { return 1 << (geom & 15); }
__device__ __forceinline__ int geom_rr(int geom) { return (geom >> 4) & 7; }
// bit 7: the job takes the f32 path whatever its format (gemv.py GEMV_INT_ROWS)
__device__ __forceinline__ bool geom_f32(int geom) { return (geom >> 7) & 1; }
