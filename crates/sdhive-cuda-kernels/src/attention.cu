// Fused multi-head attention for the UNet's transformer blocks: softmax(q kᵀ · scale) v without materialising
// the score matrix (the online softmax of Milakov & Gimelshein, tiled as in Dao's FlashAttention 2), on tensor
// cores.
//
// q, k, v are the projections' (B, S, H·D) layout with any batch and sequence strides, so the heads are read in
// place; the output is written contiguous (B, Sq, H·D), ready for the out-projection: no split or merge copies. A
// block of WARPS warps owns 16·WARPS·ATOMS query rows of one (batch, head); each warp owns ATOMS atoms of 16 rows
// and keeps their scores, probabilities, running max and sum and output in registers. Key tiles are copied to shared
// memory asynchronously (cp.async), the next one while the block works on the current one. With SPLIT key groups,
// SPLIT sets of such warps share the rows and each takes its own BK keys of every SPLIT·BK-key stage; the groups'
// maxima, sums and outputs are merged through shared memory at the end (small grids: a shorter key loop per warp,
// more warps per SM). Probabilities are rounded to the storage type before the product with V, as every fp16 flash
// kernel does. The head dimension D (a multiple of 8, at most 160) is zero-padded to DP, a multiple of 16, for the
// scores; the product with V skips the output columns past D (SD1.5's D 40 in DP 48: five 8-wide tiles, not six).
// Scores are masked only in a key group's last tile, the one that can pass the end. f16 and bf16 storage (sm_80 and
// later; the host only launches these kernels there). Shared memory is dynamic: `smem_bytes` in attention.rs must
// match the layout. Further down, two kernels of their own: `cross_attention` for short key sequences (the
// cross-attention over the text tokens), which holds all keys and values in shared memory, and the Hopper (sm_90a)
// wgmma kernels in `namespace hopper`.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>
// The Hopper kernels' mbarriers and tensor map argument (TmaMap).
#include "wgmma_common.cuh"

namespace {

__device__ __forceinline__ uint32_t pack2(__half a, __half b) {
    return (uint32_t)__half_as_ushort(a) | ((uint32_t)__half_as_ushort(b) << 16);
}
__device__ __forceinline__ uint32_t pack2(__nv_bfloat16 a, __nv_bfloat16 b) {
    return (uint32_t)__bfloat16_as_ushort(a) | ((uint32_t)__bfloat16_as_ushort(b) << 16);
}
__device__ __forceinline__ __half cvt(float v, __half) { return __float2half(v); }
__device__ __forceinline__ __nv_bfloat16 cvt(float v, __nv_bfloat16) { return __float2bfloat16(v); }

// Copies `rows` rows of D values (16-byte chunks; rows past `valid` and columns past `d` as zeros) from global
// rows `stride` apart into shared rows LD apart, without waiting for it: cp.async with a zero fill where the source
// is out of range (no byte is read then; the base address stands in). Completes at the next cp.async.wait_group
// that covers its group.
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

// Tensor-core products through PTX mma.sync m16n8k16 (whose fragment layouts are specified, unlike WMMA's), K and
// V fragments read with ldmatrix. In the accumulator of an
// m16n8 tile, lane l holds row g = l/4 at columns 2t, 2t+1 (t = l%4) and row g+8 at the same columns; two adjacent
// score tiles are exactly the A operand of the next product, so P never leaves the registers. Each row's max and
// sum live in the four lanes of its quad. Shared memory holds only the two stages of K and V (and the query tile
// while it is loaded).
template <typename T> struct MmaType;
template <> struct MmaType<__half> {
    static __device__ __forceinline__ void mma(float *c, const uint32_t *a, const uint32_t *b) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};
template <> struct MmaType<__nv_bfloat16> {
    static __device__ __forceinline__ void mma(float *c, const uint32_t *a, const uint32_t *b) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};

__device__ __forceinline__ void ldmatrix_x4(uint32_t *r, const void *p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t *r, const void *p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

template <typename T> __device__ __forceinline__ uint32_t pack_f2(float a, float b) {
    T t{};
    return pack2(cvt(a, t), cvt(b, t));
}

// exp2 on the special-function unit, flushing subnormal results to zero (they are far below what a probability
// rounded to f16/bf16 can hold); the library exp2f adds range handling around the same instruction.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The maxima of an atom's rows g and g + 8 over its NS score tiles (m16n8 accumulators: [0], [1] row g, [2], [3]
// row g + 8), across the quad of lanes that holds each row.
template <int NS> __device__ __forceinline__ void atom_row_max(const float (&s)[NS][4], float &x0, float &x1) {
    x0 = -INFINITY;
    x1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < NS; ++n) {
        x0 = fmaxf(x0, fmaxf(s[n][0], s[n][1]));
        x1 = fmaxf(x1, fmaxf(s[n][2], s[n][3]));
    }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffff, x0, off));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffff, x1, off));
    }
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t *r, const void *p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}

template <typename T, int DP, int BK, int WARPS, int ATOMS, int SPLIT = 1>
__device__ void flash_attention(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                                T *__restrict__ o, int sq, int sk, int d, int heads, long long q_bs, long long q_ss,
                                long long k_bs, long long k_ss, long long v_bs, long long v_ss, float scale_log2) {
    constexpr int LD = DP + 8; // 16-byte row padding: the eight rows of an ldmatrix hit different banks
    constexpr int KEYS = BK * SPLIT; // keys per stage; key group s takes its rows s·BK..s·BK+BK-1
    constexpr int TILE = KEYS * LD;
    constexpr int NS = BK / 8; // score tiles per key tile
    constexpr int NO = DP / 8; // output tiles; those at or past the head dimension d are skipped
    constexpr int ROWS = 16 * WARPS * ATOMS;
    static_assert(DP % 16 == 0 && BK % 16 == 0, "tile shapes");
    T *kv = reinterpret_cast<T *>(flash_smem);

    const int warp = threadIdx.x / 32 % WARPS, split = threadIdx.x / (32 * WARPS), lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * ROWS;
    const int no = (d + 7) / 8;
    const T *qh = q + b * q_bs + (long long)h * d + q0 * q_ss;
    const T *kh = k + b * k_bs + (long long)h * d;
    const T *vh = v + b * v_bs + (long long)h * d;

    // The query tile in the second stage, requested before the first key tile so that their latencies overlap; the
    // wait covers only the query group.
    stage_async<T, DP, LD>(kv + 2 * TILE, qh, ROWS, sq - q0, d, q_ss);
    stage_async<T, DP, LD>(kv, kh, KEYS, sk, d, k_ss);
    stage_async<T, DP, LD>(kv + TILE, vh, KEYS, sk, d, v_ss);
    wait_async<2>();
    __syncthreads();
    // A fragments of the warp's query rows, per 16-row atom: matrices (rows 0-7 | 8-15) × (columns 0-7 | 8-15) of
    // each k-step.
    uint32_t qf[ATOMS][DP / 16][4];
#pragma unroll
    for (int a = 0; a < ATOMS; ++a) {
        const int r = (warp * ATOMS + a) * 16 + (lane % 8) + ((lane / 8) % 2) * 8, c = (lane / 16) * 8;
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk) ldmatrix_x4(qf[a][kk], kv + 2 * TILE + r * LD + kk * 16 + c);
    }
    __syncthreads();

    float acc[ATOMS][NO][4];
#pragma unroll
    for (int a = 0; a < ATOMS; ++a)
#pragma unroll
        for (int j = 0; j < NO; ++j) acc[a][j][0] = acc[a][j][1] = acc[a][j][2] = acc[a][j][3] = 0.f;
    // Rows g and g + 8 of each atom: running max of the raw scores, this lane's share of the sums.
    float m0[ATOMS], m1[ATOMS], l0[ATOMS], l1[ATOMS];
