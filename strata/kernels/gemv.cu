// gemv.cu: every dense matrix-vector product of the forward pass, and the embedding lookup.
//
// One launch runs a table of jobs: the matrices that read the same input (GDN's qkv, gate, alpha and beta; QSA's
// five projections; the router, the shared expert's gate vector and its gate/up pair) go in one launch. A tile of
// one job is RT = G * RR consecutive rows staged in shared memory (quant.cuh, the GEMV core) and computed by a CTA
// of 256 threads, thread group g of TPG threads owning rows g, g + G, ... of the tile. Partial sums meet in a fixed
// order: the result is deterministic, which is what lets a replayed graph equal the eager sequence bit for bit.
#include "quant.cuh"

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
    i32 geom;            // log2(TPG) | RR << 4 (quant.cuh geom_*); tile rows RT = 256 / TPG * RR
};

// A launch runs fewer CTAs than tiles (gemv.py gemv_launch: those that fit on the GPU at once), and each CTA walks
// its tiles t = blockIdx.x, + gridDim.x, ... through GEMV_STAGES shared-memory buffers of `stage_bytes`: the copies of
// the next GEMV_STAGES - 1 tiles are in flight while this one is computed. One tile a CTA, copy then compute, left
// every multiprocessor's memory pipe idle while it computed, and the last partial wave idle for a whole tile.
__device__ __forceinline__ int tile_job(const GemvJob* __restrict__ jobs, int n_jobs, int t) {
    int j = 0;
    for (int i = 1; i < n_jobs; i++)
        if (jobs[i].cta0 <= t) j = i;
    return j;
}

// tile t's first row and row count
__device__ __forceinline__ void tile_rows(const GemvJob& J, int t, int& row0, int& nrows) {
    const int RT = (int)blockDim.x / geom_tpg(J.geom) * geom_rr(J.geom);
    row0 = (t - J.cta0) * RT;
    nrows = min(RT, J.n_out - row0);
}

// whether job J reads x's integer limbs (quant.cuh int_type; either matrix of a GLU pair)
__device__ __forceinline__ bool reads_xq(const GemvJob& J) {
    return !geom_f32(J.geom) && (int_type(J.type) || (J.w2 != nullptr && int_type(J.type2)));
}

// tile t's weight rows (both matrices of a GLU pair) as the ranges of the buffer at shared offset `base`
__device__ __forceinline__ Ranges tile_ranges(const GemvJob& J, int t, int base) {
    int row0, nrows;
    tile_rows(J, t, row0, nrows);
    const bool glu = J.w2 != nullptr;
    return ranges2(J.w + (size_t)row0 * J.row_bytes, nrows * J.row_bytes,
                   glu ? J.w2 + (size_t)row0 * J.row_bytes2 : nullptr, glu ? nrows * J.row_bytes2 : 0, base);
}

// the copies of tile t (when it exists) into buffer t's stage, as one cp.async group (empty past the last tile,
// so that the group count a wait counts on stays the same)
__device__ __forceinline__ void tile_issue(const GemvJob* __restrict__ jobs, int n_jobs, int n_tiles, int t, int k,
                                           int stage_bytes) {
    if (t < n_tiles) stage_issue(tile_ranges(jobs[tile_job(jobs, n_jobs, t)], t, (k % GEMV_STAGES) * stage_bytes));
    cp_async_commit();
}

