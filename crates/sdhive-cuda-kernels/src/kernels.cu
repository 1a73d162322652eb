// The fused kernels of sdhive-cuda-kernels: each replaces a chain of candle ops that made one pass over the
// tensor per op (several of them candle's strided broadcast kernels). Arithmetic is in f32 whatever the storage
// type; every kernel is instantiated for float, __half and __nv_bfloat16 (suffixes f32, f16, bf16).

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

// Running (count, mean, sum of squared deviations), combined with Chan et al.'s formula: the variance of large,
// offset groups stays exact where E[x²] − E[x]² would cancel.
struct Moments {
    float n, mean, m2;
};

__device__ __forceinline__ Moments combine(Moments a, Moments b) {
    float n = a.n + b.n;
    if (n == 0.f) return a;
    float d = b.mean - a.mean;
    float wb = b.n / n;
    return Moments{n, a.mean + d * wb, a.m2 + b.m2 + d * d * a.n * wb};
}

__device__ __forceinline__ Moments shfl_xor(Moments m, int offset) {
    return Moments{__shfl_xor_sync(0xffffffff, m.n, offset), __shfl_xor_sync(0xffffffff, m.mean, offset),
                   __shfl_xor_sync(0xffffffff, m.m2, offset)};
}

// Reduces one Moments per thread of the block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// block's total.
__device__ Moments block_moments(Moments m) {
    __shared__ Moments warps[32];
    __shared__ Moments total;
    for (int o = 16; o > 0; o >>= 1) m = combine(m, shfl_xor(m, o));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warps[warp] = m;
    __syncthreads();
    if (warp == 0) {
        Moments w = lane < (int)(blockDim.x / 32) ? warps[lane] : Moments{0.f, 0.f, 0.f};
        for (int o = 16; o > 0; o >>= 1) w = combine(w, shfl_xor(w, o));
        if (lane == 0) total = w;
    }
    __syncthreads();
    return total;
}

// GroupNorm, pass 1: block (chunk, group-of-sample) writes the moments of its chunk of the group's
// `group_elems` contiguous values to partial[(group * chunks + chunk) * 3 ..].
template <typename T>
__device__ void gn_stats(const T *x, float *partial, uint32_t group_elems, uint32_t chunks) {
    const size_t bg = blockIdx.y;
    const uint32_t per = (group_elems + chunks - 1) / chunks;
    const uint32_t start = blockIdx.x * per;
    const uint32_t end = min(start + per, group_elems);
    const T *g = x + bg * group_elems;
    Moments m{0.f, 0.f, 0.f};
    for (uint32_t i = start + threadIdx.x; i < end; i += blockDim.x) {
        float v = to_f(g[i]);
        m.n += 1.f;
        float d = v - m.mean;
        m.mean += d / m.n;
        m.m2 += d * (v - m.mean);
    }
    m = block_moments(m);
    if (threadIdx.x == 0) {
        float *p = partial + (bg * chunks + blockIdx.x) * 3;
        p[0] = m.n;
        p[1] = m.mean;
        p[2] = m.m2;
    }
}

// GroupNorm, pass 2: the group's moments from the partials, then (x − mean) / sqrt(var + eps) · w[c] + b[c],
// optionally through SiLU, for the same chunk. Channel c of element i of a group: i / inner, offset by the group.
template <typename T>
__device__ void gn_apply(const T *x, const T *w, const T *b, T *out, const float *partial, uint32_t group_elems,
                         uint32_t chunks, uint32_t channels_per_group, uint32_t inner, uint32_t groups, float eps,
                         int silu) {
    const size_t bg = blockIdx.y;
    Moments m{0.f, 0.f, 0.f};
    for (uint32_t k = threadIdx.x; k < chunks; k += blockDim.x) {
        const float *p = partial + (bg * chunks + k) * 3;
        m = combine(m, Moments{p[0], p[1], p[2]});
    }
    m = block_moments(m);
    const float mean = m.mean;
    const float rstd = rsqrtf(m.m2 / m.n + eps);
    const uint32_t first_channel = (uint32_t)(bg % groups) * channels_per_group;
    const uint32_t per = (group_elems + chunks - 1) / chunks;
    const uint32_t start = blockIdx.x * per;
    const uint32_t end = min(start + per, group_elems);
    const size_t base = bg * group_elems;
    for (uint32_t i = start + threadIdx.x; i < end; i += blockDim.x) {
        uint32_t c = first_channel + i / inner;
        float v = (to_f(x[base + i]) - mean) * rstd * to_f(w[c]) + to_f(b[c]);
        if (silu) v = v / (1.f + expf(-v));
        out[base + i] = from_f<T>(v);
    }
}

// out = y + add[sample, c] (+ residual): a per-channel bias (add_batch_stride 0) or a per-sample, per-channel
// term, over NCHW (inner = H·W) or channels-last (inner = 1, rows_per_sample = H·W pixel rows per sample) layouts. When every 16-byte group of values shares
// one channel (NCHW) or covers whole channels of one sample (channels-last), and the pointers allow it, each thread
// moves 16 bytes per load and store and does the index arithmetic once per group.
template <typename T>
__device__ void add_channel(const T *y, const T *add, const T *residual, T *out, size_t n, uint32_t channels,
                            uint32_t inner, uint32_t add_batch_stride, uint32_t rows_per_sample) {
    constexpr uint32_t VEC = 16 / sizeof(T);
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x, step = (size_t)gridDim.x * blockDim.x;
    const uintptr_t addr = reinterpret_cast<uintptr_t>(y) | reinterpret_cast<uintptr_t>(out) |
                           reinterpret_cast<uintptr_t>(residual) | reinterpret_cast<uintptr_t>(add);
    const bool last = inner == 1 && channels % VEC == 0 && add_batch_stride % VEC == 0;
    if ((last || inner % VEC == 0) && n % VEC == 0 && addr % 16 == 0) {
        for (size_t i = start; i < n / VEC; i += step) {
            const size_t e = i * VEC;
            uint4 yv = reinterpret_cast<const uint4 *>(y)[i], rv = make_uint4(0, 0, 0, 0), ov;
            if (residual) rv = reinterpret_cast<const uint4 *>(residual)[i];
            const T *ye = reinterpret_cast<const T *>(&yv), *re = reinterpret_cast<const T *>(&rv);
            T *oe = reinterpret_cast<T *>(&ov);
            if (last) {
                const size_t sample = e / channels / rows_per_sample;
                const uint4 av = *reinterpret_cast<const uint4 *>(add + sample * add_batch_stride + e % channels);
                const T *ae = reinterpret_cast<const T *>(&av);
#pragma unroll
                for (uint32_t j = 0; j < VEC; j++)
                    oe[j] = from_f<T>(to_f(ye[j]) + to_f(ae[j]) + (residual ? to_f(re[j]) : 0.f));
            } else {
                const size_t ci = e / inner;
                const float a = to_f(add[(ci / channels) * add_batch_stride + ci % channels]);
#pragma unroll
                for (uint32_t j = 0; j < VEC; j++)
                    oe[j] = from_f<T>(to_f(ye[j]) + a + (residual ? to_f(re[j]) : 0.f));
            }
            reinterpret_cast<uint4 *>(out)[i] = ov;
        }
        return;
    }
    for (size_t i = start; i < n; i += step) {
        size_t ci = i / inner;
        uint32_t c = (uint32_t)(ci % channels);
        size_t sample = ci / channels / (inner == 1 ? rows_per_sample : 1);
        float v = to_f(y[i]) + to_f(add[sample * add_batch_stride + c]);
        if (residual) v += to_f(residual[i]);
        out[i] = from_f<T>(v);
    }
}

// The sum of `v` over the warp, for every lane.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

// The sum of `v` over the block (at most 1024 threads, a multiple of 32), for every thread. `red` holds 32 floats
// and `total` one; consecutive calls may share them.
__device__ __forceinline__ float block_sum(float v, float *red, float *total) {
    v = warp_sum(v);
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const float t = warp_sum(lane < blockDim.x / 32 ? red[lane] : 0.f);
        if (lane == 0) *total = t;
    }
    __syncthreads();
    return *total;
}

// x · sigmoid(x) for a map of T: for 16-bit maps through the fast exponential and division (a few ulps of f32, far
// below their rounding), since the exact forms cost a normalisation over a 64² map more than its memory traffic,
// and the SD1.5 step's 45 gn_group_nhwc launches 0.02 of their 0.33 ms (ncu). f32 maps, which only the kernels'
// tests make channels-last (the engine keeps f32 maps NCHW), keep the exact forms.
template <typename T> __device__ __forceinline__ float silu_of(float v) {
    return sizeof(T) == 4 ? v / (1.f + expf(-v)) : __fdividef(v, 1.f + __expf(-v));
}