#pragma unroll
    for (int a = 0; a < ATOMS; ++a) {
        m0[a] = m1[a] = -INFINITY;
        l0[a] = l1[a] = 0.f;
    }

    for (int s0 = 0, it = 0; s0 < sk; s0 += KEYS, ++it) {
        if (s0 + KEYS < sk) {
            T *next = kv + 2 * TILE * ((it + 1) % 2);
            stage_async<T, DP, LD>(next, kh + (s0 + KEYS) * k_ss, KEYS, sk - s0 - KEYS, d, k_ss);
            stage_async<T, DP, LD>(next + TILE, vh + (s0 + KEYS) * v_ss, KEYS, sk - s0 - KEYS, d, v_ss);
            wait_async<2>();
        } else {
            wait_async<0>();
        }
        __syncthreads();
        // A key group whose tile lies past the end skips it (its warps only keep the barriers).
        const int k0 = s0 + split * BK;
        if (k0 < sk) {
            const T *ks = kv + 2 * TILE * (it % 2) + split * BK * LD, *vs = ks + TILE;

            // S = Q Kᵀ: K's rows are the B operand's columns, so ldmatrix without transposition; one x4 load gives
            // two score tiles' fragments for one k-step, used by every atom.
            float sc[ATOMS][NS][4];
#pragma unroll
            for (int a = 0; a < ATOMS; ++a)
#pragma unroll
                for (int n = 0; n < NS; ++n) sc[a][n][0] = sc[a][n][1] = sc[a][n][2] = sc[a][n][3] = 0.f;
#pragma unroll
            for (int n = 0; n < NS; n += 2) {
                const int key = n * 8 + (lane % 8) + (lane / 16) * 8, c = ((lane / 8) % 2) * 8;
#pragma unroll
                for (int kk = 0; kk < DP / 16; ++kk) {
                    uint32_t kf[4];
                    ldmatrix_x4(kf, ks + key * LD + kk * 16 + c);
#pragma unroll
                    for (int a = 0; a < ATOMS; ++a) {
                        MmaType<T>::mma(sc[a][n], qf[a][kk], kf);
                        MmaType<T>::mma(sc[a][n + 1], qf[a][kk], kf + 2);
                    }
                }
            }

            // Keys past the end exist only in the last tile (zero-filled there): only it pays for the mask.
            if (k0 + BK > sk) {
#pragma unroll
                for (int a = 0; a < ATOMS; ++a)
#pragma unroll
                    for (int n = 0; n < NS; ++n)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            if (k0 + n * 8 + 2 * t + e >= sk) sc[a][n][e] = sc[a][n][2 + e] = -INFINITY;
            }

#pragma unroll
            for (int a = 0; a < ATOMS; ++a) {
                float t0, t1;
                atom_row_max<NS>(sc[a], t0, t1);
                // A group's first tile holds a key (k0 < sk), so the new maxima are finite and the first rescales
                // are 0. The scale (positive) is applied inside the exponent: one fused multiply-add per score.
                const float n0 = fmaxf(m0[a], t0), n1 = fmaxf(m1[a], t1);
                const float a0 = fast_exp2((m0[a] - n0) * scale_log2), a1 = fast_exp2((m1[a] - n1) * scale_log2);
                const float b0 = -n0 * scale_log2, b1 = -n1 * scale_log2;
                m0[a] = n0;
                m1[a] = n1;
                float s0 = 0.f, s1 = 0.f;
#pragma unroll
                for (int n = 0; n < NS; ++n) {
                    sc[a][n][0] = fast_exp2(fmaf(sc[a][n][0], scale_log2, b0));
                    sc[a][n][1] = fast_exp2(fmaf(sc[a][n][1], scale_log2, b0));
                    sc[a][n][2] = fast_exp2(fmaf(sc[a][n][2], scale_log2, b1));
                    sc[a][n][3] = fast_exp2(fmaf(sc[a][n][3], scale_log2, b1));
                    s0 += sc[a][n][0] + sc[a][n][1];
                    s1 += sc[a][n][2] + sc[a][n][3];
                }
                l0[a] = l0[a] * a0 + s0;
                l1[a] = l1[a] * a1 + s1;
#pragma unroll
                for (int j = 0; j < NO; ++j) {
                    acc[a][j][0] *= a0;
                    acc[a][j][1] *= a0;
                    acc[a][j][2] *= a1;
                    acc[a][j][3] *= a1;
                }
            }

            // O += P V: score tiles 2kk and 2kk+1 are the A fragment of k-step kk; V's rows are the B operand's rows,
            // so ldmatrix transposes; one x4 load gives two output tiles' fragments (an x2 load the last odd one),
            // used by every atom.
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                uint32_t pa[ATOMS][4];
#pragma unroll
                for (int a = 0; a < ATOMS; ++a) {
                    pa[a][0] = pack_f2<T>(sc[a][2 * kk][0], sc[a][2 * kk][1]);
                    pa[a][1] = pack_f2<T>(sc[a][2 * kk][2], sc[a][2 * kk][3]);
                    pa[a][2] = pack_f2<T>(sc[a][2 * kk + 1][0], sc[a][2 * kk + 1][1]);
                    pa[a][3] = pack_f2<T>(sc[a][2 * kk + 1][2], sc[a][2 * kk + 1][3]);
                }
                const int key = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8, c = (lane / 16) * 8;
#pragma unroll
                for (int j = 0; j < NO; j += 2) {
                    if (j >= no) break;
                    uint32_t vf[4];
                    if (j + 1 < no) {
                        ldmatrix_x4_trans(vf, vs + key * LD + j * 8 + c);
#pragma unroll
                        for (int a = 0; a < ATOMS; ++a) {
                            MmaType<T>::mma(acc[a][j], pa[a], vf);
                            MmaType<T>::mma(acc[a][j + 1], pa[a], vf + 2);
                        }
                    } else {
                        ldmatrix_x2_trans(vf, vs + key * LD + j * 8);
#pragma unroll
                        for (int a = 0; a < ATOMS; ++a) MmaType<T>::mma(acc[a][j], pa[a], vf);
                    }
                }
            }
        }
        __syncthreads(); // every warp is done with this stage before the next prefetch replaces it
    }

    // Key groups past the first hand their rows' maxima, sums (this lane's shares) and unnormalised outputs over
    // shared memory, in the accumulator layout, to the first, which merges them in group order (deterministic). A
    // group without a key has maxima -inf and factor 0.
    if constexpr (SPLIT > 1) {
        float *part = reinterpret_cast<float *>(flash_smem);
        constexpr int SLOT = (NO + 1) * 128; // per atom: NO output tiles and one of maxima and sums, 4 per lane
        if (split > 0) {
#pragma unroll
            for (int a = 0; a < ATOMS; ++a) {
                float *p = part + (((split - 1) * WARPS + warp) * ATOMS + a) * SLOT + lane * 4;
#pragma unroll
                for (int j = 0; j < NO; ++j) {
                    if (j >= no) break;
                    *reinterpret_cast<float4 *>(p + j * 128) =
                        make_float4(acc[a][j][0], acc[a][j][1], acc[a][j][2], acc[a][j][3]);
                }
                *reinterpret_cast<float4 *>(p + NO * 128) = make_float4(m0[a], m1[a], l0[a], l1[a]);
            }
        }
        __syncthreads();
        if (split > 0) return;
#pragma unroll
        for (int s = 1; s < SPLIT; ++s)
#pragma unroll
            for (int a = 0; a < ATOMS; ++a) {
                const float *p = part + (((s - 1) * WARPS + warp) * ATOMS + a) * SLOT + lane * 4;
                const float4 ml = *reinterpret_cast<const float4 *>(p + NO * 128);
                const float n0 = fmaxf(m0[a], ml.x), n1 = fmaxf(m1[a], ml.y);
                const float a0 = fast_exp2((m0[a] - n0) * scale_log2), a1 = fast_exp2((m1[a] - n1) * scale_log2);
                const float b0 = fast_exp2((ml.x - n0) * scale_log2), b1 = fast_exp2((ml.y - n1) * scale_log2);
                m0[a] = n0;
                m1[a] = n1;
                l0[a] = l0[a] * a0 + ml.z * b0;
                l1[a] = l1[a] * a1 + ml.w * b1;
#pragma unroll
                for (int j = 0; j < NO; ++j) {
                    if (j >= no) break;
                    const float4 x = *reinterpret_cast<const float4 *>(p + j * 128);
                    acc[a][j][0] = acc[a][j][0] * a0 + x.x * b0;
                    acc[a][j][1] = acc[a][j][1] * a0 + x.y * b0;
                    acc[a][j][2] = acc[a][j][2] * a1 + x.z * b1;
                    acc[a][j][3] = acc[a][j][3] * a1 + x.w * b1;
                }
            }
    }

#pragma unroll
    for (int a = 0; a < ATOMS; ++a) {
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            l0[a] += __shfl_xor_sync(0xffffffff, l0[a], off);
            l1[a] += __shfl_xor_sync(0xffffffff, l1[a], off);
        }
        const float i0 = 1.f / l0[a], i1 = 1.f / l1[a];
        const int r0 = q0 + (warp * ATOMS + a) * 16 + g, r1 = r0 + 8;
        T *o0 = o + ((long long)b * sq + r0) * heads * d + (long long)h * d;
        T *o1 = o0 + 8LL * heads * d;
#pragma unroll
        for (int j = 0; j < NO; ++j) {
            const int col = j * 8 + 2 * t;
            if (j >= no) break;
            if (r0 < sq) *reinterpret_cast<uint32_t *>(o0 + col) = pack_f2<T>(acc[a][j][0] * i0, acc[a][j][1] * i0);
            if (r1 < sq) *reinterpret_cast<uint32_t *>(o1 + col) = pack_f2<T>(acc[a][j][2] * i1, acc[a][j][3] * i1);
        }
    }
}

// Short key sequences (the text encoder's 77 tokens of cross-attention; attention.rs takes it up to 128 keys). The
// kernels above stream key tiles through a grid of short-lived blocks, each of which loads its query tile and key tiles
// and writes its output with little to overlap them. Here a block loads all of one (batch, head)'s keys and values into
// shared memory once, and each of its WARPS warps then loops over chunks of 16·ATOMS query rows on its own: the next QB
// - 1 chunks' Q tiles are in flight (cp.async into the warp's ring of QB tiles) while it computes one, and the chunk's
// output leaves through the same tile as 16-byte rows. Keys are taken CROSS_TILE at a time (one tile at 77 keys: no
// rescale), with the online softmax across tiles, P rounded to the storage type before P·V and f32 accumulation, as
// flash_attention; K and V's rows are zero past sk up to a whole tile, so every loop is unrolled whole and only the
// mask looks at sk. The row sums come out of the tensor core: V's column chunk D (its row padding, or D 40's pad to 48)
// holds ones, and P·V computes it as one more output tile. The host picks the grid's width: block x of gridDim.x takes
// a contiguous run of the head's chunks, its warps every WARPS-th of them. Head dimension D exactly (a multiple of 8),
// padded to DP = whole k-steps of 16 for the scores: the pad columns of K and of the Q tiles are zeroed once and never
// written (O uses only D). Shared memory: (2·KR + WARPS·QB·16·ATOMS) rows of DP + 8 elements, KR = sk rounded up to a
// whole tile (`cross_smem` in attention.rs).
constexpr int CROSS_TILE = 80;

__device__ __forceinline__ void ldsm_x4(uint32_t *r, uint32_t a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t *r, uint32_t a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x2_t(uint32_t *r, uint32_t a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}
__device__ __forceinline__ void cp16(uint32_t to, const void *from, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from), "r"(ok ? 16 : 0));
}

