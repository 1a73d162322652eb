// The crate's narrow product + LayerNorm for Hopper (crates/sdhive-cuda-kernels/src/linear_norm_wgmma.cu, included
// here so that this measures exactly the crate's kernel) against what the engine runs without it: cuBLASLt's product
// with the bias in its epilogue and the residual as C (as src/gemm.rs sets it up), then kernels.cu's layer_norm. At
// the SD1.5 UNet's 64² transformer shapes (batch 2: 8192 tokens, 320 channels): proj_in (bias, no residual), the
// attentions' to_out (bias and residual), the feed-forward's second product (K 1280), and ragged row counts; both
// timed as CUDA graphs of 20 calls on random data. h and n are checked against an f64 reference (h as stored, n from
// the stored h, as the unfused pair computes it) next to the baseline's own error; rows past M must stay unwritten;
// bf16 against the f64 reference only. Other stage counts, the crate's h-only instantiation (no LayerNorm), the
// h-only kernel with each row split over blocks of 160 columns (the crate's linear_wgmma_half is the first such
// row), and each block reading its own copy of W (whether the blocks' shared reads of W from L2 cost) are timed
// too.
// Build here, run on the GPU machine (cuBLAS from PyTorch's wheels):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -cudart shared xtask/bench/linear_norm.cu -o linear_norm \
//     -lcublasLt
//   ./linear_norm
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <vector>
#include "../../crates/sdhive-cuda-kernels/src/kernels.cu"
#include "../../crates/sdhive-cuda-kernels/src/linear_norm_wgmma.cu"
#include "harness.cuh"

static Timer tm;

// Other stage counts and occupancies than the crate's, through the same device function.
template <typename T, int NWG, int S, bool W1>
__global__ void __launch_bounds__(128 * NWG, 1)
    variant(const T *x, const T *w, const T *b, const T *r, const T *g, const T *be, T *h, T *n, int M, int K,
            float eps) {
    linear_norm_wgmma::fused<T, NWG, S, W1>(x, w, b, r, g, be, h, n, M, K, eps);
}
// Each block reads its own copy of W (block b copy b % C): whether the blocks' simultaneous reads of one W from L2
// are what the kernel waits for.
template <typename T, int C>
__global__ void __launch_bounds__(256, 1)
    copies(const T *x, const T *w, const T *b, const T *r, const T *g, const T *be, T *h, T *n, int M, int K,
           float eps) {
    linear_norm_wgmma::fused<T, 2, 3, false>(x, w + (size_t)(blockIdx.x % C) * 320 * K, b, r, g, be, h, n, M, K, eps);
}
template <typename T>
using Kern = void (*)(const T *, const T *, const T *, const T *, const T *, const T *, T *, T *, int, int, float);
struct Cfg {
    const char *name;
    int nwg, smem;
    Kern<__half> k;
    Kern<__nv_bfloat16> kb; // the crate's only
    int split = 1;          // column blocks per row (h only)
};
// h only, the row split into column blocks of 160·NWG.
template <typename T, int NWG, int S, bool W1>
__global__ void __launch_bounds__(128 * NWG, 1)
    split_variant(const T *x, const T *w, const T *b, const T *r, const T *g, const T *be, T *h, T *n, int M, int K,
                  float eps) {
    linear_norm_wgmma::fused<T, NWG, S, W1, false>(x, w, b, r, g, be, h, n, M, K, eps);
}
#define SPLIT(NWG, S, W1, SPLITS)                                                                              \
    Cfg {                                                                                                     \
        "h only wg" #NWG " s" #S " w" #W1 " split" #SPLITS " (no LN)", NWG,                                     \
            linear_norm_wgmma::smem_bytes<NWG, S>(), split_variant<__half, NWG, S, W1>, nullptr, SPLITS        \
    }
#define VAR(NWG, S, W1)                                                                                        \
    Cfg { "wg" #NWG " s" #S " w" #W1, NWG, linear_norm_wgmma::smem_bytes<NWG, S>(), variant<__half, NWG, S, W1>, \
          nullptr }
