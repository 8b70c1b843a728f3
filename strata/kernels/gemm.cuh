// gemm.cuh: the tensor-core tile of the batched step's matrix products (gemm.cu's dense jobs, moe.cu's experts).
//
// Y[n] = W X[n] for the n < nrows rows of a tile (X rows gathered through xrow when it is set), or
// Y[n] = silu(W X[n]) * (W2 X[n]) (GLU). A CTA takes a tile of BM weight rows and BN step rows; per k-chunk of
// BK elements it decodes its weight rows once (the GEMV's decoders) into shared memory as f16 halves and applies
// them to all BN rows with wgmma (Hopper) or mma.sync m16n8k16 in 3xFP16: each f32 operand is split as hi = f16(v),
// lo = f16(v - hi), and hi*hi + hi*lo + lo*hi keep about 22 bits of every product (what 3xTF32 kept, at twice the
// tensor rate and a third of the fragment instructions: ldmatrix, no per-load split), which is what keeps the
// batched path within 1e-5 of the f32 GEMV (a plain f16 or TF32 product would be ~1e-3).
// f16 has a narrow exponent, so each weight row and each step row of a chunk is scaled by a power of two that brings
// its largest |v| into [2^14, 2^15) before the split: lo is then never subnormal where it matters and hi never
// overflows. Each k-chunk's MMAs go into zeroed registers, brought back by the chunk's row factors (the step rows'
// exact powers of two; each weight row's power of two, or its block scale where the tile holds the block's integer
// codes: deq_tile_q2c) and added into the f32 result with an FMA: the tensor cores' f32 accumulation truncates, so
// one accumulator carried over the whole input drifted with its length (3.8e-5 from float64 at n_in 10240 against
// 4e-7 this way, H200, bench/gemm_accuracy.py), for ~9% more time (more registers a thread). Accumulation is in a
// fixed order per element (the k loop), so results are deterministic, and a row's result does not depend on which
// other rows share its tile.
#pragma once
#include "quant.cuh"

// BK, the k-chunk: a whole number of the formats' part groups: 128 for Q6_K (groups of 128), 64 for the others,
// whose smaller tiles let more CTAs share a multiprocessor (gemm.py picks per launch). A tile's rows take BK + 4
// floats' bytes of shared memory each (Layout: how the two paths place the halves in them).
#define GM_THREADS 128
// Resident CTAs a multiprocessor is asked to fit (registers): the tile has no load/compute overlap of its own, so
// other CTAs' chunks are what hides a chunk's loads. 4 fits the one-m16 plain tiles at k-chunks of 64; the rest get
// 3 (168 registers: the 128-row and GLU tiles spill a little there, and measured faster so than at 2 without
// spills: attn_qkv at 4096 rows 3.33 against 3.56 ms; the 64-row plain tile at 4 spilled and lost, hc down 0.84
// against 0.79 at 3; H200, 2026-12-03).
// GEMM_MIN_CTAS=n in $STRATA_KERNEL_DEFINES asks n of every tile (the wgmma tiles' GLU ones spill 192-324 bytes at 3:
// whether 2 without spills is faster is for bench/gpu_gemm.sh to say).
#ifdef GEMM_MIN_CTAS
#define GM_MIN_CTAS(GLU, BK, MT) GEMM_MIN_CTAS
#else
#define GM_MIN_CTAS(GLU, BK, MT) ((GLU) || (BK) > 64 || (MT) > 1 ? 3 : 4)
#endif

__device__ __forceinline__ u32 f16x2_of(float lo, float hi) {     // lo in the low half: the lower k
#ifdef __CUDACC__
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return emu_f16x2(lo, hi);
#endif
}

__device__ __forceinline__ float2 f32x2_of(u32 v) {
    float2 f;
#ifdef __CUDACC__
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
        : "=f"(f.x), "=f"(f.y) : "r"(v));
#else
    f.x = emu_half_to_float((u16)v);
    f.y = emu_half_to_float((u16)(v >> 16));
#endif
    return f;
}

// a - b in each f16 half (exact where the results are small integers, as deq_tile_q2c's)
__device__ __forceinline__ u32 f16x2_sub(u32 a, u32 b) {
#ifdef __CUDACC__
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
#else
    const float2 x = f32x2_of(a), y = f32x2_of(b);
    return emu_f16x2(x.x - y.x, x.y - y.y);
#endif
}

// 4 consecutive (scaled) elements -> their f16 values (the hi halves), two words
__device__ __forceinline__ uint2 hi4(float4 v) {
    uint2 h;
    h.x = f16x2_of(v.x, v.y);
    h.y = f16x2_of(v.z, v.w);
    return h;
}

// 4 consecutive (scaled) elements -> their hi and lo halves, two words each
__device__ __forceinline__ void split4(float4 v, uint2& hi, uint2& lo) {
    hi = hi4(v);
    const float2 a = f32x2_of(hi.x), b = f32x2_of(hi.y);
    lo.x = f16x2_of(v.x - a.x, v.y - a.y);
    lo.y = f16x2_of(v.z - b.x, v.w - b.y);
}

__device__ __forceinline__ float4 scale4(float4 v, float f) {
    v.x *= f;
    v.y *= f;
    v.z *= f;
    v.w *= f;
    return v;
}

__device__ __forceinline__ float absmax4(float m, float4 v) {
    return fmaxf(fmaxf(m, fmaxf(fabsf(v.x), fabsf(v.y))), fmaxf(fabsf(v.z), fabsf(v.w)));
}

// The shift s that brings m = max |v| of a row's chunk into [2^14, 2^15) as v 2^s, within [-126, 126]. A zero row
// (or one whose max fmaxf dropped as NaN) keeps 0; an infinite one stays infinite, so non-finite values propagate.
__device__ __forceinline__ int f16_shift(float m) {
    return m > 0.0f ? max(-126, min(126, 141 - ((__float_as_int(m) >> 23) & 255))) : 0;
}