template <typename T, int D, int WARPS, int ATOMS, int QB, bool CAUSAL = false>
__device__ void cross_attention(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                                T *__restrict__ o, int sq, int sk, int heads, long long q_bs, long long q_ss,
                                long long k_bs, long long k_ss, long long v_bs, long long v_ss, float scale_log2) {
    constexpr int KT = CROSS_TILE, DP = (D + 15) / 16 * 16, LD = DP + 8, CH = D / 8, NS = KT / 8, NO = D / 8;
    constexpr int ROWS = 16 * ATOMS, TB = ROWS * LD * 2, QN = (ROWS * CH + 31) / 32;
    static_assert(D % 8 == 0 && KT % 16 == 0 && QB >= 2, "shapes");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int b = blockIdx.z, h = blockIdx.y;
    const int kr = (sk + KT - 1) / KT * KT;
    T *ks = reinterpret_cast<T *>(flash_smem), *vs = ks + kr * LD, *qb = vs + kr * LD + warp * QB * ROWS * LD;
    const uint32_t ks_s = static_cast<uint32_t>(__cvta_generic_to_shared(ks)), vs_s = ks_s + kr * LD * 2;
    const uint32_t qb_s = static_cast<uint32_t>(__cvta_generic_to_shared(qb));
    const T *qh = q + b * q_bs + (long long)h * D;
    const T *kh = k + b * k_bs + (long long)h * D;
    const T *vh = v + b * v_bs + (long long)h * D;
    const int chunks = (sq + ROWS - 1) / ROWS, per = (chunks + gridDim.x - 1) / gridDim.x;
    const int first = blockIdx.x * per, end = min(chunks, first + per);

    // K and V, rows past sk zero-filled (V's must be finite: 0·NaN is NaN; K's are masked); D columns.
    for (int i = threadIdx.x; i < 2 * kr * CH; i += blockDim.x) {
        const int kv = i >= kr * CH, j = kv ? i - kr * CH : i, r = j / CH, c = (j % CH) * 8;
        const bool ok = r < sk;
        const T *from = (kv ? vh : kh) + (ok ? r * (kv ? v_ss : k_ss) + c : 0);
        cp16((kv ? vs_s : ks_s) + (r * LD + c) * 2, from, ok);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    // V's ones column, K's pad columns D..DP-1 and those of this warp's Q tiles (which meet K's in the scores).
    {
        T one{};
        one = cvt(1.f, one);
        const uint32_t ones = pack2(one, one);
        for (int r = threadIdx.x; r < kr; r += blockDim.x) {
            *reinterpret_cast<uint4 *>(vs + r * LD + D) = make_uint4(ones, ones, ones, ones);
            if constexpr (DP != D) *reinterpret_cast<uint4 *>(ks + r * LD + D) = make_uint4(0, 0, 0, 0);
        }
        if constexpr (DP != D)
            for (int r = lane; r < QB * ROWS; r += 32)
                *reinterpret_cast<uint4 *>(qb + r * LD + D) = make_uint4(0, 0, 0, 0);
    }
    // A chunk's Q tile into tile `slot`, rows past sq zero-filled; one cp.async group per call, empty past the run.
    auto load_q = [&](int chunk, int slot) {
        if (chunk < end) {
            const int r0 = chunk * ROWS;
            const T *src = qh + (long long)r0 * q_ss;
#pragma unroll
            for (int it = 0; it < QN; ++it) {
                const int i = lane + 32 * it, r = i / CH, c = (i % CH) * 8;
                if (ROWS * CH % 32 == 0 || i < ROWS * CH) {
                    const bool ok = r0 + r < sq;
                    cp16(qb_s + slot * TB + (r * LD + c) * 2, src + (ok ? r * q_ss + c : 0), ok);
                }
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    int chunk = first + warp;
#pragma unroll
    for (int i = 0; i < QB - 1; ++i) load_q(chunk + i * WARPS, i);
    wait_async<QB - 1>(); // K and V (this thread's copies; the barrier makes them everyone's)
    __syncthreads();

    // Per-lane ldmatrix offsets: A (Q) and transposed B (V) take rows lane%16, column half lane/16; B (K) rows
    // lane%8 + 8·(lane/16), column half (lane/8)%2.
    const uint32_t a_off = ((lane % 16) * LD + (lane / 16) * 8) * 2;
    const uint32_t k_off = ((lane % 8 + (lane / 16) * 8) * LD + ((lane / 8) % 2) * 8) * 2;
    for (int slot = 0; chunk < end; chunk += WARPS, slot = slot + 1 == QB ? 0 : slot + 1) {
        load_q(chunk + (QB - 1) * WARPS, slot == 0 ? QB - 1 : slot - 1);
        wait_async<QB - 1>();
        __syncwarp();
        const uint32_t qt = qb_s + slot * TB;

        // acc[a][NO] is the ones column: the row sums (g in [0], [1]; g + 8 in [2], [3]).
        float acc[ATOMS][NO + 1][4];
        float m0[ATOMS], m1[ATOMS];
#pragma unroll
        for (int a = 0; a < ATOMS; ++a) {
            m0[a] = m1[a] = -INFINITY;
#pragma unroll
            for (int j = 0; j <= NO; ++j) acc[a][j][0] = acc[a][j][1] = acc[a][j][2] = acc[a][j][3] = 0.f;
        }
        for (int k0 = 0; k0 < sk; k0 += KT) {
            float sc[ATOMS][NS][4];
#pragma unroll
            for (int a = 0; a < ATOMS; ++a)
#pragma unroll
                for (int n = 0; n < NS; ++n) sc[a][n][0] = sc[a][n][1] = sc[a][n][2] = sc[a][n][3] = 0.f;
            const uint32_t kt = ks_s + k0 * LD * 2 + k_off;
#pragma unroll
            for (int kk = 0; kk < DP / 16; ++kk) {
                uint32_t qf[ATOMS][4];
#pragma unroll
                for (int a = 0; a < ATOMS; ++a) ldsm_x4(qf[a], qt + a_off + (a * 16 * LD + kk * 16) * 2);
#pragma unroll
                for (int n = 0; n < NS; n += 2) {
                    uint32_t kf[4];
                    ldsm_x4(kf, kt + (n * 8 * LD + kk * 16) * 2);
#pragma unroll
                    for (int a = 0; a < ATOMS; ++a) {
                        MmaType<T>::mma(sc[a][n], qf[a], kf);
                        MmaType<T>::mma(sc[a][n + 1], qf[a], kf + 2);
                    }
                }
            }
            // Keys past sk: in the tile's last k-step where the tile holds the end (always at 77 keys), else past
            // it too.
            if (k0 + KT > sk) {
                const int lim = sk - k0 - 2 * t;
                if (sk - k0 > KT - 16) {
#pragma unroll
                    for (int a = 0; a < ATOMS; ++a)
#pragma unroll
                        for (int n = NS - 2; n < NS; ++n)
#pragma unroll
                            for (int e = 0; e < 2; ++e)
                                if (n * 8 + e >= lim) sc[a][n][e] = sc[a][n][2 + e] = -INFINITY;
                } else {
#pragma unroll
                    for (int a = 0; a < ATOMS; ++a)
#pragma unroll
                        for (int n = 0; n < NS; ++n)
#pragma unroll
                            for (int e = 0; e < 2; ++e)
                                if (n * 8 + e >= lim) sc[a][n][e] = sc[a][n][2 + e] = -INFINITY;
                }
            }
            // A text encoder's causal mask: row r sees keys 0..=r. Key 0 is in the first tile, so every row's
            // maximum there is finite and a later tile masked whole for a row leaves its running max as it was.
            if constexpr (CAUSAL) {
                const int lim = chunk * ROWS + g - k0 - 2 * t;
#pragma unroll
                for (int a = 0; a < ATOMS; ++a)
#pragma unroll
                    for (int n = 0; n < NS; ++n)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            if (n * 8 + e > lim + a * 16) sc[a][n][e] = -INFINITY;
                            if (n * 8 + e > lim + a * 16 + 8) sc[a][n][2 + e] = -INFINITY;
                        }
            }
#pragma unroll
            for (int a = 0; a < ATOMS; ++a) {
                float x0, x1;
                atom_row_max<NS>(sc[a], x0, x1);
                // Every tile holds a real key, so the maxima are finite; the first tile rescales nothing.
                const float n0 = fmaxf(m0[a], x0), n1 = fmaxf(m1[a], x1);
                if (k0 > 0) {
                    const float a0 = fast_exp2((m0[a] - n0) * scale_log2), a1 = fast_exp2((m1[a] - n1) * scale_log2);
#pragma unroll
                    for (int j = 0; j <= NO; ++j) {
                        acc[a][j][0] *= a0;
                        acc[a][j][1] *= a0;
                        acc[a][j][2] *= a1;
                        acc[a][j][3] *= a1;
                    }
                }
                m0[a] = n0;
                m1[a] = n1;
                const float b0 = -n0 * scale_log2, b1 = -n1 * scale_log2;
#pragma unroll
                for (int n = 0; n < NS; ++n) {
                    sc[a][n][0] = fast_exp2(fmaf(sc[a][n][0], scale_log2, b0));
                    sc[a][n][1] = fast_exp2(fmaf(sc[a][n][1], scale_log2, b0));
                    sc[a][n][2] = fast_exp2(fmaf(sc[a][n][2], scale_log2, b1));
                    sc[a][n][3] = fast_exp2(fmaf(sc[a][n][3], scale_log2, b1));
                }
            }
            // O += P V (and the ones column), as flash_attention: score tiles 2kk, 2kk+1 are k-step kk's A fragment.
            const uint32_t vt = vs_s + k0 * LD * 2 + a_off;
#pragma unroll
            for (int kk = 0; kk < KT / 16; ++kk) {
                uint32_t pa[ATOMS][4];
#pragma unroll
                for (int a = 0; a < ATOMS; ++a) {
                    pa[a][0] = pack_f2<T>(sc[a][2 * kk][0], sc[a][2 * kk][1]);
                    pa[a][1] = pack_f2<T>(sc[a][2 * kk][2], sc[a][2 * kk][3]);
                    pa[a][2] = pack_f2<T>(sc[a][2 * kk + 1][0], sc[a][2 * kk + 1][1]);
                    pa[a][3] = pack_f2<T>(sc[a][2 * kk + 1][2], sc[a][2 * kk + 1][3]);
                }
#pragma unroll
                for (int j = 0; j <= NO; j += 2) {
                    uint32_t vf[4];
                    if (j + 1 <= NO) {
                        ldsm_x4_t(vf, vt + (kk * 16 * LD + j * 8) * 2);
#pragma unroll
                        for (int a = 0; a < ATOMS; ++a) {
                            MmaType<T>::mma(acc[a][j], pa[a], vf);
                            MmaType<T>::mma(acc[a][j + 1], pa[a], vf + 2);
                        }
                    } else {
                        ldsm_x2_t(vf, vt + (kk * 16 * LD + j * 8) * 2);
#pragma unroll
                        for (int a = 0; a < ATOMS; ++a) MmaType<T>::mma(acc[a][j], pa[a], vf);
                    }
                }
            }
        }

        // The normalised output over the chunk's Q tile (every lane's reads of it are done), then out as 16-byte
        // rows of D; the tile takes the chunk QB - 1 ahead once all lanes have read it.
        __syncwarp();
        T *ot = qb + slot * ROWS * LD;
#pragma unroll
        for (int a = 0; a < ATOMS; ++a) {
            const float i0 = 1.f / acc[a][NO][0], i1 = 1.f / acc[a][NO][2];
            T *o0 = ot + (a * 16 + g) * LD + 2 * t, *o1 = o0 + 8 * LD;
#pragma unroll
            for (int j = 0; j < NO; ++j) {
                *reinterpret_cast<uint32_t *>(o0 + j * 8) = pack_f2<T>(acc[a][j][0] * i0, acc[a][j][1] * i0);
                *reinterpret_cast<uint32_t *>(o1 + j * 8) = pack_f2<T>(acc[a][j][2] * i1, acc[a][j][3] * i1);
            }
        }
        __syncwarp();
        const int r0 = chunk * ROWS;
        T *oh = o + ((long long)b * sq + r0) * heads * D + (long long)h * D;
#pragma unroll
        for (int it = 0; it < QN; ++it) {
            const int i = lane + 32 * it, r = i / CH, c = (i % CH) * 8;
            if ((ROWS * CH % 32 == 0 || i < ROWS * CH) && r0 + r < sq)
                *reinterpret_cast<uint4 *>(oh + (long long)r * heads * D + c) =
                    *reinterpret_cast<const uint4 *>(ot + r * LD + c);
        }
        __syncwarp();
    }
}

// Hopper (sm_90a) kernel for heads of 40 (SD1.5's 64x64 maps, where most of its attention time goes), 64 (SDXL)
// and 80 (SD1.5's 32x32 maps), after FlashAttention 3's intra-warpgroup pipelining without TMA or warp
// specialisation: warpgroup-wide asynchronous products (wgmma) instead of per-warp mma.sync, so the tensor cores
// run one tile's P·V while the warps do the next tile's softmax.
// - A block is NWG warpgroups of 128 threads; each owns 64 query rows (wgmma's M) and keeps its scores,
//   probabilities, running max and sum and output in registers. All threads stage 64-key tiles of K and V with
//   cp.async into a three-stage shared ring: tile j+2 is requested while tile j is consumed, one barrier per tile.
// - S = Q Kᵀ: m64n64k16 with Q as the A operand, loaded once (D zero-padded to whole k-steps of 16, 40 to 48): from
//   global memory into registers, or for D 80 into shared memory (Tiles::Q_SHARED); K from shared memory as B,
//   K-major. O += P V: m64nDk16 with P straight from the score
//   accumulators as the register A operand (the m64nN accumulator layout pairs into the A fragment layout), V
//   from shared memory as B read transposed (MN-major).
// - Per key tile: issue S of tile j+1 and P·V of tile j back to back, wait for S only, do tile j+1's softmax while
//   P·V runs, then wait for it and rescale O.
// The instructions exist only in the arch-specific sm_90a target: build.rs compiles this file a second time for
// compute_90a where the build is for 9.0, and elsewhere the kernels are traps the host never launches.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
namespace hopper {

constexpr int BN = 64; // keys per tile: the N of S = Q Kᵀ

// 16-byte chunks per key of a K tile, KC (D padded to whole k-steps), and of a V tile, VC (exactly D: P·V's N need
// only be a multiple of 8, so no output columns are computed past D). Q as a register operand costs 2·KC registers
// per thread: at D 80 that makes 137 and one two-warpgroup block per SM; read from shared memory (a 64 × KC chunk
// tile per warpgroup after the stages, laid out as K) it makes 120 and two, 1.23x faster at (8, 1024, 8, 80).
// RING (D 64, 80): four stages handed over through mbarriers instead of three and a block barrier per tile, so a
// warpgroup may run up to a tile ahead of the others (see the key loop). ONES (D 40, 64): V's tile carries one more
// chunk per key, all ones, and P·V runs N = D + 8, so each row's sum of the rounded P comes out of the tensor core
// in the extra accumulator columns instead of 32 additions per tile. At D 40 the ring did not pay; the three-stage
// loop there pays only with the ones column, the pinned wait and a leaner tile loop together (notes at
// HOPPER_BOTH).
template <int D> struct Tiles {
    static_assert(D == 40 || D == 64 || D == 80, "the P·V product is written out for N 48, 72 and 80");
    static constexpr bool RING = D != 40, ONES = D != 80;
    static constexpr int STAGES = RING ? 4 : 3;
    static constexpr int KC = (D + 15) / 16 * 2, VC = D / 8, VCX = VC + ONES, PV_N = D + 8 * ONES;
    static constexpr int K_BYTES = BN * KC * 16, V_BYTES = BN * VCX * 16, STAGE = K_BYTES + V_BYTES;
    static constexpr bool Q_SHARED = D == 80;
};

// Shared operands use no swizzle: the unit is the core matrix, 8 rows of 16 bytes stored in 128 contiguous bytes.
// A tile of keys × d is [key group of 8][d chunk][key % 8][8 values], byte (key, chunk) = ((key/8)·C + chunk)·128
// + (key%8)·16 with C chunks per key, and the same bytes serve both products:
//  - K as B of S = Q Kᵀ (n = key, k = d, d contiguous: K-major): LBO, between core matrices adjacent in k (the next
//    d chunk) = 128; SBO, between those adjacent in n (the next key group) = KC·128. k-step s starts 256 B on.
//  - Q as A of S = Q Kᵀ, when in shared memory: as K, with query rows for keys.
//  - V as B of O = P V (k = key, n = d, d contiguous: MN-major, transposed read): LBO, between core matrices
//    adjacent in k (the next key group) = VCX·128; SBO, between those adjacent in n (the next d chunk) = 128.
//    k-step s (keys 16s..16s+15) starts two key groups on: 2·VCX·128 B (VCX = VC, plus the ones chunk with ONES).
// Descriptor bits: 0-13 address >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4, 62-63 swizzle (0: none).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// The compiler does not know that a wgmma writes its registers asynchronously: an empty volatile asm "rewriting"
// each one right after a wait keeps every later read behind the wait.
template <typename R, int N> __device__ __forceinline__ void fence_regs(R (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        if constexpr (sizeof(R) == 4 && R(0.5f) != R(0)) {
            asm volatile("" : "+f"(r[i])::"memory");
        } else {
            asm volatile("" : "+r"(r[i])::"memory");
        }
    }
}

// An m64nN f32 accumulator is N/2 registers per thread, all named in the instruction.
#define SDHIVE_ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define SDHIVE_ACC8(i) SDHIVE_ACC4(i), SDHIVE_ACC4(i + 4)
#define SDHIVE_ACC32 SDHIVE_ACC8(0), SDHIVE_ACC8(8), SDHIVE_ACC8(16), SDHIVE_ACC8(24)
#define SDHIVE_R20 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19"
#define SDHIVE_R24 SDHIVE_R20 ", %20, %21, %22, %23"
#define SDHIVE_R32 SDHIVE_R24 ", %24, %25, %26, %27, %28, %29, %30, %31"
#define SDHIVE_R40 SDHIVE_R32 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define SDHIVE_WGMMA_QK(TY)                                                                                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                     \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                                      \
                 "{" SDHIVE_R32 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                  \
                 : SDHIVE_ACC32                                                                                   \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(SCALE_D))
#define SDHIVE_WGMMA_QK_SS(TY)                                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                     \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                                      \
                 "{" SDHIVE_R32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                                 \
                 : SDHIVE_ACC32                                                                                   \
                 : "l"(da), "l"(desc), "n"(SCALE_D))
#define SDHIVE_WGMMA_PV(TY, N, REGS, A, DESC, ...)                                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                       \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " "                                  \
                 "{" REGS "}, {" A "}, " DESC ", p, 1, 1, 1;\n}\n"                                                \
                 : __VA_ARGS__                                                                                    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc))
