// common.cuh: integer types, fp16/bf16 decoding, reductions and activations shared by every kernel file.
//
// NVRTC compiles these sources with no toolkit headers: fp16 is decoded with the PTX `cvt` instruction and bf16
// with a shift, so nothing here needs cuda_fp16.h. No fast-math: expf/sqrtf/cosf are the accurate versions, which
// is what keeps the f32 path within 1e-5 of the numpy reference.
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

#define FULL_MASK 0xffffffffu
#define F_INF __int_as_float(0x7f800000)

// The dynamic shared memory of every kernel, as bytes (one symbol per module, so device functions that index it
// compile to shared-memory loads even when they are not inlined into the kernel). The CPU emulator supplies its own.
#ifdef __CUDACC__
extern __shared__ __align__(16) unsigned char dyn_smem[];
#define SMEM dyn_smem
#else
#define SMEM emu_smem()
#endif

// Asynchronous copies global -> shared (cp.async): a thread's copies since its last commit form a group; a wait
// returns once at most N of its groups are still in flight (wait_all: none, the open copies included), and the
// caller's __syncthreads then covers every thread's. The CPU emulator keeps the copies queued until that wait,
// as the hardware may: a read of a stage before its wait sees the emulator's NaN-filled shared memory.
// N bytes to dynamic shared offset dst: 16 (cp.async.cg, cached in L2 only: weights are read once) or 4
// (cp.async.ca: 4-byte copies cannot bypass L1); both N-aligned.
template <int N>
__device__ __forceinline__ void cp_async_n(int dst, const u8* src) {
    static_assert(N == 16 || N == 4, "cp_async_n: 16 or 4 bytes");
#ifdef __CUDACC__
    u32 d;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(d) : "l"(SMEM + dst));
    if (N == 16) asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
    else asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
#else
    emu_cp_async(SMEM + dst, src, N);
#endif
}
__device__ __forceinline__ void cp_async16(int dst, const u8* src) { cp_async_n<16>(dst, src); }
__device__ __forceinline__ void cp_async4(int dst, const u8* src) { cp_async_n<4>(dst, src); }

// a shared-memory address as the 32-bit offset ldmatrix and cp.async take
__device__ __forceinline__ u32 smem_addr(const void* p) {
#ifdef __CUDACC__
    u32 d;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(d) : "l"(p));
    return d;
#else
    return emu_smem_addr(p);
#endif
}

__device__ __forceinline__ void ldsm4(u32 addr, u32* r) {
#ifdef __CUDACC__
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#else
    emu_ldsm4(addr, r);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef __CUDACC__
    asm volatile("cp.async.commit_group;" ::: "memory");
#else
    emu_cp_commit();
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait_pending() {
#ifdef __CUDACC__
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#else
    emu_cp_wait(N);
#endif
}

// every copy this thread issued has landed
__device__ __forceinline__ void stage_wait() {
#ifdef __CUDACC__
    asm volatile("cp.async.wait_all;" ::: "memory");
#else
    emu_cp_commit();
    emu_cp_wait(0);
#endif
}

// Programmatic dependent launch: wait until the kernels this one depends on have completed and their writes are
// visible, then let the next kernel in the stream be scheduled (its CTAs wait in their own pdl_begin). Every
// kernel calls this before any early return and before touching memory that a kernel writes, so completion stays
// transitive along the stream; only reads of what no kernel writes (a GEMV's weights and job table) may come
// first. Without the launch attribute both instructions are no-ops.
__device__ __forceinline__ void pdl_begin() {
#ifdef __CUDACC__
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// 16 bytes of read-only streaming data (weights): not kept in L1 (x and other reused vectors live there), L2
// fetches 256-byte groups. p is 16-byte aligned.
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 v;
#ifdef __CUDACC__
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
    v = *(const uint4*)p;
#endif
    return v;
}

// a global float read that bypasses L1 (data another CTA of the same kernel wrote, after a fence)
__device__ __forceinline__ float ld_cg(const float* p) {
#ifdef __CUDACC__
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
#else
    return *(volatile const float*)p;
#endif
}

// step[] is the per-token data block filled from pinned staging before the first graph of a token runs.
#define STEP_TOKEN 0      // token id
#define STEP_POS 1        // position of the token in the sequence (= cells already cached)
#define STEP_RING 2       // doorbell sequence value of layer 0 for this token (layer l rings STEP_RING + l)
#define STEP_T 3          // rows of the step (1 on the one-token path); row t is at position STEP_POS + t
#define STEP_L 4          // logit rows of the step
#define STEP_FLAGS 5      // STEP_ROUTE_X: the doorbell's payload carries the routed rows of x (a split step's CPU
#define STEP_ROUTE_X 1    // experts read them; a streamed step's 42 MB a layer at 4096 rows would go unread)
#define STEP_WORDS 8      // then the rows' token ids, then the logit rows (batched steps: see strata/cuda/backend.py)

__device__ __forceinline__ float h2f(u16 h) {
#ifdef __CUDACC__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return emu_half_to_float(h);
#endif
}

__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float((u32)b << 16); }

