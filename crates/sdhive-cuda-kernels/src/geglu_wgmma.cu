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
// - More than 256 rows take a persistent, warp-specialised form instead (`pingpong`): a producer warp loads by
//   the tensor memory accelerator, two consumer warpgroups alternate 128- or 64-row tiles so that one's epilogue
//   runs under the other's products.
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

// One warpgroup's 64 accumulator rows (BN product columns in a/gate pairs of IL) with the bias and the GEGLU into
// rows row0.. of a staging slab of BN + 16 bytes a row: the padding puts the quads' 4-byte writes in distinct banks.
// Accumulator i of a thread is row 16·warp + lane/4 + 8·((i/2)%2) of the warpgroup's 64, product column
// 8·(i/4) + 2t + i%2. Column pair p (128 columns: 64 a, then their 64 gates) is i/64; in it the a values are the
// first 32 registers, their gates the next 32.
template <typename T, int BN, bool FAST>
__device__ __forceinline__ void stage_rows(const float (&acc)[BN / 2], const T *bt, uint32_t slab, int row0) {
    constexpr int PITCH = BN + 16;
    const int lane = threadIdx.x % 32, t = lane % 4, r0 = row0 + ((threadIdx.x % 128) / 32) * 16 + lane / 4;
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
}

// ROWS staged rows out to rows m0.. of `out` (H outputs a row, from column h0) as coalesced 16-byte stores by one
// warpgroup; rows past M are not written.
template <typename T, int BN, int ROWS>
__device__ __forceinline__ void store_rows(uint32_t slab, T *__restrict__ out, int m0, int M, int H, int h0) {
    constexpr int PITCH = BN + 16, CH = BN / 16; // bytes per row, 16-byte chunks per row
#pragma unroll
    for (int q = 0; q < ROWS * CH / 128; ++q) {
        const int idx = threadIdx.x % 128 + q * 128, r = idx / CH, c = idx % CH;
        if (m0 + r < M) {
            uint4 v;
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(slab + r * PITCH + c * 16));
            *reinterpret_cast<uint4 *>(out + (size_t)(m0 + r) * H + h0 + c * 8) = v;
        }
    }
}

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

    // One 64-row staging slab per warpgroup, over the ring.
    __syncthreads(); // every warpgroup's wgmma reads of the ring are done before the slabs overwrite it
    const uint32_t slab = base + wg * 64 * (BN + 16);
    stage_rows<T, BN, FAST>(acc, bias + (size_t)n_tile * BN, slab, 0);
    // This warpgroup's slab is written (immediate barrier ids: a register id makes ptxas reserve all 16).
    if constexpr (NWG == 1) {
        asm volatile("bar.sync 1, 128;\n" ::: "memory");
    } else {
        static_assert(NWG == 2, "named barriers are written out for one or two warpgroups");
        if (wg == 0) asm volatile("bar.sync 1, 128;\n" ::: "memory");
        else asm volatile("bar.sync 2, 128;\n" ::: "memory");
    }
    store_rows<T, BN, 64>(slab, out, m0 + wg * 64, M, H, n_tile * (BN / 2));
}

// The persistent, warp-specialised form for M > 256, 288 threads: warps 0-7 are two consumer
// warpgroups, warp 8 a producer. A block per SM walks tiles u = blockIdx.x, + gridDim.x, … of BM rows × 128
// product columns (n tile u / m_tiles, m tile u % m_tiles, so that the grid's concurrent tiles share W1 tiles in
// L2). The producer's elected thread brings every tile's K tiles of x and W1 in with the tensor memory accelerator
// (2-D tensor maps xm over x (K, M) and wm over the interleaved W1 (K, 2H), boxes of 64 × BM and 64 × 128,
// 128-byte swizzle:
// the layout desc_sw128 describes; rows past M arrive as zeros) into an S-stage ring, each stage handed over by a
// full mbarrier (its bytes landed) and an empty one (both consumers' products read it). The consumer warpgroups
// take alternate tiles, each a whole one (BM/64 m64n128 products per k-step), and pass the tensor cores to each other
// through two named barriers once their main loop is issued, so that one's epilogue (bias, GEGLU, staging in its
// own slab, coalesced stores) runs under the other's products and the ring never waits on an epilogue.
template <int S, int BM> constexpr int pp_smem_bytes() { return S * (BM + 128) * 128 + 2 * BM * (128 + 16) + 1024; }

