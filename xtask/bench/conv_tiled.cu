// A cluster split-K implicit-GEMM 3×3 convolution for the 16² maps, of the fused GEGLU product's construction (a
// cp.async ring, 128-byte swizzle, warpgroups of wgmma, a block barrier per K tile), against what the engine runs
// there: cuDNN's cudnnConvolutionBiasActivationForward (IMPLICIT_PRECOMP_GEMM, NHWC f16, bias and skip in its
// epilogue, as src/cudnn.rs calls it). Per SD1.5 shape (batch 2) and per instantiation: the largest error against
// an f32 reference (a plain GPU loop over the 9·C products) over the output's largest value, both kernels; then
// times. Four copies of the filter and input are cycled so that the filter comes from memory, as in a UNet step.
// Times: CUDA graphs of 20 calls launched 5 times, best, µs a call. Measured and not taken (docs/benchmarks.md).
// Build here, run on the GPU machine:
//   C=~/.cache/sdhive-cuda-13.0/prefix/nvidia (the toolchain `cargo xtask build-cuda` caches; its nvcc on PATH)
//   nvcc -O3 -std=c++17 -arch=sm_90a -cudart shared -I$C/cudnn/include xtask/bench/conv_tiled.cu -o conv_tiled \
//        -L$C/cu13/lib -L$C/cudnn/lib -l:libcudnn.so.9
//   ./conv_tiled [instantiation name part]
//
// The kernel:
// A 3×3 convolution (stride 1, padding 1) of mid-sized channels-last maps for Hopper (sm_90a) as an implicit
// GEMM whose K is split among the blocks of a thread block cluster: f16 or bf16 storage, f32 accumulation, filter
// KRSC, `y = conv(x) + bias (+ skip)`. It is for SD1.5's 16² UNet level (batch 2: 512 output pixels, 1280 output
// channels, 640 to 2560 input channels), where cuDNN's kernels fill only 80 of an H100's 132 SMs: 512 × 1280
// outputs make few tiles, and the K of 9·C is deep enough to be shared out instead.
// - GEMM view: M = output pixels (NHWC order), N = output channels, K = 9·C ordered (64-channel slice, tap), the
//   9 taps of a slice one after the other. A K tile of A is 64 channels of one tap: for output pixel p, the 128
//   bytes of input pixel p shifted by the tap, or zeros past the image's border (cp.async's zero fill); a K tile
//   of B is 64 values of each of the block's filter rows. Both go through an S-stage cp.async ring, 128-byte
//   swizzle (wgmma_common.cuh's TileRing layout), and WGM warpgroups each multiply 64 pixel rows by the block's
//   BN channels (wgmma m64nBNk16, both operands in shared memory).
// - Cluster split-K: block `rank` of a cluster of SPLIT takes K tiles [rank·KT/SPLIT, (rank+1)·KT/SPLIT). After
//   its main loop each block stages its f32 partial tile in its own shared memory (where the ring was); after a
//   cluster barrier each block adds up a share of the tile's 16-byte output chunks, reading every block's partials
//   in rank order through distributed shared memory (so the sum does not depend on timing), adds bias and skip in
//   f32, rounds once and writes. A second cluster barrier keeps every block's partials alive until all are read.
// Constraints the harness keeps: C % 64 == 0, K % BN == 0, N·H·W % (64·WGM) == 0, 16-byte aligned pointers.
#include "../../crates/sdhive-cuda-kernels/src/wgmma_common.cuh"

