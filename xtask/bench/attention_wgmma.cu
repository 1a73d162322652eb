// The Hopper-native (wgmma) fused attention forward of crates/sdhive-cuda-kernels/src/attention.cu (`hopper`
// there) for head dimensions 40, 64 and 80, against the mma.sync kernel attention.cu instantiates for each (its DP
// 48 instance: two 16-row atoms per warp over 32-key tiles; DP 64 and 80: one atom over 64-key tiles), f16, q/k/v/o
// in the projections' (B, S, H·D) layout (and the Hopper kernels with their tile copies by TMA, HOPPER_TMA there,
// through tensor maps made as attention.rs makes them), and once per D with q, k, v packed in one (B, S, 3·H·D) buffer (the row
// stride three heads' widths). For each shape: max and mean absolute error of both kernels against an f32 reference
// (two passes over the keys, as in attention_shapes.cu), then time per call (3 warm-up launches, mean of 20 timed
// with CUDA events) and TFLOP/s at 4·B·H·Sq·Sk·D. Not part of the build. Build here, run on the H100 machine (driver
// only):
//   nvcc -O3 -arch=sm_90a -std=c++17 -cudart shared xtask/bench/attention_wgmma.cu -o attention_wgmma && ./attention_wgmma
//
// The kernel and its design: `hopper` in attention.cu. Before the block shapes were chosen this harness also timed
// other warpgroup counts, blocks per SM and Q in registers or shared memory (attention.cu's notes on the
// instantiations). H100 (SXM, 1980 MHz max), f16: see attention.cu's notes; errors as mma_sync's everywhere.

#define SDHIVE_ATTENTION_NO_INSTANCES
#include "../../crates/sdhive-cuda-kernels/src/attention.cu"
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define SDHIVE_ARGS                                                                                               \
    const __half *q, const __half *k, const __half *v, __half *o, int sq, int sk, int d, int heads, long long q_bs, \
        long long q_ss, long long k_bs, long long k_ss, long long v_bs, long long v_ss, float c
#define SDHIVE_PASS q, k, v, o, sq, sk, d, heads, q_bs, q_ss, k_bs, k_ss, v_bs, v_ss, c
using Kernel = void (*)(SDHIVE_ARGS);

// The kernels as attention.cu instantiates them (FLASH_BOTH and HOPPER_BOTH there), without the storage-type pair.
extern "C" __global__ void __launch_bounds__(128, 4) mma_sync_d48(SDHIVE_ARGS) {
    flash_attention<__half, 48, 32, 4, 2>(SDHIVE_PASS);
}
extern "C" __global__ void __launch_bounds__(128, 5) mma_sync_d64(SDHIVE_ARGS) {
    flash_attention<__half, 64, 64, 4, 1>(SDHIVE_PASS);
}
extern "C" __global__ void __launch_bounds__(128) mma_sync_d80(SDHIVE_ARGS) {
    flash_attention<__half, 80, 64, 4, 1>(SDHIVE_PASS);
}
template <int D, int NWG, int BLOCKS> __global__ void __launch_bounds__(128 * NWG, BLOCKS) wgmma(SDHIVE_ARGS) {
    SDHIVE_SM90A((hopper::attention<__half, D, NWG>(q, k, v, o, sq, sk, heads, q_bs, q_ss, k_bs, k_ss, v_bs, v_ss, c)));
}