template <typename T, int S, int BM, bool FAST>
__device__ __forceinline__ void pingpong(const TmaMap *xm, const TmaMap *wm, const T *__restrict__ bias,
                                         T *__restrict__ out, int M, int K, int H) {
    static_assert(BM == 64 || BM == 128, "one or two m64n128 accumulators per warpgroup");
    constexpr int BN = 128, HALVES = BM / 64, A_BYTES = BM * 128, STAGE = A_BYTES + BN * 128, ACC = BN / 2;
    constexpr int PITCH = BN + 16;
    extern __shared__ uint8_t smem_raw[];
    __shared__ __align__(8) uint64_t bars[2 * S];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t base = (raw + 1023) & ~1023u;
    const uint32_t full0 = (uint32_t)__cvta_generic_to_shared(bars), empty0 = full0 + 8 * S;
    const int tid = threadIdx.x, KT = K / BK;
    const int m_tiles = (M + BM - 1) / BM, units = m_tiles * (2 * H / BN), step = gridDim.x;

    if (tid == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, 1);
        }
        // The TMA's arrivals come through the async proxy: the initialisation must be visible to it.
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (tid / 32 == 8) {
        if (tid % 32 == 0) {
            int g = 0; // K tiles issued so far, over all of the block's tiles
            for (int u = blockIdx.x; u < units; u += step) {
                const int m0 = (u % m_tiles) * BM, c0 = (u / m_tiles) * BN;
                for (int kt = 0; kt < KT; ++kt, ++g) {
                    const int s = g % S;
                    mbar_wait(empty0 + 8 * s, ((g / S) & 1) ^ 1);
                    const uint32_t st = base + s * STAGE;
                    mbar_expect(full0 + 8 * s, STAGE);
                    tma_load_2d(st, xm, kt * BK, m0, full0 + 8 * s);
                    tma_load_2d(st + A_BYTES, wm, kt * BK, c0, full0 + 8 * s);
                }
            }
        }
        __syncwarp();
        return;
    }
    const int wg = tid / 128;
    const uint32_t slab = base + S * STAGE + wg * BM * PITCH;
    // K tile g's stage goes back once its products have completed: one arrival per warpgroup using it.
    auto release = [&](int g) {
        if (tid % 128 == 0) mbar_arrive(empty0 + 8 * (g % S));
    };
    // j: this warpgroup's position in the block's sequence of tiles (it takes every second one).
    int j = wg;
    for (int u = blockIdx.x + wg * step; u < units; u += 2 * step, j += 2) {
        const int m0 = (u % m_tiles) * BM, n_tile = u / m_tiles;
        if (j > 0) { // the other warpgroup has issued tile j-1's products
            if (wg == 0) asm volatile("bar.sync 1, 256;\n" ::: "memory");
            else asm volatile("bar.sync 2, 256;\n" ::: "memory");
        }
        float acc[HALVES][ACC];
#pragma unroll
        for (int h = 0; h < HALVES; ++h)
#pragma unroll
            for (int i = 0; i < ACC; ++i) acc[h][i] = 0.f;
        int g = j * KT;
        for (int kt = 0; kt < KT; ++kt, ++g) {
            const int s = g % S;
            mbar_wait(full0 + 8 * s, (g / S) & 1);
            const uint32_t st = base + s * STAGE;
            const uint64_t da = desc_sw128(st), db = desc_sw128(st + A_BYTES);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
#pragma unroll
                for (int h = 0; h < HALVES; ++h) // rows 64h..: 8 KiB on per half
                    Wgmma<T, BN>::mma(acc[h], da + h * 64 * 8 + 2 * kk, db + 2 * kk);
            }
            wgmma_commit();
            wgmma_wait<1>();
            if (kt > 0) release(g - 1);
        }
        // The tensor cores go to the other warpgroup once this tile's products are all issued, if it has a tile.
        if (u + step < units) {
            if (wg == 0) asm volatile("bar.arrive 2, 256;\n" ::: "memory");
            else asm volatile("bar.arrive 1, 256;\n" ::: "memory");
        }
        wgmma_wait<0>();
