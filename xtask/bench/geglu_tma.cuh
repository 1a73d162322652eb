// A warp-specialised form of the crate's fused first feed-forward product + GEGLU (geglu_wgmma.cu) for Hopper
// (sm_90a): one producer warp brings the K tiles of x and W1 in with the tensor memory accelerator (TMA) into an
// S-stage ring handed over through mbarriers, and two consumer warpgroups run wgmma on them with no block barrier
// per K tile. With a cluster of CM blocks along M, the blocks share their W1 tile: each loads 1/CM of its rows and
// multicasts them to every block of the cluster, so the L2 serves W1 once per cluster.
// - Block: warps 0-7 are the two consumer warpgroups (64 rows of the block's BM = 128 each), warp 8 the producer.
// - Operands as geglu_wgmma.cu (W1 and b1 interleaved in blocks of 64 rows), 128-byte swizzle written by TMA in
//   the layout desc_sw128 describes; rows past M come in as zeros (TMA's out-of-bounds fill) and are not stored.
// - Empty barriers count CM·2 arrivals: one per consumer warpgroup of every block whose multicast writes the stage.
// Measured in geglu_gemm.cu (H100 2026-11-27 14:0x and 15:4x, errors identical to the crate's kernel), not yet
// in the crate: at SD1.5's (8192, 320, 1280) the crate's 128×128 cp.async kernel 40.1 µs, cuBLASLt's product alone (no
// GEGLU) 30.0-30.2; this kernel with two blocks per SM 39.5-39.8, with clusters of two multicasting W1 57.1, one
// block per SM 48.5 (128×256: 41.4). The persistent ping-pong below (15:4x, once its epilogue no longer spilled):
// 39.4 µs (36.3 with the A&S erf) against the crate's 40.2; at (2048, 640, 2560) 28.7 (26.3) against 31.2, at
// (512, 1280, 5120) 31.2 against the crate's 29.3; with clusters 44-54 µs everywhere: the multicast, as written
// here, costs far more than the L2 reads it saves.
#pragma once
#include <cuda.h>
// geglu_wgmma.cu (crates/sdhive-cuda-kernels/src) must be included before this file: its products and GEGLU.