#define SDHIVE_R36 SDHIVE_R32 ", %32, %33, %34, %35"
#define SDHIVE_WGMMA_PV_N(TY)                                                                                     \
    if constexpr (N == 48)                                                                                        \
        SDHIVE_WGMMA_PV(TY, 48, SDHIVE_R24, "%24, %25, %26, %27", "%28", SDHIVE_ACC8(0), SDHIVE_ACC8(8),          \
                        SDHIVE_ACC8(16));                                                                         \
    else if constexpr (N == 64)                                                                                   \
        SDHIVE_WGMMA_PV(TY, 64, SDHIVE_R32, "%32, %33, %34, %35", "%36", SDHIVE_ACC32);                           \
    else if constexpr (N == 72)                                                                                   \
        SDHIVE_WGMMA_PV(TY, 72, SDHIVE_R36, "%36, %37, %38, %39", "%40", SDHIVE_ACC32, SDHIVE_ACC4(32));          \
    else                                                                                                          \
        SDHIVE_WGMMA_PV(TY, 80, SDHIVE_R40, "%40, %41, %42, %43", "%44", SDHIVE_ACC32, SDHIVE_ACC8(32))

// D(64×64, f32) (+)= A(64×16, registers) · B(16×64, K-major); SCALE_D 0 ignores D's old value. And D(64×N) +=
// A(64×16) · B(16×N, MN-major, transposed read) for N 48 (40 and the ones column), 64, 72 (64 and the ones
// column) or 80.
template <typename T> struct Wgmma;
#define SDHIVE_WGMMA_FOR(T, TY)                                                                                   \
    template <> struct Wgmma<T> {                                                                                 \
        template <int SCALE_D>                                                                                    \
        static __device__ __forceinline__ void qk(float *d, const uint32_t *a, uint64_t desc) {                   \
            SDHIVE_WGMMA_QK(TY);                                                                                  \
        }                                                                                                         \
        template <int SCALE_D> static __device__ __forceinline__ void qk(float *d, uint64_t da, uint64_t desc) {  \
            SDHIVE_WGMMA_QK_SS(TY);                                                                               \
        }                                                                                                         \
        template <int N> static __device__ __forceinline__ void pv(float *d, const uint32_t *a, uint64_t desc) {  \
            SDHIVE_WGMMA_PV_N(TY);                                                                                \
        }                                                                                                         \
    };
SDHIVE_WGMMA_FOR(__half, "f16")
SDHIVE_WGMMA_FOR(__nv_bfloat16, "bf16")