#pragma unroll
        for (int h = 0; h < HALVES; ++h) fence_regs(acc[h]);
        release(g - 1);

#pragma unroll
        for (int h = 0; h < HALVES; ++h) stage_rows<T, BN, FAST>(acc[h], bias + (size_t)n_tile * BN, slab, 64 * h);
        if (wg == 0) asm volatile("bar.sync 3, 128;\n" ::: "memory");
        else asm volatile("bar.sync 4, 128;\n" ::: "memory");
        store_rows<T, BN, BM>(slab, out, m0, M, H, n_tile * (BN / 2));
        // The next tile's stage_rows rewrites the slab only past the hand-over barrier at its top, which every
        // thread of this warpgroup reaches after its stores.
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
// The persistent form: geglu_pp_<NAME>_<f16|bf16>, 288 threads, pp_smem_bytes<S, BM>() of dynamic shared memory, a grid of
// at most one block per SM; x and W1 as tensor maps (cuda.rs's `tensor_map_2d`).
#define GEGLU_PP(NAME, S, BM, FAST, T, SFX)                                                                       \
    extern "C" __global__ void __launch_bounds__(288, 1) geglu_pp_##NAME##_##SFX(                                 \
        const __grid_constant__ TmaMap xm, const __grid_constant__ TmaMap wm, const T *bias, T *out, int M, int K, \
        int H) {                                                                                                  \
        GW_SM90A((geglu_wgmma::pingpong<T, S, BM, FAST>(&xm, &wm, bias, out, M, K, H)));                             \
    }
#define GEGLU_WGMMA_BOTH(NAME, NWG, BN, S, W1, MINB, MF, FAST)                                                    \
    GEGLU_WGMMA(NAME, NWG, BN, S, W1, MINB, MF, FAST, __half, f16)                                                \
    GEGLU_WGMMA(NAME, NWG, BN, S, W1, MINB, MF, FAST, __nv_bfloat16, bf16)
#ifndef SDHIVE_GEGLU_NO_INSTANCES
// The tilings src/geglu.rs picks from by shape where the persistent form does not run (M ≤ 256, or switched off, or
// a tensor map refused; xtask/bench/geglu_gemm.cu times them against the others on an H100, docs/benchmarks.md).
// Many rows (M ≥ 1024) at K ≤ 640: 128×128 tiles, two blocks per SM so that one's
// epilogue overlaps the other's main loop.
GEGLU_WGMMA_BOTH(m128_n128, 2, 128, 3, false, 2, false, false)
// Many rows at K ≥ 1280: 128×256 tiles (half the x reads per product column), a deeper ring, one block per SM.
GEGLU_WGMMA_BOTH(m128_n256, 2, 256, 4, true, 1, false, false)
// 256 < M < 1024: 64×128 tiles, three blocks per SM, to have enough blocks for the SMs.
GEGLU_WGMMA_BOTH(m64_n128, 1, 128, 3, false, 3, true, false)
// M ≤ 256: a grid of one or two block rows cannot fill the SMs whatever the tile, so each block keeps more of its
// tiles in flight instead (five stages).
GEGLU_WGMMA_BOTH(m128_n128_s5, 2, 128, 5, true, 1, true, false)
// The persistent form (src/geglu.rs's `Persistent` repeats NAME, S, BM) with the A&S erf: M ≥ 1024 in 128-row
// tiles with five stages; 256 < M < 1024 in 64-row tiles, so that the last wave of tiles is short, with eight.
GEGLU_PP(m128, 5, 128, true, __half, f16)
GEGLU_PP(m128, 5, 128, true, __nv_bfloat16, bf16)
GEGLU_PP(m64, 8, 64, true, __half, f16)
GEGLU_PP(m64, 8, 64, true, __nv_bfloat16, bf16)
#endif
