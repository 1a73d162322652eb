// A first GEGLU-fused feed-forward product for Hopper (not in the crate yet): out[m, h] = (x·W1ᵀ + b1)[m, h] ·
// gelu_erf((x·W1ᵀ + b1)[m, H + h]), x M×K, W1 2H×K, f16 storage with f32 accumulation, against what the engine runs
// now (cuBLASLt's product, then crates/sdhive-cuda-kernels/src/kernels.cu's geglu with the bias), at the SD1.5
// UNet's four first feed-forward shapes; both timed as CUDA graphs of 20 calls, the fused output checked against
// the baseline's and against an f64 reference on a few rows. The fused kernel reads W' = W1 with its rows
// interleaved in blocks of BN/2 (a rows, then the matching g rows), so that one BN-column tile of the product holds
// matching a and g columns in the same thread's accumulators and GEGLU runs on the registers: the M×2H product is
// never written. wgmma from shared memory (128-byte swizzle) fed by a cp.async ring; docs/benchmarks.md has the H100
// figures and what a production version needs. Build here, run on the GPU machine (cuBLAS from PyTorch's wheels):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a xtask/bench/geglu_gemm.cu -o geglu_gemm -lcublasLt -lcublas
//   ./geglu_gemm
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>
#include "../../crates/sdhive-cuda-kernels/src/kernels.cu"

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

