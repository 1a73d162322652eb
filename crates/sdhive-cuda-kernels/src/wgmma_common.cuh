// Shared by the Hopper (sm_90a) product kernels (geglu_wgmma.cu, linear_norm_wgmma.cu, conv_splitk.cu): the
// shared-memory wgmma instruction with its operand lists, wgmma's fences and waits, the cp.async ring's copies and
// group waits and its per-thread copy plan (TileRing), the mbarriers and the tensor memory accelerator's 2-D copies
// (with the tensor map argument, TmaMap; attention.cu's Hopper kernels take these two too), the 128-byte-swizzled
// K-major operand descriptor, and f16/bf16 pairs to and from f32. Only in the arch-specific sm_90a target (and for
// the host's view of the includers), but for TmaMap, which every target's kernel signatures may name.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// A tensor map kernel argument: CUtensorMap's 128 opaque bytes (cuda.rs's `TmaMap`), passed by value as a
// __grid_constant__ parameter so that its generic address can name it to the TMA.
struct alignas(64) TmaMap {
    uint64_t opaque[16];
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)

// An m64nN f32 accumulator is N/2 registers per thread, all named in the instruction: WG_ACC* list `d[i]`.. as
// read-write operands, WG_R* the text of their operand numbers (WG_R10(i): %i0 to %i9).
#define WG_ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_ACC16(i) WG_ACC4(i), WG_ACC4(i + 4), WG_ACC4(i + 8), WG_ACC4(i + 12)
#define WG_ACC32(i) WG_ACC16(i), WG_ACC16(i + 16)
#define WG_R10(i) "%" #i "0, %" #i "1, %" #i "2, %" #i "3, %" #i "4, %" #i "5, %" #i "6, %" #i "7, %" #i "8, %" #i "9"
#define WG_R30 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, " WG_R10(1) ", " WG_R10(2)
#define WG_R32 WG_R30 ", %30, %31"
#define WG_R64 WG_R30 ", " WG_R10(3) ", " WG_R10(4) ", " WG_R10(5) ", %60, %61, %62, %63"
#define WG_R80 WG_R30 ", " WG_R10(3) ", " WG_R10(4) ", " WG_R10(5) ", " WG_R10(6) ", " WG_R10(7)
#define WG_R128                                                                                                   \
    WG_R64 ", %64, %65, %66, %67, %68, %69, " WG_R10(7) ", " WG_R10(8) ", " WG_R10(9) ", " WG_R10(10) ", "        \
        WG_R10(11) ", %120, %121, %122, %123, %124, %125, %126, %127"
// D(64×N, f32) += A(64×16) · B(16×N), both from shared memory (descriptors `da`, `db`), K-major: REGS names the
// accumulator's operands, IA and IB the descriptors' numbers, the rest the accumulator list.
#define WG_MMA_SS(TY, N, REGS, IA, IB, ...)                                                                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                       \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" REGS "}, %" #IA ", %" #IB       \
                 ", p, 1, 1, 0, 0;\n}\n"                                                                          \
                 : __VA_ARGS__                                                                                    \
                 : "l"(da), "l"(db))

