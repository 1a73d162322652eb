// Fused multi-head attention for the UNet's transformer blocks: softmax(q kᵀ · scale) v without materialising
// the score matrix (the online softmax of Milakov & Gimelshein, tiled as in Dao's FlashAttention), on tensor
// cores through the WMMA API.
//
// q, k, v are the projections' (B, S, H·D) layout with any batch and sequence strides, so the heads are read in
// place; the output is written contiguous (B, Sq, H·D), ready for the out-projection: no split or merge copies.
// A block of 4 warps owns 64 query rows of one (batch, head); each warp owns 16 of them. Key tiles are copied to
// shared memory asynchronously (cp.async), the next one while the block works on the current one; each warp
// computes its 16×BK scores in f32, updates its rows' running max and sum, rounds the probabilities to the storage
// type (as every fp16 flash kernel does) and accumulates P·V. Shared memory is dynamic: `flash_smem_bytes` on
// the host side must match `SmemLayout` here. The
// head dimension D (a multiple of 8, at most 160) is zero-padded to DP, a multiple of 16. f16 and bf16 storage
// (bf16 WMMA needs sm_80; the host only launches these kernels there).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <mma.h>
#include <stdint.h>

using namespace nvcuda;

namespace {

constexpr int WARPS = 4;
constexpr int ROWS = 16 * WARPS;

__device__ __forceinline__ uint32_t pack2(__half a, __half b) {
    return (uint32_t)__half_as_ushort(a) | ((uint32_t)__half_as_ushort(b) << 16);
}
__device__ __forceinline__ uint32_t pack2(__nv_bfloat16 a, __nv_bfloat16 b) {
    return (uint32_t)__bfloat16_as_ushort(a) | ((uint32_t)__bfloat16_as_ushort(b) << 16);
}
__device__ __forceinline__ __half cvt(float v, __half) { return __float2half(v); }
__device__ __forceinline__ __nv_bfloat16 cvt(float v, __nv_bfloat16) { return __float2bfloat16(v); }

// Eight floats rounded to T, as one 16-byte word.
template <typename T> __device__ __forceinline__ uint4 pack8(const float *v) {
    T t{};
    return make_uint4(pack2(cvt(v[0], t), cvt(v[1], t)), pack2(cvt(v[2], t), cvt(v[3], t)),
                      pack2(cvt(v[4], t), cvt(v[5], t)), pack2(cvt(v[6], t), cvt(v[7], t)));
}

// Copies `rows` rows of D values (16-byte chunks; rows past `valid` and columns past `d` as zeros) from global
// rows `stride` apart into shared rows LD apart.
template <typename T, int DP, int LD>
__device__ __forceinline__ void stage(T *dst, const T *src, int rows, int valid, int d, long long stride) {
    constexpr int CH = DP / 8;
    for (int i = threadIdx.x; i < rows * CH; i += blockDim.x) {
        int r = i / CH, c = (i % CH) * 8;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (r < valid && c < d) val = *reinterpret_cast<const uint4 *>(src + r * stride + c);
        *reinterpret_cast<uint4 *>(dst + r * LD + c) = val;
    }
}

// The same copy without waiting for it: cp.async with a zero fill where the source is out of range (no byte is
// read then; the base address stands in). Completes at the next cp.async.wait_group that covers its group.
template <typename T, int DP, int LD>
__device__ __forceinline__ void stage_async(T *dst, const T *src, int rows, int valid, int d, long long stride) {
    constexpr int CH = DP / 8;
    for (int i = threadIdx.x; i < rows * CH; i += blockDim.x) {
        int r = i / CH, c = (i % CH) * 8;
        const bool ok = r < valid && c < d;
        const T *from = ok ? src + r * stride + c : src;
        const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst + r * LD + c));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from), "r"(ok ? 16 : 0));
    }
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int N> __device__ __forceinline__ void wait_async() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

extern __shared__ __align__(128) unsigned char flash_smem[];

template <typename T, int DP, int BK>
__device__ void flash_attention(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                                T *__restrict__ o, int sq, int sk, int d, int heads, long long q_bs,
                                long long q_ss, long long k_bs, long long k_ss, long long v_bs, long long v_ss,
                                float scale_log2) {
    constexpr int LD = DP + 8;  // padded rows keep the fragment loads off one shared-memory bank
    constexpr int LDS = BK + 4; // scores, f32
    constexpr int LDP = BK + 8; // probabilities, T, over the same bytes as the scores
    constexpr int HALF = BK / 2;
    constexpr int TILE = BK * LD; // one K or V tile
    static_assert(4 * BK >= ROWS, "the query tile is staged in the K/V buffers");
    // Two stages of (K, V), then each warp's scores, then each warp's 16×16 output partials.
    T *kv = reinterpret_cast<T *>(flash_smem);
    float *scores = reinterpret_cast<float *>(kv + 4 * TILE);
    float *pv = scores + WARPS * 16 * LDS;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = lane / 2, part = lane % 2; // each row's softmax and output belong to two lanes
    const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * ROWS;
    const T *qh = q + b * q_bs + (long long)h * d + q0 * q_ss;
    const T *kh = k + b * k_bs + (long long)h * d;
    const T *vh = v + b * v_bs + (long long)h * d;

    stage<T, DP, LD>(kv, qh, ROWS, sq - q0, d, q_ss);
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qf[DP / 16];
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) wmma::load_matrix_sync(qf[kk], kv + warp * 16 * LD + kk * 16, LD);
    __syncthreads();

    float *s = scores + warp * 16 * LDS;
    T *p = reinterpret_cast<T *>(s);
    float *pw = pv + warp * 16 * 16;
    float m = -INFINITY, l = 0.f;
    float acc[DP / 2];
