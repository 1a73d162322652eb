// Whether the 3×3 convolutions of SD1.5's small maps (16², 32², 8² at CFG batch 2), where cuDNN's tiles leave SMs
// idle, gain from being issued as independent halves on two streams inside one CUDA graph (a fork and a join, as a
// step's graph would record them): per shape the engine's single call (cudnnConvolutionBiasActivationForward,
// IMPLICIT_PRECOMP_GEMM, NHWC f16, bias and skip in its epilogue), the two images as two calls one after the
// other, the two images on two streams, and the output channels' two halves on two streams (strided NHWC output
// and skip views). Four copies of the filter and input are cycled so that the filter is read from memory as in a
// step. Every variant's output is compared with the single call's. Then, per up-path ResNet shape, its first
// convolution (C → K, bias) and its shortcut, the 1×1 product x·Wᵀ (cuBLAS, f32 accumulation), one after the other
// and with the product on a second stream beside the convolution: what a step's graph would gain by recording the
// shortcut as a branch. Times: graphs of 20 calls, best of 5 launches.
// Build here, run on the GPU machine:
//   C=~/.cache/sdhive-cuda-13.0/prefix/nvidia (the toolchain `cargo xtask build-cuda` caches; its nvcc on PATH)
//   nvcc -O3 -std=c++17 -arch=sm_90 -cudart shared -I$C/cudnn/include xtask/bench/conv_streams.cu -o conv_streams \
//        -L$C/cu13/lib -L$C/cudnn/lib -l:libcudnn.so.9 -lcublas
#include "cudnn_conv.cuh"
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cmath>
#include <vector>

