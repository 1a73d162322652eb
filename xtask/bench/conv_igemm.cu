// Research spike: a Hopper (sm_90a, wgmma) implicit-GEMM 3x3 convolution (stride 1, padding 1, channels-last f16,
// f32 accumulation, filter KRSC, bias and optional residual in the epilogue), with and without the preceding
// GroupNorm(32)+SiLU applied to its input while loading, against what the engine runs today: cuDNN's legacy
// cudnnConvolutionBiasActivationForward (IMPLICIT_PRECOMP_GEMM, as crates/sdhive-cuda-kernels/src/cudnn.rs drives
// it) on an already normalised map, after a GroupNorm "apply" pass that writes that map. The statistics pass (per
// (batch, group) mean and rstd) stays separate in both pipelines and is not timed. Per SD1.5 UNet shape (batch 2):
//   (1) cuDNN conv alone, (2) apply pass + cuDNN conv, (3) our conv without the norm, (4) our conv with the norm
// on load; (3) is checked against cuDNN on the raw map, (4) against cuDNN on the applied map (max abs error over
// the output's max; FAILED past 1e-2), and cuDNN itself spot-checked against an f64 host reference. Times: CUDA
// graphs of 20 calls launched 10 times, random data (per-channel offsets and spreads, so the norm is no identity).
// - GEMM view: M = N·H·W pixels, N_gemm = Cout, K = 9·Cin ordered (tap, cin) as the filter stores it. A K tile is
//   64 channels of one tap: for output pixel p, 128 contiguous bytes of input pixel p shifted by the tap, or zeros
//   past the border (cp.async's zero fill), so the A tile is cp.async'ed exactly like a dense GEMM's. "cbm1" walks
//   the 9 taps of a 64-channel slice before the next slice (a little faster than all slices of one tap first).
// - conv(): WGM×WGN warpgroups of 64×WN (SS wgmma), S-stage cp.async ring, 128-byte swizzle (geglu_wgmma.cu's
//   scheme). With the norm each thread rewrites in shared memory the A chunks it copied itself (no barrier between
//   its cp.async wait and the rewrite), then fence.proxy.async; padded rows stay zero (the norm precedes the
//   padding). NORM modes: 1 f32 FMA + v/(1+exp(-v)) (two MUFU ops a value), 2 f32 FMA + h+h·tanh(h), h = v/2 (one:
//   tanh.approx.f32), 3 f32 FMA then tanh.approx.f16x2, 4 all f16x2 (HFMA2, tanh.approx.f16x2, HFMA2); 5 and 6 are
//   diagnostics with wrong results (the rewrite without math; the FMA alone).
// - conv_rs(): register-A wgmma: ldmatrix of the raw A tile straight into fragments, normalised in registers; NH 2
//   = one warpgroup over 320 columns (two n160 products sharing the fragments: half the normalisations).
// - conv_ws(): warp-specialised, mbarrier ring: producer warpgroup(s) load and normalise in place, consumers wgmma.
// - conv_halo(): per 64-channel slice the block's input rows plus a one-pixel border are loaded once into a "halo"
//   buffer and normalised once, and the 9 taps are ldmatrix windows of it (register-A wgmma): (R+2)/R
//   normalisations of a value per column tile instead of 9.
// Scale/shift per channel of the block's image come from the statistics into shared memory once per block (a block
// never straddles two images: H·W % BM == 0). Constraints: Cin % 64 == 0, Cout % BN == 0, M % BM == 0.
// Build here (C: the toolchain `cargo xtask build-cuda` caches; its nvcc on PATH), run on the GPU machine:
//   C=~/.cache/sdhive-cuda-13.0/prefix/nvidia
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -cudart shared -Xptxas -v -I$C/cudnn/include \
//        xtask/bench/conv_igemm.cu -o target/igemm/conv_igemm -L$C/cu13/lib -L$C/cudnn/lib -l:libcudnn.so.9
//   libs=$(python3 -c 'import glob, os, site; print(":".join(d for p in site.getsitepackages() for d in
//          sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))))'); export LD_LIBRARY_PATH="$libs"
//   target/igemm/conv_igemm [shape letters: A (64² 320>320 +res), a (same, no res), B (32² 640>640 +res),
//                            C (64² 640>320); default ABC] [config name part or "cudnn": run it ~6 s, for clock sampling]
#include <cudnn.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <cmath>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <vector>
#include "harness.cuh"