namespace conv_tiled {

// Shared memory of one instantiation: the larger of the ring (S stages of BM rows of A and BN rows of B, 128 bytes
// a row) and the staged partials (BM rows of BN + 8 floats: the pad spreads a quad's rows over the banks), plus
// the slack to align the ring to 1024 bytes (the swizzle's period).
template <int WGM, int BN> __host__ __device__ constexpr int pitch() { return BN + 8; }
template <int WGM, int BN, int S> __host__ __device__ constexpr int smem_bytes() {
    return (S * (64 * WGM + BN) * 128 > 64 * WGM * pitch<WGM, BN>() * 4 ? S * (64 * WGM + BN) * 128
                                                                         : 64 * WGM * pitch<WGM, BN>() * 4) +
           1024;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
using namespace sm90;

template <typename T, int N> struct Mma;
#define CT_MMA_FOR(T, TY)                                                                                         \
    template <> struct Mma<T, 128> {                                                                              \
        static __device__ __forceinline__ void run(float (&d)[64], uint64_t da, uint64_t db) {                    \
            WG_MMA_SS(TY, 128, WG_R64, 64, 65, WG_ACC32(0), WG_ACC32(32));                                         \
        }                                                                                                         \
    };                                                                                                            \
    template <> struct Mma<T, 160> {                                                                              \
        static __device__ __forceinline__ void run(float (&d)[80], uint64_t da, uint64_t db) {                    \
            WG_MMA_SS(TY, 160, WG_R80, 80, 81, WG_ACC32(0), WG_ACC32(32), WG_ACC16(64));                           \
        }                                                                                                         \
    };                                                                                                            \
    template <> struct Mma<T, 256> {                                                                              \
        static __device__ __forceinline__ void run(float (&d)[128], uint64_t da, uint64_t db) {                   \
            WG_MMA_SS(TY, 256, WG_R128, 128, 129, WG_ACC32(0), WG_ACC32(32), WG_ACC32(64), WG_ACC32(96));          \
        }                                                                                                         \
    };
CT_MMA_FOR(__half, "f16")
CT_MMA_FOR(__nv_bfloat16, "bf16")

__device__ __forceinline__ uint32_t in_block(uint32_t addr, uint32_t rank) {
    uint32_t ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(ra) : "r"(addr), "r"(rank));
    return ra;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Block (rank, n tile, m tile) of the grid (SPLIT, K/BN, M/BM), cluster (SPLIT, 1, 1). `skip` may be null.
// W1: one K tile's products left in flight while the next is issued (prefetch distance S-2), else none (S-1).
template <typename T, int WGM, int BN, int S, int SPLIT, bool W1>
__device__ __forceinline__ void conv(const T *__restrict__ x, const T *__restrict__ w, const T *__restrict__ bias,
                                     const T *__restrict__ skip, T *__restrict__ y, int H, int W, int C, int K) {
    constexpr int BM = 64 * WGM, THREADS = 128 * WGM;
    constexpr int A_BYTES = BM * 128, STAGE = A_BYTES + BN * 128;
    constexpr int A_CH = BM * 8 / THREADS, B_CH = BN * 8 / THREADS;
    static_assert(BM * 8 % THREADS == 0 && BN * 8 % THREADS == 0, "chunks divide among the threads");
    constexpr int D = W1 ? S - 2 : S - 1;
    static_assert(D >= 1, "prefetch distance");
    constexpr int PITCH = pitch<WGM, BN>();
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t base = (raw + 1023) & ~1023u;
    const int tid = threadIdx.x, wg = tid / 128, rank = blockIdx.x;
    const int n0 = blockIdx.y * BN, m0 = blockIdx.z * BM;
    const int HW = H * W, KT = 9 * (C / 64), kt0 = rank * KT / SPLIT, nk = (rank + 1) * KT / SPLIT - kt0;
    const size_t wrow = (size_t)9 * C;

    // A thread copies chunk cc (16 bytes) of the same rows of every tile: their offsets once.
    const int cc = tid % 8;
    int a_pix[A_CH], a_y[A_CH], a_x[A_CH];
    uint32_t a_dst[A_CH], b_dst[B_CH];
    size_t b_src[B_CH];
#pragma unroll
    for (int i = 0; i < A_CH; ++i) {
        const int r = tid / 8 + i * (THREADS / 8), m = m0 + r, rem = m % HW;
        a_pix[i] = m;
        a_y[i] = rem / W;
        a_x[i] = rem % W;
        a_dst[i] = r * 128 + ((cc ^ (r & 7)) << 4);
    }
#pragma unroll
    for (int i = 0; i < B_CH; ++i) {
        const int r = tid / 8 + i * (THREADS / 8);
        b_dst[i] = A_BYTES + r * 128 + ((cc ^ (r & 7)) << 4);
        b_src[i] = (size_t)(n0 + r) * wrow + cc * 8;
    }
    // The block's j-th K tile into its stage: one cp.async group per call, empty past the block's last tile, so
    // that the group count stays uniform.
    auto load = [&](int j) {
        if (j < nk) {
            const int kt = kt0 + j, slice = kt / 9, tap = kt - 9 * slice;
            const int dy = tap / 3 - 1, dx = tap % 3 - 1;
            const uint32_t st = base + (j % S) * STAGE;
            const int shift = (dy * W + dx) * C + slice * 64 + cc * 8;
#pragma unroll
            for (int i = 0; i < A_CH; ++i) {
                const bool ok = (unsigned)(a_y[i] + dy) < (unsigned)H && (unsigned)(a_x[i] + dx) < (unsigned)W;
                cp16(st + a_dst[i], x + (ok ? (size_t)a_pix[i] * C + shift : 0), ok ? 16 : 0);
            }
            const size_t k0 = (size_t)tap * C + slice * 64;
#pragma unroll
            for (int i = 0; i < B_CH; ++i) cp16(st + b_dst[i], w + b_src[i] + k0, 16);
        }
        cp_commit();
    };

    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;

#pragma unroll
    for (int s = 0; s < D; ++s) load(s);
    for (int j = 0; j < nk; ++j) {
        ring_landed<D - 1>();
        load(j + D);
        const uint32_t st = base + (j % S) * STAGE;
        const uint64_t da = desc_sw128(st + wg * 64 * 128), db = desc_sw128(st + A_BYTES);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) Mma<T, BN>::run(acc, da + 2 * kk, db + 2 * kk);
        wgmma_commit();
        if constexpr (W1) wgmma_wait<1>();
        else wgmma_wait<0>();
    }
    wgmma_wait<0>();
    fence_regs(acc);
    cp_wait<0>();
    // Every warpgroup's products are done reading the ring before the partials overwrite it.
    __syncthreads();

    // Accumulator i of a thread: pixel row 16·warp + lane/4 + 8·((i/2)%2) of its warpgroup's 64, channel
    // 8·(i/4) + 2·(lane%4) + i%2; pairs of channels are adjacent, one 8-byte store each.
    const int warp = (tid % 128) / 32, lane = tid % 32;
#pragma unroll
    for (int i = 0; i < BN / 2; i += 2) {
        const int r = wg * 64 + 16 * warp + lane / 4 + 8 * ((i / 2) % 2), c = 8 * (i / 4) + 2 * (lane % 4);
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(base + (r * PITCH + c) * 4), "f"(acc[i]),
                     "f"(acc[i + 1])
                     : "memory");
    }
    // Every block's partials are staged and visible to the cluster.
    cluster_sync();

