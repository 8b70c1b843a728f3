// moe.cu: the router with its doorbell, the VRAM-resident routed experts, and the combine that ends post[l].
#include "gemm.cuh"

// Softmax over the router logits, the top k by probability (ties to the lower expert id, like numpy's stable
// argsort), weights renormalized to sum 1 -> ids[k], wts[k]. One CTA, one thread per expert (n_exp <= 1024).
// The top k: key = (probability bits, ~id) (probabilities are >= 0, so their bits order like their values; keys
// are unique). Each warp sorts its 32 keys by a bitonic network of shuffles (15 steps), its first min(k, 32) lanes
// are the candidates, and each candidate's place is the number of candidates above it (one pass over them in
// shared memory); the places below k are the top k in order. (k rounds of a warp maximum and k rounds of a merge
// in one warp, ~20 k dependent shuffles, left the kernel at 8.6 us on the H200.)
// Then the doorbell, when db_seq is set: x (the MoE input), ids and weights go to mapped pinned host memory,
// every writer fences system-wide, the block syncs, and thread 0 stores the sequence value step[RING] + layer with
// a volatile store. The host polls that value; a value it sees means the payload before it is in place.
// Grid rows (one CTA per row of the step, rows < step[T]): logits (rows, n_exp), x (rows, E), ids/wts (rows, k) and
// the payload the same; each CTA fences its payload, takes a ticket, and the last one rings (and resets the ticket).
__device__ __forceinline__ u64 warp_sort_desc(u64 v, int lane) {
#pragma unroll
    for (int size = 2; size <= 32; size <<= 1)
#pragma unroll
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            const u64 o = __shfl_xor_sync(FULL_MASK, v, stride);
            const bool desc = (lane & size) == 0, lower = (lane & stride) == 0;
            v = (desc == lower) ? (o > v ? o : v) : (o < v ? o : v);
        }
    return v;
}