// One packed unit (4 or 16 bytes) of a map normalised: each value · scale + offset of its channel (+ SiLU).
template <typename T, typename U>
__device__ __forceinline__ U gn_normalised(const U &raw, const float *scale, const float *offset, int silu) {
    const T *e = reinterpret_cast<const T *>(&raw);
    U res;
    T *oe = reinterpret_cast<T *>(&res);
#pragma unroll
    for (uint32_t j = 0; j < sizeof(U) / sizeof(T); j++) {
        float val = fmaf(to_f(e[j]), scale[j], offset[j]);
        if (silu) val = silu_of<T>(val);
        oe[j] = from_f<T>(val);
    }
    return res;
}

// Most pixels of one group a thread of gn_group_nhwc keeps in registers (one 4-byte unit each); the host takes
// that kernel only where ⌊blockDim / units per pixel⌋ · CLUSTER · GN_GROUP_UNITS rows cover the map.
#define GN_GROUP_UNITS 32

// The sum of `v` over the CLUSTER blocks of a thread block cluster, for every thread: block sums through
// block_sum, then each block adds up the others' totals in their shared memory (the same order everywhere, so
// every block gets the same float). The second cluster-wide wait keeps `total` until every block has read it.
template <int CLUSTER> __device__ __forceinline__ float cluster_sum(float v, float *red, float *total) {
    const float mine = block_sum(v, red, total);
    if constexpr (CLUSTER == 1) {
        return mine;
    } else {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
        namespace cg = cooperative_groups;
        cg::cluster_group cluster = cg::this_cluster();
        cluster.sync();
        float sum = 0.f;
#pragma unroll
        for (int r = 0; r < CLUSTER; r++) sum += *cluster.map_shared_rank(total, r);
        cluster.sync();
        return sum;
#endif
    }
}

// Channel c0 of pixel 0 of `sample` in a channels-last map of `channels` read either from x alone (x2 null) or
// from two maps joined along their channels, the up path's skip concatenation never written before its norm:
// channels [0, c1) from x (rows of c1), [c1, channels) from x2 (rows of channels − c1). `pitch` gets the row
// length of the map the channel lives in; a run of channels read together must not straddle c1 (the host keeps c1
// a multiple of 16 bytes' worth).
template <typename T>
__device__ __forceinline__ const T *joined_at(const T *x, const T *x2, uint32_t c1, uint32_t sample,
                                              uint32_t pixels, uint32_t channels, uint32_t c0, uint32_t &pitch) {
    if (x2 == nullptr || c0 < c1) {
        pitch = x2 == nullptr ? channels : c1;
        return x + (size_t)sample * pixels * pitch + c0;
    }
    pitch = channels - c1;
    return x2 + (size_t)sample * pixels * pitch + (c0 - c1);
}

// GroupNorm over channels-last (N, H·W, C) maps in one launch, one cluster of CLUSTER blocks per (group, sample),
// for maps whose groups fit in the cluster's registers: the blocks load their share of the group's values once, 4
// bytes at a time (a group's C/groups channels of a pixel are contiguous; the host takes this kernel where 4
// bytes divide that run), sum them, sum the squared deviations from their mean (each sum over the cluster through
// distributed shared memory), and write the normalised values from the same registers. Where the two-launch path
// (gn_slab_*) reads the map twice, this reads it once; for small maps that and the one launch outweigh its
// narrower loads. Thread t owns unit t % upp (upp units per pixel) of the pixels p0 = t / upp of
// every rows-pixel slab (rows = blockDim / upp) whose index is its block's rank modulo CLUSTER, so its channels,
// weights, biases and shifts are fixed and read once, and consecutive threads read consecutive bytes of a pixel's
// run; the last blockDim % upp threads idle. More blocks per group (a larger cluster) put fewer pixels on each
// thread, for larger maps. `shift` as in gn_slab_moments_nhwc; `x2`, `c1` as in joined_at, and a non-null `cat`
// gets the joined map as read (for the products that take it whole).
template <typename T, int CLUSTER>
__device__ void gn_group_nhwc(const T *x, const T *x2, uint32_t c1, T *cat, const T *shift, uint32_t shift_stride,
                              const T *w, const T *b, T *out, uint32_t pixels, uint32_t channels, uint32_t groups,
                              float eps, int silu) {
    constexpr uint32_t E = 4 / sizeof(T);
    __shared__ float red[32];
    __shared__ float total;
    const uint32_t g = blockIdx.x / CLUSTER, rank = blockIdx.x % CLUSTER, sample = blockIdx.y;
    const uint32_t per_group = channels / groups, upp = per_group / E, rows = blockDim.x / upp;
    const uint32_t u = threadIdx.x % upp, p0 = threadIdx.x / upp + rank * rows, step = rows * CLUSTER;
    // Pixels p0, p0 + step, … below `pixels` are this thread's; none for the idle threads.
    const uint32_t held = threadIdx.x / upp < rows && p0 < pixels ? (pixels - p0 + step - 1) / step : 0;
    const uint32_t c0 = g * per_group + u * E;
    uint32_t pitch;
    const T *xs = joined_at(x, x2, c1, sample, pixels, channels, c0, pitch);
    float sh[E], wv[E], bv[E];
#pragma unroll
    for (uint32_t j = 0; j < E; j++) {
        sh[j] = shift != nullptr ? to_f(shift[(size_t)sample * shift_stride + c0 + j]) : 0.f;
        wv[j] = to_f(w[c0 + j]);
        bv[j] = to_f(b[c0 + j]);
    }
    uint32_t raw[GN_GROUP_UNITS];
    float acc = 0.f;
#pragma unroll
    for (uint32_t k = 0; k < GN_GROUP_UNITS; k++) {
        if (k >= held) break;
        raw[k] = *reinterpret_cast<const uint32_t *>(xs + (size_t)(p0 + k * step) * pitch);
    }
#pragma unroll
    for (uint32_t k = 0; k < GN_GROUP_UNITS; k++) {
        if (k >= held) break;
        const T *e = reinterpret_cast<const T *>(&raw[k]);
#pragma unroll
        for (uint32_t j = 0; j < E; j++) acc += to_f(e[j]) + sh[j];
    }
    const float count = (float)pixels * per_group;
    const float mean = cluster_sum<CLUSTER>(acc, red, &total) / count;
    acc = 0.f;
#pragma unroll
    for (uint32_t k = 0; k < GN_GROUP_UNITS; k++) {
        if (k >= held) break;
        const T *e = reinterpret_cast<const T *>(&raw[k]);
#pragma unroll
        for (uint32_t j = 0; j < E; j++) {
            const float d = to_f(e[j]) + sh[j] - mean;
            acc += d * d;
        }
    }
    const float rstd = rsqrtf(cluster_sum<CLUSTER>(acc, red, &total) / count + eps);
    float scale[E], offset[E];
#pragma unroll
    for (uint32_t j = 0; j < E; j++) {
        scale[j] = rstd * wv[j];
        offset[j] = bv[j] + (sh[j] - mean) * scale[j];
    }
    T *os = out + (size_t)sample * pixels * channels + c0;
    T *cs = cat != nullptr ? cat + (size_t)sample * pixels * channels + c0 : nullptr;
#pragma unroll
    for (uint32_t k = 0; k < GN_GROUP_UNITS; k++) {
        if (k >= held) break;
        if (cs != nullptr) *reinterpret_cast<uint32_t *>(cs + (size_t)(p0 + k * step) * channels) = raw[k];
        *reinterpret_cast<uint32_t *>(os + (size_t)(p0 + k * step) * channels) =
            gn_normalised<T>(raw[k], scale, offset, silu);
    }
}

// Most threads of a gn_slab_* block, values (16-byte vectors) each thread holds, and groups per chunk; the host
// takes those kernels only where the map fits them (`group_norm_slabs` in cuda.rs).
#define GN_SLAB_THREADS 512
#define GN_SLAB_HOLD 8
#define GN_SLAB_GROUPS 32
#define GN_SLAB_APPLY_HOLD 4

// Where a gn_slab_* thread works in pixels [begin, end) of its sample: channels c0.. (one 16-byte vector of the
// chunk) of pixels p0, p0 + rows, …, `held` of them (at most `hold`). Thread t owns vector t % vpc (vpc = chunk /
// VEC) and row t / vpc; the last blockDim % vpc threads (blocks are whole warps) hold nothing.
struct SlabThread {
    uint32_t v, rows, p0, held, c0;
};

// The first of the thread's channels: the same in every pixel it takes.
template <uint32_t VEC> __device__ __forceinline__ uint32_t slab_channel(uint32_t chunk) {
    return blockIdx.x * chunk + (threadIdx.x % (chunk / VEC)) * VEC;
}

template <uint32_t VEC>
__device__ __forceinline__ SlabThread slab_thread(uint32_t chunk, uint32_t begin, uint32_t end, uint32_t hold) {
    const uint32_t vpc = chunk / VEC, rows = blockDim.x / vpc, r = threadIdx.x / vpc, p0 = begin + r;
    const uint32_t held = r < rows && p0 < end ? min(hold, (end - p0 + rows - 1) / rows) : 0;
    return SlabThread{threadIdx.x % vpc, rows, p0, held, slab_channel<VEC>(chunk)};
}