__device__ __forceinline__ void mma_f16(float* c, const u32* a, const u32* b) {
#ifdef __CUDACC__
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    emu_mma_f16(c, a, b);
#endif
}

// GEMM_WGMMA (default 1): on Hopper (an sm_90a build: strata/kernels/build.py compiles for it on the H200) the
// tile's products run as warpgroup MMAs, wgmma.mma_async m64nNk16 with both operands read by the tensor cores from
// shared memory: the CTA's 128 threads are one warpgroup, each 64 weight rows of the tile one wgmma per k-step and
// half-product, N = the tile's step rows. Against mma.sync this takes the operand fragments (ldmatrix) and the
// three MMAs of every 16 x 8 x 16 product out of the warps' issue slots, which the decode of the next tiles then
// has (the mma.sync tile is issue- and shared-memory-bound: bench/GPU_NOTES.md). Elsewhere (other GPUs, or
// GEMM_WGMMA=0 for the comparison) the mma.sync tile. The CPU emulator runs the wgmma path (GEMM_WGMMA=0: the other).
#ifndef GEMM_WGMMA
#define GEMM_WGMMA 1
#endif
#if GEMM_WGMMA && (defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDACC__))
#define GM_WG 1
#else
#define GM_WG 0
#endif
// GEMM_XPREP (default 1): a job's step rows may come prepared by x_split (gemm.cu; gemm.py XPREP has the batched
// step use it: on the H200 the plain GEMMs 20-35% faster at 4096 rows). GEMM_XPREP=0 builds the tiles without the
// copy (for the same-call comparison).
#ifndef GEMM_XPREP
#define GEMM_XPREP 1
#endif
// GEMM_WPREP (default 1; 0 builds the tiles without the copy, for a same-call comparison): a job's weights may come
// prepared by w_split (gemm.cu), decoded and split once per launch into the same planes x_split writes for x, which
// the tile then copies instead of decoding: a prefill chunk's plain tiles decode every weight once per N tile (32
// times at 4096 rows), the issue-bound part of the wgmma tile once x is prepared. The planes take 4 bytes a weight
// against the quantized ~0.5-1, so the launch walks its tiles in groups of M tiles (gemm_jobs_body's swz) to read
// each group's planes from L2 for every N tile. wgmma tiles only. H100, 2026-12-05 (bench/RESULTS.md): a 4096-row
// chunk 1,347 -> 1,214 ms; attn_qkv 2.34 -> 1.97 ms, hc down 0.92 -> 0.50 ms, splits included.
#ifndef GEMM_WPREP
#define GEMM_WPREP 1
#endif

// Where a tile's element (r, k) of a k-chunk lives in shared memory: the byte offset of its hi half from the tile's
// start (off), and how much further its lo half is (lo, for a tile of R rows).
template <int BK>
struct Layout {
#if GM_WG
    // wgmma's K-major layout without swizzle: "core matrices" of 8 rows x 8 halves as 128 contiguous bytes (row
    // r % 8 at 16 (r % 8)), the k-adjacent ones 128 bytes apart (the descriptor's leading byte offset), an 8-row
    // group's BK / 8 of them together, 16 BK bytes (the stride byte offset) to the next group; the lo halves of
    // all R rows after the hi halves. A warp's 8-byte stores of 4-element runs cover each bank twice (no more
    // than 256 bytes need), and the tensor cores read whole 128-byte core matrices.
    static __device__ __forceinline__ int off(int r, int k) {
        return (r >> 3) * 16 * BK + (k >> 3) * 128 + (r & 7) * 16 + (k & 7) * 2;
    }
    static __device__ __forceinline__ int lo(int R) { return 2 * BK * R; }
#else
    // ldmatrix's rows: BK + 4 floats' bytes a row, hi halves then lo halves; the 16 bytes of padding put the 8 rows
    // of a fragment on distinct banks
    static __device__ __forceinline__ int off(int r, int k) { return r * (BK + 4) * 4 + 2 * k; }
    static __device__ __forceinline__ int lo(int) { return 2 * BK; }
#endif
};

// the wgmma matrix descriptor of a K-major, unswizzled operand at shared address a (Layout's strides)
__device__ __forceinline__ u64 wg_desc(u32 a, int bk) {
    return (u64)((a & 0x3FFFF) >> 4) | ((u64)(128 >> 4) << 16) | ((u64)((16 * bk) >> 4) << 32);
}

#define WG_4(c, i) c(d[i]), c(d[i + 1]), c(d[i + 2]), c(d[i + 3])
#define WG_OPS16(c) WG_4(c, 0), WG_4(c, 4)
#define WG_OPS64(c) WG_OPS16(c), WG_4(c, 8), WG_4(c, 12), WG_4(c, 16), WG_4(c, 20), WG_4(c, 24), WG_4(c, 28)
#define WG_OPS128(c) WG_OPS64(c), WG_4(c, 32), WG_4(c, 36), WG_4(c, 40), WG_4(c, 44), WG_4(c, 48), WG_4(c, 52), \
    WG_4(c, 56), WG_4(c, 60)
#define WG_REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define WG_REGS64 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_REGS128 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
    " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
    " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
// operands: the N / 2 accumulators, then the descriptors and the accumulate flag (scale-d)
#define WG_ASM(N, NA, NB, NP)                                                                             \
    "{ .reg .pred p; setp.ne.b32 p, %" #NP ", 0;\n"                                                       \
    "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 " WG_REGS##N ", %" #NA ", %" #NB ", p, 1, 1, 0, 0; }"