__device__ __forceinline__ u16 ld16(const u8* p) { return *(const u16*)p; }

// a 32-bit word at a 2-byte aligned address (blocks of 18, 34, 210 ... bytes are only 2-aligned)
__device__ __forceinline__ u32 ld32_a2(const u8* p) {
    const u16* q = (const u16*)p;
    return (u32)q[0] | ((u32)q[1] << 16);
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }
// torch's softplus: linear above threshold 20
__device__ __forceinline__ float softplusf_(float x) { return x > 20.0f ? x : log1pf(expf(fminf(x, 20.0f))); }

// xor butterfly: every lane ends with the same, order-fixed sum (deterministic)
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// The largest / the sum of the values of this lane's aligned group of W lanes (W a power of two up to 32; every
// lane of the warp calls it): one redux instruction from sm_80 on, a butterfly of shuffles elsewhere.
template <int W>
__device__ __forceinline__ u32 lanes_max_u32(u32 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const u32 mask = W == 32 ? FULL_MASK : ((1u << (W & 31)) - 1) << (threadIdx.x & 31 & ~(W - 1));
    u32 r;
    asm volatile("redux.sync.max.u32 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(mask));
    return r;
#else
#pragma unroll
    for (int o = W / 2; o > 0; o >>= 1) v = max(v, (u32)__shfl_xor_sync(FULL_MASK, v, o));
    return v;
#endif
}

template <int W>
__device__ __forceinline__ int lanes_sum(int v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const u32 mask = W == 32 ? FULL_MASK : ((1u << (W & 31)) - 1) << (threadIdx.x & 31 & ~(W - 1));
    int r;
    asm volatile("redux.sync.add.s32 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(mask));
    return r;
#else
#pragma unroll
    for (int o = W / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
#endif
}

// Sum over the whole block (blockDim a multiple of 32, at most 1024); every thread gets the result.
// `red` is 33 floats of shared memory; the call starts and ends with a barrier so `red` can be reused.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int tid = threadIdx.x + threadIdx.y * blockDim.x;
    const int nw = (blockDim.x * blockDim.y) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if ((tid & 31) == 0) red[tid >> 5] = v;
    __syncthreads();
    if (tid < 32) {
        float s = tid < nw ? red[tid] : 0.0f;
        s = warp_sum(s);
        if (tid == 0) red[32] = s;
    }
    __syncthreads();
    return red[32];
}

__device__ __forceinline__ float block_max(float v, float* red) {
    const int tid = threadIdx.x + threadIdx.y * blockDim.x;
    const int nw = (blockDim.x * blockDim.y) >> 5;
    v = warp_max(v);
    __syncthreads();
    if ((tid & 31) == 0) red[tid >> 5] = v;
    __syncthreads();
    if (tid < 32) {
        float s = tid < nw ? red[tid] : -F_INF;
        s = warp_max(s);
        if (tid == 0) red[32] = s;
    }
    __syncthreads();
    return red[32];
}

// NEOX RoPE on the first n_rot dims of v (shared memory, length >= n_rot): pairs (i, i + n_rot/2).
// Angles are float32 pos * inv_freq[i] like strata.reference.common.rope; cosf/sinf are the accurate ones.
__device__ __forceinline__ void rope_neox(float* v, int n_rot, int pos, const float* inv_freq) {
    const int half = n_rot >> 1;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float ang = (float)pos * inv_freq[i];
        const float c = cosf(ang), s = sinf(ang);
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c - x2 * s;
        v[i + half] = x2 * c + x1 * s;
    }
    __syncthreads();
}

// A thread's elements of a stream (e = tid, tid + nt, ... < E) go in rounds of RMS_BATCH whose loads are all issued
// before any store: one element a round, a round's store to memory the next round's loads may alias kept those
// loads behind it, an L2 round trip per element on the small kernels' path (write_rms 6 us on the H100, bench/
// RESULTS.md "ninth session").
#define RMS_BATCH 4

// f(e, x[e], y[e]) for this thread's elements, RMS_BATCH elements' loads issued before any f runs
template <typename F>
__device__ __forceinline__ void batched_pairs(const float* x, const float* y, int E, int tid, int nt, F f) {
    for (int e0 = tid; e0 < E; e0 += RMS_BATCH * nt) {
        float a[RMS_BATCH], b[RMS_BATCH];
#pragma unroll
        for (int u = 0; u < RMS_BATCH; u++)
            if (e0 + u * nt < E) {
                a[u] = x[e0 + u * nt];
                b[u] = y[e0 + u * nt];
            }
#pragma unroll
        for (int u = 0; u < RMS_BATCH; u++)
            if (e0 + u * nt < E) f(e0 + u * nt, a[u], b[u]);
    }
}

// The small kernels that end in a stream's norm (write_rms, combine_write_rms) hold a thread's elements of the
// stream (e = tid + u nt, u < RMS_BATCH; E <= RMS_BATCH nt, their launchers check) in registers: the norm weights,
// constant, read before pdl_begin (under the previous kernel's tail), and the new stream values, so that the norm's
// scale needs no second round trip to memory for either.
__device__ __forceinline__ void load_own(const float* __restrict__ w, int E, int tid, int nt, float (&v)[RMS_BATCH]) {
#pragma unroll
    for (int u = 0; u < RMS_BATCH; u++) v[u] = tid + u * nt < E ? w[tid + u * nt] : 0.0f;
}

// out[e] = (v * inv) * w over this thread's elements (their values v and weights w held as load_own's)
__device__ __forceinline__ void scale_own(const float (&v)[RMS_BATCH], const float (&w)[RMS_BATCH], float inv,
                                          float* out, int E, int tid, int nt) {
#pragma unroll
    for (int u = 0; u < RMS_BATCH; u++)
        if (tid + u * nt < E) out[tid + u * nt] = (v[u] * inv) * w[u];
}

// out[e] = (r[e] * inv) * w[e] over this thread's elements
__device__ __forceinline__ void scale_into(const float* r, const float* w, float inv, float* out, int E, int tid,
                                           int nt) {
    batched_pairs(r, w, E, tid, nt, [&](int e, float a, float b) { out[e] = (a * inv) * b; });
}

// out[e] = r[e] / sqrt(mean(r^2) + eps) * w[e] over one stream of E values, by the whole block (the reference's
// x * (1 / sqrt(mean + eps)) * w order). Returns nothing; `red` as for block_sum.
__device__ __forceinline__ void stream_rms(const float* r, const float* w, float* out, int E, float eps, float* red) {
    const int tid = threadIdx.x + threadIdx.y * blockDim.x, nt = blockDim.x * blockDim.y;
    float ss = 0.0f;
    for (int e = tid; e < E; e += nt) ss += r[e] * r[e];
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)E + eps);
    scale_into(r, w, inv, out, E, tid, nt);
}