int main() {
    setvbuf(stdout, nullptr, _IONBF, 0);
    cudaStream_t st[2];
    cudnnHandle_t dn[2];
    for (int i = 0; i < 2; ++i) {
        CK(cudaStreamCreateWithFlags(&st[i], cudaStreamNonBlocking));
        CK(cudnnCreate(&dn[i]));
        CK(cudnnSetStream(dn[i], st[i]));
    }
    cudaEvent_t fork, join;
    CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
    const auto algo = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
    const float one = 1.f;
    struct Shape {
        int hw, c, k;
    };
    constexpr int NB = 2, COPIES = 4;
    for (Shape sh : {Shape{16, 1280, 1280}, Shape{16, 2560, 1280}, Shape{16, 1920, 1280}, Shape{16, 640, 1280},
                     Shape{32, 640, 640}, Shape{32, 1280, 640}, Shape{8, 1280, 1280}}) {
        const int hw = sh.hw, C = sh.c, K = sh.k, px = hw * hw;
        const size_t nx = (size_t)NB * px * C, nw = (size_t)K * 9 * C, ny = (size_t)NB * px * K;
        std::vector<__half *> xs(COPIES), ws(COPIES);
        for (int i = 0; i < COPIES; ++i) {
            CK(cudaMalloc(&xs[i], nx * 2));
            CK(cudaMalloc(&ws[i], nw * 2));
            fill<<<(nx + 255) / 256, 256>>>(xs[i], nx, 11 + i, 1.f);
            fill<<<(nw + 255) / 256, 256>>>(ws[i], nw, 101 + i, 1.f / sqrtf(9.f * C));
        }
        __half *bias, *skip, *y, *y_ref;
        CK(cudaMalloc(&bias, K * 2));
        CK(cudaMalloc(&skip, ny * 2));
        CK(cudaMalloc(&y, ny * 2));
        CK(cudaMalloc(&y_ref, ny * 2));
        fill<<<(K + 255) / 256, 256>>>(bias, K, 7, 0.5f);
        fill<<<(ny + 255) / 256, 256>>>(skip, ny, 9, 1.f);
        CK(cudaDeviceSynchronize());

        // The whole call, one image, and half the output channels (strided views of y and the skip).
        const Conv3x3Nhwc whole(NB, C, K, hw), image(1, C, K, hw), half(NB, C, K / 2, hw);
        for (const Conv3x3Nhwc *d : {&whole, &image, &half}) CK(cudnnSetConvolutionMathType(d->cd, CUDNN_TENSOR_OP_MATH));
        CK(cudnnSetTensor4dDescriptorEx(half.yd, CUDNN_DATA_HALF, NB, K / 2, hw, hw, px * K, 1, hw * K, K));
        size_t wsz = 0, w1 = 0, w2 = 0;
        CK(cudnnGetConvolutionForwardWorkspaceSize(dn[0], whole.xd, whole.wd, whole.cd, whole.yd, algo, &wsz));
        CK(cudnnGetConvolutionForwardWorkspaceSize(dn[0], image.xd, image.wd, image.cd, image.yd, algo, &w1));
        const bool half_ok =
            cudnnGetConvolutionForwardWorkspaceSize(dn[0], half.xd, half.wd, half.cd, half.yd, algo, &w2) == 0;
        wsz = std::max(wsz, std::max(w1, w2));
        void *wsp[2] = {nullptr, nullptr};
        if (wsz)
            for (auto &p : wsp) CK(cudaMalloc(&p, wsz));

        auto call = [&](int s, const Conv3x3Nhwc &d, const __half *x, const __half *w, const __half *b,
                        const __half *z, __half *out) {
            return cudnnConvolutionBiasActivationForward(dn[s], &one, d.xd, x, d.wd, w, d.cd, algo, wsp[s], wsz, &one,
                                                         d.yd, z, d.bd, b, d.ad, d.yd, out);
        };
        auto single = [&](int i) { CK(call(0, whole, xs[i % COPIES], ws[i % COPIES], bias, skip, y)); };
        auto images_seq = [&](int i) {
            for (int b = 0; b < NB; ++b)
                CK(call(0, image, xs[i % COPIES] + b * px * C, ws[i % COPIES], bias, skip + b * px * K, y + b * px * K));
        };
        // Stream 1 joins the capture through the fork event and hands its work back through the join event.
        auto two_streams = [&](auto &&second, auto &&first) {
            CK(cudaEventRecord(fork, st[0]));
            CK(cudaStreamWaitEvent(st[1], fork, 0));
            second();
            first();
            CK(cudaEventRecord(join, st[1]));
            CK(cudaStreamWaitEvent(st[0], join, 0));
        };
        auto images_par = [&](int i) {
            two_streams([&] { CK(call(1, image, xs[i % COPIES] + px * C, ws[i % COPIES], bias, skip + px * K, y + px * K)); },
                        [&] { CK(call(0, image, xs[i % COPIES], ws[i % COPIES], bias, skip, y)); });
        };
        auto halves_par = [&](int i) {
            const size_t off = (size_t)(K / 2) * 9 * C;
            two_streams([&] { CK(call(1, half, xs[i % COPIES], ws[i % COPIES] + off, bias + K / 2, skip + K / 2, y + K / 2)); },
                        [&] { CK(call(0, half, xs[i % COPIES], ws[i % COPIES], bias, skip, y)); });
        };

        single(0);
        CK(cudaStreamSynchronize(st[0]));
        CK(cudaMemcpy(y_ref, y, ny * 2, cudaMemcpyDeviceToDevice));
        printf("== %dx%d x%d, %d -> %d, bias+skip; %.1f GFLOP\n", hw, hw, NB, C, K, 2.0 * ny * 9 * C / 1e9);
        auto report = [&](const char *name, auto &&f) {
            CK(cudaMemset(y, 0, ny * 2));
            f(0);
            CK(cudaStreamSynchronize(st[0]));
            CK(cudaDeviceSynchronize());
            const float d = max_diff(y, y_ref, ny);
            const float t = time_graph(st[0], f);
            printf("%-22s %8.2f us  max diff from the single call %.3g\n", name, t, d);
        };
        report("single call", single);
        report("images one by one", images_seq);
        report("images on 2 streams", images_par);
        if (half_ok)
            report("K halves on 2 streams", halves_par);
        else
            printf("K halves: cuDNN refuses the strided output\n");
        for (auto p : xs) CK(cudaFree(p));
        for (auto p : ws) CK(cudaFree(p));
        for (auto p : wsp)
            if (p) CK(cudaFree(p));
        CK(cudaFree(bias));
        CK(cudaFree(skip));
        CK(cudaFree(y));
        CK(cudaFree(y_ref));
    }

    cublasHandle_t bl;
    CK(cublasCreate(&bl));
    CK(cublasSetStream(bl, st[1]));
    // Its own workspace, so that capturing it into a graph allocates nothing.
    void *blas_ws;
    CK(cudaMalloc(&blas_ws, 32 << 20));
    CK(cublasSetWorkspace(bl, blas_ws, 32 << 20));
    struct Res {
        int hw, c, k;
    };
    for (Res r : {Res{8, 2560, 1280}, Res{16, 2560, 1280}, Res{16, 1920, 1280}, Res{32, 1920, 640}, Res{32, 960, 640},
                  Res{64, 960, 320}, Res{64, 640, 320}}) {
        const int hw = r.hw, C = r.c, K = r.k, M = NB * hw * hw;
        const size_t nx = (size_t)M * C, nw = (size_t)K * 9 * C, ny = (size_t)M * K, ns = (size_t)K * C;
        std::vector<__half *> xs(COPIES), ws(COPIES), wss(COPIES);
        for (int i = 0; i < COPIES; ++i) {
            CK(cudaMalloc(&xs[i], nx * 2));
            CK(cudaMalloc(&ws[i], nw * 2));
            CK(cudaMalloc(&wss[i], ns * 2));
            fill<<<(nx + 255) / 256, 256>>>(xs[i], nx, 21 + i, 1.f);
            fill<<<(nw + 255) / 256, 256>>>(ws[i], nw, 201 + i, 1.f / sqrtf(9.f * C));
            fill<<<(ns + 255) / 256, 256>>>(wss[i], ns, 301 + i, 1.f / sqrtf((float)C));
        }
        __half *bias, *y, *sc;
        CK(cudaMalloc(&bias, K * 2));
        CK(cudaMalloc(&y, ny * 2));
        CK(cudaMalloc(&sc, ny * 2));
        fill<<<(K + 255) / 256, 256>>>(bias, K, 7, 0.5f);
        CK(cudaDeviceSynchronize());
        const Conv3x3Nhwc d(NB, C, K, hw);
        CK(cudnnSetConvolutionMathType(d.cd, CUDNN_TENSOR_OP_MATH));
        size_t wsz = 0;
        CK(cudnnGetConvolutionForwardWorkspaceSize(dn[0], d.xd, d.wd, d.cd, d.yd, algo, &wsz));
        void *wsp = nullptr;
        if (wsz) CK(cudaMalloc(&wsp, wsz));
        const float zero = 0.f;
        auto conv = [&](int i) {
            CK(cudnnConvolutionBiasActivationForward(dn[0], &one, d.xd, xs[i % COPIES], d.wd, ws[i % COPIES], d.cd,
                                                     algo, wsp, wsz, &zero, d.yd, y, d.bd, bias, d.ad, d.yd, y));
        };
        // sc (M × K, row-major) = x (M × C) · Wsᵀ, Ws (K × C): column-major K × M = Wsᵀ-op over x.
        auto product = [&](int i) {
            CK(cublasGemmEx(bl, CUBLAS_OP_T, CUBLAS_OP_N, K, M, C, &one, wss[i % COPIES], CUDA_R_16F, C,
                            xs[i % COPIES], CUDA_R_16F, C, &zero, sc, CUDA_R_16F, K, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
        };
        auto serial = [&](int i) {
            conv(i);
            CK(cudaEventRecord(fork, st[0]));
            CK(cudaStreamWaitEvent(st[1], fork, 0));
            product(i);
            CK(cudaEventRecord(join, st[1]));
            CK(cudaStreamWaitEvent(st[0], join, 0));
        };
        auto branch = [&](int i) {
            CK(cudaEventRecord(fork, st[0]));
            CK(cudaStreamWaitEvent(st[1], fork, 0));
            product(i);
            conv(i);
            CK(cudaEventRecord(join, st[1]));
            CK(cudaStreamWaitEvent(st[0], join, 0));
        };
        auto only_product = [&](int i) {
            CK(cudaEventRecord(fork, st[0]));
            CK(cudaStreamWaitEvent(st[1], fork, 0));
            product(i);
            CK(cudaEventRecord(join, st[1]));
            CK(cudaStreamWaitEvent(st[0], join, 0));
        };
        const float t_conv = time_graph(st[0], conv), t_prod = time_graph(st[0], only_product);
        const float t_serial = time_graph(st[0], serial), t_branch = time_graph(st[0], branch);
        printf("ResNet %dx%d x%d, %d -> %d: conv1 %.2f us, shortcut product %.2f us; one after the other %.2f us, "
               "the product beside the convolution %.2f us (%.2f us saved)\n",
               hw, hw, NB, C, K, t_conv, t_prod, t_serial, t_branch, t_serial - t_branch);
        for (int i = 0; i < COPIES; ++i) {
            CK(cudaFree(xs[i]));
            CK(cudaFree(ws[i]));
            CK(cudaFree(wss[i]));
        }
        CK(cudaFree(bias));
        CK(cudaFree(y));
        CK(cudaFree(sc));
        if (wsp) CK(cudaFree(wsp));
    }
    CK(cublasDestroy(bl));
    CK(cudaFree(blas_ws));
    printf("done\n");
    return 0;
}
