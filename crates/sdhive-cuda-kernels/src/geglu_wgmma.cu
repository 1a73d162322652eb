// The transformer feed-forward's first product with diffusers' GEGLU in its epilogue, for Hopper (sm_90a):
// out[m, h] = (x·W1ᵀ + b1)[m, h] · gelu_erf((x·W1ᵀ + b1)[m, H + h]), x (M, K) and out (M, H) row-major and
// contiguous, W1 (2H, K), f16 or bf16 storage with f32 accumulation. It replaces cuBLASLt's M×2H product followed
// by kernels.cu's geglu, which writes the whole product to memory only to read it back once: here the product stays
// in the accumulators and only M×H is written.
// - W1 and b1 come interleaved (sdhive's `interleave_geglu`, once at load): rows in blocks of IL = 64, a block of
//   "a" rows then the matching block of gate rows. A tile of BN product columns is then BN/128 such pairs, so every
//   output's a and gate values sit in the same thread's accumulators, 32 registers apart.
// - A block is NWG warpgroups of 64 rows (wgmma's M) over BN product columns. All threads stage 64-wide K tiles of
//   x and W1 with cp.async into an S-stage ring (128-byte swizzle, K-major, the layout wgmma reads without
//   conflicts); rows past M are zero-filled on load and never stored, so any M runs.
// - The epilogue adds the bias, applies the GELU and stages each warpgroup's 64 output rows through shared memory
//   so that global stores are 16-byte and coalesced.
// - Constraints the host checks: K % 64 == 0 (whole K tiles, no tail), H % (BN/2) == 0, 16-byte aligned pointers.
// The instructions exist only in the arch-specific sm_90a target: build.rs compiles this file for compute_90a
// where the build is for 9.0 (and nowhere else); in other targets the kernels are traps the host never launches.
#include "wgmma_common.cuh"

namespace geglu_wgmma {

constexpr int BK = 64; // K values per tile: one 128-byte swizzle row of f16/bf16
constexpr int IL = 64; // the interleave block of W1's rows (and of b1)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)

template <typename T, int N> struct Wgmma;
#define GW_WGMMA_FOR(T, TY)                                                                                       \
    template <> struct Wgmma<T, 128> {                                                                            \
        static __device__ __forceinline__ void mma(float (&d)[64], uint64_t da, uint64_t db) {                    \
            WG_MMA_SS(TY, 128, WG_R64, 64, 65, WG_ACC32(0), WG_ACC32(32));                                                       \
        }                                                                                                         \
    };                                                                                                            \
    template <> struct Wgmma<T, 256> {                                                                            \
        static __device__ __forceinline__ void mma(float (&d)[128], uint64_t da, uint64_t db) {                   \
            WG_MMA_SS(TY, 256, WG_R128, 128, 129, WG_ACC32(0), WG_ACC32(32), WG_ACC32(64), WG_ACC32(96));                                      \
        }                                                                                                         \
    };
GW_WGMMA_FOR(__half, "f16")
GW_WGMMA_FOR(__nv_bfloat16, "bf16")

using namespace sm90;

// a · gelu_erf(g). erff is the exact function diffusers calls; FAST takes erf from Abramowitz & Stegun 7.1.26
// (|error| ≤ 1.5e-7, far below a 16-bit output's rounding) with one exp and one reciprocal on the SFU.
template <bool FAST> __device__ __forceinline__ float geglu(float a, float g) {
    if constexpr (FAST) {
        // 1 + erf(g/√2) = 2 − q for g ≥ 0, q for g < 0, q = poly(t)·exp(−z²), z = |g|/√2.
        const float z = fabsf(g) * 0.70710678118654752f;
        const float t = __fdividef(1.f, fmaf(0.3275911f, z, 1.f));
        const float poly =
            t * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 1.061405429f, -1.453152027f), 1.421413741f), -0.284496736f),
                     0.254829592f);
        const float q = poly * __expf(-z * z);
        return a * 0.5f * g * (g >= 0.f ? 2.f - q : q);
    } else {
        return a * 0.5f * g * (1.f + erff(g * 0.70710678118654752f));
    }
}