namespace fg {
template <int N> struct Wg;
template <> struct Wg<64> {
    static __device__ __forceinline__ void mma(float (&d)[32], uint64_t da, uint64_t db) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                     : "l"(da), "l"(db), "n"(1));
    }
};
template <> struct Wg<128> {
    static __device__ __forceinline__ void mma(float (&d)[64], uint64_t da, uint64_t db) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                     : "l"(da), "l"(db), "n"(1));
    }
};
template <> struct Wg<256> {
    static __device__ __forceinline__ void mma(float (&d)[128], uint64_t da, uint64_t db) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                     : "l"(da), "l"(db), "n"(1));
    }
};

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp16(uint32_t dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// K-major operand tile, rows of 64 f16 (128 bytes), 128-byte swizzle: 16-byte chunk c of row r sits at chunk
// c ^ (r % 8); 8-row groups of 1024 bytes (SBO), tile base 1024-aligned. Bits: 0-13 addr>>4, 16-29 LBO>>4 (unused
// here, 1), 32-45 SBO>>4, 62-63 layout (1: 128B swizzle). k-step s of 16 values starts 32·s bytes on.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

constexpr int BK = 64;

// NWG warpgroups of 64 rows (BM = 64·NWG), BN product columns (BN/2 outputs) per block, S stages, W1: wgmma
// wait<1> (prefetch distance S-2) or wait<0> (distance S-1). M % BM == 0, K % 64 == 0, H % (BN/2) == 0.
// EPI 0: GEGLU from the accumulators straight to global memory (half2 stores); 1: staged through shared memory for
// 16-byte coalesced stores; 2: as 1 without the erf (a·g, timing only); 3: no output (mainloop only, timing only);
// 4: as 1 with erf from Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7, one ex2 and one rcp on the SFU).
// MF: consecutive blocks walk M (share a W1 tile) rather than N.
template <int NWG, int BN, int S, bool W1, int MINB, int EPI, bool MF>
__global__ void __launch_bounds__(128 * NWG, MINB)
    fused_geglu(const __half *__restrict__ x, const __half *__restrict__ w, const __half *__restrict__ bias,
                __half *__restrict__ out, int M, int K, int H) {
    constexpr int BM = 64 * NWG, T = 128 * NWG;
    constexpr int A_BYTES = BM * 128, B_BYTES = BN * 128, STAGE = A_BYTES + B_BYTES;
    constexpr int D = W1 ? S - 2 : S - 1;
    static_assert(D >= 1, "prefetch distance");
    constexpr int A_CH = BM * 8 / T, B_CH = BN * 8 / T;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t base = (raw + 1023) & ~1023u;
    const int tid = threadIdx.x;
    const int n_tile = MF ? blockIdx.y : blockIdx.x, m0 = (MF ? blockIdx.x : blockIdx.y) * BM;
    const __half *xa = x + (size_t)m0 * K;
    const __half *wb = w + (size_t)n_tile * BN * K;
    const int KT = K / BK;

    // Per-thread copy offsets (same for every k tile).
    uint32_t a_dst[A_CH], b_dst[B_CH];
    uint32_t a_src[A_CH], b_src[B_CH];
#pragma unroll
    for (int i = 0; i < A_CH; ++i) {
        const int idx = tid + i * T, r = idx / 8, c = idx % 8;
        a_dst[i] = r * 128 + ((c ^ (r & 7)) << 4);
        a_src[i] = r * K + c * 8;
    }
#pragma unroll
    for (int i = 0; i < B_CH; ++i) {
        const int idx = tid + i * T, r = idx / 8, c = idx % 8;
        b_dst[i] = A_BYTES + r * 128 + ((c ^ (r & 7)) << 4);
        b_src[i] = r * K + c * 8;
    }
    auto load = [&](int kt) {
        if (kt < KT) {
            const uint32_t st = base + (kt % S) * STAGE;
            const int k0 = kt * BK;
#pragma unroll
            for (int i = 0; i < A_CH; ++i) cp16(st + a_dst[i], xa + a_src[i] + k0);
#pragma unroll
            for (int i = 0; i < B_CH; ++i) cp16(st + b_dst[i], wb + b_src[i] + k0);
        }
        cp_commit();
    };

    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;

    const int wg = tid / 128;
#pragma unroll
    for (int s = 0; s < D; ++s) load(s);
    for (int kt = 0; kt < KT; ++kt) {
        cp_wait<D - 1>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        load(kt + D);
        const uint32_t st = base + (kt % S) * STAGE;
        const uint64_t da = desc_sw128(st + wg * 64 * 128), db = desc_sw128(st + A_BYTES);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) Wg<BN>::mma(acc, da + 2 * kk, db + 2 * kk);
        wgmma_commit();
        if constexpr (W1) wgmma_wait<1>(); else wgmma_wait<0>();
    }
    wgmma_wait<0>();
    fence_regs(acc);

    // Epilogue: a column c < BN/2 is acc[i] with c = 8(i/4) + 2t + i%2, its gate acc[i + BN/4].
    const int warp = (tid % 128) / 32, lane = tid % 32, t = lane % 4;
    const int h0 = n_tile * (BN / 2);
    if constexpr (EPI == 3) {
        float z = 0.f;
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) z += acc[i];
        if (z == 12345.678f) out[tid] = __float2half(z);
        return;
    }
    auto gelu = [](float a, float g) {
        if constexpr (EPI == 2) return a * g;
        else if constexpr (EPI == 4) {
            // 1 + erf(g/sqrt2) = 2 - q for g >= 0, q for g < 0, q = poly(t)·exp(-z²), z = |g|/sqrt2.
            const float z = fabsf(g) * 0.70710678118654752f;
            const float t = __fdividef(1.f, fmaf(0.3275911f, z, 1.f));
            const float poly =
                t * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 1.061405429f, -1.453152027f), 1.421413741f), -0.284496736f),
                         0.254829592f);
            const float q = poly * __expf(-z * z);
            return a * 0.5f * g * (g >= 0.f ? 2.f - q : q);
        } else return a * 0.5f * g * (1.f + erff(g * 0.70710678118654752f));
    };
    if constexpr (EPI == 0) {
        const int row0 = m0 + wg * 64 + warp * 16 + lane / 4;
#pragma unroll
        for (int j = 0; j < BN / 16; ++j) {
            const int h = h0 + 8 * j + 2 * t;
            const float2 ba = __half22float2(*reinterpret_cast<const __half2 *>(bias + h));
            const float2 bg = __half22float2(*reinterpret_cast<const __half2 *>(bias + H + h));
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int i = 4 * j + 2 * hr;
                const float o0 = gelu(acc[i] + ba.x, acc[i + BN / 4] + bg.x);
                const float o1 = gelu(acc[i + 1] + ba.y, acc[i + 1 + BN / 4] + bg.y);
                *reinterpret_cast<__half2 *>(out + (size_t)(row0 + 8 * hr) * H + h) = __floats2half2_rn(o0, o1);
            }
        }
    } else {
        // Rows of BN/2 outputs padded by 16 bytes (conflict-free half2 writes), one 64-row slab per warpgroup.
        constexpr int PITCH = BN + 16, CH = BN / 16; // bytes per row, 16-byte chunks per row
        __syncthreads(); // every warpgroup's wgmma reads of the stages are done
        const uint32_t slab = base + wg * 64 * PITCH;
        const int r0 = warp * 16 + lane / 4;
#pragma unroll
        for (int j = 0; j < BN / 16; ++j) {
            const int c = 8 * j + 2 * t;
            const float2 ba = __half22float2(*reinterpret_cast<const __half2 *>(bias + h0 + c));
            const float2 bg = __half22float2(*reinterpret_cast<const __half2 *>(bias + H + h0 + c));
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int i = 4 * j + 2 * hr;
                const float o0 = gelu(acc[i] + ba.x, acc[i + BN / 4] + bg.x);
                const float o1 = gelu(acc[i + 1] + ba.y, acc[i + 1 + BN / 4] + bg.y);
                const __half2 v = __floats2half2_rn(o0, o1);
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(slab + (r0 + 8 * hr) * PITCH + c * 2),
                             "r"(*reinterpret_cast<const uint32_t *>(&v)));
            }
        }
        // this warpgroup's slab is written (immediate barrier ids: a register id makes ptxas reserve all 16)
        if (wg == 0) asm volatile("bar.sync 1, 128;\n" ::: "memory");
        else asm volatile("bar.sync 2, 128;\n" ::: "memory");
        const int lt = tid % 128;
