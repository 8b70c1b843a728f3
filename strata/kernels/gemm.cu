// gemm.cu: the batched step's dense matrix products on the tensor cores (the tile: gemm.cuh), every block format
// the GEMV takes, several matrices reading the same rows in one launch.
#include "gemm.cuh"

// Layout must match strata/kernels/gemm.py (GEMM_JOB_DTYPE): 120 bytes.
struct GemmJob {
    const u8* w;          // n_out rows of row_bytes
    const u8* w2;         // GLU partner, or null
    const float* x;       // rows of ldx floats, 16-byte aligned
    float* y;             // rows of ldy floats
    const i32* xrow;      // row n reads x[xrow[n]] (null: x[n])
    i32 type, type2, n_in, n_out, row_bytes, row_bytes2;
    i32 ldx, ldy;
    i32 pad0, pad1;       // (a job's first M tile is counted on the device: the tile's BM differs by bucket of
                          // rows, and one table serves every bucket)
    const u8* xs;         // x as x_split prepared it for this launch's k-chunk (null: the tile splits x)
    i32 xs_rows, pad2;    // rows of xs's planes
    const u8* ws;         // w (and w2) as w_split prepared them (null: the tile decodes them)
    const u8* ws2;
    i32 ws_rows, pad3;    // rows of their planes
};

// Dense jobs of one step: grid (sum of the jobs' M tiles, ceil(max rows / BN), ks); the step's row count is device
// data (*n_rows), so a graph captured for a bucket of rows serves every count up to it. swz > 0: the CTAs, in launch
// order, walk groups of swz M tiles, each group over every N tile before the next (what keeps prepared weights'
// planes in L2 across the N tiles: gemm.cuh GEMM_WPREP); 0: M tiles fastest. ks > 1 (split-K, plain jobs only:
// gemm.py k_slices): slice z = blockIdx.z sums its share of the k-chunks into part, a [ks][part_rows][part_ld]
// array with the jobs' outputs side by side in job order, and gemm_ksum adds the slices into each job's y.
template <bool MAY_GLU, int BK, int MT, int NT, int WM, int WN>
__device__ __forceinline__ void gemm_jobs_body(const GemmJob* __restrict__ jobs, int n_jobs,
                                               const i32* __restrict__ n_rows, int swz, float* part, int ks,
                                               int part_ld, int part_rows) {
    constexpr int BM = WM * MT * 16, BN = WN * NT * 8;
    pdl_begin();
    int bx = (int)blockIdx.x, by = (int)blockIdx.y;
    if (swz > 0) {
        const int nm = (int)gridDim.x, l = bx + nm * by, span = swz * (int)gridDim.y, g = l / span;
        const int gm = min(swz, nm - g * swz), in = l - g * span;
        bx = g * swz + in % gm;
        by = in / gm;
    }
    const int nrows = *n_rows, n0 = by * BN;
    if (n0 >= nrows) return;
    int j = 0, cta0 = 0, col0 = 0;
    for (int i = 0, c = 0, o = 0; i < n_jobs; c += (jobs[i].n_out + BM - 1) / BM, o += jobs[i].n_out, i++)
        if (c <= bx) j = i, cta0 = c, col0 = o;
    const GemmJob J = jobs[j];
    const int m0 = (bx - cta0) * BM;
    float* y = J.y;
    int ldy = J.ldy, k_lo = 0, k_hi = -1;
    if (ks > 1) {
        const int z = (int)blockIdx.z, per = ((J.n_in + BK - 1) / BK + ks - 1) / ks * BK;
        k_lo = z * per;
        k_hi = k_lo + per;
        y = part + (size_t)z * part_rows * part_ld + col0;
        ldy = part_ld;
    }
    gemm_tile<MAY_GLU, BK, MT, NT, WM, WN>(J.w, J.w2, J.type, J.type2, J.row_bytes, J.row_bytes2, J.n_in, J.n_out,
                                           m0, J.x, J.ldx, J.xrow, nrows, n0, y, ldy, J.xs, J.xs_rows, 0, J.ws,
                                           J.ws2, J.ws_rows, k_lo, k_hi);
}

// A split-K launch's slices added in order (deterministic) into each job's y: grid (ceil(part_ld / 256), rows),
// 256 threads; row r's column c of part belongs to the job whose outputs cover it (gemm_jobs_body's layout).
extern "C" __global__ void __launch_bounds__(256)
    gemm_ksum(const GemmJob* __restrict__ jobs, int n_jobs, const i32* __restrict__ n_rows,
              const float* __restrict__ part, int ks, int part_ld, int part_rows) {
    pdl_begin();
    const int r = (int)blockIdx.y, c = (int)blockIdx.x * 256 + (int)threadIdx.x;
    if (r >= *n_rows || c >= part_ld) return;
    float v = 0.0f;
    for (int z = 0; z < ks; z++) v += part[((size_t)z * part_rows + r) * part_ld + c];
    int j = 0, col0 = 0;
    for (int i = 0, o = 0; i < n_jobs; o += jobs[i].n_out, i++)
        if (o <= c) j = i, col0 = o;
    jobs[j].y[(size_t)r * jobs[j].ldy + c - col0] = v;
}