// Block `index` of `blocks` splitting `pixels`: its [begin, end).
__device__ __forceinline__ uint2 share_of(uint32_t pixels, uint32_t index, uint32_t blocks) {
    const uint32_t share = (pixels + blocks - 1) / blocks, begin = min(pixels, index * share);
    return make_uint2(begin, min(pixels, begin + share));
}

// The block's sums of v[0..VEC) per group of its chunk, into part[0..chunk / per_group). `red` takes every
// thread's values (rows × chunk, as thread t's are channels (t % vpc) · VEC.. of row t / vpc); slice q of the
// threads then sums every Q-th row of a channel into csum (Q × chunk), and warp g the Q × per_group entries of
// group g. Leaves `part` visible to the block.
template <uint32_t VEC>
__device__ __forceinline__ void gn_block_group_sums(const float (&v)[VEC], float *red, float *csum, float *part,
                                                    uint32_t chunk, uint32_t rows, uint32_t per_group) {
#pragma unroll
    for (uint32_t j = 0; j < VEC; j++) red[threadIdx.x * VEC + j] = v[j];
    __syncthreads();
    const uint32_t slices = max(1u, blockDim.x / chunk);
    for (uint32_t i = threadIdx.x; i < slices * chunk; i += blockDim.x) {
        const uint32_t c = i % chunk, q = i / chunk;
        float s = 0.f;
        for (uint32_t r = q; r < rows; r += slices) s += red[r * chunk + c];
        csum[q * chunk + c] = s;
    }
    __syncthreads();
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (uint32_t g = warp; g < chunk / per_group; g += warps) {
        float s = 0.f;
        for (uint32_t e = lane; e < slices * per_group; e += 32)
            s += csum[(e / per_group) * chunk + g * per_group + e % per_group];
        s = warp_sum(s);
        if (lane == 0) part[g] = s;
    }
    __syncthreads();
}

// GroupNorm over channels-last (N, H·W, C) maps in two launches with every load and store 16 bytes wide, for maps
// too large for one block's registers per group. The channels split into chunks of whole groups (`chunk`: a
// multiple of a vector's and a group's channels) and the pixels into `slabs`. Pass 1, block (chunk, slab,
// sample): in steps of what its registers hold (GN_SLAB_HOLD vectors a thread), its threads load their vectors
// once, the block takes each group's mean over the step, then the squared deviations from it (two exact passes
// over the registers), and merges the steps (Chan's formula); it writes (count, mean, M2) to
// partial[((sample · slabs + slab) · groups + g) · 3]. A non-null `shift` (N rows of C, `shift_stride` apart)
// is added to every pixel of its sample first: the ResNet time embedding, which the convolution before the norm
// then never has to add in a pass of its own. Its rows are strided because they are columns of the UNet's table
// of every ResNet's projection.
template <typename T>
__device__ void gn_slab_moments_nhwc(const T *x, const T *x2, uint32_t c1, const T *shift, uint32_t shift_stride,
                                     float *partial, uint32_t pixels, uint32_t channels, uint32_t groups,
                                     uint32_t chunk, uint32_t slabs) {
    constexpr uint32_t VEC = 16 / sizeof(T);
    // blockDim · VEC floats of `red`, then max(blockDim, chunk) of `csum` (gn_block_group_sums), sized by the host.
    extern __shared__ float dyn[];
    float *red = dyn, *csum = dyn + blockDim.x * VEC;
    __shared__ float part[GN_SLAB_GROUPS], mean_g[GN_SLAB_GROUPS];
    const uint32_t slab = blockIdx.y, sample = blockIdx.z, per_group = channels / groups, gpc = chunk / per_group;
    const uint2 range = share_of(pixels, slab, slabs);
    const uint32_t c0 = slab_channel<VEC>(chunk);
    uint32_t row;
    const uint4 *xv = reinterpret_cast<const uint4 *>(joined_at(x, x2, c1, sample, pixels, channels, c0, row));
    const size_t pitch = row / VEC;
    float sh[VEC];
    uint4 s = make_uint4(0, 0, 0, 0);
    if (shift != nullptr) s = *reinterpret_cast<const uint4 *>(shift + (size_t)sample * shift_stride + c0);
#pragma unroll
    for (uint32_t j = 0; j < VEC; j++) sh[j] = to_f(reinterpret_cast<const T *>(&s)[j]);
    // The slab in steps of what the block's registers hold, each step's moments merged into the running ones of
    // thread g (group g of the chunk).
    Moments run{0.f, 0.f, 0.f};
    const uint32_t step = blockDim.x / (chunk / VEC) * GN_SLAB_HOLD;
    for (uint32_t begin = range.x; begin < range.y; begin += step) {
        const uint32_t end = min(range.y, begin + step);
        const SlabThread t = slab_thread<VEC>(chunk, begin, end, GN_SLAB_HOLD);
        uint4 raw[GN_SLAB_HOLD];
#pragma unroll
        for (uint32_t k = 0; k < GN_SLAB_HOLD; k++) {
            if (k >= t.held) break;
            raw[k] = xv[(size_t)(t.p0 + k * t.rows) * pitch];
        }
        float acc[VEC];
#pragma unroll
        for (uint32_t j = 0; j < VEC; j++) acc[j] = 0.f;
#pragma unroll
        for (uint32_t k = 0; k < GN_SLAB_HOLD; k++) {
            if (k >= t.held) break;
            const T *e = reinterpret_cast<const T *>(&raw[k]);
#pragma unroll
            for (uint32_t j = 0; j < VEC; j++) acc[j] += to_f(e[j]) + sh[j];
        }
        const float count = (float)(end - begin) * per_group;
        gn_block_group_sums<VEC>(acc, red, csum, part, chunk, t.rows, per_group);
        for (uint32_t g = threadIdx.x; g < gpc; g += blockDim.x) mean_g[g] = part[g] / count;
        __syncthreads();
        // The mean less the shift, so that x − it is the shifted value's deviation.
        float mean[VEC];
#pragma unroll
        for (uint32_t j = 0; j < VEC; j++) {
            mean[j] = mean_g[(t.v * VEC + j) / per_group] - sh[j];
            acc[j] = 0.f;
        }
#pragma unroll
        for (uint32_t k = 0; k < GN_SLAB_HOLD; k++) {
            if (k >= t.held) break;
            const T *e = reinterpret_cast<const T *>(&raw[k]);
#pragma unroll
            for (uint32_t j = 0; j < VEC; j++) {
                const float d = to_f(e[j]) - mean[j];
                acc[j] += d * d;
            }
        }
        gn_block_group_sums<VEC>(acc, red, csum, part, chunk, t.rows, per_group);
        if (threadIdx.x < gpc) run = combine(run, Moments{count, mean_g[threadIdx.x], part[threadIdx.x]});
        // The next step rewrites mean_g and part.
        __syncthreads();
    }
    if (threadIdx.x < gpc) {
        float *p = partial + (((size_t)sample * slabs + slab) * groups + blockIdx.x * gpc + threadIdx.x) * 3;
        p[0] = run.n;
        p[1] = run.mean;
        p[2] = run.m2;
    }
}

