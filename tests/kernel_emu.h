// kernel_emu.h: the CUDA kernels' own sources (strata/kernels/*.cu), compiled by g++ for the CPU. Each CUDA thread
// of a CTA is a fiber (its own stack, switched cooperatively on one OS thread), the CTAs of a grid one after
// another; __syncthreads is a barrier over the CTA's fibers and a warp shuffle exchanges through a per-warp slot
// array at one barrier of the warp: a fiber that waits at a barrier yields to the next, round robin, so a barrier
// costs one switch a thread (~20 ns) where an OS thread a CUDA thread would cost a wake-up each, too slow for the
// whole CUDA backend to run here (tests/emu_driver.py). cp.async is a plain copy made at issue (the worst case for a
// buffer reused too early), PTX prmt and the f16 conversion are written out. It checks what the sources compute and
// how they index and synchronize, not their speed; the kernels' inline PTX is under `#ifdef __CUDACC__` with a plain
// C++ twin beside it. A kernel that spins on a value another thread of its CTA writes, without a barrier, would hang
// here (none does).
//
// tests/kernel_emu.py compiles a kernel file with this header first and runs its kernels through emu_launch.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <sys/mman.h>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
// one CTA runs at a time, so a CTA's static shared arrays can live in static storage
#define __shared__ static

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};

inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

namespace emu {
// A barrier of fibers: the last of `expected` arrivals opens the phase; a waiter yields until it has opened. A
// thread that exits drops out (counted as arriving now and expected no more), as an exited CUDA thread does.
struct Bar {
    int expected = 0, count = 0;
    unsigned phase = 0;
};
void arrive_and_wait(Bar& b);
void arrive_and_drop(Bar& b);

struct Cta {
    dim3 block;
    Bar bar;
    std::vector<Bar> warp_bar;
    std::vector<std::uint64_t> slots;     // 32 per warp, twice: the shuffle exchange
    std::vector<unsigned> frag;           // 6 words per lane: mma.sync's fragments
    std::vector<unsigned char> smem;
};
inline Cta* cta = nullptr;
inline dim3 tid, bid;     // the running fiber's (one launch at a time: kernel_emu_fiber.h)
inline dim3 cur_grid;
}  // namespace emu

#define threadIdx emu::tid
#define blockIdx emu::bid
#define blockDim emu::cta->block
#define gridDim emu::cur_grid

inline unsigned char* emu_smem() { return emu::cta->smem.data(); }

inline int emu_linear_tid() { return (int)(threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y); }

inline void __syncthreads() { emu::arrive_and_wait(emu::cta->bar); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::arrive_and_wait(emu::cta->warp_bar[emu_linear_tid() >> 5]); }

// Two slot arrays used in turn: a warp's shuffle i writes set i % 2, waits at the warp barrier, reads. Shuffle
// i + 2 writes that set again only after the barrier of shuffle i + 1, which every lane reaches after its read.
template <class T>
inline T emu_shfl(T v, int src_lane) {
    static_assert(sizeof(T) <= 8, "shuffle of a value over 8 bytes");
    const int t = emu_linear_tid(), w = t >> 5;
    emu::Bar& b = emu::cta->warp_bar[w];
    std::uint64_t* slots = emu::cta->slots.data() + (size_t)(b.phase & 1) * emu::cta->slots.size() / 2;
    std::uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    slots[t] = bits;
    emu::arrive_and_wait(b);
    bits = slots[w * 32 + (src_lane & 31)];
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int m) { return emu_shfl(v, (emu_linear_tid() & 31) ^ m); }
template <class T>
inline T __shfl_up_sync(unsigned, T v, int d) {
    const int l = emu_linear_tid() & 31;
    return emu_shfl(v, l >= d ? l - d : l);
}

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }

