// The GEGLU kernel (crates/sdhive-cuda-kernels/src/kernels.cu) at the SD1.5 UNet's shapes (batch 2 with CFG;
// the count is how often a step runs each), f16 with the projection's bias, each timed in µs per call as a CUDA
// graph of 50 calls over ten rotating buffers (so no call finds its input in L2): launched with a thread per
// element (its grid before) and with a thread per 16-byte vector (what cuda.rs launches now), beside two index
// schemes (32-bit, and a 2-D grid with no division) and a copy of the same bytes as the bandwidth bound; the
// variants' largest difference from the kernel's output is printed. docs/benchmarks.md has the H100 figures. Build
// here, run on the GPU machine (driver only):
//   nvcc -O3 -arch=sm_90 -std=c++17 xtask/bench/geglu_shapes.cu -o geglu_shapes && ./geglu_shapes
#include "../../crates/sdhive-cuda-kernels/src/kernels.cu"
#include <cstdio>
#include <vector>
#include <cmath>
__global__ void fill(__half *p, size_t n, unsigned seed) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) { unsigned x = (unsigned)i * 2654435761u ^ seed; x ^= x >> 13; x *= 0x5bd1e995; x ^= x >> 15; p[i] = __float2half(((x & 0xffff) / 65535.f - 0.5f) * 4.f); }
}
// Eight outputs of row r at column j, as the kernel computes them.
__device__ __forceinline__ uint4 geglu8(const __half *x, const __half *bias, size_t r, uint32_t j, uint32_t half) {
  const uint4 hv = *reinterpret_cast<const uint4 *>(x + r * 2 * half + j);
  const uint4 gv = *reinterpret_cast<const uint4 *>(x + r * 2 * half + half + j);
  const uint4 hb = *reinterpret_cast<const uint4 *>(bias + j);
  const uint4 gb = *reinterpret_cast<const uint4 *>(bias + half + j);
  const __half *he = (const __half *)&hv, *ge = (const __half *)&gv, *hbe = (const __half *)&hb, *gbe = (const __half *)&gb;
  uint4 ov; __half *oe = (__half *)&ov;
#pragma unroll
  for (int k = 0; k < 8; k++) { float h = __half2float(he[k]) + __half2float(hbe[k]), g = __half2float(ge[k]) + __half2float(gbe[k]);
    oe[k] = __float2half(h * 0.5f * g * (1.f + erff(g * 0.70710678118654752f))); }
  return ov;
}
// 32-bit indices, exact grid.
__global__ void geglu32(const __half *x, const __half *bias, __half *out, uint32_t rows, uint32_t half) {
  const uint32_t per_row = half / 8, n = rows * per_row;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const uint32_t r = i / per_row, j = (i - r * per_row) * 8;
    reinterpret_cast<uint4 *>(out)[i] = geglu8(x, bias, r, j, half);
  }
}
// 2-D: blockIdx.y picks the row, no division.
__global__ void geglu2d(const __half *x, const __half *bias, __half *out, uint32_t rows, uint32_t half) {
  const uint32_t per_row = half / 8, r = blockIdx.y;
  for (uint32_t v = blockIdx.x * blockDim.x + threadIdx.x; v < per_row; v += gridDim.x * blockDim.x)
    *reinterpret_cast<uint4 *>(out + (size_t)r * half + v * 8) = geglu8(x, bias, r, v * 8, half);
}
__global__ void copyref(const uint4 *x, uint4 *out, uint32_t rows, uint32_t per_row) {
  const uint32_t n = rows * per_row;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const uint32_t r = i / per_row, j = i - r * per_row;
    uint4 a = x[(size_t)r * 2 * per_row + j], b = x[(size_t)r * 2 * per_row + per_row + j];
    out[i] = make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
  }
}
int main() {
  struct Shape { int rows, half, count; } shapes[] = {{8192, 1280, 5}, {2048, 2560, 5}, {512, 5120, 5}, {128, 5120, 1}};
  cudaStream_t st; cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  double tot[5] = {0};
  printf("rows x half  count  per-element-grid  per-vector-grid  32-bit  2-D  copy (us per call)\n");
  for (auto &s : shapes) {
    size_t nin = (size_t)s.rows * 2 * s.half, nout = (size_t)s.rows * s.half;
    __half *x, *b, *o1, *o2;
    // Ten inputs in rotation so consecutive calls do not hit L2 with the previous call's data.
    const int ROT = 10;
    cudaMalloc(&x, nin * 2 * ROT); cudaMalloc(&b, s.half * 4); cudaMalloc(&o1, nout * 2 * ROT); cudaMalloc(&o2, nout * 2);
    fill<<<(nin * ROT + 255) / 256, 256>>>(x, nin * ROT, 1); fill<<<(2 * s.half + 255) / 256, 256>>>(b, 2 * s.half, 2);
    auto time_graph = [&](auto &&call) -> float {
      cudaGraph_t g; cudaGraphExec_t ge;
      cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
      for (int i = 0; i < 50; i++) call(i % ROT);
      cudaStreamEndCapture(st, &g); cudaGraphInstantiate(&ge, g, 0);
      cudaGraphLaunch(ge, st); cudaStreamSynchronize(st);
      cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
      cudaEventRecord(e0, st); for (int r = 0; r < 10; r++) cudaGraphLaunch(ge, st); cudaEventRecord(e1, st); cudaEventSynchronize(e1);
      float ms; cudaEventElapsedTime(&ms, e0, e1);
      return ms * 1e3f / 500.f;
    };
    size_t vec = nout / 8;
    float t[5];
    t[0] = time_graph([&](int k) { geglu_f16<<<(unsigned)std::min<size_t>((nout + 255) / 256, 65535), 256, 0, st>>>(x + k * nin, b, o1 + k * nout, s.rows, s.half); });
    t[1] = time_graph([&](int k) { geglu_f16<<<(unsigned)std::min<size_t>((vec + 255) / 256, 65535), 256, 0, st>>>(x + k * nin, b, o1 + k * nout, s.rows, s.half); });
    t[2] = time_graph([&](int k) { geglu32<<<(unsigned)std::min<size_t>((vec + 255) / 256, 65535), 256, 0, st>>>(x + k * nin, b, o1 + k * nout, s.rows, s.half); });
    const unsigned per_row = s.half / 8, bx = (per_row + 255) / 256;
    t[3] = time_graph([&](int k) { geglu2d<<<dim3(bx, s.rows), std::min(256u, per_row), 0, st>>>(x + k * nin, b, o1 + k * nout, s.rows, s.half); });
    t[4] = time_graph([&](int k) { copyref<<<(unsigned)std::min<size_t>((vec + 255) / 256, 65535), 256, 0, st>>>((const uint4 *)(x + k * nin), (uint4 *)(o1 + k * nout), s.rows, per_row); });
    // correctness of variants against the current kernel
    geglu_f16<<<(unsigned)((nout + 255) / 256), 256, 0, st>>>(x, b, o2, s.rows, s.half);
    std::vector<__half> ref(nout), got(nout); cudaStreamSynchronize(st);
    cudaMemcpy(ref.data(), o2, nout * 2, cudaMemcpyDeviceToHost);
    double bad = 0;
    for (int v = 2; v <= 3; v++) {
      if (v == 2) geglu32<<<(unsigned)((vec + 255) / 256), 256, 0, st>>>(x, b, o1, s.rows, s.half);
      else geglu2d<<<dim3(bx, s.rows), std::min(256u, per_row), 0, st>>>(x, b, o1, s.rows, s.half);
      cudaStreamSynchronize(st); cudaMemcpy(got.data(), o1, nout * 2, cudaMemcpyDeviceToHost);
      for (size_t i = 0; i < nout; i++) bad = std::max(bad, (double)fabsf(__half2float(got[i]) - __half2float(ref[i])));
    }
    double gbs = (nin + nout) * 2 / (t[1] * 1e3);
    printf("%5dx%5d x%d  %6.1f  %6.1f  %6.1f  %6.1f  %6.1f   (per-vector grid %.0f GB/s, max diff %g)\n", s.rows, s.half, s.count, t[0], t[1], t[2], t[3], t[4], gbs, bad);
    for (int v = 0; v < 5; v++) tot[v] += t[v] * s.count;
    cudaFree(x); cudaFree(b); cudaFree(o1); cudaFree(o2);
  }
  printf("per SD1.5 step (16 calls): per-element grid %.1f  per-vector grid %.1f  32-bit %.1f  2-D %.1f  copy %.1f us\n", tot[0], tot[1], tot[2], tot[3], tot[4]);
  printf("err: %s\n", cudaGetErrorString(cudaGetLastError()));
}
