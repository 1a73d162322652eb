// How fast cuDNN's legacy API runs the SD1.5 UNet's 3×3 convolutions (every map size at CFG batch 2, channels-last
// f16, f32 accumulation) per forward algorithm and math type, on random operands (zeros flatter the clocks and the
// memory system: conv_gemm.cu's note). The engine calls cudnnConvolutionBiasActivationForward with
// IMPLICIT_PRECOMP_GEMM (the only algorithm with the identity activation); at 8² cuDNN runs a 64×64-tile kernel there on 40 blocks, while the 2560-channel inputs at the same
// map get a split-K kernel on 120. Each line: the algorithm, cudnnConvolutionForward's time and the largest
// difference from the PRECOMP output, then the same with beta = 1 over a prefilled output (the skip and bias
// written first, as a caller without the bias epilogue would). Graphs of 20 calls, best of 5 launches. The last
// shapes are the networks' edge convolutions with their few channels padded to 8 (what EdgeConv does), 16, 32, 64.
// CONV_ALGOS_ONLY=SUBSTRING runs the shapes whose name holds it.
// Build here, run on the GPU machine:
//   C=~/.cache/sdhive-cuda-13.0/prefix/nvidia (the toolchain `cargo xtask build-cuda` caches; its nvcc on PATH)
//   nvcc -O2 -std=c++17 -arch=sm_90 -cudart shared -I$C/cudnn/include xtask/bench/conv_algos.cu -o conv_algos \
//        -L$C/cu13/lib -L$C/cudnn/lib -l:libcudnn.so.9
#include "cudnn_conv.cuh"
#include <cuda_fp16.h>
#include <cmath>
#include <cstring>
#include <vector>

