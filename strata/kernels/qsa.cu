// qsa.cu: QSA decode attention for one token: q/k norms and RoPE with the caches written, the indexer's block
// pooling and scoring, the top-k block selection, split-K attention over the selected cells, and the sigmoid gate.
//
// Caches of one layer (row-major, f32): Kc, Vc (max_ctx, Hkv, D) normed+rotated keys and values; idx_raw
// (max_ctx, Di) the indexer's raw keys (never normed, never rotated); idx_blk (max_ctx / ratio, Di) the pooled,
// normed, rotated key of every complete block. The position t is step[POS]; every count below derives from it.
#include "common.cuh"

#define QSA_MAXD 256      // head dims up to 256 (8 values per lane in the attention kernel)

// grid (H + Hkv + Hi + 1, rows), block 128; row r is at position step[POS] + r, r < step[T]. CTA kinds: query head (RMSNorm, RoPE -> q_out), key head (RMSNorm, RoPE ->
// Kc[t]; V -> Vc[t]), indexer query head (RMSNorm, RoPE -> iq_out), and the indexer key CTA (raw -> idx_raw[t];
// when t completes block b = t / ratio and `pool` is set: mean of the block's raw keys, RMSNorm, RoPE at 4b ->
// idx_blk[b]; a chunk of rows pools in qsa_pool after, since its blocks' raw keys come from several CTAs).
// Per row: qg (H, 2D) [q | gate] per head, kr/vr (Hkv*D), iqr (Hi*Di), ikr (Di), q_out (H*D), iq_out (Hi*Di).
// Shared memory: max(D, Di) floats.
extern "C" __global__ void __launch_bounds__(128) qsa_prep(
    const float* __restrict__ qg, const float* __restrict__ kr, const float* __restrict__ vr,
    const float* __restrict__ iqr, const float* __restrict__ ikr, const float* __restrict__ q_norm,
    const float* __restrict__ k_norm, const float* __restrict__ iq_norm, const float* __restrict__ ik_norm,
    const float* __restrict__ inv_freq, float* q_out, float* Kc, float* Vc, float* iq_out, float* idx_raw,
    float* idx_blk, const i32* __restrict__ step, int H, int Hkv, int D, int Hi, int Di, int n_rot, int ratio,
    float eps, int pool) {
    pdl_begin();
    extern __shared__ float v[];
    __shared__ float red[33];
    const int b = blockIdx.x, row = blockIdx.y;
    if (row >= step[STEP_T]) return;
    const int t = step[STEP_POS] + row;
    qg += (size_t)row * H * 2 * D;
    kr += (size_t)row * Hkv * D;
    vr += (size_t)row * Hkv * D;
    iqr += (size_t)row * Hi * Di;
    ikr += (size_t)row * Di;
    q_out += (size_t)row * H * D;
    iq_out += (size_t)row * Hi * Di;
    const float* src;
    const float* w;
    float* dst;
    int n = D, pos = t;
    if (b < H) {
        src = qg + (size_t)b * 2 * D;
        w = q_norm;
        dst = q_out + (size_t)b * D;
    } else if (b < H + Hkv) {
        const int j = b - H;
        src = kr + (size_t)j * D;
        w = k_norm;
        dst = Kc + ((size_t)t * Hkv + j) * D;
        for (int i = threadIdx.x; i < D; i += blockDim.x) Vc[((size_t)t * Hkv + j) * D + i] = vr[(size_t)j * D + i];
    } else if (b < H + Hkv + Hi) {
        const int j = b - H - Hkv;
        src = iqr + (size_t)j * Di;
        w = iq_norm;
        dst = iq_out + (size_t)j * Di;
        n = Di;
    } else {
        for (int i = threadIdx.x; i < Di; i += blockDim.x) idx_raw[(size_t)t * Di + i] = ikr[i];
        if (!pool || (t + 1) % ratio != 0) return;
        const int blk = t / ratio;
        for (int i = threadIdx.x; i < Di; i += blockDim.x) {
            float s = 0.0f;
            for (int c = blk * ratio; c < t; c++) s += idx_raw[(size_t)c * Di + i];
            s += ikr[i];
            v[i] = s / (float)ratio;
        }
        __syncthreads();
        stream_rms(v, ik_norm, v, Di, eps, red);
        __syncthreads();
        rope_neox(v, n_rot, blk * ratio, inv_freq);
        for (int i = threadIdx.x; i < Di; i += blockDim.x) idx_blk[(size_t)blk * Di + i] = v[i];
        return;
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) v[i] = src[i];
    __syncthreads();
    stream_rms(v, w, v, n, eps, red);
    __syncthreads();
    rope_neox(v, n_rot, pos, inv_freq);
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = v[i];
}