extern "C" __global__ void __launch_bounds__(1024) moe_route(
    const float* __restrict__ logits, const float* __restrict__ x, i32* ids, float* wts, float* db_x, i32* db_ids,
    float* db_wts, volatile u32* db_seq, const i32* __restrict__ step, int layer, int n_exp, int k, int E,
    u32* ticket) {
    __shared__ u64 cand[1024];
    __shared__ float pk[64];
    __shared__ i32 ik[64];
    __shared__ float red[33];
    pdl_begin();
    const int row = blockIdx.x, n_rows = step[STEP_T];
    if (row >= n_rows) return;
    logits += (size_t)row * n_exp;
    x += (size_t)row * E;
    ids += row * k;
    wts += row * k;
    const int i = threadIdx.x, lane = i & 31, warp = i >> 5, nw = blockDim.x >> 5, kw = min(k, 32);
    const float li = i < n_exp ? logits[i] : -F_INF;
    const float mx = block_max(li, red);
    const float ei = i < n_exp ? expf(li - mx) : 0.0f;
    const float sum = block_sum(ei, red);
    const float pi = ei / sum;
    const u64 mine = i < n_exp ? ((u64)__float_as_uint(pi) << 32) | (u64)(0xFFFFFFFFu - (u32)i) : 0ull;
    const u64 sorted = warp_sort_desc(mine, lane);
    if (lane < kw) cand[warp * kw + lane] = sorted;
    __syncthreads();
    const int nc = nw * kw;
    if (i < nc) {
        const u64 c = cand[i];
        int place = 0;
        for (int j = 0; j < nc; j++) place += cand[j] > c;
        if (place < k && c != 0ull) {            // 0: a thread past n_exp (never above k real keys)
            ik[place] = (i32)(0xFFFFFFFFu - (u32)(c & 0xFFFFFFFFull));
            pk[place] = __uint_as_float((u32)(c >> 32));
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
    if (step[STEP_FLAGS] & STEP_ROUTE_X)
        for (int e = i; e < E; e += blockDim.x) db_x[(size_t)row * E + e] = x[e];
    if (i < k) {
        db_ids[row * k + i] = ik[i];
        db_wts[row * k + i] = pk[i] / red[0];
    }
    __threadfence_system();
    __syncthreads();
    if (i == 0 && atomicAdd(ticket, 1u) == (u32)(n_rows - 1)) {
        *ticket = 0u;
        __threadfence_system();
        *db_seq = (u32)(step[STEP_RING] + layer);
    }
}

// The routed experts' weights: expert slot s's gate, up and down matrices start at base + s * stride (a layer's
// stacked GGUF tensors when every expert is resident, the cache's slots otherwise), or, with ptab set (the
// one-row kernels of a mapped token), at ptab[3 s + {0, 1, 2}]: the layer's table of each expert's addresses, a
// VRAM cache slot or the expert's blob in mapped pinned host memory (read over PCIe by the kernel itself).
// With `fetched` set, ptab is instead (k, 3): selection j's part addresses, all in VRAM (moe_fetch wrote them).
// Layout must match strata/kernels/moe.py (MOE_JOB_DTYPE): 104 bytes.
struct MoeJob {
    const u8* g_base;
    const u8* u_base;
    const u8* d_base;
    i64 g_stride, u_stride, d_stride;
    i32 type_g, type_u, type_d;
    i32 rb_g, rb_u, rb_d;
    i32 E, F, Fp;          // Fp: the row stride of h, F rounded up to 8 (16-byte aligned rows)
    i32 geom_gu, geom_d;   // tile geometry (quant.cuh geom_*) of the two launches
    i32 fetched;           // ptab is moe_fetch's per-selection table (every part in VRAM)
    const unsigned long long* ptab;   // null: base + slot * stride
};

__device__ __forceinline__ const u8* expert_part(const MoeJob& J, int slot, int part) {
    if (J.fetched) return (const u8*)J.ptab[3 * blockIdx.y + part];
    if (J.ptab != nullptr) return (const u8*)J.ptab[3 * slot + part];
    return part == 0 ? J.g_base + slot * J.g_stride : part == 1 ? J.u_base + slot * J.u_stride
                                                                : J.d_base + slot * J.d_stride;
}

// A mapped token's misses, fetched into VRAM before its expert kernels run: for each routed expert j of the
// layer (ids[j]) whose table entry ptab[3 ids[j] + p] lies outside the device range [dev_lo, dev_hi) (its blob in
// mapped pinned host memory), the three parts' 16-byte chunks are copied by the whole grid into staging slot j
// (parts at stage + j stride + part_off[p], each keeping its address mod 16); eff (k, 3) gets each selection's
// part addresses, the staging's or the cache slot's as they were. The whole grid reads every miss of the layer,
// where the expert kernels give a missed expert only the CTAs its rows fill; on the H200 both measured near PCIe
// speed (bench/RESULTS.md, 2026-12-03), so the kernels' own reads stay an option (mapped_reads="direct").
// n_g, n_u, n_d: each part's bytes. One CTA's threads work out the chunk ranges (k <= MAX_USED), every CTA the same.
// pre_ids / pre_eff (n_pre, and n_pre x 3; null: none): a prefetch of this layer's predicted experts (n_pre of
// them: the predicted logits' top k or more), this kernel's own output for those ids into another staging (run
// beside the previous layer): a miss among them takes its addresses from pre_eff and is not copied again.
#define FETCH_BATCH 8       // 16-byte loads in flight per thread
extern "C" __global__ void __launch_bounds__(256) moe_fetch(
    const unsigned long long* __restrict__ ptab, const i32* __restrict__ ids, unsigned long long* eff, u8* stage,
    unsigned long long dev_lo, unsigned long long dev_hi, int k, int stride, int n_g, int n_u, int n_d, int off_u,
    int off_d, const i32* __restrict__ pre_ids, const unsigned long long* __restrict__ pre_eff, int n_pre) {
    __shared__ int first[3 * 64 + 1];           // chunk index where copy (j, p) starts; first[3k]: the total
    __shared__ unsigned long long src[3 * 64];  // its 16-aligned source
    __shared__ int dst[3 * 64];                 // its 16-aligned offset in the staging
    pdl_begin();
    const int nc = 3 * k;
    if (threadIdx.x < nc) {
        const int j = threadIdx.x / 3, p = threadIdx.x % 3;
        const int e = ids[j];
        const unsigned long long* t = ptab + 3 * (size_t)e;
        const bool host = t[0] < dev_lo || t[0] >= dev_hi;
        int m = -1;                              // this miss's place among the prefetched ids
        if (host && pre_ids != nullptr)
            for (int q = 0; q < n_pre && m < 0; q++)
                if (pre_ids[q] == e) m = q;
        const unsigned long long s = t[p];
        const int n = p == 0 ? n_g : p == 1 ? n_u : n_d;
        const int d = j * stride + (p == 0 ? 0 : p == 1 ? off_u : off_d);
        src[threadIdx.x] = s & ~15ull;
        dst[threadIdx.x] = d;
        first[threadIdx.x + 1] = host && m < 0 ? chunks16((const u8*)s, n) : 0;
        if (blockIdx.x == 0)
            eff[threadIdx.x] = m >= 0 ? pre_eff[3 * m + p] : host ? (unsigned long long)(stage + d) + (s & 15) : s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        first[0] = 0;
        for (int c = 0; c < nc; c++) first[c + 1] += first[c];
    }
    __syncthreads();
    const int total = first[nc], step = gridDim.x * blockDim.x;
    for (int base = blockIdx.x * blockDim.x + threadIdx.x; base < total; base += FETCH_BATCH * step) {
        uint4 v[FETCH_BATCH];
        int at[FETCH_BATCH];
#pragma unroll
        for (int u = 0; u < FETCH_BATCH; u++) {
            const int i = base + u * step;
            at[u] = -1;
            if (i < total) {
                int c = 0;
                while (first[c + 1] <= i) c++;
                v[u] = ld_stream16((const u8*)src[c] + 16 * (i - first[c]));
                at[u] = dst[c] + 16 * (i - first[c]);
            }
        }
#pragma unroll
        for (int u = 0; u < FETCH_BATCH; u++)
            if (at[u] >= 0) *(uint4*)(stage + at[u]) = v[u];
    }
}

// h[j, r] = silu(gate_j[r] . x) * (up_j[r] . x) for every selected expert j whose slot is >= 0 (a GPU expert);
// grid (ceil(F / RT), k): CTA (t, j) stages rows [t RT, t RT + RT) of expert j's gate and up matrices.
// slots[j] < 0: the host computes expert j, this CTA has nothing to do. With ptab, slots are the expert ids.
extern "C" __global__ void __launch_bounds__(256, GEMV_MIN_CTAS) moe_gate_up(const MoeJob* __restrict__ job,
                                                                             const i32* __restrict__ slots,
                                                                             const float* __restrict__ x, float* h) {
    __shared__ float red[4 * 8];
    pdl_begin();
    const MoeJob J = *job;
    const int slot = slots[blockIdx.y];
    if (slot < 0) return;
    const int tpg = geom_tpg(J.geom_gu), rr = geom_rr(J.geom_gu), G = blockDim.x / tpg, RT = G * rr;
    const int row0 = blockIdx.x * RT, nrows = min(RT, J.F - row0);
    const Ranges R = ranges2(expert_part(J, slot, 0) + (size_t)row0 * J.rb_g, nrows * J.rb_g,
                             expert_part(J, slot, 1) + (size_t)row0 * J.rb_u, nrows * J.rb_u);
    stage_issue(R, J.ptab != nullptr && !J.fetched);     // unfetched misses are read from host memory
    const int lay = xq_layout(J.type_g), xo = range_end(R, 1);    // x's limbs after the tile, made meanwhile
    if (lay != 0) xq_prep(x, J.E, xo, lay == 2);
    stage_wait();
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
    float4 a = dot_rows_x(J.type_g, lay, o[0], o[1], o[2], o[3], x, xo, J.E, l, tpg);
    a = group_sum(a, tpg, red);
    float4 b = dot_rows_x(J.type_u, lay, o2[0], o2[1], o2[2], o2[3], x, xo, J.E, l, tpg);
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
extern "C" __global__ void __launch_bounds__(256, GEMV_MIN_CTAS) moe_down(const MoeJob* __restrict__ job,
                                                                          const i32* __restrict__ slots,
                                                                          const float* __restrict__ h, float* out) {
    __shared__ float red[4 * 8];
    pdl_begin();
    const MoeJob J = *job;
    const int slot = slots[blockIdx.y];
    if (slot < 0) return;
    const int tpg = geom_tpg(J.geom_d), rr = geom_rr(J.geom_d), G = blockDim.x / tpg, RT = G * rr;
    const int row0 = blockIdx.x * RT, nrows = min(RT, J.E - row0);
    const Ranges R = ranges2(expert_part(J, slot, 2) + (size_t)row0 * J.rb_d, nrows * J.rb_d, nullptr, 0);
    stage_issue(R, J.ptab != nullptr && !J.fetched);     // unfetched misses are read from host memory
    const float* hj = h + (size_t)blockIdx.y * J.Fp;
    const int lay = xq_layout(J.type_d), xo = range_end(R, 0);
    if (lay != 0) xq_prep(hj, J.F, xo, lay == 2);
    stage_wait();
    __syncthreads();
    const int g = threadIdx.x / tpg, l = threadIdx.x % tpg;
    int o[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int t = q * G + g;
        o[q] = q < rr && t < nrows ? range_off(R, 0) + t * J.rb_d : -1;
    }
    float4 a = dot_rows_x(J.type_d, lay, o[0], o[1], o[2], o[3], hj, xo, J.F, l, tpg);
    a = group_sum(a, tpg, red);
    if (l == 0) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int t = q * G + g;
            if (q < rr && t < nrows) out[(size_t)blockIdx.y * J.E + row0 + t] = f4get(a, q);
        }
    }
}

// sum_j sw[j] sp[j][e] (j in order), then + sh[e] gs: the combine of an element, its part loads issued 16 at a
// time before any is added (k = 10 in 3 dependent rounds of 4 before)
__device__ __forceinline__ float combined_at(const float* sw, const float* const* sp, int k,
                                            const float* __restrict__ sh, float gs, int e) {
    float o = 0.0f;
    for (int j0 = 0; j0 < k; j0 += 16) {
        float v[16];
#pragma unroll
        for (int u = 0; u < 16; u++)
            if (j0 + u < k) v[u] = sp[j0 + u][e];
#pragma unroll
        for (int u = 0; u < 16; u++)
            if (j0 + u < k) o += sw[j0 + u] * v[u];
    }
    return o + sh[e] * gs;
}

// post[l]'s end: out = sum_j wts[j] part_j + sigmoid(sg) shared, part_j = gpu_parts[j] when slots[j] >= 0 else
// host_parts[j] (combine); R[s] += inject_s out with inject_s = 2 sigmoid(inj_raw[s] / hc) (gr_write); then
// xn[s] = RMSNorm(R[s]) * w_next[s], the next read's norm (the next layer's attention read, or the final mixer).
// grid hc; CTA 0 also writes `comb` (the combine stage's output). The weights and part rows are read into shared
// memory first, so each element's k loads are independent (no chain of dependent reads); the stream's own values,
// its inject and gate are read in the same round, the next norm's weights before pdl_begin (load_own; E <=
// RMS_BATCH * 1024), and every element's parts are loaded before any store.
extern "C" __global__ void __launch_bounds__(1024) combine_write_rms(
    const float* __restrict__ wts, const i32* __restrict__ slots, const float* __restrict__ gpu_parts,
    const float* __restrict__ host_parts, const float* __restrict__ shared, const float* __restrict__ sg,
    const float* __restrict__ inj_raw, float* R, float* comb, const float* __restrict__ w_next, float* xn, int k,
    int E, int hc, float eps) {
    __shared__ float red[33];
    __shared__ float sw[64];
    __shared__ const float* sp[64];
    const int s = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    float wv[RMS_BATCH], rv[RMS_BATCH], o[RMS_BATCH];
    load_own(w_next + (size_t)s * E, E, tid, nt, wv);
    pdl_begin();
    if (tid < k) {
        sw[tid] = wts[tid];
        sp[tid] = (slots[tid] >= 0 ? gpu_parts : host_parts) + (size_t)tid * E;
    }
    float* r = R + (size_t)s * E;
    load_own(r, E, tid, nt, rv);
    const float inj_r = inj_raw[s], sg_r = sg[0];
    __syncthreads();
    const float inj = 2.0f * sigmoidf_(inj_r / (float)hc), gs = sigmoidf_(sg_r);
#pragma unroll
    for (int u = 0; u < RMS_BATCH; u++) o[u] = tid + u * nt < E ? combined_at(sw, sp, k, shared, gs, tid + u * nt) : 0.0f;
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < RMS_BATCH; u++)
        if (tid + u * nt < E) {
            const int e = tid + u * nt;
            if (s == 0) comb[e] = o[u];
            rv[u] = rv[u] + inj * o[u];
            r[e] = rv[u];
            ss += rv[u] * rv[u];
        }
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)E + eps);
    scale_own(rv, wv, inv, xn + (size_t)s * E, E, tid, nt);
}