#pragma unroll
        for (int q = 0; q < 64 * CH / 128; ++q) {
            const int idx = lt + q * 128, r = idx / CH, c = idx % CH;
            uint4 v;
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(slab + r * PITCH + c * 16));
            *reinterpret_cast<uint4 *>(out + (size_t)(m0 + wg * 64 + r) * H + h0 + c * 8) = v;
        }
    }
}

template <int NWG, int BN, int S, bool W1, int MINB, int EPI, bool MF> struct Cfg {
    static constexpr int SMEM = S * (64 * NWG * 128 + BN * 128) + 1024;
    static const char *name() {
        static char buf[64];
        snprintf(buf, sizeof buf, "wg%d bn%d s%d w%d mb%d epi%d %s", NWG, BN, S, W1 ? 1 : 0, MINB, EPI, MF ? "mfast" : "nfast");
        return buf;
    }
    static void setup() {
        CK(cudaFuncSetAttribute(fused_geglu<NWG, BN, S, W1, MINB, EPI, MF>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    }
    static bool ok(int M, int K, int H) { return M % (64 * NWG) == 0 && K % 64 == 0 && H % (BN / 2) == 0; }
    static void launch(const __half *x, const __half *w, const __half *b, __half *o, int M, int K, int H,
                       cudaStream_t s) {
        dim3 grid = MF ? dim3(M / (64 * NWG), 2 * H / BN) : dim3(2 * H / BN, M / (64 * NWG));
        fused_geglu<NWG, BN, S, W1, MINB, EPI, MF><<<grid, 128 * NWG, SMEM, s>>>(x, w, b, o, M, K, H);
    }
};

} // namespace fg

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

struct Problem {
    int M, K, H, count;
    __half *x, *w, *b, *ff1, *ref, *fo, *wi[3]; // wi: W1 interleaved for BN 64, 128, 256
    std::vector<__half> hx, hw, hb, href;
    std::vector<int> rows;       // rows checked against the f64 reference
    std::vector<double> exact;   // rows.size() × H
};

static __half *wi_for(Problem &p, int bn) { return p.wi[bn == 64 ? 0 : bn == 128 ? 1 : 2]; }

static double max_err(const std::vector<__half> &a, const std::vector<__half> &b) {
    double m = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        double d = fabs((double)__half2float(a[i]) - (double)__half2float(b[i]));
        if (!(d <= m)) m = d; // NaN propagates
    }
    return m;
}
static double exact_err(const Problem &p, const std::vector<__half> &o) {
    double m = 0;
    for (size_t r = 0; r < p.rows.size(); ++r)
        for (int h = 0; h < p.H; ++h) {
            double d = fabs((double)__half2float(o[(size_t)p.rows[r] * p.H + h]) - p.exact[r * p.H + h]);
            if (!(d <= m)) m = d;
        }
    return m;
}

static Timer tm;
static float g_best[8];
static int g_shape;

template <typename C> static void run_cfg(Problem &p) {
    if (!C::ok(p.M, p.K, p.H)) return;
    C::setup();
    const __half *wi = wi_for(p, 0); // placeholder, replaced below
    (void)wi;
    CK(cudaMemset(p.fo, 0xff, (size_t)p.M * p.H * 2));
    auto go = [&] { C::launch(p.x, wi_for(p, C::BNv), p.b, p.fo, p.M, p.K, p.H, tm.s); };
    go();
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(tm.s));
    std::vector<__half> o((size_t)p.M * p.H);
    CK(cudaMemcpy(o.data(), p.fo, o.size() * 2, cudaMemcpyDeviceToHost));
    const double e_ref = max_err(o, p.href), e_exact = exact_err(p, o);
    const float us = tm.time(go);
    printf("  fused %-22s %8.2f us   max|fused-baseline| %.3g   max|fused-exact| %.3g\n", C::name(), us, e_ref,
           e_exact);
    if (!C::TIMING_ONLY && e_ref < 0.05 && us < g_best[g_shape]) g_best[g_shape] = us;
}

