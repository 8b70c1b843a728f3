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
    float* v = (float*)SMEM;
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
    float* v = (float*)SMEM;
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

// Split-K attention: grid (Hkv, nsplit, rows), one warp per QSA_HW query heads of the kv head's group (consecutive
// heads share a kv head); the CTA's warps share one copy of each cell's K and V rows, staged into shared memory
// QSA_U cells a round, QSA_STAGES rounds in flight (cp.async), so a cell is read once for the whole group and the
// copies of the next rounds overlap this one's arithmetic. Lane l holds dimensions [8l, 8l + 8) of its heads' q and
// output. Split sp takes cells [sp*per, (sp+1)*per) of the n_cells list; each head's partial dots are summed over
// the lanes by a reduce-scatter (each lane ends with a few of the round's sums), the scores meet in shared memory,
// and every lane keeps the online softmax (m, l) of its warp's heads. The partials go to
// part[(h * nsplit + sp) * (D + 2)] = {m, l, acc[D]} (m = -inf when empty).
// grid.z = rows: row r (t = step[POS] + r) reads q + r H D, sel + r ld, meta + 2 r and writes part + r H nsplit (D+2).
// Dynamic shared memory (strata/kernels/qsa.py attn_smem): QSA_STAGES * QSA_U * 2 * D floats, then the split's
// cell indices (at most `cap`, computed once: the runtime division by the ratio is not repeated per copy).
// H200, flash heads, a 4096-row chunk past the budget (bench/gpu_check.py --phases qsa): 13.8 ms a layer; one warp
// per head reading its cells from global memory (the design before) took 44.7-60.2, 6 heads a warp 14.1, staging
// without the swizzle, the precomputed cells and the folded scale 19.7.
#ifndef QSA_HW
#define QSA_HW 4          // query heads per warp: 4 x 8 floats of q and of the output per lane
#endif
#ifndef QSA_U
#define QSA_U 8           // cells a round
#endif
#ifndef QSA_STAGES
#define QSA_STAGES 2      // rounds of K/V in shared memory (one computing, the rest arriving)
#endif
#define QSA_N (QSA_U * QSA_HW)
static_assert(QSA_MAXD == 8 * 32, "qsa_attn: a lane holds 8 dimensions of a row");
static_assert(QSA_N % 8 == 0 && QSA_N <= 64, "qsa_attn: the reduce-scatter takes a multiple of 8 sums, 2 a lane");

// Lane l's 8 dimensions of a row: [8l, 8l + 8), the two halves swapped on lanes with bit 2 set, so that the 8
// lanes of each quarter-warp's 16-byte shared-memory reads cover 128 distinct bytes (no bank conflict). Register j
// of a lane holds dimension qsa_dim(lane, j), the same for q, K, V and the output.
__device__ __forceinline__ int qsa_dim(int lane, int j) { return 8 * lane + ((j >> 2) ^ ((lane >> 2) & 1)) * 4 + (j & 3); }

// the lane's 8 floats of a row (zeros past D); p 16-byte aligned when D % 4 == 0
__device__ __forceinline__ void qsa_load8(const float* p, int lane, int D, float* v) {
    if (8 * lane + 8 <= D && (D & 3) == 0) {
        const float4 a = *(const float4*)(p + qsa_dim(lane, 0)), b = *(const float4*)(p + qsa_dim(lane, 4));
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = qsa_dim(lane, j) < D ? p[qsa_dim(lane, j)] : 0.0f;
    }
}

// One step of the reduce-scatter: lanes with `bit` clear keep values [0, n/2), the others [n/2, n), each adding
// its partner's copy of the half it keeps.
template <int N>
__device__ __forceinline__ void qsa_scatter(float* v, int lane, int bit) {
    const bool up = lane & bit;
#pragma unroll
    for (int k = 0; k < N / 2; k++) {
        const float send = up ? v[k] : v[k + N / 2];
        const float keep = up ? v[k + N / 2] : v[k];
        v[k] = keep + __shfl_xor_sync(FULL_MASK, send, bit);
    }
}

__device__ __forceinline__ void cp_async_f(float* dst, const float* src, bool vec) {
#ifdef __CUDACC__
    u32 d;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(d) : "l"(dst));
    if (vec)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
