// A transformer block's narrow product with the LayerNorm that follows it, for Hopper (sm_90a):
// h = x·Wᵀ + bias (+ residual), and, with LN, n = (h − mean) / sqrt(var + eps) · gamma + beta over each row of h.
// x (M, K), W (N, K), residual, h and n (M, N): row-major, contiguous, f16 or bf16 storage, f32 accumulation. In
// the UNet's transformers every LayerNorm reads the output of such a product (proj_in; each attention's to_out plus
// the residual stream) and nothing else: cuBLASLt's product writes h, a LayerNorm launch reads it back and writes n.
// Here a block holds whole rows of h in its accumulators, so it writes h and n from there, and the products'
// residual epilogue, slow in cuBLASLt at these shapes, costs one read.
// - A block is NWG warpgroups over 64 rows (wgmma's M); warpgroup w owns product columns 160w..160w+159 (one
//   m64n160 accumulator: 80 registers per thread), so a block spans N = 160·NWG columns: whole rows. All threads
//   stage 64-wide K tiles of x and W with cp.async into an S-stage ring (128-byte swizzle, K-major, as
//   geglu_wgmma.cu); rows past M are zero-filled on load and never stored, so any M runs.
// - Epilogue: bias and residual added, h rounded to the storage type (the LayerNorm reads what is stored, as the
//   unfused pair does); each row's mean and squared deviations from each thread's own values merged across the
//   quad and the warpgroups (one block barrier); h and n staged in shared memory and written as 16-byte rows, h's
//   stores issued before the LayerNorm's arithmetic.
// - Constraints the host checks: K % 64 == 0, N == 160·NWG of an instantiation, 16-byte aligned pointers.
// The instructions exist only in the arch-specific sm_90a target: build.rs compiles this file for compute_90a
// where the build is for 9.0 (and nowhere else); in other targets the kernels are traps the host never launches.
#include "wgmma_common.cuh"

namespace linear_norm_wgmma {

constexpr int BK = 64;  // K values per tile: one 128-byte swizzle row of f16/bf16
constexpr int WN = 160; // product columns per warpgroup

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)

// D(64×160, f32) += A(64×16) · B(16×160), both from shared memory, K-major.
#define LN_WGMMA(TY) WG_MMA_SS(TY, 160, WG_R80, 80, 81, WG_ACC32(0), WG_ACC32(32), WG_ACC16(64))

template <typename T> struct Wgmma;
template <> struct Wgmma<__half> {
    static __device__ __forceinline__ void mma(float (&d)[80], uint64_t da, uint64_t db) { LN_WGMMA("f16"); }
};
template <> struct Wgmma<__nv_bfloat16> {
    static __device__ __forceinline__ void mma(float (&d)[80], uint64_t da, uint64_t db) { LN_WGMMA("bf16"); }
};

using namespace sm90;

template <typename T> __device__ __forceinline__ uint32_t ld2(const T *p) {
    return *reinterpret_cast<const uint32_t *>(p);
}

// Shared memory of one instantiation: S stages of an x tile (64 rows) and a W tile (160·NWG rows), 128 bytes a
// row; the block's 64 residual rows and the bias, gamma and beta (requested with the first K tile, so that the
// epilogue reads them from shared memory); a (mean, M2) pair per warpgroup and row; and the slack to align the ring
// to 1024 bytes (the swizzle's period). h is staged over the residual rows, the LayerNorm's output over the ring.
// Rows of N values are padded by 16 bytes (PITCH) so that the quads' 4-byte accesses fall in distinct banks.
template <int NWG> __host__ __device__ constexpr int pitch() { return WN * NWG * 2 + 16; }
template <int NWG> __host__ __device__ constexpr int side_bytes() {
    return 64 * pitch<NWG>() + 3 * WN * NWG * 2 + NWG * 64 * 8;
}
template <int NWG, int S> constexpr int smem_bytes() { return S * (64 + WN * NWG) * 128 + side_bytes<NWG>() + 1024; }

