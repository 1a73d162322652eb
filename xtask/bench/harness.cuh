// What the harnesses share (geglu_gemm.cu, linear_norm.cu, linear_algos.cu): error checks for the
// CUDA runtime (CK) and cuBLAS/cuBLASLt (CL) calls, the seeded uniform random numbers their data come from, the timer
// that replays a call as a CUDA graph, and a token product set up in cuBLASLt as src/gemm.rs sets it up.
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

// x (M × K) · Wᵀ (W: N × K), both row-major, into D (M × N), as src/gemm.rs sets a token product up in cuBLASLt's
// column-major terms: D (N × M) = op(A)·B (+ C), A = W (K × N, transposed), B = x (K × M); with `bias`, the bias
// in the epilogue. C and D share a layout; the product's workspace is `workspace` bytes.
struct LtProduct {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, cd;
    cublasLtMatmulPreference_t pref;
    LtProduct(int M, int K, int N, const void *bias, size_t workspace) {
        CL(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        CL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
        CL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
        if (bias) {
            const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
            CL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
            CL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
        }
        CL(cublasLtMatrixLayoutCreate(&a, CUDA_R_16F, K, N, K));
        CL(cublasLtMatrixLayoutCreate(&b, CUDA_R_16F, K, M, K));
        CL(cublasLtMatrixLayoutCreate(&cd, CUDA_R_16F, N, M, N));
        CL(cublasLtMatmulPreferenceCreate(&pref));
        CL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                sizeof workspace));
    }
    LtProduct(const LtProduct &) = delete;
    LtProduct &operator=(const LtProduct &) = delete;
    // The heuristic's first `n` offers into `hr`; how many it made.
    int offers(cublasLtHandle_t lt, cublasLtMatmulHeuristicResult_t *hr, int n) const {
        int got = 0;
        CL(cublasLtMatmulAlgoGetHeuristic(lt, desc, a, b, cd, cd, pref, n, hr, &got));
        return got;
    }
    ~LtProduct() {
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(a);
        cublasLtMatrixLayoutDestroy(b);
        cublasLtMatrixLayoutDestroy(cd);
        cublasLtMatmulDescDestroy(desc);
    }
};
