// The element-wise passes of the channels-last ESRGAN path that candle would make in several launches: LeakyReLU(0.2)
// applied while joining a dense block's new features to the earlier ones, LeakyReLU alone, and the residual
// `s·a + b`. Channels-last maps are whole 16-byte vectors per pixel (the caller checks), so every thread moves one
// uint4. Half types compute in float and round once, as PyTorch's opmath does.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// PyTorch's `x > 0 ? x : x * negative_slope`.
template <typename T> __device__ __forceinline__ uint4 leaky_relu_vec(uint4 v) {
    T *e = reinterpret_cast<T *>(&v);
#pragma unroll
    for (int i = 0; i < 16 / (int)sizeof(T); i++) {
        float x = to_f<T>(e[i]);
        if (!(x > 0.f)) e[i] = from_f<T>(x * 0.2f);
    }
    return v;
}

// Each output row: the `va` vectors of a's row, then b's `vb` vectors through LeakyReLU.
template <typename T>
__device__ void cat_leaky_relu(const uint4 *a, const uint4 *b, uint4 *out, uint32_t va, uint32_t vb, size_t rows) {
    size_t vt = (size_t)va + vb, n = rows * vt;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / vt;
        uint32_t c = (uint32_t)(i - r * vt);
        out[i] = c < va ? a[r * va + c] : leaky_relu_vec<T>(b[r * vb + (c - va)]);
    }
}

template <typename T> __device__ void leaky_relu(const uint4 *x, uint4 *out, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = leaky_relu_vec<T>(x[i]);
    }
}

// out = s·a + b
template <typename T> __device__ void scale_add(const uint4 *a, const uint4 *b, uint4 *out, float s, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 va = a[i], vb = b[i], vo;
        const T *ea = reinterpret_cast<const T *>(&va);
        const T *eb = reinterpret_cast<const T *>(&vb);
        T *eo = reinterpret_cast<T *>(&vo);
#pragma unroll
        for (int j = 0; j < 16 / (int)sizeof(T); j++) eo[j] = from_f<T>(s * to_f<T>(ea[j]) + to_f<T>(eb[j]));
        out[i] = vo;
    }
}

#define INSTANTIATE(T, SFX)                                                                                          \
    extern "C" __global__ void cat_leaky_relu_##SFX(const uint4 *a, const uint4 *b, uint4 *out, uint32_t va,        \
                                                    uint32_t vb, size_t rows) {                                      \
        cat_leaky_relu<T>(a, b, out, va, vb, rows);                                                                  \
    }                                                                                                                \
    extern "C" __global__ void leaky_relu_##SFX(const uint4 *x, uint4 *out, size_t n) { leaky_relu<T>(x, out, n); }  \
    extern "C" __global__ void scale_add_##SFX(const uint4 *a, const uint4 *b, uint4 *out, float s, size_t n) {     \
        scale_add<T>(a, b, out, s, n);                                                                               \
    }

INSTANTIATE(float, f32)
INSTANTIATE(__half, f16)
INSTANTIATE(__nv_bfloat16, bf16)
