// gemm.cuh: the tensor-core tile of the batched step's matrix products (gemm.cu's dense jobs, moe.cu's experts).
//
// Y[n] = W X[n] for the n < nrows rows of a tile (X rows gathered through xrow when it is set), or
// Y[n] = silu(W X[n]) * (W2 X[n]) (GLU). A CTA takes a tile of BM weight rows and BN step rows; per k-chunk of
// BK elements it decodes its weight rows once into shared memory as f32 (part_deq: the GEMV's decoders) and
// applies them to all BN rows with mma.sync m16n8k8 in 3xTF32: each f32 operand is split as big = tf32(v),
// small = tf32(v - big), and big*big + big*small + small*big keep about 22 bits of every product, which is what
// keeps the batched path within 1e-5 of the f32 GEMV (plain TF32 would be ~1e-3). Accumulation is f32 in a
// fixed order per element (the k loop), so results are deterministic, and a row's result does not depend on
// which other rows share its tile.
#pragma once
#include "quant.cuh"

// BK, the k-chunk: a whole number of the formats' part groups: 128 for Q6_K (groups of 128), 64 for the others,
// whose smaller tiles let more CTAs share a multiprocessor (gemm.py picks per launch). Shared rows are BK + 4
// floats: the fragment loads of a warp then hit 32 distinct banks.
#define GM_THREADS 128

__device__ __forceinline__ u32 tf32_of(float v) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
    return r;
}

__device__ __forceinline__ void split_tf32(float v, u32& big, u32& small) {
    big = tf32_of(v);
    small = tf32_of(v - __uint_as_float(big));
}