    constexpr int UNITS = BM * BN / 8, ROW_UNITS = BN / 8;
    const int u0 = rank * UNITS / SPLIT, u1 = (rank + 1) * UNITS / SPLIT;
    for (int u = u0 + tid; u < u1; u += THREADS) {
        const int r = u / ROW_UNITS, c = (u % ROW_UNITS) * 8;
        const uint32_t at = base + (r * PITCH + c) * 4;
        float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int q = 0; q < SPLIT; ++q) {
            const uint32_t src = in_block(at, q);
            float4 a, b;
            asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                         : "=f"(a.x), "=f"(a.y), "=f"(a.z), "=f"(a.w)
                         : "r"(src));
            asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                         : "=f"(b.x), "=f"(b.y), "=f"(b.z), "=f"(b.w)
                         : "r"(src + 16));
            sum[0] += a.x, sum[1] += a.y, sum[2] += a.z, sum[3] += a.w;
            sum[4] += b.x, sum[5] += b.y, sum[6] += b.z, sum[7] += b.w;
        }
        const size_t o = (size_t)(m0 + r) * K + n0 + c;
        const uint4 bv = *reinterpret_cast<const uint4 *>(bias + n0 + c);
        const uint4 sv = skip != nullptr ? *reinterpret_cast<const uint4 *>(skip + o) : make_uint4(0, 0, 0, 0);
        const uint32_t bw[4] = {bv.x, bv.y, bv.z, bv.w}, sw[4] = {sv.x, sv.y, sv.z, sv.w};
        uint32_t out[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 bf = to_f2(bw[e], T()), sf = to_f2(sw[e], T());
            out[e] = pack2(sum[2 * e] + bf.x + sf.x, sum[2 * e + 1] + bf.y + sf.y, T());
        }
        *reinterpret_cast<uint4 *>(y + o) = make_uint4(out[0], out[1], out[2], out[3]);
    }
    // No block leaves (and frees its shared memory) while another may still be reading its partials.
    cluster_sync();
}

