// Block shapes of the fused attention kernel (crates/sdhive-cuda-kernels/src/attention.cu) against each other at
// the UNets' attention shapes, f16: time per call, bitwise agreement with the first shape of each head size, and
// the error against an f32 reference. Not part of the build; it chose the instantiations at the end of
// attention.cu (docs/benchmarks.md has the H100 figures). Build here, run on the GPU machine (driver only):
//   nvcc -O3 -arch=sm_90 -std=c++17 xtask/bench/attention_shapes.cu -o attention_shapes && ./attention_shapes
#define SDHIVE_ATTENTION_NO_INSTANCES
#include "../../crates/sdhive-cuda-kernels/src/attention.cu"
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cstring>
#include <algorithm>

#define INST(NAME, DP, BK, W, BOUNDS) INSTA(NAME, DP, BK, W, 1, BOUNDS)
#define INSTA(NAME, DP, BK, W, A, BOUNDS) INSTS(NAME, DP, BK, W, A, 1, BOUNDS)
#define INSTS(NAME, DP, BK, W, A, S, BOUNDS) \
  extern "C" __global__ void __launch_bounds__ BOUNDS NAME(const __half *q, const __half *k, const __half *v, __half *o, int sq, int sk, int d, int heads, long long q_bs, long long q_ss, long long k_bs, long long k_ss, long long v_bs, long long v_ss, float s) { \
    flash_attention<__half, DP, BK, W, A, S>(q, k, v, o, sq, sk, d, heads, q_bs, q_ss, k_bs, k_ss, v_bs, v_ss, s); }

INST(d48_w4_b5, 48, 64, 4, (128, 5))
INST(d48_w4_b4, 48, 64, 4, (128, 4))
INST(d48_w8_b2, 48, 64, 8, (256, 2))
INST(d48_w8_b3, 48, 64, 8, (256, 3))
INSTA(d48_w4_k32_b5, 48, 32, 4, 1, (128, 5))
INSTA(d48_w8_k32_b2, 48, 32, 8, 1, (256, 2))
INSTA(d48_a2_k32_b4, 48, 32, 4, 2, (128, 4))
INSTA(d48_a2_k32_b3, 48, 32, 4, 2, (128, 3))
INSTA(d48_a2_k64_b3, 48, 64, 4, 2, (128, 3))
INSTA(d48_a2_k64_b2, 48, 64, 4, 2, (128, 2))
INSTA(d64_a2_k32_b4, 64, 32, 4, 2, (128, 4))
INSTA(d64_a2_k32_b3, 64, 32, 4, 2, (128, 3))
INSTA(d64_a2_k64_b3, 64, 64, 4, 2, (128, 3))
INSTA(d80_a2_k32, 80, 32, 4, 2, (128))
INST(d64_w4_b5, 64, 64, 4, (128, 5))
INST(d64_w8_b2, 64, 64, 8, (256, 2))
INST(d80_w4, 80, 64, 4, (128))
INST(d80_w8, 80, 64, 8, (256))
INST(d160_w4, 160, 32, 4, (128))
INST(d160_w8, 160, 32, 8, (256))
INST(d160_w2, 160, 32, 2, (64))
INST(d160_w1, 160, 32, 1, (32))
INST(d80_w2, 80, 64, 2, (64))
INST(d80_w2_k32, 80, 32, 2, (64))
INST(d48_w2_k32, 48, 32, 2, (64))
INSTA(d48_a2_k32_w2, 48, 32, 2, 2, (64, 8))
INSTS(d160_w2_s4, 160, 32, 2, 1, 4, (256))
INSTS(d160_w4_s2, 160, 32, 4, 1, 2, (256))
INSTS(d160_w2_s2, 160, 32, 2, 1, 2, (128))
INSTS(d160_w2_s4_k16, 160, 16, 2, 1, 4, (256))

typedef void (*K)(const __half *, const __half *, const __half *, __half *, int, int, int, int, long long, long long, long long, long long, long long, long long, float);

__global__ void fill(__half *p, size_t n, unsigned seed) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) { unsigned x = (unsigned)i * 2654435761u ^ seed; x ^= x >> 13; x *= 0x5bd1e995; x ^= x >> 15; p[i] = __float2half(((x & 0xffff) / 65535.f - 0.5f) * 4.f); }
}