#define CD(x)                                                                                            \
    do {                                                                                                 \
        cudnnStatus_t s_ = (x);                                                                          \
        if (s_ != CUDNN_STATUS_SUCCESS) {                                                                \
            fprintf(stderr, "cuDNN %s at %s:%d: %s\n", #x, __FILE__, __LINE__, cudnnGetErrorString(s_)); \
            exit(1);                                                                                     \
        }                                                                                                \
    } while (0)

namespace igemm {

#define IG_ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define IG_ACC16(i) IG_ACC4(i), IG_ACC4(i + 4), IG_ACC4(i + 8), IG_ACC4(i + 12)
#define IG_ACC40 IG_ACC16(0), IG_ACC16(16), IG_ACC4(32), IG_ACC4(36)
#define IG_ACC64 IG_ACC16(0), IG_ACC16(16), IG_ACC16(32), IG_ACC16(48)
#define IG_ACC80 IG_ACC64, IG_ACC16(64)
#define IG_R10(i) "%" #i "0, %" #i "1, %" #i "2, %" #i "3, %" #i "4, %" #i "5, %" #i "6, %" #i "7, %" #i "8, %" #i "9"
#define IG_R0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9"
#define IG_R40 IG_R0 ", " IG_R10(1) ", " IG_R10(2) ", " IG_R10(3)
#define IG_R64 IG_R40 ", " IG_R10(4) ", " IG_R10(5) ", %60, %61, %62, %63"
#define IG_R80 IG_R40 ", " IG_R10(4) ", " IG_R10(5) ", " IG_R10(6) ", " IG_R10(7)
// D(64×N, f32) += A(64×16) · B(16×N), both from shared memory, K-major.
#define IG_WGMMA(N, REGS, IA, IB, ...)                                                                            \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                       \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 {" REGS "}, %" #IA ", %" #IB             \
                 ", p, 1, 1, 0, 0;\n}\n"                                                                          \
                 : __VA_ARGS__                                                                                    \
                 : "l"(da), "l"(db))
template <int N> struct Wgmma;
template <> struct Wgmma<80> {
    static __device__ __forceinline__ void mma(float (&d)[40], uint64_t da, uint64_t db) {
        IG_WGMMA(80, IG_R40, 40, 41, IG_ACC40);
    }
};
template <> struct Wgmma<128> {
    static __device__ __forceinline__ void mma(float (&d)[64], uint64_t da, uint64_t db) {
        IG_WGMMA(128, IG_R64, 64, 65, IG_ACC64);
    }
};
template <> struct Wgmma<160> {
    static __device__ __forceinline__ void mma(float (&d)[80], uint64_t da, uint64_t db) {
        IG_WGMMA(160, IG_R80, 80, 81, IG_ACC80);
    }
};

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// wgmma writes its registers asynchronously, unknown to the compiler: keeps the epilogue's reads behind the wait.
template <int N> __device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// `bytes` 0 writes zeros without reading: the convolution's padding.
__device__ __forceinline__ void cp16(uint32_t dst, const void *src, uint32_t bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ uint4 lds128(uint32_t a) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ void sts128(uint32_t a, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}
__device__ __forceinline__ float2 h2f(uint32_t v) { return __half22float2(*reinterpret_cast<const __half2 *>(&v)); }
__device__ __forceinline__ uint32_t f2h(float a, float b) {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t *>(&v);
}
__device__ __forceinline__ float tanh_f32(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ uint32_t tanh_h2(uint32_t x) {
    uint32_t y;
    asm("tanh.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}
// Two channels of silu(x·scale + shift); modes 2 and 3 get scale and shift halved (h = v/2, silu = h + h·tanh h).
template <int NORM> __device__ __forceinline__ uint32_t norm2(uint32_t v, float s0, float s1, float b0, float b1) {
    const float2 x = h2f(v);
    const float a = fmaf(x.x, s0, b0), b = fmaf(x.y, s1, b1);
    if constexpr (NORM == 1) {
        return f2h(__fdividef(a, 1.f + __expf(-a)), __fdividef(b, 1.f + __expf(-b)));
    } else if constexpr (NORM == 2) {
        return f2h(fmaf(a, tanh_f32(a), a), fmaf(b, tanh_f32(b), b));
    } else {
        const uint32_t h = f2h(a, b);
        const __half2 hh = *reinterpret_cast<const __half2 *>(&h);
        const uint32_t t = tanh_h2(h);
        const __half2 o = __hfma2(hh, *reinterpret_cast<const __half2 *>(&t), hh);
        return *reinterpret_cast<const uint32_t *>(&o);
    }
}

// Mode 4: all in f16x2 (scale and shift rounded to f16, v/2 computed by one HFMA2): three instructions a pair.
__device__ __forceinline__ uint32_t norm2h(uint32_t v, uint32_t s, uint32_t b) {
    const __half2 h = __hfma2(*reinterpret_cast<const __half2 *>(&v), *reinterpret_cast<const __half2 *>(&s),
                              *reinterpret_cast<const __half2 *>(&b));
    const uint32_t hu = *reinterpret_cast<const uint32_t *>(&h), t = tanh_h2(hu);
    const __half2 o = __hfma2(h, *reinterpret_cast<const __half2 *>(&t), h);
    return *reinterpret_cast<const uint32_t *>(&o);
}

__device__ __forceinline__ uint32_t hfma2u(uint32_t v, uint32_t s, uint32_t b) {
    const __half2 h = __hfma2(*reinterpret_cast<const __half2 *>(&v), *reinterpret_cast<const __half2 *>(&s),
                              *reinterpret_cast<const __half2 *>(&b));
    return *reinterpret_cast<const uint32_t *>(&h);
}

struct Params {
    const __half *x, *w, *bias, *res; // res may be null
    const float *mean, *rstd;         // per (image, group), 32 groups
    const __half *gamma, *beta;
    __half *y;
    int H, W, Cin, Cout;
};

template <int WGM, int WGN, int WN, int S> constexpr int smem_bytes() {
    return S * (64 * WGM + WN * WGN) * 128 + 1024 + 2 * 640 * 4 + 16 * S; // ring, alignment, table, mbarriers
}

// WGM×WGN warpgroups of 64×WN; S stages; W1: one K tile's wgmmas left in flight (prefetch distance S-2) or none
// (S-1). NORM: 0 none, else the mode above. CBM: K tiles walk the 9 taps of one 64-channel slice before the next
// slice (consecutive tiles re-read the same input lines) instead of all slices of one tap.
template <int WGM, int WGN, int WN, int S, bool W1, int NORM, bool CBM, int TA = 1>
__global__ void __launch_bounds__(128 * WGM * WGN, 1) conv(Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BM = 64 * WGM, BN = WN * WGN, T = 128 * WGM * WGN;
    constexpr int A_BYTES = BM * 128, STAGE = A_BYTES + BN * 128;
    constexpr int D = W1 ? S - 2 : S - 1;
    static_assert(D >= 1 && D >= TA, "prefetch distance");
    static_assert(BM * 8 % T == 0, "A chunks divide among the threads");
    constexpr int A_CH = BM * 8 / T, B_CH = (BN * 8 + T - 1) / T;
    constexpr int PITCH = WN * 2 + 16, CH = WN / 8;
    static_assert(WGM * WGN * 64 * PITCH <= S * STAGE, "staging fits in the ring");
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t base = (raw + 1023) & ~1023u;
    float *tab = reinterpret_cast<float *>(smem_raw + (base - raw) + S * STAGE); // scale[Cin], shift[Cin]
    const int tid = threadIdx.x, wg = tid / 128, wgm = wg % WGM, wgn = wg / WGM;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
    const int H = p.H, W = p.W, Cin = p.Cin, HW = H * W, K = 9 * Cin, CB = Cin / 64, KT = 9 * CB;

    if constexpr (NORM != 0) {
        const int img = m0 / HW, cg = Cin / 32;
        const float half_ = NORM == 1 ? 1.f : 0.5f;
        for (int c = tid; c < Cin; c += T) {
            const int g = img * 32 + c / cg;
            const float sc = p.rstd[g] * __half2float(p.gamma[c]);
            tab[c] = sc * half_;
            tab[Cin + c] = (__half2float(p.beta[c]) - p.mean[g] * sc) * half_;
        }
        __syncthreads();
    }

    // A thread always copies chunk cc (16 bytes) of its rows: offsets worked out once.
    const int cc = tid % 8;
    int a_pix[A_CH], a_y[A_CH], a_x[A_CH];
    uint32_t a_dst[A_CH], b_dst[B_CH];
    int b_src[B_CH];
#pragma unroll
    for (int i = 0; i < A_CH; ++i) {
        const int r = tid / 8 + i * (T / 8), m = m0 + r, rem = m % HW;
        a_pix[i] = m;
        a_y[i] = rem / W;
        a_x[i] = rem % W;
        a_dst[i] = r * 128 + ((cc ^ (r & 7)) << 4);
    }
#pragma unroll
    for (int i = 0; i < B_CH; ++i) {
        const int r = tid / 8 + i * (T / 8);
        b_dst[i] = A_BYTES + r * 128 + ((cc ^ (r & 7)) << 4);
        b_src[i] = (n0 + r) * K + cc * 8;
    }
    auto split = [&](int kt, int &tap, int &cb) {
        if constexpr (CBM) {
            cb = kt / 9;
            tap = kt - 9 * cb;
        } else {
            tap = kt / CB;
            cb = kt - tap * CB;
        }
    };
    // One cp.async group per call, empty past the last tile, so that the group count stays uniform.
    auto load = [&](int kt) {
        if (kt < KT) {
            int tap, cb;
            split(kt, tap, cb);
            const int dy = tap / 3 - 1, dx = tap % 3 - 1;
            const uint32_t st = base + (kt % S) * STAGE;
            const int shift = (dy * W + dx) * Cin + cb * 64 + cc * 8;
#pragma unroll
            for (int i = 0; i < A_CH; ++i) {
                const bool ok = (unsigned)(a_y[i] + dy) < (unsigned)H && (unsigned)(a_x[i] + dx) < (unsigned)W;
                cp16(st + a_dst[i], p.x + (ok ? a_pix[i] * Cin + shift : 0), ok ? 16 : 0);
            }
            const int k0 = tap * Cin + cb * 64;
#pragma unroll
            for (int i = 0; i < B_CH; ++i)
                if (BN * 8 % T == 0 || tid + i * T < BN * 8) cp16(st + b_dst[i], p.w + b_src[i] + k0, 16);
        }
        cp_commit();
    };
    // Normalises in place the A chunks this thread copied for tile kt (its own cp.async data: no barrier).
    auto transform = [&](int kt) {
        if constexpr (NORM != 0) {
            if (kt < KT) {
                int tap, cb;
                split(kt, tap, cb);
                const int dy = tap / 3 - 1, dx = tap % 3 - 1, ch = cb * 64 + cc * 8;
                float sc[8], sh[8];
                *reinterpret_cast<float4 *>(sc) = *reinterpret_cast<const float4 *>(tab + ch);
                *reinterpret_cast<float4 *>(sc + 4) = *reinterpret_cast<const float4 *>(tab + ch + 4);
                *reinterpret_cast<float4 *>(sh) = *reinterpret_cast<const float4 *>(tab + Cin + ch);
                *reinterpret_cast<float4 *>(sh + 4) = *reinterpret_cast<const float4 *>(tab + Cin + ch + 4);
                const uint32_t st = base + (kt % S) * STAGE;
                // All loads first, then the math, then all stores: volatile asm keeps its order, so rows handled
                // one after the other would each wait a full lds -> MUFU -> sts chain. Padded rows are loaded too
                // (zeros) and stored back as zeros.
                uint4 v[A_CH];
#pragma unroll
                for (int i = 0; i < A_CH; ++i) v[i] = lds128(st + a_dst[i]);
                uint32_t s2[4], b2[4];
                if constexpr (NORM == 4 || NORM == 6) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) s2[j] = f2h(sc[2 * j], sc[2 * j + 1]), b2[j] = f2h(sh[2 * j], sh[2 * j + 1]);
                }
#pragma unroll
                for (int i = 0; i < A_CH; ++i) {
                    const bool ok =
                        (unsigned)(a_y[i] + dy) < (unsigned)H && (unsigned)(a_x[i] + dx) < (unsigned)W;
                    uint32_t *u = reinterpret_cast<uint32_t *>(&v[i]);
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        uint32_t o;
                        if constexpr (NORM == 4) o = norm2h(u[j], s2[j], b2[j]);
                        else if constexpr (NORM == 5) o = u[j]; // diagnostics: the round trip alone
                        else if constexpr (NORM == 6) o = hfma2u(u[j], s2[j], b2[j]); // no MUFU
                        else o = norm2<NORM>(u[j], sc[2 * j], sc[2 * j + 1], sh[2 * j], sh[2 * j + 1]);
                        u[j] = ok ? o : 0u;
                    }
                }
#pragma unroll
                for (int i = 0; i < A_CH; ++i) sts128(st + a_dst[i], v[i]);
            }
        }
    };

    float acc[WN / 2];
#pragma unroll
    for (int i = 0; i < WN / 2; ++i) acc[i] = 0.f;

#pragma unroll
    for (int s = 0; s < D; ++s) load(s);
    cp_wait<D - 1>();
    transform(0);
    if constexpr (TA == 2) {
        cp_wait<D - 2>();
        transform(1);
    }
    for (int kt = 0; kt < KT; ++kt) {
        // Rewritten chunks (generic proxy) are read by wgmma (async proxy); the barrier: every thread's part of
        // tile kt is in, and every warpgroup is done with the stage load() refills.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        load(kt + D);
        const uint32_t st = base + (kt % S) * STAGE;
        const uint64_t da = desc_sw128(st + wgm * 64 * 128), db = desc_sw128(st + A_BYTES + wgn * WN * 128);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) Wgmma<WN>::mma(acc, da + 2 * kk, db + 2 * kk);
        wgmma_commit();
        // Tile kt+TA is in (D-TA younger groups may be pending); normalise it while tile kt's wgmmas run. TA 2
        // takes the rewrite's latency off the path from a tile's landing to its wgmma.
        cp_wait<D - TA>();
        transform(kt + TA);
        if constexpr (W1) wgmma_wait<1>();
        else wgmma_wait<0>();
    }
    wgmma_wait<0>();
    fence_regs(acc);
    cp_wait<0>();
    __syncthreads(); // every warpgroup's wgmma reads of the ring are done before the slabs overwrite it

    const int lt = tid % 128, warp = lt / 32, lane = lt % 32, t = lane % 4, r0 = warp * 16 + lane / 4;
    const int row0 = m0 + wgm * 64, col0 = n0 + wgn * WN, Cout = p.Cout;
    const uint32_t slab = base + wg * 64 * PITCH;
    auto wg_bar = [&] {
        switch (wg) { // immediate ids: a register id makes ptxas reserve all 16
        case 0: asm volatile("bar.sync 1, 128;\n" ::: "memory"); break;
        case 1: asm volatile("bar.sync 2, 128;\n" ::: "memory"); break;
        case 2: asm volatile("bar.sync 3, 128;\n" ::: "memory"); break;
        default: asm volatile("bar.sync 4, 128;\n" ::: "memory"); break;
        }
    };
    const bool res = p.res != nullptr;
    if (res) { // the residual is added in f32 before the single rounding, as cuDNN does
#pragma unroll
        for (int q = 0; q < 64 * CH / 128; ++q) {
            const int idx = lt + q * 128, r = idx / CH, c = idx % CH;
            cp16(slab + r * PITCH + c * 16, p.res + (size_t)(row0 + r) * Cout + col0 + c * 8, 16);
        }
        cp_commit();
        cp_wait<0>();
        wg_bar();
    }
#pragma unroll
    for (int j = 0; j < WN / 8; ++j) {
        const int col = 8 * j + 2 * t;
        const float2 b = h2f(*reinterpret_cast<const uint32_t *>(p.bias + col0 + col));
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int i = 4 * j + 2 * hr;
            const uint32_t a = slab + (r0 + 8 * hr) * PITCH + col * 2;
            float o0 = acc[i] + b.x, o1 = acc[i + 1] + b.y;
            if (res) {
                uint32_t v;
                asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(a));
                const float2 rv = h2f(v);
                o0 += rv.x;
                o1 += rv.y;
            }
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(f2h(o0, o1)));
        }
    }
    wg_bar();