#endif // sm_90a or host

} // namespace conv_tiled

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CT_SM90A(...) __VA_ARGS__
#else
#define CT_SM90A(...) __trap()
#endif

// One launchable instantiation: conv_tiled_<NAME>_<f16|bf16>, 128·WGM threads, smem_bytes<WGM, BN, S>() of dynamic
// shared memory, grid (SPLIT, K/BN, N·H·W/(64·WGM)), its cluster (SPLIT, 1, 1) fixed here.
#define CONV_TILED(NAME, WGM, BN, S, SPLIT, W1, MINB, T, SFX)                                                     \
    extern "C" __global__ void __cluster_dims__(SPLIT, 1, 1) __launch_bounds__(128 * WGM, MINB)                  \
        conv_tiled_##NAME##_##SFX(const T *x, const T *w, const T *bias, const T *skip, T *y, int H, int W, int C, \
                                  int K) {                                                                        \
        CT_SM90A((conv_tiled::conv<T, WGM, BN, S, SPLIT, W1>(x, w, bias, skip, y, H, W, C, K)));                  \
    }

#include "cudnn_conv.cuh"
#include <cstring>

CONV_TILED(m64n128_s4_k3, 1, 128, 4, 3, false, 2, __half, f16)
CONV_TILED(m64n128_s4_k2, 1, 128, 4, 2, false, 2, __half, f16)
CONV_TILED(m128n128_s3_k3, 2, 128, 3, 3, false, 2, __half, f16)
CONV_TILED(m64n128_s3_k3, 1, 128, 3, 3, false, 3, __half, f16)
CONV_TILED(m64n128_s4_k3_w1, 1, 128, 4, 3, true, 2, __half, f16)
CONV_TILED(m64n256_s3_k3, 1, 256, 3, 3, false, 1, __half, f16)
CONV_TILED(m64n128_s3_k4, 1, 128, 3, 4, false, 3, __half, f16)
CONV_TILED(m128n128_s4_k1, 2, 128, 4, 1, false, 1, __half, f16)
// One warpgroup over 64×160 with a deep ring and a product in flight: conv_igemm.cu's fastest form at 32².
CONV_TILED(m64n160_s5_k2_w1, 1, 160, 5, 2, true, 1, __half, f16)
CONV_TILED(m64n160_s5_k1_w1, 1, 160, 5, 1, true, 1, __half, f16)
CONV_TILED(m64n160_s4_k2_w1, 1, 160, 4, 2, true, 1, __half, f16)
CONV_TILED(m64n128_s4_k2_w1, 1, 128, 4, 2, true, 2, __half, f16)