static Cfg cfgs[] = {
    {"crate n320 (wg2 s3 w0)", 2, linear_norm_wgmma::smem_bytes<2, 3>(), linear_norm_wgmma_n320_f16,
     linear_norm_wgmma_n320_bf16},
    VAR(2, 3, true),
    VAR(2, 2, false),
    {"crate n320 h only (no LN)", 2, linear_norm_wgmma::smem_bytes<2, 3>(), linear_wgmma_n320_f16, nullptr},
    {"W copies 8", 2, linear_norm_wgmma::smem_bytes<2, 3>(), copies<__half, 8>, nullptr},
    {"W copies 128", 2, linear_norm_wgmma::smem_bytes<2, 3>(), copies<__half, 128>, nullptr},
    SPLIT(1, 3, false, 2),
    SPLIT(1, 3, true, 2),
    SPLIT(1, 2, false, 2),
    SPLIT(1, 4, true, 2),
};

template <typename T> static T cvt(float v);
template <> __half cvt<__half>(float v) { return __float2half(v); }
template <> __nv_bfloat16 cvt<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
static double f(__half v) { return __half2float(v); }
static double f(__nv_bfloat16 v) { return __bfloat162float(v); }

// Random operands in T and the f64 reference of `rows`: h exactly, then rounded to T as stored, n from that.
template <typename T> struct Data {
    int M, K, N;
    bool res;
    std::vector<T> hx, hw, hb, hr, hg, hbe;
    std::vector<int> rows;
    std::vector<double> h_exact, n_exact;
    T *x, *w, *b, *r, *g, *be;
    Data(int M_, int K_, int N_, bool res_, uint64_t seed, bool all_rows) : M(M_), K(K_), N(N_), res(res_) {
        hx.resize((size_t)M * K);
        hw.resize((size_t)N * K);
        hb.resize(N);
        hr.resize((size_t)M * N);
        hg.resize(N);
        hbe.resize(N);
        const float ws = 2.f / sqrtf((float)K);
        for (auto &v : hx) v = cvt<T>(frand(seed));
        for (auto &v : hw) v = cvt<T>(frand(seed) * ws);
        for (auto &v : hb) v = cvt<T>(0.5f * frand(seed));
        // The residual stream carries an offset per row and large values, as the UNet's does.
        for (int m = 0; m < M; ++m) {
            const float off = 3.f * frand(seed);
            for (int c = 0; c < N; ++c) hr[(size_t)m * N + c] = cvt<T>(off + 4.f * frand(seed));
        }
        for (auto &v : hg) v = cvt<T>(1.f + 0.5f * frand(seed));
        for (auto &v : hbe) v = cvt<T>(0.2f * frand(seed));
        auto up = [](T *&d, const std::vector<T> &h) {
            CK(cudaMalloc(&d, h.size() * sizeof(T)));
            CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
        };
        up(x, hx);
        {
            std::vector<T> many;
            for (int c = 0; c < 128; ++c) many.insert(many.end(), hw.begin(), hw.end());
            up(w, many);
        }
        up(b, hb);
        up(r, hr);
        up(g, hg);
        up(be, hbe);
        if (all_rows) {
            for (int q = 0; q < M; ++q) rows.push_back(q);
        } else {
            rows = {0, 1, 63, 64, 77, M / 2 + 5, std::max(0, M - 129), M - 1};
        }
        h_exact.resize(rows.size() * N);
        n_exact.resize(rows.size() * N);
        std::vector<double> hs(N);
        for (size_t q = 0; q < rows.size(); ++q) {
            const int m = rows[q];
            for (int c = 0; c < N; ++c) {
                double s = f(hb[c]) + (res ? f(hr[(size_t)m * N + c]) : 0.0);
                for (int k = 0; k < K; ++k) s += f(hx[(size_t)m * K + k]) * f(hw[(size_t)c * K + k]);
                h_exact[q * N + c] = s;
                hs[c] = f(cvt<T>((float)s));
            }
            double mean = 0, var = 0;
            for (int c = 0; c < N; ++c) mean += hs[c];
            mean /= N;
            for (int c = 0; c < N; ++c) var += (hs[c] - mean) * (hs[c] - mean);
            var /= N;
            for (int c = 0; c < N; ++c)
                n_exact[q * N + c] = (hs[c] - mean) / sqrt(var + 1e-5) * f(hg[c]) + f(hbe[c]);
        }
    }
    ~Data() {
        cudaFree(x); cudaFree(w); cudaFree(b); cudaFree(r); cudaFree(g); cudaFree(be);
    }
    double err(const std::vector<T> &o, const std::vector<double> &want) const {
        double m = 0;
        for (size_t q = 0; q < rows.size(); ++q)
            for (int c = 0; c < N; ++c) {
                const double d = fabs(f(o[(size_t)rows[q] * N + c]) - want[q * N + c]);
                if (!(d <= m)) m = d; // NaN propagates
            }
        return m;
    }
};