#pragma unroll
    for (int q = 0; q < 64 * CH / 128; ++q) {
        const int idx = lt + q * 128, r = idx / CH, c = idx % CH;
        *reinterpret_cast<uint4 *>(p.y + (size_t)(row0 + r) * Cout + col0 + c * 8) = lds128(slab + r * PITCH + c * 16);
    }
#else
    __trap();
#endif
}


#define IG_WGMMA_RS(N, REGS, IA, IB, ...)                                                                         \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                       \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 {" REGS "}, {%" #IA "0, %" #IA "1, %" #IA \
                 "2, %" #IA "3}, %" #IB ", p, 1, 1, 0;\n}\n"                                                      \
                 : __VA_ARGS__                                                                                    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
// D(64×160) += A(64×16, this warpgroup's registers) · B(16×160, shared memory). Operands 80-83 are A ("%8" "0").
__device__ __forceinline__ void wgmma_rs160(float (&d)[80], const uint32_t (&a)[4], uint64_t db) {
    IG_WGMMA_RS(160, IG_R80, 8, 84, IG_ACC80);
}
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// The register-A form: the raw A tile is cp.async'ed as in conv(); each warpgroup loads its own 64 rows with
// ldmatrix straight into wgmma's A fragment layout, normalises the fragments in registers (f16x2, mode 4) and
// issues wgmma with A from registers. No shared-memory rewrite and no proxy fence; a tile's A is read from shared
// memory once (by ldmatrix) as the SS form's wgmma would. Fragments double-buffered: the tile kt-1 wgmmas still
// in flight (W1) read the other set. WGN = 1 only (warpgroups along N would normalise the same rows twice).
template <int WGM, int S, int NM = 4, int NH = 1>
__global__ void __launch_bounds__(128 * WGM, 1) conv_rs(Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    // NH = 2: each warpgroup spans 320 columns as two m64n160 products sharing the A fragments, so a value is
    // normalised once per tap instead of once per tap and 160-column tile.
    constexpr int WN = 160 * NH, BM = 64 * WGM, BN = WN, T = 128 * WGM;
    constexpr int A_BYTES = BM * 128, STAGE = A_BYTES + BN * 128;
    constexpr int D = S - 2; // W1
    static_assert(D >= 1, "prefetch distance");
    constexpr int A_CH = BM * 8 / T, B_CH = (BN * 8 + T - 1) / T;
    constexpr int PITCH = WN * 2 + 16, CH = WN / 8;
    static_assert(WGM * 64 * PITCH <= S * STAGE, "staging fits in the ring");
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t base = (raw + 1023) & ~1023u;
    uint32_t *tabh = reinterpret_cast<uint32_t *>(smem_raw + (base - raw) + S * STAGE); // half2 scale, shift pairs
    const uint32_t tab_s = base + S * STAGE;
    const int tid = threadIdx.x, wg = tid / 128, wgm = wg;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
    const int H = p.H, W = p.W, Cin = p.Cin, HW = H * W, K = 9 * Cin, KT = 9 * (Cin / 64);
    {
        const int img = m0 / HW, cg = Cin / 32;
        for (int c = 2 * tid; c < Cin; c += 2 * T) {
            float sc[2], sh[2];
            for (int k = 0; k < 2; ++k) {
                const int g = img * 32 + (c + k) / cg;
                sc[k] = p.rstd[g] * __half2float(p.gamma[c + k]);
                sh[k] = (__half2float(p.beta[c + k]) - p.mean[g] * sc[k]) * 0.5f;
                sc[k] *= 0.5f;
            }
            tabh[c] = f2h(sc[0], sc[1]);     // pair c/2: scale at 2·(c/2), shift at 2·(c/2)+1
            tabh[c + 1] = f2h(sh[0], sh[1]);
        }
        __syncthreads();
    }
    const int cc = tid % 8;
    int a_pix[A_CH], a_y[A_CH], a_x[A_CH];
    uint32_t a_dst[A_CH], b_dst[B_CH];
    int b_src[B_CH];
#pragma unroll
    for (int i = 0; i < A_CH; ++i) {
        const int r = tid / 8 + i * (T / 8), m = m0 + r, rem = m % HW;
        a_pix[i] = m, a_y[i] = rem / W, a_x[i] = rem % W;
        a_dst[i] = r * 128 + ((cc ^ (r & 7)) << 4);
    }
#pragma unroll
    for (int i = 0; i < B_CH; ++i) {
        const int r = tid / 8 + i * (T / 8);
        b_dst[i] = A_BYTES + r * 128 + ((cc ^ (r & 7)) << 4);
        b_src[i] = (n0 + r) * K + cc * 8;
    }
    // Channel-slice-major K order (cbm1 above).
    auto load = [&](int kt) {
        if (kt < KT) {
            const int cb = kt / 9, tap = kt - 9 * cb, dy = tap / 3 - 1, dx = tap % 3 - 1;
            const uint32_t st = base + (kt % S) * STAGE;
            const int shift = (dy * W + dx) * Cin + cb * 64 + cc * 8;
#pragma unroll
            for (int i = 0; i < A_CH; ++i) {
                const bool ok = (unsigned)(a_y[i] + dy) < (unsigned)H && (unsigned)(a_x[i] + dx) < (unsigned)W;
                cp16(st + a_dst[i], p.x + (ok ? a_pix[i] * Cin + shift : 0), ok ? 16 : 0);
            }
            const int k0 = tap * Cin + cb * 64;
#pragma unroll
            for (int i = 0; i < B_CH; ++i)
                if (BN * 8 % T == 0 || tid + i * T < BN * 8) cp16(st + b_dst[i], p.w + b_src[i] + k0, 16);
        }
        cp_commit();
    };
    // This thread's fragment rows (g and g+8 of its warp's 16) and ldmatrix row.
    const int lt = tid % 128, warp = lt / 32, lane = lt % 32, t = lane % 4, g8 = lane / 4;
    const int wr0 = wgm * 64 + warp * 16;
    int f_y[2], f_x[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int rem = (m0 + wr0 + g8 + 8 * h) % HW;
        f_y[h] = rem / W, f_x[h] = rem % W;
    }
    const int lr = wr0 + (lane & 7) + ((lane >> 3) & 1) * 8, lhi = lane >> 4;
    const uint32_t l_row = lr * 128, l_sw = lr & 7;

    // Loads and normalises tile kt's fragments: f[kk][i], i as wgmma's A registers (rows g, g+8; k 2t, 2t+8).
    auto frag = [&](uint32_t (&f)[4][4], int kt) {
        const int cb = kt / 9, tap = kt - 9 * cb, dy = tap / 3 - 1, dx = tap % 3 - 1;
        const uint32_t st = base + (kt % S) * STAGE;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) ldsm4(f[kk], st + l_row + (((2 * kk + lhi) ^ l_sw) << 4));
        bool ok[2];
#pragma unroll
        for (int h = 0; h < 2; ++h)
            ok[h] = (unsigned)(f_y[h] + dy) < (unsigned)H && (unsigned)(f_x[h] + dx) < (unsigned)W;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
            for (int hi = 0; hi < 2; ++hi) {
                const int pair = (cb * 64 + kk * 16 + 8 * hi + 2 * t) / 2;
                uint32_t s2, b2;
                asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(s2), "=r"(b2) : "r"(tab_s + pair * 8));
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int i = 2 * hi + h;
                    // NM: 4 the norm; diagnostics (wrong results): 0 fragments as loaded, 6 the FMA alone.
                    const uint32_t o = NM == 4 ? norm2h(f[kk][i], s2, b2) : NM == 6 ? hfma2u(f[kk][i], s2, b2) : f[kk][i];
                    f[kk][i] = ok[h] ? o : 0u;
                }
            }
        }
    };

    float acc[NH][80];
#pragma unroll
    for (int h = 0; h < NH; ++h)
#pragma unroll
        for (int i = 0; i < 80; ++i) acc[h][i] = 0.f;
    uint32_t fa[4][4], fb[4][4];