// Shared memory of one instantiation: S stages of an x tile (BM rows) and a W1 tile (BN rows), 128 bytes a row,
// plus the slack to align the ring to 1024 bytes (the swizzle's period).
template <int NWG, int BN, int S> constexpr int smem_bytes() { return S * (64 * NWG + BN) * 128 + 1024; }

// NWG warpgroups (BM = 64·NWG rows), BN product columns (BN/2 outputs) per block, S stages. W1: wgmma wait<1>
// (one product in flight while the next tile is issued, prefetch distance S-2) or wait<0> (distance S-1).
// MINB: blocks per SM for the register budget. MF: consecutive blocks walk M (and share a W1 tile in L2) rather
// than the columns.
template <typename T, int NWG, int BN, int S, bool W1, int MINB, bool MF, bool FAST>
__device__ __forceinline__ void fused(const T *__restrict__ x, const T *__restrict__ w, const T *__restrict__ bias,
                                      T *__restrict__ out, int M, int K, int H) {
    static_assert(BN % (2 * IL) == 0, "a tile holds whole a/gate pairs");
    constexpr int BM = 64 * NWG, THREADS = 128 * NWG;
    using Ring = TileRing<THREADS, BM, BN, S>;
    constexpr int A_BYTES = Ring::A_BYTES, STAGE = Ring::STAGE;
    constexpr int D = W1 ? S - 2 : S - 1;
    static_assert(D >= 1, "prefetch distance");
    constexpr int ACC = BN / 2;
    // The epilogue's staging slabs reuse the ring.
    static_assert(NWG * 64 * (BN + 16) <= S * STAGE, "staging fits in the ring");
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t base = (raw + 1023) & ~1023u;
    const int tid = threadIdx.x;
    const int n_tile = MF ? blockIdx.y : blockIdx.x, m0 = (MF ? blockIdx.x : blockIdx.y) * BM;
    const T *xa = x + (size_t)m0 * K;
    const T *wb = w + (size_t)n_tile * BN * K;
    const int KT = K / BK;

    const Ring ring(tid, m0, M, K);
    auto load = [&](int kt) { ring.load(base, xa, wb, kt, KT); };

    float acc[ACC];
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0.f;

    const int wg = tid / 128;
#pragma unroll
    for (int s = 0; s < D; ++s) load(s);
    for (int kt = 0; kt < KT; ++kt) {
        // Every thread's part of tile kt has landed, and every warpgroup is done with the stage load() refills.
        ring_landed<D - 1>();
        load(kt + D);
        const uint32_t st = base + (kt % S) * STAGE;
        const uint64_t da = desc_sw128(st + wg * 64 * 128), db = desc_sw128(st + A_BYTES);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) Wgmma<T, BN>::mma(acc, da + 2 * kk, db + 2 * kk);
        wgmma_commit();
        if constexpr (W1) wgmma_wait<1>();
        else wgmma_wait<0>();
    }
    wgmma_wait<0>();
    fence_regs(acc);

    // Accumulator i of a thread is row 16·warp + lane/4 + 8·((i/2)%2) of its warpgroup's 64, product column
    // 8·(i/4) + 2t + i%2. Column pair p (128 columns: 64 a, then their 64 gates) is i/64; in it the a values are
    // the first 32 registers, their gates the next 32.
    const int warp = (tid % 128) / 32, lane = tid % 32, t = lane % 4;
    // Rows of BN/2 outputs (BN bytes) padded by 16 bytes, so the quads' 4-byte writes fall in distinct banks; one
    // 64-row slab per warpgroup.
    constexpr int PITCH = BN + 16, CH = BN / 16; // bytes per row, 16-byte chunks per row
    __syncthreads(); // every warpgroup's wgmma reads of the ring are done before the slabs overwrite it
    const uint32_t slab = base + wg * 64 * PITCH;
    const int r0 = warp * 16 + lane / 4;
    const T *bt = bias + (size_t)n_tile * BN;