using Kernel = void (*)(const __half *, const __half *, const __half *, const __half *, __half *, int, int, int, int);
struct Config {
    const char *name;
    Kernel k;
    int wgm, bn, split, smem;
};
#define CFG(NAME, WGM, BN, S, SPLIT)                                                                              \
    Config { #NAME, conv_tiled_##NAME##_f16, WGM, BN, SPLIT, conv_tiled::smem_bytes<WGM, BN, S>() }
const Config CONFIGS[] = {
    CFG(m64n128_s4_k3, 1, 128, 4, 3),    CFG(m64n128_s4_k2, 1, 128, 4, 2),    CFG(m128n128_s3_k3, 2, 128, 3, 3),
    CFG(m64n128_s3_k3, 1, 128, 3, 3),    CFG(m64n128_s4_k3_w1, 1, 128, 4, 3), CFG(m64n256_s3_k3, 1, 256, 3, 3),
    CFG(m64n128_s3_k4, 1, 128, 3, 4),    CFG(m128n128_s4_k1, 2, 128, 4, 1),   CFG(m64n160_s5_k2_w1, 1, 160, 5, 2),
    CFG(m64n160_s5_k1_w1, 1, 160, 5, 1), CFG(m64n160_s4_k2_w1, 1, 160, 4, 2), CFG(m64n128_s4_k2_w1, 1, 128, 4, 2),
};

// out[p, k] = bias[k] + skip[p, k] + Σ x[p shifted by the tap, c] · w[k, tap, c], f32.
__global__ void reference(const __half *x, const __half *w, const __half *bias, const __half *skip, float *out,
                          int nb, int hw, int C, int K) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= nb * hw * hw * K) return;
    const int k = idx % K, p = idx / K, b = p / (hw * hw), oy = p % (hw * hw) / hw, ox = p % hw;
    float acc = __half2float(bias[k]) + (skip ? __half2float(skip[idx]) : 0.f);
    for (int tap = 0; tap < 9; ++tap) {
        const int iy = oy + tap / 3 - 1, ix = ox + tap % 3 - 1;
        if (iy < 0 || iy >= hw || ix < 0 || ix >= hw) continue;
        const __half *xp = x + ((size_t)(b * hw + iy) * hw + ix) * C;
        const __half *wp = w + ((size_t)k * 9 + tap) * C;
        for (int c = 0; c < C; ++c) acc += __half2float(xp[c]) * __half2float(wp[c]);
    }
    out[idx] = acc;
}

