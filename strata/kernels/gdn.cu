// gdn.cu: the Gated DeltaNet core of one token, fused: causal conv + SiLU, q/k L2 norms, the gates, the delta-rule
// state update, the output and its gated RMSNorm. The projections before it and ssm_out after it are GEMV jobs.
#include "quant.cuh"

// One CTA per value head h (key head h % Hk, the converter's tiled order). Block (32*ceil(Dv/32), KS) with
// KS = ceil(Dk/16): thread (v, ky) holds S[h, 16ky .. 16ky+15, v] in registers, so the state is read and written
// once. Shared memory: q[Dk] k[Dk] v[Dv] part[KS*Dv].
//
// qkv (conv_dim,), z (Hv*Dv,), alpha/beta (Hv,): raw projections. conv_w (conv_dim, K) row-major.
// ring (K, conv_dim): the raw qkv of position p lives in row p % K; this token reads rows (t+1+j) % K, j < K-1,
// (positions t-K+1 .. t-1, zeros before the start) and writes row t % K, which no CTA reads this step. Key-head
// channels are written by CTA h == kh only (the others read the same rows).
// S (Hv, Dk, Dv): the recurrent state, as strata.reference.gdn.GdnState.S.
#define GDN_CONV_CH 4       // conv channels a thread of gdn_core (gdn.py CONV_CH)
extern "C" __global__ void __launch_bounds__(1024) gdn_core(
    const float* __restrict__ qkv, const float* __restrict__ z, const float* __restrict__ alpha,
    const float* __restrict__ beta, const float* __restrict__ conv_w, const float* __restrict__ dt,
    const float* __restrict__ A, const float* __restrict__ norm_w, float* ring, float* S, float* y,
    const i32* __restrict__ step, int Hk, int Hv, int Dk, int Dv, int K, float eps) {
    float* sm = (float*)SMEM;
    __shared__ float red[33];
    float* sq = sm;
    float* sk = sm + Dk;
    float* sv = sm + 2 * Dk;
    float* part = sm + 2 * Dk + Dv;
    const int h = blockIdx.x, kh = h % Hk, kd = Hk * Dk, conv_dim = 2 * kd + Hv * Dv;
    const int tid = threadIdx.x + threadIdx.y * blockDim.x, nt = blockDim.x * blockDim.y;
    // The state is the largest read: issue it first, so it streams in while the conv and the norms run, and
    // before pdl_begin, with the conv's history in the ring, the step's position and the constants: only this
    // layer's gdn_core of an earlier step (or gdn_scan) wrote the state and the ring rows read here, and the host's
    // step copy began the token; a kernel's CTAs start only after the kernel two before it completed (every kernel
    // passes pdl_begin before it lets the next one start), so all of them are long complete. Only the projections'
    // outputs (qkv, z, alpha, beta) wait for pdl_begin.
    const int v = threadIdx.x, ky = threadIdx.y;
    const bool col = v < Dv;
    float* Sh = S + (size_t)h * Dk * Dv;
    float st[16];
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int k = ky * 16 + i;
        st[i] = (col && k < Dk) ? Sh[(size_t)k * Dv + v] : 0.0f;
    }
    const int t = step[STEP_POS];
    // 1. conv over [K-1 previous raw inputs, this one], SiLU on every channel (before the split): a thread's
    // channels i = tid + u nt (u < GDN_CONV_CH, gdn.py checks), their history's part of the sum before pdl_begin
    float hist[GDN_CONV_CH], w_cur[GDN_CONV_CH];
    int chan[GDN_CONV_CH];
#pragma unroll
    for (int u = 0; u < GDN_CONV_CH; u++) {
        const int i = tid + u * nt;
        chan[u] = i < Dk ? kh * Dk + i : i < 2 * Dk ? kd + kh * Dk + (i - Dk) : 2 * kd + h * Dv + (i - 2 * Dk);
        hist[u] = w_cur[u] = 0.0f;
        if (i < 2 * Dk + Dv) {
            const float* wc = conv_w + (size_t)chan[u] * K;
            for (int j = 0; j < K - 1; j++) hist[u] += ring[(size_t)((t + 1 + j) % K) * conv_dim + chan[u]] * wc[j];
            w_cur[u] = wc[K - 1];
        }
    }
    const float a_h = A[h], dt_h = dt[h], nw = col ? norm_w[v] : 0.0f;
    pdl_begin();