// ---- the batched step's routed experts: the step's (row, choice) pairs grouped by expert, on the device -------
//
// moe_group (one CTA of 1024 threads): for the step's rows (step[T]) and their k choices ids (rows, k), the pairs
// whose expert has a VRAM slot (slot_of[e] >= 0; slot_of null: slot e, every expert resident) are counted per
// expert, laid out expert by expert (pair_tok[p] = the pair's row, pair_of[row * k + j] = its pair p, -1 when the
// host computes it) and cut into tiles: tiles[4 i] = {slot, first pair, pairs, plane row}, the plane row where
// moe_split puts the tile's rows. An expert's c pairs make c / bn full tiles of bn pairs in the first list
// (tiles[0 ..], n_tiles[0] of them); the rest, r = c % bn, one more tile there when r > bn2, else (0 < r <= bn2) a
// tile in the second list (tiles[4 cap ..], n_tiles[1]), which the tiles of bn2 pairs take: a 128-pair tile costs
// twice the multiplies of a 64-pair one, so an expert's last few pairs go to the narrower tile (moe.py tile_plan).
// bn2 = 0: one list. Plane rows: the first list's tile i at i bn, the second's tile j at cap bn + j bn2.
// The order of pairs inside an expert's group is the atomics' (each pair's result does not depend on it).
extern "C" __global__ void __launch_bounds__(1024) moe_group(const i32* __restrict__ ids, const i32* __restrict__ slot_of,
                                                             const i32* __restrict__ step, i32* pair_tok, i32* pair_of,
                                                             i32* tiles, i32* n_tiles, int n_exp, int k, int bn,
                                                             int bn2, int cap) {
    __shared__ int cnt[1024], fill[1024];
    __shared__ int wsum[3][32];
    pdl_begin();
    const int tid = threadIdx.x, n = step[STEP_T] * k;
    const int e = tid;
    cnt[e] = 0;
    fill[e] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
        const int x = ids[i];
        if (slot_of == nullptr || slot_of[x] >= 0) atomicAdd(&cnt[x], 1);
    }
    __syncthreads();
    const int c = e < n_exp ? cnt[e] : 0, r = c % bn;
    const int nw = c / bn + (r > bn2 ? 1 : 0), nn = r > 0 && r <= bn2 ? 1 : 0;
    // exclusive scans of the pair counts and of both lists' tile counts (block_exscan of qsa.cu, three at once)
    const int lane = tid & 31, w = tid >> 5;
    int v[3] = {c, nw, nn};