#pragma unroll
    for (int s = 0; s < D; ++s) load(s);
    cp_wait<D - 1>();
    auto step = [&](uint32_t (&f)[4][4], int kt) {
        // Every thread's part of tile kt is in (each thread waited for its own), and the kt-2 wgmmas are done
        // with the stage load() refills.
        __syncthreads();
        load(kt + D);
        frag(f, kt);
        const uint32_t st = base + (kt % S) * STAGE;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int h = 0; h < NH; ++h) wgmma_rs160(acc[h], f[kk], desc_sw128(st + A_BYTES + h * 160 * 128) + 2 * kk);
        wgmma_commit();
        cp_wait<D - 1>();
        wgmma_wait<1>();
    };
    int kt = 0;
    for (; kt + 1 < KT; kt += 2) {
        step(fa, kt);
        step(fb, kt + 1);
    }
    if (kt < KT) step(fa, kt);
    wgmma_wait<0>();
#pragma unroll
    for (int h = 0; h < NH; ++h) fence_regs(acc[h]);
    cp_wait<0>();
    __syncthreads();

    const int r0 = warp * 16 + lane / 4;
    const int row0 = m0 + wgm * 64, col0 = n0, Cout = p.Cout;
    const uint32_t slab = base + wg * 64 * PITCH;
    auto wg_bar = [&] {
        switch (wg) {
        case 0: asm volatile("bar.sync 1, 128;\n" ::: "memory"); break;
        case 1: asm volatile("bar.sync 2, 128;\n" ::: "memory"); break;
        case 2: asm volatile("bar.sync 3, 128;\n" ::: "memory"); break;
        default: asm volatile("bar.sync 4, 128;\n" ::: "memory"); break;
        }
    };
    const bool res = p.res != nullptr;
    if (res) {
#pragma unroll
        for (int q = 0; q < 64 * CH / 128; ++q) {
            const int idx = lt + q * 128, r = idx / CH, c = idx % CH;
            cp16(slab + r * PITCH + c * 16, p.res + (size_t)(row0 + r) * Cout + col0 + c * 8, 16);
        }
        cp_commit();
        cp_wait<0>();
        wg_bar();
    }
#pragma unroll
    for (int j = 0; j < WN / 8; ++j) {
        const int col = 8 * j + 2 * t, h = j / 20, jj = j % 20;
        const float2 b = h2f(*reinterpret_cast<const uint32_t *>(p.bias + col0 + col));
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int i = 4 * jj + 2 * hr;
            const uint32_t a = slab + (r0 + 8 * hr) * PITCH + col * 2;
            float o0 = acc[h][i] + b.x, o1 = acc[h][i + 1] + b.y;
            if (res) {
                uint32_t v;
                asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(a));
                const float2 rv = h2f(v);
                o0 += rv.x;
                o1 += rv.y;
            }
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(f2h(o0, o1)));
        }
    }
    wg_bar();
#pragma unroll
    for (int q = 0; q < 64 * CH / 128; ++q) {
        const int idx = lt + q * 128, r = idx / CH, c = idx % CH;
        *reinterpret_cast<uint4 *>(p.y + (size_t)(row0 + r) * Cout + col0 + c * 8) = lds128(slab + r * PITCH + c * 16);
    }
#else
    __trap();
#endif
}


__device__ __forceinline__ void mbar_init(uint32_t a, int n) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t a) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(a) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t a, uint32_t parity) {
    asm volatile("{\n.reg .pred P1;\nLAB_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(a),
                 "r"(parity)
                 : "memory");
}

// Warp-specialised form: WGM consumer warpgroups (64×160 each, SS wgmma) and NP producer warpgroups that
// cp.asyncs both tiles, waits for its own copies, normalises A in place (NORM 4, or nothing with 0), fences and
// arrives on the stage's "full" mbarrier; consumers arrive on "empty" once a stage's wgmmas are done. The rewrite
// then runs beside the tensor cores instead of between a tile's landing and its wgmma. Prefetch P = S-2 tiles (a
// stage is released one tile after its wgmma is issued).
template <int WGM, int NP, int S, int NORM>
__global__ void __launch_bounds__(128 * (WGM + NP), 1) conv_ws(Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int WN = 160, BM = 64 * WGM, BN = WN, T = 128 * (WGM + NP), PT = 128 * NP;
    constexpr int A_BYTES = BM * 128, STAGE = A_BYTES + BN * 128;
    constexpr int P = S - 2;
    static_assert(P >= 1, "prefetch distance");
    constexpr int A_CH = BM * 8 / PT, B_CH = BN * 8 / PT;
    constexpr int PITCH = WN * 2 + 16, CH = WN / 8;
    static_assert(WGM * 64 * PITCH <= S * STAGE, "staging fits in the ring");
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t base = (raw + 1023) & ~1023u;
    float *tab = reinterpret_cast<float *>(smem_raw + (base - raw) + S * STAGE);
    const uint32_t bars = base + S * STAGE + 2 * 640 * 4; // full[S], empty[S]
    const int tid = threadIdx.x, wg = tid / 128;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
    const int H = p.H, W = p.W, Cin = p.Cin, HW = H * W, K = 9 * Cin, KT = 9 * (Cin / 64);
    if constexpr (NORM != 0) {
        const int img = m0 / HW, cg = Cin / 32;
        for (int c = tid; c < Cin; c += T) {
            const int g = img * 32 + c / cg;
            const float sc = p.rstd[g] * __half2float(p.gamma[c]);
            tab[c] = sc * 0.5f;
            tab[Cin + c] = (__half2float(p.beta[c]) - p.mean[g] * sc) * 0.5f;
        }
    }
    if (tid == 0) {
        for (int s = 0; s < S; ++s) mbar_init(bars + 8 * s, PT), mbar_init(bars + 8 * (S + s), 128 * WGM);
    }
    __syncthreads();

    if (wg >= WGM) { // producer (NP warpgroups)
        const int pt = tid - 128 * WGM, cc = pt % 8;
        int a_pix[A_CH], a_y[A_CH], a_x[A_CH];
        uint32_t a_dst[A_CH], b_dst[B_CH];
        int b_src[B_CH];
#pragma unroll
        for (int i = 0; i < A_CH; ++i) {
            const int r = pt / 8 + i * (PT / 8), m = m0 + r, rem = m % HW;
            a_pix[i] = m, a_y[i] = rem / W, a_x[i] = rem % W;
            a_dst[i] = r * 128 + ((cc ^ (r & 7)) << 4);
        }
#pragma unroll
        for (int i = 0; i < B_CH; ++i) {
            const int r = pt / 8 + i * (PT / 8);
            b_dst[i] = A_BYTES + r * 128 + ((cc ^ (r & 7)) << 4);
            b_src[i] = (n0 + r) * K + cc * 8;
        }
        auto issue = [&](int j) {
            if (j < KT) {
                if (j >= S) mbar_wait(bars + 8 * (S + j % S), ((j / S) + 1) & 1);
                const int cb = j / 9, tap = j - 9 * cb, dy = tap / 3 - 1, dx = tap % 3 - 1;
                const uint32_t st = base + (j % S) * STAGE;
                const int shift = (dy * W + dx) * Cin + cb * 64 + cc * 8;
#pragma unroll
                for (int i = 0; i < A_CH; ++i) {
                    const bool ok = (unsigned)(a_y[i] + dy) < (unsigned)H && (unsigned)(a_x[i] + dx) < (unsigned)W;
                    cp16(st + a_dst[i], p.x + (ok ? a_pix[i] * Cin + shift : 0), ok ? 16 : 0);
                }
                const int k0 = tap * Cin + cb * 64;
#pragma unroll
                for (int i = 0; i < B_CH; ++i) cp16(st + b_dst[i], p.w + b_src[i] + k0, 16);
            }
            cp_commit();
        };
#pragma unroll
        for (int j = 0; j < P; ++j) issue(j);
        for (int kt = 0; kt < KT; ++kt) {
            issue(kt + P);
            cp_wait<P>();
            if constexpr (NORM != 0) {
                const int cb = kt / 9, tap = kt - 9 * cb, dy = tap / 3 - 1, dx = tap % 3 - 1, ch = cb * 64 + cc * 8;
                uint32_t s2[4], b2[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float2 sv = *reinterpret_cast<const float2 *>(tab + ch + 2 * j);
                    const float2 bv = *reinterpret_cast<const float2 *>(tab + Cin + ch + 2 * j);
                    s2[j] = f2h(sv.x, sv.y), b2[j] = f2h(bv.x, bv.y);
                }
                const uint32_t st = base + (kt % S) * STAGE;
                uint4 v[A_CH];
#pragma unroll
                for (int i = 0; i < A_CH; ++i) v[i] = lds128(st + a_dst[i]);
#pragma unroll
                for (int i = 0; i < A_CH; ++i) {
                    const bool ok = (unsigned)(a_y[i] + dy) < (unsigned)H && (unsigned)(a_x[i] + dx) < (unsigned)W;
                    uint32_t *u = reinterpret_cast<uint32_t *>(&v[i]);
#pragma unroll
                    for (int j = 0; j < 4; ++j) u[j] = ok ? norm2h(u[j], s2[j], b2[j]) : 0u;
                }
#pragma unroll
                for (int i = 0; i < A_CH; ++i) sts128(st + a_dst[i], v[i]);
            }
            // Own copies landed (and rewritten): visible to the consumers' wgmma (async proxy) once all arrive.
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            mbar_arrive(bars + 8 * (kt % S));
        }
        cp_wait<0>();
        __syncthreads();
        return;
    }

    // consumers
    float acc[WN / 2];
#pragma unroll
    for (int i = 0; i < WN / 2; ++i) acc[i] = 0.f;
    for (int kt = 0; kt < KT; ++kt) {
        mbar_wait(bars + 8 * (kt % S), (kt / S) & 1);
        const uint32_t st = base + (kt % S) * STAGE;
        const uint64_t da = desc_sw128(st + wg * 64 * 128), db = desc_sw128(st + A_BYTES);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) Wgmma<WN>::mma(acc, da + 2 * kk, db + 2 * kk);
        wgmma_commit();
        wgmma_wait<1>();
        if (kt >= 1) mbar_arrive(bars + 8 * (S + (kt - 1) % S));
    }
    wgmma_wait<0>();
    fence_regs(acc);
    __syncthreads();

    const int lt = tid % 128, warp = lt / 32, lane = lt % 32, t = lane % 4, r0 = warp * 16 + lane / 4;
    const int row0 = m0 + wg * 64, col0 = n0, Cout = p.Cout;
    const uint32_t slab = base + wg * 64 * PITCH;
    auto wg_bar = [&] {
        if (wg == 0) asm volatile("bar.sync 1, 128;\n" ::: "memory");
        else asm volatile("bar.sync 2, 128;\n" ::: "memory");
    };
    const bool res = p.res != nullptr;
    if (res) {
#pragma unroll
        for (int q = 0; q < 64 * CH / 128; ++q) {
            const int idx = lt + q * 128, r = idx / CH, c = idx % CH;
            cp16(slab + r * PITCH + c * 16, p.res + (size_t)(row0 + r) * Cout + col0 + c * 8, 16);
        }
        cp_commit();
        cp_wait<0>();
        wg_bar();
    }
