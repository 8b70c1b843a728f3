// moe.cu: the router with its doorbell, the VRAM-resident routed experts, and the combine that ends post[l].
#include "quant.cuh"

// Softmax over the router logits, the top k by probability (ties to the lower expert id, like numpy's stable
// argsort), weights renormalized to sum 1 -> ids[k], wts[k]. One CTA, one thread per expert (n_exp <= 1024).
// The top k: key = (probability bits, ~id) (probabilities are >= 0, so their bits order like their values); each
// warp finds its k largest keys by k rounds of a warp max, then warp 0 takes the k largest of those in order.
// Then the doorbell, when db_seq is set: x (the MoE input), ids and weights go to mapped pinned host memory,
// every writer fences system-wide, the block syncs, and thread 0 stores the sequence value step[RING] + layer with
// a volatile store. The host polls that value; a value it sees means the payload before it is in place.
__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 w = __shfl_xor_sync(FULL_MASK, v, o);
        v = w > v ? w : v;
    }
    return v;
}

extern "C" __global__ void __launch_bounds__(1024) moe_route(
    const float* __restrict__ logits, const float* __restrict__ x, i32* ids, float* wts, float* db_x, i32* db_ids,
    float* db_wts, volatile u32* db_seq, const i32* __restrict__ step, int layer, int n_exp, int k, int E) {
    __shared__ u64 cand[32 * 64];
    __shared__ float pk[64];
    __shared__ i32 ik[64];
    __shared__ float red[33];
    pdl_begin();
    const int i = threadIdx.x, lane = i & 31, warp = i >> 5, nw = blockDim.x >> 5;
    const float li = i < n_exp ? logits[i] : -F_INF;
    const float mx = block_max(li, red);
    const float ei = i < n_exp ? expf(li - mx) : 0.0f;
    const float sum = block_sum(ei, red);
    const float pi = ei / sum;
    u64 mine = i < n_exp ? ((u64)__float_as_uint(pi) << 32) | (u64)(0xFFFFFFFFu - (u32)i) : 0ull;
    for (int r = 0; r < k; r++) {
        const u64 m = warp_max_u64(mine);
        if (lane == 0) cand[warp * k + r] = m;
        if (mine == m) mine = 0ull;             // keys are unique (ids differ): one lane drops out
    }
    __syncthreads();
    if (warp == 0) {
        const int nc = nw * k;
        for (int r = 0; r < k; r++) {
            u64 best = 0ull;
            int bi = -1;
            for (int c = lane; c < nc; c += 32)
                if (cand[c] > best) {
                    best = cand[c];
                    bi = c;
                }
            const u64 m = warp_max_u64(best);
            if (bi >= 0 && best == m) cand[bi] = 0ull;      // only this lane reads index bi again
            if (lane == 0) {
                ik[r] = (i32)(0xFFFFFFFFu - (u32)(m & 0xFFFFFFFFull));
                pk[r] = __uint_as_float((u32)(m >> 32));
            }
        }
    }
    __syncthreads();
    if (i == 0) {
        float s = 0.0f;
        for (int r = 0; r < k; r++) s += pk[r];
        red[0] = s;
    }
    __syncthreads();
    if (i < k) {
        ids[i] = ik[i];
        wts[i] = pk[i] / red[0];
    }
    if (db_seq == nullptr) return;
    for (int e = i; e < E; e += blockDim.x) db_x[e] = x[e];
    if (i < k) {
        db_ids[i] = ik[i];
        db_wts[i] = pk[i] / red[0];
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
    i32 geom_gu, geom_d;   // tile geometry (quant.cuh geom_*) of the two launches
    i32 pad;
};

// h[j, r] = silu(gate_j[r] . x) * (up_j[r] . x) for every selected expert j whose slot is >= 0 (a GPU expert);
// grid (ceil(F / RT), k): CTA (t, j) stages rows [t RT, t RT + RT) of expert j's gate and up matrices.
// slots[j] < 0: the host computes expert j, this CTA has nothing to do.
extern "C" __global__ void __launch_bounds__(256, 2) moe_gate_up(const MoeJob* __restrict__ job,
                                                                 const i32* __restrict__ slots,
                                                                 const float* __restrict__ x, float* h) {
    __shared__ float red[4 * 8];
    pdl_begin();
    const MoeJob J = *job;
    const int slot = slots[blockIdx.y];
    if (slot < 0) return;
    const int tpg = geom_tpg(J.geom_gu), rr = geom_rr(J.geom_gu), G = blockDim.x / tpg, RT = G * rr;
    const int row0 = blockIdx.x * RT, nrows = min(RT, J.F - row0);
    const Ranges R = ranges2(J.g_base + slot * J.g_stride + (size_t)row0 * J.rb_g, nrows * J.rb_g,
                             J.u_base + slot * J.u_stride + (size_t)row0 * J.rb_u, nrows * J.rb_u);
    stage(R);
    __syncthreads();
    const int g = threadIdx.x / tpg, l = threadIdx.x % tpg;
    int o[4], o2[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int t = q * G + g;
        const bool ok = q < rr && t < nrows;
        o[q] = ok ? range_off(R, 0) + t * J.rb_g : -1;
        o2[q] = ok ? range_off(R, 1) + t * J.rb_u : -1;
    }
    float4 a = dot_rows(J.type_g, o[0], o[1], o[2], o[3], x, J.E, l, tpg);
    a = group_sum(a, tpg, red);
    float4 b = dot_rows(J.type_u, o2[0], o2[1], o2[2], o2[3], x, J.E, l, tpg);
    b = group_sum(b, tpg, red);
    if (l == 0) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int t = q * G + g;
            if (q < rr && t < nrows) h[(size_t)blockIdx.y * J.Fp + row0 + t] = siluf_(f4get(a, q)) * f4get(b, q);
        }
    }
}

