// A 3×3 convolution (stride 1, padding 1) of small channels-last maps for Hopper (sm_90a): images of 8×8 pixels,
// f16 or bf16 storage, f32 accumulation, filter KRSC, `y = conv(x) + bias (+ skip)`. These are SD1.5's lowest
// UNet level (batch 2: 128 output pixels), where the convolution is a read of its 29.5 or 59 MB filter and little
// else: cuDNN runs it on 40 blocks (or a split-K kernel whose partial sums take a second pass) at well under the
// memory's bandwidth. Here the filter's input channels are split among the S blocks of a thread block cluster,
// so that S × (K/64) blocks stream the filter at once, and the S partial sums are added inside the cluster through
// distributed shared memory: no partials in global memory, no second launch.
// - GEMM view per block: D(64 output channels × 64·NB pixels) += W(64 × 64 channels of one tap) · X(the pixels ×
//   those channels, shifted by the tap), one wgmma m64n(64·NB)k16 per 16 channels, both operands in shared memory.
// - The filter tiles (64 output channels × 64 input channels of one tap, 8 KB) stream through a cp.async ring,
//   128-byte swizzle (wgmma_common.cuh's layout), one tile's products in flight while the next is waited for.
// - The input is loaded once per 64-channel slice as a "halo": every image's 10×10 padded pixels (the border
//   zeroed once), no swizzle, 8-channel columns of all pixels one after another, the images' rows alternating. A
//   tap's operand is then a window of it: the 8 pixels of an output row are 8 consecutive halo pixels (16 bytes
//   each: one core matrix of wgmma's no-swizzle layout), the next row of pixels (the other image's, then the next
//   row's) 10 pixels on (the descriptor's row-group stride), the next 8 channels a column on (its K stride). The
//   9 taps read the slice from shared memory instead of 9 times from L2.
// - Split order reduction: each block owns a contiguous share of the output pixels. Every block stages its f32
//   partial tile in its own shared memory and sends each other block that block's pixels with one bulk copy
//   (shared::cta to shared::cluster, completion counted in bytes on the receiver's mbarrier); each block then adds
//   the S partials of its pixels in rank order (so the sum does not depend on timing), the bias and the skip, and
//   writes them. A block arrives at the cluster barrier once all it was sent is in, and leaves after everyone has,
//   so no block's partials go away while they are being copied.
// Constraints the host checks: H = W = 8, C % (64·S) == 0, K % 64 == 0, images ≤ NB, 16-byte aligned pointers.
// Only in the arch-specific sm_90a target (build.rs); elsewhere the kernels are traps the host never launches.
#include "wgmma_common.cuh"

