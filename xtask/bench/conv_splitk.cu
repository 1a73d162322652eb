// The cluster split-K convolution of the 8² maps (crates/sdhive-cuda-kernels/src/conv_splitk.cu) against what the
// engine ran before it: cuDNN's cudnnConvolutionBiasActivationForward (IMPLICIT_PRECOMP_GEMM, NHWC f16, bias and
// skip in its epilogue, as src/cudnn.rs calls it). Per SD1.5 shape (batch 2, 8×8, output 1280 channels; input 1280
// with and without skip, 2560 with skip) and per instantiation (splits S = cluster size, tiles in flight D): the
// largest error against an f32 reference (a plain GPU loop over the 9·C products) over the output's largest
// value, both kernels; then times. Four copies of the filter (and input) are cycled so that the filter is read from
// memory, not the L2, as in a UNet step. Times: CUDA graphs of 20 calls launched 5 times, best, µs a call; GB/s is
// the filter's bytes over that time.
// Build here, run on the GPU machine:
//   C=~/.cache/sdhive-cuda-13.0/prefix/nvidia (the toolchain `cargo xtask build-cuda` caches; its nvcc on PATH)
//   nvcc -O3 -std=c++17 -arch=sm_90a -cudart shared -I$C/cudnn/include xtask/bench/conv_splitk.cu -o conv_splitk \
//        -L$C/cu13/lib -L$C/cudnn/lib -l:libcudnn.so.9
#define SDHIVE_CONV_SPLITK_NO_INSTANCES
#include "../../crates/sdhive-cuda-kernels/src/conv_splitk.cu"
#include "cudnn_conv.cuh"
#include <cmath>
#include <cstring>
#include <vector>

CONV_SPLITK(4, 2, 6, __half, f16)
CONV_SPLITK(5, 2, 6, __half, f16)
CONV_SPLITK(5, 2, 8, __half, f16)

using Kernel = void (*)(const __half *, const __half *, const __half *, const __half *, __half *, int, int, int);
struct Config {
    const char *name;
    Kernel k;
    int s, d;
};
const Config CONFIGS[] = {
    {"s4_d6", conv_splitk_s4_b2_d6_f16, 4, 6},
    {"s5_d6", conv_splitk_s5_b2_d6_f16, 5, 6},
    {"s5_d8", conv_splitk_s5_b2_d8_f16, 5, 8},
};

// out[p, k] = bias[k] + skip[p, k] + Σ x[p shifted by the tap, c] · w[k, tap, c], f32.
__global__ void reference(const __half *x, const __half *w, const __half *bias, const __half *skip, float *out,
                          int nb, int C, int K) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= nb * 64 * K) return;
    const int k = idx % K, p = idx / K, b = p / 64, oy = p % 64 / 8, ox = p % 8;
    float acc = __half2float(bias[k]) + (skip ? __half2float(skip[idx]) : 0.f);
    for (int tap = 0; tap < 9; ++tap) {
        const int iy = oy + tap / 3 - 1, ix = ox + tap % 3 - 1;
        if (iy < 0 || iy >= 8 || ix < 0 || ix >= 8) continue;
        const __half *xp = x + ((size_t)(b * 8 + iy) * 8 + ix) * C;
        const __half *wp = w + ((size_t)k * 9 + tap) * C;
        for (int c = 0; c < C; ++c) acc += __half2float(xp[c]) * __half2float(wp[c]);
    }
    out[idx] = acc;
}

std::vector<__half> random_halves(size_t n, float scale, unsigned &seed) {
    std::vector<__half> v(n);
    for (auto &e : v) {
        seed = seed * 1664525u + 1013904223u;
        e = __float2half(((seed >> 8) / 16777216.f * 2.f - 1.f) * scale);
    }
    return v;
}

__half *upload(const std::vector<__half> &v) {
    __half *d;
    CK(cudaMalloc(&d, v.size() * sizeof(__half)));
    CK(cudaMemcpy(d, v.data(), v.size() * sizeof(__half), cudaMemcpyHostToDevice));
    return d;
}