// The Hopper kernels with their tile copies by TMA (HOPPER_TMA in attention.cu), two tensor maps over k and v.
template <int D, int NWG, int BLOCKS>
__global__ void __launch_bounds__(128 * NWG, BLOCKS) wgmma_tma(SDHIVE_ARGS, const __grid_constant__ TmaMap km,
                                                               const __grid_constant__ TmaMap vm) {
    SDHIVE_SM90A((hopper::attention<__half, D, NWG, true>(q, k, v, o, sq, sk, heads, q_bs, q_ss, k_bs, k_ss, v_bs,
                                                           v_ss, c, &km, &vm)));
}
using TmaKernel = void (*)(SDHIVE_ARGS, TmaMap, TmaMap);
static PFN_cuTensorMapEncodeTiled_v12000 encode_tiled;
// As attention.rs's `kv_map`: 8 values, keys, D/8 chunks, heads, batch; a box of one 64-key tile.
static bool kv_map(TmaMap *m, const __half *p, int D, int sk, int heads, int b, long long ss, long long bs) {
    const cuuint64_t dim[5] = {8, (cuuint64_t)sk, (cuuint64_t)D / 8, (cuuint64_t)heads, (cuuint64_t)b};
    const cuuint64_t stride[4] = {(cuuint64_t)ss * 2, 16, (cuuint64_t)D * 2, (cuuint64_t)bs * 2};
    const cuuint32_t box[5] = {8, 64, (cuuint32_t)D / 8, 1, 1}, es[5] = {1, 1, 1, 1, 1};
    const CUresult r = encode_tiled(reinterpret_cast<CUtensorMap *>(m), CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 5,
                                    const_cast<__half *>(p), dim, stride, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                    CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) printf("  cuTensorMapEncodeTiled: %d\n", (int)r);
    return r == CUDA_SUCCESS;
}
struct Impl { const char *name; Kernel fn; int threads, rows, smem; TmaKernel tma = nullptr; };
// flash_attention's two stages of K and V tiles of BK keys × DP + 8 columns, the query tile staged from the second
// stage on (`smem_bytes` in attention.rs).
template <int DP, int BK, int ROWS> Impl mma_sync(Kernel fn) {
    return {"mma_sync", fn, 128, ROWS, (4 * BK > 2 * BK + ROWS ? 4 * BK : 2 * BK + ROWS) * (DP + 8) * 2};
}
// hopper's stages (three, four with Tiles::RING: D 64, 80) of a 64-key K tile of KC chunks and V tile of D / 8
// (one more with Tiles::ONES: D 40, 64), and Q's tiles where Tiles::Q_SHARED (D 80): written out, as `hopper`
// exists only in the sm_90a pass.
template <int D, int NWG, int BLOCKS> Impl wg() {
    constexpr int KC = (D + 15) / 16 * 2, STAGES = D == 40 ? 3 : 4, VCX = D / 8 + (D != 80);
    return {"wgmma", wgmma<D, NWG, BLOCKS>, 128 * NWG, 64 * NWG,
            STAGES * 64 * (KC + VCX) * 16 + (D == 80 ? NWG * 64 * KC * 16 : 0)};
}
template <int D, int NWG, int BLOCKS> Impl wg_tma() {
    Impl i = wg<D, NWG, BLOCKS>();
    i.name = "tma";
    i.fn = nullptr;
    i.tma = wgmma_tma<D, NWG, BLOCKS>;
    return i;
}
struct Case { int d; Impl impls[3]; };
static Case cases[] = {
    {40, {mma_sync<48, 32, 128>(mma_sync_d48), wg<40, 2, 2>(), wg_tma<40, 2, 2>()}},
    {64, {mma_sync<64, 64, 64>(mma_sync_d64), wg<64, 3, 1>(), wg_tma<64, 3, 1>()}},
    {80, {mma_sync<80, 64, 64>(mma_sync_d80), wg<80, 2, 2>(), wg_tma<80, 2, 2>()}},
};
// SD1.5's heads of 40 (64x64 maps) and 80 (32x32), SDXL's of 64; ragged: row and key counts off every tile size.
struct Shape { int d; const char *what; int b, sq, sk, h; bool packed; };
static const Shape shapes[] = {
    {40, "self", 2, 4096, 4096, 8, false},  {40, "cross", 2, 4096, 77, 8, false},
    {40, "ragged", 2, 1000, 333, 3, false}, {40, "self", 2, 4096, 4096, 8, true},
    {64, "self", 2, 4096, 4096, 10, false}, {64, "self", 2, 1024, 1024, 20, false},
    {64, "cross", 2, 4096, 77, 10, false},  {64, "ragged", 2, 1000, 333, 5, false},
    {64, "self", 2, 1024, 1024, 20, true},  {80, "self", 2, 1024, 1024, 8, false},
    {80, "cross", 2, 1024, 77, 8, false},   {80, "ragged", 1, 777, 50, 3, false},
    {80, "self", 2, 1024, 1024, 8, true},
    // SD3.5-medium at 1024²: the joint attention over 4096 patch + 333 text tokens, MMDiT-X's over the patches.
    {64, "sd3 joint", 2, 4429, 4429, 24, false}, {64, "sd3 image", 2, 4096, 4096, 24, false},
};