namespace conv_splitk {

constexpr int SIDE = 8;                       // output (and input) side
constexpr int HALO_SIDE = SIDE + 2;           // with the padding
constexpr int HALO_PIX = HALO_SIDE * HALO_SIDE;
constexpr int TILE = 64 * 128;                // a filter tile: 64 rows of 64 values
constexpr int PITCH = 72;                     // floats per pixel row of the partials (64 + 8: fewer bank conflicts)

// K stride of the halo (one 8-channel column of all NB images' pixels), 16 bytes more so that the eight columns
// of one pixel do not fall in one bank group when copied.
template <int NB> __host__ __device__ constexpr int halo_lbo() { return NB * HALO_PIX * 16 + 16; }
template <int NB> __host__ __device__ constexpr int halo_bytes() { return 8 * halo_lbo<NB>(); }
// The ring of D + 2 filter stages, later the partials (NB·64 pixels × PITCH floats); then two halo slices.
template <int NB, int D> __host__ __device__ constexpr int low_bytes() {
    return (D + 2) * TILE > NB * 64 * PITCH * 4 ? (D + 2) * TILE : NB * 64 * PITCH * 4;
}
// Pixels of the output whose sums one block of S makes (the last ones may make one fewer).
template <int S, int NB> __host__ __device__ constexpr int owned_pixels() { return (NB * 64 + S - 1) / S; }
// The partials the other blocks send a block: one slot per rank (its own unused), its pixels × PITCH floats.
template <int S, int NB> __host__ __device__ constexpr int slot_bytes() { return owned_pixels<S, NB>() * PITCH * 4; }
template <int S, int NB, int D> __host__ __device__ constexpr int smem_bytes() {
    return low_bytes<NB, D>() + 2 * halo_bytes<NB>() + S * slot_bytes<S, NB>() + 16 + 1024;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
using namespace sm90;

// D(64×N, f32) += A(64×16) · B(16×N), both K-major in shared memory: N = 64 per image.
template <typename T, int NB> struct Mma;
#define CS_MMA_FOR(T, TY)                                                                                         \
    template <> struct Mma<T, 1> {                                                                                \
        static __device__ __forceinline__ void run(float (&d)[32], uint64_t da, uint64_t db) {                    \
            WG_MMA_SS(TY, 64, WG_R32, 32, 33, WG_ACC32(0));                                                        \
        }                                                                                                         \
    };                                                                                                            \
    template <> struct Mma<T, 2> {                                                                                \
        static __device__ __forceinline__ void run(float (&d)[64], uint64_t da, uint64_t db) {                    \
            WG_MMA_SS(TY, 128, WG_R64, 64, 65, WG_ACC32(0), WG_ACC32(32));                                         \
        }                                                                                                         \
    };
CS_MMA_FOR(__half, "f16")
CS_MMA_FOR(__nv_bfloat16, "bf16")

// No-swizzle K-major operand: core matrices of 8 rows × 16 bytes, `lbo` bytes apart along K, `sbo` apart along
// the rows; layout bits 62-63 zero.
__device__ __forceinline__ uint64_t desc_plain(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}

__device__ __forceinline__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
// `addr` in this block's shared memory as the same offset in cluster block `rank`'s.
__device__ __forceinline__ uint32_t in_block(uint32_t addr, uint32_t rank) {
    uint32_t ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(ra) : "r"(addr), "r"(rank));
    return ra;
}

// Block (rank, n) of the grid (S, K/64), cluster (S, 1, 1): output channels 64·n.., input channel slices
// rank·C/(64·S).. (each 64 channels, all 9 taps). `nb` images (at most NB); `skip` may be null. D: tiles in flight.
template <typename T, int S, int NB, int D>
__device__ __forceinline__ void conv(const T *__restrict__ x, const T *__restrict__ w, const T *__restrict__ bias,
                                     const T *__restrict__ skip, T *__restrict__ y, int nb, int C, int K) {
    static_assert(D >= 1 && D <= 8, "a halo slice is refilled only once the 9 tiles two slices back are done");
    // One tile's products stay in flight while the next is issued: the stage refilled is two tiles back.
    constexpr int STAGES = D + 2, LBO = halo_lbo<NB>(), HALO = halo_bytes<NB>(), LOW = low_bytes<NB, D>();
    constexpr int SLOT = slot_bytes<S, NB>();
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    const uint32_t base = (raw + 1023) & ~1023u, halo0 = base + LOW, recv0 = halo0 + 2 * HALO, bar = recv0 + S * SLOT;
    const int tid = threadIdx.x, rank = blockIdx.x, m0 = blockIdx.y * 64;
    const int n_sl = C / (64 * S), KT = 9 * n_sl, slice0 = rank * n_sl;
    const size_t wrow = (size_t)9 * C;
    // This block adds up the output pixels [p0, p1) of its 64 channels; the other S - 1 blocks each send it their
    // partials for them, which its barrier counts in bytes.
    const int np = nb * 64, p0 = rank * np / S, p1 = (rank + 1) * np / S;
    if (tid == 0) {
        mbar_init(bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        mbar_expect(bar, (S - 1) * (p1 - p0) * PITCH * 4);
    }
    // Every block's barrier is ready before any block sends to it (the wait is just before the first send).
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");

    // The halo's border and the images past `nb` are zeros in both slice buffers, written once: the copies
    // below only ever fill the image pixels. Halo row hy of image b starts at pixel (hy·NB + b)·10: the images'
    // rows alternate, so that the 8·NB pixel rows of one tap are evenly spaced and one product covers all images.
    for (int idx = tid; idx < 2 * NB * HALO_PIX * 8; idx += 128) {
        const int c = idx % 8, pix = idx / 8 % (NB * HALO_PIX), buf = idx / (8 * NB * HALO_PIX);
        const int hx = pix % HALO_SIDE, b = pix / HALO_SIDE % NB, hy = pix / HALO_SIDE / NB;
        if (b >= nb || hy == 0 || hy == HALO_SIDE - 1 || hx == 0 || hx == HALO_SIDE - 1)
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(halo0 + buf * HALO + c * LBO + pix * 16),
                         "r"(0));
    }

    // The filter tile's copies: 512 chunks of 16 bytes, four per thread, the same for every tile.
    uint32_t w_dst[4];
    size_t w_src[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int idx = tid + i * 128, r = idx / 8, c = idx % 8;
        w_dst[i] = r * 128 + ((c ^ (r & 7)) << 4);
        w_src[i] = (size_t)(m0 + r) * wrow + c * 8;
    }
    auto load = [&](int kt) {
        if (kt < KT) {
            const int sl = kt / 9, tap = kt % 9, c0 = (slice0 + sl) * 64;
            const uint32_t st = base + (kt % STAGES) * TILE;
#pragma unroll
            for (int i = 0; i < 4; ++i) cp16(st + w_dst[i], w + w_src[i] + tap * C + c0, 16);
            if (tap == 0) {
                // Pixel p (NHWC order) of the input is halo pixel (y + 1, x + 1) of its image.
                const uint32_t hb = halo0 + (sl % 2) * HALO;
                for (int idx = tid; idx < nb * 64 * 8; idx += 128) {
                    const int c = idx % 8, p = idx / 8;
                    const int hp = ((p % 64 / 8 + 1) * NB + p / 64) * HALO_SIDE + p % 8 + 1;
                    cp16(hb + c * LBO + hp * 16, x + (size_t)p * C + c0 + c * 8, 16);
                }
            }
        }
        cp_commit();
    };

    float acc[32 * NB];
#pragma unroll
    for (int i = 0; i < 32 * NB; ++i) acc[i] = 0.f;

#pragma unroll
    for (int s = 0; s < D; ++s) load(s);
    for (int kt = 0; kt < KT; ++kt) {
        // Every thread's part of tile kt (and of its halo) has landed, the zeros above are visible to wgmma too,
        // and tile kt-2's products are done.
        ring_landed<D - 1>();
        load(kt + D);
        const int sl = kt / 9, tap = kt % 9;
        // The tap's window: output row y of image b reads halo row y + tap/3 from column tap%3 on.
        const uint32_t hb = halo0 + (sl % 2) * HALO + ((tap / 3) * NB * HALO_SIDE + tap % 3) * 16;
        const uint64_t da = desc_sw128(base + (kt % STAGES) * TILE);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            Mma<T, NB>::run(acc, da + 2 * kk, desc_plain(hb + 2 * kk * LBO, LBO, HALO_SIDE * 16));
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    fence_regs(acc);

    // Units of 8 output channels of one of this block's pixels; their bias and skip are read before the
    // partials arrive, so that the reads overlap the wait.
    constexpr int MAXU = (owned_pixels<S, NB>() * 8 + 127) / 128;
    const int units = (p1 - p0) * 8;
    uint4 bv[MAXU], sv[MAXU];
#pragma unroll
    for (int j = 0; j < MAXU; ++j) {
        const int u = tid + 128 * j;
        bv[j] = sv[j] = make_uint4(0, 0, 0, 0);
        if (u < units) {
            bv[j] = *reinterpret_cast<const uint4 *>(bias + m0 + u % 8 * 8);
            if (skip != nullptr)
                sv[j] = *reinterpret_cast<const uint4 *>(skip + (size_t)(p0 + u / 8) * K + m0 + u % 8 * 8);
        }
    }
    // Every warp's products are done before the partials overwrite the ring.
    __syncthreads();

    // Accumulator i of a thread: output channel 16·warp + lane/4 + 8·((i/2)%2), product column 8·(i/4) +
    // 2·(lane%4) + i%2, whose pixel row i/4 holds row (i/4)/NB of image (i/4)%NB. The partials go to this
    // block's shared memory as rows of PITCH floats per output pixel (NHWC order), so that each block's pixels
    // are one contiguous piece.
    const int warp = tid / 32, lane = tid % 32;
#pragma unroll
    for (int i = 0; i < 32 * NB; ++i) {
        const int m = 16 * warp + lane / 4 + 8 * ((i / 2) % 2), g = i / 4, b = g % NB;
        const int pix = b * 64 + g / NB * 8 + 2 * (lane % 4) + i % 2;
        if (b < nb) asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(base + (pix * PITCH + m) * 4), "f"(acc[i]));
    }
    // The stores above are read by the bulk copies (the async proxy).
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
    if (tid < S && tid != rank) {
        // Block `tid`'s pixels of this block's partials into its slot `rank`.
        const int q0 = tid * np / S, q1 = (tid + 1) * np / S;
        asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                         in_block(recv0 + rank * SLOT, tid)),
                     "r"(base + q0 * PITCH * 4), "r"((q1 - q0) * PITCH * 4), "r"(in_block(bar, tid))
                     : "memory");
    }
    mbar_wait(bar, 0);
    // Everything sent here has arrived, so this block is done with the others' shared memory.
    cluster_arrive();