#else
    emu_cp_async((u8*)dst, src, vec ? 16 : 4);
#endif
}

extern "C" __global__ void __launch_bounds__(256) qsa_attn(const float* __restrict__ q, const float* __restrict__ Kc,
                                                           const float* __restrict__ Vc, const i32* __restrict__ sel,
                                                           const i32* __restrict__ meta, float* part,
                                                           const i32* __restrict__ step, int H, int Hkv, int D,
                                                           int ratio, int nsplit, int ld, int cap) {
    __shared__ __align__(16) float sh_s[8][QSA_N], sh_p[8][QSA_N], sh_m[8][QSA_HW];
    float* kvbuf = (float*)SMEM;          // [stage][cell u][K, V][D]
    i32* cells = (i32*)(kvbuf + QSA_STAGES * QSA_U * 2 * D);    // the split's cells, at most cap
    pdl_begin();
    const int kvh = blockIdx.x, sp = blockIdx.y, row = blockIdx.z, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (row >= step[STEP_T]) return;
    // the group's heads split evenly over the CTA's warps (strata/kernels/qsa.py: ceil(group / QSA_HW) warps)
    const int group = H / Hkv, nw = blockDim.x >> 5, hw = (group + nw - 1) / nw;
    const int h0 = kvh * group + w * hw, nh = min(hw, group - w * hw);
    q += (size_t)row * H * D;
    sel += (size_t)row * ld;
    meta += 2 * row;
    part += (size_t)row * H * nsplit * (D + 2);
    const int nb = (step[STEP_POS] + row + 1) / ratio, nsc = meta[0] * ratio, n_cells = meta[1];
    const int per = (n_cells + nsplit - 1) / nsplit, i0 = sp * per, i1 = min(n_cells, i0 + per);
    const int n_mine = max(0, min(i1 - i0, cap));      // cap holds every split of a launch (qsa.py attn_smem)
    const int rounds = (n_mine + QSA_U - 1) / QSA_U;
    for (int k = threadIdx.x; k < n_mine; k += blockDim.x) {
        const int iu = i0 + k;
        cells[k] = iu < nsc ? sel[iu / ratio] * ratio + iu % ratio : nb * ratio + (iu - nsc);
    }
    __syncthreads();
    const bool vec = (D & 3) == 0;
    const int step_f = vec ? 4 : 1;
    // round r's cells into stage r % QSA_STAGES (one copy group per round, empty past the last)
    auto issue = [&](int r) {
        if (r < rounds) {
            float* st = kvbuf + (size_t)(r % QSA_STAGES) * QSA_U * 2 * D;
#pragma unroll
            for (int u = 0; u < QSA_U; u++) {
                const int c = cells[min(r * QSA_U + u, n_mine - 1)];  // past the end: the last cell again (weight 0)
                const size_t o = ((size_t)c * Hkv + kvh) * D;
                for (int e = step_f * (int)threadIdx.x; e < 2 * D; e += step_f * (int)blockDim.x) {
                    const int kv = e >= D, d = e - kv * D;
                    cp_async_f(st + (2 * u + kv) * D + d, (kv ? Vc : Kc) + o + d, vec);
                }
            }
        }
        cp_async_commit();
    };
    const float scale = 1.0f / sqrtf((float)D);      // applied to q once, not to every score
    float qr[QSA_HW][8], acc[QSA_HW][8], m[QSA_HW], l[QSA_HW];
#pragma unroll
    for (int h = 0; h < QSA_HW; h++) {
        if (h < nh) qsa_load8(q + (size_t)(h0 + h) * D, lane, D, qr[h]);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            qr[h][j] = h < nh ? qr[h][j] * scale : 0.0f;
            acc[h][j] = 0.0f;
        }
        m[h] = -F_INF;
        l[h] = 0.0f;
    }
