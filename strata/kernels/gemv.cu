// gemv.cu: every dense matrix-vector product of the forward pass, and the embedding lookup.
//
// One launch runs a table of jobs (GemvJob, quant.cuh): the matrices that read the same input (GDN's qkv, gate,
// alpha and beta; QSA's five projections; the router and the shared expert's gate vector) go in one launch.
// A CTA is 8 warps; a job gives each row `wpr` warps (long rows are split so that every lane has >= 2 parts),
// so 8 / wpr rows per CTA. Partial sums meet in a fixed order: the result is deterministic, which is what lets
// a replayed graph equal the eager kernel sequence bit for bit.
#include "quant.cuh"

extern "C" __global__ void __launch_bounds__(256) gemv_jobs(const GemvJob* __restrict__ jobs, int n_jobs) {
    __shared__ float part[8], part2[8];
    int j = 0;
    for (int i = 1; i < n_jobs; i++)
        if (jobs[i].cta0 <= (int)blockIdx.x) j = i;
    const GemvJob J = jobs[j];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rpc = 8 / J.wpr, rl = warp / J.wpr, slice = warp % J.wpr;
    const int row = ((int)blockIdx.x - J.cta0) * rpc + rl;
    const bool glu = J.w2 != nullptr;
    float acc = 0.0f, acc2 = 0.0f;
    if (row < J.n_out) {
        acc = row_dot(J.type, J.w + (size_t)row * J.row_bytes, J.x, J.n_in, slice * 32 + lane, J.wpr * 32);
        if (glu) acc2 = row_dot(J.type2, J.w2 + (size_t)row * J.row_bytes2, J.x, J.n_in, slice * 32 + lane, J.wpr * 32);
    }
    acc = warp_sum(acc);
    acc2 = warp_sum(acc2);
    if (J.wpr > 1) {
        if (lane == 0) {
            part[warp] = acc;
            part2[warp] = acc2;
        }
        __syncthreads();
        if (slice == 0 && lane == 0) {
            acc = 0.0f;
            acc2 = 0.0f;
            for (int s = 0; s < J.wpr; s++) {
                acc += part[rl * J.wpr + s];
                acc2 += part2[rl * J.wpr + s];
            }
        }
    }
    if (slice == 0 && lane == 0 && row < J.n_out) J.y[row] = glu ? siluf_(acc) * acc2 : acc;
}

// R[s] = row step[TOKEN] of the embedding table, dequantized, for every stream s (grid hc); then, when `norm` is
// set, xn[s] = RMSNorm(R[s]) * norm[s]: the first layer's read norm, so pre[0] starts at its projections.
extern "C" __global__ void __launch_bounds__(256) embed_rms(const u8* __restrict__ table, int type, int row_bytes,
                                                           int E, const i32* __restrict__ step, float* R,
                                                           const float* __restrict__ norm, float* xn, float eps) {
    __shared__ float red[33];
    const int s = blockIdx.x;
    const u8* row = table + (size_t)step[STEP_TOKEN] * row_bytes;
    row_deq(type, row, R + (size_t)s * E, E, threadIdx.x, blockDim.x);
    __syncthreads();
    if (norm != nullptr) stream_rms(R + (size_t)s * E, norm + (size_t)s * E, xn + (size_t)s * E, E, eps, red);
}