// Requests keys k0..k0+BN-1 of K and V into one stage (keys past sk zero-filled: V's must not be garbage, as
// 0·NaN is NaN) and commits one cp.async group, empty when k0 is past the end so that group counting stays
// uniform (with RING, arrives on the stage's mbarrier once its copies have landed instead). Eight consecutive
// threads fill one 128-byte core matrix. A thread copies the same chunks of every tile,
// so their offsets are worked out once, before the key loop: recomputed per tile, the index arithmetic (divisions by
// VC, 64-bit products, a loop of runtime trip count) cost about as many instructions as the softmax. Per chunk: the
// source element offset from the tile's first row (32 bits: a 64-key tile spans less than 2^32 elements for any row
// stride below 2^26), and the destination byte offset in the stage with the key at bit 16 and K or V at bit 24.
template <typename T, int D, int THREADS> struct TileLoader {
    static constexpr int KC = Tiles<D>::KC, VC = Tiles<D>::VC, VCX = Tiles<D>::VCX, K_BYTES = Tiles<D>::K_BYTES;
    static constexpr int N = 2 * BN * VC, R = (N + THREADS - 1) / THREADS;
    static_assert(Tiles<D>::STAGE < (1 << 16), "stage offsets in 16 bits");
    uint32_t src[R], dst[R];

    __device__ __forceinline__ TileLoader(long long k_ss, long long v_ss) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int i = threadIdx.x + r * THREADS;
            const bool is_v = i >= BN * VC;
            const int j = is_v ? i - BN * VC : i;
            const int u = j / 8, kg = u / VC, c = u % VC, key = kg * 8 + j % 8;
            src[r] = (uint32_t)(key * (is_v ? v_ss : k_ss) + c * 8);
            const int v_off = VCX == VC ? j * 16 : ((kg * VCX + c) * 8 + j % 8) * 16;
            dst[r] = (is_v ? K_BYTES + v_off : ((kg * KC + c) * 8 + j % 8) * 16) | key << 16 | (uint32_t)is_v << 24;
        }
    }

    __device__ __forceinline__ void load(uint32_t stage, const T *kh, const T *vh, int k0, int sk, long long k_ss,
                                         long long v_ss, uint32_t full = 0) const {
        if (k0 < sk) {
            const int valid = sk - k0;
            const T *kt = kh + k0 * k_ss, *vt = vh + k0 * v_ss;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (N % THREADS != 0 && r == R - 1 && threadIdx.x + r * THREADS >= N) break;
                const uint32_t d = dst[r];
                const bool ok = (int)((d >> 16) & 0xff) < valid;
                const T *from = (d >> 24 ? vt : kt) + (ok ? src[r] : 0u);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(stage + (d & 0xffff)),
                             "l"(from), "r"(ok ? 16 : 0));
            }
        }
        if constexpr (Tiles<D>::RING)
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full) : "memory");
        else
            asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
};

// The three-stage loop's loader (D 40): TileLoader's precomputed offsets, with the tiles requested in order so
// that the K and V row pointers advance by a tile per call (no 64-bit product per tile), and whole tiles copied
// without the per-chunk bounds test and zero fill (only the tile holding the end takes them). Where the chunks do
// not divide among the threads, the last round's spare threads repeat a copy of the round before (the same bytes to
// the same place) instead of branching around it.
template <typename T, int D, int THREADS> struct StreamLoader {
    static constexpr int KC = Tiles<D>::KC, VC = Tiles<D>::VC, VCX = Tiles<D>::VCX, K_BYTES = Tiles<D>::K_BYTES;
    static constexpr int N = 2 * BN * VC, R = (N + THREADS - 1) / THREADS;
    static_assert(R >= 2 || N % THREADS == 0, "spare threads repeat the previous round");
    uint32_t src[R], dst[R], key[R];
    bool is_v[R];
    const T *kt, *vt;
    long long k_step, v_step;

    __device__ __forceinline__ StreamLoader(const T *kh, const T *vh, long long k_ss, long long v_ss)
        : kt(kh), vt(vh), k_step(BN * k_ss), v_step(BN * v_ss) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            int i = threadIdx.x + r * THREADS;
            if (i >= N) i -= THREADS;
            const bool v = i >= BN * VC;
            const int j = v ? i - BN * VC : i;
            const int u = j / 8, kg = u / VC, c = u % VC, kk = kg * 8 + j % 8;
            src[r] = (uint32_t)(kk * (v ? v_ss : k_ss) + c * 8);
            dst[r] = v ? K_BYTES + ((kg * VCX + c) * 8 + j % 8) * 16 : ((kg * KC + c) * 8 + j % 8) * 16;
            key[r] = kk;
            is_v[r] = v;
        }
    }
    // Round r's rows: K's or V's for every thread where the round lies in one of them (known once unrolled).
    __device__ __forceinline__ const T *rows(int r) const {
        const bool all_k = (r + 1) * THREADS <= BN * VC;
        const bool all_v = r * THREADS >= BN * VC && ((r + 1) * THREADS <= N || N - THREADS >= BN * VC);
        return all_k ? kt : all_v ? vt : is_v[r] ? vt : kt;
    }
    // Requests keys k0..k0+BN-1 into `stage` and commits a cp.async group (empty past the end), k0 advancing by BN
    // from 0 over the calls.
    __device__ __forceinline__ void load(uint32_t stage, int k0, int sk) {
        if (k0 + BN <= sk) {
#pragma unroll
            for (int r = 0; r < R; ++r)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(stage + dst[r]), "l"(rows(r) + src[r]));
        } else if (k0 < sk) {
            const int valid = sk - k0;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const bool ok = (int)key[r] < valid;
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(stage + dst[r]),
                             "l"(rows(r) + (ok ? src[r] : 0u)), "r"(ok ? 16 : 0));
            }
        }
        kt += k_step;
        vt += v_step;
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
};
template <bool B, typename X, typename Y> struct Pick {
    using type = X;
};
template <typename X, typename Y> struct Pick<false, X, Y> {
    using type = Y;
};

using sm90::mbar_arrive;
using sm90::mbar_expect;
using sm90::mbar_init;
using sm90::mbar_wait;
__device__ __forceinline__ uint32_t ones2(__half) { return 0x3C003C00u; }
__device__ __forceinline__ uint32_t ones2(__nv_bfloat16) { return 0x3F803F80u; }

// Online softmax of one score tile in place (exp2 domain, the scale in one fused multiply-add per score). In the
// m64nN accumulator s[i] is row g + 8·((i/2)%2) of the warp's 16, column 8·(i/4) + 2t + i%2; a row's values live
// in the four lanes of a quad. a0/a1 receive the factors the output rows are rescaled by; l0/l1 are this lane's
// shares of the sums.
// MASK 1 tests whether the tile holds the end (a branch); 2 masks unconditionally, 0 not at all. Without SUMS
// (ONES) l0 and l1 are left alone.
template <int N, int MASK = 1, bool SUMS = true>
__device__ __forceinline__ void softmax_tile(float (&s)[N], int valid, int t, float c, float &m0, float &m1,
                                             float &l0, float &l1, float &a0, float &a1) {
    if (MASK == 2 || (MASK == 1 && valid < 2 * N)) { // only the tile holding the end pays for the mask
#pragma unroll
        for (int i = 0; i < N; ++i)
            if (8 * (i / 4) + 2 * t + (i % 2) >= valid) s[i] = -INFINITY;
    }
    float x0 = -INFINITY, x1 = -INFINITY;
#pragma unroll
    for (int i = 0; i < N; i += 4) {
        x0 = fmaxf(x0, fmaxf(s[i], s[i + 1]));
        x1 = fmaxf(x1, fmaxf(s[i + 2], s[i + 3]));
    }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffff, x0, off));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffff, x1, off));
    }
    // Every tile holds at least one real key, so the new maxima are finite; the first tile's factors are 0.
    const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
    a0 = fast_exp2((m0 - n0) * c);
    a1 = fast_exp2((m1 - n1) * c);
    m0 = n0;
    m1 = n1;
    const float b0 = -n0 * c, b1 = -n1 * c;
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int i = 0; i < N; i += 4) {
        s[i] = fast_exp2(fmaf(s[i], c, b0));
        s[i + 1] = fast_exp2(fmaf(s[i + 1], c, b0));
        s[i + 2] = fast_exp2(fmaf(s[i + 2], c, b1));
        s[i + 3] = fast_exp2(fmaf(s[i + 3], c, b1));
        if constexpr (SUMS) {
            s0 += s[i] + s[i + 1];
            s1 += s[i + 2] + s[i + 3];
        }
    }
    if constexpr (SUMS) {
        l0 = l0 * a0 + s0;
        l1 = l1 * a1 + s1;
    }
}

// P as the A operand of m64nNk16: for k-step kk (keys 16kk..16kk+15) the register fragment is accumulator values
// s[8kk .. 8kk+7] in order, paired.
template <typename T, int N> __device__ __forceinline__ void pack_p(uint32_t (&p)[N / 2], const float (&s)[N]) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) p[i] = pack_f2<T>(s[2 * i], s[2 * i + 1]);
}

// Static shared memory: RING's full and empty mbarriers (unused without it), then PIN floats per thread for the
// store that pins the wait for P·V (the key loops).
template <int THREADS, int PIN> __device__ __forceinline__ uint32_t ring_shared() {
    __shared__ __align__(16) uint64_t ring[8 + THREADS * PIN / 2];
    return static_cast<uint32_t>(__cvta_generic_to_shared(ring));
}
template <bool B> struct Last {
    static constexpr bool value = B;
};