#pragma unroll
    for (int j = 0; j < MAXU; ++j) {
        const int u = tid + 128 * j;
        if (u < units) {
            const int lp = u / 8, q = u % 8;
            // The S partials in rank order (this block's own from its staging rows), so that the sum does not
            // depend on which block finished first.
            float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int r = 0; r < S; ++r) {
                const uint32_t at = r == rank ? base + ((p0 + lp) * PITCH + q * 8) * 4 : recv0 + r * SLOT + (lp * PITCH + q * 8) * 4;
                float4 a, c;
                asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(a.x), "=f"(a.y), "=f"(a.z), "=f"(a.w) : "r"(at));
                asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(c.x), "=f"(c.y), "=f"(c.z), "=f"(c.w) : "r"(at + 16));
                sum[0] += a.x, sum[1] += a.y, sum[2] += a.z, sum[3] += a.w;
                sum[4] += c.x, sum[5] += c.y, sum[6] += c.z, sum[7] += c.w;
            }
            const uint32_t bw[4] = {bv[j].x, bv[j].y, bv[j].z, bv[j].w}, sw[4] = {sv[j].x, sv[j].y, sv[j].z, sv[j].w};
            uint32_t out[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 bf = to_f2(bw[e], T()), sf = to_f2(sw[e], T());
                float a = sum[2 * e] + bf.x, c = sum[2 * e + 1] + bf.y;
                if (skip != nullptr) a += sf.x, c += sf.y;
                out[e] = pack2(a, c, T());
            }
            *reinterpret_cast<uint4 *>(y + (size_t)(p0 + lp) * K + m0 + q * 8) = make_uint4(out[0], out[1], out[2], out[3]);
        }
    }
    // No block leaves while another may still be reading its partials: each arrives once all it was sent is in.
    cluster_wait();
}