__global__ void fill(__half *p, size_t n, unsigned seed) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) {
        unsigned x = (unsigned)i * 2654435761u ^ seed;
        x ^= x >> 13;
        x *= 0x5bd1e995;
        x ^= x >> 15;
        p[i] = __float2half(((x & 0xffff) / 65535.f - 0.5f) * 4.f);
    }
}

// fp32 reference with the kernels' strides, output contiguous (B, Sq, H·D): one thread per (row, head, batch), two
// passes over the keys.
__global__ void naive(const __half *q, const __half *k, const __half *v, float *o, int sq, int sk, int heads, int d,
                      long long q_bs, long long q_ss, long long k_bs, long long k_ss, long long v_bs, long long v_ss,
                      float scale) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    int h = blockIdx.y, b = blockIdx.z;
    if (r >= sq) return;
    const __half *qr = q + b * q_bs + r * q_ss + h * d;
    float m = -1e30f;
    for (int j = 0; j < sk; ++j) {
        const __half *kr = k + b * k_bs + j * k_ss + h * d;
        float s = 0;
        for (int c = 0; c < d; ++c) s += __half2float(qr[c]) * __half2float(kr[c]);
        m = fmaxf(m, s * scale);
    }
    float acc[160];
    for (int c = 0; c < d; ++c) acc[c] = 0;
    float l = 0;
    for (int j = 0; j < sk; ++j) {
        const __half *kr = k + b * k_bs + j * k_ss + h * d;
        const __half *vr = v + b * v_bs + j * v_ss + h * d;
        float s = 0;
        for (int c = 0; c < d; ++c) s += __half2float(qr[c]) * __half2float(kr[c]);
        float p = expf(s * scale - m);
        l += p;
        for (int c = 0; c < d; ++c) acc[c] += p * __half2float(vr[c]);
    }
    float *orow = o + (b * (long long)sq + r) * heads * d + h * d;
    for (int c = 0; c < d; ++c) orow[c] = acc[c] / l;
}

static bool check(const char *what) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) printf("  %s: CUDA error: %s\n", what, cudaGetErrorString(e));
    return e == cudaSuccess;
}

struct Result { bool ok; double us, max_err, mean_err; };

