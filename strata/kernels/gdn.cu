// gdn.cu: the Gated DeltaNet core of one token, fused: causal conv + SiLU, q/k L2 norms, the gates, the delta-rule
// state update, the output and its gated RMSNorm. The projections before it and ssm_out after it are GEMV jobs.
#include "common.cuh"

// One CTA per value head h (key head h % Hk, the converter's tiled order). Block (32*ceil(Dv/32), KS) with
// KS = ceil(Dk/16): thread (v, ky) holds S[h, 16ky .. 16ky+15, v] in registers, so the state is read and written
// once. Shared memory: q[Dk] k[Dk] v[Dv] part[KS*Dv].
//
// qkv (conv_dim,), z (Hv*Dv,), alpha/beta (Hv,): raw projections. conv_w (conv_dim, K) row-major.
// ring (K, conv_dim): the raw qkv of position p lives in row p % K; this token reads rows (t+1+j) % K, j < K-1,
// (positions t-K+1 .. t-1, zeros before the start) and writes row t % K, which no CTA reads this step. Key-head
// channels are written by CTA h == kh only (the others read the same rows).
// S (Hv, Dk, Dv): the recurrent state, as strata.reference.gdn.GdnState.S.
extern "C" __global__ void __launch_bounds__(1024) gdn_core(
    const float* __restrict__ qkv, const float* __restrict__ z, const float* __restrict__ alpha,
    const float* __restrict__ beta, const float* __restrict__ conv_w, const float* __restrict__ dt,
    const float* __restrict__ A, const float* __restrict__ norm_w, float* ring, float* S, float* y,
    const i32* __restrict__ step, int Hk, int Hv, int Dk, int Dv, int K, float eps) {
    pdl_begin();
    extern __shared__ float sm[];
    __shared__ float red[33];
    float* sq = sm;
    float* sk = sm + Dk;
    float* sv = sm + 2 * Dk;
    float* part = sm + 2 * Dk + Dv;
    const int h = blockIdx.x, kh = h % Hk, kd = Hk * Dk, conv_dim = 2 * kd + Hv * Dv;
    const int t = step[STEP_POS];
    const int tid = threadIdx.x + threadIdx.y * blockDim.x, nt = blockDim.x * blockDim.y;
    // the state is the largest read: issue it first, so it streams in while the conv and the norms run
    const int v = threadIdx.x, ky = threadIdx.y;
    const bool col = v < Dv;
    float* Sh = S + (size_t)h * Dk * Dv;
    float st[16];
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int k = ky * 16 + i;
        st[i] = (col && k < Dk) ? Sh[(size_t)k * Dv + v] : 0.0f;
    }

    // 1. conv over [K-1 previous raw inputs, this one], SiLU on every channel (before the split)
    for (int i = tid; i < 2 * Dk + Dv; i += nt) {
        const int c = i < Dk ? kh * Dk + i : i < 2 * Dk ? kd + kh * Dk + (i - Dk) : 2 * kd + h * Dv + (i - 2 * Dk);
        const float* wc = conv_w + (size_t)c * K;
        float acc = 0.0f;
        for (int j = 0; j < K - 1; j++) acc += ring[(size_t)((t + 1 + j) % K) * conv_dim + c] * wc[j];
        const float cur = qkv[c];
        acc += cur * wc[K - 1];
        sm[i] = siluf_(acc);
        if (i >= 2 * Dk || h == kh) ring[(size_t)(t % K) * conv_dim + c] = cur;
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
    const float eg = expf(A[h] * softplusf_(alpha[h] + dt[h]));

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
    if (ky == 0 && col) y[(size_t)h * Dv + v] = ((o * inv) * norm_w[v]) * sigmoidf_(z[(size_t)h * Dv + v]);
}

// ---- a chunk of T rows of one sequence (positions step[POS] + t, t < step[T]) ---------------------------------
//
// gdn_conv: c[t, ch] = silu(causal conv of channel ch at row t) over every conv channel, the K-1 inputs before
// each row from the chunk's own rows or, before the chunk, from the ring (zeros before the start). A separate
// launch, because gdn_chunk then overwrites ring rows that other CTAs' first rows read.
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

