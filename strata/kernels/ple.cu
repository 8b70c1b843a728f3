// ple.cu: the per-layer embedding block (layer 1 of Qwen3.8-Flash-Next). The host hashes each token's n-grams and
// gathers the 16 table rows into e; GEMV or GEMM jobs give key_raw = ple_key @ e (hc*E) and value = ple_value @ e
// (E) per row.
#include "common.cuh"

// The block in three launches, each parallel over the step's rows (row r < step[T] at position t = step[POS] + r):
// only the conv's history ties rows together, and it reads gn, which each row computes from its own inputs.
// (One CTA per stream walking the rows in order took 33.6 ms of a 4096-row chunk on an H100: 4 CTAs busy.)
//
// ple_gate, grid (hc, rows): per stream s, key = RMSNorm(key_raw[s], norm_key[s]), q = RMSNorm(R[s], norm_query[s]),
// a = key . q / sqrt(E), gate = sigmoid(sign(a) sqrt(max(|a|, 1e-6))) -> gate[r hc + s]; gn = RMSNorm(gate value,
// norm_conv[s]) overwrites key_raw[r][s] (read by this CTA alone, and only before). Per row: R and key_raw (hc E),
// value (E).
extern "C" __global__ void __launch_bounds__(256) ple_gate(
    const float* __restrict__ R, float* key_raw, const float* __restrict__ value, const float* __restrict__ norm_key,
    const float* __restrict__ norm_query, const float* __restrict__ norm_conv, float* gate,
    const i32* __restrict__ step, int E, int hc, float eps) {
    __shared__ float red[33];
    pdl_begin();
    const int s = blockIdx.x, row = blockIdx.y;
    if (row >= step[STEP_T]) return;
    const size_t o = (size_t)s * E, C = (size_t)hc * E;
    float* kr = key_raw + row * C + o;
    const float* Rr = R + row * C + o;
    const float* vr = value + (size_t)row * E;
    float a = 0.0f, b = 0.0f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        a += kr[e] * kr[e];
        b += Rr[e] * Rr[e];
    }
    const float ik = 1.0f / sqrtf(block_sum(a, red) / (float)E + eps);
    const float iq = 1.0f / sqrtf(block_sum(b, red) / (float)E + eps);
    float d = 0.0f;
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        d += ((kr[e] * ik) * norm_key[o + e]) * ((Rr[e] * iq) * norm_query[o + e]);
    const float at = block_sum(d, red) / sqrtf((float)E);
    const float sgn = (float)((at > 0.0f) - (at < 0.0f));
    const float g = sigmoidf_(sgn * sqrtf(fmaxf(fabsf(at), 1e-6f)));
    float g2 = 0.0f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) g2 += (g * vr[e]) * (g * vr[e]);
    const float ig = 1.0f / sqrtf(block_sum(g2, red) / (float)E + eps);      // (its barrier: every read of kr done)
    for (int e = threadIdx.x; e < E; e += blockDim.x) kr[e] = ((g * vr[e]) * ig) * norm_conv[o + e];
    if (threadIdx.x == 0) gate[row * hc + s] = g;
}

// ple_conv, grid (ceil(hc E / 256), rows): channel c = s E + e, R[r][c] += gated + silu(conv) with gated = gate[r hc
// + s] value[r][e] and conv the depthwise causal conv (kernel K, dilation dil) over gn: tap j < K - 1 at position
// p = t - Hh + j dil (Hh = (K - 1) dil), this step's from gn (ple_gate's rows), earlier ones from hist (row p % Hh;
// zeros before the sequence's start), tap K - 1 this row's gn.
extern "C" __global__ void __launch_bounds__(256) ple_conv(
    float* R, const float* __restrict__ gn, const float* __restrict__ value, const float* __restrict__ gate,
    const float* __restrict__ conv_w, const float* __restrict__ hist, const i32* __restrict__ step, int E, int hc,
    int K, int dil) {
    pdl_begin();
    const int row = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x, C = hc * E;
    if (row >= step[STEP_T] || c >= C) return;
    const int t0 = step[STEP_POS], t = t0 + row, Hh = (K - 1) * dil, s = c / E;
    const float gated = gate[row * hc + s] * value[(size_t)row * E + (c - s * E)];
    const float* wc = conv_w + (size_t)c * K;
    float conv = 0.0f;
    for (int j = 0; j < K - 1; j++) {
        const int p = t - Hh + j * dil;
        conv += (p >= t0 ? gn[(size_t)(p - t0) * C + c] : hist[(size_t)((t + j * dil) % Hh) * C + c]) * wc[j];
    }
    conv += gn[(size_t)row * C + c] * wc[K - 1];
    float* rc = R + (size_t)row * C + c;
    *rc = (*rc + gated) + siluf_(conv);
}

// ple_hist, grid (ceil(hc E / 256), Hh): the history's rows for the step's last positions p = t_end - Hh + y (those
// >= step[POS]) from gn: after ple_conv, whose taps read the rows these replace.
extern "C" __global__ void __launch_bounds__(256) ple_hist(const float* __restrict__ gn, float* hist,
                                                           const i32* __restrict__ step, int C, int Hh) {
    pdl_begin();
    const int c = blockIdx.x * blockDim.x + threadIdx.x, t0 = step[STEP_POS];
    const int p = t0 + step[STEP_T] - Hh + (int)blockIdx.y;
    if (c >= C || p < t0) return;
    hist[(size_t)(p % Hh) * C + c] = gn[(size_t)(p - t0) * C + c];
}