int main() {
    cudaDriverEntryPointQueryResult qr;
    cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void **>(&encode_tiled), 12000,
                                    cudaEnableDefault, &qr);
    for (auto &c : cases) {
        for (auto &k : c.impls) {
            if (!k.name) continue;
            if (k.tma) {
                cudaFuncSetAttribute(k.tma, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem);
                cudaFuncAttributes at;
                cudaFuncGetAttributes(&at, k.tma);
                printf("D %d %-12s regs %3d  spill %zu B  smem %6d B\n", c.d, k.name, at.numRegs, at.localSizeBytes,
                       k.smem);
                continue;
            }
            cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem);
            cudaFuncAttributes at;
            int nb = 0;
            cudaFuncGetAttributes(&at, k.fn);
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, k.fn, k.threads, k.smem);
            printf("D %d %-12s (%d threads, %3d rows)  regs %3d  spill %zu B  smem %6d B  blocks/SM %d\n", c.d, k.name,
                   k.threads, k.rows, at.numRegs, at.localSizeBytes, k.smem, nb);
        }
    }
    if (!check("setup")) return 1;

    for (auto &s : shapes) {
        const Case *cp = nullptr;
        for (auto &c : cases)
            if (c.d == s.d) cp = &c;
        const int D = s.d;
        // Packed: q, k, v are the thirds of each row of one (B, S, 3·H·D) buffer, as a fused QKV projection writes
        // them.
        const long long hs = (long long)s.h * D, row = s.packed ? 3 * hs : hs;
        const size_t nq = (size_t)s.b * s.sq * hs, nk = (size_t)s.b * s.sk * hs;
        __half *q, *k, *v, *o;
        if (s.packed) {
            cudaMalloc(&q, 3 * nq * 2);
            fill<<<(3 * nq + 255) / 256, 256>>>(q, 3 * nq, 1);
            k = q + hs;
            v = q + 2 * hs;
        } else {
            cudaMalloc(&q, nq * 2);
            cudaMalloc(&k, nk * 2);
            cudaMalloc(&v, nk * 2);
            fill<<<(nq + 255) / 256, 256>>>(q, nq, 1);
            fill<<<(nk + 255) / 256, 256>>>(k, nk, 2);
            fill<<<(nk + 255) / 256, 256>>>(v, nk, 3);
        }
        cudaMalloc(&o, nq * 2);
        const long long q_bs = s.sq * row, k_bs = s.sk * row;
        float *of;
        cudaMalloc(&of, nq * 4);
        std::vector<float> exact(nq);
        std::vector<__half> got(nq);
        naive<<<dim3((s.sq + 127) / 128, s.h, s.b), 128>>>(q, k, v, of, s.sq, s.sk, s.h, D, q_bs, row, k_bs, row, k_bs,
                                                           row, 1.f / sqrtf((float)D));
        if (!check("reference")) return 1;
        cudaMemcpy(exact.data(), of, nq * 4, cudaMemcpyDeviceToHost);
        cudaFree(of);
        const double flop = 4.0 * s.b * s.h * (double)s.sq * s.sk * D;
        const float scale_log2 = 1.f / sqrtf((float)D) * 1.4426950408889634f;

        // One launch for the errors (output first filled with NaN: an element left unwritten counts as wrong),
        // then 3 warm-up launches and 20 timed.
        auto measure = [&](const Impl &k_) {
            Result r{false, 0, 0, 0};
            TmaMap km, vm;
            if (k_.tma && !(kv_map(&km, k, D, s.sk, s.h, s.b, row, k_bs) && kv_map(&vm, v, D, s.sk, s.h, s.b, row, k_bs)))
                return r;
            auto launch = [&]() {
                const dim3 grid((s.sq + k_.rows - 1) / k_.rows, s.h, s.b);
                if (k_.tma)
                    k_.tma<<<grid, k_.threads, k_.smem>>>(q, k, v, o, s.sq, s.sk, D, s.h, q_bs, row, k_bs, row, k_bs,
                                                          row, scale_log2, km, vm);
                else
                    k_.fn<<<grid, k_.threads, k_.smem>>>(q, k, v, o, s.sq, s.sk, D, s.h, q_bs, row, k_bs, row, k_bs,
                                                         row, scale_log2);
            };
            cudaMemset(o, 0xff, nq * 2);
            launch();
            if (!check(k_.name)) return r;
            cudaMemcpy(got.data(), o, nq * 2, cudaMemcpyDeviceToHost);
            double sum = 0;
            for (size_t i = 0; i < nq; ++i) {
                double e = fabs((double)__half2float(got[i]) - exact[i]);
                if (!(e <= 1e30)) e = INFINITY;
                r.max_err = fmax(r.max_err, e);
                sum += e;
            }
            r.mean_err = sum / nq;
            for (int i = 0; i < 3; ++i) launch();
            cudaEvent_t e0, e1;
            cudaEventCreate(&e0);
            cudaEventCreate(&e1);
            const int reps = 20;
            cudaEventRecord(e0);
            for (int i = 0; i < reps; ++i) launch();
            cudaEventRecord(e1);
            cudaEventSynchronize(e1);
            float ms;
            cudaEventElapsedTime(&ms, e0, e1);
            cudaEventDestroy(e0);
            cudaEventDestroy(e1);
            r.us = ms * 1e3 / reps;
            r.ok = check(k_.name);
            return r;
        };
        printf("D %d %-6s B %d Sq %4d Sk %4d H %2d%s", D, s.what, s.b, s.sq, s.sk, s.h, s.packed ? " packed" : "");
        double first = 0;
        for (auto &k_ : cp->impls) {
            if (!k_.name) continue;
            const Result r = measure(k_);
            if (first == 0) first = r.us;
            printf(" | %s %7.1f us %5.1f TFLOP/s err max %.2e mean %.2e", k_.name, r.us, flop / (r.us * 1e-6) / 1e12,
                   r.max_err, r.mean_err);
            if (&k_ != &cp->impls[0]) printf(" %.2fx", first / r.us);
            if (!r.ok) printf(" (CUDA ERROR)");
        }
        printf("\n");
        cudaFree(q);
        if (!s.packed) {
            cudaFree(k);
            cudaFree(v);
        }
        cudaFree(o);
    }
    return 0;
}