// CUDA's __byte_perm: byte i of the result is byte (s >> 4i) & 7 of {y, x} (x bytes 0-3, y bytes 4-7); bit 3 of
// each selector nibble is ignored (the CUDA math API's definition)
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const std::uint64_t v = ((std::uint64_t)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= ((unsigned)(v >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
    return r;
}

// PTX dp4a.s32.s32: c + the dot product of a's and b's four signed bytes
inline int emu_dp4a(unsigned a, unsigned b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}

using std::max;
using std::min;

template <class T>
inline T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// ---- the tensor-core path's PTX (gemm.cuh), by the warp's lanes exchanging their fragments --------------------

inline float emu_half_to_float(unsigned short h);

inline unsigned emu_f16x2(float lo, float hi) {    // cvt.rn.f16x2.f32: lo in the low half
    const _Float16 a = (_Float16)lo, b = (_Float16)hi;
    unsigned short x, y;
    std::memcpy(&x, &a, 2);
    std::memcpy(&y, &b, 2);
    return (unsigned)x | ((unsigned)y << 16);
}

inline unsigned emu_smem_addr(const void* p) { return (unsigned)((const unsigned char*)p - emu_smem()); }

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lane L gives the address of row L % 8 of matrix L / 8; matrix i's word
// at row L / 4, bytes 4 (L % 4).. come back in r[i]
inline void emu_ldsm4(unsigned addr, unsigned* r) {
    const int l = emu_linear_tid() & 31;
    for (int i = 0; i < 4; i++) {
        const unsigned a = emu_shfl(addr, 8 * i + l / 4);
        std::memcpy(&r[i], emu_smem() + a + 4 * (l % 4), 4);
    }
}

// A warp's mma.sync m16n8kK, c += A B: each lane's fragments (a0..a3, b0, b1) gathered where every lane reads
// them, then each lane's C[g][2t, 2t+1] (c0, c1) and C[g+8][..] (c2, c3) (g = lane / 4, t = lane % 4) summed over k
// in order, A(F, row, k) and B(F, k, n) reading an element from the gathered words F (6 a lane).
template <int K, class FA, class FB>
inline void emu_mma_m16n8(float* c, const unsigned* a, const unsigned* b, FA A, FB B) {
    const int t = emu_linear_tid(), w = t >> 5, l = t & 31;
    unsigned* F = emu::cta->frag.data() + (size_t)w * 32 * 6;
    for (int i = 0; i < 4; i++) F[6 * l + i] = a[i];
    F[6 * l + 4] = b[0];
    F[6 * l + 5] = b[1];
    __syncwarp();
    const int g = l / 4, tt = l % 4;
    for (int j = 0; j < 4; j++) {
        const int row = g + 8 * (j >> 1), n = 2 * tt + (j & 1);
        float acc = c[j];
        for (int k = 0; k < K; k++) acc += A(F, row, k) * B(F, k, n);
        c[j] = acc;
    }
    __syncwarp();
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: lane L (g = L / 4, t = L % 4) holds A[g][2t, 2t+1] (a0),
// A[g+8][..] (a1), A[g][2t+8, 2t+9] (a2), A[g+8][..] (a3); B[2t, 2t+1][g] (b0), B[2t+8, 2t+9][g] (b1). The products
// of halves are exact in float.
inline void emu_mma_f16(float* c, const unsigned* a, const unsigned* b) {
    auto half = [](const unsigned* F, int lane, int reg, int hi) {
        return emu_half_to_float((unsigned short)(F[6 * lane + reg] >> (16 * hi)));
    };
    auto A = [&](const unsigned* F, int row, int k) {
        return half(F, 4 * (row & 7) + (k & 7) / 2, (row >> 3) + 2 * (k >> 3), k & 1);
    };
    auto B = [&](const unsigned* F, int k, int n) { return half(F, 4 * n + (k & 7) / 2, 4 + (k >> 3), k & 1); };
    emu_mma_m16n8<16>(c, a, b, A, B);
}

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32: lane L holds A[g][t] (a0), A[g+8][t] (a1), A[g][t+4] (a2),
// A[g+8][t+4] (a3); B[t][g] (b0), B[t+4][g] (b1). The hardware reads the operands' top 19 bits; their products are
// exact in float.
inline void emu_mma_tf32(float* c, const unsigned* a, const unsigned* b) {
    auto val = [](const unsigned* F, int lane, int reg) { return __uint_as_float(F[6 * lane + reg] & 0xffffe000u); };
    auto A = [&](const unsigned* F, int row, int k) {
        return val(F, 4 * (row & 7) + (k & 3), (row >> 3) + 2 * (k >> 2));
    };
    auto B = [&](const unsigned* F, int k, int n) { return val(F, 4 * n + (k & 3), 4 + (k >> 2)); };
    emu_mma_m16n8<8>(c, a, b, A, B);
}

// wgmma.mma_async m64nNk16 .f32.f16.f16 with both operands in shared memory (K-major, no swizzle), issued by
// the 128 threads of a warpgroup: each thread's accumulator fragment is d[4j + e] = D[16 w + g + 8 (e >> 1)][8 j
// + 2 t + (e & 1)] (w its warp in the group, g = lane / 4, t = lane % 4). Kept until the wait, as the hardware may:
// the shared operands are read and d written there, so a tile that overwrote its operands or read d before the
// wait computes something else here too. Descriptor: start, leading (k-adjacent core matrices) and stride (8-row
// groups) byte offsets >> 4 in bits 0, 16, 32; any swizzle or base offset reads as NaN.
namespace emu {
struct WgOp {
    float* d;
    int n;
    std::uint64_t a, b;
    int acc;
};
struct WgQueue {
    std::vector<WgOp> issued, committed;     // since the last commit; since the last wait
};
WgQueue& wg();     // the running fiber's

// cp.async (common.cuh): a thread's copies since its last commit, then its committed groups, oldest first. They
// land only at the thread's wait, as the hardware is free to deliver them: a read before the wait sees what shared
// memory held (the launch's NaN poison, or the stage's previous chunk).
struct CpOp {
    unsigned char* dst;
    const unsigned char* src;
    int n;
};
struct CpQueue {
    std::vector<CpOp> open;
    std::vector<std::vector<CpOp>> groups;
};
CpQueue& cpq();    // the running fiber's
}  // namespace emu

inline void emu_cp_async(unsigned char* dst, const void* src, int n) {
    emu::cpq().open.push_back({dst, (const unsigned char*)src, n});
}

inline void emu_cp_commit() {
    emu::CpQueue& q = emu::cpq();
    q.groups.push_back(std::move(q.open));
    q.open.clear();
}

// the oldest groups land until at most `pending` remain in flight
inline void emu_cp_wait(int pending) {
    emu::CpQueue& q = emu::cpq();
    const int land = (int)q.groups.size() - pending;
    for (int i = 0; i < land; i++)
        for (const emu::CpOp& op : q.groups[i]) std::memcpy(op.dst, op.src, op.n);
    if (land > 0) q.groups.erase(q.groups.begin(), q.groups.begin() + land);
}

inline void emu_wgmma(float* d, int n, std::uint64_t a, std::uint64_t b, int acc) {
    emu::wg().issued.push_back({d, n, a, b, acc});
}

inline float emu_wg_elem(std::uint64_t desc, int r, int k) {
    if (desc >> 49) return NAN;
    const unsigned start = (unsigned)(desc & 0x3FFF) << 4, lbo = (unsigned)((desc >> 16) & 0x3FFF) << 4,
                   sbo = (unsigned)((desc >> 32) & 0x3FFF) << 4;
    unsigned short h;
    std::memcpy(&h, emu_smem() + start + (r >> 3) * sbo + (k >> 3) * lbo + (r & 7) * 16 + (k & 7) * 2, 2);
    return emu_half_to_float(h);
}

inline void emu_wgmma_commit() {
    emu::WgQueue& q = emu::wg();
    q.committed.insert(q.committed.end(), q.issued.begin(), q.issued.end());
    q.issued.clear();
}

inline void emu_wgmma_wait() {
    const int t = emu_linear_tid() & 127, w = t >> 5, g = (t & 31) >> 2, q = t & 3;
    for (const emu::WgOp& op : emu::wg().committed)
        for (int j = 0; j < op.n / 8; j++)
            for (int e = 0; e < 4; e++) {
                const int m = 16 * w + g + 8 * (e >> 1), n = 8 * j + 2 * q + (e & 1);
                float s = op.acc ? op.d[4 * j + e] : 0.0f;
                for (int k = 0; k < 16; k++) s += emu_wg_elem(op.a, m, k) * emu_wg_elem(op.b, n, k);
                op.d[4 * j + e] = s;
            }
    emu::wg().committed.clear();
}

// f16 bits -> f32, exactly (common.cuh h2f's twin of cvt.f32.f16)
inline float emu_half_to_float(unsigned short h) {
    const unsigned s = (h >> 15) & 1u, e = (h >> 10) & 31u, m = h & 1023u;
    float v;
    if (e == 0) v = std::ldexp((float)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = std::ldexp((float)(m | 1024u), (int)e - 25);
    return s ? -v : v;
}

#include "kernel_emu_fiber.h"

namespace emu {
template <class... A, size_t... I>
void launch_packed(void (*k)(A...), dim3 g, dim3 b, size_t smem, void** args, std::index_sequence<I...>) {
    launch(k, g, b, smem, *static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

// the driver's calling convention: args[i] points at the value of parameter i
template <class... A>
void launch_args(void (*k)(A...), dim3 g, dim3 b, size_t smem, void** args) {
    launch_packed(k, g, b, smem, args, std::index_sequence_for<A...>{});
}
}  // namespace emu

namespace emu {
// the kernel's parameter sizes, for a graph that copies a launch's arguments at capture (tests/emu_driver.py)
template <class... A>
int arg_sizes(void (*)(A...), size_t* out) {
    const size_t s[] = {sizeof(A)..., 0};
    for (size_t i = 0; i < sizeof...(A); i++) out[i] = s[i];
    return (int)sizeof...(A);
}
}  // namespace emu

// a launch's entry: 0, or 1 with the reason in emu_error() (a CTA wrote past its shared memory)
extern "C" const char* emu_error() { return emu::error.c_str(); }
#define EMU_ENTRY(name)                                                                                      \
    extern "C" int emu_##name(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,  \
                              size_t smem, void** args) {                                                    \
        emu::error.clear();                                                                                  \
        emu::launch_args(name, dim3{gx, gy, gz}, dim3{bx, by, bz}, smem, args);                              \
        return emu::error.empty() ? 0 : 1;                                                                   \
    }                                                                                                        \
    extern "C" int emu_args_##name(size_t* out) { return emu::arg_sizes(name, out); }
