// The 3×3 convolutions (stride 1, padding 1) at a channels-last network's edges, where a few image or latent
// channels (NCHW, outside) meet the network's wide channels-last maps: each in one launch that reads one layout and
// writes the other, f16 or bf16 storage, f32 accumulation. They replace a cuDNN convolution over channels padded
// to 8 plus a transpose launch, where cuDNN runs an old tile-per-128-pixel kernel well below the GPU's width
// (SD1.5: 7 + 3 µs at the first convolution, 14 + 3.5 µs at the last, H100).
// - edge_out: (N, H, W, C) channels-last in, (N, K, H, W) out for K ≤ 8, the filter (8, 3, 3, C) (rows past K
//   zero). A block makes 16 consecutive pixels of one row × 8 output channels with mma.sync m16n8k16, a warp per
//   tap (their 9 partial products added through shared memory): per 32 input channels, each lane loads 16 bytes of
//   its two pixels and of its output channel's filter row and feeds two products. Which input channel is which k of a product does not matter as long as A and B agree: lane t of
//   a quad takes channels 8t..8t+3 into the first product (its k 2t, 2t+1, 2t+8, 2t+9) and 8t+4..8t+7 into the
//   second, so one 16-byte load per operand serves both. sm_80 and later (the host checks the build).
// - edge_in: (N, CIN, H, W) in, (N, H, W, K) channels-last out, the filter (K, 3, 3, CP) with CP ≥ CIN (columns
//   past CIN unused). A block makes 16 consecutive pixels of one row: the 3 × 18 input pixels they read go to
//   shared memory once, and each thread keeps two output channels' 9·CIN weights in registers, so that a warp
//   writes 128 contiguous bytes of a pixel per step.
// Constraints the host checks: edge_out C % 32 == 0, W % 16 == 0; edge_in CIN == 4, K even, K/2 ≤ 1024, W % 16 == 0;
// contiguous operands, 16-byte aligned.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace edge_conv {

