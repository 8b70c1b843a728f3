// ple.cu: the per-layer embedding block (layer 1 of Qwen3.8-Flash-Next). The host hashes the token's n-grams and
// gathers the 16 table rows into e; GEMV jobs give key_raw = ple_key @ e (hc*E) and value = ple_value @ e (E).
#include "common.cuh"

// Per stream s (grid hc): key = RMSNorm(key_raw[s], norm_key[s]), q = RMSNorm(R[s], norm_query[s]),
// a = key . q / sqrt(E), gate = sigmoid(sign(a) sqrt(max(|a|, 1e-6))), gated = gate * value,
// gn = RMSNorm(gated, norm_conv[s]); conv = depthwise causal conv over channel c = s*E + e with kernel K and
// dilation `dil` on the history of gn; R[s] += gated + silu(conv).
// hist (Hh = (K-1)*dil, hc*E): gn of position p lives in row p % Hh; tap j < K-1 reads position t - Hh + j*dil,
// row (t + j*dil) % Hh (zeros before the start), and gn of t then overwrites row t % Hh, which only tap 0 of
// the same thread read. A step's rows run in order inside the CTA (row r at position step[POS] + r, r < step[T]):
// a later row's taps read what this thread wrote for the earlier rows, so no other CTA is involved.
// Per row: R (hc, E), key_raw (hc*E), value (E).
extern "C" __global__ void __launch_bounds__(1024) ple_mix(
    float* R, const float* __restrict__ key_raw, const float* __restrict__ value, const float* __restrict__ norm_key,
    const float* __restrict__ norm_query, const float* __restrict__ norm_conv, const float* __restrict__ conv_w,
    float* hist, const i32* __restrict__ step, int E, int hc, int K, int dil, float eps) {
    pdl_begin();
    __shared__ float red[33];
    const int s = blockIdx.x, Hh = (K - 1) * dil, C = hc * E, n_rows = step[STEP_T];
    for (int row = 0; row < n_rows; row++) {
        const int t = step[STEP_POS] + row;
        float* Rr = R + (size_t)row * C;
        const float* kr = key_raw + (size_t)row * C;
        const float* vr = value + (size_t)row * E;
        const size_t o = (size_t)s * E;
        float a = 0.0f, b = 0.0f;
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            a += kr[o + e] * kr[o + e];
            b += Rr[o + e] * Rr[o + e];
        }
        const float ik = 1.0f / sqrtf(block_sum(a, red) / (float)E + eps);
        const float iq = 1.0f / sqrtf(block_sum(b, red) / (float)E + eps);
        float d = 0.0f;
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            d += ((kr[o + e] * ik) * norm_key[o + e]) * ((Rr[o + e] * iq) * norm_query[o + e]);
        const float at = block_sum(d, red) / sqrtf((float)E);
        const float sgn = (float)((at > 0.0f) - (at < 0.0f));
        const float gate = sigmoidf_(sgn * sqrtf(fmaxf(fabsf(at), 1e-6f)));
        float g2 = 0.0f;
        for (int e = threadIdx.x; e < E; e += blockDim.x) g2 += (gate * vr[e]) * (gate * vr[e]);
        const float ig = 1.0f / sqrtf(block_sum(g2, red) / (float)E + eps);
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            const int c = s * E + e;
            const float gated = gate * vr[e];
            const float gn = (gated * ig) * norm_conv[c];
            const float* wc = conv_w + (size_t)c * K;
            float conv = 0.0f;
            for (int j = 0; j < K - 1; j++) conv += hist[(size_t)((t + j * dil) % Hh) * C + c] * wc[j];
            conv += gn * wc[K - 1];
            Rr[c] = (Rr[c] + gated) + siluf_(conv);
            hist[(size_t)(t % Hh) * C + c] = gn;
        }
        __syncthreads();
    }
}
