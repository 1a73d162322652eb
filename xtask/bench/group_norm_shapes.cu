// The channels-last GroupNorm's three paths (crates/sdhive-cuda-kernels/src/kernels.cu) against each other, f16,
// with a shift and SiLU: the one-launch gn_group_nhwc (one block, or a cluster of two, per group, as cuda.rs's
// group_norm_one_launch picks), the slab launches gn_slab_* (cuda.rs's group_norm_slabs plan) and the streaming
// launches gn_rows_* (group_norm_rows' plan; moments and normalisation also timed alone), at the SD1.5 UNet's maps
// at batch 16 (eight guided images) and 2, the VAE decoder's at one image and SDXL's 128² map. Each is timed in
// µs as a CUDA graph of 20 calls and checked against an f64 reference on the host (BAD: more than 4e-3 from it,
// two f16 ulps of the normalised values); "read" is one pass reading the map. Not part of the build; it chose
// ROWS_MIN_BYTES in cuda.rs (docs/benchmarks.md has the H200 figures). Build here, run on the GPU machine:
//   nvcc -O3 -arch=sm_90a -std=c++17 xtask/bench/group_norm_shapes.cu -o group_norm_shapes && ./group_norm_shapes
#include "../../crates/sdhive-cuda-kernels/src/kernels.cu"
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>
__global__ void fill(__half *p, size_t n, unsigned seed, float offset, float amp) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) { unsigned x = (unsigned)i * 2654435761u ^ seed; x ^= x >> 13; x *= 0x5bd1e995; x ^= x >> 15; p[i] = __float2half(((x & 0xffff) / 65535.f - 0.5f) * amp + offset); }
}
__global__ void read_all(const uint4 *x, size_t n, float *sink) {
  float a = 0.f;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) { uint4 v = __ldg(x + i); a += __uint_as_float(v.x ^ v.y ^ v.z ^ v.w); }
  if (a == 1.2345f) sink[0] = a;
}
static int r32(int x) { return (x + 31) / 32 * 32; }
int main() {
  struct Shape { const char *what; int n, pixels, channels; } shapes[] = {
      {"b16 64x64x320", 16, 4096, 320}, {"b16 64x64x640", 16, 4096, 640}, {"b16 64x64x960", 16, 4096, 960},
      {"b16 32x32x640", 16, 1024, 640}, {"b16 32x32x1280", 16, 1024, 1280}, {"b16 16x16x1280", 16, 256, 1280},
      {"b16 8x8x1280", 16, 64, 1280}, {"b2 64x64x320", 2, 4096, 320}, {"b2 32x32x640", 2, 1024, 640},
      {"vae 512x512x128", 1, 262144, 128}, {"vae 512x512x256", 1, 262144, 256}, {"vae 256x256x256", 1, 65536, 256},
      {"vae 256x256x512", 1, 65536, 512}, {"vae 128x128x512", 1, 16384, 512}, {"vae 64x64x512", 1, 4096, 512},
      {"xl 128x128x320 b2", 2, 16384, 320}};
  cudaStream_t st; cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  const int groups = 32; const float eps = 1e-5f;
  uint32_t *done; cudaMalloc(&done, 4096 * 4); cudaMemset(done, 0, 4096 * 4);
  for (auto &s : shapes) {
    size_t n = (size_t)s.n * s.pixels * s.channels;
    __half *x, *w, *b, *sh, *o; float *part;
    cudaMalloc(&x, n * 2); cudaMalloc(&o, n * 2); cudaMalloc(&w, s.channels * 2); cudaMalloc(&b, s.channels * 2); cudaMalloc(&sh, s.n * s.channels * 2);
    cudaMalloc(&part, (size_t)s.n * 300 * groups * 3 * 4);
    fill<<<(n + 255) / 256, 256>>>(x, n, 1, 3.f, 4.f); fill<<<8, 256>>>(w, s.channels, 2, 1.f, 1.f); fill<<<8, 256>>>(b, s.channels, 3, 0.f, 1.f); fill<<<8, 256>>>(sh, s.n * s.channels, 4, 0.f, 2.f);
    cudaDeviceSynchronize();  // the fills ran on the legacy stream, which `st` does not wait for
    // The f64 reference of the f16 inputs (+ shift, SiLU).
    std::vector<float> exact(n);
    std::vector<__half> hx(n), hw(s.channels), hb(s.channels), hs(s.n * s.channels), got(n);
    cudaMemcpy(hx.data(), x, n * 2, cudaMemcpyDeviceToHost); cudaMemcpy(hw.data(), w, s.channels * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(hb.data(), b, s.channels * 2, cudaMemcpyDeviceToHost); cudaMemcpy(hs.data(), sh, s.n * s.channels * 2, cudaMemcpyDeviceToHost);
    const int pg = s.channels / groups;
    for (int smp = 0; smp < s.n; smp++) for (int g = 0; g < groups; g++) {
      auto val = [&](int p, int c) { return (double)__half2float(hx[((size_t)smp * s.pixels + p) * s.channels + c]) + __half2float(hs[smp * s.channels + c]); };
      double sum = 0, sq = 0; const double cnt = (double)s.pixels * pg;
      for (int p = 0; p < s.pixels; p++) for (int c = g * pg; c < (g + 1) * pg; c++) sum += val(p, c);
      const double mean = sum / cnt;
      for (int p = 0; p < s.pixels; p++) for (int c = g * pg; c < (g + 1) * pg; c++) sq += (val(p, c) - mean) * (val(p, c) - mean);
      const double rstd = 1.0 / sqrt(sq / cnt + eps);
      for (int p = 0; p < s.pixels; p++) for (int c = g * pg; c < (g + 1) * pg; c++) {
        const double v = (val(p, c) - mean) * rstd * __half2float(hw[c]) + __half2float(hb[c]);
        exact[((size_t)smp * s.pixels + p) * s.channels + c] = (float)(v / (1.0 + exp(-v)));
      }
    }
    auto time_graph = [&](auto &&call) -> float {
      cudaGraph_t g; cudaGraphExec_t ge;
      cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
      for (int i = 0; i < 20; i++) call();
      cudaStreamEndCapture(st, &g); cudaGraphInstantiate(&ge, g, 0);
      cudaGraphLaunch(ge, st); cudaStreamSynchronize(st);
      cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
      cudaEventRecord(e0, st); for (int r = 0; r < 10; r++) cudaGraphLaunch(ge, st); cudaEventRecord(e1, st); cudaEventSynchronize(e1);
      float ms; cudaEventElapsedTime(&ms, e0, e1);
      cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
      return ms * 1e3f / 200.f;
    };
    // Runs `call` once into `o`: " BAD" when it is off the reference or failed to launch.
    auto check = [&](auto &&call) -> const char * {
      cudaMemsetAsync(o, 0, n * 2, st); call(); cudaStreamSynchronize(st);
      if (cudaGetLastError() != cudaSuccess) return " BAD (launch)";
      cudaMemcpy(got.data(), o, n * 2, cudaMemcpyDeviceToHost);
      double d = 0; for (size_t k = 0; k < n; k++) d = fmax(d, fabs(__half2float(got[k]) - exact[k]));
      return d > 4e-3 ? " BAD" : "";
    };
    printf("%-18s %6.1f MB", s.what, n * 2 / 1e6);
    printf(" | read %.1f", time_graph([&]() { read_all<<<132 * 8, 256, 0, st>>>((const uint4 *)x, n / 8, part); }));
    {  // cuda.rs group_norm_one_launch
      const int upp = pg / 2;
      auto per_thread = [&](int threads, int cl) { return (s.pixels + (threads / upp) * cl - 1) / ((threads / upp) * cl); };
      int threads = 0, cl = 0;
      if (512 / upp > 0 && per_thread(512, 1) <= 16) { threads = 512; cl = 1; }
      else if (1024 / upp > 0 && per_thread(1024, 1) <= 12) { threads = 1024; cl = 1; }
      else if (s.pixels <= 1024 && 1024 / upp > 0 && per_thread(1024, 2) <= 16) { threads = 1024; cl = 2; }
      if (threads) {
        auto call = [&]() {
          if (cl == 1) gn_group_nhwc_c1_f16<<<dim3(groups, s.n), threads, 0, st>>>(x, nullptr, s.channels, nullptr, sh, s.channels, w, b, o, s.pixels, s.channels, groups, eps, 1);
          else gn_group_nhwc_c2_f16<<<dim3(groups * 2, s.n), threads, 0, st>>>(x, nullptr, s.channels, nullptr, sh, s.channels, w, b, o, s.pixels, s.channels, groups, eps, 1);
        };
        const char *bad = check(call);
        printf(" | one c%d %.1f%s", cl, time_graph(call), bad);
      }
    }
    {  // cuda.rs group_norm_slabs
      int chunk = 8 / std::__gcd(8, pg) * pg;
      while (chunk * 2 < 64 && s.channels % (2 * chunk) == 0 && 2 * chunk / pg <= GN_SLAB_GROUPS) chunk *= 2;
      const int vpc = chunk / 8;
      auto rows = [&](int slabs) { return ((s.pixels + slabs - 1) / slabs + GN_SLAB_HOLD - 1) / GN_SLAB_HOLD; };
      int slabs = 1; while (rows(slabs) * vpc > GN_SLAB_THREADS) slabs *= 2;
      while ((s.channels / chunk) * slabs * s.n < 256 && rows(slabs * 2) * vpc >= 64) slabs *= 2;
      slabs = std::min(slabs, 64);
      const int threads = r32(std::min(rows(slabs), GN_SLAB_THREADS / vpc) * vpc);
      int at = 0, ab = 0;
      for (int t : {128, 256, 512, 1024}) { const int t2 = std::max(t, r32(vpc)), bl = (s.pixels + (t2 / vpc) * GN_SLAB_APPLY_HOLD - 1) / ((t2 / vpc) * GN_SLAB_APPLY_HOLD); if (t2 <= 1024 && bl <= 65535) { at = t2; ab = bl; break; } }
      const int chunks = s.channels / chunk, smem = (threads * 8 + std::max(threads, chunk)) * 4;
      auto call = [&]() {
        gn_slab_moments_nhwc_f16<<<dim3(chunks, slabs, s.n), threads, smem, st>>>(x, nullptr, s.channels, sh, s.channels, part, s.pixels, s.channels, groups, chunk, slabs);
        gn_slab_apply_nhwc_f16<<<dim3(chunks, ab, s.n), at, 0, st>>>(x, nullptr, s.channels, nullptr, sh, s.channels, w, b, o, part, s.pixels, s.channels, groups, chunk, slabs, eps, 1);
      };
      const char *bad = check(call);
      printf(" | slab %.1f%s", time_graph(call), bad);
    }
    {  // cuda.rs group_norm_rows
      const int vpr = s.channels / 8, rows = std::max(1, 256 / vpr), threads = r32(rows * vpr);
      const int most = std::min(256, std::max(1, (s.pixels + rows * GN_ROWS_BATCH - 1) / (rows * GN_ROWS_BATCH)));
      const int slabs = std::min(most, std::max(1, (256 + s.n - 1) / s.n));
      const int per_block = rows * GN_ROWS_APPLY * 2, blocks = (s.pixels + per_block - 1) / per_block;
      float *stats = part + (size_t)s.n * slabs * groups * 3;
      auto moments = [&]() { gn_rows_moments_nhwc_f16<<<dim3(slabs, s.n), threads, threads * 17 * 4, st>>>(x, nullptr, s.channels, sh, s.channels, part, stats, done, s.pixels, s.channels, groups, slabs, eps); };
      auto apply = [&]() { gn_rows_apply_nhwc_f16<<<dim3(blocks, s.n), threads, 0, st>>>(x, nullptr, s.channels, nullptr, sh, s.channels, w, b, o, stats, s.pixels, s.channels, groups, per_block, 1); };
      auto call = [&]() { moments(); apply(); };
      const char *bad = check(call);
      printf(" | rows %.1f = %.1f + %.1f%s\n", time_graph(call), time_graph(moments), time_graph(apply), bad);
    }
    cudaFree(x); cudaFree(w); cudaFree(b); cudaFree(sh); cudaFree(o); cudaFree(part);
  }
  cudaError_t e = cudaGetLastError(); printf("last error: %s\n", cudaGetErrorString(e));
}