// Pass 2, block (chunk, block of pixels, sample): every thread loads its vectors (at most GN_SLAB_APPLY_HOLD
// pixels; the grid's y blocks split the pixels) and its channels' weights, biases and shifts, while one warp per
// group of the chunk merges the slabs' moments (a lane per slab, Chan's formula) into the mean and
// 1 / sqrt(var + eps); then it normalises them (+ SiLU).
template <typename T>
__device__ void gn_slab_apply_nhwc(const T *x, const T *x2, uint32_t c1, T *cat, const T *shift,
                                   uint32_t shift_stride, const T *w, const T *b, T *out, const float *partial,
                                   uint32_t pixels, uint32_t channels, uint32_t groups, uint32_t chunk,
                                   uint32_t slabs, float eps, int silu) {
    constexpr uint32_t VEC = 16 / sizeof(T);
    __shared__ float stat[2][GN_SLAB_GROUPS];
    const uint32_t sample = blockIdx.z, per_group = channels / groups, gpc = chunk / per_group;
    const uint2 range = share_of(pixels, blockIdx.y, gridDim.y);
    const SlabThread t = slab_thread<VEC>(chunk, range.x, range.y, GN_SLAB_APPLY_HOLD);
    uint32_t row;
    const uint4 *xs = reinterpret_cast<const uint4 *>(joined_at(x, x2, c1, sample, pixels, channels, t.c0, row));
    const size_t pitch = channels / VEC, in_pitch = row / VEC;
    uint4 raw[GN_SLAB_APPLY_HOLD];
#pragma unroll
    for (uint32_t k = 0; k < GN_SLAB_APPLY_HOLD; k++) {
        if (k >= t.held) break;
        raw[k] = xs[(size_t)(t.p0 + k * t.rows) * in_pitch];
    }
    uint4 sraw = make_uint4(0, 0, 0, 0), wraw = sraw, braw = sraw;
    if (t.held > 0) {
        if (shift != nullptr) sraw = *reinterpret_cast<const uint4 *>(shift + (size_t)sample * shift_stride + t.c0);
        wraw = *reinterpret_cast<const uint4 *>(w + t.c0);
        braw = *reinterpret_cast<const uint4 *>(b + t.c0);
    }
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (uint32_t g = warp; g < gpc; g += blockDim.x / 32) {
        Moments m{0.f, 0.f, 0.f};
        for (uint32_t k = lane; k < slabs; k += 32) {
            const float *p = partial + (((size_t)sample * slabs + k) * groups + blockIdx.x * gpc + g) * 3;
            m = combine(m, Moments{p[0], p[1], p[2]});
        }
        for (int o = 16; o > 0; o >>= 1) m = combine(m, shfl_xor(m, o));
        if (lane == 0) {
            stat[0][g] = m.mean;
            stat[1][g] = rsqrtf(m.m2 / m.n + eps);
        }
    }
    __syncthreads();
    const T *se = reinterpret_cast<const T *>(&sraw), *we = reinterpret_cast<const T *>(&wraw);
    const T *be = reinterpret_cast<const T *>(&braw);
    float scale[VEC], offset[VEC];
#pragma unroll
    for (uint32_t j = 0; j < VEC; j++) {
        const uint32_t g = (t.v * VEC + j) / per_group;
        scale[j] = stat[1][g] * to_f(we[j]);
        offset[j] = to_f(be[j]) + (to_f(se[j]) - stat[0][g]) * scale[j];
    }
    uint4 *os = reinterpret_cast<uint4 *>(out + (size_t)sample * pixels * channels + t.c0);
    uint4 *cs = cat != nullptr ? reinterpret_cast<uint4 *>(cat + (size_t)sample * pixels * channels + t.c0) : nullptr;
#pragma unroll
    for (uint32_t k = 0; k < GN_SLAB_APPLY_HOLD; k++) {
        if (k >= t.held) break;
        if (cs != nullptr) cs[(size_t)(t.p0 + k * t.rows) * pitch] = raw[k];
        os[(size_t)(t.p0 + k * t.rows) * pitch] = gn_normalised<T>(raw[k], scale, offset, silu);
    }
}

// Vectors a gn_rows_* thread has in flight: the moments pass takes its pixels GN_ROWS_BATCH at a time, the
// normalisation GN_ROWS_APPLY at a time.
#define GN_ROWS_BATCH 8
#define GN_ROWS_APPLY 4
// Slabs whose partial moments a thread of the last block loads together.
#define GN_ROWS_MERGE 8

// Where a gn_rows_* thread works: its block's threads cover whole pixel rows, vpr = channels / VEC 16-byte
// vectors each, thread t vector t % vpr of row t / vpr (of `rows`; the last blockDim % vpr threads hold nothing),
// so a warp reads consecutive bytes of each row.
struct RowThread {
    uint32_t v, r, rows;
    bool active;
};

template <uint32_t VEC> __device__ __forceinline__ RowThread row_thread(uint32_t channels) {
    const uint32_t vpr = channels / VEC, rows = blockDim.x / vpr;
    return RowThread{threadIdx.x % vpr, threadIdx.x / vpr, rows, threadIdx.x / vpr < rows};
}

// GroupNorm over channels-last (N, H·W, C) maps in two launches that stream the map row by row, for maps too large
// for the one-launch gn_group_nhwc. Pass 1, block (slab, sample): each thread keeps running moments of its
// VEC channels over its pixels of the slab, GN_ROWS_BATCH pixels at a time (the batch's mean, then its squared
// deviations, merged by Chan's formula), so its loads stay in flight while it adds; the block then merges its
// threads' channel moments into each group's (a warp per group) and writes (count, mean, M2) to
// partial[((sample · slabs + slab) · groups + g) · 3]. The last block of a sample to finish (counted in
// done[sample], which atomicInc returns to 0) merges the slabs into stats[(sample · groups + g) · 2] = (mean,
// 1 / sqrt(var + eps)). A non-null `shift` (N rows of C, `shift_stride` apart) is added to every pixel of its
// sample first: the ResNet time embedding, which the convolution before the norm then never has to add in a pass
// of its own; its rows are columns of the UNet's table of every ResNet's projection. `x2`, `c1` as in joined_at.
// Dynamic shared memory: blockDim · (2 · VEC + 1) floats.
template <typename T>
__device__ void gn_rows_moments_nhwc(const T *x, const T *x2, uint32_t c1, const T *shift, uint32_t shift_stride,
                                     float *partial, float *stats, uint32_t *done, uint32_t pixels,
                                     uint32_t channels, uint32_t groups, uint32_t slabs, float eps) {
    constexpr uint32_t VEC = 16 / sizeof(T);
    extern __shared__ float dyn[];
    float *sm_mean = dyn, *sm_m2 = dyn + blockDim.x * VEC, *sm_n = dyn + 2 * blockDim.x * VEC;
    __shared__ bool last;
    const uint32_t slab = blockIdx.x, sample = blockIdx.y;
    const RowThread t = row_thread<VEC>(channels);
    const uint2 range = share_of(pixels, slab, slabs);
    float mean[VEC], m2[VEC], n = 0.f;
#pragma unroll
    for (uint32_t j = 0; j < VEC; j++) mean[j] = m2[j] = 0.f;
    if (t.active) {
        uint32_t pitch;
        const T *xs = joined_at(x, x2, c1, sample, pixels, channels, t.v * VEC, pitch);
        float sh[VEC];
        uint4 s = make_uint4(0, 0, 0, 0);
        if (shift != nullptr) s = *reinterpret_cast<const uint4 *>(shift + (size_t)sample * shift_stride + t.v * VEC);
#pragma unroll
        for (uint32_t j = 0; j < VEC; j++) sh[j] = to_f(reinterpret_cast<const T *>(&s)[j]);
        for (uint32_t p0 = range.x + t.r; p0 < range.y; p0 += t.rows * GN_ROWS_BATCH) {
            const uint32_t nb = min((uint32_t)GN_ROWS_BATCH, (range.y - p0 + t.rows - 1) / t.rows);
            uint4 raw[GN_ROWS_BATCH];
#pragma unroll
            for (uint32_t k = 0; k < GN_ROWS_BATCH; k++)
                if (k < nb) raw[k] = __ldg(reinterpret_cast<const uint4 *>(xs + (size_t)(p0 + k * t.rows) * pitch));
            const float inv = 1.f / (float)nb;
            float bm[VEC], bq[VEC];
#pragma unroll
            for (uint32_t j = 0; j < VEC; j++) bm[j] = bq[j] = 0.f;
#pragma unroll
            for (uint32_t k = 0; k < GN_ROWS_BATCH; k++) {
                if (k >= nb) break;
                const T *e = reinterpret_cast<const T *>(&raw[k]);
#pragma unroll
                for (uint32_t j = 0; j < VEC; j++) bm[j] += to_f(e[j]);
            }
#pragma unroll
            for (uint32_t j = 0; j < VEC; j++) bm[j] *= inv;
#pragma unroll
            for (uint32_t k = 0; k < GN_ROWS_BATCH; k++) {
                if (k >= nb) break;
                const T *e = reinterpret_cast<const T *>(&raw[k]);
#pragma unroll
                for (uint32_t j = 0; j < VEC; j++) {
                    const float d = to_f(e[j]) - bm[j];
                    bq[j] = fmaf(d, d, bq[j]);
                }
            }
            // The shift moves the mean only; the running mean is of the shifted values.
            const float nn = n + (float)nb, wb = (float)nb / nn, wab = n * wb;
#pragma unroll
            for (uint32_t j = 0; j < VEC; j++) {
                const float d = bm[j] + sh[j] - mean[j];
                mean[j] = fmaf(d, wb, mean[j]);
                m2[j] += bq[j] + d * d * wab;
            }
            n = nn;
        }
    }
#pragma unroll
    for (uint32_t j = 0; j < VEC; j++) {
        sm_mean[threadIdx.x * VEC + j] = mean[j];
        sm_m2[threadIdx.x * VEC + j] = m2[j];
    }
    sm_n[threadIdx.x] = n;
    __syncthreads();
    // Thread (row, vector)'s channel c sits at row · channels + c: a group's entries of one row are consecutive.
    const uint32_t per_group = channels / groups, vpr = channels / VEC, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t entries = t.rows * per_group;
    for (uint32_t g = warp; g < groups; g += blockDim.x / 32) {
        Moments m{0.f, 0.f, 0.f};
        for (uint32_t e = lane; e < entries; e += 32) {
            const uint32_t row = e / per_group, c = g * per_group + e % per_group;
            const uint32_t at = row * channels + c;
            m = combine(m, Moments{sm_n[row * vpr + c / VEC], sm_mean[at], sm_m2[at]});
        }
        for (int o = 16; o > 0; o >>= 1) m = combine(m, shfl_xor(m, o));
        if (lane == 0) {
            float *p = partial + (((size_t)sample * slabs + slab) * groups + g) * 3;
            p[0] = m.n;
            p[1] = m.mean;
            p[2] = m.m2;
        }
    }
    // The last block of the sample merges every slab (the threadFenceReduction pattern): `lanes` consecutive
    // threads per group (a power of two, at most a warp) each merge every lanes-th slab, GN_ROWS_MERGE loads in
    // flight at a time, then their shares through shuffles.
    if (lane == 0) __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicInc(done + sample, slabs - 1) == slabs - 1;
        if (last) __threadfence();
    }
    __syncthreads();
    if (!last) return;
    uint32_t lanes = 1;
    while (lanes < 32 && 2 * lanes * groups <= blockDim.x) lanes *= 2;
    const uint32_t sub = threadIdx.x % lanes, per_pass = blockDim.x / lanes;
    for (uint32_t g0 = 0; g0 < groups; g0 += per_pass) {
        const uint32_t g = g0 + threadIdx.x / lanes;
        Moments m{0.f, 0.f, 0.f};
        if (g < groups) {
            for (uint32_t k0 = sub; k0 < slabs; k0 += lanes * GN_ROWS_MERGE) {
                float v[GN_ROWS_MERGE][3];
#pragma unroll
                for (uint32_t i = 0; i < GN_ROWS_MERGE; i++) {
                    const uint32_t k = min(k0 + i * lanes, slabs - 1);
                    const float *p = partial + (((size_t)sample * slabs + k) * groups + g) * 3;
                    v[i][0] = __ldcg(p);
                    v[i][1] = __ldcg(p + 1);
                    v[i][2] = __ldcg(p + 2);
                }
#pragma unroll
                for (uint32_t i = 0; i < GN_ROWS_MERGE; i++)
                    if (k0 + i * lanes < slabs) m = combine(m, Moments{v[i][0], v[i][1], v[i][2]});
            }
        }
        for (uint32_t o = lanes / 2; o > 0; o >>= 1) m = combine(m, shfl_xor(m, o));
        if (g < groups && sub == 0) {
            stats[((size_t)sample * groups + g) * 2] = m.mean;
            stats[((size_t)sample * groups + g) * 2 + 1] = rsqrtf(m.m2 / m.n + eps);
        }
    }
}

