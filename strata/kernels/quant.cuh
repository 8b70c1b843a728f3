// quant.cuh: ggml block formats decoded in registers, and the warp-cooperative row dot product built on them.
//
// THE F32 PATH (the GPU's correctness contract): a weight is dequantized to float32 in registers exactly as
// strata.quant.dequantize does (w = a*q + b per group), multiplied by the float32 activation and accumulated in
// float32. Nothing is rounded to a lower-precision activation format, so y matches dequantize(W) @ x (float64)
// to float32 accumulation error (~1e-7 relative), not llama.cpp's vec_dot_type rounding.
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

// kvalues_iq4nl (ggml-common.h) for 4 nibbles at once: nibble i of `sel` (bits 4i..4i+3) -> byte i, int8
__device__ __forceinline__ u32 iq4nl_lut4(u32 sel) {
    const u32 t0 = 0xBFAD9881u;   // -127 -104 -83 -65  (bytes 0..3)
    const u32 t1 = 0xF6EADDCFu;   //  -49  -35 -22 -10
    const u32 t2 = 0x26190D01u;   //    1   13  25  38
    const u32 t3 = 0x71594535u;   //   53   69  89 113
    const u32 lo = __byte_perm(t0, t1, sel & 0x7777u);
    const u32 hi = __byte_perm(t2, t3, sel & 0x7777u);
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
        const float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
#pragma unroll
        for (int s = 0; s < 2; s++) {
            int sc, m;
            k_scale_min(b + 4, 2 * c + s, sc, m);
            a[s] = d * (float)sc;
            bb[s] = -(dmin * (float)m);
        }
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
        const float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
#pragma unroll
        for (int s = 0; s < 2; s++) {
            int sc, m;
            k_scale_min(b + 4, 2 * c + s, sc, m);
            a[s] = d * (float)sc;
            bb[s] = -(dmin * (float)m);
        }
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

// ---- one part against x, and one part written out ------------------------------------------------------

template <class F>
__device__ __forceinline__ float part_dot(const u8* blk, int p, const float* xb) {
    float q[F::EPP], a[F::G], b[F::G];
    F::decode(blk, p, q, a, b);
    constexpr int RUNS = F::EPP / 4, RPG = RUNS / F::G;
    float acc = 0.0f;
#pragma unroll
    for (int g = 0; g < F::G; g++) {
        float s = 0.0f, sx = 0.0f;
#pragma unroll
        for (int rr = 0; rr < RPG; rr++) {
            const int r = g * RPG + rr;
            const float4 xv = *(const float4*)(xb + F::run(p, r));
            s += q[4 * r] * xv.x + q[4 * r + 1] * xv.y + q[4 * r + 2] * xv.z + q[4 * r + 3] * xv.w;
            if (F::HAS_B) sx += (xv.x + xv.y) + (xv.z + xv.w);
        }
        acc += F::HAS_B ? a[g] * s + b[g] * sx : a[g] * s;
    }
    return acc;
}

template <class F>
__device__ __forceinline__ void part_deq(const u8* blk, int p, float* ob) {
    float q[F::EPP], a[F::G], b[F::G];
    F::decode(blk, p, q, a, b);
    constexpr int RUNS = F::EPP / 4, RPG = RUNS / F::G;
#pragma unroll
    for (int r = 0; r < RUNS; r++) {
        const int g = r / RPG;
#pragma unroll
        for (int i = 0; i < 4; i++) ob[F::run(p, r) + i] = a[g] * q[4 * r + i] + b[g];
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

// ---- a row against x: this lane's share (lane `li` of `lt` cooperating lanes); the caller reduces ---------

template <class F>
__device__ __forceinline__ float row_dot_q(const u8* row, const float* x, int n_in, int li, int lt) {
    const int nparts = n_in / F::QK * F::NP;
    float acc = 0.0f;
#pragma unroll 2
    for (int i = li; i < nparts; i += lt) {
        const int blk = i / F::NP, p = i % F::NP;
        acc += part_dot<F>(row + (size_t)blk * F::BB, p, x + blk * F::QK);
    }
    return acc;
}

template <int T>
__device__ __forceinline__ float row_dot_f(const u8* row, const float* x, int n_in, int li, int lt) {
    constexpr int ES = T == T_F32 ? 4 : 2;
    const int nparts = (n_in + 7) >> 3;
    float acc = 0.0f;
#pragma unroll 2
    for (int i = li; i < nparts; i += lt) {
        float v[8];
        float8<T>(row + (size_t)i * 8 * ES, v);
        const int base = 8 * i;
        if (base + 8 <= n_in) {
            const float4 x0 = *(const float4*)(x + base), x1 = *(const float4*)(x + base + 4);
            acc += (v[0] * x0.x + v[1] * x0.y + v[2] * x0.z + v[3] * x0.w) +
                   (v[4] * x1.x + v[5] * x1.y + v[6] * x1.z + v[7] * x1.w);
        } else {
            for (int j = 0; base + j < n_in; j++) acc += v[j] * x[base + j];
        }
    }
    return acc;
}

__device__ __noinline__ float row_dot(int type, const u8* row, const float* x, int n_in, int li, int lt) {
    switch (type) {
        case T_F32: return row_dot_f<T_F32>(row, x, n_in, li, lt);
        case T_F16: return row_dot_f<T_F16>(row, x, n_in, li, lt);
        case T_BF16: return row_dot_f<T_BF16>(row, x, n_in, li, lt);
        case T_Q4_0: return row_dot_q<FQ4_0>(row, x, n_in, li, lt);
        case T_Q4_1: return row_dot_q<FQ4_1>(row, x, n_in, li, lt);
        case T_Q5_0: return row_dot_q<FQ5_0>(row, x, n_in, li, lt);
        case T_Q5_1: return row_dot_q<FQ5_1>(row, x, n_in, li, lt);
        case T_Q8_0: return row_dot_q<FQ8_0>(row, x, n_in, li, lt);
        case T_Q2_0: return row_dot_q<FQ2_0>(row, x, n_in, li, lt);
        case T_Q2_K: return row_dot_q<FQ2_K>(row, x, n_in, li, lt);
        case T_Q3_K: return row_dot_q<FQ3_K>(row, x, n_in, li, lt);
        case T_Q4_K: return row_dot_q<FQ4_K>(row, x, n_in, li, lt);
        case T_Q5_K: return row_dot_q<FQ5_K>(row, x, n_in, li, lt);
        case T_Q6_K: return row_dot_q<FQ6_K>(row, x, n_in, li, lt);
        case T_IQ4_NL: return row_dot_q<FIQ4_NL>(row, x, n_in, li, lt);
        case T_IQ4_XS: return row_dot_q<FIQ4_XS>(row, x, n_in, li, lt);
    }
    return __int_as_float(0x7fc00000);   // an unknown type poisons the output instead of passing silently
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

// ---- a job: one matrix of a launch, kept in device memory for the life of the session ---------------------

// y[r] = W[r] . x for r < n_out; when w2 is set (GLU), y[r] = silu(W[r] . x) * (W2[r] . x).
// Layout must match strata/kernels/gemv.py (JOB_DTYPE): 64 bytes.
struct GemvJob {
    const u8* w;         // rows of row_bytes, n_out of them
    const u8* w2;        // GLU partner (same n_in, n_out), or null
    const float* x;      // (n_in,) 16-byte aligned
    float* y;            // (n_out,)
    i32 type, type2;     // ggml type ids of w and w2
    i32 n_in, n_out;
    i32 row_bytes, row_bytes2;
    i32 cta0;            // first CTA of this job in its launch
    i32 wpr;             // warps per row (1, 2, 4 or 8); 8 / wpr rows per CTA
};
