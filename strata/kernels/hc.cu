// hc.cu: the gated residual ("hyper-connections"): the grouped norm, the low-rank gate with the stream mean,
// and the write with the norm of the next read fused in. R is (hc, E) raw streams, row-major.
#include "quant.cuh"

// xn[s] = RMSNorm(R[s]) * w[s]; grid (hc, rows): R and xn are (rows, hc, E), w is (hc, E). Used where nothing
// before could fuse it: after the PLE block.
extern "C" __global__ void __launch_bounds__(1024) rms_group(const float* __restrict__ R, const float* __restrict__ w,
                                                             float* xn, int E, float eps) {
    __shared__ float red[33];
    pdl_begin();
    const size_t o = ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * E;
    stream_rms(R + o, w + (size_t)blockIdx.x * E, xn + o, E, eps, red);
}

// R[s] += inject_s * out with inject_s = 2 sigmoid(inj_raw[s] / hc) (gr_write), then xn[s] = RMSNorm(R[s]) * w[s]
// (the next gr_read's norm); grid (hc, rows): R, xn (rows, hc, E), inj_raw (rows, hc), out (rows, E). A thread's
// elements stay in its registers (load_own; E <= RMS_BATCH * 1024).
extern "C" __global__ void __launch_bounds__(1024) write_rms(float* R, const float* __restrict__ inj_raw,
                                                             const float* __restrict__ out,
                                                             const float* __restrict__ w, float* xn, int E, int hc,
                                                             float eps) {
    __shared__ float red[33];
    const int s = blockIdx.x, row = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    float wv[RMS_BATCH], a[RMS_BATCH], b[RMS_BATCH];
    load_own(w + (size_t)s * E, E, tid, nt, wv);
    pdl_begin();
    const size_t o = ((size_t)row * hc + s) * E;
    float* r = R + o;
    const float inj_r = inj_raw[row * hc + s];
    load_own(r, E, tid, nt, a);
    load_own(out + (size_t)row * E, E, tid, nt, b);
    const float inj = 2.0f * sigmoidf_(inj_r / (float)hc);
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < RMS_BATCH; u++)
        if (tid + u * nt < E) {
            a[u] = a[u] + inj * b[u];
            r[tid + u * nt] = a[u];
            ss += a[u] * a[u];
        }
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)E + eps);
    scale_own(a, wv, inv, xn + o, E, tid, nt);
}

// The batched gr_read's tail, around a GEMM G = lo @ up^T (rows, hc*E): lo[i] = silu(lo_raw[i] / hc) for the
// n = rows * r values first (hc_lo_act), then mixed[t, e] = mean_s sigmoid(G[t, s*E + e]) * xn[t, s, e] (hc_mix).
extern "C" __global__ void __launch_bounds__(256) hc_lo_act(const float* __restrict__ lo_raw, float* lo, int n,
                                                            int hc) {
    pdl_begin();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        lo[i] = siluf_(lo_raw[i] / (float)hc);
}

extern "C" __global__ void __launch_bounds__(256) hc_mix(const float* __restrict__ G, const float* __restrict__ xn,
                                                         float* mixed, const i32* __restrict__ n_rows, int E, int hc) {
    pdl_begin();
    const int n = *n_rows * E;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int t = i / E, e = i % E;
        float acc = 0.0f;
        for (int s = 0; s < hc; s++)
            acc += sigmoidf_(G[((size_t)t * hc + s) * E + e]) * xn[((size_t)t * hc + s) * E + e];
        mixed[i] = acc / (float)hc;
    }
}

// mixed[e] = mean_s sigmoid(up[s*E + e] . lo) * xn[s, e] with lo = silu(lo_raw / hc) (gr_read's tail).
// A CTA takes G = blockDim / TPG consecutive e: the GEMV core with one row set per stream (rows s*E + e), so a
// thread's lo reads serve the hc rows of its e. lo lives in shared memory after the tiles, zeros up to a multiple
// of 8. hc <= 4.
extern "C" __global__ void __launch_bounds__(256) up_mix(const u8* __restrict__ up, int type, int row_bytes, int r,
                                                         const float* __restrict__ lo_raw,
                                                         const float* __restrict__ xn, float* mixed, int E, int hc,
                                                         int geom) {
    __shared__ float red[4 * 8];
    const int tpg = geom_tpg(geom), G = blockDim.x / tpg;
    const int e0 = blockIdx.x * G, ne = min(G, E - e0);
    Ranges R;
    int end = 0;
#pragma unroll
    for (int s = 0; s < 4; s++) {
        R.src[s] = s < hc ? up + ((size_t)s * E + e0) * row_bytes : nullptr;
        R.n[s] = s < hc ? ne * row_bytes : 0;
        R.dst[s] = end;
        if (s < hc) end = range_end(R, s) + 16;
    }
    stage_constant(R);       // the weights are constant: copied in before pdl_begin, as gemv_jobs does
    float* lo = (float*)(SMEM + end);
    const int rp = (r + 7) & ~7;
    for (int i = threadIdx.x; i < rp; i += blockDim.x) lo[i] = i < r ? siluf_(lo_raw[i] / (float)hc) : 0.0f;
    __syncthreads();
    const int g = threadIdx.x / tpg, l = threadIdx.x % tpg;
    int o[4];
#pragma unroll
    for (int s = 0; s < 4; s++) o[s] = s < hc && g < ne ? range_off(R, s) + g * row_bytes : -1;
    float xv[4];                      // the row's stream values, loaded before the dot so that they arrive under it
#pragma unroll
    for (int s = 0; s < 4; s++) xv[s] = l == 0 && g < ne && s < hc ? xn[(size_t)s * E + e0 + g] : 0.0f;
    float4 a = dot_rows(type, o[0], o[1], o[2], o[3], lo, r, l, tpg);
    a = group_sum(a, tpg, red);
    if (l == 0 && g < ne) {
        float acc = 0.0f;
#pragma unroll
        for (int s = 0; s < 4; s++)
            if (s < hc) acc += sigmoidf_(f4get(a, s)) * xv[s];
        mixed[e0 + g] = acc / (float)hc;
    }
}