#pragma unroll
    for (int r = 0; r < QSA_STAGES - 1; r++) issue(r);
    // after the scatter steps (16, 8, 4) lane holds the sums base .. base + QSA_N / 8 - 1 of the round (cell-major)
    const int base = (lane & 16 ? QSA_N / 2 : 0) + (lane & 8 ? QSA_N / 4 : 0) + (lane & 4 ? QSA_N / 8 : 0);
    for (int r = 0; r < rounds; r++) {
        issue(r + QSA_STAGES - 1);
        cp_async_wait_pending<QSA_STAGES - 1>();
        __syncthreads();
        const float* st = kvbuf + (size_t)(r % QSA_STAGES) * QSA_U * 2 * D;
        float s[QSA_N];
#pragma unroll
        for (int u = 0; u < QSA_U; u++) {
            float kr[8];
            qsa_load8(st + 2 * u * D, lane, D, kr);
#pragma unroll
            for (int h = 0; h < QSA_HW; h++) {
                float d = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; j++) d = fmaf(qr[h][j], kr[j], d);
                s[u * QSA_HW + h] = d;
            }
        }
        qsa_scatter<QSA_N>(s, lane, 16);
        qsa_scatter<QSA_N / 2>(s, lane, 8);
        qsa_scatter<QSA_N / 4>(s, lane, 4);
#pragma unroll
        for (int k = 0; k < QSA_N / 8; k++) {
            s[k] += __shfl_xor_sync(FULL_MASK, s[k], 2);
            s[k] += __shfl_xor_sync(FULL_MASK, s[k], 1);
        }
        if ((lane & 3) == 0) {
#pragma unroll
            for (int k = 0; k < QSA_N / 8; k++) {
                const int n = base + k;
                sh_s[w][n] = r * QSA_U + n / QSA_HW < n_mine ? s[k] : -F_INF;
            }
        }
        __syncwarp();
        float mn[QSA_HW], corr[QSA_HW];
#pragma unroll
        for (int h = 0; h < QSA_HW; h++) mn[h] = m[h];
#pragma unroll
        for (int k = 0; k < QSA_N; k += 4) {
            const float4 t = *(const float4*)&sh_s[w][k];
            mn[k % QSA_HW] = fmaxf(mn[k % QSA_HW], t.x);
            mn[(k + 1) % QSA_HW] = fmaxf(mn[(k + 1) % QSA_HW], t.y);
            mn[(k + 2) % QSA_HW] = fmaxf(mn[(k + 2) % QSA_HW], t.z);
            mn[(k + 3) % QSA_HW] = fmaxf(mn[(k + 3) % QSA_HW], t.w);
        }
#pragma unroll
        for (int h = 0; h < QSA_HW; h++) {
            corr[h] = expf(m[h] - mn[h]);
            m[h] = mn[h];
        }
        if (lane == 0) {
#pragma unroll
            for (int h = 0; h < QSA_HW; h++) sh_m[w][h] = mn[h];
        }
        __syncwarp();
#pragma unroll
        for (int k = lane; k < QSA_N; k += 32) sh_p[w][k] = expf(sh_s[w][k] - sh_m[w][k % QSA_HW]);   // head k % HW
        __syncwarp();
#pragma unroll
        for (int h = 0; h < QSA_HW; h++) {
            l[h] *= corr[h];
#pragma unroll
            for (int j = 0; j < 8; j++) acc[h][j] *= corr[h];
        }
        float pv[QSA_N];
#pragma unroll
        for (int k = 0; k < QSA_N; k += 4) {
            const float4 t = *(const float4*)&sh_p[w][k];
            pv[k] = t.x; pv[k + 1] = t.y; pv[k + 2] = t.z; pv[k + 3] = t.w;
        }
#pragma unroll
        for (int u = 0; u < QSA_U; u++) {
            float vr[8];
            qsa_load8(st + (2 * u + 1) * D, lane, D, vr);
#pragma unroll
            for (int h = 0; h < QSA_HW; h++) {
                const float p = pv[u * QSA_HW + h];
                l[h] += p;
#pragma unroll
                for (int j = 0; j < 8; j++) acc[h][j] = fmaf(p, vr[j], acc[h][j]);
            }
        }
        __syncthreads();        // every warp is done with this stage before a later round's copies overwrite it
    }
    // a launch this build cannot serve (more heads a warp, more cells a split than the shared memory holds): NaN
    const float bad = hw > QSA_HW || i1 - i0 > cap ? __int_as_float(0x7fc00000) : 0.0f;