#pragma unroll
    for (int o = 1; o < 32; o <<= 1)
#pragma unroll
        for (int q = 0; q < 3; q++) {
            const int y = __shfl_up_sync(FULL_MASK, v[q], o);
            if (lane >= o) v[q] += y;
        }
    if (lane == 31)
#pragma unroll
        for (int q = 0; q < 3; q++) wsum[q][w] = v[q];
    __syncthreads();
    if (w == 0)
#pragma unroll
        for (int q = 0; q < 3; q++) {
            int sq = wsum[q][lane];
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(FULL_MASK, sq, o);
                if (lane >= o) sq += y;
            }
            wsum[q][lane] = sq;
        }
    __syncthreads();
    int ex[3];
#pragma unroll
    for (int q = 0; q < 3; q++) ex[q] = (w > 0 ? wsum[q][w - 1] : 0) + v[q];     // inclusive
    const int off = ex[0] - c, tw = ex[1] - nw, tn = ex[2] - nn;
    if (tid == blockDim.x - 1) {
        n_tiles[0] = ex[1];
        n_tiles[1] = ex[2];
    }
    const int slot = e < n_exp ? (slot_of == nullptr ? e : slot_of[e]) : -1;
    for (int q = 0; q < nw; q++) {
        i32* tq = tiles + 4 * (tw + q);
        tq[0] = slot;
        tq[1] = off + q * bn;
        tq[2] = min(bn, c - q * bn);
        tq[3] = (tw + q) * bn;
    }
    if (nn) {
        i32* tq = tiles + 4 * (cap + tn);
        tq[0] = slot;
        tq[1] = off + c - r;
        tq[2] = r;
        tq[3] = cap * bn + tn * bn2;
    }
    __shared__ int offs[1024];
    offs[e] = off;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
        const int x = ids[i];
        if (slot_of == nullptr || slot_of[x] >= 0) {
            const int p = offs[x] + atomicAdd(&fill[x], 1);
            pair_tok[p] = i / k;
            pair_of[i] = p;
        } else {
            pair_of[i] = -1;
        }
    }
}