__device__ __forceinline__ void mma_tf32(float* c, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Rows [0, nrows) of a weight tile, elements [k0, k0 + BK), into Ws (BM x (BK + 4) floats); elements past n_in
// are zero. Items are (row, part) pairs: a part is wholly inside or outside a chunk for every format.
template <int BK, class F>
__device__ __forceinline__ void deq_tile_q(const u8* w, int rb, int nrows, int k0, int n_in, float* Ws, int BM) {
    constexpr int PPT = F::NP * BK / F::QK, LD = BK + 4;           // parts per row of the tile
    const int gp0 = k0 / F::QK * F::NP + (k0 % F::QK) * F::NP / F::QK;
    for (int i = threadIdx.x; i < BM * PPT; i += blockDim.x) {
        const int row = i / PPT, gp = gp0 + i % PPT, blk = gp / F::NP, p = gp % F::NP;
        float* ob = Ws + row * LD + (blk * F::QK - k0);
        if (row < nrows && blk * F::QK < n_in) {
            part_deq<F, true>(w + (size_t)row * rb + (size_t)blk * F::BB, p, ob);   // runs 16-byte aligned
        } else {
#pragma unroll
            for (int r = 0; r < F::EPP / 4; r++) {
                float4 z;
                z.x = z.y = z.z = z.w = 0.0f;
                *(float4*)(ob + F::run(p, r)) = z;
            }
        }
    }
}

template <int BK, int T>
__device__ __forceinline__ void deq_tile_f(const u8* w, int rb, int nrows, int k0, int n_in, float* Ws, int BM) {
    constexpr int ES = T == T_F32 ? 4 : 2, LD = BK + 4;
    for (int i = threadIdx.x; i < BM * (BK / 8); i += blockDim.x) {
        const int row = i / (BK / 8), c = i % (BK / 8), k = k0 + 8 * c;
        float v[8];
        if (row < nrows && k < n_in) float8<T>(w + (size_t)row * rb + (size_t)k * ES, v);
#pragma unroll
        for (int e = 0; e < 8; e++) Ws[row * LD + 8 * c + e] = row < nrows && k + e < n_in ? v[e] : 0.0f;
    }
}

template <int BK>
__device__ __noinline__ void deq_tile(int type, const u8* w, int rb, int nrows, int k0, int n_in, float* Ws, int BM) {
    switch (type) {
        case T_F32: deq_tile_f<BK, T_F32>(w, rb, nrows, k0, n_in, Ws, BM); return;
        case T_F16: deq_tile_f<BK, T_F16>(w, rb, nrows, k0, n_in, Ws, BM); return;
        case T_BF16: deq_tile_f<BK, T_BF16>(w, rb, nrows, k0, n_in, Ws, BM); return;
        case T_Q4_0: deq_tile_q<BK, FQ4_0>(w, rb, nrows, k0, n_in, Ws, BM); return;
        case T_Q4_1: deq_tile_q<BK, FQ4_1>(w, rb, nrows, k0, n_in, Ws, BM); return;
        case T_Q5_0: deq_tile_q<BK, FQ5_0>(w, rb, nrows, k0, n_in, Ws, BM); return;
        case T_Q5_1: deq_tile_q<BK, FQ5_1>(w, rb, nrows, k0, n_in, Ws, BM); return;
        case T_Q8_0: deq_tile_q<BK, FQ8_0>(w, rb, nrows, k0, n_in, Ws, BM); return;
        case T_Q2_0: deq_tile_q<BK, FQ2_0>(w, rb, nrows, k0, n_in, Ws, BM); return;
        case T_Q2_K: deq_tile_q<BK, FQ2_K>(w, rb, nrows, k0, n_in, Ws, BM); return;
        case T_Q3_K: deq_tile_q<BK, FQ3_K>(w, rb, nrows, k0, n_in, Ws, BM); return;
        case T_Q4_K: deq_tile_q<BK, FQ4_K>(w, rb, nrows, k0, n_in, Ws, BM); return;
        case T_Q5_K: deq_tile_q<BK, FQ5_K>(w, rb, nrows, k0, n_in, Ws, BM); return;
        case T_Q6_K: deq_tile_q<BK, FQ6_K>(w, rb, nrows, k0, n_in, Ws, BM); return;
        case T_IQ4_NL: deq_tile_q<BK, FIQ4_NL>(w, rb, nrows, k0, n_in, Ws, BM); return;
        case T_IQ4_XS: deq_tile_q<BK, FIQ4_XS>(w, rb, nrows, k0, n_in, Ws, BM); return;
    }
    for (int i = threadIdx.x; i < BM * (BK + 4); i += blockDim.x) Ws[i] = __int_as_float(0x7fc00000);   // unknown type
}

// X rows [n0, n0 + BN) (gathered), elements [k0, k0 + BK), into Xs (BN x (BK + 4)); zeros outside.
// Rows whose stride or start is not 16-byte aligned are read a float at a time.
template <int BK>
__device__ __forceinline__ void load_x(const float* x, int ldx, const i32* xrow, int n0, int nrows, int k0, int n_in,
                                       float* Xs, int BN) {
    const bool vec = (ldx & 3) == 0 && ((unsigned long long)x & 15) == 0;     // 16-byte rows: float4 loads
    for (int i = threadIdx.x; i < BN * (BK / 4); i += blockDim.x) {
        const int n = i / (BK / 4), c = i % (BK / 4), k = k0 + 4 * c;
        float4 v;
        v.x = v.y = v.z = v.w = 0.0f;
        if (n0 + n < nrows && k < n_in) {
            const float* xp = x + (size_t)(xrow != nullptr ? xrow[n0 + n] : n0 + n) * ldx + k;
            if (vec && k + 4 <= n_in) {
                v = *(const float4*)xp;
            } else {                          // unaligned rows, or the tail of n_in (not a multiple of 4)
                v.x = xp[0];
                v.y = k + 1 < n_in ? xp[1] : 0.0f;
                v.z = k + 2 < n_in ? xp[2] : 0.0f;
                v.w = k + 3 < n_in ? xp[3] : 0.0f;
            }
        }
        *(float4*)(Xs + n * (BK + 4) + 4 * c) = v;
    }
}

// The tile [m0, m0 + BM) x [n0, n0 + BN) of one job. Warps are WM x WN, each MT m16 tiles by NT n8 tiles.
// Shared memory: Ws (BM), Ws2 (BM, GLU only), Xs (BN), BK + 4 floats a row.
template <int BK, int MT, int NT, int WM, int WN>
__device__ __forceinline__ void gemm_tile(const u8* w, const u8* w2, int type, int type2, int rb, int rb2, int n_in,
                                          int n_out, int m0, const float* x, int ldx, const i32* xrow, int nrows,
                                          int n0, float* y, int ldy) {
    constexpr int BM = WM * MT * 16, BN = WN * NT * 8, GM_LD = BK + 4;
    const bool glu = w2 != nullptr;
    float* Ws = (float*)SMEM;
    float* Ws2 = Ws + BM * GM_LD;
    float* Xs = Ws2 + (glu ? BM * GM_LD : 0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wm = (warp % WM) * MT * 16, wn = (warp / WM) * NT * 8;
    const int mrows = min(BM, n_out - m0);
    float acc[MT][NT][4], acc2[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = acc2[i][j][e] = 0.0f;

    for (int k0 = 0; k0 < n_in; k0 += BK) {
        deq_tile<BK>(type, w + (size_t)m0 * rb, rb, mrows, k0, n_in, Ws, BM);
        if (glu) deq_tile<BK>(type2, w2 + (size_t)m0 * rb2, rb2, mrows, k0, n_in, Ws2, BM);
        load_x<BK>(x, ldx, xrow, n0, nrows, k0, n_in, Xs, BN);
        __syncthreads();
#pragma unroll 2
        for (int kk = 0; kk < BK; kk += 8) {
            u32 bb[NT][2], bs[NT][2];
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const float* xp = Xs + (wn + j * 8 + g) * GM_LD + kk + t;
                split_tf32(xp[0], bb[j][0], bs[j][0]);
                split_tf32(xp[4], bb[j][1], bs[j][1]);
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (h == 1 && !glu) break;
                const float* W = h ? Ws2 : Ws;
#pragma unroll
                for (int i = 0; i < MT; i++) {
                    const float* wp = W + (wm + i * 16 + g) * GM_LD + kk + t;
                    u32 ab[4], as[4];
                    split_tf32(wp[0], ab[0], as[0]);
                    split_tf32(wp[8 * GM_LD], ab[1], as[1]);
                    split_tf32(wp[4], ab[2], as[2]);
                    split_tf32(wp[8 * GM_LD + 4], ab[3], as[3]);
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        float* c = h ? acc2[i][j] : acc[i][j];
                        mma_tf32(c, as, bb[j]);
                        mma_tf32(c, ab, bs[j]);
                        mma_tf32(c, ab, bb[j]);
                    }
                }
            }
        }
        __syncthreads();
    }
    // c[0], c[1]: weight row g, step rows 2t, 2t+1; c[2], c[3]: weight row g + 8
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int m = m0 + wm + i * 16 + g + (e >> 1) * 8, n = n0 + wn + j * 8 + 2 * t + (e & 1);
                if (m < n_out && n < nrows) {
                    const float a = acc[i][j][e];
                    y[(size_t)n * ldy + m] = glu ? siluf_(a) * acc2[i][j][e] : a;
                }
            }
}