// fp32 reference: one thread per (row, head, batch), two passes over the keys.
__global__ void naive(const __half *q, const __half *k, const __half *v, float *o, int b_, int sq, int sk, int h_, int d, float scale) {
  int r = blockIdx.x * blockDim.x + threadIdx.x; int h = blockIdx.y, b = blockIdx.z;
  if (r >= sq) return;
  long long hs = (long long)h_ * d;
  const __half *qr = q + (b * (long long)sq + r) * hs + h * d;
  float m = -1e30f;
  for (int j = 0; j < sk; ++j) { const __half *kr = k + (b * (long long)sk + j) * hs + h * d; float s = 0; for (int c = 0; c < d; ++c) s += __half2float(qr[c]) * __half2float(kr[c]); m = fmaxf(m, s * scale); }
  float acc[160]; for (int c = 0; c < d; ++c) acc[c] = 0; float l = 0;
  for (int j = 0; j < sk; ++j) { const __half *kr = k + (b * (long long)sk + j) * hs + h * d; const __half *vr = v + (b * (long long)sk + j) * hs + h * d; float s = 0; for (int c = 0; c < d; ++c) s += __half2float(qr[c]) * __half2float(kr[c]); float p = expf(s * scale - m); l += p; for (int c = 0; c < d; ++c) acc[c] += p * __half2float(vr[c]); }
  float *orow = o + (b * (long long)sq + r) * hs + h * d; for (int c = 0; c < d; ++c) orow[c] = acc[c] / l;
}

struct Var { const char *name; K k; int dp, bk, warps, atoms = 1, split = 1; };

// attention.rs's smem_bytes: two stages of SPLIT·BK keys of K and V, the query tile from the second stage on, or
// the later key groups' hand-over if larger.
static int smem_of(const Var &v) {
  int keys = v.bk * v.split, rows = 16 * v.warps * v.atoms, ld = v.dp + 8;
  int stages = std::max(4 * keys, 2 * keys + rows) * ld * 2, merge = (v.split - 1) * rows / 16 * (v.dp / 8 + 1) * 512;
  return std::max(stages, merge);
}