namespace sm90 {

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// The compiler does not know that a wgmma writes its registers asynchronously: an empty volatile asm "rewriting"
// each one after the last wait keeps the epilogue's reads behind it.
template <int N> __device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// The head of a cp.async ring's step: this thread's copies up to N groups back have landed and are visible to
// wgmma (cp.async writes through the generic proxy, wgmma reads through the async one), and after the barrier
// every thread's are, and every thread is past what it did in the step before.
template <int N> __device__ __forceinline__ void ring_landed() {
    cp_wait<N>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// `bytes` 0 writes zeros without reading (rows past M).
__device__ __forceinline__ void cp16(uint32_t dst, const void *src, uint32_t bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives, and expects `bytes` more of asynchronous copies before the phase completes.
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile("{\n.reg .pred p;\nw_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra w_%=;\n}\n" ::"r"(
                     bar),
                 "r"(parity)
                 : "memory");
}
// The box at (c0, c1) of a 2-D tensor map into shared memory at `dst`, its bytes counted on `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const TmaMap *map, int c0, int c1, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
                 "[%4];\n" ::"r"(dst),
                 "l"(map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}

// K-major operand tile, rows of 64 values (128 bytes), 128-byte swizzle: 16-byte chunk c of row r sits at chunk
// c ^ (r % 8); 8-row groups of 1024 bytes (SBO), tile base 1024-aligned. Bits: 0-13 addr>>4, 16-29 LBO>>4 (unused
// with this swizzle, 1), 32-45 SBO>>4, 62-63 layout (1: 128B swizzle). k-step s of 16 values starts 32·s bytes on,
// 2·s in the descriptor's address field.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ float2 to_f2(uint32_t v, __half) {
    return __half22float2(*reinterpret_cast<const __half2 *>(&v));
}
__device__ __forceinline__ float2 to_f2(uint32_t v, __nv_bfloat16) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&v));
}
__device__ __forceinline__ uint32_t pack2(float a, float b, __half) {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t *>(&v);
}
__device__ __forceinline__ uint32_t pack2(float a, float b, __nv_bfloat16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t *>(&v);
}

// The copies of one product kernel's K-tile ring: S stages of BM rows of A then BN rows of B, 64 values (128
// bytes) a row, 128-byte swizzle (desc_sw128's layout), both K-major with K values per row in global memory. A
// thread copies the same chunks of every K tile, so their offsets are worked out once; A's rows past the matrix
// read nothing (and point at the block's first row, which exists) so that their zeros make zero products.
template <int THREADS, int BM, int BN, int S> struct TileRing {
    static constexpr int A_BYTES = BM * 128, STAGE = A_BYTES + BN * 128;
    static constexpr int A_CH = BM * 8 / THREADS, B_CH = BN * 8 / THREADS;
    static_assert(BM * 8 % THREADS == 0 && BN * 8 % THREADS == 0, "chunks divide among the threads");
    uint32_t a_dst[A_CH], a_src[A_CH], a_bytes[A_CH], b_dst[B_CH], b_src[B_CH];

    // The block's A rows start at row m0 of M.
    __device__ __forceinline__ TileRing(int tid, int m0, int M, int K) {
#pragma unroll
        for (int i = 0; i < A_CH; ++i) {
            const int idx = tid + i * THREADS, r = idx / 8, c = idx % 8;
            const bool ok = m0 + r < M;
            a_dst[i] = r * 128 + ((c ^ (r & 7)) << 4);
            a_src[i] = (ok ? r * K : 0) + c * 8;
            a_bytes[i] = ok ? 16 : 0;
        }
#pragma unroll
        for (int i = 0; i < B_CH; ++i) {
            const int idx = tid + i * THREADS, r = idx / 8, c = idx % 8;
            b_dst[i] = A_BYTES + r * 128 + ((c ^ (r & 7)) << 4);
            b_src[i] = r * K + c * 8;
        }
    }

    // K tile kt of A and B (the block's first rows) into its stage of the ring at `base`: one cp.async group per
    // call, empty past the last of the KT tiles, so that the group count stays uniform.
    template <typename T>
    __device__ __forceinline__ void load(uint32_t base, const T *a, const T *b, int kt, int KT) const {
        if (kt < KT) {
            const uint32_t st = base + (kt % S) * STAGE;
            const int k0 = kt * 64;
#pragma unroll
            for (int i = 0; i < A_CH; ++i) cp16(st + a_dst[i], a + a_src[i] + k0, a_bytes[i]);
#pragma unroll
            for (int i = 0; i < B_CH; ++i) cp16(st + b_dst[i], b + b_src[i] + k0, 16);
        }
        cp_commit();
    }
};

} // namespace sm90
#endif