__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
// Two values rounded to T, as the 4 bytes they take in memory.
template <typename T> __device__ __forceinline__ uint32_t pack(float a, float b) {
    const T v[2] = {from_f<T>(a), from_f<T>(b)};
    return *reinterpret_cast<const uint32_t *>(v);
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// D(16×8, f32) += A(16×16) · B(16×8).
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1, __half) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1, __nv_bfloat16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Block `blockIdx.x` takes pixels 16·MT·that.. (in N·H·W order; W % (16·MT) == 0 keeps them in one row), its warp
// `tap` one of the 9 taps over every input channel, so that each warp's loads are independent of the others' and
// many are in flight; the 9 partial products are added in tap order through shared memory. A warp's MT tiles of 16
// pixels share each filter load (the crate keeps MT = 1). Fragment rows are pixels, columns output channels: lane = 4g + t holds rows g and
// g + 8, columns 2t, 2t+1.
template <typename T, int MT, int AHEAD>
__device__ void edge_out(const T *__restrict__ x, const T *__restrict__ w, const T *__restrict__ bias,
                         T *__restrict__ out, uint32_t h, uint32_t wd, uint32_t c, uint32_t k) {
    __shared__ float part[9][MT][32][4];
    const uint32_t lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, tap = threadIdx.x / 32, hw = h * wd;
    const uint32_t p0 = blockIdx.x * 16 * MT, img = p0 / hw, y = p0 % hw / wd, x0 = p0 % wd;
    float acc[MT][4];
    const int iy = (int)y + (int)(tap / 3) - 1, dx = (int)(tap % 3) - 1;
    const bool row_ok = iy >= 0 && iy < (int)h;
    bool ok0[MT], ok1[MT];
    const uint4 *a0p[MT], *a1p[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;
        const int ix0 = (int)(x0 + 16 * m + g) + dx, ix1 = ix0 + 8;
        ok0[m] = row_ok && ix0 >= 0 && ix0 < (int)wd;
        ok1[m] = row_ok && ix1 >= 0 && ix1 < (int)wd;
        a0p[m] = reinterpret_cast<const uint4 *>(x + ((size_t)(img * h + (ok0[m] ? iy : 0)) * wd + (ok0[m] ? ix0 : 0)) * c) + t;
        a1p[m] = reinterpret_cast<const uint4 *>(x + ((size_t)(img * h + (ok1[m] ? iy : 0)) * wd + (ok1[m] ? ix1 : 0)) * c) + t;
    }
    const uint4 *bp = reinterpret_cast<const uint4 *>(w + ((size_t)g * 9 + tap) * c) + t;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    // AHEAD steps' loads issued before their products, so that a warp waits on the memory once per AHEAD.
    auto step = [&](const uint4 (&a0)[MT], const uint4 (&a1)[MT], uint4 b) {
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            mma(acc[m], a0[m].x, a1[m].x, a0[m].y, a1[m].y, b.x, b.y, T());
            mma(acc[m], a0[m].z, a1[m].z, a0[m].w, a1[m].w, b.z, b.w, T());
        }
    };
    uint32_t v = 0;
    for (; v + 4 * AHEAD <= c / 8; v += 4 * AHEAD) {
        uint4 a0[AHEAD][MT], a1[AHEAD][MT], b[AHEAD];
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
            b[u] = __ldg(bp + v + 4 * u);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                a0[u][m] = ok0[m] ? __ldg(a0p[m] + v + 4 * u) : zero;
                a1[u][m] = ok1[m] ? __ldg(a1p[m] + v + 4 * u) : zero;
            }
        }
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) step(a0[u], a1[u], b[u]);
    }
    for (; v < c / 8; v += 4) {
        uint4 a0[MT], a1[MT];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            a0[m] = ok0[m] ? __ldg(a0p[m] + v) : zero;
            a1[m] = ok1[m] ? __ldg(a1p[m] + v) : zero;
        }
        step(a0, a1, __ldg(bp + v));
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) part[tap][m][lane][i] = acc[m][i];
    __syncthreads();
    // Thread (tile m, lane l, accumulator i) of the fragments: pixel 16m + l/4 + 8·(i/2), channel 2·(l%4) + i%2.
    for (uint32_t e = threadIdx.x; e < 128 * MT; e += blockDim.x) {
        const uint32_t m = e / 128, l = e % 128 / 4, i = e % 4, ch = 2 * (l % 4) + i % 2;
        if (ch >= k) continue;
        float sum = to_f(bias[ch]);
#pragma unroll
        for (int q = 0; q < 9; ++q) sum += part[q][m][l][i];
        const uint32_t px = x0 + 16 * m + l / 4 + 8 * (i / 2);
        out[((size_t)(img * k + ch) * h + y) * wd + px] = from_f<T>(sum);
    }
}
#endif