// The rows of each expert tile split once for all its M tiles (gemm.py GEMM_XPREP; x_split of gemm.cu, per tile):
// tile i's rows (x[xrow[p]] for its pairs p when xrow is set, else x[p]) into plane rows [b, b + BN) of xs's
// k-chunk blockIdx.y, b its plane row (moe_group), zeros past its pairs. grid (max tiles, chunks); tiles past
// *n_tiles do nothing.
template <int BK, int BN>
__device__ __forceinline__ void moe_split_body(const i32* __restrict__ tiles, const i32* __restrict__ n_tiles,
                                               const float* __restrict__ x, int ldx, int n_in,
                                               const i32* __restrict__ xrow, u8* xs, int xs_rows) {
    pdl_begin();
    const int i = blockIdx.x;
    if (i >= *n_tiles) return;
    const int p0 = tiles[4 * i + 1], np_ = tiles[4 * i + 2], b = tiles[4 * i + 3];
    const XsChunk<BK> c(xs, xs_rows, (int)blockIdx.y);
    load_x<BK, BN>(xrow != nullptr ? x : x + (size_t)p0 * ldx, ldx, xrow != nullptr ? xrow + p0 : nullptr, 0, np_,
                   (int)blockIdx.y * BK, n_in, (float*)c.hi(b), c.shift(b), (int)c.plane);
}