// Head dimension D, NWG warpgroups of 64 query rows per block. q, k, v with any batch and row strides (rows 16-byte
// aligned), the output contiguous (B, Sq, H·D), as flash_attention.
// TMA: K and V tiles come in by the tensor memory accelerator instead of every thread's cp.async: km and vm are the
// generic addresses of two 5-D tensor maps (TmaMap) over k and v, dimensions (8 values, keys, D/8 chunks, heads,
// batch), boxes of one 64-key tile; thread 0 requests each tile on its stage's full mbarrier (with RING, once the
// stage's empty one says every thread is done with it), which every thread waits on. The maps' order of dimensions
// lays a tile out [chunk][key][8 values] (unlike the cp.async path's [key group][chunk][key % 8][8 values]), so the
// descriptors' strides differ (kdesc, vdesc, K_LO and the rest below). Q in shared memory (D 80) keeps cp.async.
template <typename T, int D, int NWG, bool TMA = false>
__device__ __forceinline__ void attention(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                                          T *__restrict__ o, int sq, int sk, int heads, long long q_bs,
                                          long long q_ss, long long k_bs, long long k_ss, long long v_bs,
                                          long long v_ss, float c, const void *km = nullptr,
                                          const void *vm = nullptr) {
    constexpr int KC = Tiles<D>::KC, VC = Tiles<D>::VC, VCX = Tiles<D>::VCX, K_BYTES = Tiles<D>::K_BYTES;
    constexpr int STAGE = Tiles<D>::STAGE, STAGES = Tiles<D>::STAGES;
    constexpr int THREADS = 128 * NWG, NS = BN / 2, KS = KC / 2, NA = D / 2, NAX = Tiles<D>::PV_N / 2;
    constexpr bool QS = Tiles<D>::Q_SHARED, RING = Tiles<D>::RING, ONES = Tiles<D>::ONES;
    const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int b = blockIdx.z, h = blockIdx.y;
    const int r0 = blockIdx.x * 64 * NWG + (tid / 128) * 64 + ((tid / 32) % 4) * 16 + g, r1 = r0 + 8;
    const T *kh = k + b * k_bs + h * D, *vh = v + b * v_bs + h * D;
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(flash_smem));
    const int nt = (sk + BN - 1) / BN;

    // With RING the pads below are written before any copy and made visible by the barrier that also publishes
    // the mbarriers' initialisation; the copies' arrivals need it.
    constexpr int PIN = ONES ? 4 : 2;
    const uint32_t ring = ring_shared<THREADS, PIN>();
    const uint32_t full0 = ring, empty0 = ring + 8 * 4, pin = ring + 8 * 8 + tid * PIN * 4;
    if constexpr (RING) {
        if (tid == 0) {
            for (int s = 0; s < STAGES; ++s) {
                mbar_init(full0 + 8 * s, TMA ? 1 : THREADS);
                mbar_init(empty0 + 8 * s, THREADS);
            }
            if constexpr (TMA) asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
    }
    // K's pad chunk (d D..KC·8-1) meets Q's zero columns but must not hold NaN or Inf bit patterns: zeroed once in
    // every stage; cp.async never writes it. With ONES, V's ones chunk likewise.
    auto pads = [&]() {
        if constexpr (TMA) {
            const uint32_t one = ones2(T{});
            for (int i = tid; i < STAGES * BN; i += THREADS) {
                const int st = i / BN, key = i % BN;
                if constexpr (D % 16 != 0)
                    *reinterpret_cast<uint4 *>(flash_smem + st * STAGE + ((KC - 1) * BN + key) * 16) =
                        make_uint4(0, 0, 0, 0);
                if constexpr (ONES)
                    *reinterpret_cast<uint4 *>(flash_smem + st * STAGE + K_BYTES + (VC * BN + key) * 16) =
                        make_uint4(one, one, one, one);
            }
            return;
        }
        if constexpr (D % 16 != 0) {
            for (int i = tid; i < STAGES * BN; i += THREADS) {
                const int st = i / BN, kg = (i % BN) / 8, r = i % 8;
                *reinterpret_cast<uint4 *>(flash_smem + st * STAGE + ((kg * KC + KC - 1) * 8 + r) * 16) =
                    make_uint4(0, 0, 0, 0);
            }
        }
        if constexpr (ONES) {
            const uint32_t one = ones2(T{});
            for (int i = tid; i < STAGES * BN; i += THREADS) {
                const int st = i / BN, kg = (i % BN) / 8, r = i % 8;
                *reinterpret_cast<uint4 *>(flash_smem + st * STAGE + K_BYTES + ((kg * VCX + VC) * 8 + r) * 16) =
                    make_uint4(one, one, one, one);
            }
        }
    };
    if constexpr (RING) {
        pads();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
    }

    // A shared Q tile joins tile 0's cp.async group (or arrival), so the prologue's wait covers it; chunks past D
    // and rows past sq are zero-filled.
    const uint32_t qs = base + STAGES * STAGE + (tid / 128) * 64 * KC * 16;
    if constexpr (QS) {
        for (int i = tid % 128; i < 64 * KC; i += 128) {
            const int c = (i / 8) % KC, row = blockIdx.x * 64 * NWG + (tid / 128) * 64 + (i / (8 * KC)) * 8 + i % 8;
            const bool ok = c < VC && row < sq;
            const T *src = q + (ok ? b * q_bs + (long long)row * q_ss + h * D + c * 8 : 0);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(qs + i * 16), "l"(src),
                         "r"(ok ? 16 : 0));
        }
        if constexpr (TMA) { // no tile's arrival covers these copies
            asm volatile("cp.async.wait_group 0;\n" ::: "memory");
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncthreads();
        }
    }
    using Loader = typename Pick<RING, TileLoader<T, D, THREADS>, StreamLoader<T, D, THREADS>>::type;
    Loader loader = [&] {
        if constexpr (RING)
            return Loader(k_ss, v_ss);
        else
            return Loader(kh, vh, k_ss, v_ss);
    }();
    // TMA: thread 0 requests tile `tile` (keys past sk arrive as zeros) into stage tile % STAGES, on that stage's
    // full barrier.
    auto tma_tile = [&](int tile) {
        if constexpr (TMA) {
            if (tid == 0 && tile < nt) {
                const int s = tile % STAGES;
                const uint32_t st = base + s * STAGE, bar = full0 + 8 * s;
                mbar_expect(bar, 2 * BN * VC * 16);
                asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
                             "{%2, %3, %4, %5, %6}], [%7];\n" ::"r"(st),
                             "l"(km), "r"(0), "r"(tile * BN), "r"(0), "r"(h), "r"(b), "r"(bar)
                             : "memory");
                asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
                             "{%2, %3, %4, %5, %6}], [%7];\n" ::"r"(st + K_BYTES),
                             "l"(vm), "r"(0), "r"(tile * BN), "r"(0), "r"(h), "r"(b), "r"(bar)
                             : "memory");
            }
        }
    };
    auto load = [&](int tile) {
        if constexpr (RING && TMA)
            tma_tile(tile);
        else if constexpr (RING)
            loader.load(base + (tile % STAGES) * STAGE, kh, vh, tile * BN, sk, k_ss, v_ss,
                        full0 + 8 * (tile % STAGES));
    };
    // Without RING the stages rotate in registers, in 16-byte units (the descriptors' address field): s_a holds
    // tile j, s_b tile j+1, s_c tile j+2.
    uint32_t s_a = base >> 4, s_b = (base + STAGE) >> 4, s_c = (base + 2 * STAGE) >> 4;
    if constexpr (RING) {
        load(0);
        load(1);
        load(2);
    } else if constexpr (TMA) {
        if (tid == 0) {
            for (int s = 0; s < STAGES; ++s) mbar_init(full0 + 8 * s, 1);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        pads();
        __syncthreads();
        tma_tile(0);
        tma_tile(1);
    } else {
        loader.load(s_a << 4, 0, sk);
        loader.load(s_b << 4, BN, sk);
        pads();
    }

    // Otherwise Q's A fragments straight from global memory, once: k-step s holds columns 16s + 2t (+1) in a[0]
    // (row g) and a[1] (row g+8), 16s + 8 + 2t (+1) in a[2], a[3]; columns past D and rows past sq are zeros.
    uint32_t qa[KS][4];
    if constexpr (!QS) {
        const T *q0 = q + b * q_bs + (long long)r0 * q_ss + h * D, *q1 = q0 + 8 * q_ss;
#pragma unroll
        for (int s = 0; s < KS; ++s)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int col = 16 * s + 8 * half + 2 * t;
                const bool ok = col < D;
                qa[s][2 * half] = ok && r0 < sq ? *reinterpret_cast<const uint32_t *>(q0 + col) : 0u;
                qa[s][2 * half + 1] = ok && r1 < sq ? *reinterpret_cast<const uint32_t *>(q1 + col) : 0u;
            }
    }

    // With ONES, acc[NA..NA+3] are the ones columns: each holds the sum of its row (g, g, g+8, g+8).
    float sc[NS], acc[NAX];
    uint32_t p[NS / 2];
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f, a0, a1;
#pragma unroll
    for (int i = 0; i < NAX; ++i) acc[i] = 0.f;

    // S = Q Kᵀ for the tile in `stage`, issued and committed, not waited for.
    // K's k-step s and V's k-step kk of a stage's tiles, in either layout (TMA's [chunk][key]: K's LBO, the next d
    // chunk, 64 keys · 16 bytes and its SBO, the next key group, 128; V's LBO, the next key group, 128 and its
    // SBO, the next d chunk, 1024).
    auto kdesc = [](uint32_t stage, int s) {
        return TMA ? smem_desc(stage + 2048 * s, 1024, 128) : smem_desc(stage + 256 * s, 128, KC * 128);
    };
    auto vdesc = [](uint32_t vs, int kk) {
        return TMA ? smem_desc(vs + 256 * kk, 128, 1024) : smem_desc(vs + kk * 2 * VCX * 128, VCX * 128, 128);
    };
    auto issue_s = [&](uint32_t stage) {
        if constexpr (QS) {
            Wgmma<T>::template qk<0>(sc, smem_desc(qs, 128, KC * 128), kdesc(stage, 0));
#pragma unroll
            for (int s = 1; s < KS; ++s)
                Wgmma<T>::template qk<1>(sc, smem_desc(qs + 256 * s, 128, KC * 128), kdesc(stage, s));
        } else {
            Wgmma<T>::template qk<0>(sc, qa[0], kdesc(stage, 0));
#pragma unroll
            for (int s = 1; s < KS; ++s) Wgmma<T>::template qk<1>(sc, qa[s], kdesc(stage, s));
        }
        wgmma_commit();
    };
    auto issue_pv = [&](int j) {
        const uint32_t vs = base + (j % STAGES) * STAGE + K_BYTES;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            Wgmma<T>::template pv<Tiles<D>::PV_N>(acc, p + 4 * kk, vdesc(vs, kk));
        wgmma_commit();
    };
    // The same products for the three-stage loop from a stage address in 16-byte units, the descriptors' constant
    // words folded (shared addresses lie below 2^18: smem_desc's mask is a no-op): no % 3 and no mask per tile.
    // The same strides as kdesc and vdesc, a k-step two chunks (K) or two key groups (V) on.
    constexpr uint32_t K_LO = TMA ? 64 << 16 : 8 << 16, K_HI = TMA ? 8 : KC * 8;
    constexpr uint32_t V_LO = TMA ? 8 << 16 : VCX * 8 << 16, V_HI = TMA ? 64 : 8;
    constexpr uint32_t K_STEP = TMA ? 128 : 16, V_STEP = TMA ? 16 : 2 * VCX * 8;
    auto desc = [](uint32_t lo, uint32_t hi) { return (uint64_t)hi << 32 | lo; };
    auto issue_s16 = [&](uint32_t s16) {
        if constexpr (QS) {
            Wgmma<T>::template qk<0>(sc, desc(K_LO + (qs >> 4), K_HI), desc(K_LO + s16, K_HI));
#pragma unroll
            for (int s = 1; s < KS; ++s)
                Wgmma<T>::template qk<1>(sc, desc(K_LO + (qs >> 4) + 16 * s, K_HI),
                                         desc(K_LO + s16 + K_STEP * s, K_HI));
        } else {
            Wgmma<T>::template qk<0>(sc, qa[0], desc(K_LO + s16, K_HI));
#pragma unroll
            for (int s = 1; s < KS; ++s) Wgmma<T>::template qk<1>(sc, qa[s], desc(K_LO + s16 + K_STEP * s, K_HI));
        }
        wgmma_commit();
    };
    auto issue_pv16 = [&](uint32_t s16) {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            Wgmma<T>::template pv<Tiles<D>::PV_N>(acc, p + 4 * kk,
                                                  desc(V_LO + s16 + K_BYTES / 16 + kk * V_STEP, V_HI));
        wgmma_commit();
    };
    auto rescale = [&]() {
#pragma unroll
        for (int i = 0; i < NAX; i += 4) {
            acc[i] *= a0;
            acc[i + 1] *= a0;
            acc[i + 2] *= a1;
            acc[i + 3] *= a1;
        }
    };

    // Tile 0 complete (tile 1's group may still be in flight); the cp.async and pad writes made visible to the
    // async proxy through which wgmma reads shared memory, then to every thread.
    if constexpr (RING || TMA) {
        mbar_wait(full0, 0);
    } else {
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    if constexpr (!RING) __syncthreads();
    wgmma_fence();
    if constexpr (RING)
        issue_s(base);
    else
        issue_s16(s_a);
    wgmma_wait<0>();
    fence_regs(sc);
    softmax_tile<NS, 1, !ONES>(sc, min(BN, sk), t, c, m0, m1, l0, l1, a0, a1);
    pack_p<T, NS>(p, sc);

    if constexpr (RING) {
        // Tile j+1's stage is full once every thread's copies have landed; a thread's P·V of tile j empties tile
        // j's. Tile j+3 is requested at the end of iteration j, into tile j-1's stage, once all have emptied it: a
        // warpgroup may run up to a tile ahead of the others, where the block barrier kept them in step (D 64:
        // 373-382 → 310 µs at (2, 4096, 10, 64), ONES included). A shared store of the softmax's results (the row
        // sums; with ONES the last four probabilities, which pin only part of it) keeps the wait for P·V after
        // them: ptxas otherwise issues that wait within the first instructions of the softmax (it does so in the
        // three-stage loop below too), and with the ring that cost 30.5 against 26.1 µs at (2, 1024, 8, 80). The
        // last key tile's iteration is peeled: it alone masks, unconditionally.
        auto step = [&](int j, auto last) {
            constexpr bool LAST = decltype(last)::value;
            mbar_wait(full0 + 8 * ((j + 1) % STAGES), ((j + 1) / STAGES) & 1);
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            wgmma_fence();
            issue_s(base + ((j + 1) % STAGES) * STAGE);
            issue_pv(j);
            wgmma_wait<1>();
            fence_regs(sc);
            softmax_tile<NS, LAST ? 2 : 0, !ONES>(sc, sk - (j + 1) * BN, t, c, m0, m1, l0, l1, a0, a1);
            if constexpr (ONES)
                asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(pin), "f"(sc[NS - 1]),
                             "f"(sc[NS - 2]), "f"(sc[NS - 3]), "f"(sc[NS - 4])
                             : "memory");
            else
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(pin), "f"(l0), "f"(l1) : "memory");
            wgmma_wait<0>();
            fence_regs(acc);
            fence_regs(p);
            mbar_arrive(empty0 + 8 * (j % STAGES));
            rescale();
            pack_p<T, NS>(p, sc);
            if constexpr (!LAST) {
                if ((!TMA || tid == 0) && j >= 1)
                    mbar_wait(empty0 + 8 * ((j - 1) % STAGES), ((j - 1) / STAGES) & 1);
                load(j + 3);
            }
        };
        for (int j = 0; j + 2 < nt; ++j) step(j, Last<false>{});
        if (nt >= 2) step(nt - 2, Last<true>{});
    } else {
        // The last tile is peeled off so that the loop body has no branch between issuing a wgmma and waiting for
        // it (ptxas serialises wgmmas it cannot follow through control flow). The wait for P·V is pinned after the
        // softmax as in the ring (ptxas hoists it otherwise); here it pays only with the ones column and the lean
        // loader and descriptors (notes at HOPPER_BOTH).
        for (int j = 0; j + 1 < nt; ++j) {
            // Tile j+1 has landed (this thread's copies; the barrier makes it everyone's) and every warpgroup has
            // finished tile j-1, so its stage can take tile j+2.
            if constexpr (TMA) {
                // The copies write through the async proxy that wgmma reads through: no proxy fence. The barrier
                // still frees tile j-1's stage for tile j+2 (an empty mbarrier per stage, waited for by thread 0
                // alone, measured slower: 154-156 against 152-154 us at (2, 4096, 8, 40)).
                mbar_wait(full0 + 8 * ((j + 1) % STAGES), ((j + 1) / STAGES) & 1);
                __syncthreads();
                tma_tile(j + 2);
            } else {
                asm volatile("cp.async.wait_group 0;\n" ::: "memory");
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                __syncthreads();
                loader.load(s_c << 4, (j + 2) * BN, sk);
            }

            wgmma_fence(); // p and acc were written by ordinary instructions
            issue_s16(s_b);
            issue_pv16(s_a);
            wgmma_wait<1>(); // the scores; P·V may still run
            fence_regs(sc);
            softmax_tile<NS, 1, !ONES>(sc, min(BN, sk - (j + 1) * BN), t, c, m0, m1, l0, l1, a0, a1);
            if constexpr (ONES)
                asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(pin), "f"(sc[NS - 1]),
                             "f"(sc[NS - 2]), "f"(sc[NS - 3]), "f"(sc[NS - 4])
                             : "memory");
            else
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(pin), "f"(l0), "f"(l1) : "memory");
            wgmma_wait<0>();
            fence_regs(acc);
            fence_regs(p);
            rescale();
            pack_p<T, NS>(p, sc);
            const uint32_t x = s_a;
            s_a = s_b;
            s_b = s_c;
            s_c = x;
        }
    }
    // The last tile landed before the previous iteration's barrier or wait (the prologue's, for a single tile).
    wgmma_fence();
    if constexpr (RING)
        issue_pv(nt - 1);
    else
        issue_pv16(s_a);
    wgmma_wait<0>();
    fence_regs(acc);

    if constexpr (ONES) {
        l0 = acc[NA];
        l1 = acc[NA + 2];
    } else {
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            l0 += __shfl_xor_sync(0xffffffff, l0, off);
            l1 += __shfl_xor_sync(0xffffffff, l1, off);
        }
    }
    const float i0 = 1.f / l0, i1 = 1.f / l1;
    T *o0 = o + ((long long)b * sq + r0) * heads * D + h * D, *o1 = o0 + 8LL * heads * D;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
        const int col = 8 * j + 2 * t;
        if (r0 < sq) *reinterpret_cast<uint32_t *>(o0 + col) = pack_f2<T>(acc[4 * j] * i0, acc[4 * j + 1] * i0);
        if (r1 < sq) *reinterpret_cast<uint32_t *>(o1 + col) = pack_f2<T>(acc[4 * j + 2] * i1, acc[4 * j + 3] * i1);
    }
}

} // namespace hopper
#endif

} // namespace