int main(int argc, char **argv) {
    setvbuf(stdout, nullptr, _IONBF, 0);
    const char *only = argc > 1 ? argv[1] : nullptr;
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    cudnnHandle_t dn;
    CK(cudnnCreate(&dn));
    CK(cudnnSetStream(dn, st));
    constexpr int NB = 2, COPIES = 4;
    struct Shape {
        int hw, c, k;
        bool skip;
    };
    // SD1.5's 16² convolutions: the ResNets' second (skip) and first (no skip; 640, 1920 and 2560 input channels
    // where the block's input is concatenated or widened), the up-sampler's; then a 32² one for comparison.
    for (Shape sh : {Shape{16, 1280, 1280, true}, Shape{16, 1280, 1280, false}, Shape{16, 2560, 1280, false},
                     Shape{16, 1920, 1280, false}, Shape{16, 640, 1280, false}, Shape{32, 640, 640, true}}) {
        const int C = sh.c, K = sh.k, HW = sh.hw * sh.hw, M = NB * HW;
        const size_t nx = (size_t)M * C, nw = (size_t)K * 9 * C, ny = (size_t)M * K;
        std::vector<__half *> xs, ws;
        for (int i = 0; i < COPIES; ++i) {
            __half *a, *b;
            CK(cudaMalloc(&a, nx * 2));
            CK(cudaMalloc(&b, nw * 2));
            fill<<<(unsigned)((nx + 255) / 256), 256>>>(a, nx, 11 + i, 1.f);
            fill<<<(unsigned)((nw + 255) / 256), 256>>>(b, nw, 97 + i, 1.f / sqrtf(9.f * C));
            xs.push_back(a);
            ws.push_back(b);
        }
        __half *bias, *skip = nullptr, *y;
        float *ref;
        CK(cudaMalloc(&bias, K * 2));
        fill<<<(K + 255) / 256, 256>>>(bias, K, 5, 0.5f);
        if (sh.skip) {
            CK(cudaMalloc(&skip, ny * 2));
            fill<<<(unsigned)((ny + 255) / 256), 256>>>(skip, ny, 7, 1.f);
        }
        CK(cudaMalloc(&y, ny * 2));
        CK(cudaMalloc(&ref, ny * 4));
        reference<<<(unsigned)((ny + 255) / 256), 256, 0, st>>>(xs[0], ws[0], bias, skip, ref, NB, sh.hw, C, K);
        CK(cudaStreamSynchronize(st));
        std::vector<float> r(ny);
        CK(cudaMemcpy(r.data(), ref, ny * 4, cudaMemcpyDeviceToHost));
        std::vector<__half> out(ny);
        auto check = [&] {
            CK(cudaMemcpy(out.data(), y, ny * 2, cudaMemcpyDeviceToHost));
            double err = 0, top = 0;
            for (size_t i = 0; i < ny; ++i) {
                const float v = __half2float(out[i]);
                err = std::max(err, std::isfinite(v) ? (double)fabsf(v - r[i]) : 1e30);
                top = std::max(top, (double)fabsf(r[i]));
            }
            return err / top;
        };
        const double flop = 2.0 * M * K * 9.0 * C;
        printf("== %dx%d x%d, %d -> %d, %s; %.1f GFLOP, filter %.1f MB\n", sh.hw, sh.hw, NB, C, K,
               sh.skip ? "bias+skip" : "bias", flop / 1e9, nw * 2 / 1e6);

        const EngineConv engine(dn, NB, C, K, sh.hw);
        auto cudnn = [&](int i) { engine.run(xs[i % COPIES], ws[i % COPIES], bias, skip, y); };
        CK(cudaMemset(y, 0, ny * 2));
        cudnn(0);
        CK(cudaStreamSynchronize(st));
        const double e_cudnn = check();
        const float t_cudnn = time_graph(st, cudnn);
        printf("cudnn              %8.2f us %6.0f TFLOP/s  err %.2e\n", t_cudnn, flop / (t_cudnn * 1e6), e_cudnn);

        for (const Config &cfg : CONFIGS) {
            if (only && !strstr(cfg.name, only)) continue;
            const int bm = 64 * cfg.wgm;
            if (C % 64 || K % cfg.bn || M % bm) continue;
            CK(cudaFuncSetAttribute(cfg.k, cudaFuncAttributeMaxDynamicSharedMemorySize, cfg.smem));
            const dim3 grid(cfg.split, K / cfg.bn, M / bm);
            auto ours = [&](int i) {
                cfg.k<<<grid, 128 * cfg.wgm, cfg.smem, st>>>(xs[i % COPIES], ws[i % COPIES], bias, skip, y, sh.hw,
                                                             sh.hw, C, K);
            };
            CK(cudaMemset(y, 0xFF, ny * 2));
            ours(0);
            CK(cudaGetLastError());
            CK(cudaStreamSynchronize(st));
            const double e = check();
            cudaLaunchConfig_t lc = {};
            lc.gridDim = grid;
            lc.blockDim = dim3(128 * cfg.wgm);
            lc.dynamicSmemBytes = cfg.smem;
            int clusters = -1;
            cudaOccupancyMaxActiveClusters(&clusters, (void *)cfg.k, &lc);
            const float t = time_graph(st, ours);
            printf("%-18s %8.2f us %6.0f TFLOP/s  err %.2e  %4d blocks, %3d clusters of %d fit, %6d B  %s\n",
                   cfg.name, t, flop / (t * 1e6), e, grid.x * grid.y * grid.z, clusters, cfg.split, cfg.smem,
                   e < 1e-2 ? "ok" : "FAILED");
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
