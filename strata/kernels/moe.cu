// moe.cu: the router with its doorbell, the VRAM-resident routed experts, and the combine that ends post[l].
#include "quant.cuh"

// Softmax over the router logits, the top k by probability (ties to the lower expert id, like numpy's stable
// argsort), weights renormalized to sum 1 -> ids[k], wts[k]. One CTA, one thread per expert (n_exp <= 1024).
// Then the doorbell, when db_seq is set: x (the MoE input), ids and weights go to mapped pinned host memory,
// every writer fences system-wide, the block syncs, and thread 0 stores the sequence value step[RING] + layer with
// a volatile store. The host polls that value; a value it sees means the payload before it is in place.
extern "C" __global__ void __launch_bounds__(1024) moe_route(
    const float* __restrict__ logits, const float* __restrict__ x, i32* ids, float* wts, float* db_x, i32* db_ids,
    float* db_wts, volatile u32* db_seq, const i32* __restrict__ step, int layer, int n_exp, int k, int E) {
    __shared__ float p[1024];
    __shared__ float pk[64];
    __shared__ float red[33];
    const int i = threadIdx.x;
    const float li = i < n_exp ? logits[i] : -F_INF;
    const float mx = block_max(li, red);
    const float ei = i < n_exp ? expf(li - mx) : 0.0f;
    const float sum = block_sum(ei, red);
    const float pi = ei / sum;
    if (i < n_exp) p[i] = pi;
    __syncthreads();
    if (i < n_exp) {
        int rank = 0;
        for (int j = 0; j < n_exp; j++) rank += p[j] > pi || (p[j] == pi && j < i);
        if (rank < k) {
            ids[rank] = i;
            pk[rank] = pi;
        }
    }
    __syncthreads();
    if (i == 0) {
        float s = 0.0f;
        for (int r = 0; r < k; r++) s += pk[r];
        red[0] = s;
    }
    __syncthreads();
    if (i < k) wts[i] = pk[i] / red[0];
    if (db_seq == nullptr) return;
    __syncthreads();
    for (int e = i; e < E; e += blockDim.x) db_x[e] = x[e];
    if (i < k) {
        db_ids[i] = ids[i];
        db_wts[i] = wts[i];
    }
    __threadfence_system();
    __syncthreads();
    if (i == 0) *db_seq = (u32)(step[STEP_RING] + layer);
}

// The routed experts' weights: expert slot s's gate, up and down matrices start at base + s * stride (a layer's
// stacked GGUF tensors when every expert is resident, the cache's slots otherwise).
// Layout must match strata/kernels/moe.py (MOE_JOB_DTYPE): 96 bytes.
struct MoeJob {
    const u8* g_base;
    const u8* u_base;
    const u8* d_base;
    i64 g_stride, u_stride, d_stride;
    i32 type_g, type_u, type_d;
    i32 rb_g, rb_u, rb_d;
    i32 E, F, Fp;          // Fp: the row stride of h, F rounded up to 8 (16-byte aligned rows)
    i32 wpr_gu, wpr_d;     // warps per row of the two launches
    i32 pad;
};