// out[j, e] = down_j[e] . h[j] for every GPU expert j; grid (ceil(E / RT), k)
extern "C" __global__ void __launch_bounds__(256, 2) moe_down(const MoeJob* __restrict__ job,
                                                              const i32* __restrict__ slots,
                                                              const float* __restrict__ h, float* out) {
    __shared__ float red[4 * 8];
    pdl_begin();
    const MoeJob J = *job;
    const int slot = slots[blockIdx.y];
    if (slot < 0) return;
    const int tpg = geom_tpg(J.geom_d), rr = geom_rr(J.geom_d), G = blockDim.x / tpg, RT = G * rr;
    const int row0 = blockIdx.x * RT, nrows = min(RT, J.E - row0);
    const Ranges R = ranges2(J.d_base + slot * J.d_stride + (size_t)row0 * J.rb_d, nrows * J.rb_d, nullptr, 0);
    stage(R);
    __syncthreads();
    const int g = threadIdx.x / tpg, l = threadIdx.x % tpg;
    int o[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int t = q * G + g;
        o[q] = q < rr && t < nrows ? range_off(R, 0) + t * J.rb_d : -1;
    }
    float4 a = dot_rows(J.type_d, o[0], o[1], o[2], o[3], h + (size_t)blockIdx.y * J.Fp, J.F, l, tpg);
    a = group_sum(a, tpg, red);
    if (l == 0) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int t = q * G + g;
            if (q < rr && t < nrows) out[(size_t)blockIdx.y * J.E + row0 + t] = f4get(a, q);
        }
    }
}

// post[l]'s end: out = sum_j wts[j] part_j + sigmoid(sg) shared, part_j = gpu_parts[j] when slots[j] >= 0 else
// host_parts[j] (combine); R[s] += inject_s out with inject_s = 2 sigmoid(inj_raw[s] / hc) (gr_write); then
// xn[s] = RMSNorm(R[s]) * w_next[s], the next read's norm (the next layer's attention read, or the final mixer).
// grid hc; CTA 0 also writes `comb` (the combine stage's output). The weights and part rows are read into shared
// memory first, so each element's k loads are independent (no chain of dependent reads).
extern "C" __global__ void __launch_bounds__(1024) combine_write_rms(
    const float* __restrict__ wts, const i32* __restrict__ slots, const float* __restrict__ gpu_parts,
    const float* __restrict__ host_parts, const float* __restrict__ shared, const float* __restrict__ sg,
    const float* __restrict__ inj_raw, float* R, float* comb, const float* __restrict__ w_next, float* xn, int k,
    int E, int hc, float eps) {
    __shared__ float red[33];
    __shared__ float sw[64];
    __shared__ const float* sp[64];
    pdl_begin();
    const int s = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    if (tid < k) {
        sw[tid] = wts[tid];
        sp[tid] = (slots[tid] >= 0 ? gpu_parts : host_parts) + (size_t)tid * E;
    }
    __syncthreads();
    const float inj = 2.0f * sigmoidf_(inj_raw[s] / (float)hc), gs = sigmoidf_(sg[0]);
    float* r = R + (size_t)s * E;
    float ss = 0.0f;
    for (int e = tid; e < E; e += nt) {
        float o = 0.0f;
#pragma unroll 4
        for (int j = 0; j < k; j++) o += sw[j] * sp[j][e];
        o += shared[e] * gs;
        if (s == 0) comb[e] = o;
        const float v = r[e] + inj * o;
        r[e] = v;
        ss += v * v;
    }
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)E + eps);
    for (int e = tid; e < E; e += nt) xn[(size_t)s * E + e] = (r[e] * inv) * w_next[(size_t)s * E + e];
}