// h[p] = silu(gate_s x[pair_tok[p]]) * (up_s x[pair_tok[p]]) for the pairs p of tile blockIdx.y (expert slot s);
// grid (ceil(F / OM), max tiles), tiles past *n_tiles do nothing; OM = BM outputs a CTA, or BM / 2 in the paired
// tile (PAIR: gate's and up's rows in one accumulator set, gemm.cuh). x (rows, E), h (pairs, Fp); xs: the tiles'
// rows split by moe_split (null: the tiles split them).
template <int BK, int MT, int NT, int WM, int WN, bool PAIR>
__device__ __forceinline__ void moe_gu_body(const MoeJob* __restrict__ job, const i32* __restrict__ tiles,
                                            const i32* __restrict__ n_tiles, const float* __restrict__ x,
                                            const i32* __restrict__ pair_tok, float* h, const u8* xs, int xs_rows) {
    constexpr int OM = WM * MT * 16 / (PAIR ? 2 : 1);
    pdl_begin();
    if ((int)blockIdx.y >= *n_tiles) return;
    const MoeJob J = *job;
    const i32* tq = tiles + 4 * blockIdx.y;
    const int slot = tq[0], p0 = tq[1], np_ = tq[2];
    gemm_tile<!PAIR, BK, MT, NT, WM, WN, PAIR>(J.g_base + slot * J.g_stride, J.u_base + slot * J.u_stride, J.type_g,
                              J.type_u, J.rb_g, J.rb_u, J.E, J.F, (int)blockIdx.x * OM, x, J.E, pair_tok + p0, np_, 0,
                              h + (size_t)p0 * J.Fp, J.Fp, xs, xs_rows, tq[3]);
}