#pragma unroll
    for (int u = 0; u < GDN_CONV_CH; u++) {
        const int i = tid + u * nt;
        if (i < 2 * Dk + Dv) {
            const float cur = qkv[chan[u]];
            sm[i] = siluf_(hist[u] + cur * w_cur[u]);
            if (i >= 2 * Dk || h == kh) ring[(size_t)(t % K) * conv_dim + chan[u]] = cur;
        }
    }
    __syncthreads();

    // 2. q, k L2-normalized (FLA eps 1e-6), q also scaled by 1/sqrt(Dk)
    float a = 0.0f, b = 0.0f;
    for (int i = tid; i < Dk; i += nt) {
        a += sq[i] * sq[i];
        b += sk[i] * sk[i];
    }
    const float nq = 1.0f / sqrtf(block_sum(a, red) + 1e-6f);
    const float nk = 1.0f / sqrtf(block_sum(b, red) + 1e-6f);
    const float sd = sqrtf((float)Dk);
    for (int i = tid; i < Dk; i += nt) {
        sq[i] = (sq[i] * nq) / sd;
        sk[i] = sk[i] * nk;
    }
    __syncthreads();

    // 3. gates: beta = sigmoid(beta_raw), decay exp(g) with g = A * softplus(alpha_raw + dt_bias)
    const float bt = sigmoidf_(beta[h]);
    const float eg = expf(a_h * softplusf_(alpha[h] + dt_h));

    // 4. S = exp(g) S; delta = beta (v - S^T k); S += k delta^T; o = S^T q
    float p = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int k = ky * 16 + i;
        st[i] = (col && k < Dk) ? st[i] * eg : 0.0f;
        if (k < Dk) p += st[i] * sk[k];
    }
    if (col) part[ky * Dv + v] = p;
    __syncthreads();
    float kv = 0.0f;
    if (col)
        for (int j = 0; j < blockDim.y; j++) kv += part[j * Dv + v];
    const float delta = col ? (sv[v] - kv) * bt : 0.0f;
    __syncthreads();
    p = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int k = ky * 16 + i;
        if (col && k < Dk) {
            st[i] = st[i] + sk[k] * delta;
            Sh[(size_t)k * Dv + v] = st[i];
            p += st[i] * sq[k];
        }
    }
    if (col) part[ky * Dv + v] = p;
    __syncthreads();
    float o = 0.0f;
    if (col)
        for (int j = 0; j < blockDim.y; j++) o += part[j * Dv + v];

    // 5. y = RMSNorm(o, ssm_norm) * sigmoid(z), per head
    const float ss = block_sum(ky == 0 && col ? o * o : 0.0f, red);
    const float inv = 1.0f / sqrtf(ss / (float)Dv + eps);
    if (ky == 0 && col) y[(size_t)h * Dv + v] = ((o * inv) * nw) * sigmoidf_(z[(size_t)h * Dv + v]);
}

