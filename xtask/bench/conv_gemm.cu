// 3x3 convolutions (stride 1, padding 1, channels-last f16, f32 accumulation) at the UNets' shapes: cuDNN's legacy
// API as crates/sdhive-cuda-kernels/src/cudnn.rs drives it (heuristic algorithm; bias through
// cudnnConvolutionBiasActivationForward with IMPLICIT_PRECOMP_GEMM) against an im2col copy plus one cuBLASLt product
// with the bias in its epilogue (the heuristic's first algorithm and the fastest of its top 8), and the networks'
// first and last convolutions with their channels padded to 8 ("in 8>320", "out 320>8"). Graphs of 20 calls. The
// operands are zero-filled, which flatters every kernel's clocks: inside the network (random weights) the product
// path lost what it won here, see docs/benchmarks.md. Build here, run on the GPU machine:
//   C=~/.cache/sdhive-cuda-13.0/prefix/nvidia (the toolchain `cargo xtask build-cuda` caches; its nvcc on PATH)
//   nvcc -O2 -std=c++17 -arch=sm_90 -I$C/cudnn/include xtask/bench/conv_gemm.cu -o conv_gemm \
//        -L$C/cu13/lib -L$C/cudnn/lib -lcublasLt -l:libcudnn.so.9
#include <cublasLt.h>
#include <cudnn.h>
#include <cuda_fp16.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#define CK(x) do { auto e_ = (x); if ((int)e_ != 0) { printf("%s failed %d line %d\n", #x, (int)e_, __LINE__); exit(1); } } while (0)

// out[(n,y,x)][(r*3+s)*C + c] = in[n, y+r-1, x+s-1, c] or 0; one 16-byte chunk per thread.
__global__ void im2col3(const uint4 *in, uint4 *out, int n, int h, int w, int c8) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long total = (long long)n * h * w * 9 * c8;
    if (i >= total) return;
    int c = i % c8; long long t = i / c8; int tap = t % 9; long long p = t / 9;
    int x = p % w, y = (p / w) % h, b = p / ((long long)w * h);
    int yy = y + tap / 3 - 1, xx = x + tap % 3 - 1;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (yy >= 0 && yy < h && xx >= 0 && xx < w) v = in[(((long long)b * h + yy) * w + xx) * c8 + c];
    out[i] = v;
}

template <typename F> float time_graph(cudaStream_t st, F f) {
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < 20; ++i) f();
    CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    CK(cudaGraphLaunch(ge, st)); cudaStreamSynchronize(st);
    float best = 1e9;
    for (int r = 0; r < 5; ++r) {
        cudaEventRecord(e0, st); cudaGraphLaunch(ge, st); cudaEventRecord(e1, st); cudaEventSynchronize(e1);
        float ms; cudaEventElapsedTime(&ms, e0, e1); best = std::min(best, ms);
    }
    cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
    return best * 1000 / 20;
}