// out[p] = down_s h[p]; grid (ceil(E / BM), max tiles). out (pairs, E); xs as moe_gu's.
template <int BK, int MT, int NT, int WM, int WN>
__device__ __forceinline__ void moe_down_body(const MoeJob* __restrict__ job, const i32* __restrict__ tiles,
                                              const i32* __restrict__ n_tiles, const float* __restrict__ h, float* out,
                                              const u8* xs, int xs_rows) {
    constexpr int BM = WM * MT * 16;
    pdl_begin();
    if ((int)blockIdx.y >= *n_tiles) return;
    const MoeJob J = *job;
    const i32* tq = tiles + 4 * blockIdx.y;
    const int slot = tq[0], p0 = tq[1], np_ = tq[2];
    gemm_tile<false, BK, MT, NT, WM, WN>(J.d_base + slot * J.d_stride, nullptr, J.type_d, 0, J.rb_d, 0, J.F, J.E,
                              (int)blockIdx.x * BM, h + (size_t)p0 * J.Fp, J.Fp, nullptr, np_, 0,
                              out + (size_t)p0 * J.E, J.E, xs, xs_rows, tq[3]);
}

// The 16-pair tiles (NT = 2: steps of few pairs an expert, each weight decoded for ~10 pairs) are bound by their
// weight loads' latency: MOE_MIN_CTAS16 CTAs a multiprocessor for them against gemm.cuh's 3 (165 registers): at 5
// (96 registers, the gate/up tile spilling 144 bytes) a 512-row chunk 325.9 -> 301.4 ms (4: 306.6; H100, same
// call). 6 (80 registers, 192 bytes of stack) fits by shared memory only with GEMM_COMPACT_W's 21 KB gate/up tiles
// (40 KB without): with both, 1024-row chunks 428.9 -> 422.4 ms, 4096 1,069.6 -> 1,065.2 (H100, same call;
// bench/RESULTS.md 2026-12-07). 0: GM_MIN_CTAS, as the other tiles. With Q2_0's codes (gemm.cuh GEMM_Q2_CODES),
// 7 and 8 move time between the launches (512 rows, gpu_check.py --phases moe: gate/up 1.864 / 1.777 / 1.760 ms a
// layer at 6 / 7 / 8, down 0.866 / 0.934 / 0.928), and gate/up at 8 with down at 6 left the 512-row chunk as it was
// (282.23 against 282.44 ms; H100, bench/RESULTS.md twenty-third session).
#ifndef MOE_MIN_CTAS16
#define MOE_MIN_CTAS16 6
#endif
#define MOE_MIN_CTAS(GLU, BK, MT, NT) (NT == 2 && MOE_MIN_CTAS16 ? MOE_MIN_CTAS16 : GM_MIN_CTAS(GLU, BK, MT))

// tiles of 16, 64 or 128 pairs, k-chunks of 64 or 128 (gemm.cuh); the down projection's 64-pair tiles take 128
// rows (MTD m16 tiles a warp: gemm.py tile_bm); the 128-pair tiles are 64 x 128, gate/up as the paired GLU tile
#define MOE_GEMMS(SUF, BK, MT, NT, WM, WN, MTD)                                                                      \
    extern "C" __global__ void __launch_bounds__(GM_THREADS, MOE_MIN_CTAS(true, BK, MT, NT)) moe_gu##SUF(            \
        const MoeJob* __restrict__ job, const i32* __restrict__ tiles, const i32* __restrict__ n_tiles,           \
        const float* __restrict__ x, const i32* __restrict__ pair_tok, float* h, const u8* xs, int xs_rows) {    \
        moe_gu_body<BK, MT, NT, WM, WN, WN * NT * 8 == 128>(job, tiles, n_tiles, x, pair_tok, h, xs, xs_rows);     \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GM_THREADS, MOE_MIN_CTAS(false, BK, MTD, NT)) moe_down##SUF(        \
        const MoeJob* __restrict__ job, const i32* __restrict__ tiles, const i32* __restrict__ n_tiles,           \
        const float* __restrict__ h, float* out, const u8* xs, int xs_rows) {                                     \
        moe_down_body<BK, MTD, NT, WM, WN>(job, tiles, n_tiles, h, out, xs, xs_rows);                             \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GM_THREADS) moe_split##SUF(                                      \
        const i32* __restrict__ tiles, const i32* __restrict__ n_tiles, const float* __restrict__ x, int ldx,     \
        int n_in, const i32* __restrict__ xrow, u8* xs, int xs_rows) {                                           \
        moe_split_body<BK, WN * NT * 8>(tiles, n_tiles, x, ldx, n_in, xrow, xs, xs_rows);                         \
    }