// gdn_chunk: gdn_core's steps 2-5 for the rows of the chunk in order, the state in registers from the first row
// to the last (read and written once per chunk); then the ring takes the chunk's last K raw inputs. Same CTA and
// thread layout as gdn_core; c (rows, conv_dim) from gdn_conv; z (rows, Hv*Dv), alpha/beta (rows, Hv) raw.
extern "C" __global__ void __launch_bounds__(1024) gdn_chunk(
    const float* __restrict__ c, const float* __restrict__ qkv, const float* __restrict__ z,
    const float* __restrict__ alpha, const float* __restrict__ beta, const float* __restrict__ dt,
    const float* __restrict__ A, const float* __restrict__ norm_w, float* ring, float* S, float* y,
    const i32* __restrict__ step, int Hk, int Hv, int Dk, int Dv, int K, float eps) {
    pdl_begin();
    extern __shared__ float sm[];
    __shared__ float red[33];
    float* sq = sm;
    float* sk = sm + Dk;
    float* sv = sm + 2 * Dk;
    float* part = sm + 2 * Dk + Dv;
    const int h = blockIdx.x, kh = h % Hk, kd = Hk * Dk, conv_dim = 2 * kd + Hv * Dv, vd = Hv * Dv;
    const int T = step[STEP_T], p0 = step[STEP_POS];
    const int tid = threadIdx.x + threadIdx.y * blockDim.x, nt = blockDim.x * blockDim.y;
    const int v = threadIdx.x, ky = threadIdx.y;
    const bool col = v < Dv;
    float* Sh = S + (size_t)h * Dk * Dv;
    float st[16];
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int k = ky * 16 + i;
        st[i] = (col && k < Dk) ? Sh[(size_t)k * Dv + v] : 0.0f;
    }
    const float A_h = A[h], dt_h = dt[h], sd = sqrtf((float)Dk);
    for (int t = 0; t < T; t++) {
        const float* ct = c + (size_t)t * conv_dim;
        for (int i = tid; i < 2 * Dk + Dv; i += nt)
            sm[i] = ct[i < Dk ? kh * Dk + i : i < 2 * Dk ? kd + kh * Dk + (i - Dk) : 2 * kd + h * Dv + (i - 2 * Dk)];
        __syncthreads();
        float a = 0.0f, b = 0.0f;
        for (int i = tid; i < Dk; i += nt) {
            a += sq[i] * sq[i];
            b += sk[i] * sk[i];
        }
        const float nq = 1.0f / sqrtf(block_sum(a, red) + 1e-6f);
        const float nk = 1.0f / sqrtf(block_sum(b, red) + 1e-6f);
        for (int i = tid; i < Dk; i += nt) {
            sq[i] = (sq[i] * nq) / sd;
            sk[i] = sk[i] * nk;
        }
        __syncthreads();
        const float bt = sigmoidf_(beta[(size_t)t * Hv + h]);
        const float eg = expf(A_h * softplusf_(alpha[(size_t)t * Hv + h] + dt_h));
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
                p += st[i] * sq[k];
            }
        }
        if (col) part[ky * Dv + v] = p;
        __syncthreads();
        float o = 0.0f;
        if (col)
            for (int j = 0; j < blockDim.y; j++) o += part[j * Dv + v];
        const float ss = block_sum(ky == 0 && col ? o * o : 0.0f, red);
        const float inv = 1.0f / sqrtf(ss / (float)Dv + eps);
        if (ky == 0 && col)
            y[(size_t)t * vd + h * Dv + v] = ((o * inv) * norm_w[v]) * sigmoidf_(z[(size_t)t * vd + h * Dv + v]);
    }
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int k = ky * 16 + i;
        if (col && k < Dk) Sh[(size_t)k * Dv + v] = st[i];
    }
    // the ring keeps raw inputs of positions p0 + T - K .. p0 + T - 1 (those of the chunk)
    for (int i = tid; i < 2 * Dk + Dv; i += nt) {
        const int ch = i < Dk ? kh * Dk + i : i < 2 * Dk ? kd + kh * Dk + (i - Dk) : 2 * kd + h * Dv + (i - 2 * Dk);
        if (i < 2 * Dk && h != kh) continue;
        for (int t = max(0, T - K); t < T; t++) ring[(size_t)((p0 + t) % K) * conv_dim + ch] = qkv[(size_t)t * conv_dim + ch];
    }
}