#endif // sm_90a or host

} // namespace conv_splitk

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CS_SM90A(...) __VA_ARGS__
#else
#define CS_SM90A(...) __trap()
#endif

// One launchable instantiation: conv_splitk_s<S>_b<NB>_d<D>_<f16|bf16>, 128 threads, smem_bytes<S, NB, D>() of
// dynamic shared memory, grid (S, K/64), its cluster (S, 1, 1) fixed here. The host's table (src/conv_splitk.rs)
// repeats these parameters.
#define CONV_SPLITK(S, NB, D, T, SFX)                                                                             \
    extern "C" __global__ void __cluster_dims__(S, 1, 1) __launch_bounds__(128, 1)                               \
        conv_splitk_s##S##_b##NB##_d##D##_##SFX(const T *x, const T *w, const T *bias, const T *skip, T *y,        \
                                                int nb, int C, int K) {                                           \
        CS_SM90A((conv_splitk::conv<T, S, NB, D>(x, w, bias, skip, y, nb, C, K)));                                \
    }
#define CONV_SPLITK_BOTH(S, NB, D)                                                                                \
    CONV_SPLITK(S, NB, D, __half, f16)                                                                            \
    CONV_SPLITK(S, NB, D, __nv_bfloat16, bf16)
#ifndef SDHIVE_CONV_SPLITK_NO_INSTANCES
// Five splits (100 blocks for 1280 output channels), eight tiles in flight: the fastest at SD1.5's 8² shapes
// (xtask/bench/conv_splitk.cu). Four splits for input channels that five do not divide.
CONV_SPLITK_BOTH(5, 2, 8)
CONV_SPLITK_BOTH(4, 2, 6)
#endif