int main() {
    struct S { const char *what; int n, hw, c, k, count; } shapes[] = {
        {"sd15 64 320>320", 2, 64, 320, 320, 10}, {"sd15 64 640>320", 2, 64, 640, 320, 2},
        {"sd15 32 320>640", 2, 32, 320, 640, 1}, {"sd15 32 640>640", 2, 32, 640, 640, 8}, {"sd15 32 1280>640", 2, 32, 1280, 640, 1},
        {"sd15 16 640>1280", 2, 16, 640, 1280, 1}, {"sd15 16 1280>1280", 2, 16, 1280, 1280, 8}, {"sd15 16 2560>1280", 2, 16, 2560, 1280, 2},
        {"sd15 8 1280>1280", 2, 8, 1280, 1280, 12}, {"sd15 8 2560>1280", 2, 8, 2560, 1280, 3},
        {"out 320>8", 2, 64, 320, 8, 0}, {"in 8>320", 2, 64, 8, 320, 0}, {"sdxl out 320>8", 2, 128, 320, 8, 0}, {"sdxl in 8>320", 2, 128, 8, 320, 0},
        {"m256 16 1280>1280", 1, 16, 1280, 1280, 0}, {"m256 8 1280>1280", 4, 8, 1280, 1280, 0}, {"m256 8 2560>1280", 4, 8, 2560, 1280, 0}, {"m512 8 1280>1280", 8, 8, 1280, 1280, 0},
        {"m64 8 1280>1280", 1, 8, 1280, 1280, 0}, {"m64 8 2560>1280", 1, 8, 2560, 1280, 0},
        {"sdxl 32 1280>1280", 2, 32, 1280, 1280, 20}, {"sdxl 32 2560>1280", 2, 32, 2560, 1280, 2}, {"sdxl 64 640>640", 2, 64, 640, 640, 8},
    };
    cudnnHandle_t dn; CK(cudnnCreate(&dn));
    cublasLtHandle_t lt; CK(cublasLtCreate(&lt));
    cudaStream_t st; cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    CK(cudnnSetStream(dn, st));
    size_t wsz = 64 << 20; void *ws; cudaMalloc(&ws, wsz);
    double tot_dnn = 0, tot_g = 0, tot_best = 0;
    for (auto &s : shapes) {
        int m = s.n * s.hw * s.hw, kk = 9 * s.c;
        __half *x, *w, *y, *bias, *col;
        cudaMalloc(&x, (size_t)m * s.c * 2); cudaMalloc(&w, (size_t)s.k * kk * 2); cudaMalloc(&y, (size_t)m * s.k * 2);
        cudaMalloc(&bias, s.k * 2); cudaMalloc(&col, (size_t)m * kk * 2);
        cudaMemset(x, 0, (size_t)m * s.c * 2); cudaMemset(w, 0, (size_t)s.k * kk * 2); cudaMemset(bias, 0, s.k * 2);
        // cuDNN
        cudnnTensorDescriptor_t xd, yd, bd; cudnnFilterDescriptor_t wd; cudnnConvolutionDescriptor_t cd;
        cudnnActivationDescriptor_t ad;
        CK(cudnnCreateTensorDescriptor(&xd)); CK(cudnnCreateTensorDescriptor(&yd)); CK(cudnnCreateTensorDescriptor(&bd));
        CK(cudnnCreateFilterDescriptor(&wd)); CK(cudnnCreateConvolutionDescriptor(&cd)); CK(cudnnCreateActivationDescriptor(&ad));
        CK(cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NHWC, CUDNN_DATA_HALF, s.n, s.c, s.hw, s.hw));
        CK(cudnnSetTensor4dDescriptor(yd, CUDNN_TENSOR_NHWC, CUDNN_DATA_HALF, s.n, s.k, s.hw, s.hw));
        CK(cudnnSetTensor4dDescriptor(bd, CUDNN_TENSOR_NHWC, CUDNN_DATA_HALF, 1, s.k, 1, 1));
        CK(cudnnSetFilter4dDescriptor(wd, CUDNN_DATA_HALF, CUDNN_TENSOR_NHWC, s.k, s.c, 3, 3));
        CK(cudnnSetConvolution2dDescriptor(cd, 1, 1, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
        CK(cudnnSetConvolutionMathType(cd, CUDNN_TENSOR_OP_MATH));
        CK(cudnnSetActivationDescriptor(ad, CUDNN_ACTIVATION_IDENTITY, CUDNN_NOT_PROPAGATE_NAN, 0.0));
        float one = 1.f, zero = 0.f;
        cudnnConvolutionFwdAlgoPerf_t perf[8]; int got = 0;
        CK(cudnnGetConvolutionForwardAlgorithm_v7(dn, xd, wd, cd, yd, 8, &got, perf));
        cudnnConvolutionFwdAlgo_t algo = perf[0].algo;
        float t_plain = time_graph(st, [&] { CK(cudnnConvolutionForward(dn, &one, xd, x, wd, w, cd, algo, ws, wsz, &zero, yd, y)); });
        float t_bias = time_graph(st, [&] {
            CK(cudnnConvolutionBiasActivationForward(dn, &one, xd, x, wd, w, cd, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
                                                     ws, wsz, &zero, yd, y, bd, bias, ad, yd, y)); });
        // im2col + cuBLASLt: y[m, k] = col[m, kk] . w[k, kk]^T + bias (column-major: y^T = w . col^T)
        cublasLtMatmulDesc_t desc; CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
        CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
        CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof nt));
        cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS; CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep));
        CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
        cublasLtMatrixLayout_t la, lb, lc;
        CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16F, kk, s.k, kk)); CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16F, kk, m, kk));
        CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16F, s.k, m, s.k));
        cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
        size_t lws = 32 << 20;
        CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &lws, sizeof lws));
        cublasLtMatmulHeuristicResult_t res[8]; int cnt = 0;
        CK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 8, res, &cnt));
        long long chunks = (long long)m * 9 * (s.c / 8);
        auto i2c = [&] { im2col3<<<(chunks + 255) / 256, 256, 0, st>>>((const uint4 *)x, (uint4 *)col, s.n, s.hw, s.hw, s.c / 8); };
        float t_i2c = time_graph(st, i2c);
        float t_g[8], best = 1e9; int bi = 0;
        for (int a = 0; a < cnt; ++a) {
            t_g[a] = time_graph(st, [&] { CK(cublasLtMatmul(lt, desc, &one, w, la, col, lb, &zero, y, lc, y, lc, &res[a].algo, ws, lws, st)); });
            if (t_g[a] < best) { best = t_g[a]; bi = a; }
        }
        printf("%-20s M %5d K %5d N %4d | cudnn algo %d plain %6.1f  bias %6.1f us | im2col %5.1f + gemm top1 %6.1f best(%d) %6.1f us => %6.1f / %6.1f  x%d\n",
               s.what, m, kk, s.k, (int)algo, t_plain, t_bias, t_i2c, t_g[0], bi, best, t_i2c + t_g[0], t_i2c + best, s.count);
        if (s.what[1] == 'd' && s.what[2] == '1') { tot_dnn += s.count * t_bias; tot_g += s.count * std::min(t_bias, t_i2c + t_g[0]); tot_best += s.count * std::min(t_bias, t_i2c + best); }
        cudaFree(x); cudaFree(w); cudaFree(y); cudaFree(bias); cudaFree(col);
    }
    printf("sd15 weighted: cudnn %.1f us, min(cudnn, im2col+top1) %.1f, min(cudnn, im2col+best) %.1f\n", tot_dnn, tot_g, tot_best);
    return 0;
}