#define GEMV_MAX_JOBS 8     // jobs in one launch (gemv.py GEMV_MAX_JOBS checks)
extern "C" __global__ void __launch_bounds__(256, GEMV_MIN_CTAS) gemv_jobs(const GemvJob* __restrict__ jobs_g,
                                                                          int n_jobs, int n_tiles, int stage_bytes) {
    __shared__ float red[4 * 8];
    // The job table in shared memory: every tile looks its job up twice (its copies, its compute), each a chain of
    // dependent loads from global memory otherwise (0.3-0.5 us a launch of the flash matrices on the H100,
    // bench/RESULTS.md "tenth session").
    __shared__ GemvJob sjobs[GEMV_MAX_JOBS];
    for (int i = threadIdx.x; i < n_jobs * (int)(sizeof(GemvJob) / 4); i += blockDim.x)
        ((u32*)sjobs)[i] = ((const u32*)jobs_g)[i];
    __syncthreads();
    const GemvJob* __restrict__ jobs = sjobs;
    // The job table and the weights never change while a graph runs, so it and the first tiles' copies are read
    // and issued before pdl_begin: they overlap the previous kernel's tail. x, its output, is read only after.
    if (!GEMV_EARLY_STAGE) pdl_begin();
#pragma unroll
    for (int k = 0; k < GEMV_STAGES - 1; k++)
        tile_issue(jobs, n_jobs, n_tiles, blockIdx.x + k * gridDim.x, k, stage_bytes);
    if (GEMV_EARLY_STAGE) pdl_begin();

    // the integer path's x limbs, after the ring; the first tile's made while its copies are in flight (the loop's
    // first barrier orders them before any read)
    const int xo = GEMV_STAGES * stage_bytes;
    const float* xq_of = nullptr;                        // the x they hold
    if ((int)blockIdx.x < n_tiles) {
        const GemvJob& J = jobs[tile_job(jobs, n_jobs, blockIdx.x)];
        if (reads_xq(J)) {
            xq_prep(J.x, J.n_in, xo);
            xq_of = J.x;
        }
    }
    int k = 0;
    for (int t = blockIdx.x; t < n_tiles; t += gridDim.x, k++) {
        cp_async_wait_pending<GEMV_STAGES - 2>();      // this thread's copies of tile k are in
        __syncthreads();                               // everyone's are, and everyone is done with tile k - 1
        // tile k + STAGES - 1 goes into the buffer tile k - 1 used
        tile_issue(jobs, n_jobs, n_tiles, t + (GEMV_STAGES - 1) * gridDim.x, k + GEMV_STAGES - 1, stage_bytes);

        const GemvJob J = jobs[tile_job(jobs, n_jobs, t)];
        const int tpg = geom_tpg(J.geom), rr = geom_rr(J.geom), G = blockDim.x / tpg;
        int row0, nrows;
        tile_rows(J, t, row0, nrows);
        const bool glu = J.w2 != nullptr;
        const Ranges R = tile_ranges(J, t, (k % GEMV_STAGES) * stage_bytes);
        if (reads_xq(J) && J.x != xq_of) {               // uniform over the CTA: every thread reads the same job
            xq_prep(J.x, J.n_in, xo);
            xq_of = J.x;
            __syncthreads();
        }
        const int g = threadIdx.x / tpg, l = threadIdx.x % tpg;
        int o[4], o2[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int r = q * G + g;          // row of the tile
            const bool ok = q < rr && r < nrows;
            o[q] = ok ? range_off(R, 0) + r * J.row_bytes : -1;
            o2[q] = ok && glu ? range_off(R, 1) + r * J.row_bytes2 : -1;
        }
        // the limbs are in the natural layout (1) whenever a format of this job reads them, none for an f32 job
        const int lay = geom_f32(J.geom) ? 0 : 1;
        float4 a = dot_rows_x(J.type, lay, o[0], o[1], o[2], o[3], J.x, xo, J.n_in, l, tpg);
        a = group_sum(a, tpg, red);
        float4 b = a;
        if (glu) {
            b = dot_rows_x(J.type2, lay, o2[0], o2[1], o2[2], o2[3], J.x, xo, J.n_in, l, tpg);
            b = group_sum(b, tpg, red);
        }
        if (l == 0) {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int r = q * G + g;
                if (q < rr && r < nrows) J.y[row0 + r] = glu ? siluf_(f4get(a, q)) * f4get(b, q) : f4get(a, q);
            }
        }
    }
    cp_async_wait_pending<0>();                        // no copy outlives the CTA (the empty groups past the end)
}

// R[t, s] = row step[WORDS + t] (row t's token) of the embedding table, dequantized, for every stream s; grid
// (hc, rows), rows past step[T] do nothing. When `norm` is set, xn[t, s] = RMSNorm(R[t, s]) * norm[s]: the first
// layer's read norm, so pre[0] starts at its projections.
extern "C" __global__ void __launch_bounds__(256) embed_rms(const u8* __restrict__ table, int type, int row_bytes,
                                                           int E, const i32* __restrict__ step, float* R,
                                                           const float* __restrict__ norm, float* xn, float eps) {
    __shared__ float red[33];
    pdl_begin();
    const int s = blockIdx.x, t = blockIdx.y;
    if (t >= step[STEP_T]) return;
    const u8* row = table + (size_t)step[STEP_WORDS + t] * row_bytes;
    const size_t o = ((size_t)t * gridDim.x + s) * E;
    row_deq(type, row, R + o, E, threadIdx.x, blockDim.x);
    __syncthreads();
    if (norm != nullptr) stream_rms(R + o, norm + (size_t)s * E, xn + o, E, eps, red);
}

// dst[i] = src[idx[i]] for rows of n floats, i < *n_rows (the head's logit rows of a batched step)
extern "C" __global__ void __launch_bounds__(256) gather_rows(const float* __restrict__ src, float* dst,
                                                              const i32* __restrict__ idx,
                                                              const i32* __restrict__ n_rows, int n) {
    pdl_begin();
    const int m = *n_rows;
    for (int i = blockIdx.y; i < m; i += gridDim.y)
        for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x)
            dst[(size_t)i * n + e] = src[(size_t)idx[i] * n + e];
}

// dst[i] = src[i] for n words, src in mapped pinned host memory (read over PCIe by this kernel): the small host
// tables a step or token needs on the device (the step words, the PLE vector, a streamed layer's slot table, a
// mapped token's expert addresses), on the compute stream. A copy engine's copy of them queued behind the side
// stream's expert copies (a streamed layer's 512 experts, a mapped token's promotions): 1 ms a token and ~9 ms a
// streamed layer on the H100 (bench/RESULTS.md, 2026-12-05 seventh session). The read comes before pdl_begin: no
// kernel writes the host's staging; the store waits for the kernels before.
extern "C" __global__ void __launch_bounds__(256) host_copy(unsigned* dst, const unsigned* __restrict__ src, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned v = i < n ? src[i] : 0u;
    pdl_begin();
    if (i < n) dst[i] = v;
}

// Programmatic-launch probe (strata.cuda.launch): b[i] = a[i] + 1 after a kernel that wrote a[i] = i slowly.
extern "C" __global__ void __launch_bounds__(256) pdl_probe_a(float* a, int n, int spin) {
    pdl_begin();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = (float)i;
    for (int k = 0; k < spin; k++) v = v * 1.0000001f - (float)i * 1e-7f;
    if (i < n) a[i] = v - v + (float)i;
}

extern "C" __global__ void __launch_bounds__(256) pdl_probe_b(const float* a, float* b, int n) {
    pdl_begin();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) b[i] = a[i] + 1.0f;
}
