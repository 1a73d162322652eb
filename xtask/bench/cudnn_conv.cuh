// Shared by the convolution harnesses that time against cuDNN (conv_splitk.cu,
// edge_conv.cu): the error check, CUDA-graph timing, random f16 operands and their largest difference,
// the descriptors of a channels-last f16 3×3 convolution (stride 1, padding 1, f32 accumulation) with a (1, K, 1, 1)
// bias and the identity activation, as src/cudnn.rs sets them up, and the engine's call on them.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                                     \
    do {                                                                                                          \
        auto e_ = (x);                                                                                            \
        if ((int)e_ != 0) {                                                                                       \
            printf("%s failed: %d (line %d)\n", #x, (int)e_, __LINE__);                                          \
            exit(1);                                                                                              \
        }                                                                                                         \
    } while (0)

// n values in [-scale, scale), a hash of the index and the seed: random operands, since zeros flatter the clocks.
__global__ void fill(__half *p, size_t n, unsigned seed, float scale) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    p[i] = __float2half(scale * ((h & 0xFFFFFF) / 8388608.f - 1.f));
}

// The largest absolute difference between two device arrays of n f16 values.
static float max_diff(const __half *a, const __half *b, size_t n) {
    std::vector<__half> ha(n), hb(n);
    CK(cudaMemcpy(ha.data(), a, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb.data(), b, n * 2, cudaMemcpyDeviceToHost));
    float d = 0;
    for (size_t i = 0; i < n; ++i) d = std::max(d, fabsf(__half2float(ha[i]) - __half2float(hb[i])));
    return d;
}

// µs per call of `f(i)`: a CUDA graph of 20 calls (i = 0..19) launched 5 times after one warm-up, the best launch.
template <typename F> float time_graph(cudaStream_t st, F f) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < 20; ++i) f(i);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaStreamSynchronize(st));
    float best = 1e9;
    for (int r = 0; r < 5; ++r) {
        CK(cudaEventRecord(e0, st));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        best = std::min(best, ms);
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return best * 1000.f / 20.f;
}

// Input (n, hw, hw, c), filter (k, 3, 3, c), output (n, hw, hw, k); the math type is the caller's.
struct Conv3x3Nhwc {
    cudnnTensorDescriptor_t xd, yd, bd;
    cudnnFilterDescriptor_t wd;
    cudnnConvolutionDescriptor_t cd;
    cudnnActivationDescriptor_t ad;

    Conv3x3Nhwc(int n, int c, int k, int hw) {
        CK(cudnnCreateTensorDescriptor(&xd));
        CK(cudnnCreateTensorDescriptor(&yd));
        CK(cudnnCreateTensorDescriptor(&bd));
        CK(cudnnCreateFilterDescriptor(&wd));
        CK(cudnnCreateConvolutionDescriptor(&cd));
        CK(cudnnCreateActivationDescriptor(&ad));
        CK(cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NHWC, CUDNN_DATA_HALF, n, c, hw, hw));
        CK(cudnnSetTensor4dDescriptor(yd, CUDNN_TENSOR_NHWC, CUDNN_DATA_HALF, n, k, hw, hw));
        CK(cudnnSetTensor4dDescriptor(bd, CUDNN_TENSOR_NHWC, CUDNN_DATA_HALF, 1, k, 1, 1));
        CK(cudnnSetFilter4dDescriptor(wd, CUDNN_DATA_HALF, CUDNN_TENSOR_NHWC, k, c, 3, 3));
        CK(cudnnSetConvolution2dDescriptor(cd, 1, 1, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
        CK(cudnnSetActivationDescriptor(ad, CUDNN_ACTIVATION_IDENTITY, CUDNN_NOT_PROPAGATE_NAN, 0.0));
    }
    Conv3x3Nhwc(const Conv3x3Nhwc &) = delete;
    Conv3x3Nhwc &operator=(const Conv3x3Nhwc &) = delete;
    ~Conv3x3Nhwc() {
        cudnnDestroyTensorDescriptor(xd);
        cudnnDestroyTensorDescriptor(yd);
        cudnnDestroyTensorDescriptor(bd);
        cudnnDestroyFilterDescriptor(wd);
        cudnnDestroyConvolutionDescriptor(cd);
        cudnnDestroyActivationDescriptor(ad);
    }
};

// The engine's cuDNN call (src/cudnn.rs): cudnnConvolutionBiasActivationForward with IMPLICIT_PRECOMP_GEMM and
// tensor-op math on its own workspace, bias and (with a skip) the skip added in the epilogue.
struct EngineConv {
    Conv3x3Nhwc d;
    cudnnHandle_t dn;
    size_t wsz = 0;
    void *ws = nullptr;
    static constexpr cudnnConvolutionFwdAlgo_t ALGO = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;

    EngineConv(cudnnHandle_t dn, int n, int c, int k, int hw) : d(n, c, k, hw), dn(dn) {
        CK(cudnnSetConvolutionMathType(d.cd, CUDNN_TENSOR_OP_MATH));
        CK(cudnnGetConvolutionForwardWorkspaceSize(dn, d.xd, d.wd, d.cd, d.yd, ALGO, &wsz));
        if (wsz) CK(cudaMalloc(&ws, wsz));
    }
    EngineConv(const EngineConv &) = delete;
    EngineConv &operator=(const EngineConv &) = delete;
    ~EngineConv() {
        if (ws) cudaFree(ws);
    }
    // y = conv(x) + bias (+ skip): z is the skip (alpha2 1) or y itself (alpha2 0).
    void run(const __half *x, const __half *w, const __half *bias, const __half *skip, __half *y) const {
        const float one = 1.f, zero = 0.f;
        CK(cudnnConvolutionBiasActivationForward(dn, &one, d.xd, x, d.wd, w, d.cd, ALGO, ws, wsz, skip ? &one : &zero,
                                                 d.yd, skip ? skip : y, d.bd, bias, d.ad, d.yd, y));
    }
};