#pragma unroll
    for (int h = 0; h < QSA_HW; h++) {
        if (h < nh) {
            float* o = part + ((size_t)(h0 + h) * nsplit + sp) * (D + 2);
            if (lane == 0) {
                o[0] = m[h];
                o[1] = l[h] + bad;
            }
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (qsa_dim(lane, j) < D) o[2 + qsa_dim(lane, j)] = acc[h][j];
        }
    }
}

// qsa_attn_tc: qsa_attn's function for the batched step's rows, on the tensor cores. qsa_attn runs on the FMA
// pipes and issues ~3x its multiply-adds in shuffles and softmax bookkeeping (13.8 ms a layer for a 4096-row chunk
// past the budget, H200: instruction-bound); here a CTA takes 16 query heads of one kv head (grid.x = Hkv x
// ceil(group / 16)) and computes S = Q K^T and O += P V over rounds of 16 cells with mma.sync m16n8k8 in 3xTF32:
// each f32 operand is split as hi = tf32(v), lo = tf32(v - hi), and lo*hi + hi*lo + hi*hi keep ~22 bits of every
// product (a plain TF32 product, ~1e-3, would move the output past the batched path's 1e-5). TF32 keeps f32's
// exponent, so unlike the GEMM's 3xFP16 no operand needs scaling. Each of the QSA_TC_W warps owns a slice of the
// (padded) head dims for both products: its Q fragments stay in registers, its partial scores meet the others' in
// shared memory, and its O accumulators are its dims of the 16 heads. A round's P V goes into zeroed registers and
// is added to O in f32 after O is rescaled (O = O corr + PV): the tensor cores' accumulation truncates, and 128
// rounds into one accumulator would drift. The partials, the cell list and the split are qsa_attn's, so
// qsa_combine merges either. Dims are padded to 8 a warp (zeros in shared memory and q); the staged rows'
// strides (Dp + 4 for K, Dp + 8 for V) make the B-fragment reads of both products free of bank conflicts.
#ifndef QSA_TC_STAGES
#define QSA_TC_STAGES 2   // rounds of K/V in shared memory (one computing, the rest arriving)
#endif
#ifndef QSA_TC_W
#define QSA_TC_W 8        // warps a CTA, each a slice of Dp / QSA_TC_W dims
#endif
#define QSA_TC_C 16       // cells a round
#define QSA_TC_KS (32 / QSA_TC_W)    // k-steps of 8 dims a warp at most: D up to 256
#define QSA_TC_TPH (2 * QSA_TC_W)    // the softmax's threads a head, QSA_TC_C / QSA_TC_TPH cells each
static_assert(QSA_TC_W == 4 || QSA_TC_W == 8, "qsa_attn_tc: 4 or 8 warps");

// v as hi + lo: hi rounded to TF32's 10 mantissa bits by integer operations (half an ulp added to the magnitude's
// bits, the low 13 cleared: cvt.rna.tf32's result without a conversion instruction, which the CUDA guide rates at
// 16 a clock per multiprocessor against 64 for integer adds and logic, under every K and V element), lo = v - hi
// exactly in f32, passed whole: the MMA reads its top 19 bits, so lo keeps ~10 bits below hi's and the pair ~21
// of v. A finite v near FLT_MAX may round hi to infinity (lo then NaN), as it would overflow the scores anyway.
__device__ __forceinline__ void tf32_split(float v, u32& hi, u32& lo) {
    hi = (__float_as_uint(v) + 0x1000u) & 0xffffe000u;
    lo = __float_as_uint(v - __uint_as_float(hi));
}

__device__ __forceinline__ void mma_tf32(float* c, const u32* a, const u32* b) {
#ifdef __CUDACC__
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    emu_mma_tf32(c, a, b);
#endif
}

// c += A B in 3xTF32, the small cross terms first
__device__ __forceinline__ void mma_tf32x3(float* c, const u32* ah, const u32* al, const u32* bh, const u32* bl) {
    mma_tf32(c, al, bh);
    mma_tf32(c, ah, bl);
    mma_tf32(c, ah, bh);
}