// The blocks that rows of a chunk complete (qsa_prep wrote their raw keys): CTA i takes the i-th row t with
// (step[POS] + t + 1) % ratio == 0, block b = (step[POS] + t) / ratio: the mean of its raw keys in cell order,
// RMSNorm, RoPE at b * ratio -> idx_blk[b], as qsa_prep's one-token pooling. Shared memory: Di floats.
extern "C" __global__ void __launch_bounds__(128) qsa_pool(const float* __restrict__ idx_raw, float* idx_blk,
                                                           const float* __restrict__ ik_norm,
                                                           const float* __restrict__ inv_freq,
                                                           const i32* __restrict__ step, int Di, int n_rot, int ratio,
                                                           float eps) {
    pdl_begin();
    extern __shared__ float v[];
    __shared__ float red[33];
    const int p0 = step[STEP_POS], t = (ratio - 1 - p0 % ratio) + (int)blockIdx.x * ratio;
    if (t >= step[STEP_T]) return;
    const int blk = (p0 + t) / ratio;
    for (int i = threadIdx.x; i < Di; i += blockDim.x) {
        float s = 0.0f;
        for (int c = blk * ratio; c < blk * ratio + ratio; c++) s += idx_raw[(size_t)c * Di + i];
        v[i] = s / (float)ratio;
    }
    __syncthreads();
    stream_rms(v, ik_norm, v, Di, eps, red);
    __syncthreads();
    rope_neox(v, n_rot, blk * ratio, inv_freq);
    for (int i = threadIdx.x; i < Di; i += blockDim.x) idx_blk[(size_t)blk * Di + i] = v[i];
}

// scores[b] = sum_h relu(iq_h . idx_blk[b]) / sqrt(Di) for the nb = (t+1) / ratio complete blocks, only when
// nb > topk (otherwise everything is selected and nothing reads the scores). One warp per block, grid-stride over
// gridDim.x; grid.y = rows: row r (t = step[POS] + r) reads iq + r Hi Di and writes scores + r ld.
extern "C" __global__ void __launch_bounds__(256) qsa_score(const float* __restrict__ iq,
                                                            const float* __restrict__ idx_blk, float* scores,
                                                            const i32* __restrict__ step, int Hi, int Di, int ratio,
                                                            int topk, int ld) {
    pdl_begin();
    const int row = blockIdx.y;
    if (row >= step[STEP_T]) return;
    const int nb = (step[STEP_POS] + row + 1) / ratio;
    if (nb <= topk) return;
    iq += (size_t)row * Hi * Di;
    scores += (size_t)row * ld;
    const int lane = threadIdx.x & 31, nw = (gridDim.x * blockDim.x) >> 5;
    const float sd = sqrtf((float)Di);
    for (int b = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < nb; b += nw) {
        const float* key = idx_blk + (size_t)b * Di;
        float s = 0.0f;
        for (int h = 0; h < Hi; h++) {
            float d = 0.0f;
            for (int i = lane; i < Di; i += 32) d += iq[h * Di + i] * key[i];
            s += fmaxf(warp_sum(d), 0.0f);
        }
        if (lane == 0) scores[b] = s / sd;
    }
}

// exclusive prefix sum over the 1024 threads of the block; `sm` is 33 ints
__device__ __forceinline__ int block_exscan(int x, int* sm) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int inc = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(FULL_MASK, inc, o);
        if (lane >= o) inc += y;
    }
    __syncthreads();
    if (lane == 31) sm[w] = inc;
    __syncthreads();
    if (w == 0) {
        int s = sm[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(FULL_MASK, s, o);
            if (lane >= o) s += y;
        }
        sm[lane] = s;     // inclusive over warps
    }
    __syncthreads();
    return (w > 0 ? sm[w - 1] : 0) + inc - x;
}