// The outputs with 128 guard rows past M filled with 0xff bytes.
template <typename T> struct Out {
    T *h, *n;
    size_t count, guard;
    Out(int M, int N) : count((size_t)M * N), guard((size_t)128 * N) {
        CK(cudaMalloc(&h, (count + guard) * sizeof(T)));
        CK(cudaMalloc(&n, (count + guard) * sizeof(T)));
    }
    ~Out() { cudaFree(h); cudaFree(n); }
    void poison() {
        CK(cudaMemset(h, 0xff, (count + guard) * sizeof(T)));
        CK(cudaMemset(n, 0xff, (count + guard) * sizeof(T)));
    }
    // The first M rows; `clean` whether the guard rows stayed untouched.
    std::vector<T> fetch(const T *p, bool &clean) const {
        std::vector<T> all(count + guard);
        CK(cudaMemcpy(all.data(), p, all.size() * sizeof(T), cudaMemcpyDeviceToHost));
        for (size_t i = count; i < all.size(); ++i) {
            uint16_t v;
            memcpy(&v, &all[i], 2);
            if (v != 0xffff) clean = false;
        }
        all.resize(count);
        return all;
    }
};

template <typename T>
static void launch(Kern<T> k, const Cfg &c, const Data<T> &d, Out<T> &o) {
    k<<<dim3((d.M + 63) / 64, c.split), 128 * c.nwg, c.smem, tm.s>>>(d.x, d.w, d.b, d.res ? d.r : nullptr, d.g, d.be,
                                                                       o.h, o.n, d.M, d.K, 1e-5f);
}