#pragma unroll
    for (int j = 0; j < WN / 8; ++j) {
        const int col = 8 * j + 2 * t;
        const float2 b = h2f(*reinterpret_cast<const uint32_t *>(p.bias + col0 + col));
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int i = 4 * j + 2 * hr;
            const uint32_t a = slab + (r0 + 8 * hr) * PITCH + col * 2;
            float o0 = acc[i] + b.x, o1 = acc[i + 1] + b.y;
            if (res) {
                uint32_t v;
                asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(a));
                const float2 rv = h2f(v);
                o0 += rv.x;
                o1 += rv.y;
            }
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(f2h(o0, o1)));
        }
    }
    wg_bar();
#pragma unroll
    for (int q = 0; q < 64 * CH / 128; ++q) {
        const int idx = lt + q * 128, r = idx / CH, c = idx % CH;
        *reinterpret_cast<uint4 *>(p.y + (size_t)(row0 + r) * Cout + col0 + c * 8) = lds128(slab + r * PITCH + c * 16);
    }
#else
    __trap();
#endif
}


// Halo form: WGM warpgroups per block, 64·WGM output pixels (whole image rows, W | 64·WGM) × 160·NH columns;
// each warpgroup its own 64 pixels, all of them sharing the B tile. For each
// 64-channel slice the block cp.asyncs the input rows it needs, with one zero pixel either side and zero rows past
// the image, into a "halo" buffer and normalises it in place once; the 9 taps then read shifted windows of it with
// ldmatrix (any row address per lane, so a shift is an address) into wgmma's register-A fragments. A value is
// normalised (64/W + 2)/(64/W) times per column tile instead of 9 times. Three halo buffers: slice c's halo is
// requested with the second tile of slice c-1 and normalised in eight portions during slice c-1's taps (beside the
// wgmmas in flight, not in one serial burst); B streams through an S-stage ring as in conv(). A tile's fragments
// are loaded after the previous tile's wgmmas are issued (the halo is already visible), not after a barrier.
template <int S, int NH, bool NORM, int WGM = 1>
__global__ void __launch_bounds__(128 * WGM, 1) conv_halo(Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int WN = 160 * NH, BN = WN, BM = 64 * WGM, T = 128 * WGM, STAGE = BN * 128, NHB = 3;
    constexpr int HALO = (WGM == 1 ? 198 : 264) * 128 + 512; // ≤ (BM/64 + 2) rows × 66 px
    constexpr int D = S - 2;
    static_assert(D >= 1, "prefetch distance");
    constexpr int B_CH = BN * 8 / T, PITCH = WN * 2 + 16, CH = WN / 8;
    static_assert(BM * PITCH <= S * STAGE, "staging fits in the ring");
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t base = (raw + 1023) & ~1023u, halo0 = base + S * STAGE;
    float *tab = reinterpret_cast<float *>(smem_raw + (base - raw) + S * STAGE + NHB * HALO);
    const int tid = threadIdx.x;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
    const int H = p.H, W = p.W, Cin = p.Cin, HW = H * W, K = 9 * Cin, KT = 9 * (Cin / 64);
    const int img = m0 / HW, y0 = m0 % HW / W, R = BM / W, PW = W + 2, HP = (R + 2) * PW;
    if constexpr (NORM) {
        const int cg = Cin / 32;
        for (int c = tid; c < Cin; c += T) {
            const int g = img * 32 + c / cg;
            const float sc = p.rstd[g] * __half2float(p.gamma[c]);
            tab[c] = sc * 0.5f;
            tab[Cin + c] = (__half2float(p.beta[c]) - p.mean[g] * sc) * 0.5f;
        }
        __syncthreads();
    }
    const int cc = tid % 8;
    uint32_t b_dst[B_CH];
    int b_src[B_CH];
#pragma unroll
    for (int i = 0; i < B_CH; ++i) {
        const int r = tid / 8 + i * (T / 8);
        b_dst[i] = r * 128 + ((cc ^ (r & 7)) << 4);
        b_src[i] = (n0 + r) * K + cc * 8;
    }
    auto halo_at = [&](int hp, int c) { return (uint32_t)(hp * 128 + ((c ^ (hp & 7)) << 4)); };
    // Halo pixel hp (row hr of R+2, column px of W+2) of slice cb; chunk cc of every 8th pixel is this thread's.
    auto halo_load = [&](int cb) {
        const uint32_t hb = halo0 + (cb % NHB) * HALO;
        for (int hp = tid / 8; hp < HP; hp += T / 8) {
            const int hr = hp / PW, px = hp % PW, iy = y0 - 1 + hr, ix = px - 1;
            const bool ok = (unsigned)iy < (unsigned)H && (unsigned)ix < (unsigned)W;
            cp16(hb + halo_at(hp, cc), p.x + (ok ? ((size_t)(img * H + iy) * W + ix) * Cin + cb * 64 + cc * 8 : 0),
                 ok ? 16 : 0);
        }
    };
    // Portion q (of 8; -1: all) of slice cb's halo: this thread's pixels tid/8 + 16·m, m in [2q, 2q+1].
    auto halo_norm = [&](int cb, int q) {
        if constexpr (NORM) {
            const uint32_t hb = halo0 + (cb % NHB) * HALO;
            const int ch = cb * 64 + cc * 8;
            uint32_t s2[4], b2[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 sv = *reinterpret_cast<const float2 *>(tab + ch + 2 * j);
                const float2 bv = *reinterpret_cast<const float2 *>(tab + Cin + ch + 2 * j);
                s2[j] = f2h(sv.x, sv.y), b2[j] = f2h(bv.x, bv.y);
            }
            const int first = q < 0 ? tid / 8 : tid / 8 + 2 * q * (T / 8), last = q < 0 ? HP : min(HP, first + 2 * (T / 8));
            for (int hp0 = first; hp0 < last; hp0 += 2 * (T / 8)) { // two at a time: more loads in flight
                uint4 v[2];
                bool ok[2];
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    const int hp = min(hp0 + u * (T / 8), HP - 1);
                    const int hr = hp / PW, px = hp % PW, iy = y0 - 1 + hr, ix = px - 1;
                    ok[u] = hp0 + u * (T / 8) < HP && (unsigned)iy < (unsigned)H && (unsigned)ix < (unsigned)W;
                    v[u] = lds128(hb + halo_at(hp, cc));
                }
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    uint32_t *w = reinterpret_cast<uint32_t *>(&v[u]);
#pragma unroll
                    for (int j = 0; j < 4; ++j) w[j] = norm2h(w[j], s2[j], b2[j]);
                    if (ok[u]) sts128(hb + halo_at(hp0 + u * (T / 8), cc), v[u]);
                }
            }
        }
    };
    // Tile kt = (slice cb, tap): B tile into the ring; the halo of slice cb rides with its first tap's group.
    auto load = [&](int kt) {
        if (kt < KT) {
            const int cb = kt / 9, tap = kt - 9 * cb;
            if (kt == 0) halo_load(0);
            if (tap == 1 && cb + 1 < KT / 9) halo_load(cb + 1);
            const uint32_t st = base + (kt % S) * STAGE;
            const int k0 = tap * Cin + cb * 64;
#pragma unroll
            for (int i = 0; i < B_CH; ++i) cp16(st + b_dst[i], p.w + b_src[i] + k0, 16);
        }
        cp_commit();
    };
    const int wg = tid / 128, warp = tid % 128 / 32, lane = tid % 32, t = lane % 4;
    const int lr = wg * 64 + warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, lhi = lane >> 4;
    const int l_hp = (lr / W + 1) * PW + lr % W + 1; // this lane's ldmatrix pixel at tap (0, 0)
    auto frag = [&](uint32_t (&f)[4][4], int kt) {
        const int cb = kt / 9, tap = kt - 9 * cb, dy = tap / 3 - 1, dx = tap % 3 - 1;
        const int hp = l_hp + dy * PW + dx;
        const uint32_t a = halo0 + (cb % NHB) * HALO + hp * 128, sw = hp & 7;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) ldsm4(f[kk], a + (((2 * kk + lhi) ^ sw) << 4));
    };

    float acc[NH][80];
