// The channels-last GroupNorm's two paths (crates/sdhive-cuda-kernels/src/kernels.cu) against each other, f16,
// at the SD1.5 UNet's maps (batch 2 with CFG; the count is how often a step runs each) and a few SDXL and VAE
// ones: the three launches (moments, statistics, normalisation) and the one-launch gn_group_nhwc with clusters of
// 1-8 blocks per group at 256-1024 threads where a group fits ("-" where it does not), each timed in µs as a CUDA
// graph of 50 calls (as the UNet step replays them); BAD marks a difference of more than 8e-3 from the
// three-launch output (about 2 f16 ulps of the normalised values). Not part of the build; it
// chose `group_norm_block_per_group` in cuda.rs (docs/benchmarks.md has the H100 figures). Build here, run on the
// GPU machine (driver only):
//   nvcc -O3 -arch=sm_90 -std=c++17 xtask/bench/group_norm_shapes.cu -o group_norm_shapes && ./group_norm_shapes
#include "../../crates/sdhive-cuda-kernels/src/kernels.cu"
#include <cstdio>
#include <vector>
#include <algorithm>
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
  double told = 0, tbest = 0;
  for (auto &s : shapes) {
    size_t n = (size_t)s.n * s.pixels * s.channels;
    __half *x, *w, *b, *sh, *o1, *o2; float *partial, *stats;
    cudaMalloc(&x, n * 2); cudaMalloc(&o1, n * 2); cudaMalloc(&o2, n * 2); cudaMalloc(&w, s.channels * 2); cudaMalloc(&b, s.channels * 2); cudaMalloc(&sh, s.n * s.channels * 2);
    fill<<<(n + 255) / 256, 256>>>(x, n, 1, 3.f); fill<<<8, 256>>>(w, s.channels, 2, 1.f); fill<<<8, 256>>>(b, s.channels, 3, 0.f); fill<<<8, 256>>>(sh, s.n * s.channels, 4, 0.f);
    const int nvec = s.channels / 8, lanes = std::max(1, 256 / nvec);
    const int chunks = std::min(1024, std::max(1, (s.pixels + lanes * 8 - 1) / (lanes * 8)));
    cudaMalloc(&partial, (size_t)s.n * chunks * groups * 3 * 4); cudaMalloc(&stats, s.n * groups * 8);
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
    auto old_path = [&]() {
      gn_stats_nhwc_f16<<<dim3(chunks, s.n), lanes * nvec, lanes * nvec * 8 * 12, st>>>(x, sh, s.channels, partial, s.pixels, s.channels, groups, chunks);
      gn_finalize_nhwc<<<(s.n * groups + 7) / 8, 256, 0, st>>>(partial, stats, s.n, groups, chunks, eps);
      size_t vec = n / 8; unsigned grid = (unsigned)std::min<size_t>((vec + 255) / 256, 65535);
      gn_apply_nhwc_f16<<<grid, 256, 0, st>>>(x, sh, s.channels, w, b, o1, stats, n, s.pixels, s.channels, groups, 1);
    };
    old_path(); cudaStreamSynchronize(st);
    std::vector<__half> ref(n), got(n);
    cudaMemcpy(ref.data(), o1, n * 2, cudaMemcpyDeviceToHost);
    float to = time_graph(old_path);
    printf("%-15s old %6.2f us", s.what, to);
    const int upp = (s.channels / groups) / 2;
    float best = to;
    typedef void (*Group)(const __half *, const __half *, uint32_t, const __half *, const __half *, __half *, uint32_t, uint32_t, uint32_t, float, int);
    const Group kernels[4] = {gn_group_nhwc_c1_f16, gn_group_nhwc_c2_f16, gn_group_nhwc_c4_f16, gn_group_nhwc_c8_f16};
    for (int ci = 0; ci < 4; ci++) {
      const int cluster = 1 << ci;
      for (int threads : {256, 512, 1024}) {
        if ((threads / upp) * cluster * GN_GROUP_UNITS < s.pixels) { printf(" | c%d/%d -", cluster, threads); continue; }
        auto call = [&]() { kernels[ci]<<<dim3(groups * cluster, s.n), threads, 0, st>>>(x, sh, s.channels, w, b, o2, s.pixels, s.channels, groups, eps, 1); };
        cudaMemsetAsync(o2, 0, n * 2, st); call(); cudaStreamSynchronize(st);
        cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) { printf(" | c%d/%d %s", cluster, threads, cudaGetErrorString(err)); continue; }
        cudaMemcpy(got.data(), o2, n * 2, cudaMemcpyDeviceToHost);
        double maxd = 0; for (size_t k = 0; k < n; k++) maxd = fmax(maxd, fabs(__half2float(got[k]) - __half2float(ref[k])));
        float t = time_graph(call); best = std::min(best, t);
        printf(" | c%d/%d %6.2f%s", cluster, threads, t, maxd > 8e-3 ? " BAD" : "");
      }
    }
    printf("  x%d\n", s.count);
    told += to * s.count; tbest += best * s.count;
    cudaFree(x); cudaFree(w); cudaFree(b); cudaFree(sh); cudaFree(o1); cudaFree(o2); cudaFree(partial); cudaFree(stats);
  }
  printf("weighted per SD1.5 step: old %.1f us, best of both %.1f us\n", told, tbest);
  cudaError_t e = cudaGetLastError(); printf("last error: %s\n", cudaGetErrorString(e));
}