int main() {
    struct S {
        const char *what;
        int n, hw, c, k;
    } shapes[] = {
        {"8² 1280>1280", 2, 8, 1280, 1280},   {"8² 2560>1280", 2, 8, 2560, 1280},  {"16² 1280>1280", 2, 16, 1280, 1280},
        {"16² 2560>1280", 2, 16, 2560, 1280}, {"16² 1920>1280", 2, 16, 1920, 1280}, {"16² 640>1280", 2, 16, 640, 1280},
        {"32² 640>640", 2, 32, 640, 640},     {"32² 1920>640", 2, 32, 1920, 640},  {"32² 1280>640", 2, 32, 1280, 640},
        {"32² 960>640", 2, 32, 960, 640},     {"32² 1280>1280", 2, 32, 1280, 1280}, {"64² 320>320", 2, 64, 320, 320},
        {"64² 640>320", 2, 64, 640, 320},     {"64² 960>320", 2, 64, 960, 320},    {"64² 640>640", 2, 64, 640, 640},
        // The networks' edges: the few image or latent channels padded (EdgeConv) to 8, 16, 32 or 64.
        {"64² 320>8", 2, 64, 320, 8},         {"64² 320>16", 2, 64, 320, 16},      {"64² 320>32", 2, 64, 320, 32},
        {"64² 320>64", 2, 64, 320, 64},       {"64² 8>320", 2, 64, 8, 320},        {"64² 16>320", 2, 64, 16, 320},
        {"64² 32>320", 2, 64, 32, 320},       {"512² 128>8", 1, 512, 128, 8},      {"512² 128>16", 1, 512, 128, 16},
        {"512² 128>32", 1, 512, 128, 32},     {"64² 8>512", 1, 64, 8, 512},        {"64² 16>512", 1, 64, 16, 512},
    };
    const char *only = getenv("CONV_ALGOS_ONLY"); // a substring of the shapes to run
    const char *algo_name[8] = {"IMPLICIT_GEMM", "IMPLICIT_PRECOMP_GEMM", "GEMM", "DIRECT", "FFT", "FFT_TILING",
                                "WINOGRAD", "WINOGRAD_NONFUSED"};
    cudnnHandle_t dn;
    CK(cudnnCreate(&dn));
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    CK(cudnnSetStream(dn, st));
    size_t wsz = 256 << 20;
    void *ws;
    cudaMalloc(&ws, wsz);
    printf("cuDNN %zu\n", cudnnGetVersion());
    for (auto &s : shapes) {
        if (only && !strstr(s.what, only)) continue;
        const size_t m = (size_t)s.n * s.hw * s.hw, kk = 9 * (size_t)s.c;
        __half *x, *w, *y, *yref, *bias, *skip;
        cudaMalloc(&x, m * s.c * 2);
        cudaMalloc(&w, s.k * kk * 2);
        cudaMalloc(&y, m * s.k * 2);
        cudaMalloc(&yref, m * s.k * 2);
        cudaMalloc(&bias, s.k * 2);
        cudaMalloc(&skip, m * s.k * 2);
        fill<<<(m * s.c + 255) / 256, 256, 0, st>>>(x, m * s.c, 1, 1.f);
        fill<<<(s.k * kk + 255) / 256, 256, 0, st>>>(w, s.k * kk, 2, 1.7f / sqrtf((float)kk));
        fill<<<(s.k + 255) / 256, 256, 0, st>>>(bias, s.k, 3, 0.1f);
        fill<<<(m * s.k + 255) / 256, 256, 0, st>>>(skip, m * s.k, 4, 1.f);
        const Conv3x3Nhwc d(s.n, s.c, s.k, s.hw);
        const auto xd = d.xd, yd = d.yd, bd = d.bd;
        const auto wd = d.wd;
        const auto cd = d.cd;
        const auto ad = d.ad;
        float one = 1.f, zero = 0.f;
        printf("\n=== %s (M %zu, K %zu, N %d)\n", s.what, m, kk, s.k);
        for (cudnnMathType_t math : {CUDNN_TENSOR_OP_MATH, CUDNN_DEFAULT_MATH}) {
            CK(cudnnSetConvolutionMathType(cd, math));
            // The engine's call: bias and skip in the epilogue.
            CK(cudaMemcpyAsync(yref, skip, m * s.k * 2, cudaMemcpyDeviceToDevice, st));
            CK(cudnnConvolutionBiasActivationForward(dn, &one, xd, x, wd, w, cd,
                                                     CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, ws, wsz, &one, yd,
                                                     yref, bd, bias, ad, yd, yref));
            float t_engine = time_graph(st, [&](int) {
                CK(cudnnConvolutionBiasActivationForward(dn, &one, xd, x, wd, w, cd,
                                                         CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, ws, wsz,
                                                         &zero, yd, y, bd, bias, ad, yd, y));
            });
            size_t own = 0;
            CK(cudnnGetConvolutionForwardWorkspaceSize(dn, xd, wd, cd, yd, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
                                                       &own));
            float t_own = time_graph(st, [&](int) {
                CK(cudnnConvolutionBiasActivationForward(dn, &one, xd, x, wd, w, cd,
                                                         CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, ws, own,
                                                         &zero, yd, y, bd, bias, ad, yd, y));
            });
            printf("math %s: engine's biasact(PRECOMP) %.1f us with a 256 MB workspace, %.1f us with its own %zu bytes\n",
                   math == CUDNN_TENSOR_OP_MATH ? "TENSOR_OP" : "DEFAULT", t_engine, t_own, own);
            cudnnConvolutionFwdAlgoPerf_t perf[8];
            int got = 0;
            CK(cudnnGetConvolutionForwardAlgorithm_v7(dn, xd, wd, cd, yd, 8, &got, perf));
            printf("  v7 heuristics:");
            for (int i = 0; i < got; ++i)
                if (perf[i].status == CUDNN_STATUS_SUCCESS)
                    printf(" %s(ws %zu MB, math %d)", algo_name[perf[i].algo], perf[i].memory >> 20, (int)perf[i].mathType);
            printf("\n");
            int found = 0;
            CK(cudnnFindConvolutionForwardAlgorithmEx(dn, xd, x, wd, w, cd, yd, y, 8, &found, perf, ws, wsz));
            printf("  Find:");
            for (int i = 0; i < found; ++i)
                if (perf[i].status == CUDNN_STATUS_SUCCESS)
                    printf(" %s %.1f us", algo_name[perf[i].algo], perf[i].time * 1000);
            printf("\n");
            for (int a = 0; a < 8; ++a) {
                auto algo = (cudnnConvolutionFwdAlgo_t)a;
                size_t need = 0;
                if (cudnnGetConvolutionForwardWorkspaceSize(dn, xd, wd, cd, yd, algo, &need) != CUDNN_STATUS_SUCCESS ||
                    need > wsz)
                    continue;
                // y = conv + 1·(skip + bias): the skip prefilled with the bias added, then beta = 1.
                CK(cudaMemcpyAsync(y, skip, m * s.k * 2, cudaMemcpyDeviceToDevice, st));
                CK(cudnnAddTensor(dn, &one, bd, bias, &one, yd, y));
                if (cudnnConvolutionForward(dn, &one, xd, x, wd, w, cd, algo, ws, wsz, &one, yd, y) != CUDNN_STATUS_SUCCESS)
                    continue;
                CK(cudaStreamSynchronize(st));
                const float d = max_diff(y, yref, m * s.k);
                float t = time_graph(st, [&](int) { cudnnConvolutionForward(dn, &one, xd, x, wd, w, cd, algo, ws, wsz, &one, yd, y); });
                float t0 = time_graph(st, [&](int) { cudnnConvolutionForward(dn, &one, xd, x, wd, w, cd, algo, ws, wsz, &zero, yd, y); });
                printf("  %-22s ws %4zu MB: beta 0 %6.1f us, beta 1 %6.1f us, max |diff| vs engine %.4f\n", algo_name[a],
                       need >> 20, t0, t, d);
            }
        }
        cudaFree(x), cudaFree(w), cudaFree(y), cudaFree(yref), cudaFree(bias), cudaFree(skip);
    }
    return 0;
}