// BN = 128 (prefill chunks' plain jobs: 64 weight rows a tile), BN = 64 (GLU jobs, or GEMM_WIDE_N=0) and BN = 16
// (a few rows: decode batches, small experts' groups), each at BK 64 and 128, without and with GLU jobs (gemm.py
// picks the _glu kernel for a launch that has one); the plain BN = 64 tiles take 128 weight rows, or 64 (_m64) over
// matrices with few outputs (gemm.py tile_bm)
#define GEMM_JOBS(NAME, GLU, BK, MT, NT, WM, WN)                                                              \
    extern "C" __global__ void __launch_bounds__(GM_THREADS, GM_MIN_CTAS(GLU, BK, MT))                        \
        NAME(const GemmJob* __restrict__ jobs, int n_jobs, const i32* __restrict__ n_rows, int swz, float* part, \
             int ks, int part_ld, int part_rows) {                                                            \
        gemm_jobs_body<GLU, BK, MT, NT, WM, WN>(jobs, n_jobs, n_rows, swz, part, ks, part_ld, part_rows);     \
    }
GEMM_JOBS(gemm_jobs16_k64, false, 64, 1, 2, 4, 1)
GEMM_JOBS(gemm_jobs16_k128, false, 128, 1, 2, 4, 1)
GEMM_JOBS(gemm_jobs64_k64, false, 64, 4, 4, 2, 2)
GEMM_JOBS(gemm_jobs64_k128, false, 128, 4, 4, 2, 2)
GEMM_JOBS(gemm_jobs64_k64_m64, false, 64, 2, 4, 2, 2)
GEMM_JOBS(gemm_jobs64_k128_m64, false, 128, 2, 4, 2, 2)
GEMM_JOBS(gemm_jobs128_k64, false, 64, 4, 4, 1, 4)
GEMM_JOBS(gemm_jobs128_k128, false, 128, 4, 4, 1, 4)
GEMM_JOBS(gemm_jobs16_k64_glu, true, 64, 1, 2, 4, 1)
GEMM_JOBS(gemm_jobs16_k128_glu, true, 128, 1, 2, 4, 1)
GEMM_JOBS(gemm_jobs64_k64_glu, true, 64, 2, 4, 2, 2)
GEMM_JOBS(gemm_jobs64_k128_glu, true, 128, 2, 4, 2, 2)

// A launch's step rows split once for all its M tiles (gemm.py GEMM_XPREP; the wgmma tile's Layout): per k-chunk c
// of x (rows, ldx), xs holds the hi plane and the lo plane of xs_rows rows each, then their shifts (int32); rows
// past *n_rows are zeros. grid (ceil(rows / 64), chunks), GM_THREADS threads: load_x's split, into device memory.
template <int BK>
__device__ __forceinline__ void x_split_body(const float* __restrict__ x, int ldx, int n_in,
                                             const i32* __restrict__ n_rows, u8* xs, int xs_rows) {
    pdl_begin();
    const XsChunk<BK> c(xs, xs_rows, (int)blockIdx.y);
    const int n0 = (int)blockIdx.x * 64;
    load_x<BK, 64>(x, ldx, nullptr, n0, *n_rows, (int)blockIdx.y * BK, n_in, (float*)c.hi(n0), c.shift(n0),
                   (int)c.plane);
}

#define X_SPLIT(BK)                                                                                           \
    extern "C" __global__ void __launch_bounds__(GM_THREADS) x_split_k##BK(                                  \
        const float* __restrict__ x, int ldx, int n_in, const i32* __restrict__ n_rows, u8* xs, int xs_rows) { \
        x_split_body<BK>(x, ldx, n_in, n_rows, xs, xs_rows);                                                  \
    }
X_SPLIT(64)
X_SPLIT(128)

// w_split: one matrix's rows decoded (gemm_tile's own decode, deq_tile) and split once for a launch, in x_split's
// plane format (XsChunk: ws_rows rows a plane, a multiple of 128; rows past n_out zeros), with the rows' f32 factors
// where x_split has shifts. grid (ws_rows / 64, chunks), GM_THREADS threads. Both halves are written whatever the
// type: a GLU tile whose partner is not f16-exact reads an exact matrix's lo halves too.
template <int BK>
__device__ __forceinline__ void w_split_body(const u8* __restrict__ w, int type, int rb, int n_out, int n_in, u8* ws,
                                             int ws_rows) {
    pdl_begin();
    const XsChunk<BK> c(ws, ws_rows, (int)blockIdx.y);
    const int m0 = (int)blockIdx.x * 64;
    deq_tile<BK>(type, w + (size_t)min(m0, n_out) * rb, rb, n_out - m0, (int)blockIdx.y * BK, n_in,
                 (float*)c.hi(m0), 64, (float*)c.shift(m0), true, (int)c.plane);
}

#define W_SPLIT(BK)                                                                                           \
    extern "C" __global__ void __launch_bounds__(GM_THREADS) w_split_k##BK(                                  \
        const u8* __restrict__ w, int type, int rb, int n_out, int n_in, u8* ws, int ws_rows) {               \
        w_split_body<BK>(w, type, rb, n_out, n_in, ws, ws_rows);                                              \
    }
W_SPLIT(64)
W_SPLIT(128)