// Pass 2, block (pixels [x · per_block, …), sample), taken in the reverse of pass 1's order so that the rows it
// read last, likeliest still in L2, come first: each thread's channels' scale and offset from the sample's
// stats, weight, bias and shift, then its pixels GN_ROWS_APPLY at a time, normalised (+ SiLU); a non-null `cat`
// gets the joined map as read (for the products that take it whole).
template <typename T>
__device__ void gn_rows_apply_nhwc(const T *x, const T *x2, uint32_t c1, T *cat, const T *shift,
                                   uint32_t shift_stride, const T *w, const T *b, T *out, const float *stats,
                                   uint32_t pixels, uint32_t channels, uint32_t groups, uint32_t per_block,
                                   int silu) {
    constexpr uint32_t VEC = 16 / sizeof(T);
    const RowThread t = row_thread<VEC>(channels);
    if (!t.active) return;
    const uint32_t sample = gridDim.y - 1 - blockIdx.y, block = gridDim.x - 1 - blockIdx.x;
    const uint32_t begin = block * per_block, end = min(pixels, begin + per_block), c0 = t.v * VEC;
    const uint32_t per_group = channels / groups;
    uint4 sraw = make_uint4(0, 0, 0, 0);
    if (shift != nullptr) sraw = *reinterpret_cast<const uint4 *>(shift + (size_t)sample * shift_stride + c0);
    const uint4 wraw = *reinterpret_cast<const uint4 *>(w + c0), braw = *reinterpret_cast<const uint4 *>(b + c0);
    const T *se = reinterpret_cast<const T *>(&sraw), *we = reinterpret_cast<const T *>(&wraw);
    const T *be = reinterpret_cast<const T *>(&braw);
    float scale[VEC], offset[VEC];
#pragma unroll
    for (uint32_t j = 0; j < VEC; j++) {
        const float *st = stats + ((size_t)sample * groups + (c0 + j) / per_group) * 2;
        scale[j] = st[1] * to_f(we[j]);
        offset[j] = to_f(be[j]) + (to_f(se[j]) - st[0]) * scale[j];
    }
    uint32_t row;
    const T *xs = joined_at(x, x2, c1, sample, pixels, channels, c0, row);
    T *os = out + (size_t)sample * pixels * channels + c0;
    T *cs = cat != nullptr ? cat + (size_t)sample * pixels * channels + c0 : nullptr;
    for (uint32_t p0 = begin + t.r; p0 < end; p0 += t.rows * GN_ROWS_APPLY) {
        uint4 raw[GN_ROWS_APPLY];
#pragma unroll
        for (uint32_t k = 0; k < GN_ROWS_APPLY; k++)
            if (p0 + k * t.rows < end) raw[k] = __ldg(reinterpret_cast<const uint4 *>(xs + (size_t)(p0 + k * t.rows) * row));
#pragma unroll
        for (uint32_t k = 0; k < GN_ROWS_APPLY; k++) {
            const uint32_t p = p0 + k * t.rows;
            if (p >= end) break;
            if (cs != nullptr) *reinterpret_cast<uint4 *>(cs + (size_t)p * channels) = raw[k];
            *reinterpret_cast<uint4 *>(os + (size_t)p * channels) = gn_normalised<T>(raw[k], scale, offset, silu);
        }
    }
}

// Nearest-neighbour ×2 upsampling of channels-last (N, H, W, C) maps, 16 bytes per thread: output pixel (y, x)
// copies input pixel (y / 2, x / 2).
template <typename T>
__device__ void upsample2x_nhwc(const T *x, T *out, uint32_t h, uint32_t w, uint32_t channels, size_t n) {
    constexpr uint32_t VEC = 16 / sizeof(T);
    const uint32_t nvec = channels / VEC;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n / VEC; i += step) {
        const uint32_t v = (uint32_t)(i % nvec);
        const size_t pix = i / nvec;
        const uint32_t ox = (uint32_t)(pix % (2 * w));
        const size_t rest = pix / (2 * w);
        const uint32_t oy = (uint32_t)(rest % (2 * h));
        const size_t sample = rest / (2 * h);
        const size_t src = ((sample * h + oy / 2) * w + ox / 2) * nvec + v;
        reinterpret_cast<uint4 *>(out)[i] = reinterpret_cast<const uint4 *>(x)[src];
    }
}

// Concatenation of two channels-last maps along their channels: each output row is a row of `a` (va 16-byte
// vectors) followed by the same row of `b` (vb vectors), one vector per thread. Bytes are moved, not values, so
// one kernel serves every dtype.
__device__ void concat_rows(const uint4 *a, const uint4 *b, uint4 *out, uint32_t va, uint32_t vb, size_t rows) {
    const uint32_t vt = va + vb;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < rows * vt; i += step) {
        const size_t r = i / vt;
        const uint32_t v = (uint32_t)(i - r * vt);
        out[i] = v < va ? a[r * va + v] : b[r * vb + (v - va)];
    }
}

// `copies` copies of `n` 16-byte vectors, one after another (a batch repeated whole), in one launch:
// each thread reads a vector once and writes it to every copy. Bytes are moved, so one kernel serves every dtype.
__device__ void repeat_rows(const uint4 *x, uint4 *out, size_t n, uint32_t copies) {
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += step) {
        const uint4 v = x[i];
        for (uint32_t c = 0; c < copies; ++c) out[c * n + i] = v;
    }
}

// Batched transpose of (B, M, N) to (B, N, M) through 32×32 tiles in shared memory, so reads and writes are both
// coalesced: NCHW ↔ channels-last at a network's edges (M, N = C, H·W or H·W, C). Input rows lie `in_stride` ≥ N
// apart (the first N channels of a wider channels-last map) and output rows `out_stride` ≥ M apart, the columns
// from M on written as zeros (channels padded for cuDNN's tensor-core kernels). Block (32, 8), grid
// (⌈N / 32⌉, ⌈out_stride / 32⌉, B).
template <typename T>
__device__ void transpose_tiles(const T *x, T *out, uint32_t m, uint32_t n, uint32_t in_stride, uint32_t out_stride) {
    __shared__ T tile[32][33];
    const T *src = x + (size_t)blockIdx.z * m * in_stride;
    T *dst = out + (size_t)blockIdx.z * n * out_stride;
    const uint32_t c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    for (uint32_t r = threadIdx.y; r < 32; r += 8) {
        const uint32_t row = r0 + r, col = c0 + threadIdx.x;
        tile[r][threadIdx.x] = row < m && col < n ? src[(size_t)row * in_stride + col] : from_f<T>(0.f);
    }
    __syncthreads();
    for (uint32_t r = threadIdx.y; r < 32; r += 8) {
        const uint32_t row = c0 + r, col = r0 + threadIdx.x;
        if (row < n && col < out_stride) dst[(size_t)row * out_stride + col] = tile[threadIdx.x][r];
    }
}