#define FLASH(DP, TAG, BK, W, A, S, BOUNDS, T, SFX)                                                              \
    extern "C" __global__ void __launch_bounds__ BOUNDS flash_attention_d##DP##TAG##_##SFX(                        \
        const T *q, const T *k, const T *v, T *o, int sq, int sk, int d, int heads, long long q_bs, long long q_ss, \
        long long k_bs, long long k_ss, long long v_bs, long long v_ss, float scale_log2) {                        \
        flash_attention<T, DP, BK, W, A, S>(q, k, v, o, sq, sk, d, heads, q_bs, q_ss, k_bs, k_ss, v_bs, v_ss,      \
                                            scale_log2);                                                          \
    }
#define FLASH_BOTH(DP, BK, W, A, BOUNDS)                                                                          \
    FLASH(DP, , BK, W, A, 1, BOUNDS, __half, f16)                                                                 \
    FLASH(DP, , BK, W, A, 1, BOUNDS, __nv_bfloat16, bf16)
#define FLASH_SPLIT_BOTH(DP, BK, W, A, S, BOUNDS)                                                                 \
    FLASH(DP, _split, BK, W, A, S, BOUNDS, __half, f16)                                                           \
    FLASH(DP, _split, BK, W, A, S, BOUNDS, __nv_bfloat16, bf16)

// Block shapes (key tile, warps, 16-row atoms per warp, resident blocks), measured on an H100 at the UNets' shapes;
// `block_shape` in attention.rs must match. 64-key tiles up to DP 96, 32-key tiles above (shared memory). Up to DP
// 64 the registers are capped for five resident blocks per SM (96 per thread): SDXL's DP 64 would take 103 and fit
// four, and the fifth block cut its attention's kernel time by 12 % (ncu: 15.3 → 13.4 ms per step) despite a
// 36-byte spill. DP 48 (SD1.5's heads of 40) gives each warp two atoms over 32-key tiles, so every K and V
// fragment read from shared memory feeds two products, at four blocks of 128 registers per thread: 272 µs against
// 313 µs for one atom over 64 keys at (2, 4096, 8, 40) self-attention, 14.6 against 18.7 µs for the cross-attention
// over 77 keys (two atoms over 64 keys: 308 µs; three blocks of two atoms: 360 µs). For DP 64 one atom stays
// best (491 µs against 510 µs at SDXL's (2, 4096, 10, 64)). Larger heads keep what the compiler picks.
// SD1.5's heads of 160 (its 16² and 8² maps) make grids far smaller than the GPU, where each warp's key loop sets the
// time: the host takes the split instantiation, 32 rows in two warps times four key groups of 32 keys (one block
// of 256 threads and 168 KiB per SM), where its blocks fit in one wave and the device has the shared memory.
// `xtask/bench/attention_shapes.cu`, H100, (2, Sq, 8, 160) self 16², cross 16² (77 keys), self 8², cross 8²:
// 12.2 / 9.2 / 7.8 / 8.0 µs against 23.2 / 12.2 / 9.8 / 12.1 before (10.9 / 8.3 / 10.7 of which came with the
// query tile requested together with the first key tile), 122 against 199 µs per step (five 16² and one 8²
// transformer). Two key groups of 64 rows: 16.2 / 9.9 / 7.3 / 9.4; of 32 rows: 15.2 / 9.7 / 6.5 / 8.9; four
// groups of 16 keys, 32 rows: 14.3 / 9.7 / 7.1 / 8.9. At (2, 576, 8, 160) (two waves of split blocks) 58 against
// 51 µs, at (2, 1024, 8, 160) 118 against 87 µs: the 64-row blocks stay there.
#ifndef SDHIVE_ATTENTION_NO_INSTANCES
FLASH_BOTH(16, 64, 4, 1, (128, 5))
FLASH_BOTH(32, 64, 4, 1, (128, 5))
FLASH_BOTH(48, 32, 4, 2, (128, 4))
FLASH_BOTH(64, 64, 4, 1, (128, 5))
FLASH_BOTH(80, 64, 4, 1, (128))
FLASH_BOTH(96, 64, 4, 1, (128))
FLASH_BOTH(128, 32, 4, 1, (128))
FLASH_BOTH(160, 32, 4, 1, (128))
FLASH_SPLIT_BOTH(160, 32, 2, 1, 4, (256))
#endif