#pragma unroll
    for (int i = 0; i < DP / 2; ++i) acc[i] = 0.f;

    stage_async<T, DP, LD>(kv, kh, BK, sk, d, k_ss);
    stage_async<T, DP, LD>(kv + TILE, vh, BK, sk, d, v_ss);
    for (int k0 = 0, t = 0; k0 < sk; k0 += BK, ++t) {
        // Prefetch the next tile into the other stage (free since the last iteration's closing barrier), then wait
        // for this one.
        if (k0 + BK < sk) {
            T *next = kv + 2 * TILE * ((t + 1) % 2);
            stage_async<T, DP, LD>(next, kh + (k0 + BK) * k_ss, BK, sk - k0 - BK, d, k_ss);
            stage_async<T, DP, LD>(next + TILE, vh + (k0 + BK) * v_ss, BK, sk - k0 - BK, d, v_ss);
            wait_async<2>();
        } else {
            wait_async<0>();
        }
        __syncthreads();
        const T *ks = kv + 2 * TILE * (t % 2), *vs = ks + TILE;

#pragma unroll
        for (int n = 0; n < BK / 16; ++n) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> sf;
            wmma::fill_fragment(sf, 0.f);
#pragma unroll
            for (int kk = 0; kk < DP / 16; ++kk) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kf;
                wmma::load_matrix_sync(kf, ks + n * 16 * LD + kk * 16, LD);
                wmma::mma_sync(sf, qf[kk], kf, sf);
            }
            wmma::store_matrix_sync(s + n * 16, sf, LDS, wmma::mem_row_major);
        }
        __syncwarp();

        float x[HALF];
        float mx = -INFINITY;
#pragma unroll
        for (int e = 0; e < HALF; e += 4) {
            const float4 v4 = *reinterpret_cast<const float4 *>(s + row * LDS + part * HALF + e);
            const float vals[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                x[e + i] = k0 + part * HALF + e + i < sk ? vals[i] * scale_log2 : -INFINITY;
                mx = fmaxf(mx, x[e + i]);
            }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        // The first tile always holds key 0, so m_new is finite and alpha is 0 there.
        const float m_new = fmaxf(m, mx);
        const float alpha = exp2f(m - m_new);
        float sum = 0.f;
        __syncwarp(); // every lane has read its scores before the probabilities overwrite them
#pragma unroll
        for (int e = 0; e < HALF; e += 8) {
            float pe[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                pe[i] = exp2f(x[e + i] - m_new);
                sum += pe[i];
            }
            *reinterpret_cast<uint4 *>(p + row * LDP + part * HALF + e) = pack8<T>(pe);
        }
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        l = l * alpha + sum;
        m = m_new;
        __syncwarp();

        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf[BK / 16];
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) wmma::load_matrix_sync(pf[kk], p + kk * 16, LDP);
#pragma unroll
        for (int j = 0; j < DP / 16; ++j) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> of;
            wmma::fill_fragment(of, 0.f);
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vf;
                wmma::load_matrix_sync(vf, vs + kk * 16 * LD + j * 16, LD);
                wmma::mma_sync(of, pf[kk], vf, of);
            }
            wmma::store_matrix_sync(pw, of, 16, wmma::mem_row_major);
            __syncwarp();
            const float4 lo = *reinterpret_cast<const float4 *>(pw + row * 16 + part * 8),
                         hi = *reinterpret_cast<const float4 *>(pw + row * 16 + part * 8 + 4);
            const float part_pv[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[j * 8 + e] = acc[j * 8 + e] * alpha + part_pv[e];
            __syncwarp();
        }
        __syncthreads(); // every warp is done with this stage before the next prefetch replaces it
    }

    const int qr = q0 + warp * 16 + row;
    if (qr >= sq) return;
    const float inv = 1.f / l;
    T *orow = o + ((long long)b * sq + qr) * heads * d + (long long)h * d;
#pragma unroll
    for (int j = 0; j < DP / 16; ++j) {
        int col = j * 16 + part * 8;
        if (col < d) {
            float out[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) out[e] = acc[j * 8 + e] * inv;
            *reinterpret_cast<uint4 *>(orow + col) = pack8<T>(out);
        }
    }
}

} // namespace

#define FLASH(DP, BK, T, SFX)                                                                                     \
    extern "C" __global__ void __launch_bounds__(128)                                                            \
        flash_attention_d##DP##_##SFX(const T *q, const T *k, const T *v, T *o, int sq, int sk, int d, int heads, \
                                      long long q_bs, long long q_ss, long long k_bs, long long k_ss,             \
                                      long long v_bs, long long v_ss, float scale_log2) {                         \
        flash_attention<T, DP, BK>(q, k, v, o, sq, sk, d, heads, q_bs, q_ss, k_bs, k_ss, v_bs, v_ss,              \
                                   scale_log2);                                                                   \
    }

// 64-key tiles up to DP 96, 32-key tiles above (shared memory per block: see `flash_smem_bytes` in attention.rs).
#define FLASH_BOTH(DP, BK)                                                                                        \
    FLASH(DP, BK, __half, f16)                                                                                    \
    FLASH(DP, BK, __nv_bfloat16, bf16)

FLASH_BOTH(16, 64)
FLASH_BOTH(32, 64)
FLASH_BOTH(48, 64)
FLASH_BOTH(64, 64)
FLASH_BOTH(80, 64)
FLASH_BOTH(96, 64)
FLASH_BOTH(128, 32)
FLASH_BOTH(160, 32)