// h[j, r] = silu(gate_j[r] . x) * (up_j[r] . x) for every selected expert j whose slot is >= 0 (a GPU expert);
// grid (ceil(F / (8 / wpr)), k). slots[j] < 0: the host computes expert j, this CTA has nothing to do.
extern "C" __global__ void __launch_bounds__(256) moe_gate_up(const MoeJob* __restrict__ job,
                                                              const i32* __restrict__ slots,
                                                              const float* __restrict__ x, float* h) {
    __shared__ float part[8], part2[8];
    const MoeJob J = *job;
    const int slot = slots[blockIdx.y];
    if (slot < 0) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wpr = J.wpr_gu, rl = warp / wpr, sl = warp % wpr, row = blockIdx.x * (8 / wpr) + rl;
    float a = 0.0f, b = 0.0f;
    if (row < J.F) {
        a = row_dot(J.type_g, J.g_base + slot * J.g_stride + (size_t)row * J.rb_g, x, J.E, sl * 32 + lane, wpr * 32);
        b = row_dot(J.type_u, J.u_base + slot * J.u_stride + (size_t)row * J.rb_u, x, J.E, sl * 32 + lane, wpr * 32);
    }
    a = warp_sum(a);
    b = warp_sum(b);
    if (wpr > 1) {
        if (lane == 0) {
            part[warp] = a;
            part2[warp] = b;
        }
        __syncthreads();
        if (sl == 0 && lane == 0) {
            a = 0.0f;
            b = 0.0f;
            for (int s = 0; s < wpr; s++) {
                a += part[rl * wpr + s];
                b += part2[rl * wpr + s];
            }
        }
    }
    if (sl == 0 && lane == 0 && row < J.F) h[(size_t)blockIdx.y * J.Fp + row] = siluf_(a) * b;
}

// out[j, e] = down_j[e] . h[j] for every GPU expert j; grid (ceil(E / (8 / wpr)), k)
extern "C" __global__ void __launch_bounds__(256) moe_down(const MoeJob* __restrict__ job,
                                                           const i32* __restrict__ slots,
                                                           const float* __restrict__ h, float* out) {
    __shared__ float part[8];
    const MoeJob J = *job;
    const int slot = slots[blockIdx.y];
    if (slot < 0) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wpr = J.wpr_d, rl = warp / wpr, sl = warp % wpr, row = blockIdx.x * (8 / wpr) + rl;
    float a = 0.0f;
    if (row < J.E)
        a = row_dot(J.type_d, J.d_base + slot * J.d_stride + (size_t)row * J.rb_d, h + (size_t)blockIdx.y * J.Fp,
                    J.F, sl * 32 + lane, wpr * 32);
    a = warp_sum(a);
    if (wpr > 1) {
        if (lane == 0) part[warp] = a;
        __syncthreads();
        if (sl == 0 && lane == 0) {
            a = 0.0f;
            for (int s = 0; s < wpr; s++) a += part[rl * wpr + s];
        }
    }
    if (sl == 0 && lane == 0 && row < J.E) out[(size_t)blockIdx.y * J.E + row] = a;
}

// post[l]'s end: out = sum_j wts[j] part_j + sigmoid(sg) shared, part_j = gpu_parts[j] when slots[j] >= 0 else
// host_parts[j] (combine); R[s] += inject_s out with inject_s = 2 sigmoid(inj_raw[s] / hc) (gr_write); then
// xn[s] = RMSNorm(R[s]) * w_next[s], the next read's norm (the next layer's attention read, or the final mixer).
// grid hc; CTA 0 also writes `comb` (the combine stage's output).
extern "C" __global__ void __launch_bounds__(1024) combine_write_rms(
    const float* __restrict__ wts, const i32* __restrict__ slots, const float* __restrict__ gpu_parts,
    const float* __restrict__ host_parts, const float* __restrict__ shared, const float* __restrict__ sg,
    const float* __restrict__ inj_raw, float* R, float* comb, const float* __restrict__ w_next, float* xn, int k,
    int E, int hc, float eps) {
    __shared__ float red[33];
    const int s = blockIdx.x;
    const float inj = 2.0f * sigmoidf_(inj_raw[s] / (float)hc), gs = sigmoidf_(sg[0]);
    float* r = R + (size_t)s * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float o = 0.0f;
        for (int j = 0; j < k; j++) o += wts[j] * (slots[j] >= 0 ? gpu_parts : host_parts)[(size_t)j * E + e];
        o += shared[e] * gs;
        if (s == 0) comb[e] = o;
        r[e] = r[e] + inj * o;
    }
    __syncthreads();
    stream_rms(r, w_next + (size_t)s * E, xn + (size_t)s * E, E, eps, red);
}