int main() {
    CK(cudaStreamCreate(&tm.s));
    CK(cudaEventCreate(&tm.e0));
    CK(cudaEventCreate(&tm.e1));
    for (auto &c : cfgs) {
        CK(cudaFuncSetAttribute(c.k, cudaFuncAttributeMaxDynamicSharedMemorySize, c.smem));
        if (c.kb) CK(cudaFuncSetAttribute(c.kb, cudaFuncAttributeMaxDynamicSharedMemorySize, c.smem));
    }
    cublasLtHandle_t lt;
    CL(cublasLtCreate(&lt));
    const size_t WS = 32 << 20;
    void *ws;
    CK(cudaMalloc(&ws, WS));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);

    struct Shape { const char *what; int M, K, N; bool res, timed; };
    const Shape shapes[] = {
        {"SD1.5 64x64 b2 proj_in + norm1", 8192, 320, 320, false, true},
        {"SD1.5 64x64 b2 to_out + residual + norm2/3", 8192, 320, 320, true, true},
        {"SD1.5 64x64 b2 ff.net.2 (K 1280) + residual + norm", 8192, 1280, 320, true, true},
        {"SD1.5 64x64 b1 to_out + residual", 4096, 320, 320, true, true},
        {"ragged", 77, 320, 320, true, false},
        {"ragged", 1000, 640, 320, true, false},
        {"ragged", 1, 320, 320, false, false},
    };
    bool all_ok = true;
    for (int si = 0; si < (int)(sizeof shapes / sizeof shapes[0]); ++si) {
        const Shape &sh = shapes[si];
        const int M = sh.M, K = sh.K, N = sh.N;
        printf("\n%s: M %d K %d N %d%s\n", sh.what, M, K, N, sh.res ? " residual" : "");
        Data<__half> d(M, K, N, sh.res, 777 + si, !sh.timed);
        Out<__half> o(M, N);
        __half *bh, *bn;
        CK(cudaMalloc(&bh, (size_t)M * N * 2));
        CK(cudaMalloc(&bn, (size_t)M * N * 2));

        // cuBLASLt as src/gemm.rs: D (N×M col-major = M×N row-major) = op(A)·B + bias + C, A = W (K×N col-major,
        // transposed), B = x (K×M), C the residual.
        const LtProduct lp(M, K, N, d.b, WS);
        cublasLtMatmulHeuristicResult_t hr;
        const int got = lp.offers(lt, &hr, 1);
        if (!got) { fprintf(stderr, "no algo\n"); return 1; }
        const float one = 1.f, zero = 0.f;
        auto prod = [&] {
            CL(cublasLtMatmul(lt, lp.desc, &one, d.w, lp.a, d.x, lp.b, sh.res ? &one : &zero, sh.res ? d.r : bh, lp.cd, bh, lp.cd,
                              &hr.algo, ws, WS, tm.s));
        };
        const unsigned ln_blocks = (unsigned)(((size_t)M * 32 + 255) / 256);
        auto norm = [&] { layer_norm_f16<<<ln_blocks, 256, 0, tm.s>>>(bh, d.g, d.be, bn, M, N, 1e-5f); };
        prod();
        norm();
        CK(cudaGetLastError());
        CK(cudaStreamSynchronize(tm.s));
        std::vector<__half> base_h((size_t)M * N), base_n((size_t)M * N);
        CK(cudaMemcpy(base_h.data(), bh, base_h.size() * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(base_n.data(), bn, base_n.size() * 2, cudaMemcpyDeviceToHost));
        const double beh = d.err(base_h, d.h_exact), ben = d.err(base_n, d.n_exact);
        float t_prod = 0, t_both = 0;
        if (sh.timed) {
            t_prod = tm.time(prod);
            t_both = tm.time([&] { prod(); norm(); });
        }
        printf("  baseline cuBLASLt %8.2f us, + layer_norm %8.2f us   max|h-exact| %.3g  max|n-exact| %.3g\n", t_prod,
               t_both, beh, ben);
        for (const Cfg &c : cfgs) {
            if (!sh.timed && !c.kb) continue;
            o.poison();
            launch(c.k, c, d, o);
            CK(cudaGetLastError());
            CK(cudaStreamSynchronize(tm.s));
            bool clean = true;
            const auto h = o.fetch(o.h, clean), n = o.fetch(o.n, clean);
            // The h-only kernel leaves n alone.
            const bool norm = strstr(c.name, "no LN") == nullptr;
            const double eh = d.err(h, d.h_exact), en = norm ? d.err(n, d.n_exact) : 0.0;
            float us = 0;
            if (sh.timed) us = tm.time([&] { launch(c.k, c, d, o); });
            const bool ok = clean && eh <= 2 * beh + 1e-3 && en <= 2 * ben + 1e-3;
            if (c.kb) all_ok = all_ok && ok;
            printf("  %-28s %8.2f us   max|h-exact| %.3g  max|n-exact| %.3g%s%s\n", c.name, us, eh, en,
                   clean ? "" : "   ROWS PAST M WRITTEN", ok ? "" : "   FAIL");
        }
        {
            Data<__nv_bfloat16> db(M, K, N, sh.res, 999 + si, !sh.timed);
            Out<__nv_bfloat16> ob(M, N);
            const Cfg &c = cfgs[0];
            ob.poison();
            launch(c.kb, c, db, ob);
            CK(cudaGetLastError());
            CK(cudaStreamSynchronize(tm.s));
            bool clean = true;
            const auto h = ob.fetch(ob.h, clean), n = ob.fetch(ob.n, clean);
            double hmax = 0, nmax = 0;
            for (double v : db.h_exact) hmax = std::max(hmax, fabs(v));
            for (double v : db.n_exact) nmax = std::max(nmax, fabs(v));
            const double eh = db.err(h, db.h_exact), en = db.err(n, db.n_exact);
            // bf16 keeps 8 significant bits: half a unit of the largest value's last place, and the inputs' rounding.
            const bool ok = clean && eh <= hmax / 128.0 && en <= nmax / 128.0;
            all_ok = all_ok && ok;
            printf("    bf16 %-23s max|h-exact| %.3g (largest %.3g)  max|n-exact| %.3g (largest %.3g)%s%s\n", c.name,
                   eh, hmax, en, nmax, clean ? "" : "   ROWS PAST M WRITTEN", ok ? "" : "   FAIL");
        }
        cudaFree(bh); cudaFree(bn);
    }
    printf("\n%s\n", all_ok ? "all checks passed" : "SOME CHECKS FAILED");
    return all_ok ? 0 : 1;
}