namespace geglu_tma {

constexpr int BM = 128, BK = 64, IL = 64;

template <int BN, int S> constexpr int smem_bytes() { return S * (BM + BN) * 128 + 1024; }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
using namespace sm90;

// The products and the GEGLU are geglu_wgmma.cu's.
using geglu_wgmma::geglu;
template <typename T, int N> using Mma = geglu_wgmma::Wgmma<T, N>;

__device__ __forceinline__ void bar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
    asm volatile("{\n.reg .pred p;\nwait_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra wait_%=;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void bar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrives on the mbarrier at the same shared offset in block `rank` of the cluster.
__device__ __forceinline__ void bar_arrive_at(uint32_t bar, uint32_t rank) {
    asm volatile("{\n.reg .b32 r;\nmapa.shared::cluster.u32 r, %0, %1;\n"
                 "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [r];\n}\n" ::"r"(bar),
                 "r"(rank)
                 : "memory");
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// Box (c0 = K offset, c1 = row) of the 2-D map into shared memory, completion counted on `bar`.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap *map, int c0, int c1, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
                 "[%4];\n" ::"r"(dst),
                 "l"(map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
// The same box written to the same offset in every block of `mask`, each block's `bar` counting it.
__device__ __forceinline__ void tma_load_mc(uint32_t dst, const CUtensorMap *map, int c0, int c1, uint32_t bar,
                                            uint16_t mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
                 "[%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
                 "l"(map), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
                 : "memory");
}

// One warpgroup's 64 accumulator rows (BN product columns in a/gate pairs of IL, as geglu_wgmma.cu lays them) with
// the bias and the GEGLU into rows row0.. of a staging slab of BN + 16 bytes a row.
template <typename T, int BN, bool FAST>
__device__ __forceinline__ void stage_rows(const float (&acc)[BN / 2], const T *bt, uint32_t slab, int row0) {
    constexpr int PITCH = BN + 16;
    const int lane = threadIdx.x % 32, t = lane % 4, r0 = row0 + ((threadIdx.x % 128) / 32) * 16 + lane / 4;
#pragma unroll
    for (int p = 0; p < BN / (2 * IL); ++p) {
#pragma unroll
        for (int j = 0; j < IL / 8; ++j) {
            const int c = 2 * IL * p + 8 * j + 2 * t;
            const float2 ba = to_f2(*reinterpret_cast<const uint32_t *>(bt + c), T());
            const float2 bg = to_f2(*reinterpret_cast<const uint32_t *>(bt + c + IL), T());
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int i = 64 * p + 4 * j + 2 * hr;
                const float o0 = geglu<FAST>(acc[i] + ba.x, acc[i + 32] + bg.x);
                const float o1 = geglu<FAST>(acc[i + 1] + ba.y, acc[i + 33] + bg.y);
                const int col = IL * p + 8 * j + 2 * t;
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(slab + (r0 + 8 * hr) * PITCH + col * 2),
                             "r"(pack2(o0, o1, T())));
            }
        }
    }
}

// ROWS staged rows out to rows m0.. of `out` (H outputs a row, from column h0) as 16-byte chunks by one
// warpgroup; rows past M are not written.
template <typename T, int BN, int ROWS>
__device__ __forceinline__ void store_rows(uint32_t slab, T *out, int m0, int M, int H, int h0) {
    constexpr int PITCH = BN + 16, CH = BN / 16;
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

// xm: x (M, K) as a 2-D map of boxes {64, 128}; wm: W1 interleaved (2H, K), boxes {64, BN/CM}. Grid: x the M tiles
// (a multiple of CM), y the BN-column tiles.
template <typename T, int BN, int S, int CM, bool FAST>
__device__ __forceinline__ void fused(const CUtensorMap *xm, const CUtensorMap *wm, const T *__restrict__ bias,
                                      T *__restrict__ out, int M, int K, int H) {
    constexpr int A_BYTES = BM * 128, B_BYTES = BN * 128, STAGE = A_BYTES + B_BYTES, ACC = BN / 2;
    constexpr int B_PART = BN / CM;
    static_assert(2 * 64 * (BN + 16) <= S * STAGE, "staging fits in the ring");
    extern __shared__ uint8_t smem_raw[];
    __shared__ __align__(8) uint64_t bars[2 * S];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t base = (raw + 1023) & ~1023u;
    const uint32_t full0 = (uint32_t)__cvta_generic_to_shared(bars), empty0 = full0 + 8 * S;
    const int tid = threadIdx.x, warp = tid / 32;
    const int m0 = blockIdx.x * BM, n_tile = blockIdx.y;
    const int KT = K / BK;
    const uint32_t rank = CM > 1 ? cluster_rank() : 0;

    if (tid == 0) {
        for (int s = 0; s < S; ++s) {
            bar_init(full0 + 8 * s, 1);
            bar_init(empty0 + 8 * s, 2 * CM);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if constexpr (CM > 1) cluster_sync();
    else __syncthreads();

    if (warp == 8) {
        if (tid % 32 == 0) {
            for (int kt = 0; kt < KT; ++kt) {
                const int s = kt % S;
                bar_wait(empty0 + 8 * s, ((kt / S) & 1) ^ 1);
                const uint32_t st = base + s * STAGE;
                bar_expect(full0 + 8 * s, STAGE);
                tma_load(st, xm, kt * BK, m0, full0 + 8 * s);
                if constexpr (CM > 1)
                    tma_load_mc(st + A_BYTES + rank * B_PART * 128, wm, kt * BK, n_tile * BN + rank * B_PART,
                                full0 + 8 * s, (uint16_t)((1u << CM) - 1));
                else
                    tma_load(st + A_BYTES, wm, kt * BK, n_tile * BN, full0 + 8 * s);
            }
        }
    } else {
        const int wg = tid / 128, lt = tid % 128;
        float acc[ACC];
#pragma unroll
        for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
        // Tile kt's stage goes back once the product of tile kt+1 is issued and kt's has completed: one elected
        // thread per warpgroup and destination block.
        auto release = [&](int kt) {
            if (lt < CM) {
                if constexpr (CM > 1) bar_arrive_at(empty0 + 8 * (kt % S), lt);
                else asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(empty0 + 8 * (kt % S)) : "memory");
            }
        };
        for (int kt = 0; kt < KT; ++kt) {
            const int s = kt % S;
            bar_wait(full0 + 8 * s, (kt / S) & 1);
            const uint32_t st = base + s * STAGE;
            const uint64_t da = desc_sw128(st + wg * 64 * 128), db = desc_sw128(st + A_BYTES);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) Mma<T, BN>::mma(acc, da + 2 * kk, db + 2 * kk);
            wgmma_commit();
            wgmma_wait<1>();
            if (kt > 0) release(kt - 1);
        }
        wgmma_wait<0>();
        fence_regs(acc);
        release(KT - 1);

        // Both warpgroups' products have read the ring before the staging slabs overwrite it; every stage's
        // bytes (multicast ones included) have landed, since each was waited for.
        asm volatile("bar.sync 1, 256;\n" ::: "memory");
        const uint32_t slab = base + wg * 64 * (BN + 16);
        stage_rows<T, BN, FAST>(acc, bias + (size_t)n_tile * BN, slab, 0);
        if (wg == 0) asm volatile("bar.sync 2, 128;\n" ::: "memory");
        else asm volatile("bar.sync 3, 128;\n" ::: "memory");
        store_rows<T, BN, 64>(slab, out, m0 + wg * 64, M, H, n_tile * (BN / 2));
    }
    // No block leaves while a peer may still arrive on its barriers or write its ring.
    if constexpr (CM > 1) {
        __syncwarp();
        cluster_sync();
    }
}

// Persistent ping-pong form: a block per SM (or per SM pair with CM 2) walks tiles of 128 rows × BN columns; its
// two consumer warpgroups take alternate tiles, each a whole tile (two m64nBN products per k-step), and hand the
// tensor cores to each other through two named barriers after issuing their main loop, so that one's epilogue
// (GEGLU, staging, stores) runs during the other's products. The producer warp streams every tile's K tiles through
// the ring without a break. Tile u of the sequence (u = block's cluster id + j·clusters): its n tile is u / m_pairs,
// its m tile (u % m_pairs)·CM + rank.
template <int BN, int S> constexpr int pp_smem_bytes() { return S * (BM + BN) * 128 + 2 * BM * (BN + 16) + 1024; }

template <typename T, int BN, int S, int CM, bool FAST>
__device__ __forceinline__ void pingpong(const CUtensorMap *xm, const CUtensorMap *wm, const T *__restrict__ bias,
                                         T *__restrict__ out, int M, int K, int H) {
    static_assert(BN == 128, "a warpgroup's tile is two m64n128 accumulators");
    constexpr int A_BYTES = BM * 128, B_BYTES = BN * 128, STAGE = A_BYTES + B_BYTES, ACC = BN / 2;
    constexpr int B_PART = BN / CM, PITCH = BN + 16;
    extern __shared__ uint8_t smem_raw[];
    __shared__ __align__(8) uint64_t bars[2 * S];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t base = (raw + 1023) & ~1023u;
    const uint32_t full0 = (uint32_t)__cvta_generic_to_shared(bars), empty0 = full0 + 8 * S;
    const int tid = threadIdx.x, warp = tid / 32;
    const int KT = K / BK;
    const uint32_t rank = CM > 1 ? cluster_rank() : 0;
    const int m_tiles = (M + BM - 1) / BM, m_pairs = (m_tiles + CM - 1) / CM, n_tiles = 2 * H / BN;
    const int units = m_pairs * n_tiles, clusters = gridDim.x / CM, cid = blockIdx.x / CM;

    if (tid == 0) {
        for (int s = 0; s < S; ++s) {
            bar_init(full0 + 8 * s, 1);
            bar_init(empty0 + 8 * s, CM);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if constexpr (CM > 1) cluster_sync();
    else __syncthreads();

    if (warp == 8) {
        if (tid % 32 == 0) {
            int g = 0;
            for (int u = cid; u < units; u += clusters) {
                const int m0 = ((u % m_pairs) * CM + rank) * BM, nb = (u / m_pairs) * BN;
                for (int kt = 0; kt < KT; ++kt, ++g) {
                    const int s = g % S;
                    bar_wait(empty0 + 8 * s, ((g / S) & 1) ^ 1);
                    const uint32_t st = base + s * STAGE;
                    bar_expect(full0 + 8 * s, STAGE);
                    tma_load(st, xm, kt * BK, m0, full0 + 8 * s);
                    if constexpr (CM > 1)
                        tma_load_mc(st + A_BYTES + rank * B_PART * 128, wm, kt * BK, nb + rank * B_PART,
                                    full0 + 8 * s, (uint16_t)((1u << CM) - 1));
                    else
                        tma_load(st + A_BYTES, wm, kt * BK, nb, full0 + 8 * s);
                }
            }
        }
        __syncwarp();
    } else {
        const int wg = tid / 128, lt = tid % 128;
        const uint32_t slab = base + S * STAGE + wg * BM * PITCH;
        auto release = [&](int g) {
            if (lt < CM) {
                if constexpr (CM > 1) bar_arrive_at(empty0 + 8 * (g % S), lt);
                else asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(empty0 + 8 * (g % S)) : "memory");
            }
        };
        // j: this warpgroup's position in the block's tile sequence (it takes every second one).
        int j = wg;
        for (int u = cid + wg * clusters; u < units; u += 2 * clusters, j += 2) {
            const int m0 = ((u % m_pairs) * CM + rank) * BM, n_tile = u / m_pairs;
            if (j > 0) { // the other warpgroup has issued tile j-1's products
                if (wg == 0) asm volatile("bar.sync 1, 256;\n" ::: "memory");
                else asm volatile("bar.sync 2, 256;\n" ::: "memory");
            }
            float acc[2][ACC];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int i = 0; i < ACC; ++i) acc[h][i] = 0.f;
            int g = j * KT;
            for (int kt = 0; kt < KT; ++kt, ++g) {
                const int s = g % S;
                bar_wait(full0 + 8 * s, (g / S) & 1);
                const uint32_t st = base + s * STAGE;
                const uint64_t da = desc_sw128(st), db = desc_sw128(st + A_BYTES);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk) {
                    Mma<T, BN>::mma(acc[0], da + 2 * kk, db + 2 * kk);
                    Mma<T, BN>::mma(acc[1], da + 64 * 8 + 2 * kk, db + 2 * kk);
                }
                wgmma_commit();
                wgmma_wait<1>();
                if (kt > 0) release(g - 1);
            }
            // Hand the tensor cores over once this tile's products are all issued, if a next tile exists.
            if (u + clusters < units) {
                if (wg == 0) asm volatile("bar.arrive 2, 256;\n" ::: "memory");
                else asm volatile("bar.arrive 1, 256;\n" ::: "memory");
            }
            wgmma_wait<0>();
            fence_regs(acc[0]);
            fence_regs(acc[1]);
            release(g - 1);

#pragma unroll
            for (int h = 0; h < 2; ++h) stage_rows<T, BN, FAST>(acc[h], bias + (size_t)n_tile * BN, slab, 64 * h);
            if (wg == 0) asm volatile("bar.sync 3, 128;\n" ::: "memory");
            else asm volatile("bar.sync 4, 128;\n" ::: "memory");
            store_rows<T, BN, BM>(slab, out, m0, M, H, n_tile * (BN / 2));
            // The slab is read before the next tile's epilogue writes it: the hand-over barrier at the top of
            // the next tile has every thread of this warpgroup.
        }
    }
    if constexpr (CM > 1) cluster_sync();
}
#endif

} // namespace geglu_tma

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GT_SM90A(...) __VA_ARGS__
#else
#define GT_SM90A(...) __trap()
#endif

template <typename T, int BN, int S, int CM, int MINB, bool FAST>
__global__ void __cluster_dims__(CM, 1, 1) __launch_bounds__(288, MINB)
    geglu_tma_kernel(const __grid_constant__ CUtensorMap xm, const __grid_constant__ CUtensorMap wm, const T *bias,
                     T *out, int M, int K, int H) {
    GT_SM90A((geglu_tma::fused<T, BN, S, CM, FAST>(&xm, &wm, bias, out, M, K, H)));
}

template <typename T, int S, int CM, bool FAST>
__global__ void __cluster_dims__(CM, 1, 1) __launch_bounds__(288, 1)
    geglu_pp_kernel(const __grid_constant__ CUtensorMap xm, const __grid_constant__ CUtensorMap wm, const T *bias,
                    T *out, int M, int K, int H) {
    GT_SM90A((geglu_tma::pingpong<T, 128, S, CM, FAST>(&xm, &wm, bias, out, M, K, H)));
}