// Online softmax state of one lane: running max and the sum of exp(value − max).
struct OnlineMax {
    float m = -INFINITY, s = 0.f;
    __device__ __forceinline__ void add(float v) {
        // Masked scores are −∞: they add nothing (and −∞ − −∞ would be NaN before a finite value is seen).
        if (v == -INFINITY) return;
        if (v > m) {
            s = s * expf(m - v) + 1.f;
            m = v;
        } else {
            s += expf(v - m);
        }
    }
};

// Softmax over rows of `cols` values, one warp per row: an online max/sum pass, then the normalised write. Rows
// whose length and address allow it move 16 bytes per load and store.
template <typename T> __device__ void softmax_rows(const T *x, T *out, uint32_t rows, uint32_t cols) {
    constexpr uint32_t VEC = 16 / sizeof(T);
    const size_t row = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const T *r = x + row * cols;
    T *o = out + row * cols;
    const bool vec = cols % VEC == 0 && ((reinterpret_cast<uintptr_t>(r) | reinterpret_cast<uintptr_t>(o)) % 16) == 0;
    OnlineMax acc;
    if (vec) {
        const uint4 *rv = reinterpret_cast<const uint4 *>(r);
        for (uint32_t c = lane; c < cols / VEC; c += 32) {
            uint4 packed = rv[c];
            const T *e = reinterpret_cast<const T *>(&packed);
#pragma unroll
            for (uint32_t j = 0; j < VEC; j++) acc.add(to_f(e[j]));
        }
    } else {
        for (uint32_t c = lane; c < cols; c += 32) acc.add(to_f(r[c]));
    }
    float m = acc.m, s = acc.s;
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffff, m, off);
        float s2 = __shfl_xor_sync(0xffffffff, s, off);
        float mx = fmaxf(m, m2);
        if (mx == -INFINITY) continue;
        s = s * expf(m - mx) + s2 * expf(m2 - mx);
        m = mx;
    }
    const float inv = 1.f / s;
    if (vec) {
        const uint4 *rv = reinterpret_cast<const uint4 *>(r);
        uint4 *ov = reinterpret_cast<uint4 *>(o);
        for (uint32_t c = lane; c < cols / VEC; c += 32) {
            uint4 packed = rv[c];
            const T *e = reinterpret_cast<const T *>(&packed);
            uint4 result;
            T *w = reinterpret_cast<T *>(&result);
#pragma unroll
            for (uint32_t j = 0; j < VEC; j++) w[j] = from_f<T>(expf(to_f(e[j]) - m) * inv);
            ov[c] = result;
        }
    } else {
        for (uint32_t c = lane; c < cols; c += 32) o[c] = from_f<T>(expf(to_f(r[c]) - m) * inv);
    }
}

// diffusers' GEGLU: rows of 2·half values (plus the projection's bias, when not null) → hidden[j] ·
// gelu_erf(gate[j]), hidden the first half. 16 bytes per load and store when the halves and pointers allow it.
template <typename T> __device__ void geglu(const T *x, const T *bias, T *out, size_t rows, uint32_t half) {
    constexpr uint32_t VEC = 16 / sizeof(T);
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x, step = (size_t)gridDim.x * blockDim.x;
    auto gelu = [](float h, float g) { return h * 0.5f * g * (1.f + erff(g * 0.70710678118654752f)); };
    const uintptr_t addr = reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(out) |
                           reinterpret_cast<uintptr_t>(bias);
    if (half % VEC == 0 && addr % 16 == 0) {
        const uint32_t per_row = half / VEC;
        for (size_t i = start; i < rows * per_row; i += step) {
            const size_t r = i / per_row, j = (i % per_row) * VEC;
            const uint4 hv = *reinterpret_cast<const uint4 *>(x + r * 2 * half + j);
            const uint4 gv = *reinterpret_cast<const uint4 *>(x + r * 2 * half + half + j);
            uint4 hb = make_uint4(0, 0, 0, 0), gb = make_uint4(0, 0, 0, 0);
            if (bias) {
                hb = *reinterpret_cast<const uint4 *>(bias + j);
                gb = *reinterpret_cast<const uint4 *>(bias + half + j);
            }
            const T *he = reinterpret_cast<const T *>(&hv), *ge = reinterpret_cast<const T *>(&gv);
            const T *hbe = reinterpret_cast<const T *>(&hb), *gbe = reinterpret_cast<const T *>(&gb);
            uint4 ov;
            T *oe = reinterpret_cast<T *>(&ov);
            // A zero word is zero in every storage type, so without a bias the sums are exact.
#pragma unroll
            for (uint32_t k = 0; k < VEC; k++)
                oe[k] = from_f<T>(gelu(to_f(he[k]) + to_f(hbe[k]), to_f(ge[k]) + to_f(gbe[k])));
            reinterpret_cast<uint4 *>(out)[i] = ov;
        }
        return;
    }
    const size_t n = rows * half;
    for (size_t i = start; i < n; i += step) {
        size_t r = i / half, j = i % half;
        const float hb = bias ? to_f(bias[j]) : 0.f, gb = bias ? to_f(bias[half + j]) : 0.f;
        out[i] = from_f<T>(gelu(to_f(x[r * 2 * half + j]) + hb, to_f(x[r * 2 * half + half + j]) + gb));
    }
}

// LayerNorm over rows of `cols` values, one warp per row: (x − mean) / sqrt(var + eps) · w + b. Rows whose length
// and pointers allow 16-byte loads and stores, and that fit REGS vectors per lane, stay in registers: the mean and
// then the squared deviations from it, each summed across the warp, and the write from the same registers, one read
// of the row in all. `layer_norm` keeps 8 vectors a lane (2048 f16/bf16 values, 1024 f32: SD1/SDXL's and
// SD3.5-medium's rows) and loads the weights and biases with the row, so their latency overlaps the row's and the
// reductions' instead of following them; `layer_norm_wide` keeps 16 (4096 and 2048 values: SD3.5-large's 2432)
// and reads the weights and biases at the write, where holding them too would spill. Other rows take Welford
// moments and a second read.
//
// `group_rows` rows share one weight and bias row: `rows` for one affine over all rows, the sequence length for
// per-sample modulation (an adaptive norm's `norm(x) · (1 + scale) + shift`: weight `scale` with `one_plus` 1,
// rounded to T as the network rounds `1 + scale`, bias `shift`). The groups' weight and bias rows lie `w_stride`
// and `b_stride` values apart (chunks of a modulation table, read in place).
template <typename T, uint32_t REGS>
__device__ void layer_norm_rows(const T *x, const T *w, const T *b, T *out, uint32_t rows, uint32_t cols, float eps,
                                uint32_t group_rows, uint32_t w_stride, uint32_t b_stride, float one_plus) {
    constexpr uint32_t VEC = 16 / sizeof(T);
    constexpr bool AFFINE_IN_REGS = REGS <= 8;
    const size_t row = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    w += (row / group_rows) * w_stride;
    b += (row / group_rows) * b_stride;
    const T *r = x + row * cols;
    T *o = out + row * cols;
    const uintptr_t addr = reinterpret_cast<uintptr_t>(r) | reinterpret_cast<uintptr_t>(o) |
                           reinterpret_cast<uintptr_t>(w) | reinterpret_cast<uintptr_t>(b);
    const uint32_t nvec = cols / VEC;
    if (cols % VEC == 0 && addr % 16 == 0 && nvec <= 32 * REGS) {
        uint4 v[REGS], wv[AFFINE_IN_REGS ? REGS : 1], bv[AFFINE_IN_REGS ? REGS : 1];
#pragma unroll
        for (uint32_t k = 0; k < REGS; k++) {
            const uint32_t c = lane + 32 * k;
            if (c >= nvec) break;
            v[k] = reinterpret_cast<const uint4 *>(r)[c];
            if constexpr (AFFINE_IN_REGS) {
                wv[k] = reinterpret_cast<const uint4 *>(w)[c];
                bv[k] = reinterpret_cast<const uint4 *>(b)[c];
            }
        }
        float sum = 0.f;
#pragma unroll
        for (uint32_t k = 0; k < REGS; k++) {
            const uint32_t c = lane + 32 * k;
            if (c >= nvec) break;
            const T *e = reinterpret_cast<const T *>(&v[k]);
#pragma unroll
            for (uint32_t j = 0; j < VEC; j++) sum += to_f(e[j]);
        }
        const float mean = warp_sum(sum) / cols;
        float m2 = 0.f;
#pragma unroll
        for (uint32_t k = 0; k < REGS; k++) {
            if (lane + 32 * k >= nvec) break;
            const T *e = reinterpret_cast<const T *>(&v[k]);
#pragma unroll
            for (uint32_t j = 0; j < VEC; j++) {
                const float d = to_f(e[j]) - mean;
                m2 += d * d;
            }
        }
        const float rstd = rsqrtf(warp_sum(m2) / cols + eps);
#pragma unroll
        for (uint32_t k = 0; k < REGS; k++) {
            const uint32_t c = lane + 32 * k;
            if (c >= nvec) break;
            uint4 wk, bk;
            if constexpr (AFFINE_IN_REGS) {
                wk = wv[k];
                bk = bv[k];
            } else {
                wk = reinterpret_cast<const uint4 *>(w)[c];
                bk = reinterpret_cast<const uint4 *>(b)[c];
            }
            const T *xe = reinterpret_cast<const T *>(&v[k]), *we = reinterpret_cast<const T *>(&wk),
                    *be = reinterpret_cast<const T *>(&bk);
            uint4 ov;
            T *oe = reinterpret_cast<T *>(&ov);
#pragma unroll
            for (uint32_t j = 0; j < VEC; j++)
                oe[j] = from_f<T>((to_f(xe[j]) - mean) * rstd * to_f(from_f<T>(to_f(we[j]) + one_plus)) + to_f(be[j]));
            reinterpret_cast<uint4 *>(o)[c] = ov;
        }
        return;
    }
    Moments m{0.f, 0.f, 0.f};
    for (uint32_t c = lane; c < cols; c += 32) {
        float v = to_f(r[c]);
        m.n += 1.f;
        float d = v - m.mean;
        m.mean += d / m.n;
        m.m2 += d * (v - m.mean);
    }
    for (int off = 16; off > 0; off >>= 1) m = combine(m, shfl_xor(m, off));
    const float rstd = rsqrtf(m.m2 / m.n + eps);
    for (uint32_t c = lane; c < cols; c += 32)
        o[c] = from_f<T>((to_f(r[c]) - m.mean) * rstd * to_f(from_f<T>(to_f(w[c]) + one_plus)) + to_f(b[c]));
}