// The selected blocks, ascending, in sel[0, n_sel); meta = {n_sel, n_cells}. With nb <= topk every complete block;
// otherwise the topk highest scores, ties to the lower block index (strata.reference.qsa.select_blocks): a radix
// select finds the topk-th largest score T (scores are >= 0, so their bit patterns order like the values), then an
// ordered compaction keeps every score > T and the first `need` scores == T. One CTA of 1024 threads.
// Cells attended: the selected blocks' ratio cells each, then the incomplete tail nb*ratio .. t.
// Grid rows: row r (t = step[POS] + r) reads scores + r ld, writes sel + r ld and meta + 2 r.
extern "C" __global__ void __launch_bounds__(1024) qsa_select(const float* __restrict__ scores, i32* sel, i32* meta,
                                                              const i32* __restrict__ step, int ratio, int topk,
                                                              int ld) {
    pdl_begin();
    __shared__ u32 hist[256];
    __shared__ u32 sh_prefix, sh_need;
    __shared__ int scan[33];
    const int row = blockIdx.x;
    if (row >= step[STEP_T]) return;
    scores += (size_t)row * ld;
    sel += (size_t)row * ld;
    meta += 2 * row;
    const int t = step[STEP_POS] + row, nb = (t + 1) / ratio, tail = t + 1 - nb * ratio, tid = threadIdx.x;
    if (nb <= topk) {
        for (int i = tid; i < nb; i += blockDim.x) sel[i] = i;
        if (tid == 0) {
            meta[0] = nb;
            meta[1] = nb * ratio + tail;
        }
        return;
    }
    u32 prefix = 0, mask = 0, need = (u32)topk;
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (tid < 256) hist[tid] = 0;
        __syncthreads();
        for (int i = tid; i < nb; i += blockDim.x) {
            const u32 u = __float_as_uint(scores[i]);
            if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            u32 c = 0;
            int bin = 255;
            for (; bin > 0; bin--) {
                if (c + hist[bin] >= need) break;
                c += hist[bin];
            }
            sh_prefix = prefix | ((u32)bin << shift);
            sh_need = need - c;
        }
        __syncthreads();
        prefix = sh_prefix;
        need = sh_need;
        mask |= 255u << shift;
    }
    // thread tid owns blocks [lo, hi) and writes its selected ones at the count of selected blocks before lo
    const int per = (nb + blockDim.x - 1) / blockDim.x, lo = min(nb, tid * per), hi = min(nb, lo + per);
    int gt = 0, eq = 0;
    for (int i = lo; i < hi; i++) {
        const u32 u = __float_as_uint(scores[i]);
        gt += u > prefix;
        eq += u == prefix;
    }
    const int eq_before = block_exscan(eq, scan);
    const int take = max(0, min(eq, (int)need - eq_before));
    int o = block_exscan(gt + take, scan);
    int seen = 0;
    for (int i = lo; i < hi; i++) {
        const u32 u = __float_as_uint(scores[i]);
        if (u > prefix || (u == prefix && seen++ < take)) sel[o++] = i;
    }
    if (tid == 0) {
        meta[0] = topk;
        meta[1] = topk * ratio + tail;
    }
}