// ---- a chunk of T rows of one sequence (positions step[POS] + t, t < step[T]) ---------------------------------
//
// gdn_conv: c[t, ch] = silu(causal conv of channel ch at row t) over every conv channel, the K-1 inputs before
// each row from the chunk's own rows or, before the chunk, from the ring (zeros before the start). A separate
// launch, because gdn_prep then overwrites ring rows that other CTAs' first rows read.
// qkv, c (rows, conv_dim); grid-stride over rows x conv_dim.
extern "C" __global__ void __launch_bounds__(256) gdn_conv(const float* __restrict__ qkv, const float* __restrict__ conv_w,
                                                           const float* __restrict__ ring, float* c,
                                                           const i32* __restrict__ step, int conv_dim, int K) {
    pdl_begin();
    const int T = step[STEP_T], p0 = step[STEP_POS];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < T * conv_dim; i += gridDim.x * blockDim.x) {
        const int t = i / conv_dim, ch = i % conv_dim;
        const float* wc = conv_w + (size_t)ch * K;
        float acc = 0.0f;
        for (int j = 0; j < K - 1; j++) {
            const int tt = t - (K - 1) + j, p = p0 + tt;       // the input's row in the chunk, its position
            const float v = tt >= 0 ? qkv[(size_t)tt * conv_dim + ch] : p >= 0 ? ring[(size_t)(p % K) * conv_dim + ch]
                                                                                 : 0.0f;
            acc += v * wc[j];
        }
        acc += qkv[(size_t)t * conv_dim + ch] * wc[K - 1];
        c[i] = siluf_(acc);
    }
}

// The chunk's delta rule in three launches, so the sequential part is only the state recurrence:
// gdn_prep (grid (Hk, rows)): per row and key head, q and k L2-normalized (q also / sqrt(Dk)) -> qn, kn (rows, Hk,
// Dk), and the gates of the value heads h = kh (mod Hk): bt = sigmoid(beta), eg = exp(A softplus(alpha + dt))
// (rows, Hv); the ring takes the raw inputs of the chunk's last K rows (gdn_conv, which reads it, ran before).
extern "C" __global__ void __launch_bounds__(128) gdn_prep(
    const float* __restrict__ c, const float* __restrict__ qkv, const float* __restrict__ alpha,
    const float* __restrict__ beta, const float* __restrict__ dt, const float* __restrict__ A, float* qn, float* kn,
    float* bt, float* eg, float* ring, const i32* __restrict__ step, int Hk, int Hv, int Dk, int Dv, int K) {
    pdl_begin();
    __shared__ float red[33];
    const int kh = blockIdx.x, t = blockIdx.y, T = step[STEP_T], p0 = step[STEP_POS];
    if (t >= T) return;
    const int kd = Hk * Dk, conv_dim = 2 * kd + Hv * Dv;
    const float* ct = c + (size_t)t * conv_dim;
    float a = 0.0f, b = 0.0f;
    for (int i = threadIdx.x; i < Dk; i += blockDim.x) {
        const float q = ct[kh * Dk + i], k = ct[kd + kh * Dk + i];
        a += q * q;
        b += k * k;
    }
    const float nq = 1.0f / sqrtf(block_sum(a, red) + 1e-6f);
    const float nk = 1.0f / sqrtf(block_sum(b, red) + 1e-6f);
    const float sd = sqrtf((float)Dk);
    const size_t o = ((size_t)t * Hk + kh) * Dk;
    for (int i = threadIdx.x; i < Dk; i += blockDim.x) {
        qn[o + i] = (ct[kh * Dk + i] * nq) / sd;
        kn[o + i] = ct[kd + kh * Dk + i] * nk;
    }
    for (int h = kh + Hk * (int)threadIdx.x; h < Hv; h += Hk * blockDim.x) {
        bt[(size_t)t * Hv + h] = sigmoidf_(beta[(size_t)t * Hv + h]);
        eg[(size_t)t * Hv + h] = expf(A[h] * softplusf_(alpha[(size_t)t * Hv + h] + dt[h]));
    }
    if (t < T - K) return;
    const float* raw = qkv + (size_t)t * conv_dim;
    float* dst = ring + (size_t)((p0 + t) % K) * conv_dim;
    for (int i = threadIdx.x; i < Dk; i += blockDim.x) {
        dst[kh * Dk + i] = raw[kh * Dk + i];
        dst[kd + kh * Dk + i] = raw[kd + kh * Dk + i];
    }
    for (int h = kh; h < Hv; h += Hk)
        for (int i = threadIdx.x; i < Dv; i += blockDim.x) dst[2 * kd + h * Dv + i] = raw[2 * kd + h * Dv + i];
}

