// A Hopper-native (wgmma) fused attention forward for SD1.5's head dimension 40, against the mma.sync kernel of
// crates/sdhive-cuda-kernels/src/attention.cu (its DP 48 instance: two 16-row atoms per warp over 32-key tiles),
// f16, q/k/v/o in the projections' (B, S, H·D) layout. For each shape: max and mean absolute error of both kernels
// against an f32 reference (two passes over the keys, as in attention_shapes.cu), then time per call (3 warm-up
// launches, mean of 20 timed with CUDA events) and TFLOP/s at 4·B·H·Sq·Sk·D. Not part of the build. Build here,
// run on the H100 machine (driver only):
//   nvcc -O3 -arch=sm_90a -std=c++17 xtask/bench/attention_wgmma.cu -o attention_wgmma && ./attention_wgmma
//
// The kernel and its design: `hopper` in attention.cu. Before its block shape was chosen this harness also timed
// 128-key tiles, three warpgroups and one warpgroup per block (attention.cu's notes on the instantiation).
// H100 (SXM, 1980 MHz max): self 190 us against 272 us for mma_sync (1.43x), cross 15.9 against 14.8 us (two
// 64-key tiles for 77 keys against three of 32), (2, 1000, 333, 3) 9.5 against 17.6 us; errors as mma_sync's.

#define SDHIVE_ATTENTION_NO_INSTANCES
#include "../../crates/sdhive-cuda-kernels/src/attention.cu"
#include <cstdio>
#include <cstdlib>
#include <vector>

extern "C" __global__ void __launch_bounds__(128, 4)
    flash_mma_sync(const __half *q, const __half *k, const __half *v, __half *o, int sq, int sk, int d, int heads,
                   long long q_bs, long long q_ss, long long k_bs, long long k_ss, long long v_bs, long long v_ss,
                   float s) {
    flash_attention<__half, 48, 32, 4, 2>(q, k, v, o, sq, sk, d, heads, q_bs, q_ss, k_bs, k_ss, v_bs, v_ss, s);
}

// The kernel as attention.cu instantiates it (HOPPER there), here without the storage-type pair.
constexpr int WG_THREADS = 256, WG_ROWS = 128;
extern "C" __global__ void __launch_bounds__(WG_THREADS, 2)
    attention_wgmma(const __half *q, const __half *k, const __half *v, __half *o, int sq, int sk, int heads,
                    long long q_bs, long long q_ss, long long k_bs, long long k_ss, long long v_bs, long long v_ss,
                    float c) {
    SDHIVE_SM90A(hopper::attention<__half, 2>(q, k, v, o, sq, sk, heads, q_bs, q_ss, k_bs, k_ss, v_bs, v_ss, c));
}

__global__ void fill(__half *p, size_t n, unsigned seed) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) {
        unsigned x = (unsigned)i * 2654435761u ^ seed;
        x ^= x >> 13;
        x *= 0x5bd1e995;
        x ^= x >> 15;
        p[i] = __float2half(((x & 0xffff) / 65535.f - 0.5f) * 4.f);
    }
}

// fp32 reference: one thread per (row, head, batch), two passes over the keys.
__global__ void naive(const __half *q, const __half *k, const __half *v, float *o, int sq, int sk, int h_, int d,
                      float scale) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    int h = blockIdx.y, b = blockIdx.z;
    if (r >= sq) return;
    long long hs = (long long)h_ * d;
    const __half *qr = q + (b * (long long)sq + r) * hs + h * d;
    float m = -1e30f;
    for (int j = 0; j < sk; ++j) {
        const __half *kr = k + (b * (long long)sk + j) * hs + h * d;
        float s = 0;
        for (int c = 0; c < d; ++c) s += __half2float(qr[c]) * __half2float(kr[c]);
        m = fmaxf(m, s * scale);
    }
    float acc[160];
    for (int c = 0; c < d; ++c) acc[c] = 0;
    float l = 0;
    for (int j = 0; j < sk; ++j) {
        const __half *kr = k + (b * (long long)sk + j) * hs + h * d;
        const __half *vr = v + (b * (long long)sk + j) * hs + h * d;
        float s = 0;
        for (int c = 0; c < d; ++c) s += __half2float(qr[c]) * __half2float(kr[c]);
        float p = expf(s * scale - m);
        l += p;
        for (int c = 0; c < d; ++c) acc[c] += p * __half2float(vr[c]);
    }
    float *orow = o + (b * (long long)sq + r) * hs + h * d;
    for (int c = 0; c < d; ++c) orow[c] = acc[c] / l;
}

static bool check(const char *what) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) printf("  %s: CUDA error: %s\n", what, cudaGetErrorString(e));
    return e == cudaSuccess;
}

struct Result { bool ok; double us, max_err, mean_err; };