#pragma unroll
    for (int h = 0; h < NH; ++h)
#pragma unroll
        for (int i = 0; i < 80; ++i) acc[h][i] = 0.f;
    uint32_t fa[4][4], fb[4][4];
#pragma unroll
    for (int s = 0; s < D; ++s) load(s);
    cp_wait<D - 1>();
    halo_norm(0, -1);
    __syncthreads();
    frag(fa, 0);
    // f: tile kt's fragments (loaded last iteration); g: the other set, free once tile kt-1's wgmmas are done.
    auto step = [&](uint32_t (&f)[4][4], uint32_t (&g)[4][4], int kt) {
        // B (cp.async, generic proxy) is read by wgmma (async proxy); every thread's copies and halo rewrites are
        // in; the kt-2 wgmmas are done with the stage load() refills.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        load(kt + D);
        const uint32_t st = base + (kt % S) * STAGE;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int h = 0; h < NH; ++h) wgmma_rs160(acc[h], f[kk], desc_sw128(st + h * 160 * 128) + 2 * kk);
        wgmma_commit();
        cp_wait<D - 1>(); // tile kt+1's group (and a halo riding with it) has landed
        const int q = kt % 9;
        if (q < 8 && kt / 9 + 1 < KT / 9) halo_norm(kt / 9 + 1, q);
        wgmma_wait<1>();
        // Tile kt+1 reads a halo made visible by this iteration's barrier at the latest (its last portion ran an
        // iteration earlier).
        if (kt + 1 < KT) frag(g, kt + 1);
    };
    int kt = 0;
    for (; kt + 1 < KT; kt += 2) {
        step(fa, fb, kt);
        step(fb, fa, kt + 1);
    }
    if (kt < KT) step(fa, fb, kt);
    wgmma_wait<0>();
#pragma unroll
    for (int h = 0; h < NH; ++h) fence_regs(acc[h]);
    cp_wait<0>();
    __syncthreads();

    const int r0 = warp * 16 + lane / 4, row0 = m0 + wg * 64, col0 = n0, Cout = p.Cout, lt = tid % 128;
    const uint32_t slab = base + wg * 64 * PITCH;
    const bool res = p.res != nullptr;
    if (res) {
#pragma unroll
        for (int q = 0; q < 64 * CH / 128; ++q) {
            const int idx = lt + q * 128, r = idx / CH, c = idx % CH;
            cp16(slab + r * PITCH + c * 16, p.res + (size_t)(row0 + r) * Cout + col0 + c * 8, 16);
        }
        cp_commit();
        cp_wait<0>();
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < WN / 8; ++j) {
        const int col = 8 * j + 2 * t, h = j / 20, jj = j % 20;
        const float2 b = h2f(*reinterpret_cast<const uint32_t *>(p.bias + col0 + col));
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int i = 4 * jj + 2 * hr;
            const uint32_t a = slab + (r0 + 8 * hr) * PITCH + col * 2;
            float o0 = acc[h][i] + b.x, o1 = acc[h][i + 1] + b.y;
            if (res) {
                uint32_t v;
                asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(a));
                const float2 rv = h2f(v);
                o0 += rv.x;
                o1 += rv.y;
            }
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(f2h(o0, o1)));
        }
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < 64 * CH / 128; ++q) {
        const int idx = lt + q * 128, r = idx / CH, c = idx % CH;
        *reinterpret_cast<uint4 *>(p.y + (size_t)(row0 + r) * Cout + col0 + c * 8) = lds128(slab + r * PITCH + c * 16);
    }
#else
    __trap();
#endif
}
template <int S, int NH, int WGM = 1> constexpr int halo_smem() {
    return S * 160 * NH * 128 + 1024 + 3 * ((WGM == 1 ? 198 : 264) * 128 + 512) + 2 * 640 * 4;
}

} // namespace igemm

// Per (image, group) mean and rstd, two passes in f32 (the reference the fused kernel and the apply pass share).
__global__ void gn_stats(const __half *x, float *mean, float *rstd, int HW, int C, float eps) {
    const int img = blockIdx.x / 32, g = blockIdx.x % 32, cg = C / 32;
    const __half *base = x + (size_t)img * HW * C + g * cg;
    __shared__ float red[32];
    __shared__ float mu;
    auto block_sum = [&](float v) {
        for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
        if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
        __syncthreads();
        float s = 0.f;
        if (threadIdx.x < 32) {
            s = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0.f;
            for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(~0u, s, o);
        }
        __syncthreads();
        return s;
    };
    const int n = HW * cg;
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += __half2float(base[(size_t)(i / cg) * C + i % cg]);
    s = block_sum(s);
    if (threadIdx.x == 0) mu = s / n;
    __syncthreads();
    const float m = mu;
    float q = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float d = __half2float(base[(size_t)(i / cg) * C + i % cg]) - m;
        q += d * d;
    }
    q = block_sum(q);
    if (threadIdx.x == 0) {
        mean[blockIdx.x] = m;
        rstd[blockIdx.x] = rsqrtf(q / n + eps);
    }
}

// The engine's second GroupNorm launch, as the baseline: y = silu((x - mean)·rstd·gamma + beta), f16 out, 16 bytes
// a thread.
__global__ void gn_apply(const uint4 *x, uint4 *y, const float *mean, const float *rstd, const __half *gamma,
                         const __half *beta, long long chunks, int HW, int C) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= chunks) return;
    const int c8 = C / 8, c = (int)(i % c8) * 8, img = (int)(i / ((long long)HW * c8));
    // 8 channels may straddle two groups (10 channels a group at C = 320).
    const int cg = C / 32, g0 = img * 32 + c / cg, split = (c / cg + 1) * cg - c;
    const float mu0 = mean[g0], rs0 = rstd[g0], mu1 = split < 8 ? mean[g0 + 1] : mu0, rs1 = split < 8 ? rstd[g0 + 1] : rs0;
    uint4 v = x[i];
    uint32_t *w = reinterpret_cast<uint32_t *>(&v);
    const uint4 gv = *reinterpret_cast<const uint4 *>(gamma + c), bv = *reinterpret_cast<const uint4 *>(beta + c);
    const uint32_t *gw = reinterpret_cast<const uint32_t *>(&gv), *bw = reinterpret_cast<const uint32_t *>(&bv);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 xf = igemm::h2f(w[k]), gf = igemm::h2f(gw[k]), bf = igemm::h2f(bw[k]);
        const bool s0 = 2 * k < split, s1 = 2 * k + 1 < split;
        const float a = (xf.x - (s0 ? mu0 : mu1)) * (s0 ? rs0 : rs1) * gf.x + bf.x;
        const float b = (xf.y - (s1 ? mu0 : mu1)) * (s1 ? rs0 : rs1) * gf.y + bf.y;
        w[k] = igemm::f2h(a / (1.f + expf(-a)), b / (1.f + expf(-b)));
    }
    y[i] = v;
}


using Kern = void (*)(igemm::Params);
struct Cfg {
    const char *name;
    int bm, bn, threads, smem, norm;
    Kern k;
};
#define CFGT(WGM, WGN, WN, S, W1, NORM, CBM, TA)                                                               \
    Cfg {                                                                                                        \
        #WGM "x" #WGN "wg n" #WN " s" #S " w" #W1 " norm" #NORM " cbm" #CBM " ta" #TA, 64 * WGM, WN * WGN,     \
            128 * WGM * WGN, igemm::smem_bytes<WGM, WGN, WN, S>(), NORM,                                         \
            igemm::conv<WGM, WGN, WN, S, W1, NORM, CBM, TA>                                                      \
    }
