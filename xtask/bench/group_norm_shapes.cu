// The channels-last GroupNorm's two paths (crates/sdhive-cuda-kernels/src/kernels.cu) against each other, f16,
// at the SD1.5 UNet's maps (batch 2 with CFG; the count is how often a step runs each) and a few SDXL and VAE
// ones: the one-launch gn_group_nhwc with clusters of 1, 2 (what the crate instantiates), 4 and 8 blocks per
// group at 128 to 1024 threads where a group fits, and the two-launch gn_slab_* (moments per slab, then the
// normalisation) at 2-32 slabs per sample, its apply blocks of 128 threads. Each is timed in µs as a CUDA graph
// of 50 calls (as the UNet step replays them; the slab rows also time each launch alone) and checked against an
// f64 reference on the host (BAD: more than 4e-3 from it, two f16 ulps of the normalised values). Not part of
// the build; it chose `group_norm_one_launch` and `group_norm_slabs` in cuda.rs (docs/benchmarks.md has the
// H100 figures). Build here, run on the GPU machine (driver only):
//   nvcc -O3 -arch=sm_90 -std=c++17 xtask/bench/group_norm_shapes.cu -o group_norm_shapes && ./group_norm_shapes
#include "../../crates/sdhive-cuda-kernels/src/kernels.cu"
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>
// The crate instantiates clusters of 1 and 2 blocks; the larger ones are measured here.
GN_CLUSTER_GROUP(__half, f16, 4)
GN_CLUSTER_GROUP(__half, f16, 8)
__global__ void fill(__half *p, size_t n, unsigned seed, float offset) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) { unsigned x = (unsigned)i * 2654435761u ^ seed; x ^= x >> 13; x *= 0x5bd1e995; x ^= x >> 15; p[i] = __float2half(((x & 0xffff) / 65535.f - 0.5f) * 4.f + offset); }
}
int main() {
  struct Shape { const char *what; int n, pixels, channels, count; } shapes[] = {
      {"64x64x320", 2, 4096, 320, 13}, {"64x64x640", 2, 4096, 640, 2}, {"64x64x960", 2, 4096, 960, 1},
      {"32x32x320", 2, 1024, 320, 1}, {"32x32x640", 2, 1024, 640, 11}, {"32x32x960", 2, 1024, 960, 1}, {"32x32x1280", 2, 1024, 1280, 1}, {"32x32x1920", 2, 1024, 1920, 1},
      {"16x16x640", 2, 256, 640, 1}, {"16x16x1280", 2, 256, 1280, 11}, {"16x16x1920", 2, 256, 1920, 1}, {"16x16x2560", 2, 256, 2560, 2},
      {"8x8x1280", 2, 64, 1280, 12}, {"8x8x2560", 2, 64, 2560, 3},
      {"xl 128x128x320", 2, 16384, 320, 0}, {"xl 64x64x640", 2, 4096, 640, 0}, {"xl 32x32x1280", 2, 1024, 1280, 0}, {"xl 32x32x2560", 2, 1024, 2560, 0}, {"vae 32x32x512", 1, 1024, 512, 0}, {"vae 64x64x512", 1, 4096, 512, 0}, {"vae 128x128x256", 1, 16384, 256, 0}};
  cudaStream_t st; cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  const int groups = 32; const float eps = 1e-5f;
  double tone = 0, tslab = 0, tbest = 0;
  for (auto &s : shapes) {
    size_t n = (size_t)s.n * s.pixels * s.channels;
    __half *x, *w, *b, *sh, *o; float *part;
    cudaMalloc(&x, n * 2); cudaMalloc(&o, n * 2); cudaMalloc(&w, s.channels * 2); cudaMalloc(&b, s.channels * 2); cudaMalloc(&sh, s.n * s.channels * 2);
    cudaMalloc(&part, (size_t)s.n * 32 * groups * 3 * 4);
    fill<<<(n + 255) / 256, 256>>>(x, n, 1, 3.f); fill<<<8, 256>>>(w, s.channels, 2, 1.f); fill<<<8, 256>>>(b, s.channels, 3, 0.f); fill<<<8, 256>>>(sh, s.n * s.channels, 4, 0.f);
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
      for (int i = 0; i < 50; i++) call();
      cudaStreamEndCapture(st, &g); cudaGraphInstantiate(&ge, g, 0);
      cudaGraphLaunch(ge, st); cudaStreamSynchronize(st);
      cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
      cudaEventRecord(e0, st); for (int r = 0; r < 10; r++) cudaGraphLaunch(ge, st); cudaEventRecord(e1, st); cudaEventSynchronize(e1);
      float ms; cudaEventElapsedTime(&ms, e0, e1);
      cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
      return ms * 1e3f / 500.f;
    };
    // Runs `call` once into `o` and returns its largest distance from the reference, or -1 after a launch error.
    auto check = [&](auto &&call) -> double {
      cudaMemsetAsync(o, 0, n * 2, st); call(); cudaStreamSynchronize(st);
      if (cudaGetLastError() != cudaSuccess) return -1;
      cudaMemcpy(got.data(), o, n * 2, cudaMemcpyDeviceToHost);
      double d = 0; for (size_t k = 0; k < n; k++) d = fmax(d, fabs(__half2float(got[k]) - exact[k]));
      return d;
    };
    printf("%-15s", s.what);
    float best_one = 1e9, best_slab = 1e9;
    typedef void (*Group)(const __half *, const __half *, uint32_t, const __half *, const __half *, __half *, uint32_t, uint32_t, uint32_t, float, int);
    const Group kernels[4] = {gn_group_nhwc_c1_f16, gn_group_nhwc_c2_f16, gn_group_nhwc_c4_f16, gn_group_nhwc_c8_f16};
    const int upp = pg / 2;
    for (int ci = 0; ci < 4; ci++) {
      const int cluster = 1 << ci;
      for (int threads : {128, 256, 512, 1024}) {
        if (threads / upp == 0 || (threads / upp) * cluster * GN_GROUP_UNITS < s.pixels) continue;
        auto call = [&]() { kernels[ci]<<<dim3(groups * cluster, s.n), threads, 0, st>>>(x, sh, s.channels, w, b, o, s.pixels, s.channels, groups, eps, 1); };
        const double d = check(call);
        if (d < 0) { printf(" | c%d/%d error", cluster, threads); continue; }
        const float t = time_graph(call);
        if (cluster <= 2) best_one = std::min(best_one, t);
        printf(" | c%d/%d %.2f%s", cluster, threads, t, d > 4e-3 ? " BAD" : "");
      }
    }
    int chunk = 8 / std::__gcd(8, pg) * pg;
    while (chunk < 32 && s.channels % (2 * chunk) == 0 && 2 * chunk / pg <= GN_SLAB_GROUPS) chunk *= 2;
    const int vpc = chunk / 8, chunks = s.channels / chunk;
    printf(" || chunk %d", chunk);
    for (int slabs : {2, 4, 8, 16, 32}) {
      const int rows = ((s.pixels + slabs - 1) / slabs + GN_SLAB_HOLD - 1) / GN_SLAB_HOLD;
      const int threads = (rows * vpc + 31) / 32 * 32;
      if (threads > GN_SLAB_THREADS) continue;
      const int smem = (threads * 8 + std::max(threads, chunk)) * 4;
      const int at = std::max(128, (vpc + 31) / 32 * 32), pblocks = (s.pixels + at / vpc * GN_SLAB_APPLY_HOLD - 1) / (at / vpc * GN_SLAB_APPLY_HOLD);
      auto moments = [&]() { gn_slab_moments_nhwc_f16<<<dim3(chunks, slabs, s.n), threads, smem, st>>>(x, sh, s.channels, part, s.pixels, s.channels, groups, chunk, slabs); };
      auto apply = [&]() { gn_slab_apply_nhwc_f16<<<dim3(chunks, pblocks, s.n), at, 0, st>>>(x, sh, s.channels, w, b, o, part, s.pixels, s.channels, groups, chunk, slabs, eps, 1); };
      auto call = [&]() { moments(); apply(); };
      const double d = check(call);
      if (d < 0) { printf(" | s%d error", slabs); continue; }
      const float t = time_graph(call), tm = time_graph(moments), ta = time_graph(apply);
      best_slab = std::min(best_slab, t);
      printf(" | s%d(%d blocks) %.2f = %.2f + %.2f%s", slabs, chunks * slabs * s.n, t, tm, ta, d > 4e-3 ? " BAD" : "");
    }
    printf("  x%d\n", s.count);
    tone += (best_one < 1e9 ? best_one : best_slab) * s.count; tslab += best_slab * s.count; tbest += std::min(best_one, best_slab) * s.count;
    cudaFree(x); cudaFree(w); cudaFree(b); cudaFree(sh); cudaFree(o); cudaFree(part);
  }
  printf("weighted per SD1.5 step: one launch where it fits %.1f us, two launches everywhere %.1f us, best of both %.1f us\n", tone, tslab, tbest);
  cudaError_t e = cudaGetLastError(); printf("last error: %s\n", cudaGetErrorString(e));
}