int main(int argc, char **argv) {
    setvbuf(stdout, nullptr, _IONBF, 0);
    const char *only = argc > 1 ? argv[1] : nullptr;
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    cudnnHandle_t dn;
    CK(cudnnCreate(&dn));
    CK(cudnnSetStream(dn, st));
    constexpr int NB = 2, K = 1280, COPIES = 4;
    struct Shape {
        int c;
        bool skip;
    };
    for (Shape sh : {Shape{1280, true}, Shape{1280, false}, Shape{2560, true}}) {
        const int C = sh.c;
        unsigned seed = 1234 + C + sh.skip;
        const size_t nx = (size_t)NB * 64 * C, nw = (size_t)K * 9 * C, ny = (size_t)NB * 64 * K;
        std::vector<__half *> xs, ws;
        for (int i = 0; i < COPIES; ++i) {
            xs.push_back(upload(random_halves(nx, 1.f, seed)));
            ws.push_back(upload(random_halves(nw, 1.f / sqrtf(9.f * C), seed)));
        }
        __half *bias = upload(random_halves(K, 0.5f, seed));
        __half *skip = sh.skip ? upload(random_halves(ny, 1.f, seed)) : nullptr;
        __half *y;
        float *ref;
        CK(cudaMalloc(&y, ny * 2));
        CK(cudaMalloc(&ref, ny * 4));
        std::vector<float> r(ny);
        std::vector<__half> out(ny);
        auto check = [&](int nb) {
            CK(cudaMemcpy(out.data(), y, nb * 64 * K * 2, cudaMemcpyDeviceToHost));
            double err = 0, top = 0;
            for (int i = 0; i < nb * 64 * K; ++i) {
                err = std::max(err, (double)fabsf(__half2float(out[i]) - r[i]));
                top = std::max(top, (double)fabsf(r[i]));
            }
            return err / top;
        };
        auto reference_for = [&](int nb) {
            reference<<<(nb * 64 * K + 255) / 256, 256, 0, st>>>(xs[0], ws[0], bias, skip, ref, nb, C, K);
            CK(cudaStreamSynchronize(st));
            CK(cudaMemcpy(r.data(), ref, nb * 64 * K * 4, cudaMemcpyDeviceToHost));
        };
        printf("== 8x8 x%d, %d -> %d, %s; filter %.1f MB\n", NB, C, K, sh.skip ? "bias+skip" : "bias",
               nw * 2 / 1e6);

        const EngineConv engine(dn, NB, C, K, 8);
        auto cudnn = [&](int i) { engine.run(xs[i % COPIES], ws[i % COPIES], bias, skip, y); };
        reference_for(NB);
        cudnn(0);
        CK(cudaStreamSynchronize(st));
        const double e_cudnn = check(NB);
        const float t_cudnn = time_graph(st, cudnn);
        printf("cudnn   %8.2f us %7.0f GB/s  err %.2e\n", t_cudnn, nw * 2 / (t_cudnn * 1e3), e_cudnn);

        for (const Config &cfg : CONFIGS) {
            if (only && !strstr(cfg.name, only)) continue;
            if (C % (64 * cfg.s)) continue;
            const int smem = cfg.s == 4 ? conv_splitk::smem_bytes<4, NB, 6>()
                             : cfg.d == 6 ? conv_splitk::smem_bytes<5, NB, 6>()
                                          : conv_splitk::smem_bytes<5, NB, 8>();
            if (smem > 227 * 1024) continue;
            CK(cudaFuncSetAttribute(cfg.k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
            auto ours = [&](int i, int nb) {
                cfg.k<<<dim3(cfg.s, K / 64), 128, smem, st>>>(xs[i % COPIES], ws[i % COPIES], bias, skip, y, nb, C,
                                                            K);
            };
            CK(cudaMemset(y, 0, ny * 2));
            ours(0, NB);
            CK(cudaGetLastError());
            CK(cudaStreamSynchronize(st));
            const double e2 = check(NB);
            reference_for(1);
            CK(cudaMemset(y, 0, ny * 2));
            ours(0, 1);
            CK(cudaStreamSynchronize(st));
            const double e1 = check(1);
            reference_for(NB);
            cudaLaunchConfig_t lc = {};
            lc.gridDim = dim3(cfg.s, K / 64);
            lc.blockDim = dim3(128);
            lc.dynamicSmemBytes = smem;
            int clusters = -1;
            cudaOccupancyMaxActiveClusters(&clusters, (void *)cfg.k, &lc);
            const float t = time_graph(st, [&](int i) { ours(i, NB); });
            printf("%-7s %8.2f us %7.0f GB/s  err %.2e (1 image %.2e)  %d blocks, %d clusters fit, %d B smem  %s\n",
                   cfg.name, t, nw * 2 / (t * 1e3), e2, e1, cfg.s * K / 64, clusters, smem,
                   e2 < 1e-2 && e1 < 1e-2 ? "ok" : "FAILED");
        }
        for (auto p : xs) CK(cudaFree(p));
        for (auto p : ws) CK(cudaFree(p));
        CK(cudaFree(bias));
        if (skip) CK(cudaFree(skip));
        CK(cudaFree(y));
        CK(cudaFree(ref));
    }
    printf("done\n");
    return 0;
}