// The short-key kernel (cross_attention) per head dimension: (warps, 16-row atoms per warp, launch bounds), its Q ring
// two tiles deep; `cross_shape` in attention.rs must match. `xtask/bench/attention_cross.cu` on an H100, f16, 77 keys,
// per call in a CUDA graph, against the kernels the host took before (the Hopper kernels at 40, 64, 80, the key-split
// one at 160), each at the grid attention.rs's rule picks: SD1.5 (2, 4096, 8, 40) 7.95-8.04 against 14.26-14.31 us, (2,
// 1024, 8, 80) 4.63 against 8.37-8.56, (2, 256, 8, 160) 5.20-5.23 against 8.43-8.45, (2, 64, 8, 160) 5.01 against 7.15;
// SDXL (2, 4096, 10, 64) 12.14-12.29 against 25.39, (2, 1024, 20, 64) 7.59-7.64 against 14.26-14.28; errors as the
// others'. Over 128 keys (two tiles, one rescale) at the same shapes: 11.8 against 16.6 us (40), 6.4 against 8.7 (80),
// 7.9 against 9.3 (160), 19.2 against 27.9 (64, at 4096 rows). Alternatives at the 77-key shapes: at 40 one atom 9.26
// (four warps), 8.68 (eight), two atoms in eight warps 7.69; at 64 two atoms 11.72 / 8.36, eight warps (rule) 20.2 /
// 7.29; at 80 four warps 5.25; at 160 eight warps 6.08 / 4.53. A third Q tile in flight changed nothing (within 0.2
// us). Before the key tiles were made whole (rows zeroed up to CROSS_TILE) and the row sums moved to the ones column,
// runtime bounds on the unrolled loops made ptxas guard every ldmatrix and shuffle for divergence: 10.6 us at 40, 15.7
// at 64.
#define CROSS(D, W, A, BOUNDS, T, SFX)                                                                            \
    extern "C" __global__ void __launch_bounds__ BOUNDS cross_attention_d##D##_##SFX(                             \
        const T *q, const T *k, const T *v, T *o, int sq, int sk, int d, int heads, long long q_bs, long long q_ss, \
        long long k_bs, long long k_ss, long long v_bs, long long v_ss, float scale_log2) {                        \
        cross_attention<T, D, W, A, 2>(q, k, v, o, sq, sk, heads, q_bs, q_ss, k_bs, k_ss, v_bs, v_ss, scale_log2); \
    }
#define CROSS_BOTH(D, W, A, BOUNDS)                                                                               \
    CROSS(D, W, A, BOUNDS, __half, f16)                                                                           \
    CROSS(D, W, A, BOUNDS, __nv_bfloat16, bf16)
#ifndef SDHIVE_ATTENTION_NO_INSTANCES
CROSS_BOTH(40, 4, 2, (128, 2))
CROSS_BOTH(64, 4, 1, (128, 3))
CROSS_BOTH(80, 8, 1, (256, 1))
CROSS_BOTH(160, 4, 1, (128, 2))
#endif

// The same kernel with a causal mask, for the CLIP text encoders' self-attention (77 tokens, heads of 64 in SD1.5's,
// SD2's and SDXL's encoders): their layers then replay from a CUDA graph, which the split into heads and the masked
// softmax of the unfused attention (strided copies whose layouts candle uploads at every call) would prevent.
#define CAUSAL(D, W, A, BOUNDS, T, SFX)                                                                           \
    extern "C" __global__ void __launch_bounds__ BOUNDS causal_attention_d##D##_##SFX(                            \
        const T *q, const T *k, const T *v, T *o, int sq, int sk, int d, int heads, long long q_bs, long long q_ss, \
        long long k_bs, long long k_ss, long long v_bs, long long v_ss, float scale_log2) {                        \
        cross_attention<T, D, W, A, 2, true>(q, k, v, o, sq, sk, heads, q_bs, q_ss, k_bs, k_ss, v_bs, v_ss,       \
                                             scale_log2);                                                         \
    }
#ifndef SDHIVE_ATTENTION_NO_INSTANCES
CAUSAL(64, 4, 1, (128, 3), __half, f16)
CAUSAL(64, 4, 1, (128, 3), __nv_bfloat16, bf16)
#endif

// The Hopper kernels: (head dimension, warpgroups of 64 query rows per block, resident blocks per SM), the registers
// capped for those blocks (D 80 spills 16 bytes, one L1-resident reload per key tile); dynamic shared memory
// STAGES · 64 · (KC + VCX) · 16 bytes, plus NWG · 64 · KC · 16 with Q in shared memory (Tiles); `hopper_shape` in
// attention.rs must match. `xtask/bench/attention_wgmma.cu` on an H100, against the mma.sync kernel above (the
// alternatives were measured before the tile loader's offsets were precomputed, which took D 40 from 197 to 174 us):
// - D 40 (121 registers, 36 KiB: three stages, the ones column, the pinned wait, StreamLoader and rotated stage
//   addresses): SD1.5's (2, 4096, 8, 40) self-attention 166.0 us (two runs; 168.3-168.9 with q, k, v packed)
//   against 172.5-172.9 (172.0-172.9) for the three-stage loop without them, errors unchanged, 271-274 us for
//   mma.sync. Those parts pay only together: each alone or in pairs, measured against 172-175 us in the same runs
//   (before), the ones column 181 us; the pinned wait 183 us; the leaner loader and descriptors 173 us, with the
//   ones column 170. Not taken: 128-key tiles (179 registers, one block per SM) 235 us, three warpgroups 217 us,
//   one warpgroup per block 302 us; part of each thread's 32 exp2 as a polynomial on the FMA pipe 180 / 185 / 193
//   / 201 us for 4 / 8 / 12 / 16 of them (the loop issues about 350 instructions per warp and tile, and each added
//   one costs); the ring 175 us (with the pinned wait 179, with the ones column too 174); FA3's ping-pong over the
//   ring 185 us.
// - D 64 (140 registers, 68 KiB: the ring, the ones column): three warpgroups in the only block of an SM: SDXL's
//   (2, 4096, 10, 64) 310 us against 481 us, (2, 1024, 20, 64) 48.6 against 67 us (three stages and the block
//   barrier: 373-382 and 54 us; the ring without the ones column 321 and 51 us). Two blocks of two warpgroups took
//   399 and 64 us, one block of four 365 and 71 us (with the block barrier): at batch 2 the block count decides the
//   last wave (at (8, 1024, 20, 64) two blocks of two take 195 us, three warpgroups 216 us). One warpgroup per
//   block: 710 us.
// - D 80 (128 registers, 100 KiB, Q in shared memory, the ring): SD1.5's (2, 1024, 8, 80) 26.4 against 47 us (three
//   stages and the block barrier: 27.8-28.0 us), its cross-attention over 77 keys 9.2-9.3 against 9.0-9.1 us;
//   (8, 1024, 8, 80) took 97 against 133 us before the ring; Q in registers (137, one block per SM) 30 and 119 us.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SDHIVE_SM90A(...) __VA_ARGS__
#else
#define SDHIVE_SM90A(...) __trap()
#endif
#define HOPPER(D, NWG, BLOCKS, T, SFX)                                                                            \
    extern "C" __global__ void __launch_bounds__(128 * NWG, BLOCKS) attention_wgmma_d##D##_##SFX(                 \
        const T *q, const T *k, const T *v, T *o, int sq, int sk, int d, int heads, long long q_bs, long long q_ss, \
        long long k_bs, long long k_ss, long long v_bs, long long v_ss, float scale_log2) {                        \
        SDHIVE_SM90A(hopper::attention<T, D, NWG>(q, k, v, o, sq, sk, heads, q_bs, q_ss, k_bs, k_ss, v_bs, v_ss,  \
                                                  scale_log2));                                                   \
    }
#define HOPPER_BOTH(D, NWG, BLOCKS)                                                                               \
    HOPPER(D, NWG, BLOCKS, __half, f16)                                                                           \
    HOPPER(D, NWG, BLOCKS, __nv_bfloat16, bf16)
// Every Hopper instantiation has a TMA twin (attention.rs takes it unless SDHIVE_ATTENTION_TMA=0), its tensor maps
// passed by value (wgmma_common.cuh's TmaMap).
#define HOPPER_TMA(D, NWG, BLOCKS, T, SFX)                                                                        \
    extern "C" __global__ void __launch_bounds__(128 * NWG, BLOCKS) attention_wgmma_d##D##_tma_##SFX(             \
        const T *q, const T *k, const T *v, T *o, int sq, int sk, int d, int heads, long long q_bs, long long q_ss, \
        long long k_bs, long long k_ss, long long v_bs, long long v_ss, float scale_log2,                         \
        const __grid_constant__ TmaMap km, const __grid_constant__ TmaMap vm) {                                   \
        SDHIVE_SM90A(hopper::attention<T, D, NWG, true>(q, k, v, o, sq, sk, heads, q_bs, q_ss, k_bs, k_ss, v_bs,  \
                                                        v_ss, scale_log2, &km, &vm));                             \
    }
#define HOPPER_TMA_BOTH(D, NWG, BLOCKS)                                                                           \
    HOPPER_TMA(D, NWG, BLOCKS, __half, f16)                                                                       \
    HOPPER_TMA(D, NWG, BLOCKS, __nv_bfloat16, bf16)
#ifndef SDHIVE_ATTENTION_NO_INSTANCES
HOPPER_BOTH(40, 2, 2)
HOPPER_BOTH(64, 3, 1)
HOPPER_BOTH(80, 2, 2)
// The TMA twins against the above (H100, xtask/bench/attention_wgmma.cu, errors identical): D 40 (2, 4096, 8, 40)
// 151.7-152.4 us against 166.4-167.8 (q, k, v packed 153.7-154.4 against 168.6-169.8), 110 registers against 121;
// D 64 (2, 4096, 10, 64) 293.8 against 310.2 us, (2, 1024, 20, 64) 44.3 against 48.5 (packed 45.5 against 50.3),
// 127 registers; D 80 (2, 1024, 8, 80) 23.0 against 26.6 us (packed 22.9 against 26.5), 119 registers.
// Cross-attention's 77 keys go to the short-key kernel either way.
HOPPER_TMA_BOTH(40, 2, 2)
HOPPER_TMA_BOTH(64, 3, 1)
HOPPER_TMA_BOTH(80, 2, 2)
#endif