int main() {
  Var vars[] = {{"d48_w4_b5", d48_w4_b5, 48, 64, 4}, {"d48_w4_b4", d48_w4_b4, 48, 64, 4}, {"d48_w8_b2", d48_w8_b2, 48, 64, 8}, {"d48_w8_b3", d48_w8_b3, 48, 64, 8},
                {"d48_a2_k32_b4", d48_a2_k32_b4, 48, 32, 4, 2}, {"d48_a2_k32_b3", d48_a2_k32_b3, 48, 32, 4, 2}, {"d48_a2_k64_b3", d48_a2_k64_b3, 48, 64, 4, 2}, {"d48_a2_k64_b2", d48_a2_k64_b2, 48, 64, 4, 2},
                {"d48_w4_k32_b5", d48_w4_k32_b5, 48, 32, 4, 1}, {"d48_w8_k32_b2", d48_w8_k32_b2, 48, 32, 8, 1},
                {"d64_a2_k32_b4", d64_a2_k32_b4, 64, 32, 4, 2}, {"d64_a2_k32_b3", d64_a2_k32_b3, 64, 32, 4, 2}, {"d64_a2_k64_b3", d64_a2_k64_b3, 64, 64, 4, 2}, {"d80_a2_k32", d80_a2_k32, 80, 32, 4, 2},
                {"d64_w4_b5", d64_w4_b5, 64, 64, 4}, {"d64_w8_b2", d64_w8_b2, 64, 64, 8},
                {"d80_w4", d80_w4, 80, 64, 4}, {"d80_w8", d80_w8, 80, 64, 8},
                {"d160_w4", d160_w4, 160, 32, 4}, {"d160_w8", d160_w8, 160, 32, 8},
                {"d160_w2", d160_w2, 160, 32, 2}, {"d160_w1", d160_w1, 160, 32, 1}, {"d80_w2", d80_w2, 80, 64, 2}, {"d80_w2_k32", d80_w2_k32, 80, 32, 2},
                {"d48_w2_k32", d48_w2_k32, 48, 32, 2}, {"d48_a2_k32_w2", d48_a2_k32_w2, 48, 32, 2, 2},
                {"d160_w2_s4", d160_w2_s4, 160, 32, 2, 1, 4}, {"d160_w4_s2", d160_w4_s2, 160, 32, 4, 1, 2},
                {"d160_w2_s2", d160_w2_s2, 160, 32, 2, 1, 2}, {"d160_w2_s4_k16", d160_w2_s4_k16, 160, 16, 2, 1, 4}};
  struct Shape { const char *what; int b, sq, sk, h, d; } shapes[] = {
      {"sd15 self 64x64", 2, 4096, 4096, 8, 40}, {"sd15 cross 64x64", 2, 4096, 77, 8, 40},
      {"sd15 self 32x32", 2, 1024, 1024, 8, 80}, {"sd15 cross 32x32", 2, 1024, 77, 8, 80}, {"sd15 self 16x16", 2, 256, 256, 8, 160}, {"sd15 cross 16x16", 2, 256, 77, 8, 160}, {"sd15 self 8x8", 2, 64, 64, 8, 160}, {"sd15 cross 8x8", 2, 64, 77, 8, 160},
      {"24x24 self", 2, 576, 576, 8, 160}, {"32x32 self", 2, 1024, 1024, 8, 160}, {"d160 keys 300", 1, 64, 300, 2, 160}, {"d160 one key", 1, 90, 1, 2, 160},
      {"sdxl self 64x64", 2, 4096, 4096, 10, 64}, {"sdxl self 32x32", 2, 1024, 1024, 20, 64}, {"sdxl cross 64x64", 2, 4096, 77, 10, 64}};
  for (auto &v : vars) {
    cudaFuncAttributes at; cudaFuncGetAttributes(&at, v.k);
    int smem = smem_of(v); int nb = 0;
    if (smem > 48 * 1024) cudaFuncSetAttribute(v.k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, v.k, v.warps * v.split * 32, smem);
    printf("%-14s regs %3d spill %3zu B  blocks/SM %d\n", v.name, at.numRegs, at.localSizeBytes, nb);
  }
  for (auto &s : shapes) {
    int dp = 0; for (int p : {16, 32, 48, 64, 80, 96, 128, 160}) if (p >= s.d) { dp = p; break; }
    size_t nq = (size_t)s.b * s.sq * s.h * s.d, nk = (size_t)s.b * s.sk * s.h * s.d;
    __half *q, *k, *v, *o; cudaMalloc(&q, nq * 2); cudaMalloc(&k, nk * 2); cudaMalloc(&v, nk * 2); cudaMalloc(&o, nq * 2);
    fill<<<(nq + 255) / 256, 256>>>(q, nq, 1); fill<<<(nk + 255) / 256, 256>>>(k, nk, 2); fill<<<(nk + 255) / 256, 256>>>(v, nk, 3);
    std::vector<__half> ref(nq), got(nq); bool have_ref = false;
    float *of; cudaMalloc(&of, nq * 4); std::vector<float> exact(nq);
    naive<<<dim3((s.sq + 127) / 128, s.h, s.b), 128>>>(q, k, v, of, s.b, s.sq, s.sk, s.h, s.d, 1.f / sqrtf((float)s.d));
    cudaMemcpy(exact.data(), of, nq * 4, cudaMemcpyDeviceToHost); cudaFree(of);
    double flop = 4.0 * s.b * s.h * (double)s.sq * s.sk * s.d;
    for (auto &var : vars) {
      if (var.dp != dp) continue;
      int smem = smem_of(var);
      int rows = 16 * var.warps * var.atoms; dim3 grid((s.sq + rows - 1) / rows, s.h, s.b);
      long long hs = (long long)s.h * s.d;
      float scale = 1.f / sqrtf((float)s.d) * 1.4426950408889634f;
      auto launch = [&]() { var.k<<<grid, var.warps * var.split * 32, smem>>>(q, k, v, o, s.sq, s.sk, s.d, s.h, s.sq * hs, hs, s.sk * hs, hs, s.sk * hs, hs, scale); };
      cudaMemset(o, 0, nq * 2);
      for (int i = 0; i < 20; ++i) launch();
      cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
      const int reps = 200;
      cudaEventRecord(e0); for (int i = 0; i < reps; ++i) launch(); cudaEventRecord(e1); cudaEventSynchronize(e1);
      float ms; cudaEventElapsedTime(&ms, e0, e1); ms /= reps;
      cudaError_t err = cudaGetLastError();
      cudaMemcpy(got.data(), o, nq * 2, cudaMemcpyDeviceToHost);
      const char *eq = "ref";
      if (!have_ref) { ref = got; have_ref = true; } else eq = memcmp(ref.data(), got.data(), nq * 2) == 0 ? "identical" : "DIFFERENT";
      double maxe = 0, sume = 0; for (size_t i = 0; i < nq; ++i) { double e = fabs(__half2float(got[i]) - exact[i]); maxe = fmax(maxe, e); sume += e; }
      printf("%-18s %-14s %8.1f us  %6.1f TFLOP/s  %-9s vs fp32: max %.2e mean %.2e %s\n", s.what, var.name, ms * 1e3, flop / (ms * 1e-3) / 1e12, eq, maxe, sume / nq, err ? cudaGetErrorString(err) : "");
    }
    cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(o);
  }
}