// grid (Hkv * ceil(group / 16), nsplit, rows), block 32 QSA_TC_W; dynamic shared memory (strata/kernels/qsa.py
// attn_tc_smem): QSA_TC_STAGES rounds of 16 K rows (stride Dp + 4), the same of V rows (Dp + 8), then the split's
// cells (at most cap).
extern "C" __global__ void __launch_bounds__(32 * QSA_TC_W)
    qsa_attn_tc(const float* __restrict__ q, const float* __restrict__ Kc, const float* __restrict__ Vc,
                const i32* __restrict__ sel, const i32* __restrict__ meta, float* part, const i32* __restrict__ step,
                int H, int Hkv, int D, int ratio, int nsplit, int ld, int cap) {
    __shared__ __align__(16) float sh_s[QSA_TC_W][16][QSA_TC_C + 1];   // each warp's partial scores (head, cell)
    __shared__ __align__(16) float sh_p[16][QSA_TC_C + 4];      // the round's probabilities; stride 20: no conflicts
    __shared__ float sh_c[16];                                  // each head's rescale of O this round
    pdl_begin();
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int group = H / Hkv, mt = (group + 15) / 16, kvh = blockIdx.x / mt, hb = (blockIdx.x % mt) * 16;
    const int h0 = kvh * group + hb, nh = min(16, group - hb), sp = blockIdx.y, row = blockIdx.z;
    if (row >= step[STEP_T]) return;
    const int Dp = (D + 8 * QSA_TC_W - 1) / (8 * QSA_TC_W) * (8 * QSA_TC_W), SK = Dp + 4, SV = Dp + 8;
    const int ksn = Dp / (8 * QSA_TC_W), dw = w * (Dp / QSA_TC_W);
    float* kbuf = (float*)SMEM;                                 // [stage][cell][SK]
    float* vbuf = kbuf + QSA_TC_STAGES * QSA_TC_C * SK;         // [stage][cell][SV]
    i32* cells = (i32*)(vbuf + QSA_TC_STAGES * QSA_TC_C * SV);
    q += ((size_t)row * H + h0) * D;
    sel += (size_t)row * ld;
    meta += 2 * row;
    part += (size_t)row * H * nsplit * (D + 2);
    const int nb = (step[STEP_POS] + row + 1) / ratio, nsc = meta[0] * ratio, n_cells = meta[1];
    const int per = (n_cells + nsplit - 1) / nsplit, i0 = sp * per, i1 = min(n_cells, i0 + per);
    const int n_mine = max(0, min(i1 - i0, cap));
    const int rounds = (n_mine + QSA_TC_C - 1) / QSA_TC_C;
    for (int k = threadIdx.x; k < n_mine; k += blockDim.x) {
        const int iu = i0 + k;
        cells[k] = iu < nsc ? sel[iu / ratio] * ratio + iu % ratio : nb * ratio + (iu - nsc);
    }
    // the padded dims [D, Dp) of every staged row: the copies never write them
    for (int i = threadIdx.x; i < QSA_TC_STAGES * QSA_TC_C * (Dp - D); i += blockDim.x) {
        const int r = i / (Dp - D), d = D + i % (Dp - D);
        kbuf[r * SK + d] = 0.0f;
        vbuf[r * SV + d] = 0.0f;
    }
    __syncthreads();
    const bool vec = (D & 3) == 0;
    const int step_f = vec ? 4 : 1, per_cell = 2 * D / step_f;     // copies a cell: its K row, then its V row
    // The thread's copy plan, fixed for the kernel (the copies' addressing was most of a round's instructions):
    // copy e of cells u0, u0 + ustep, ...; threads past ustep x per_cell copy nothing. A cell of more copies than
    // threads (D % 4 != 0 past 128 dims) takes the general loop.
    const bool plan = per_cell <= (int)blockDim.x;
    const int ustep = plan ? (int)blockDim.x / per_cell : 1, u0 = plan ? (int)threadIdx.x / per_cell : QSA_TC_C;
    const int e0 = plan ? ((int)threadIdx.x - u0 * per_cell) * step_f : 0, kv0 = e0 >= D, d0 = e0 - kv0 * D;
    const float* src0 = (kv0 ? Vc : Kc) + (size_t)kvh * D + d0;
    float* dst0 = (kv0 ? vbuf : kbuf) + d0;
    const int stride0 = kv0 ? SV : SK;
    const size_t cell_stride = (size_t)Hkv * D;
    auto issue = [&](int r) {
        if (r < rounds) {
            if (plan) {
                float* dst = dst0 + (size_t)(r % QSA_TC_STAGES) * QSA_TC_C * stride0;
                if (u0 < ustep)
                    for (int u = u0; u < QSA_TC_C; u += ustep) {
                        const int c = cells[min(r * QSA_TC_C + u, n_mine - 1)];   // past the end: the last cell
                        cp_async_f(dst + u * stride0, src0 + c * cell_stride, vec);
                    }
            } else {
                float* ks = kbuf + (size_t)(r % QSA_TC_STAGES) * QSA_TC_C * SK;
                float* vs = vbuf + (size_t)(r % QSA_TC_STAGES) * QSA_TC_C * SV;
                for (int i = threadIdx.x; i < QSA_TC_C * per_cell; i += blockDim.x) {
                    const int u = i / per_cell, e = (i - u * per_cell) * step_f, kv = e >= D, d = e - kv * D;
                    const int c = cells[min(r * QSA_TC_C + u, n_mine - 1)];
                    cp_async_f(kv ? vs + u * SV + d : ks + u * SK + d, (kv ? Vc : Kc) + c * cell_stride + kvh * D + d,
                               vec);
                }
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int r = 0; r < QSA_TC_STAGES - 1; r++) issue(r);
    // this warp's Q fragments, scaled by 1/sqrt(D) (zeros past the group's heads and past D)
    const float scale = 1.0f / sqrtf((float)D);
    u32 qh[QSA_TC_KS][4], ql[QSA_TC_KS][4];
#pragma unroll
    for (int j = 0; j < QSA_TC_KS; j++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int hd = g + 8 * (i & 1), d = dw + 8 * j + t + 4 * (i >> 1);
            const float v = j < ksn && hd < nh && d < D ? q[(size_t)hd * D + d] * scale : 0.0f;
            tf32_split(v, qh[j][i], ql[j][i]);
        }
    }
    float acc[QSA_TC_KS][4];
#pragma unroll
    for (int j = 0; j < QSA_TC_KS; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = 0.0f;
    // the softmax's thread: head sh = tid / TPH, cells from sc = (tid % TPH) C / TPH; m and l the same on its TPH
    // lanes (8 or 16, within a warp)
    const int sh = threadIdx.x / QSA_TC_TPH, sc = (threadIdx.x % QSA_TC_TPH) * (QSA_TC_C / QSA_TC_TPH);
    float m = -F_INF, l = 0.0f;
    for (int r = 0; r < rounds; r++) {
        issue(r + QSA_TC_STAGES - 1);
        cp_async_wait_pending<QSA_TC_STAGES - 1>();
        __syncthreads();
        const float* ks = kbuf + (size_t)(r % QSA_TC_STAGES) * QSA_TC_C * SK;
        const float* vs = vbuf + (size_t)(r % QSA_TC_STAGES) * QSA_TC_C * SV;
        // two chains of MMAs a cell tile (even and odd k-steps): each MMA waits for the one before it in its chain
        float s2[2][2][4] = {};
        // one ldmatrix a k-step gives both cell tiles' B fragments: matrix m of lane L's address is cells
        // 8 (m >> 1) + L % 8, dims + 4 (m & 1); word i comes back as K[cell g (+8)][dim t (+4)]
        const u32 kaddr = smem_addr(ks + ((lane & 7) + 8 * (lane >> 4)) * SK + dw + 4 * ((lane >> 3) & 1));
#pragma unroll
        for (int j = 0; j < QSA_TC_KS; j++) {
            if (j < ksn) {
                u32 kw[4];
                ldsm4(kaddr + 32 * j, kw);
#pragma unroll
                for (int n = 0; n < 2; n++) {
                    u32 bh[2], bl[2];
                    tf32_split(__uint_as_float(kw[2 * n]), bh[0], bl[0]);
                    tf32_split(__uint_as_float(kw[2 * n + 1]), bh[1], bl[1]);
                    mma_tf32x3(s2[n][j & 1], qh[j], ql[j], bh, bl);
                }
            }
        }
        float s[2][4];
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[n][e] = s2[n][0][e] + s2[n][1][e];
#pragma unroll
        for (int n = 0; n < 2; n++) {
            sh_s[w][g][8 * n + 2 * t] = s[n][0];
            sh_s[w][g][8 * n + 2 * t + 1] = s[n][1];
            sh_s[w][g + 8][8 * n + 2 * t] = s[n][2];
            sh_s[w][g + 8][8 * n + 2 * t + 1] = s[n][3];
        }
        __syncthreads();
        {
            constexpr int CPT = QSA_TC_C / QSA_TC_TPH;
            float v[CPT], mx = -F_INF;
#pragma unroll
            for (int i = 0; i < CPT; i++) {
                const int c = sc + i;
                float x = 0.0f;
#pragma unroll
                for (int ww = 0; ww < QSA_TC_W; ww++) x += sh_s[ww][sh][c];
                v[i] = r * QSA_TC_C + c < n_mine ? x : -F_INF;
                mx = fmaxf(mx, v[i]);
            }
#pragma unroll
            for (int b = QSA_TC_TPH / 2; b; b >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, b));
            const float mn = fmaxf(m, mx), corr = expf(m - mn);
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < CPT; i++) {
                v[i] = expf(v[i] - mn);
                sum += v[i];
                sh_p[sh][sc + i] = v[i];
            }
#pragma unroll
            for (int b = QSA_TC_TPH / 2; b; b >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, b);
            m = mn;
            l = fmaf(l, corr, sum);
            if ((threadIdx.x & (QSA_TC_TPH - 1)) == 0) sh_c[sh] = corr;
        }
        __syncthreads();
        float o[QSA_TC_KS][4];
#pragma unroll
        for (int j = 0; j < QSA_TC_KS; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[j][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < QSA_TC_C / 8; kk++) {
            u32 ah[4], al[4];
#pragma unroll
            for (int i = 0; i < 4; i++) tf32_split(sh_p[g + 8 * (i & 1)][8 * kk + t + 4 * (i >> 1)], ah[i], al[i]);
#pragma unroll
            for (int j = 0; j < QSA_TC_KS; j++) {
                if (j < ksn) {
                    const float* vr = vs + (8 * kk + t) * SV + dw + 8 * j + g;
                    u32 bh[2], bl[2];
                    tf32_split(vr[0], bh[0], bl[0]);
                    tf32_split(vr[4 * SV], bh[1], bl[1]);
                    mma_tf32x3(o[j], ah, al, bh, bl);
                }
            }
        }
        const float c_lo = sh_c[g], c_hi = sh_c[g + 8];
#pragma unroll
        for (int j = 0; j < QSA_TC_KS; j++) {
            acc[j][0] = fmaf(acc[j][0], c_lo, o[j][0]);
            acc[j][1] = fmaf(acc[j][1], c_lo, o[j][1]);
            acc[j][2] = fmaf(acc[j][2], c_hi, o[j][2]);
            acc[j][3] = fmaf(acc[j][3], c_hi, o[j][3]);
        }
        __syncthreads();        // every warp is done with this stage and sh_s/sh_p/sh_c before the next round
    }
    // a launch this build cannot serve (more cells a split than the shared memory holds, dims past 256): NaN
    const float bad = i1 - i0 > cap || Dp > 8 * QSA_TC_W * QSA_TC_KS ? __int_as_float(0x7fc00000) : 0.0f;
    if (threadIdx.x % QSA_TC_TPH == 0 && sh < nh) {
        float* o = part + ((size_t)(h0 + sh) * nsplit + sp) * (D + 2);
        o[0] = m;
        o[1] = l + bad;
    }
#pragma unroll
    for (int j = 0; j < QSA_TC_KS; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int hd = g + 8 * (e >> 1), d = dw + 8 * j + 2 * t + (e & 1);
            if (j < ksn && hd < nh && d < D) part[((size_t)(h0 + hd) * nsplit + sp) * (D + 2) + 2 + d] = acc[j][e];
        }
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