#define CFG(WGM, WGN, WN, S, W1, NORM, CBM) CFGT(WGM, WGN, WN, S, W1, NORM, CBM, 1)
// Each tiling without the norm and with the cheapest norm mode; the other modes on the likeliest tilings.
#define TILING(WGM, WGN, WN, S, W1) CFG(WGM, WGN, WN, S, W1, 0, 0), CFG(WGM, WGN, WN, S, W1, 3, 0)
static Cfg cfgs[] = {
    // 128x160: Cout 320 in two column tiles, 640 in four.
    TILING(2, 1, 160, 4, 1),
    CFG(2, 1, 160, 4, 1, 0, 1),
    CFG(2, 1, 160, 5, 1, 0, 0),
    CFG(2, 1, 160, 4, 0, 0, 0),
    CFG(2, 1, 160, 4, 1, 1, 0),
    CFG(2, 1, 160, 4, 1, 2, 0),
    CFG(2, 1, 160, 4, 1, 4, 0),
    CFG(2, 1, 160, 4, 1, 4, 1),
    // 64x320: each input value normalised once per tap (no second column tile) on 256 threads.
    TILING(1, 2, 160, 4, 1),
    CFG(1, 2, 160, 4, 1, 0, 1),
    CFG(1, 2, 160, 4, 1, 2, 0),
    CFG(1, 2, 160, 4, 1, 4, 0),
    CFG(1, 2, 160, 4, 1, 4, 1),
    CFG(1, 2, 160, 4, 0, 4, 1),
    // The rewrite two tiles ahead.
    CFGT(1, 2, 160, 4, 0, 4, 1, 2),
    CFGT(2, 1, 160, 4, 0, 4, 1, 2),
    CFGT(2, 1, 160, 5, 1, 4, 1, 2),
    CFGT(2, 1, 160, 6, 0, 4, 1, 2),
    CFGT(1, 1, 160, 5, 1, 4, 1, 2),
    CFGT(1, 1, 160, 6, 0, 4, 1, 2),
    CFGT(1, 1, 160, 6, 0, 2, 1, 2),
    CFG(1, 1, 160, 5, 1, 0, 1),
    CFG(1, 1, 160, 6, 0, 0, 1),
    // The register-A form (mode 4, K order cbm1, W1).
    Cfg{"rs 2x1wg n160 s4 norm4", 128, 160, 256, igemm::smem_bytes<2, 1, 160, 4>(), 4, igemm::conv_rs<2, 4>},
    Cfg{"rs 2x1wg n160 s5 norm4", 128, 160, 256, igemm::smem_bytes<2, 1, 160, 5>(), 4, igemm::conv_rs<2, 5>},
    Cfg{"rs 1x1wg n160 s5 norm4", 64, 160, 128, igemm::smem_bytes<1, 1, 160, 5>(), 4, igemm::conv_rs<1, 5>},
    Cfg{"rs 1x1wg n160 s6 norm4", 64, 160, 128, igemm::smem_bytes<1, 1, 160, 6>(), 4, igemm::conv_rs<1, 6>},
    Cfg{"rs 1x1wg n320 s3 norm4", 64, 320, 128, igemm::smem_bytes<1, 1, 320, 3>(), 4, igemm::conv_rs<1, 3, 4, 2>},
    Cfg{"rs 1x1wg n320 s4 norm4", 64, 320, 128, igemm::smem_bytes<1, 1, 320, 4>(), 4, igemm::conv_rs<1, 4, 4, 2>},
    Cfg{"rs 1x1wg n320 s4 no norm (diag)", 64, 320, 128, igemm::smem_bytes<1, 1, 320, 4>(), 4, igemm::conv_rs<1, 4, 0, 2>},
#define HALO(S, NH, NORM)                                                                                        \
    Cfg {                                                                                                        \
        "halo 1wg n" #NH "x160 s" #S " norm" #NORM, 64, 160 * NH, 128, igemm::halo_smem<S, NH>(), NORM ? 4 : 0,  \
            igemm::conv_halo<S, NH, NORM>                                                                        \
    }
    HALO(3, 2, 0), HALO(3, 2, 1), HALO(4, 1, 0), HALO(4, 1, 1), HALO(6, 1, 1),
#define HALO2(S, NORM)                                                                                           \
    Cfg {                                                                                                        \
        "halo 2wg n160 s" #S " norm" #NORM, 128, 160, 256, igemm::halo_smem<S, 1, 2>(), NORM ? 4 : 0,           \
            igemm::conv_halo<S, 1, NORM, 2>                                                                      \
    }
    HALO2(3, 0), HALO2(4, 0), HALO2(5, 0), HALO2(3, 1), HALO2(4, 1), HALO2(5, 1),
    Cfg{"rs 2x1wg n160 s4 diag: no math", 128, 160, 256, igemm::smem_bytes<2, 1, 160, 4>(), 4, igemm::conv_rs<2, 4, 0>},
    Cfg{"rs 2x1wg n160 s4 diag: FMA only", 128, 160, 256, igemm::smem_bytes<2, 1, 160, 4>(), 4, igemm::conv_rs<2, 4, 6>},
    Cfg{"rs 1x1wg n160 s5 diag: no math", 64, 160, 128, igemm::smem_bytes<1, 1, 160, 5>(), 4, igemm::conv_rs<1, 5, 0>},
    Cfg{"rs 1x1wg n160 s5 diag: FMA only", 64, 160, 128, igemm::smem_bytes<1, 1, 160, 5>(), 4, igemm::conv_rs<1, 5, 6>},
    // Warp-specialised: a producer warpgroup loads and normalises, consumers only issue wgmma.
#define WS(WGM, NP, S, NORM)                                                                                     \
    Cfg {                                                                                                        \
        "ws " #WGM "+" #NP "wg n160 s" #S " norm" #NORM, 64 * WGM, 160, 128 * (WGM + NP),                       \
            igemm::smem_bytes<WGM, 1, 160, S>(), NORM, igemm::conv_ws<WGM, NP, S, NORM>                          \
    }
    WS(2, 1, 6, 0), WS(2, 1, 6, 4), WS(2, 2, 4, 0), WS(2, 2, 6, 0), WS(2, 2, 4, 4), WS(2, 2, 6, 4),
    WS(1, 1, 6, 0), WS(1, 1, 6, 4), WS(1, 2, 6, 0), WS(1, 2, 6, 4), WS(1, 2, 7, 4),
    // Diagnostics (wrong results by design): the in-place round trip without math (5), the FMA without SiLU (6).
    CFG(1, 2, 160, 4, 0, 5, 1),
    CFG(1, 2, 160, 4, 0, 6, 1),
    CFG(2, 1, 160, 4, 1, 5, 1),
    CFG(2, 1, 160, 4, 1, 6, 1),
    // 128x320 (4 warpgroups): only 64 blocks at M = 8192.
    TILING(2, 2, 160, 3, 1),
    // 64x160: twice the blocks, for the 32x32 maps (M = 2048).
    TILING(1, 1, 160, 5, 1),
    CFG(1, 1, 160, 5, 1, 4, 0),
    CFG(1, 1, 160, 5, 1, 4, 1),
    // 128x128 and 128x80: for Cout 640 only.
    TILING(2, 1, 128, 4, 1),
    TILING(2, 1, 80, 5, 1),
    CFG(2, 1, 80, 5, 1, 4, 1),
};

static double half_max_err(const std::vector<__half> &a, const std::vector<__half> &ref, double *refmax) {
    double e = 0, m = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        const double r = __half2float(ref[i]), v = __half2float(a[i]);
        e = std::max(e, std::isfinite(v) ? fabs(v - r) : 1e30);
        m = std::max(m, fabs(r));
    }
    *refmax = m;
    return e;
}