// RMSNorm of every `d`-wide row (an attention head), one warp per row, statistics in f32:
// `T(T(x · rsqrt(mean(x²) + eps)) · w)`, the two roundings of diffusers' RMSNorm in half precision (normalised in
// f32, cast back, then the weight).
template <typename T>
__device__ void rms_norm_rows(const T *x, const T *w, T *out, size_t rows, uint32_t d, float eps) {
    const size_t row = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const T *r = x + row * d;
    T *o = out + row * d;
    float sq = 0.f;
    for (uint32_t c = lane; c < d; c += 32) {
        const float v = to_f(r[c]);
        sq += v * v;
    }
    const float rstd = rsqrtf(warp_sum(sq) / d + eps);
    for (uint32_t c = lane; c < d; c += 32) o[c] = from_f<T>(to_f(from_f<T>(to_f(r[c]) * rstd)) * to_f(w[c]));
}

// `x + gate · y` with one gate row of `cols` values per `group` elements (a sample's tokens), the sample's row
// `gate_stride` values after the previous one (a chunk of an adaptive norm's modulation table read in place): the
// gated residual in one pass, rounded once. 16 bytes per thread where the widths and pointers allow it.
template <typename T>
__device__ void gated_add(const T *x, const T *gate, const T *y, T *out, size_t n, uint32_t cols, size_t group,
                          uint32_t gate_stride) {
    constexpr uint32_t VEC = 16 / sizeof(T);
    const uintptr_t addr = reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(gate) |
                           reinterpret_cast<uintptr_t>(y) | reinterpret_cast<uintptr_t>(out);
    if (cols % VEC == 0 && gate_stride % VEC == 0 && addr % 16 == 0) {
        for (size_t v = blockIdx.x * (size_t)blockDim.x + threadIdx.x; v < n / VEC;
             v += (size_t)gridDim.x * blockDim.x) {
            const size_t i = v * VEC;
            const uint4 xv = reinterpret_cast<const uint4 *>(x)[v], yv = reinterpret_cast<const uint4 *>(y)[v];
            const uint4 gv = *reinterpret_cast<const uint4 *>(gate + (i / group) * gate_stride + i % cols);
            const T *xe = reinterpret_cast<const T *>(&xv), *ye = reinterpret_cast<const T *>(&yv),
                    *ge = reinterpret_cast<const T *>(&gv);
            uint4 ov;
            T *oe = reinterpret_cast<T *>(&ov);
#pragma unroll
            for (uint32_t j = 0; j < VEC; j++) oe[j] = from_f<T>(to_f(xe[j]) + to_f(ge[j]) * to_f(ye[j]));
            reinterpret_cast<uint4 *>(out)[v] = ov;
        }
        return;
    }
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float g = to_f(gate[(i / group) * gate_stride + i % cols]);
        out[i] = from_f<T>(to_f(x[i]) + g * to_f(y[i]));
    }
}

// The joint sequence of an MMDiT attention: per sample, the `sa` rows of `a` then the `sb` rows of `b` (rows of
// `c` values, `ra` and `rb` vectors apart: column ranges of a stacked q/k/v projection) into `out`, and with NORM each `d`-wide head RMS-normalised with `wa` (rows of `a`) or `wb` (rows of
// `b`), rounded as rms_norm_rows rounds. One 16-byte vector per thread; a head's d / VEC threads (a power of two
// up to 32, so inside one warp) sum its squares by shuffles. The host checks widths and alignment.
template <typename T, bool NORM>
__device__ void joint_rows(const T *a, const T *b, const T *wa, const T *wb, T *out, size_t vectors, uint32_t sa,
                           uint32_t sb, uint32_t ra, uint32_t rb, uint32_t c, uint32_t d, float eps) {
    constexpr uint32_t VEC = 16 / sizeof(T);
    const uint32_t cv = c / VEC, hv = d / VEC;
    const size_t v = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const bool live = v < vectors;
    const size_t row = v / cv;
    const uint32_t col = (uint32_t)(v % cv);
    const size_t sample = row / (sa + sb);
    const uint32_t s = (uint32_t)(row % (sa + sb));
    uint4 val = make_uint4(0, 0, 0, 0);
    if (live) {
        val = s < sa ? reinterpret_cast<const uint4 *>(a)[(sample * sa + s) * ra + col]
                     : reinterpret_cast<const uint4 *>(b)[(sample * sb + (s - sa)) * rb + col];
    }
    if (NORM) {
        T *e = reinterpret_cast<T *>(&val);
        float sq = 0.f;
#pragma unroll
        for (uint32_t j = 0; j < VEC; j++) sq += to_f(e[j]) * to_f(e[j]);
        for (uint32_t off = 1; off < hv; off <<= 1) sq += __shfl_xor_sync(0xffffffff, sq, off);
        const float rstd = rsqrtf(sq / d + eps);
        if (live) {
            const uint4 wv = reinterpret_cast<const uint4 *>(s < sa ? wa : wb)[col % hv];
            const T *we = reinterpret_cast<const T *>(&wv);
#pragma unroll
            for (uint32_t j = 0; j < VEC; j++) e[j] = from_f<T>(to_f(from_f<T>(to_f(e[j]) * rstd)) * to_f(we[j]));
        }
    }
    if (live) reinterpret_cast<uint4 *>(out)[v] = val;
}

// im2col in the (batch, channel·kh·kw, out_h·out_w) layout: a weight (out_channels, channel·kh·kw) times this
// gives the convolution in NCHW directly. Consecutive threads take consecutive output pixels, so reads and writes
// are coalesced. Padding reads as zero.
template <typename T>
__device__ void im2col_k_l(const T *x, T *col, uint32_t channels, uint32_t h, uint32_t w, uint32_t kh, uint32_t kw,
                           uint32_t stride, uint32_t pad, uint32_t out_h, uint32_t out_w, size_t n) {
    const uint32_t l_count = out_h * out_w;
    const uint32_t k_count = channels * kh * kw;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t l = (uint32_t)(i % l_count);
        size_t t = i / l_count;
        uint32_t k = (uint32_t)(t % k_count);
        size_t b = t / k_count;
        uint32_t ox = l % out_w, oy = l / out_w;
        uint32_t kx = k % kw, ky = (k / kw) % kh, c = k / (kw * kh);
        int iy = (int)(oy * stride + ky) - (int)pad;
        int ix = (int)(ox * stride + kx) - (int)pad;
        T v = from_f<T>(0.f);
        if (iy >= 0 && iy < (int)h && ix >= 0 && ix < (int)w) v = x[((b * channels + c) * h + iy) * w + ix];
        col[i] = v;
    }
}