// Block `blockIdx.x` takes pixels 16·that.. (W % 16 == 0 keeps them in one row); thread j output channels 2j and
// 2j+1, each summed as two independent halves of the taps so that the FMA chains overlap.
template <typename T, int CIN>
__device__ void edge_in(const T *__restrict__ x, const T *__restrict__ w, const T *__restrict__ bias,
                        T *__restrict__ out, uint32_t h, uint32_t wd, uint32_t cp, uint32_t k) {
    constexpr int PX = 16;
    __shared__ float4 patch[3][PX + 2];
    static_assert(CIN == 4, "a patch pixel is one float4");
    const uint32_t hw = h * wd, p0 = blockIdx.x * PX, img = p0 / hw, y = p0 % hw / wd, x0 = p0 % wd;
    for (uint32_t i = threadIdx.x; i < 3 * (PX + 2) * CIN; i += blockDim.x) {
        // Channel-major, so that consecutive threads read consecutive pixels of one channel plane.
        const uint32_t ci = i / (3 * (PX + 2)), r = i % (3 * (PX + 2)) / (PX + 2), col = i % (PX + 2);
        const int iy = (int)y + (int)r - 1, ix = (int)x0 + (int)col - 1;
        const float v = iy >= 0 && iy < (int)h && ix >= 0 && ix < (int)wd
                            ? to_f(x[((size_t)(img * CIN + ci) * h + iy) * wd + ix])
                            : 0.f;
        reinterpret_cast<float *>(&patch[r][col])[ci] = v;
    }
    const uint32_t j = threadIdx.x;
    const bool active = 2 * j < k;
    // A tap's four weights of an output channel are 8 contiguous bytes (the filter's columns are CP ≥ 4 wide and
    // start on 16 bytes): one load each.
    float w0[9][4], w1[9][4], b0 = 0.f, b1 = 0.f;
#pragma unroll
    for (int tap = 0; tap < 9; ++tap) {
        uint2 r0 = make_uint2(0, 0), r1 = r0;
        if (active) {
            r0 = __ldg(reinterpret_cast<const uint2 *>(w + ((size_t)(2 * j) * 9 + tap) * cp));
            r1 = __ldg(reinterpret_cast<const uint2 *>(w + ((size_t)(2 * j + 1) * 9 + tap) * cp));
        }
        const T *e0 = reinterpret_cast<const T *>(&r0), *e1 = reinterpret_cast<const T *>(&r1);
#pragma unroll
        for (int ci = 0; ci < 4; ++ci) w0[tap][ci] = to_f(e0[ci]), w1[tap][ci] = to_f(e1[ci]);
    }
    if (active) b0 = to_f(bias[2 * j]), b1 = to_f(bias[2 * j + 1]);
    __syncthreads();
    if (!active) return;
    uint32_t *o = reinterpret_cast<uint32_t *>(out + (size_t)p0 * k) + j;
#pragma unroll 2
    for (int px = 0; px < PX; ++px) {
        float s0 = b0, s1 = b1, u0 = 0.f, u1 = 0.f;
#pragma unroll
        for (int tap = 0; tap < 9; ++tap) {
            const float4 v = patch[tap / 3][px + tap % 3];
            float &a = tap % 2 ? u0 : s0, &b = tap % 2 ? u1 : s1;
            a = fmaf(v.x, w0[tap][0], fmaf(v.y, w0[tap][1], fmaf(v.z, w0[tap][2], fmaf(v.w, w0[tap][3], a))));
            b = fmaf(v.x, w1[tap][0], fmaf(v.y, w1[tap][1], fmaf(v.z, w1[tap][2], fmaf(v.w, w1[tap][3], b))));
        }
        o[(size_t)px * (k / 2)] = pack<T>(s0 + u0, s1 + u1);
    }
}

} // namespace edge_conv

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define EDGE_OUT_MT(T, S, NAME, MT, AHEAD)                                                                        \
    extern "C" __global__ void __launch_bounds__(288) NAME(const T *x, const T *w, const T *bias, T *out, uint32_t h, \
                                                           uint32_t wd, uint32_t c, uint32_t k) {                \
        edge_conv::edge_out<T, MT, AHEAD>(x, w, bias, out, h, wd, c, k);                                          \
    }
// One tile of 16 pixels per warp: four (a quarter of the filter reads) took longer at SD1.5's shapes, with fewer
// blocks resident (xtask/bench/edge_conv.cu).
#define EDGE_OUT(T, S) EDGE_OUT_MT(T, S, edge_out_##S, 1, 4)
#else
#define EDGE_OUT(T, S)
#endif
#define EDGE_CONV(T, S)                                                                                           \
    EDGE_OUT(T, S)                                                                                                \
    extern "C" __global__ void edge_in4_##S(const T *x, const T *w, const T *bias, T *out, uint32_t h, uint32_t wd, \
                                            uint32_t cp, uint32_t k) {                                            \
        edge_conv::edge_in<T, 4>(x, w, bias, out, h, wd, cp, k);                                                  \
    }
EDGE_CONV(__half, f16)
EDGE_CONV(__nv_bfloat16, bf16)