template <int NWG, int BN, int S, bool W1, int MINB, int EPI = 1, bool MF = false>
struct C : fg::Cfg<NWG, BN, S, W1, MINB, EPI, MF> {
    static constexpr bool TIMING_ONLY = EPI == 2 || EPI == 3;
    static constexpr int BNv = BN;
};

int main() {
    CK(cudaStreamCreate(&tm.s));
    CK(cudaEventCreate(&tm.e0));
    CK(cudaEventCreate(&tm.e1));
    cublasLtHandle_t lt;
    CL(cublasLtCreate(&lt));
    const size_t WS = 32 << 20;
    void *ws;
    CK(cudaMalloc(&ws, WS));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);

    Problem shapes[4] = {{8192, 320, 1280, 5}, {2048, 640, 2560, 5}, {512, 1280, 5120, 5}, {128, 1280, 5120, 1}};
    float base_sum[4], base_prod[4], base_gg[4];
    for (int si = 0; si < 4; ++si) {
        Problem &p = shapes[si];
        g_shape = si;
        g_best[si] = 1e30f;
        const int M = p.M, K = p.K, H = p.H, N = 2 * H;
        printf("\nshape M %d K %d H %d (x%d per step)\n", M, K, H, p.count);
        uint64_t seed = 12345 + si;
        p.hx.resize((size_t)M * K);
        p.hw.resize((size_t)N * K);
        p.hb.resize(N);
        const float ws_ = 3.f / sqrtf((float)K);
        for (auto &v : p.hx) v = __float2half(frand(seed));
        for (auto &v : p.hw) v = __float2half(frand(seed) * ws_);
        for (auto &v : p.hb) v = __float2half(0.5f * frand(seed));
        CK(cudaMalloc(&p.x, p.hx.size() * 2));
        CK(cudaMalloc(&p.w, p.hw.size() * 2));
        CK(cudaMalloc(&p.b, p.hb.size() * 2));
        CK(cudaMalloc(&p.ff1, (size_t)M * N * 2));
        CK(cudaMalloc(&p.ref, (size_t)M * H * 2));
        CK(cudaMalloc(&p.fo, (size_t)M * H * 2));
        CK(cudaMemcpy(p.x, p.hx.data(), p.hx.size() * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(p.w, p.hw.data(), p.hw.size() * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(p.b, p.hb.data(), p.hb.size() * 2, cudaMemcpyHostToDevice));
        const int bns[3] = {64, 128, 256};
        for (int q = 0; q < 3; ++q) {
            const int bn = bns[q];
            std::vector<__half> wi((size_t)N * K);
            for (int r = 0; r < N; ++r) {
                const int t = r / bn, c = r % bn;
                const int src = c < bn / 2 ? t * bn / 2 + c : H + t * bn / 2 + c - bn / 2;
                memcpy(&wi[(size_t)r * K], &p.hw[(size_t)src * K], K * 2);
            }
            CK(cudaMalloc(&p.wi[q], wi.size() * 2));
            CK(cudaMemcpy(p.wi[q], wi.data(), wi.size() * 2, cudaMemcpyHostToDevice));
        }
        // f64 reference rows
        p.rows = {0, 1, 77, M / 2 + 5, M - 1};
        p.exact.resize(p.rows.size() * H);
        for (size_t r = 0; r < p.rows.size(); ++r) {
            std::vector<double> ff(N);
            for (int n = 0; n < N; ++n) {
                double s = __half2float(p.hb[n]);
                for (int k = 0; k < K; ++k)
                    s += (double)__half2float(p.hx[(size_t)p.rows[r] * K + k]) * __half2float(p.hw[(size_t)n * K + k]);
                ff[n] = s;
            }
            for (int h = 0; h < H; ++h) {
                double a = ff[h], g = ff[H + h];
                p.exact[r * H + h] = a * 0.5 * g * (1.0 + erf(g / sqrt(2.0)));
            }
        }

        // cuBLASLt: D (N×M col-major = M×N row-major) = op(A)·B, A = W1 as K×N col-major transposed, B = x as K×M.
        cublasLtMatmulDesc_t desc, desc_b;
        CL(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        CL(cublasLtMatmulDescCreate(&desc_b, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        for (auto d : {desc, desc_b}) {
            CL(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
            CL(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
        }
        cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
        CL(cublasLtMatmulDescSetAttribute(desc_b, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep));
        CL(cublasLtMatmulDescSetAttribute(desc_b, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.b, sizeof p.b));
        cublasLtMatrixLayout_t la, lb, lc;
        CL(cublasLtMatrixLayoutCreate(&la, CUDA_R_16F, K, N, K));
        CL(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16F, K, M, K));
        CL(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16F, N, M, N));
        cublasLtMatmulPreference_t pref;
        CL(cublasLtMatmulPreferenceCreate(&pref));
        CL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &WS, sizeof WS));
        cublasLtMatmulHeuristicResult_t hr, hr_b;
        int got = 0;
        CL(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &hr, &got));
        if (!got) { fprintf(stderr, "no algo\n"); return 1; }
        CL(cublasLtMatmulAlgoGetHeuristic(lt, desc_b, la, lb, lc, lc, pref, 1, &hr_b, &got));
        if (!got) { fprintf(stderr, "no bias algo\n"); return 1; }
        const float one = 1.f, zero = 0.f;
        auto prod = [&] {
            CL(cublasLtMatmul(lt, desc, &one, p.w, la, p.x, lb, &zero, p.ff1, lc, p.ff1, lc, &hr.algo, ws, WS, tm.s));
        };
        auto prod_b = [&] {
            CL(cublasLtMatmul(lt, desc_b, &one, p.w, la, p.x, lb, &zero, p.ff1, lc, p.ff1, lc, &hr_b.algo, ws, WS,
                              tm.s));
        };
        const size_t items = (size_t)M * H / 8;
        const unsigned grid = (unsigned)std::min<size_t>((items + 255) / 256, 65535);
        auto gg = [&](const __half *bias) { geglu_f16<<<grid, 256, 0, tm.s>>>(p.ff1, bias, p.ref, (size_t)M, (uint32_t)H); };
        // Baseline output, as the engine: product without bias, GEGLU adding it.
        prod();
        gg(p.b);
        CK(cudaGetLastError());
        CK(cudaStreamSynchronize(tm.s));
        p.href.resize((size_t)M * H);
        CK(cudaMemcpy(p.href.data(), p.ref, p.href.size() * 2, cudaMemcpyDeviceToHost));
        const double be = exact_err(p, p.href);
        const float t_prod = tm.time(prod), t_prod_b = tm.time(prod_b);
        const float t_gg = tm.time([&] { gg(p.b); }), t_gg0 = tm.time([&] { gg(nullptr); });
        const float t_sum = tm.time([&] { prod(); gg(p.b); });
        const float t_sum_b = tm.time([&] { prod_b(); gg(nullptr); });
        printf("  baseline: product %.2f us (bias epilogue %.2f), geglu+bias %.2f (no bias %.2f), product+geglu %.2f "
               "(bias-epilogue variant %.2f) us; max|baseline-exact| %.3g\n",
               t_prod, t_prod_b, t_gg, t_gg0, t_sum, t_sum_b, be);
        base_sum[si] = t_sum;
        base_prod[si] = t_prod;
        base_gg[si] = t_gg;
        // restore the baseline output (timing overwrote it with the same values anyway)
        run_cfg<C<2, 128, 3, false, 2, 1>>(p);
        run_cfg<C<2, 128, 3, false, 2, 4>>(p);
        run_cfg<C<2, 128, 3, false, 2, 4, true>>(p);
        run_cfg<C<2, 128, 5, true, 1, 4, true>>(p);
        run_cfg<C<2, 64, 4, true, 2, 4>>(p);
        run_cfg<C<2, 256, 4, true, 1, 4>>(p);
        cudaFree(p.x); cudaFree(p.w); cudaFree(p.b); cudaFree(p.ff1); cudaFree(p.ref); cudaFree(p.fo);
        for (auto q : p.wi) cudaFree(q);
    }
    printf("\nper SD1.5 step (counts x5, x5, x5, x1):\n");
    double tb = 0, tf = 0;
    for (int si = 0; si < 4; ++si) {
        printf("  shape %d: baseline %.2f us (product %.2f + geglu %.2f), best fused %.2f us\n", si, base_sum[si],
               base_prod[si], base_gg[si], g_best[si]);
        tb += shapes[si].count * base_sum[si];
        tf += shapes[si].count * std::min(g_best[si], base_sum[si]);
    }
    printf("  total baseline %.1f us, with the best of fused/baseline per shape %.1f us\n", tb, tf);
    return 0;
}