#define GN_GROUP_KERNEL(T, S, C, ATTR)                                                                          \
    extern "C" __global__ void ATTR __launch_bounds__(1024) gn_group_nhwc_c##C##_##S(                          \
        const T *x, const T *x2, uint32_t c1, T *cat, const T *shift, uint32_t shift_stride, const T *w,      \
        const T *b, T *out, uint32_t pixels, uint32_t channels, uint32_t groups, float eps, int silu) {       \
        gn_group_nhwc<T, C>(x, x2, c1, cat, shift, shift_stride, w, b, out, pixels, channels, groups, eps,    \
                            silu);                                                                            \
    }
#define GN_GROUP(T, S) GN_GROUP_KERNEL(T, S, 1, )

// Thread block clusters exist from sm_90 (Hopper) on; builds for older GPUs have no cluster kernels, and the host
// never asks for one there (cuda.rs).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define GN_CLUSTER_GROUP(T, S, C) GN_GROUP_KERNEL(T, S, C, __cluster_dims__(C, 1, 1))
#else
#define GN_CLUSTER_GROUP(T, S, C)
#endif

#define INSTANTIATE(T, S)                                                                                       \
    extern "C" __global__ void gn_stats_##S(const T *x, float *partial, uint32_t group_elems, uint32_t chunks) { \
        gn_stats<T>(x, partial, group_elems, chunks);                                                           \
    }                                                                                                           \
    extern "C" __global__ void gn_apply_##S(const T *x, const T *w, const T *b, T *out, const float *partial,   \
                                            uint32_t group_elems, uint32_t chunks, uint32_t channels_per_group, \
                                            uint32_t inner, uint32_t groups, float eps, int silu) {             \
        gn_apply<T>(x, w, b, out, partial, group_elems, chunks, channels_per_group, inner, groups, eps, silu);  \
    }                                                                                                           \
    extern "C" __global__ void add_channel_##S(const T *y, const T *add, const T *residual, T *out, size_t n,  \
                                               uint32_t channels, uint32_t inner, uint32_t add_batch_stride,    \
                                               uint32_t rows_per_sample) {                                      \
        add_channel<T>(y, add, residual, out, n, channels, inner, add_batch_stride, rows_per_sample);           \
    }                                                                                                           \
    GN_GROUP(T, S)                                                                                           \
    GN_CLUSTER_GROUP(T, S, 2)                                                                                \
    extern "C" __global__ void __launch_bounds__(GN_SLAB_THREADS) gn_slab_moments_nhwc_##S(                  \
        const T *x, const T *x2, uint32_t c1, const T *shift, uint32_t shift_stride, float *partial,          \
        uint32_t pixels, uint32_t channels, uint32_t groups, uint32_t chunk, uint32_t slabs) {               \
        gn_slab_moments_nhwc<T>(x, x2, c1, shift, shift_stride, partial, pixels, channels, groups, chunk,    \
                                slabs);                                                                      \
    }                                                                                                        \
    extern "C" __global__ void gn_slab_apply_nhwc_##S(                                                       \
        const T *x, const T *x2, uint32_t c1, T *cat, const T *shift, uint32_t shift_stride, const T *w,      \
        const T *b, T *out, const float *partial, uint32_t pixels, uint32_t channels, uint32_t groups,        \
        uint32_t chunk, uint32_t slabs, float eps, int silu) {                                               \
        gn_slab_apply_nhwc<T>(x, x2, c1, cat, shift, shift_stride, w, b, out, partial, pixels, channels,     \
                              groups, chunk, slabs, eps, silu);                                              \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(sizeof(T) == 4 ? 1024 : 512) gn_rows_moments_nhwc_##S(      \
        const T *x, const T *x2, uint32_t c1, const T *shift, uint32_t shift_stride, float *partial,          \
        float *stats, uint32_t *done, uint32_t pixels, uint32_t channels, uint32_t groups, uint32_t slabs,    \
        float eps) {                                                                                         \
        gn_rows_moments_nhwc<T>(x, x2, c1, shift, shift_stride, partial, stats, done, pixels, channels,      \
                                groups, slabs, eps);                                                         \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(1024) gn_rows_apply_nhwc_##S(                               \
        const T *x, const T *x2, uint32_t c1, T *cat, const T *shift, uint32_t shift_stride, const T *w,      \
        const T *b, T *out, const float *stats, uint32_t pixels, uint32_t channels, uint32_t groups,          \
        uint32_t per_block, int silu) {                                                                      \
        gn_rows_apply_nhwc<T>(x, x2, c1, cat, shift, shift_stride, w, b, out, stats, pixels, channels, groups, \
                              per_block, silu);                                                              \
    }                                                                                                        \
    extern "C" __global__ void transpose_##S(const T *x, T *out, uint32_t m, uint32_t n, uint32_t in_stride, \
                                             uint32_t out_stride) {                                          \
        transpose_tiles<T>(x, out, m, n, in_stride, out_stride);                                             \
    }                                                                                                        \
    extern "C" __global__ void upsample2x_nhwc_##S(const T *x, T *out, uint32_t h, uint32_t w, uint32_t channels, \
                                                   size_t n) {                                                  \
        upsample2x_nhwc<T>(x, out, h, w, channels, n);                                                          \
    }                                                                                                           \
    extern "C" __global__ void softmax_##S(const T *x, T *out, uint32_t rows, uint32_t cols) {                 \
        softmax_rows<T>(x, out, rows, cols);                                                                    \
    }                                                                                                           \
    extern "C" __global__ void geglu_##S(const T *x, const T *bias, T *out, size_t rows, uint32_t half) {     \
        geglu<T>(x, bias, out, rows, half);                                                                     \
    }                                                                                                           \
    extern "C" __global__ void layer_norm_##S(const T *x, const T *w, const T *b, T *out, uint32_t rows,        \
                                              uint32_t cols, float eps, uint32_t group_rows, uint32_t w_stride, \
                                              uint32_t b_stride, float one_plus) {                              \
        layer_norm_rows<T, 8>(x, w, b, out, rows, cols, eps, group_rows, w_stride, b_stride, one_plus);         \
    }                                                                                                           \
    extern "C" __global__ void layer_norm_wide_##S(const T *x, const T *w, const T *b, T *out, uint32_t rows,   \
                                                   uint32_t cols, float eps, uint32_t group_rows,               \
                                                   uint32_t w_stride, uint32_t b_stride, float one_plus) {      \
        layer_norm_rows<T, 16>(x, w, b, out, rows, cols, eps, group_rows, w_stride, b_stride, one_plus);        \
    }                                                                                                           \
    extern "C" __global__ void rms_norm_##S(const T *x, const T *w, T *out, size_t rows, uint32_t d, float eps) { \
        rms_norm_rows<T>(x, w, out, rows, d, eps);                                                              \
    }                                                                                                           \
    extern "C" __global__ void gated_add_##S(const T *x, const T *gate, const T *y, T *out, size_t n,           \
                                             uint32_t cols, size_t group, uint32_t gate_stride) {               \
        gated_add<T>(x, gate, y, out, n, cols, group, gate_stride);                                             \
    }                                                                                                           \
    extern "C" __global__ void joint_rows_##S(const T *a, const T *b, const T *wa, const T *wb, T *out,         \
                                              size_t vectors, uint32_t sa, uint32_t sb, uint32_t ra,            \
                                              uint32_t rb, uint32_t c, uint32_t d, float eps) {                 \
        joint_rows<T, false>(a, b, wa, wb, out, vectors, sa, sb, ra, rb, c, d, eps);                           \
    }                                                                                                           \
    extern "C" __global__ void joint_rows_norm_##S(const T *a, const T *b, const T *wa, const T *wb, T *out,    \
                                                   size_t vectors, uint32_t sa, uint32_t sb, uint32_t ra,       \
                                                   uint32_t rb, uint32_t c, uint32_t d, float eps) {            \
        joint_rows<T, true>(a, b, wa, wb, out, vectors, sa, sb, ra, rb, c, d, eps);                            \
    }                                                                                                           \
    extern "C" __global__ void im2col_##S(const T *x, T *col, uint32_t channels, uint32_t h, uint32_t w,       \
                                          uint32_t kh, uint32_t kw, uint32_t stride, uint32_t pad,              \
                                          uint32_t out_h, uint32_t out_w, size_t n) {                           \
        im2col_k_l<T>(x, col, channels, h, w, kh, kw, stride, pad, out_h, out_w, n);                            \
    }

extern "C" __global__ void concat_rows_vec(const uint4 *a, const uint4 *b, uint4 *out, uint32_t va, uint32_t vb,
                                           size_t rows) {
    concat_rows(a, b, out, va, vb, rows);
}

extern "C" __global__ void repeat_vec(const uint4 *x, uint4 *out, size_t n, uint32_t copies) {
    repeat_rows(x, out, n, copies);
}

INSTANTIATE(float, f32)
INSTANTIATE(__half, f16)
INSTANTIATE(__nv_bfloat16, bf16)
