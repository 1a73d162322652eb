// cuBLASLt's algorithms for the SD1.5 UNet's token products below 64² (batch 2: 32², 16² and 8² maps, where every
// product takes 7-17 µs for 0.4-6.7 GFLOP), set up as src/gemm.rs sets them up (x·Wᵀ with the bias in the
// epilogue, the residual as C where the UNet adds one): the heuristic's first choice (what the crate runs) against
// the next ones it offers, each timed as a CUDA graph of 20 calls on random data (warm: the weight stays in L2 from
// call to call) and call by call after the L2 is flushed and only the activations (and residual) read back into it,
// as a step finds them (cold weight), and checked against the first choice's output. Whether another algorithm
// (split-K among them) is worth an autotuning pass at load, and how such a pass should time the offers.
// Build here, run on the GPU machine (cuBLAS from PyTorch's wheels):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -cudart shared xtask/bench/linear_algos.cu \
//     -o linear_algos -lcublasLt
//   ./linear_algos
#include <cublasLt.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>

#include "harness.cuh"

static __half *upload(size_t n, float scale, uint64_t seed) {
    std::vector<__half> h(n);
    for (auto &v : h) v = __float2half(frand(seed) * scale);
    __half *d;
    CK(cudaMalloc(&d, n * 2));
    CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
    return d;
}

int main() {
    Timer tm;
    CK(cudaStreamCreate(&tm.s));
    CK(cudaEventCreate(&tm.e0));
    CK(cudaEventCreate(&tm.e1));
    const cudaStream_t s = tm.s;
    cublasLtHandle_t lt;
    CL(cublasLtCreate(&lt));
    const size_t WS = 32 << 20, FLUSH = 128 << 20;
    void *ws, *flush, *warm;
    CK(cudaMalloc(&ws, WS));
    CK(cudaMalloc(&flush, FLUSH));
    CK(cudaMalloc(&warm, 64 << 20));
    cudaEvent_t c0, c1;
    CK(cudaEventCreate(&c0));
    CK(cudaEventCreate(&c1));
    struct Shape { const char *what; int M, K, N; bool residual; };
    const Shape shapes[] = {
        {"32² proj_in", 2048, 640, 640, false},    {"32² qkv", 2048, 640, 1920, false},
        {"32² to_out", 2048, 640, 640, true},      {"32² q", 2048, 640, 640, false},
        {"32² ff2", 2048, 2560, 640, true},        {"16² proj_in", 512, 1280, 1280, false},
        {"16² qkv", 512, 1280, 3840, false},       {"16² to_out", 512, 1280, 1280, true},
        {"16² ff2", 512, 5120, 1280, true},        {"8² to_out", 128, 1280, 1280, true},
        {"8² qkv", 128, 1280, 3840, false},        {"8² ff2", 128, 5120, 1280, true},
        {"64² q", 8192, 320, 320, false},          {"64² qkv", 8192, 320, 960, false},
    };
    for (const Shape &sh : shapes) {
        const int M = sh.M, K = sh.K, N = sh.N;
        __half *x = upload((size_t)M * K, 1.f, 1), *w = upload((size_t)N * K, 1.f / sqrtf((float)K), 2);
        __half *b = upload(N, 0.5f, 3), *r = upload((size_t)M * N, 1.f, 4), *o, *o0;
        CK(cudaMalloc(&o, (size_t)M * N * 2));
        CK(cudaMalloc(&o0, (size_t)M * N * 2));
        const LtProduct lp(M, K, N, b, WS);
        cublasLtMatmulHeuristicResult_t hr[32];
        const int got = lp.offers(lt, hr, 32);
        const float one = 1.f, zero = 0.f;
        const float *beta = sh.residual ? &one : &zero;
        printf("\n%s: M %d K %d N %d%s, %d algorithms\n", sh.what, M, K, N, sh.residual ? " + residual" : "", got);
        std::vector<__half> ref((size_t)M * N), out((size_t)M * N);
        float best = 1e9f, first = 0.f, best_cold = 1e9f, first_cold = 0.f;
        int pick_warm = 0, pick_cold = 0;
        for (int i = 0; i < got; ++i) {
            auto call = [&] {
                return cublasLtMatmul(lt, lp.desc, &one, w, lp.a, x, lp.b, beta, sh.residual ? r : o, lp.cd, o, lp.cd,
                                      &hr[i].algo, ws, WS, s) == CUBLAS_STATUS_SUCCESS;
            };
            if (!call()) {
                printf("  #%2d refused\n", i);
                continue;
            }
            CK(cudaStreamSynchronize(s));
            CK(cudaMemcpy(out.data(), o, out.size() * 2, cudaMemcpyDeviceToHost));
            if (i == 0) ref = out;
            double diff = 0;
            for (size_t j = 0; j < out.size(); ++j)
                diff = fmax(diff, fabs(__half2float(out[j]) - __half2float(ref[j])));
            const float us = tm.time(call);
            if (i == 0) first = us;
            if (us > 0 && us < best) best = us, pick_warm = i;
            // Cold weight: flush the L2, read the activations (and the residual) back into it, time the call alone.
            float cold = 0.f;
            for (int rep = 0; rep < 10; ++rep) {
                CK(cudaMemsetAsync(flush, rep, FLUSH, s));
                CK(cudaMemcpyAsync(warm, x, (size_t)M * K * 2, cudaMemcpyDeviceToDevice, s));
                if (sh.residual)
                    CK(cudaMemcpyAsync((char *)warm + (size_t)M * K * 2, r, (size_t)M * N * 2, cudaMemcpyDeviceToDevice, s));
                CK(cudaEventRecord(c0, s));
                call();
                CK(cudaEventRecord(c1, s));
                CK(cudaEventSynchronize(c1));
                float ms;
                CK(cudaEventElapsedTime(&ms, c0, c1));
                cold += ms * 100.f; // 1000 µs per ms over 10 calls
            }
            if (i == 0) first_cold = cold;
            if (cold < best_cold) best_cold = cold, pick_cold = i;
            int tile = 0, splitk = 0, stages = 0, cluster = 0;
            size_t sz;
            cublasLtMatmulAlgoConfigGetAttribute(&hr[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &sz);
            cublasLtMatmulAlgoConfigGetAttribute(&hr[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk,
                                                 &sz);
            cublasLtMatmulAlgoConfigGetAttribute(&hr[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages,
                                                 &sz);
            cublasLtMatmulAlgoConfigGetAttribute(&hr[i].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster,
                                                 sizeof cluster, &sz);
            printf("  #%2d %7.2f us  cold %7.2f us  tile %3d split-K %2d stages %3d cluster %2d  workspace %8zu  max|d| %.3g\n", i, us,
                   cold, tile, splitk, stages, cluster, hr[i].workspaceSize, diff);
        }
        printf("  first %.2f us, best %.2f us (#%d, %.2fx); cold: first %.2f us, best %.2f us (#%d, %.2fx)\n", first,
               best, pick_warm, first / best, first_cold, best_cold, pick_cold, first_cold / best_cold);
        cudaFree(x); cudaFree(w); cudaFree(b); cudaFree(r); cudaFree(o); cudaFree(o0);
    }
    return 0;
}