// NWG warpgroups of WN columns each (N = WN·NWG), S stages. W1: wgmma wait<1> (one K tile's products in flight
// while the next is issued, prefetch distance S-2) or wait<0> (distance S-1). Without NORM only h is made (the
// products with a residual that no LayerNorm follows); gamma, beta and n_out are not touched, and the grid's y may
// split the row into gridDim.y blocks of N columns (block y the columns y·N.., rows gridDim.y·N wide), so that
// more, smaller blocks share the SMs.
template <typename T, int NWG, int S, bool W1, bool NORM = true>
__device__ __forceinline__ void fused(const T *__restrict__ x, const T *__restrict__ w, const T *__restrict__ bias,
                                      const T *__restrict__ residual, const T *__restrict__ gamma,
                                      const T *__restrict__ beta, T *__restrict__ h_out, T *__restrict__ n_out,
                                      int M, int K, float eps) {
    constexpr int N = WN * NWG, THREADS = 128 * NWG;
    using Ring = TileRing<THREADS, 64, N, S>;
    constexpr int A_BYTES = Ring::A_BYTES, STAGE = Ring::STAGE;
    constexpr int D = W1 ? S - 2 : S - 1;
    static_assert(D >= 1, "prefetch distance");
    constexpr int PITCH = pitch<NWG>(), CH = N / 8; // staging row bytes, 16-byte chunks per row
    static_assert(64 * PITCH <= S * STAGE, "the LayerNorm's staging fits in the ring");
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t base = (raw + 1023) & ~1023u;
    const uint32_t res_s = base + S * STAGE, par_s = res_s + 64 * PITCH; // bias, gamma, beta: N values each
    const int tid = threadIdx.x, wg = tid / 128;
    const int m0 = blockIdx.x * 64, n0 = NORM ? 0 : blockIdx.y * N, NT = NORM ? N : gridDim.y * N;
    const T *xa = x + (size_t)m0 * K;
    const int KT = K / BK;
    w += (size_t)n0 * K;
    bias += n0;

    // The residual rows (zeros past M, or without one) and the three parameter vectors, one cp.async group ahead
    // of the K tiles'.
    for (int i = tid; i < 64 * CH; i += THREADS) {
        const int r = i / CH, c = i % CH;
        const bool ok = residual && m0 + r < M;
        cp16(res_s + r * PITCH + c * 16, ok ? residual + (size_t)(m0 + r) * NT + n0 + c * 8 : bias, ok ? 16 : 0);
    }
    for (int i = tid; i < (NORM ? 3 : 1) * CH; i += THREADS) {
        const T *src = i < CH ? bias : i < 2 * CH ? gamma : beta;
        cp16(par_s + i * 16, src + (i % CH) * 8, 16);
    }
    cp_commit();

    const Ring ring(tid, m0, M, K);
    auto load = [&](int kt) { ring.load(base, xa, w, kt, KT); };

    float acc[80];
#pragma unroll
    for (int i = 0; i < 80; ++i) acc[i] = 0.f;

#pragma unroll
    for (int s = 0; s < D; ++s) load(s);
    for (int kt = 0; kt < KT; ++kt) {
        // Every thread's part of tile kt has landed, and every warpgroup is done with the stage load() refills.
        ring_landed<D - 1>();
        load(kt + D);
        const uint32_t st = base + (kt % S) * STAGE;
        const uint64_t da = desc_sw128(st), db = desc_sw128(st + A_BYTES + wg * WN * 128);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) Wgmma<T>::mma(acc, da + 2 * kk, db + 2 * kk);
        wgmma_commit();
        if constexpr (W1) wgmma_wait<1>();
        else wgmma_wait<0>();
    }
    wgmma_wait<0>();
    fence_regs(acc);
    // The residual and parameters landed with tile 0 (their group is older); the last barrier of the loop made
    // every thread's copies visible.

    // Accumulator i of a thread is row 16·warp + lane/4 + 8·((i/2)%2) of the block's 64, column
    // 160·wg + 8·(i/4) + 2t + i%2.
    const int warp = (tid % 128) / 32, lane = tid % 32, t = lane % 4;
    const int r0 = warp * 16 + lane / 4; // and r0 + 8
    const int c0 = wg * WN + 2 * t;
    auto lds2 = [](uint32_t at) {
        uint32_t v;
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(at));
        return v;
    };
    auto sts2 = [](uint32_t at, uint32_t v) { asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(v)); };
    // h staged where the residual was: each thread writes exactly the elements it has just read, so no other
    // thread's read can be overtaken and no barrier is needed first.
    const uint32_t h_slab = res_s, n_slab = base, stats = par_s + 3 * N * 2;
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int j = 0; j < WN / 8; ++j) {
        const int c = c0 + 8 * j;
        const uint32_t at0 = res_s + r0 * PITCH + c * 2, at1 = at0 + 8 * PITCH;
        const float2 b = to_f2(lds2(par_s + c * 2), T());
        const float2 r_0 = to_f2(lds2(at0), T()), r_1 = to_f2(lds2(at1), T());
        // h as stored: rounded to T, then read back as the LayerNorm would.
        const uint32_t h0 = pack2(acc[4 * j] + b.x + r_0.x, acc[4 * j + 1] + b.y + r_0.y, T());
        const uint32_t h1 = pack2(acc[4 * j + 2] + b.x + r_1.x, acc[4 * j + 3] + b.y + r_1.y, T());
        sts2(at0, h0);
        sts2(at1, h1);
        const float2 f0 = to_f2(h0, T()), f1 = to_f2(h1, T());
        acc[4 * j] = f0.x;
        acc[4 * j + 1] = f0.y;
        acc[4 * j + 2] = f1.x;
        acc[4 * j + 3] = f1.y;
        s0 += f0.x + f0.y;
        s1 += f1.x + f1.y;
    }
    // A slab out as 16-byte row chunks, consecutive threads along a row.
    auto store_rows = [&](uint32_t slab, T *out) {
#pragma unroll
        for (int q = 0; q < 64 * CH / THREADS; ++q) {
            const int idx = tid + q * THREADS, r = idx / CH, c = idx % CH;
            const int row = m0 + r;
            if (row < M) {
                uint4 v;
                asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                             : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                             : "r"(slab + r * PITCH + c * 16));
                *reinterpret_cast<uint4 *>(out + (size_t)row * NT + n0 + c * 8) = v;
            }
        }
    };
    if constexpr (!NORM) {
        __syncthreads();
        store_rows(h_slab, h_out);
        return;
    }
    // Each row's mean and squared deviations in one barrier: this thread's CNT values of each of its two rows
    // around their own mean, merged across the quad (Chan et al.'s pairwise formula, equal counts), then one
    // (mean, M2) per (warpgroup, row) in shared memory, merged over the warpgroups after the barrier.
    constexpr int CNT = WN / 4;
    float mu0 = s0 / CNT, mu1 = s1 / CNT, q0 = 0.f, q1 = 0.f;