#pragma unroll
    for (int p = 0; p < BN / (2 * IL); ++p) {
#pragma unroll
        for (int j = 0; j < IL / 8; ++j) {
            const int c = 2 * IL * p + 8 * j + 2 * t; // product column of the a value
            const float2 ba = to_f2(*reinterpret_cast<const uint32_t *>(bt + c), T());
            const float2 bg = to_f2(*reinterpret_cast<const uint32_t *>(bt + c + IL), T());
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int i = 64 * p + 4 * j + 2 * hr;
                const float o0 = geglu<FAST>(acc[i] + ba.x, acc[i + 32] + bg.x);
                const float o1 = geglu<FAST>(acc[i + 1] + ba.y, acc[i + 33] + bg.y);
                const int col = IL * p + 8 * j + 2 * t; // output column within the tile
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(slab + (r0 + 8 * hr) * PITCH + col * 2),
                             "r"(pack2(o0, o1, T())));
            }
        }
    }
    // This warpgroup's slab is written (immediate barrier ids: a register id makes ptxas reserve all 16).
    if constexpr (NWG == 1) {
        asm volatile("bar.sync 1, 128;\n" ::: "memory");
    } else {
        static_assert(NWG == 2, "named barriers are written out for one or two warpgroups");
        if (wg == 0) asm volatile("bar.sync 1, 128;\n" ::: "memory");
        else asm volatile("bar.sync 2, 128;\n" ::: "memory");
    }
    const int lt = tid % 128, h0 = n_tile * (BN / 2);
#pragma unroll
    for (int q = 0; q < 64 * CH / 128; ++q) {
        const int idx = lt + q * 128, r = idx / CH, c = idx % CH;
        const int row = m0 + wg * 64 + r;
        if (row < M) {
            uint4 v;
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(slab + r * PITCH + c * 16));
            *reinterpret_cast<uint4 *>(out + (size_t)row * H + h0 + c * 8) = v;
        }
    }
}

#endif // sm_90a or host

} // namespace geglu_wgmma

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GW_SM90A(...) __VA_ARGS__
#else
#define GW_SM90A(...) __trap()
#endif

// One launchable instantiation: geglu_wgmma_<NAME>_<f16|bf16>, NWG·128 threads, smem_bytes<NWG, BN, S>() of
// dynamic shared memory, grid (M/BM rounded up, 2H/BN) when MF, else the transpose. The host's table
// (src/geglu.rs, `Tile`) repeats these parameters.
#define GEGLU_WGMMA(NAME, NWG, BN, S, W1, MINB, MF, FAST, T, SFX)                                                 \
    extern "C" __global__ void __launch_bounds__(128 * NWG, MINB) geglu_wgmma_##NAME##_##SFX(                     \
        const T *x, const T *w, const T *bias, T *out, int M, int K, int H) {                                     \
        GW_SM90A((geglu_wgmma::fused<T, NWG, BN, S, W1, MINB, MF, FAST>(x, w, bias, out, M, K, H)));             \
    }
#define GEGLU_WGMMA_BOTH(NAME, NWG, BN, S, W1, MINB, MF, FAST)                                                    \
    GEGLU_WGMMA(NAME, NWG, BN, S, W1, MINB, MF, FAST, __half, f16)                                                \
    GEGLU_WGMMA(NAME, NWG, BN, S, W1, MINB, MF, FAST, __nv_bfloat16, bf16)
#ifndef SDHIVE_GEGLU_NO_INSTANCES
// The tilings src/geglu.rs picks from by shape (xtask/bench/geglu_gemm.cu times them against the others on an
// H100, docs/benchmarks.md). Many rows (M ≥ 1024) at K ≤ 640: 128×128 tiles, two blocks per SM so that one's
// epilogue overlaps the other's main loop.
GEGLU_WGMMA_BOTH(m128_n128, 2, 128, 3, false, 2, false, false)
// Many rows at K ≥ 1280: 128×256 tiles (half the x reads per product column), a deeper ring, one block per SM.
GEGLU_WGMMA_BOTH(m128_n256, 2, 256, 4, true, 1, false, false)
// 256 < M < 1024: 64×128 tiles, three blocks per SM, to have enough blocks for the SMs.
GEGLU_WGMMA_BOTH(m64_n128, 1, 128, 3, false, 3, true, false)
// M ≤ 256: a grid of one or two block rows cannot fill the SMs whatever the tile, so each block keeps more of its
// tiles in flight instead (five stages).
GEGLU_WGMMA_BOTH(m128_n128_s5, 2, 128, 5, true, 1, true, false)
#endif