// gdn_scan (grid (Hv, ceil(Dv / 16)), 128 threads): the recurrence over the chunk's rows in order. The columns of a
// head's state are independent (column v sees only q, k, v[v] and its own column), so a warp owns 4 columns: lane
// = 8 * column + g holds S[16 g .. 16 g + 15, v] in registers from the first row to the last (read and written once
// per chunk); the sums over the state's rows are 3 xor shuffles inside the column's 8 lanes. Per row, as gdn_core:
// S = eg S; delta = bt (v - S^T k); S += k delta^T; o = S^T q -> o (rows, Hv, Dv), normalized by gdn_out. Dk <= 128.
//
// The rows' inputs do not depend on the state, so they reach the warps through shared memory GDN_ROWS rows at a
// time, in two stages: the CTA's cp.async copies of rows r + GDN_ROWS .. are in flight while its warps run rows
// r .., and no row waits for memory (a row's own arithmetic is a few hundred clocks, an L2 or HBM round trip
// longer). The CTA's four warps share one copy of the key head's k and q. H100, 4096 rows at the flash heads
// (bench/gpu_check.py --phases gdn): 2.03 ms, against 6.35 reading each row from global memory at its turn; 4
// lanes a column (32 state rows a lane, 2 shuffles a sum) 2.22, and 4 partial sums a lane 2.02 (not kept).
#define GDN_ROWS 16
// one row of a stage, in floats: k at 0, q at GDN_KP (lane group g's 16 values at 20 g, so that a float4 read by the
// 8 groups covers 32 distinct banks), the CTA's 16 v at 2 GDN_KP, then eg and bt; 1360 bytes, 16-aligned
#define GDN_KP 160
#define GDN_RS (2 * GDN_KP + 20)

// one row of the recurrence on a lane's 16 state rows; returns o[v] (the column's sum, in every lane of it)
__device__ __forceinline__ float gdn_row(float (&st)[16], const float (&kr)[16], const float (&qr)[16], float e,
                                         float b, float vv) {
    float p = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        st[i] *= e;
        p += st[i] * kr[i];
    }
    p += __shfl_xor_sync(FULL_MASK, p, 1);
    p += __shfl_xor_sync(FULL_MASK, p, 2);
    p += __shfl_xor_sync(FULL_MASK, p, 4);
    const float delta = (vv - p) * b;
    float q = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        st[i] = st[i] + kr[i] * delta;
        q += st[i] * qr[i];
    }
    q += __shfl_xor_sync(FULL_MASK, q, 1);
    q += __shfl_xor_sync(FULL_MASK, q, 2);
    q += __shfl_xor_sync(FULL_MASK, q, 4);
    return q;
}