#pragma unroll
    for (int j = 0; j < WN / 8; ++j) {
        const float d0 = acc[4 * j] - mu0, d1 = acc[4 * j + 1] - mu0;
        const float d2 = acc[4 * j + 2] - mu1, d3 = acc[4 * j + 3] - mu1;
        q0 += d0 * d0 + d1 * d1;
        q1 += d2 * d2 + d3 * d3;
    }
    float half_n = 0.5f * CNT;
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        const float om0 = __shfl_xor_sync(0xffffffff, mu0, off), oq0 = __shfl_xor_sync(0xffffffff, q0, off);
        const float om1 = __shfl_xor_sync(0xffffffff, mu1, off), oq1 = __shfl_xor_sync(0xffffffff, q1, off);
        const float d0 = om0 - mu0, d1 = om1 - mu1;
        q0 = q0 + oq0 + d0 * d0 * half_n;
        q1 = q1 + oq1 + d1 * d1 * half_n;
        mu0 = 0.5f * (mu0 + om0);
        mu1 = 0.5f * (mu1 + om1);
        half_n *= 2.f;
    }
    if (t == 0) {
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(stats + (wg * 64 + r0) * 8), "f"(mu0), "f"(q0));
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(stats + (wg * 64 + r0 + 8) * 8), "f"(mu1), "f"(q1));
    }
    // h and the partial moments are everyone's; the ring is free (every warpgroup waited for its last wgmma).
    __syncthreads();
    store_rows(h_slab, h_out);
    float mean0 = 0.f, mean1 = 0.f, m2_0 = 0.f, m2_1 = 0.f;