#define WG_CASE(N, NA, NB, NP)                                                                            \
    if constexpr (N == N_)                                                                                \
        if constexpr (ACC)                                                                                \
            asm volatile(WG_ASM(N, NA, NB, NP) : WG_OPS##N("+f") : "l"(a), "l"(b), "r"(1));               \
        else                                                                                              \
            asm volatile(WG_ASM(N, NA, NB, NP) : WG_OPS##N("=f") : "l"(a), "l"(b), "r"(0));

// d (N / 2 floats: the m64nN accumulator fragment) = A B^T (+ d when ACC), A 64 x 16 and B N x 16 (K-major) at
// descriptors a and b, issued asynchronously: d is defined only after wg_commit() and wg_wait(). Without ACC the
// registers' old values are dead to the compiler (outputs only), so they cost nothing while the next chunk decodes.
template <int N_, bool ACC>
__device__ __forceinline__ void wg_mma(float* d, u64 a, u64 b) {
    static_assert(N_ == 16 || N_ == 64 || N_ == 128, "wg_mma: N");
#ifdef __CUDACC__
    WG_CASE(16, 8, 9, 10)
    WG_CASE(64, 32, 33, 34)
    WG_CASE(128, 64, 65, 66)
#else
    emu_wgmma(d, N_, a, b, ACC);
#endif
}

// ordinary shared-memory stores made visible to the tensor cores (each writing thread, before the barrier); nothing
// on the mma.sync path, whose reads are ordinary
__device__ __forceinline__ void wg_proxy_fence() {
#if defined(__CUDACC__) && GM_WG
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// before a batch of wgmma: the accumulator registers' earlier writes ordered before the MMAs that read them
__device__ __forceinline__ void wg_fence() {
#ifdef __CUDACC__
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

// the MMAs issued since the last commit, as one group
__device__ __forceinline__ void wg_commit() {
#ifdef __CUDACC__
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#else
    emu_wgmma_commit();
#endif
}

// every committed group complete: their accumulators readable and their shared operands free
__device__ __forceinline__ void wg_wait() {
#ifdef __CUDACC__
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#else
    emu_wgmma_wait();
#endif
}

// an accumulator register pinned in place: the compiler may not move its reads or writes across this point (the
// asm around a wgmma names its registers, a wait does not)
__device__ __forceinline__ void wg_pin(float& r) {
#ifdef __CUDACC__
    asm volatile("" : "+f"(r)::"memory");
#endif
}

// Weight formats whose values, scaled by a power of two into f16's range, are f16 numbers: Q2_0 (codes -1..2 times
// an f16 scale), F16, BF16 (8-bit significands). Their lo halves are zero, except for a value that falls below f16's
// normal range (2^-28 of its row's largest in the k-chunk, or less), which the hi half then keeps to 2^-25 of f16's
// unit: far below the lo x lo product that 3xFP16 drops anyway. So a tile whose weights are all such writes no lo
// halves and takes two MMAs a product, hi(W) lo(X) and hi(W) hi(X), instead of three.
// GEMM_EXACT_W=0: every format takes three MMAs (for the same-call comparison).
#ifndef GEMM_EXACT_W
#define GEMM_EXACT_W 1
#endif
__device__ __forceinline__ bool f16_exact(int type) {
    return GEMM_EXACT_W && (type == T_Q2_0 || type == T_F16 || type == T_BF16);
}
// GEMM_COMPACT_W (default 1; 0 for the same-call comparison): a wgmma tile whose weights are all f16-exact writes no
// lo halves, and its Layout keeps the lo plane after the hi one, so the next region (the GLU partner's tile, the
// rows' tile) starts where the hi halves end: half the weight tiles' shared memory (gemm.py smem_bytes sizes a launch
// so when every job's weights are exact on sm_90), room for more CTAs of the expert tiles (moe.cu MOE_MIN_CTAS16).
#ifndef GEMM_COMPACT_W
#define GEMM_COMPACT_W 1
#endif

// The PPT consecutive threads that hold one row's values (PPT a power of 2 <= 32 dividing GM_THREADS, every
// thread of the CTA calling): the row's shift from their maximum |v|, then each thread's 4-element runs split into
// halves, run r's hi half at tile + at(r) and, when wlo, its lo half lo bytes further (Layout). Returns the shift.
template <int PPT, int NR, class At>
__device__ __forceinline__ int split_runs(const float (&v)[4 * NR], u8* tile, int lo, bool wlo, At at) {
    float m = 0.0f;
#pragma unroll
    for (int r = 0; r < NR; r++) m = absmax4(m, make_float4(v[4 * r], v[4 * r + 1], v[4 * r + 2], v[4 * r + 3]));
#pragma unroll
    for (int o = 1; o < PPT; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const int s = f16_shift(m);
    const float f = pow2f(s);
#pragma unroll
    for (int r = 0; r < NR; r++) {
        const float4 a = make_float4(v[4 * r] * f, v[4 * r + 1] * f, v[4 * r + 2] * f, v[4 * r + 3] * f);
        if (wlo) {
            uint2 hi, lo_;
            split4(a, hi, lo_);
            *(uint2*)(tile + at(r)) = hi;
            *(uint2*)(tile + lo + at(r)) = lo_;
        } else {                            // f16-exact weights: no lo halves to form
            *(uint2*)(tile + at(r)) = hi4(a);
        }
    }
    return s;
}

// Rows [0, nrows) of a weight tile, elements [k0, k0 + BK), decoded (part_deq's decoders) and split into Ws (BM
// rows), fac[r] the factor that brings row r's sums back (2^-shift); elements past n_in and rows past nrows are zero.
// Items are (row, part) pairs: a part is wholly inside or outside a chunk for every format, and a row's PPT parts
// are consecutive items.
template <int BK, class F>
__device__ __forceinline__ void deq_tile_q(const u8* __restrict__ w, int rb, int nrows, int k0, int n_in,
                                           float* __restrict__ Ws, int BM, float* __restrict__ fac, bool wlo, int lo) {
    constexpr int PPT = F::NP * BK / F::QK, RUNS = F::EPP / 4, RPG = RUNS / F::G;   // parts per row of the tile
    static_assert(PPT <= 32 && GM_THREADS % PPT == 0, "deq_tile_q: a row's parts in one warp");
    const int gp0 = k0 / F::QK * F::NP + (k0 % F::QK) * F::NP / F::QK;
    for (int i = threadIdx.x; i < BM * PPT; i += GM_THREADS) {
        const int row = i / PPT, gp = gp0 + i % PPT, blk = gp / F::NP, p = gp % F::NP, e0 = blk * F::QK - k0;
        float v[F::EPP];
        if (row < nrows && blk * F::QK < n_in) {
            float q[F::EPP], a[F::G], b[F::G];
            F::decode(w + (size_t)row * rb + (size_t)blk * F::BB, p, q, a, b);
#pragma unroll
            for (int r = 0; r < RUNS; r++)
#pragma unroll
                for (int e = 0; e < 4; e++) v[4 * r + e] = a[r / RPG] * q[4 * r + e] + b[r / RPG];
        } else {
#pragma unroll
            for (int e = 0; e < F::EPP; e++) v[e] = 0.0f;
        }
        const int s = split_runs<PPT, RUNS>(v, (u8*)Ws, lo, wlo,
                                            [&](int r) { return Layout<BK>::off(row, e0 + F::run(p, r)); });
        if (i % PPT == 0) fac[row] = pow2f(-s);
    }
}

// GEMM_Q2_CODES (default 1; 0 for the same-call comparison): a Q2_0 chunk of 64 elements is one block a row (d and
// 2-bit codes c, v = (c - 1) d), so the tile holds the codes c - 1 themselves (-1..2, exact in f16) and the row's
// factor is d: the chunk's products sum codes, and the epilogue's one multiply by d a row and chunk stands in for a
// scale, a max and a split a weight. A code pair becomes f16s by bit operations (1024 + c has c in f16's low
// mantissa bits, less 1025 in f16 exactly). The decode was ~23 instructions a weight (ncu, moe_gu16_k64 at 512 rows,
// H100: 1.36e9 warp instructions for 1.9e9 weights, issue slots 62% busy); this one is ~3. One more f32 rounding
// a product (the sum times d), far below 3xFP16's 2^-22. H100, same call (bench/RESULTS.md 2026-12-07, twenty-third
// session): expert gate/up + down at 512 rows 3.31 -> 2.73 ms a layer, 4096 rows 6.94 -> 5.57; prefill chunks of
// 512 / 1024 / 4096 rows 325.3 / 421.8 / 1,054.6 -> 282.5 / 374.4 / 986.7 ms.
#ifndef GEMM_Q2_CODES
#define GEMM_Q2_CODES 1
#endif
// Items (row, part p: elements 16p .. 16p + 15) a thread in turn, each loaded, decoded and stored before the next:
// a tile's items all loaded first, or the next chunk's loaded into registers before this chunk's products
// (GEMM_Q2_PREFETCH, measured and removed: gate/up at 512 rows 2.32 against 1.86 ms, H100), spill more at the
// 16-pair tiles' 80 registers than the loads' latency costs. Rows past nrows: codes 1, scale 0 (zeros).
template <int BK>
__device__ __forceinline__ void deq_tile_q2c(const u8* __restrict__ w, int rb, int nrows, int k0, int n_in,
                                             float* __restrict__ Ws, int BM, float* __restrict__ fac, bool wlo,
                                             int lo) {
    static_assert(BK == FQ2_0::QK, "deq_tile_q2c: one block a row and chunk");
    const int blk = k0 / FQ2_0::QK;
    for (int i = threadIdx.x; i < BM * FQ2_0::NP; i += GM_THREADS) {
        const int row = i / FQ2_0::NP, p = i % FQ2_0::NP;
        u32 q = 0x55555555u;
        u16 d = 0;
        if (row < nrows && blk * FQ2_0::QK < n_in) {
            const u8* b = w + (size_t)row * rb + (size_t)blk * FQ2_0::BB;
            q = ld32_a2(b + 2 + 4 * p);                         // element e's code at bits 2e
            if (p == 0) d = ld16(b);
        }
        u32 h[8], o[8];
#pragma unroll
        for (int e = 0; e < 8; e++)         // elements e and e + 8 (16 bits apart): f16 1024 + c each, then c - 1
            h[e] = f16x2_sub(((q >> (2 * e)) & 0x00030003u) | 0x64006400u, 0x64016401u);
#pragma unroll
        for (int e = 0; e < 4; e++) {       // (2e, 2e + 8), (2e + 1, 2e + 9) -> (2e, 2e + 1), (2e + 8, 2e + 9)
            o[e] = __byte_perm(h[2 * e], h[2 * e + 1], 0x5410u);
            o[4 + e] = __byte_perm(h[2 * e], h[2 * e + 1], 0x7632u);
        }
        u8* t = (u8*)Ws + Layout<BK>::off(row, 16 * p);          // 8 elements: 16 contiguous bytes in both layouts
        u8* t8 = (u8*)Ws + Layout<BK>::off(row, 16 * p + 8);
        *(uint4*)t = make_uint4(o[0], o[1], o[2], o[3]);
        *(uint4*)t8 = make_uint4(o[4], o[5], o[6], o[7]);
        if (wlo) {                          // a GLU partner that is not f16-exact: this tile's lo halves are read
            *(uint4*)(t + lo) = make_uint4(0u, 0u, 0u, 0u);
            *(uint4*)(t8 + lo) = make_uint4(0u, 0u, 0u, 0u);
        }
        if (p == 0) fac[row] = h2f(d);
    }
}

template <int BK, int T>
__device__ __forceinline__ void deq_tile_f(const u8* w, int rb, int nrows, int k0, int n_in, float* Ws, int BM,
                                           float* fac, bool wlo, int lo) {
    constexpr int ES = T == T_F32 ? 4 : 2, PPT = BK / 8;
    for (int i = threadIdx.x; i < BM * PPT; i += blockDim.x) {
        const int row = i / PPT, c = i % PPT, k = k0 + 8 * c;
        float v[8];
        if (row < nrows && k < n_in) float8<T>(w + (size_t)row * rb + (size_t)k * ES, v);
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = row < nrows && k + e < n_in ? v[e] : 0.0f;
        const int s = split_runs<PPT, 2>(v, (u8*)Ws, lo, wlo,
                                         [&](int r) { return Layout<BK>::off(row, 8 * c + 4 * r); });
        if (c == 0) fac[row] = pow2f(-s);
    }
}

// lo: the lo halves' offset from Ws, bytes (-1: Layout's, for a tile of BM rows; w_split's planes pass theirs)
template <int BK>
__device__ __noinline__ void deq_tile(int type, const u8* w, int rb, int nrows, int k0, int n_in, float* Ws, int BM,
                                      float* fac, bool wlo, int lo = -1) {
    if (lo < 0) lo = Layout<BK>::lo(BM);
#define DEQ_Q(T, F)                                                                         \
    case T: deq_tile_q<BK, F>(w, rb, nrows, k0, n_in, Ws, BM, fac, wlo, lo); return;
    if constexpr (GEMM_Q2_CODES && BK == FQ2_0::QK)
        if (type == T_Q2_0) {
            deq_tile_q2c<BK>(w, rb, nrows, k0, n_in, Ws, BM, fac, wlo, lo);
            return;
        }
    switch (type) {
        case T_F32: deq_tile_f<BK, T_F32>(w, rb, nrows, k0, n_in, Ws, BM, fac, wlo, lo); return;
        case T_F16: deq_tile_f<BK, T_F16>(w, rb, nrows, k0, n_in, Ws, BM, fac, wlo, lo); return;
        case T_BF16: deq_tile_f<BK, T_BF16>(w, rb, nrows, k0, n_in, Ws, BM, fac, wlo, lo); return;
        DEQ_Q(T_Q4_0, FQ4_0)
        DEQ_Q(T_Q4_1, FQ4_1)
        DEQ_Q(T_Q5_0, FQ5_0)
        DEQ_Q(T_Q5_1, FQ5_1)
        DEQ_Q(T_Q8_0, FQ8_0)
        DEQ_Q(T_Q2_0, FQ2_0)
        DEQ_Q(T_Q2_K, FQ2_K)
        DEQ_Q(T_Q3_K, FQ3_K)
        DEQ_Q(T_Q4_K, FQ4_K)
        DEQ_Q(T_Q5_K, FQ5_K)
        DEQ_Q(T_Q6_K, FQ6_K)
        DEQ_Q(T_IQ4_NL, FIQ4_NL)
        DEQ_Q(T_IQ4_XS, FIQ4_XS)
    }
#undef DEQ_Q
    for (int i = threadIdx.x; i < BM * BK / 2; i += blockDim.x) {      // an unknown type: f16 NaNs in both halves
        ((u32*)Ws)[i] = 0x7e007e00u;
        ((u32*)((u8*)Ws + lo))[i] = 0x7e007e00u;
    }
    for (int i = threadIdx.x; i < BM; i += blockDim.x) fac[i] = 1.0f;
}

// X rows [n0, n0 + BN) (gathered), elements [k0, k0 + BK), split into Xs (BN rows; the lo halves lo bytes after the
// hi ones); zeros outside; shift[n] each row's power of two. TPR adjacent threads a row (GM_THREADS / BN, at least
// 2: 128-row tiles go in two passes of 64), each taking every TPR-th float4, so a warp's loads cover whole 32-byte
// sectors of its rows. Rows whose stride or start is not 16-byte aligned are read a float at a time.
template <int BK, int BN>
__device__ __forceinline__ void load_x(const float* x, int ldx, const i32* xrow, int n0, int nrows, int k0, int n_in,
                                       float* Xs, int* shift, int lo = Layout<BK>::lo(BN)) {
    constexpr int TPR = GM_THREADS / BN > 2 ? GM_THREADS / BN : 2, PASS = GM_THREADS / TPR, NV = BK / 4 / TPR;
    static_assert(BN % PASS == 0 && NV >= 1 && TPR <= 32, "load_x: threads per row");
    const bool vec = (ldx & 3) == 0 && ((unsigned long long)x & 15) == 0;     // 16-byte rows: float4 loads
    const int h = threadIdx.x % TPR;
#pragma unroll
    for (int n = threadIdx.x / TPR; n < BN; n += PASS) {
        const bool live = n0 + n < nrows;
        const float* xr = x + (live ? (size_t)(xrow != nullptr ? xrow[n0 + n] : n0 + n) * ldx : 0);
        float4 v[NV];
        float m = 0.0f;
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int k = k0 + 4 * (h + TPR * i);
            v[i].x = v[i].y = v[i].z = v[i].w = 0.0f;
            if (live && k < n_in) {
                const float* xp = xr + k;
                if (vec && k + 4 <= n_in) {
                    v[i] = *(const float4*)xp;
                } else {                          // unaligned rows, or the tail of n_in (not a multiple of 4)
                    v[i].x = xp[0];
                    v[i].y = k + 1 < n_in ? xp[1] : 0.0f;
                    v[i].z = k + 2 < n_in ? xp[2] : 0.0f;
                    v[i].w = k + 3 < n_in ? xp[3] : 0.0f;
                }
            }
            m = absmax4(m, v[i]);
        }
#pragma unroll
        for (int o = 1; o < TPR; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        const int s = f16_shift(m);
        const float f = pow2f(s);
#pragma unroll
        for (int i = 0; i < NV; i++) {
            uint2 hi, lo_;
            split4(scale4(v[i], f), hi, lo_);
            const int at = Layout<BK>::off(n, 4 * (h + TPR * i));
            *(uint2*)((u8*)Xs + at) = hi;
            *(uint2*)((u8*)Xs + lo + at) = lo_;
        }
        if (h == 0) shift[n] = s;
    }
}

// Rows prepared by x_split or w_split (gemm.cu: a launch's step rows split once instead of once per M tile, its
// weights once instead of once per N tile): per k-chunk c, the hi plane, the lo plane (rows rows each, in Layout's
// wgmma order) and the rows' shifts (x_split: int32) or factors (w_split: deq_tile's, f32). Rows [r0, r0 + R) of
// a plane are one contiguous span from hi(r0) (r0 a multiple of 8).
template <int BK>
struct XsChunk {
    u8* base;
    size_t plane;           // bytes of a plane: the lo plane is this far after the hi one
    __device__ __forceinline__ XsChunk(const u8* xs, int xs_rows, int c)
        : base((u8*)xs + (size_t)c * ((size_t)xs_rows * 4 * BK + 4 * (size_t)xs_rows)),
          plane((size_t)xs_rows * 2 * BK) {}
    __device__ __forceinline__ u8* hi(int n0) const { return base + (size_t)(n0 / 8) * 16 * BK; }
    __device__ __forceinline__ int* shift(int n0) const { return (int*)(base + 2 * plane) + n0; }
};

// Rows [r0, r0 + R) of chunk k0 / BK of prepared planes into dst (R rows of the tile's Layout; the lo halves only
// when lo_too) by cp.async, and their shifts or factors (4 bytes a row) into shift. The caller waits (stage_wait)
// before the barrier.
template <int BK, int R>
__device__ __forceinline__ void copy_planes(const u8* planes, int rows, int r0, int k0, float* dst, void* shift,
                                            bool lo_too) {
    const XsChunk<BK> c(planes, rows, k0 / BK);
    const u8* src = c.hi(r0);
    constexpr int N16 = R * 2 * BK / 16;                // 16-byte pieces of a plane's rows
    static_assert(R % 4 == 0, "copy_planes: whole 16-byte pieces of shifts");
    const int d = (int)((u8*)dst - SMEM);
    for (int i = threadIdx.x; i < (lo_too ? 2 : 1) * N16; i += GM_THREADS) {
        const int pl = i / N16, j = i % N16;
        cp_async16(d + pl * Layout<BK>::lo(R) + 16 * j, src + pl * c.plane + 16 * j);
    }
    // the shifts too (R 4-byte values, 16-byte aligned on both sides: planes of whole 128-row groups, tiles of
    // LD-float rows)
    const int ds = (int)((u8*)shift - SMEM);
    for (int i = threadIdx.x; i < R / 4; i += GM_THREADS) cp_async16(ds + 16 * i, (const u8*)c.shift(r0) + 16 * i);
}

// A k-chunk's wgmma, issued: per k-step and m64 block, lo(W) hi(X) (when WLO: weights not f16_exact), hi(W) lo(X),
// hi(W) hi(X), the first of the chunk into zeroed sums; HN weight tiles (2: a GLU pair), each its own sums. No branch
// between the MMAs (ptxas would fence the accumulators at each).
template <int BK, int MX, int BN, int HN, bool WLO>
__device__ __forceinline__ void wg_chunk(float (&part)[MX][BN / 8][4], float (&part2)[MX][BN / 8][4],
                                         const float* Ws, const float* Ws2, const float* Xs, int BM) {
    const u32 xh = smem_addr(Xs), xl = xh + Layout<BK>::lo(BN);
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16)
#pragma unroll
        for (int h = 0; h < HN; h++)
#pragma unroll
            for (int i = 0; i < MX; i++) {
                float* c = h ? &part2[i][0][0] : &part[i][0][0];
                const u32 wh = smem_addr(h ? Ws2 : Ws) + i * 128 * BK + 16 * kk, wl = wh + Layout<BK>::lo(BM);
                if (WLO) {
                    if (kk == 0)
                        wg_mma<BN, false>(c, wg_desc(wl, BK), wg_desc(xh, BK));
                    else
                        wg_mma<BN, true>(c, wg_desc(wl, BK), wg_desc(xh + 16 * kk, BK));
                    wg_mma<BN, true>(c, wg_desc(wh, BK), wg_desc(xl + 16 * kk, BK));
                } else if (kk == 0) {
                    wg_mma<BN, false>(c, wg_desc(wh, BK), wg_desc(xl, BK));
                } else {
                    wg_mma<BN, true>(c, wg_desc(wh, BK), wg_desc(xl + 16 * kk, BK));
                }
                wg_mma<BN, true>(c, wg_desc(wh, BK), wg_desc(xh + 16 * kk, BK));
            }
}

// f(r, n, i, j, e) for each accumulator acc[i][j][e] of the thread's fragment (MX m-blocks of rstep rows from
// rbase, NX n8 tiles from cbase): tile row r (weights) and column n (step rows). c[0], c[1]: weight row g, step
// rows 2t, 2t+1; c[2], c[3]: weight row g + 8. (A function template, not a generic lambda: the H200 machine's NVRTC.)
template <int MX, int NX, class F>
__device__ __forceinline__ void frag_each(int rbase, int rstep, int cbase, int g, int t, F f) {
#pragma unroll
    for (int i = 0; i < MX; i++)
#pragma unroll
        for (int j = 0; j < NX; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                f(rbase + i * rstep + g + (e >> 1) * 8, cbase + j * 8 + 2 * t + (e & 1), i, j, e);
}

// The tile [m0, m0 + BM) x [n0, n0 + BN) of one job. GLU jobs (w2 set) need MAY_GLU: the second accumulator set
// costs ~70 registers a thread, which the plain kernels spend on occupancy instead. Shared memory: Ws (BM), Ws2 (BM,
// GLU only), Xs (BN), BK + 4 floats' bytes a row, then the weight rows' factors (f32: BM, BM) and the step rows'
// shifts (int32: BN). xp: the step rows prepared by x_split, this tile's from plane row xp_r0 + n0 (the wgmma tile
// copies them in a GEMM_XPREP build; otherwise, and on the mma.sync tile, whose layout differs, the tile splits x
// itself). wp (wp2: the GLU partner's): the
// weights as w_split prepared them, wp_rows rows a plane (copied in a GEMM_WPREP wgmma build, else decoded here).
// [k_lo, k_hi): the inputs summed (k_lo a multiple of BK; k_hi < 0: to n_in), a slice of a split-K launch.
// mma.sync: warps are WM x WN, each MT m16 tiles by NT n8 tiles. wgmma: the warpgroup takes BM / 64 m64 blocks of
// all BN columns, warp w rows 16w .. 16w + 15 of each; its accumulator fragment is mma.sync's m16n8 one for each
// 8 columns, so the two paths share the epilogue with (MX, NX) the m16-or-m64 blocks and n8 tiles a thread holds.
// PAIR: a GLU job in one accumulator set, for outputs [m0, m0 + BM / 2): the tile's first BM / 2 rows are w's, the
// rest w2's, the same outputs; the products of w2's rows go through shared memory to the threads holding w's. Each
// weight is decoded once per BN step rows with the registers of a plain tile, so BN = 128 fits where the two-set GLU
// tile (twice the accumulators) stays at 64 and decodes every weight twice as often.
template <bool MAY_GLU, int BK, int MT, int NT, int WM, int WN, bool PAIR = false>
__device__ __forceinline__ void gemm_tile(const u8* w, const u8* w2, int type, int type2, int rb, int rb2, int n_in,
                                          int n_out, int m0, const float* x, int ldx, const i32* xrow, int nrows,
                                          int n0, float* y, int ldy, const u8* xp = nullptr, int xp_rows = 0,
                                          int xp_r0 = 0, const u8* wp = nullptr, const u8* wp2 = nullptr,
                                          int wp_rows = 0, int k_lo = 0, int k_hi = -1) {
    constexpr int BM = WM * MT * 16, BN = WN * NT * 8, LD = BK + 4;
    static_assert(WM * WN * 32 == GM_THREADS && NT % 2 == 0 && BK % 16 == 0, "tile");
    constexpr int MX = GM_WG ? BM / 64 : MT, NX = GM_WG ? BN / 8 : NT;
    static_assert(!GM_WG || BM % 64 == 0, "wgmma tile: whole m64 blocks");
    static_assert(!(PAIR && MAY_GLU), "a paired GLU tile has one accumulator set");
    const bool glu = MAY_GLU && w2 != nullptr;
    const bool wlo = !f16_exact(type) || ((glu || PAIR) && !f16_exact(type2));      // the weights' lo halves are used
    const int WT = GM_WG && GEMM_COMPACT_W && !wlo ? BM * BK / 2 : BM * LD;    // a weight tile's floats
    float* Ws = (float*)SMEM;
    float* Ws2 = Ws + WT;
    float* Xs = Ws2 + (glu ? WT : 0);
    float* fa_w = Xs + BN * LD;
    float* fa_w2 = fa_w + BM;
    int* sh_x = (int*)(fa_w2 + BM);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // the first row and column of this thread's fragment in block i, n8 tile j: rbase + i * rstep + g (+ 8), cbase
    // + 8 j + 2 t (+ 1)
    const int rbase = GM_WG ? 16 * warp : (warp % WM) * MT * 16, rstep = GM_WG ? 64 : 16;
    const int cbase = GM_WG ? 0 : (warp / WM) * NT * 8;
    const int R1 = PAIR ? BM / 2 : BM, mrows = min(R1, n_out - m0);     // R1: the rows of w (the rest: w2's)
    const bool wcopy = GM_WG && GEMM_WPREP && !PAIR && wp != nullptr && (!glu || wp2 != nullptr);
    const bool xcopy = GM_WG && GEMM_XPREP && xp != nullptr;
    const int k_end = k_hi < 0 ? n_in : min(k_hi, n_in);
    // chunk k0's weights and rows into shared memory
    auto load = [&](int k0) {
        if (wcopy) {
            copy_planes<BK, BM>(wp, wp_rows, m0, k0, Ws, fa_w, wlo);
            if (glu) copy_planes<BK, BM>(wp2, wp_rows, m0, k0, Ws2, fa_w2, wlo);
        }
        if (xcopy) copy_planes<BK, BN>(xp, xp_rows, xp_r0 + n0, k0, Xs, sh_x, true);
        if (PAIR) {                 // w's rows m0.. in the tile's first half, w2's in the second (never prepared)
            deq_tile<BK>(type, w + (size_t)m0 * rb, rb, mrows, k0, n_in, Ws, BM / 2, fa_w, wlo, Layout<BK>::lo(BM));
            deq_tile<BK>(type2, w2 + (size_t)m0 * rb2, rb2, mrows, k0, n_in,
                         (float*)((u8*)Ws + Layout<BK>::off(BM / 2, 0)), BM / 2, fa_w + BM / 2, wlo,
                         Layout<BK>::lo(BM));
        } else if (!wcopy) {
            deq_tile<BK>(type, w + (size_t)m0 * rb, rb, mrows, k0, n_in, Ws, BM, fa_w, wlo);
            if (glu)
                deq_tile<BK>(type2, w2 + (size_t)m0 * rb2, rb2, mrows, k0, n_in, Ws2, BM, fa_w2, wlo);
        }
        if (!xcopy) load_x<BK, BN>(x, ldx, xrow, n0, nrows, k0, n_in, Xs, sh_x);
        if (wcopy || xcopy) stage_wait();
    };
#if !GM_WG
    constexpr int RB = LD * 4;     // a row's bytes
    // ldmatrix rows of this lane: A (weights) row lane & 15 at k + 8 (lane >> 4); B (step rows) row
    // (lane & 7) + 8 (lane >> 4) at k + 8 ((lane >> 3) & 1): fragments a0..a3, and b0 b1 of two n8 tiles
    const u32 xs = smem_addr(Xs) + (cbase + (lane & 7) + ((lane >> 4) << 3)) * RB + ((lane >> 3) & 1) * 16;
    const u32 ws = smem_addr(Ws) + (rbase + (lane & 15)) * RB + (lane >> 4) * 16;
    const u32 ws2 = ws + BM * RB;
#endif
    float acc[MX][NX][4], acc2[MX][NX][4];
    float part[MX][NX][4], part2[MX][NX][4];
#pragma unroll
    for (int i = 0; i < MX; i++)
#pragma unroll
        for (int j = 0; j < NX; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = acc2[i][j][e] = 0.0f;

    for (int k0 = k_lo; k0 < k_end; k0 += BK) {
        load(k0);
        wg_proxy_fence();
        __syncthreads();
#if GM_WG
        wg_fence();
        if (glu && wlo)
            wg_chunk<BK, MX, BN, 2, true>(part, part2, Ws, Ws2, Xs, BM);
        else if (glu)
            wg_chunk<BK, MX, BN, 2, false>(part, part2, Ws, Ws2, Xs, BM);
        else if (wlo)
            wg_chunk<BK, MX, BN, 1, true>(part, part2, Ws, Ws2, Xs, BM);
        else
            wg_chunk<BK, MX, BN, 1, false>(part, part2, Ws, Ws2, Xs, BM);
        wg_commit();
        wg_wait();
#pragma unroll
        for (int i = 0; i < MX; i++)
#pragma unroll
            for (int j = 0; j < NX; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    wg_pin(part[i][j][e]);
                    if (MAY_GLU) wg_pin(part2[i][j][e]);
                }
#else
#pragma unroll
        for (int i = 0; i < MX; i++)
#pragma unroll
            for (int j = 0; j < NX; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) part[i][j][e] = part2[i][j][e] = 0.0f;
#pragma unroll 2
        for (int kk = 0; kk < BK; kk += 16) {
            u32 bh[NT][2], bl[NT][2];
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                u32 r[4];
                ldsm4(xs + j * 8 * RB + 2 * kk, r);
                bh[j][0] = r[0], bh[j][1] = r[1], bh[j + 1][0] = r[2], bh[j + 1][1] = r[3];
                ldsm4(xs + j * 8 * RB + 2 * BK + 2 * kk, r);
                bl[j][0] = r[0], bl[j][1] = r[1], bl[j + 1][0] = r[2], bl[j + 1][1] = r[3];
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (h == 1 && !glu) break;
#pragma unroll
                for (int i = 0; i < MT; i++) {
                    u32 ah[4], al[4];
                    const u32 wa = (h ? ws2 : ws) + i * 16 * RB + 2 * kk;
                    ldsm4(wa, ah);
                    if (wlo) ldsm4(wa + 2 * BK, al);
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        float* c = h ? part2[i][j] : part[i][j];
                        if (wlo) mma_f16(c, al, bh[j]);
                        mma_f16(c, ah, bl[j]);
                        mma_f16(c, ah, bh[j]);
                    }
                }
            }
        }
#endif
        // the chunk's sums back by its row factors (in turn: no 2^252 factor), added in f32
        float fx[NX][2];
#pragma unroll
        for (int j = 0; j < NX; j++)
#pragma unroll
            for (int c = 0; c < 2; c++) fx[j][c] = pow2f(-sh_x[cbase + j * 8 + 2 * t + c]);
#pragma unroll
        for (int i = 0; i < MX; i++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const float fw = fa_w[rbase + i * rstep + g + 8 * r];
                const float fw2 = glu ? fa_w2[rbase + i * rstep + g + 8 * r] : 0.0f;
#pragma unroll
                for (int j = 0; j < NX; j++)
#pragma unroll
                    for (int c = 0; c < 2; c++) {
                        acc[i][j][2 * r + c] = fmaf(part[i][j][2 * r + c] * fw, fx[j][c], acc[i][j][2 * r + c]);
                        if (glu)
                            acc2[i][j][2 * r + c] =
                                fmaf(part2[i][j][2 * r + c] * fw2, fx[j][c], acc2[i][j][2 * r + c]);
                    }
            }
        __syncthreads();
    }
    if (PAIR) {                 // the second half's sums (w2's rows) through shared memory to the first half's threads
        float* U = (float*)SMEM;        // BM / 2 x BN: the loop's last barrier freed the tile
        frag_each<MX, NX>(rbase, rstep, cbase, g, t, [&](int r, int n, int i, int j, int e) {
            if (r >= BM / 2) U[(r - BM / 2) * BN + n] = acc[i][j][e];
        });
        __syncthreads();
        frag_each<MX, NX>(rbase, rstep, cbase, g, t, [&](int r, int n, int i, int j, int e) {
            if (r < BM / 2 && m0 + r < n_out && n0 + n < nrows)
                y[(size_t)(n0 + n) * ldy + m0 + r] = siluf_(acc[i][j][e]) * U[r * BN + n];
        });
        return;
    }
    frag_each<MX, NX>(rbase, rstep, cbase, g, t, [&](int r, int n, int i, int j, int e) {
        if (m0 + r < n_out && n0 + n < nrows)
            y[(size_t)(n0 + n) * ldy + m0 + r] = glu ? siluf_(acc[i][j][e]) * acc2[i][j][e] : acc[i][j][e];
    });
}