extern "C" __global__ void __launch_bounds__(128) gdn_scan(
    const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ c,
    const float* __restrict__ bt, const float* __restrict__ eg, float* S, float* o, const i32* __restrict__ step,
    int Hk, int Hv, int Dk, int Dv) {
    pdl_begin();
    const int h = blockIdx.x, kh = h % Hk, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int v0 = blockIdx.y * 16, cv = warp * 4 + (lane >> 3), v = v0 + cv, g = lane & 7, T = step[STEP_T];
    const int kd = Hk * Dk, conv_dim = 2 * kd + Hv * Dv;
    const bool col = v < Dv;
    float* Sh = S + (size_t)h * Dk * Dv;
    float st[16];
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int k = g * 16 + i;
        st[i] = col && k < Dk ? Sh[(size_t)k * Dv + v] : 0.0f;
    }
    float kr[16], qr[16];
    float* sm = (float*)SMEM;
    // zeros where no copy writes (k, q past Dk; v past Dv): the lanes multiply them by their zero state rows
    for (int i = threadIdx.x; i < 2 * GDN_ROWS * GDN_RS; i += blockDim.x) sm[i] = 0.0f;
    __syncthreads();
    // a copy unit is 4 floats (16 bytes) where every row segment is a multiple of 4, else one float
    const int nv = min(16, Dv - v0), w = Dk % 4 == 0 && Dv % 4 == 0 ? 4 : 1, uk = Dk / w, uv = nv / w;
    const int U = 2 * uk + uv + 2, nst = (T + GDN_ROWS - 1) / GDN_ROWS;
    const float* vsrc = c + 2 * kd + (size_t)h * Dv + v0;
    auto issue = [&](int s) {
        const int r0 = s * GDN_ROWS, n = min(GDN_ROWS, T - r0);
        const int base = (s & 1) * GDN_ROWS * GDN_RS;
        for (int i = threadIdx.x; i < n * U; i += blockDim.x) {
            const int r = i / U, u = i % U, t = r0 + r, row = base + r * GDN_RS;
            const float* src;
            int dst;
            if (u < 2 * uk) {
                const int k = (u % uk) * w;
                src = (u < uk ? kn : qn) + ((size_t)t * Hk + kh) * Dk + k;
                dst = row + (u < uk ? 0 : GDN_KP) + (k >> 4) * 20 + (k & 15);
            } else if (u < 2 * uk + uv) {
                src = vsrc + (size_t)t * conv_dim + (u - 2 * uk) * w;
                dst = row + 2 * GDN_KP + (u - 2 * uk) * w;
            } else {
                src = (u == U - 2 ? eg : bt) + (size_t)t * Hv + h;
                dst = row + 2 * GDN_KP + 16 + (u == U - 2 ? 0 : 1);
            }
            if (w == 4 && u < 2 * uk + uv) cp_async16(4 * dst, (const u8*)src);
            else cp_async4(4 * dst, (const u8*)src);
        }
        cp_async_commit();
    };
    if (nst > 0) issue(0);
    for (int s = 0; s < nst; s++) {
        cp_async_wait_pending<0>();
        __syncthreads();                    // stage s is in; every warp is done with stage s - 1, whose buffer
        if (s + 1 < nst) issue(s + 1);      // takes stage s + 1
        const float* row = sm + (s & 1) * GDN_ROWS * GDN_RS;
        const int n = min(GDN_ROWS, T - s * GDN_ROWS);
        for (int r = 0; r < n; r++, row += GDN_RS) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float4 a = *(const float4*)(row + g * 20 + 4 * j), b = *(const float4*)(row + GDN_KP + g * 20 + 4 * j);
                kr[4 * j] = a.x, kr[4 * j + 1] = a.y, kr[4 * j + 2] = a.z, kr[4 * j + 3] = a.w;
                qr[4 * j] = b.x, qr[4 * j + 1] = b.y, qr[4 * j + 2] = b.z, qr[4 * j + 3] = b.w;
            }
            const float vv = col ? row[2 * GDN_KP + cv] : 0.0f;
            const float q = gdn_row(st, kr, qr, row[2 * GDN_KP + 16], row[2 * GDN_KP + 17], vv);
            if (col && g == 0) o[((size_t)(s * GDN_ROWS + r) * Hv + h) * Dv + v] = q;
        }
    }
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int k = g * 16 + i;
        if (col && k < Dk) Sh[(size_t)k * Dv + v] = st[i];
    }
}

// gdn_out (grid (Hv, rows)): y = RMSNorm(o, ssm_norm) * sigmoid(z) per head and row (gdn_core's step 5).
extern "C" __global__ void __launch_bounds__(128) gdn_out(const float* __restrict__ o, const float* __restrict__ z,
                                                          const float* __restrict__ norm_w, float* y,
                                                          const i32* __restrict__ step, int Hv, int Dv, float eps) {
    pdl_begin();
    __shared__ float red[33];
    const int h = blockIdx.x, t = blockIdx.y;
    if (t >= step[STEP_T]) return;
    const size_t b = ((size_t)t * Hv + h) * Dv;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < Dv; i += blockDim.x) ss += o[b + i] * o[b + i];
    const float inv = 1.0f / sqrtf(block_sum(ss, red) / (float)Dv + eps);
    for (int i = threadIdx.x; i < Dv; i += blockDim.x) y[b + i] = ((o[b + i] * inv) * norm_w[i]) * sigmoidf_(z[b + i]);
}