int main() {
    // attention.cu's hopper::D and its three stages of a 64-key K tile of 48 columns and a V tile of 40.
    const int D = 40, smem_sync = 2 * 2 * 32 * (48 + 8) * 2, smem_wg = 3 * 64 * (48 + 40) * 2;
    cudaFuncSetAttribute(attention_wgmma, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_wg);
    {
        cudaFuncAttributes at;
        int nb = 0;
        cudaFuncGetAttributes(&at, flash_mma_sync);
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, flash_mma_sync, 128, smem_sync);
        printf("mma_sync  (128 threads)  regs %3d  spill %zu B  smem %6d B  blocks/SM %d\n", at.numRegs,
               at.localSizeBytes, smem_sync, nb);
        cudaFuncGetAttributes(&at, attention_wgmma);
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, attention_wgmma, WG_THREADS, smem_wg);
        printf("wgmma     (%d threads)  regs %3d  spill %zu B  smem %6d B  blocks/SM %d\n", WG_THREADS, at.numRegs,
               at.localSizeBytes, smem_wg, nb);
    }
    if (!check("setup")) return 1;

    struct Shape { const char *what; int b, sq, sk, h; } shapes[] = {
        {"self", 2, 4096, 4096, 8}, {"cross", 2, 4096, 77, 8}, {"ragged", 2, 1000, 333, 3}};
    for (auto &s : shapes) {
        const size_t nq = (size_t)s.b * s.sq * s.h * D, nk = (size_t)s.b * s.sk * s.h * D;
        __half *q, *k, *v, *o;
        cudaMalloc(&q, nq * 2);
        cudaMalloc(&k, nk * 2);
        cudaMalloc(&v, nk * 2);
        cudaMalloc(&o, nq * 2);
        fill<<<(nq + 255) / 256, 256>>>(q, nq, 1);
        fill<<<(nk + 255) / 256, 256>>>(k, nk, 2);
        fill<<<(nk + 255) / 256, 256>>>(v, nk, 3);
        float *of;
        cudaMalloc(&of, nq * 4);
        std::vector<float> exact(nq);
        std::vector<__half> got(nq);
        naive<<<dim3((s.sq + 127) / 128, s.h, s.b), 128>>>(q, k, v, of, s.sq, s.sk, s.h, D, 1.f / sqrtf((float)D));
        if (!check("reference")) return 1;
        cudaMemcpy(exact.data(), of, nq * 4, cudaMemcpyDeviceToHost);
        cudaFree(of);
        const double flop = 4.0 * s.b * s.h * (double)s.sq * s.sk * D;
        const float scale_log2 = 1.f / sqrtf((float)D) * 1.4426950408889634f;
        const long long hs = (long long)s.h * D;

        // One launch for the errors (output first filled with NaN: an element left unwritten counts as wrong),
        // then 3 warm-up launches and 20 timed.
        auto measure = [&](const char *name, auto launch) {
            Result r{false, 0, 0, 0};
            cudaMemset(o, 0xff, nq * 2);
            launch();
            if (!check(name)) return r;
            cudaMemcpy(got.data(), o, nq * 2, cudaMemcpyDeviceToHost);
            double sum = 0;
            for (size_t i = 0; i < nq; ++i) {
                double e = fabs((double)__half2float(got[i]) - exact[i]);
                if (!(e <= 1e30)) e = INFINITY;
                r.max_err = fmax(r.max_err, e);
                sum += e;
            }
            r.mean_err = sum / nq;
            for (int i = 0; i < 3; ++i) launch();
            cudaEvent_t e0, e1;
            cudaEventCreate(&e0);
            cudaEventCreate(&e1);
            const int reps = 20;
            cudaEventRecord(e0);
            for (int i = 0; i < reps; ++i) launch();
            cudaEventRecord(e1);
            cudaEventSynchronize(e1);
            float ms;
            cudaEventElapsedTime(&ms, e0, e1);
            cudaEventDestroy(e0);
            cudaEventDestroy(e1);
            r.us = ms * 1e3 / reps;
            r.ok = check(name);
            return r;
        };
        const Result a = measure("mma_sync", [&]() {
            flash_mma_sync<<<dim3((s.sq + 127) / 128, s.h, s.b), 128, smem_sync>>>(
                q, k, v, o, s.sq, s.sk, D, s.h, s.sq * hs, hs, s.sk * hs, hs, s.sk * hs, hs, scale_log2);
        });
        const Result w = measure("wgmma", [&]() {
            attention_wgmma<<<dim3((s.sq + WG_ROWS - 1) / WG_ROWS, s.h, s.b), WG_THREADS, smem_wg>>>(
                q, k, v, o, s.sq, s.sk, s.h, s.sq * hs, hs, s.sk * hs, hs, s.sk * hs, hs, scale_log2);
        });
        printf("%-6s B %d Sq %4d Sk %4d H %d | mma_sync %7.1f us %5.1f TFLOP/s err max %.2e mean %.2e | wgmma %7.1f us "
               "%5.1f TFLOP/s err max %.2e mean %.2e | %.2fx%s\n",
               s.what, s.b, s.sq, s.sk, s.h, a.us, flop / (a.us * 1e-6) / 1e12, a.max_err, a.mean_err, w.us,
               flop / (w.us * 1e-6) / 1e12, w.max_err, w.mean_err, a.us / w.us, a.ok && w.ok ? "" : "  (CUDA ERROR)");
        cudaFree(q);
        cudaFree(k);
        cudaFree(v);
        cudaFree(o);
    }
    return 0;
}
