// What the cuBLAS-linked harnesses share (geglu_gemm.cu, linear_norm.cu, linear_algos.cu): error checks for the CUDA
// runtime (CK) and cuBLAS/cuBLASLt (CL) calls, the seeded uniform random numbers their data come from, and the timer
// that replays a call as a CUDA graph.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x)                                                                                       \
    do {                                                                                            \
        cudaError_t e_ = (x);                                                                       \
        if (e_ != cudaSuccess) {                                                                    \
            fprintf(stderr, "CUDA %s at %s:%d: %s\n", #x, __FILE__, __LINE__, cudaGetErrorString(e_)); \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)
#define CL(x)                                                                                        \
    do {                                                                                             \
        cublasStatus_t s_ = (x);                                                                     \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                           \
            fprintf(stderr, "cuBLAS %s at %s:%d: %d\n", #x, __FILE__, __LINE__, (int)s_);            \
            exit(1);                                                                                 \
        }                                                                                            \
    } while (0)

static float frand(uint64_t &s) { // uniform in [-1, 1)
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((s >> 40) & 0xFFFFFF) / 8388608.f - 1.f;
}

struct Timer {
    cudaStream_t s;
    cudaEvent_t e0, e1;
    // Mean time of one call of fn, timed as a CUDA graph of 20 calls launched `reps` times.
    template <typename F> float time(F fn, int reps = 10) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        for (int i = 0; i < 20; ++i) fn();
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        CK(cudaGraphLaunch(ge, s));
        CK(cudaGraphLaunch(ge, s));
        CK(cudaStreamSynchronize(s));
        CK(cudaEventRecord(e0, s));
        for (int r = 0; r < reps; ++r) CK(cudaGraphLaunch(ge, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        CK(cudaGraphExecDestroy(ge));
        CK(cudaGraphDestroy(g));
        return ms * 1000.f / (20 * reps);
    }
};