MOE_GEMMS(16_k64, 64, 1, 2, 4, 1, 1)
MOE_GEMMS(16_k128, 128, 1, 2, 4, 1, 1)
MOE_GEMMS(64_k64, 64, 2, 4, 2, 2, 4)
MOE_GEMMS(64_k128, 128, 2, 4, 2, 2, 4)
MOE_GEMMS(128_k64, 64, 4, 4, 1, 4, 4)
MOE_GEMMS(128_k128, 128, 4, 4, 1, 4, 4)

// combine_write_rms for the step's rows: row t's out = sum_j wts[t, j] part(t, j) + sigmoid(sg[t]) shared[t], part
// = gpu_out[pair_of[t k + j]] when that is >= 0, else host_parts[t k + j]; then gr_write and the next read's norm
// as combine_write_rms, for every stream s < hc (<= 4). grid (rows): a row's combine is read from its k parts once
// for all its streams (a CTA per stream read them hc times: 4x the bytes of the kernel's largest read). Each
// thread's elements and sums are those of the CTA per stream, so the same numbers bit for bit. comb (rows, E).
extern "C" __global__ void __launch_bounds__(1024) combine_rows(
    const float* __restrict__ wts, const i32* __restrict__ pair_of, const float* __restrict__ gpu_out,
    const float* __restrict__ host_parts, const float* __restrict__ shared, const float* __restrict__ sg,
    const float* __restrict__ inj_raw, float* R, float* comb, const float* __restrict__ w_next, float* xn,
    const i32* __restrict__ step, int k, int E, int hc, float eps) {
    __shared__ float red[33];
    __shared__ float sw[64];
    __shared__ const float* sp[64];
    pdl_begin();
    const int t = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    if (t >= step[STEP_T]) return;
    if (tid < k) {
        sw[tid] = wts[t * k + tid];
        const int p = pair_of[t * k + tid];
        sp[tid] = p >= 0 ? gpu_out + (size_t)p * E : host_parts + ((size_t)t * k + tid) * E;
    }
    __syncthreads();
    const float gs = sigmoidf_(sg[t]);
    float inj[4], ss[4];
#pragma unroll
    for (int s = 0; s < 4; s++) {
        inj[s] = s < hc ? 2.0f * sigmoidf_(inj_raw[t * hc + s] / (float)hc) : 0.0f;
        ss[s] = 0.0f;
    }
    float* r = R + (size_t)t * hc * E;
    const float* sh = shared + (size_t)t * E;
    for (int e = tid; e < E; e += nt) {
        const float o = combined_at(sw, sp, k, sh, gs, e);
        comb[(size_t)t * E + e] = o;
#pragma unroll
        for (int s = 0; s < 4; s++)
            if (s < hc) {
                const float v = r[(size_t)s * E + e] + inj[s] * o;
                r[(size_t)s * E + e] = v;
                ss[s] += v * v;
            }
    }
#pragma unroll
    for (int s = 0; s < 4; s++)
        if (s < hc) {
            const float inv = 1.0f / sqrtf(block_sum(ss[s], red) / (float)E + eps);
            scale_into(r + (size_t)s * E, w_next + (size_t)s * E, inv, xn + ((size_t)t * hc + s) * E, E, tid, nt);
        }
}