// Split-K attention: grid (Hkv, nsplit), one warp per query head of the kv head's group (consecutive heads share
// a kv head). Split sp takes cells [sp*per, (sp+1)*per) of the n_cells list; a warp keeps an online softmax
// (m, l, acc) and writes it to part[(h * nsplit + sp) * (D + 2)] = {m, l, acc[D]} (m = -inf when empty).
// grid.z = rows: row r (t = step[POS] + r) reads q + r H D, sel + r ld, meta + 2 r and writes part + r H nsplit (D+2).
extern "C" __global__ void __launch_bounds__(1024) qsa_attn(const float* __restrict__ q, const float* __restrict__ Kc,
                                                            const float* __restrict__ Vc, const i32* __restrict__ sel,
                                                            const i32* __restrict__ meta, float* part,
                                                            const i32* __restrict__ step, int Hkv, int D, int ratio,
                                                            int nsplit, int ld) {
    pdl_begin();
    const int kvh = blockIdx.x, sp = blockIdx.y, row = blockIdx.z, lane = threadIdx.x & 31;
    if (row >= step[STEP_T]) return;
    const int group = blockDim.x >> 5, h = kvh * group + (threadIdx.x >> 5), H = gridDim.x * group;
    q += (size_t)row * H * D;
    sel += (size_t)row * ld;
    meta += 2 * row;
    part += (size_t)row * H * nsplit * (D + 2);
    const int nb = (step[STEP_POS] + row + 1) / ratio, nsc = meta[0] * ratio, n_cells = meta[1];
    const int per = (n_cells + nsplit - 1) / nsplit, i0 = sp * per, i1 = min(n_cells, i0 + per);
    const float sd = sqrtf((float)D);
    float qr[QSA_MAXD / 32], acc[QSA_MAXD / 32];
#pragma unroll
    for (int j = 0; j < QSA_MAXD / 32; j++) {
        const int d = lane + 32 * j;
        qr[j] = d < D ? q[(size_t)h * D + d] : 0.0f;
        acc[j] = 0.0f;
    }
    // four cells a round: their dot products' shuffle sums are independent chains the warp overlaps (one cell a
    // round waited on five dependent shuffles per cell), then one online-softmax update for the four
    float m = -F_INF, l = 0.0f;
    for (int i = i0; i < i1; i += 4) {
        float s4[4];
        const float* vp[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int iu = min(i + u, i1 - 1);      // past the end: the last cell again, its weight zeroed below
            const int c = iu < nsc ? sel[iu / ratio] * ratio + iu % ratio : nb * ratio + (iu - nsc);
            const float* kp = Kc + ((size_t)c * Hkv + kvh) * D;
            vp[u] = Vc + ((size_t)c * Hkv + kvh) * D;
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < QSA_MAXD / 32; j++) {
                const int d = lane + 32 * j;
                if (d < D) dot += qr[j] * kp[d];
            }
            s4[u] = dot;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int u = 0; u < 4; u++) s4[u] += __shfl_xor_sync(FULL_MASK, s4[u], o);
        float mn = m;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            s4[u] = i + u < i1 ? s4[u] / sd : -F_INF;
            mn = fmaxf(mn, s4[u]);
        }
        const float corr = expf(m - mn);
        float p4[4];
        l = l * corr;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            p4[u] = expf(s4[u] - mn);
            l += p4[u];
        }
#pragma unroll
        for (int j = 0; j < QSA_MAXD / 32; j++) {
            const int d = lane + 32 * j;
            if (d < D) {
                float a = acc[j] * corr;
#pragma unroll
                for (int u = 0; u < 4; u++) a += p4[u] * vp[u][d];
                acc[j] = a;
            }
        }
        m = mn;
    }
    float* o = part + ((size_t)h * nsplit + sp) * (D + 2);
    if (lane == 0) {
        o[0] = m;
        o[1] = l;
    }
#pragma unroll
    for (int j = 0; j < QSA_MAXD / 32; j++) {
        const int d = lane + 32 * j;
        if (d < D) o[2 + d] = acc[j];
    }
}

// y[h*D + d] = softmax-weighted V of head h (the splits merged) * sigmoid(gate[h, d]); grid (H, rows), per row
// part + r H nsplit (D+2), qg + r H 2D, y + r H D.
extern "C" __global__ void __launch_bounds__(256) qsa_combine(const float* __restrict__ part,
                                                              const float* __restrict__ qg, float* y, int D,
                                                              int nsplit, const i32* __restrict__ step) {
    pdl_begin();
    const int h = blockIdx.x, row = blockIdx.y, H = gridDim.x;
    if (row >= step[STEP_T]) return;
    part += (size_t)row * H * nsplit * (D + 2);
    qg += (size_t)row * H * 2 * D;
    y += (size_t)row * H * D;
    const float* ph = part + (size_t)h * nsplit * (D + 2);
    float M = -F_INF;
    for (int s = 0; s < nsplit; s++) M = fmaxf(M, ph[(size_t)s * (D + 2)]);
    float L = 0.0f;
    for (int s = 0; s < nsplit; s++) L += ph[(size_t)s * (D + 2) + 1] * expf(ph[(size_t)s * (D + 2)] - M);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < nsplit; s++) o += ph[(size_t)s * (D + 2) + 2 + d] * expf(ph[(size_t)s * (D + 2)] - M);
        y[(size_t)h * D + d] = (o / L) * sigmoidf_(qg[(size_t)h * 2 * D + D + d]);
    }
}