int main(int argc, char **argv) {
    const char *pick = argc > 1 ? argv[1] : "ABC";
    const char *soak = argc > 2 ? argv[2] : nullptr; // a config name part: run it for a while (clock sampling)
    struct Shape { char id; const char *what; int n, hw, cin, cout; bool res; } shapes[] = {
        {'A', "A 64x64 320>320 +res", 2, 64, 320, 320, true},
        {'a', "a 64x64 320>320 (no res)", 2, 64, 320, 320, false},
        {'B', "B 32x32 640>640 +res", 2, 32, 640, 640, true},
        {'C', "C 64x64 640>320", 2, 64, 640, 320, false},
    };
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device %s, %d SMs, cuDNN %zu\n", prop.name, prop.multiProcessorCount, cudnnGetVersion());
    for (auto &c : cfgs) CK(cudaFuncSetAttribute(c.k, cudaFuncAttributeMaxDynamicSharedMemorySize, c.smem));
    Timer tm;
    CK(cudaStreamCreateWithFlags(&tm.s, cudaStreamNonBlocking));
    CK(cudaEventCreate(&tm.e0));
    CK(cudaEventCreate(&tm.e1));
    cudnnHandle_t dn;
    CD(cudnnCreate(&dn));
    CD(cudnnSetStream(dn, tm.s));

    for (auto &s : shapes) {
        if (!strchr(pick, s.id)) continue;
        const int M = s.n * s.hw * s.hw, HW = s.hw * s.hw, K = 9 * s.cin;
        uint64_t seed = 0x1234567ull + s.id;
        // Input with per-channel offsets and spreads, so the norm is far from the identity.
        std::vector<__half> hx((size_t)M * s.cin), hw((size_t)s.cout * K), hb(s.cout), hr((size_t)M * s.cout),
            hg(s.cin), hbe(s.cin);
        std::vector<float> coff(s.cin), cscale(s.cin);
        for (int c = 0; c < s.cin; ++c) coff[c] = 0.5f * frand(seed), cscale[c] = 1.5f + frand(seed);
        for (size_t i = 0; i < hx.size(); ++i) hx[i] = __float2half(coff[i % s.cin] + cscale[i % s.cin] * frand(seed));
        const float ws = 1.7f / sqrtf((float)K);
        for (auto &v : hw) v = __float2half(ws * frand(seed));
        for (auto &v : hb) v = __float2half(0.1f * frand(seed));
        for (auto &v : hr) v = __float2half(frand(seed));
        for (auto &v : hg) v = __float2half(1.f + 0.3f * frand(seed));
        for (auto &v : hbe) v = __float2half(0.3f * frand(seed));
        __half *x, *w, *b, *r, *g, *be, *xn, *y_ref, *y_ref_n, *y;
        float *mean, *rstd;
        auto up = [](__half **d, const std::vector<__half> &h) {
            CK(cudaMalloc(d, h.size() * 2));
            CK(cudaMemcpy(*d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
        };
        up(&x, hx), up(&w, hw), up(&b, hb), up(&r, hr), up(&g, hg), up(&be, hbe);
        const size_t out_n = (size_t)M * s.cout;
        CK(cudaMalloc(&xn, hx.size() * 2));
        CK(cudaMalloc(&y_ref, out_n * 2));
        CK(cudaMalloc(&y_ref_n, out_n * 2));
        CK(cudaMalloc(&y, out_n * 2));
        CK(cudaMalloc(&mean, s.n * 32 * 4));
        CK(cudaMalloc(&rstd, s.n * 32 * 4));
        gn_stats<<<s.n * 32, 512, 0, tm.s>>>(x, mean, rstd, HW, s.cin, 1e-5f);
        CK(cudaGetLastError());
        const long long chunks = (long long)M * s.cin / 8;
        auto apply = [&] {
            gn_apply<<<(unsigned)((chunks + 255) / 256), 256, 0, tm.s>>>((const uint4 *)x, (uint4 *)xn, mean, rstd, g,
                                                                         be, chunks, HW, s.cin);
        };
        apply();

        // cuDNN exactly as cudnn.rs sets it up.
        cudnnTensorDescriptor_t xd, yd, bd;
        cudnnFilterDescriptor_t wd;
        cudnnConvolutionDescriptor_t cd;
        cudnnActivationDescriptor_t ad;
        CD(cudnnCreateTensorDescriptor(&xd));
        CD(cudnnCreateTensorDescriptor(&yd));
        CD(cudnnCreateTensorDescriptor(&bd));
        CD(cudnnCreateFilterDescriptor(&wd));
        CD(cudnnCreateConvolutionDescriptor(&cd));
        CD(cudnnCreateActivationDescriptor(&ad));
        CD(cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NHWC, CUDNN_DATA_HALF, s.n, s.cin, s.hw, s.hw));
        CD(cudnnSetTensor4dDescriptor(yd, CUDNN_TENSOR_NHWC, CUDNN_DATA_HALF, s.n, s.cout, s.hw, s.hw));
        CD(cudnnSetTensor4dDescriptor(bd, CUDNN_TENSOR_NHWC, CUDNN_DATA_HALF, 1, s.cout, 1, 1));
        CD(cudnnSetFilter4dDescriptor(wd, CUDNN_DATA_HALF, CUDNN_TENSOR_NHWC, s.cout, s.cin, 3, 3));
        CD(cudnnSetConvolution2dDescriptor(cd, 1, 1, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
        CD(cudnnSetConvolutionMathType(cd, CUDNN_TENSOR_OP_MATH));
        CD(cudnnSetActivationDescriptor(ad, CUDNN_ACTIVATION_IDENTITY, CUDNN_NOT_PROPAGATE_NAN, 0.0));
        const auto algo = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
        size_t wsz = 0;
        CD(cudnnGetConvolutionForwardWorkspaceSize(dn, xd, wd, cd, yd, algo, &wsz));
        void *ws_p = nullptr;
        if (wsz) CK(cudaMalloc(&ws_p, wsz));
        const float one = 1.f, alpha2 = s.res ? 1.f : 0.f;
        auto dnn = [&](const __half *in, __half *out) {
            CD(cudnnConvolutionBiasActivationForward(dn, &one, xd, in, wd, w, cd, algo, ws_p, wsz, &alpha2, yd,
                                                     s.res ? (const void *)r : (const void *)out, bd, b, ad, yd, out));
        };
        dnn(x, y_ref);
        dnn(xn, y_ref_n);
        CK(cudaStreamSynchronize(tm.s));
        std::vector<__half> ref(out_n), ref_n(out_n), got(out_n);
        CK(cudaMemcpy(ref.data(), y_ref, out_n * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(ref_n.data(), y_ref_n, out_n * 2, cudaMemcpyDeviceToHost));

        printf("\n%s: M %d K %d N %d, cuDNN workspace %zu\n", s.what, M, K, s.cout, wsz);
        // Spot check of both references against the host in f64 (the norm from the device's statistics).
        std::vector<float> hmean(s.n * 32), hrstd(s.n * 32);
        CK(cudaMemcpy(hmean.data(), mean, s.n * 32 * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hrstd.data(), rstd, s.n * 32 * 4, cudaMemcpyDeviceToHost));
        auto host_out = [&](int m, int co, bool norm) {
            const int img = m / HW, yy = m % HW / s.hw, xx = m % s.hw;
            double a = __half2float(hb[co]) + (s.res ? __half2float(hr[(size_t)m * s.cout + co]) : 0.);
            for (int tap = 0; tap < 9; ++tap) {
                const int iy = yy + tap / 3 - 1, ix = xx + tap % 3 - 1;
                if (iy < 0 || iy >= s.hw || ix < 0 || ix >= s.hw) continue;
                const size_t pix = (size_t)img * HW + iy * s.hw + ix;
                for (int c = 0; c < s.cin; ++c) {
                    double v = __half2float(hx[pix * s.cin + c]);
                    if (norm) {
                        const int g = img * 32 + c / (s.cin / 32);
                        v = (v - hmean[g]) * hrstd[g] * __half2float(hg[c]) + __half2float(hbe[c]);
                        v = (double)__half2float(__float2half((float)(v / (1. + exp(-v)))));
                    }
                    a += v * __half2float(hw[(size_t)co * K + tap * s.cin + c]);
                }
            }
            return a;
        };
        double e_plain = 0, e_norm = 0;
        for (int q = 0; q < 64; ++q) {
            const int m = (int)((q * 2654435761u) % M), co = (q * 97) % s.cout;
            const int m2 = q < 8 ? q * s.hw : m; // some border pixels
            e_plain = std::max(e_plain, fabs(host_out(m2, co, false) - __half2float(ref[(size_t)m2 * s.cout + co])));
            e_norm = std::max(e_norm, fabs(host_out(m2, co, true) - __half2float(ref_n[(size_t)m2 * s.cout + co])));
        }
        {
            std::vector<__half> hxn(hx.size());
            CK(cudaMemcpy(hxn.data(), xn, hx.size() * 2, cudaMemcpyDeviceToHost));
            double e = 0; size_t at = 0;
            for (size_t i = 0; i < hx.size(); ++i) {
                const int c = (int)(i % s.cin), img = (int)(i / ((size_t)HW * s.cin)), gg = img * 32 + c / (s.cin / 32);
                double v = (__half2float(hx[i]) - hmean[gg]) * hrstd[gg] * __half2float(hg[c]) + __half2float(hbe[c]);
                v = v / (1. + exp(-v));
                const double d = fabs(v - __half2float(hxn[i]));
                if (d > e) e = d, at = i;
            }
            printf("  apply pass vs host: max err %.3g at pixel %zu channel %zu\n", e, at / s.cin, at % s.cin);
        }
        printf("  host spot check of cuDNN: raw map max err %.3g, normalised map %.3g\n", e_plain, e_norm);
        if (soak && !strcmp(soak, "cudnn")) {
            for (int rep = 0; rep < 150; ++rep) tm.time([&] { dnn(xn, y); }, 50);
            printf("  soaked cudnn\n");
        }
        const float t_dnn = tm.time([&] { dnn(xn, y); });
        const float t_apply = tm.time(apply);
        const float t_both = tm.time([&] { apply(); dnn(xn, y); });
        printf("  (1) cuDNN conv (bias%s)            %7.2f us\n", s.res ? "+res" : "", t_dnn);
        printf("      GN apply pass alone            %7.2f us\n", t_apply);
        printf("  (2) GN apply + cuDNN conv          %7.2f us\n", t_both);

        igemm::Params prm{nullptr, w, b, s.res ? r : nullptr, mean, rstd, g, be, y, s.hw, s.hw, s.cin, s.cout};
        float best[2] = {1e9f, 1e9f};
        const char *best_name[2] = {"", ""};
        for (auto &c : cfgs) {
            if (s.cout % c.bn || M % c.bm || HW % c.bm || s.cin % 64) continue;
            prm.x = c.norm ? x : x; // the fused kernel reads the raw map either way
            CK(cudaMemsetAsync(y, 0xFF, out_n * 2, tm.s));
            dim3 grid(s.cout / c.bn, M / c.bm);
            auto launch = [&] { c.k<<<grid, c.threads, c.smem, tm.s>>>(prm); };
            launch();
            CK(cudaGetLastError());
            CK(cudaStreamSynchronize(tm.s));
            CK(cudaMemcpy(got.data(), y, out_n * 2, cudaMemcpyDeviceToHost));
            double mx;
            const double err = half_max_err(got, c.norm ? ref_n : ref, &mx);
            if (soak && strstr(c.name, soak)) { // clocks and power under load: ~1.5 s of back-to-back launches
                for (int rep = 0; rep < 150; ++rep) tm.time(launch, 50);
                printf("  soaked %s\n", c.name);
            }
            const float us = tm.time(launch);
            const int v = c.norm ? 1 : 0;
            const bool ok = err / mx < 1e-2;
            if (ok && us < best[v]) best[v] = us, best_name[v] = c.name;
            printf("  (%d) %-34s %7.2f us  grid %3dx%-3d  err %.3g (rel %.2e)%s\n", c.norm ? 4 : 3, c.name, us,
                   grid.x, grid.y, err, err / mx, ok ? "" : "  FAILED");
            if (!ok) { // where: a few of the worst outputs, with the host's value
                int shown = 0;
                const auto &rf = c.norm ? ref_n : ref;
                for (size_t i = 0; i < out_n && shown < 4; ++i) {
                    const double d = fabs(__half2float(got[i]) - __half2float(rf[i]));
                    if (d < 0.5 * err) continue;
                    const int m = (int)(i / s.cout), co = (int)(i % s.cout);
                    printf("      m %d (y %d x %d) co %d: got %.4f ref %.4f host %.4f\n", m, m % HW / s.hw, m % s.hw, co,
                           __half2float(got[i]), __half2float(rf[i]), host_out(m, co, c.norm != 0));
                    ++shown;
                }
            }
        }
        printf("  best (3) %-34s %7.2f us  vs (1) %.2f\n", best_name[0], best[0], t_dnn);
        printf("  best (4) %-34s %7.2f us  vs (2) %.2f  (%+.2f us)\n", best_name[1], best[1], t_both,
               best[1] - t_both);
        CK(cudaFree(x)); CK(cudaFree(w)); CK(cudaFree(b)); CK(cudaFree(r)); CK(cudaFree(g)); CK(cudaFree(be));
        CK(cudaFree(xn)); CK(cudaFree(y_ref)); CK(cudaFree(y_ref_n)); CK(cudaFree(y)); CK(cudaFree(mean));
        CK(cudaFree(rstd));
        if (ws_p) CK(cudaFree(ws_p));
    }
    return 0;
}