#pragma unroll
    for (int g = 0; g < NWG; ++g) {
        float u0, v0, u1, v1;
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(u0), "=f"(v0) : "r"(stats + (g * 64 + r0) * 8));
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(u1), "=f"(v1) : "r"(stats + (g * 64 + r0 + 8) * 8));
        // Merging WN values into g·WN: the new part's weight WN / ((g + 1)·WN).
        const float w = 1.f / (g + 1), d0 = u0 - mean0, d1 = u1 - mean1;
        m2_0 += v0 + d0 * d0 * WN * g * w;
        m2_1 += v1 + d1 * d1 * WN * g * w;
        mean0 += d0 * w;
        mean1 += d1 * w;
    }
    const float i0 = rsqrtf(m2_0 / N + eps), i1 = rsqrtf(m2_1 / N + eps);
#pragma unroll
    for (int j = 0; j < WN / 8; ++j) {
        const int c = c0 + 8 * j;
        const float2 g = to_f2(lds2(par_s + N * 2 + c * 2), T()), be = to_f2(lds2(par_s + N * 4 + c * 2), T());
        sts2(n_slab + r0 * PITCH + c * 2,
             pack2((acc[4 * j] - mean0) * i0 * g.x + be.x, (acc[4 * j + 1] - mean0) * i0 * g.y + be.y, T()));
        sts2(n_slab + (r0 + 8) * PITCH + c * 2, pack2((acc[4 * j + 2] - mean1) * i1 * g.x + be.x,
                                                      (acc[4 * j + 3] - mean1) * i1 * g.y + be.y, T()));
    }
    __syncthreads();
    store_rows(n_slab, n_out);
}

#endif // sm_90a or host

} // namespace linear_norm_wgmma

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LN_SM90A(...) __VA_ARGS__
#else
#define LN_SM90A(...) __trap()
#endif

// One launchable instantiation: linear_norm_wgmma_n<N>_<f16|bf16> (N = 160·NWG; with NORM false linear_wgmma_n<N>_…,
// which writes h only), NWG·128 threads, smem_bytes<NWG, S>() of dynamic shared memory, grid (M/64 rounded up).
// residual may be null; without NORM so may gamma, beta and n. The host (src/linear_norm.rs) repeats these
// parameters.
#define LINEAR_NORM(NAME, N, NWG, S, W1, NORM, T, SFX)                                                            \
    extern "C" __global__ void __launch_bounds__(128 * NWG, 1) NAME##_n##N##_##SFX(                               \
        const T *x, const T *w, const T *bias, const T *residual, const T *gamma, const T *beta, T *h, T *n,      \
        int M, int K, float eps) {                                                                                \
        LN_SM90A((linear_norm_wgmma::fused<T, NWG, S, W1, NORM>(x, w, bias, residual, gamma, beta, h, n, M, K,    \
                                                                 eps)));                                          \
    }
#define LINEAR_NORM_BOTH(N, NWG, S, W1)                                                                           \
    LINEAR_NORM(linear_norm_wgmma, N, NWG, S, W1, true, __half, f16)                                              \
    LINEAR_NORM(linear_norm_wgmma, N, NWG, S, W1, true, __nv_bfloat16, bf16)                                      \
    LINEAR_NORM(linear_wgmma, N, NWG, S, W1, false, __half, f16)                                                  \
    LINEAR_NORM(linear_wgmma, N, NWG, S, W1, false, __nv_bfloat16, bf16)
#ifndef SDHIVE_LINEAR_NORM_NO_INSTANCES
// N 320 (SD1.5's 64² transformers): two warpgroups, three stages.
LINEAR_NORM_BOTH(320, 2, 3, false)
// h only, each row in two blocks of 160 columns (one warpgroup; grid (M/64, 2)), so that two blocks share an SM:
// xtask/bench/linear_norm.cu (H100 2026-11-27 14:3x) at 8192 rows, K 1280 with the residual 16.8 against 18.5 µs,
// K 320 with the residual 7.9 against 8.5, 4096 rows 6.0 against 7.6.
LINEAR_NORM(linear_wgmma_half, 320, 1, 3, false, false, __half, f16)
LINEAR_NORM(linear_wgmma_half, 320, 1, 3, false, false, __nv_bfloat16, bf16)
#endif
