// hc.cu: the gated residual ("hyper-connections"): the grouped norm, the low-rank gate with the stream mean,
// and the write with the norm of the next read fused in. R is (hc, E) raw streams, row-major.
#include "quant.cuh"

// xn[s] = RMSNorm(R[s]) * w[s]; grid hc (used where nothing before could fuse it: after the PLE block)
extern "C" __global__ void __launch_bounds__(1024) rms_group(const float* __restrict__ R, const float* __restrict__ w,
                                                             float* xn, int E, float eps) {
    __shared__ float red[33];
    const size_t o = (size_t)blockIdx.x * E;
    stream_rms(R + o, w + o, xn + o, E, eps, red);
}

// R[s] += inject_s * out with inject_s = 2 sigmoid(inj_raw[s] / hc) (gr_write), then xn[s] = RMSNorm(R[s]) * w[s]
// (the next gr_read's norm); grid hc. Each thread re-reads only what it wrote itself.
extern "C" __global__ void __launch_bounds__(1024) write_rms(float* R, const float* __restrict__ inj_raw,
                                                             const float* __restrict__ out,
                                                             const float* __restrict__ w, float* xn, int E, int hc,
                                                             float eps) {
    __shared__ float red[33];
    const int s = blockIdx.x;
    const float inj = 2.0f * sigmoidf_(inj_raw[s] / (float)hc);
    float* r = R + (size_t)s * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) r[e] = r[e] + inj * out[e];
    __syncthreads();
    stream_rms(r, w + (size_t)s * E, xn + (size_t)s * E, E, eps, red);
}

// mixed[e] = mean_s sigmoid(up[s*E + e] . lo) * xn[s, e] with lo = silu(lo_raw / hc) (gr_read's tail).
// lo (r values) is staged in shared memory with zeros up to a multiple of 8; one warp per e, 8 per CTA.
extern "C" __global__ void __launch_bounds__(256) up_mix(const u8* __restrict__ up, int type, int row_bytes, int r,
                                                         const float* __restrict__ lo_raw,
                                                         const float* __restrict__ xn, float* mixed, int E, int hc) {
    extern __shared__ __align__(16) float lo[];
    const int rp = (r + 7) & ~7;
    for (int i = threadIdx.x; i < rp; i += blockDim.x) lo[i] = i < r ? siluf_(lo_raw[i] / (float)hc) : 0.0f;
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = blockIdx.x * 8 + warp;
    if (e >= E) return;
    float acc = 0.0f;
    for (int s = 0; s < hc; s++) {
        const float d = warp_sum(row_dot(type, up + (size_t)(s * E + e) * row_bytes, lo, r, lane, 32));
        acc += sigmoidf_(d) * xn[(size_t)s * E + e];
    }
    if (lane == 0) mixed[e] = acc / (float)hc;
}
