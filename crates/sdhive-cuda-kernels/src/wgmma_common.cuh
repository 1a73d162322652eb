// Shared by the Hopper (sm_90a) product kernels (geglu_wgmma.cu, linear_norm_wgmma.cu): wgmma's fences and waits,
// the cp.async ring's copies and group waits, the 128-byte-swizzled K-major operand descriptor, and f16/bf16 pairs
// to and from f32. Only in the arch-specific sm_90a target (and for the host's view of the includers).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
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
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// `bytes` 0 writes zeros without reading (rows past M).
__device__ __forceinline__ void cp16(uint32_t dst, const void *src, uint32_t bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
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

} // namespace sm90
#endif
