// How fast a grid of one or two blocks per SM can stream a 3×3 convolution's filter into shared memory: the bound
// of the SD1.5 UNet's 8² convolutions (batch 2: 128 output pixels), whose time is the read of a 29.5 MB
// (1280 → 1280) or 59 MB (2560 → 1280) KRSC filter. cuDNN runs them at 1.2 TB/s on 40 blocks or 1.9 TB/s as a
// split-K kernel on 120; a split-K kernel of our own with 16-byte cp.async per thread reached 2.2 TB/s (docs).
// Each block takes a contiguous share of the filter's K (the split) and streams its 128 output rows × 64 K values
// per tile (16 KB, or 32 KB with two row groups) through an S-stage ring, as a split-K convolution would:
//   cpasync: 16-byte cp.async.cg by every thread, the KRSC rows read in place (128-byte pieces 23 KB apart);
//   bulk-rows: one thread issues a cp.async.bulk per 128-byte row piece, completion on an mbarrier;
//   bulk-tile: the filter pre-tiled at load so that each tile is contiguous: one cp.async.bulk per tile;
//   ldg: plain 16-byte loads into registers (no shared memory), the streaming roof.
// Each block only touches every tile (a sum of one word per thread, written out), so the figures are the copy
// engine's and the memory's, not a product's. Times: CUDA events over 50 calls after 5 warm-up calls, random data.
// Build here, run on the GPU machine (driver only):
//   C=~/.cache/sdhive-cuda-13.0/prefix/nvidia (the toolchain `cargo xtask build-cuda` caches; its nvcc on PATH)
//   nvcc -O3 -std=c++17 -arch=sm_90a -cudart shared xtask/bench/filter_stream.cu -o filter_stream -L$C/cu13/lib
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                                                     \
    do {                                                                                                          \
        cudaError_t e_ = (x);                                                                                     \
        if (e_ != cudaSuccess) {                                                                                  \
            printf("%s failed: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__);                           \
            exit(1);                                                                                              \
        }                                                                                                         \
    } while (0)

constexpr int ROWS = 128, TILE_K = 64, ROW_BYTES = TILE_K * 2, TILE_BYTES = ROWS * ROW_BYTES; // 16 KB

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile("{\n.reg .pred p;\nw_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra w_%=;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void bulk(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// Block b streams tiles [b·per, (b+1)·per) of row group g = b % groups: `w` is (groups·128 rows, K) KRSC, row
// pitch K; tile t covers K columns t·64.. of the group's 128 rows. Pre-tiled (`tiled`), tile (g, t) is the 16 KB at
// ((g · tiles + t) · 16 KB).
template <int MODE, int S>
__global__ void __launch_bounds__(256) stream(const uint8_t *w, int K, int groups, int tiles_per_block, int *out) {
    extern __shared__ __align__(128) uint8_t ring[];
    __shared__ __align__(8) uint64_t bars[S];
    const int g = blockIdx.x % groups, split = blockIdx.x / groups, tiles = K / TILE_K;
    const int t0 = split * tiles_per_block, t1 = min(tiles, t0 + tiles_per_block);
    const size_t pitch = (size_t)K * 2;
    const uint8_t *rows = w + (size_t)g * ROWS * pitch;
    int acc = 0;
    if (t0 >= t1) return;
    if constexpr (MODE == 3) { // ldg: 16 KB per tile, 64 bytes per thread
        for (int t = t0; t < t1; ++t) {
            const int r = threadIdx.x / 2, half = threadIdx.x % 2;
            const uint4 *p = reinterpret_cast<const uint4 *>(rows + r * pitch + (size_t)t * ROW_BYTES + half * 64);
            uint4 a = __ldcs(p), b = __ldcs(p + 1), c = __ldcs(p + 2), d = __ldcs(p + 3);
            acc += a.x ^ b.y ^ c.z ^ d.w;
        }
    } else if constexpr (MODE == 0) { // cp.async: 1024 16-byte pieces per tile, four per thread
        auto issue = [&](int t) {
            const uint32_t dst = smem_addr(ring + ((t - t0) % S) * TILE_BYTES);
            for (int i = threadIdx.x; i < TILE_BYTES / 16; i += 256) {
                const int r = i / (ROW_BYTES / 16), c = i % (ROW_BYTES / 16);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + i * 16),
                             "l"(rows + r * pitch + (size_t)t * ROW_BYTES + c * 16));
            }
            asm volatile("cp.async.commit_group;\n" ::);
        };
        for (int t = t0; t < min(t1, t0 + S - 1); ++t) issue(t);
        for (int t = t0; t < t1; ++t) {
            if (t + S - 1 < t1) issue(t + S - 1);
            else asm volatile("cp.async.commit_group;\n" ::);
            asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 1));
            __syncthreads();
            acc += reinterpret_cast<const int *>(ring + ((t - t0) % S) * TILE_BYTES)[threadIdx.x];
            __syncthreads();
        }
    } else { // bulk copies: thread 0 issues, every thread waits on the stage's mbarrier
        if (threadIdx.x == 0)
            for (int s = 0; s < S; ++s) mbar_init(smem_addr(&bars[s]), 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        __syncthreads();
        auto issue = [&](int t) {
            if (threadIdx.x != 0) return;
            const int s = (t - t0) % S;
            const uint32_t dst = smem_addr(ring + s * TILE_BYTES), bar = smem_addr(&bars[s]);
            mbar_expect(bar, TILE_BYTES);
            if constexpr (MODE == 1) {
                for (int r = 0; r < ROWS; ++r) bulk(dst + r * ROW_BYTES, rows + r * pitch + (size_t)t * ROW_BYTES, ROW_BYTES, bar);
            } else {
                bulk(dst, w + ((size_t)g * tiles + t) * TILE_BYTES, TILE_BYTES, bar);
            }
        };
        for (int t = t0; t < min(t1, t0 + S); ++t) issue(t);
        for (int t = t0; t < t1; ++t) {
            const int s = (t - t0) % S;
            mbar_wait(smem_addr(&bars[s]), ((t - t0) / S) & 1);
            acc += reinterpret_cast<const int *>(ring + s * TILE_BYTES)[threadIdx.x];
            __syncthreads(); // every thread has read stage s before it is refilled
            if (t + S < t1) issue(t + S);
        }
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

__global__ void fill(uint32_t *p, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) {
        uint32_t h = (uint32_t)i * 2654435761u;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        p[i] = h;
    }
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const char *mode_name[4] = {"cpasync", "bulk-rows", "bulk-tile", "ldg"};
    struct Shape { const char *what; int k_out, cin; } shapes[] = {{"1280>1280", 1280, 1280}, {"2560>1280", 1280, 2560}};
    int *out;
    CK(cudaMalloc(&out, 1 << 22));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    printf("%d SMs\n", sms);
    for (auto &sh : shapes) {
        const int K = 9 * sh.cin, groups = sh.k_out / ROWS, tiles = K / TILE_K;
        const size_t bytes = (size_t)sh.k_out * K * 2;
        uint8_t *w;
        CK(cudaMalloc(&w, bytes));
        fill<<<(bytes / 4 + 255) / 256, 256>>>(reinterpret_cast<uint32_t *>(w), bytes / 4);
        CK(cudaDeviceSynchronize());
        for (int mode = 0; mode < 4; ++mode)
            for (int per_sm : {1, 2})
                for (int stages : {4, 8}) {
                    if (mode == 3 && stages == 8) continue;
                    // Splits so that groups · splits is about per_sm blocks per SM.
                    const int splits = (per_sm * sms) / groups, per = (tiles + splits - 1) / splits;
                    const int blocks = groups * ((tiles + per - 1) / per);
                    const int smem = mode == 3 ? 0 : stages * TILE_BYTES;
                    void (*k)(const uint8_t *, int, int, int, int *) =
                        mode == 0 ? (stages == 4 ? stream<0, 4> : stream<0, 8>)
                        : mode == 1 ? (stages == 4 ? stream<1, 4> : stream<1, 8>)
                        : mode == 2 ? (stages == 4 ? stream<2, 4> : stream<2, 8>)
                                    : stream<3, 4>;
                    if (smem > 48 * 1024) CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                    for (int i = 0; i < 5; ++i) k<<<blocks, 256, smem>>>(w, K, groups, per, out);
                    CK(cudaGetLastError());
                    cudaEventRecord(e0);
                    for (int i = 0; i < 50; ++i) k<<<blocks, 256, smem>>>(w, K, groups, per, out);
                    cudaEventRecord(e1);
                    CK(cudaEventSynchronize(e1));
                    float ms;
                    cudaEventElapsedTime(&ms, e0, e1);
                    const double us = ms * 1000 / 50;
                    printf("%-10s %-9s %d/SM (%4d blocks, %3d tiles each) %d stages: %6.1f us, %.2f TB/s\n", sh.what,
                           mode_name[mode], per_sm, blocks, per, stages, us, bytes / us / 1e6);
                }
        CK(cudaFree(w));
    }
    return 0;
}
