// The edge convolutions (crates/sdhive-cuda-kernels/src/edge_conv.cu) against what the engine ran before them:
// cuDNN's NHWC convolution over channels padded to 8 (cudnnConvolutionBiasActivationForward, as src/cudnn.rs
// calls it) plus the transpose between NCHW and NHWC (timed here as a plain tiled transpose of the same bytes).
// Shapes: SD1.5's UNet (64²·320 → 4 at batch 2; 4 → 320 at batch 1 and 2) and the VAE decoder's (128 → 3 at
// 512²; 4 → 512 at 64²). Each output is checked against an f32 loop over the products. Times: CUDA graphs of 20
// calls launched 5 times, best, µs a call.
// Build here, run on the GPU machine:
//   C=~/.cache/sdhive-cuda-13.0/prefix/nvidia (the toolchain `cargo xtask build-cuda` caches; its nvcc on PATH)
//   nvcc -O3 -std=c++17 -arch=sm_90 -cudart shared -I$C/cudnn/include xtask/bench/edge_conv.cu -o edge_conv \
//        -L$C/cu13/lib -L$C/cudnn/lib -l:libcudnn.so.9
#include "../../crates/sdhive-cuda-kernels/src/edge_conv.cu"
#include "cudnn_conv.cuh"

// Four 16-pixel tiles per warp, which the crate does not keep.
EDGE_OUT_MT(__half, f16, edge_out_m4_f16, 4, 2)

// out (NHWC or NCHW by `nchw_out`) = bias + Σ x · w over the 3×3 taps, f32; x NHWC (n, h, w, c) or NCHW, w KRSC.
__global__ void reference(const __half *x, bool nchw_in, const __half *w, const __half *bias, float *out, bool nchw_out,
                          int n, int h, int wd, int c, int cp, int k) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n * h * wd * k) return;
    const int ch = idx % k, p = idx / k, b = p / (h * wd), y = p % (h * wd) / wd, xx = p % wd;
    float acc = __half2float(bias[ch]);
    for (int tap = 0; tap < 9; ++tap) {
        const int iy = y + tap / 3 - 1, ix = xx + tap % 3 - 1;
        if (iy < 0 || iy >= h || ix < 0 || ix >= wd) continue;
        for (int ci = 0; ci < c; ++ci) {
            const float v = nchw_in ? __half2float(x[((size_t)(b * c + ci) * h + iy) * wd + ix])
                                    : __half2float(x[((size_t)(b * h + iy) * wd + ix) * c + ci]);
            acc += v * __half2float(w[((size_t)ch * 9 + tap) * cp + ci]);
        }
    }
    out[nchw_out ? ((size_t)(b * k + ch) * h + y) * wd + xx : (size_t)p * k + ch] = acc;
}

// A transpose of (rows, cols) f16 through 32×32 shared tiles, as the engine's edge transposes move their bytes.
__global__ void transpose(const __half *x, __half *y, int rows, int cols) {
    __shared__ __half t[32][33];
    const int bx = blockIdx.x * 32, by = blockIdx.y * 32;
    for (int i = threadIdx.y; i < 32; i += 8)
        if (by + i < rows && bx + threadIdx.x < cols) t[i][threadIdx.x] = x[(size_t)(by + i) * cols + bx + threadIdx.x];
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += 8)
        if (bx + i < cols && by + threadIdx.x < rows) y[(size_t)(bx + i) * rows + by + threadIdx.x] = t[threadIdx.x][i];
}

int main() {
    setvbuf(stdout, nullptr, _IONBF, 0);
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    cudnnHandle_t dn;
    CK(cudnnCreate(&dn));
    CK(cudnnSetStream(dn, st));
    struct Shape { const char *what; bool out; int n, hw, c, k; };
    for (Shape s : {Shape{"UNet last 64x64 x2 320->4", true, 2, 64, 320, 4}, Shape{"VAE last 512x512 128->3", true, 1, 512, 128, 3},
                    Shape{"UNet first 64x64 x1 4->320", false, 1, 64, 4, 320}, Shape{"UNet first 64x64 x2 4->320", false, 2, 64, 4, 320},
                    Shape{"VAE first 64x64 4->512", false, 1, 64, 4, 512}}) {
        const int n = s.n, h = s.hw, wd = s.hw, c = s.c, k = s.k;
        // The padded sides as the engine holds them: 8 filter rows (out) or 8 filter columns (in).
        const int kp = s.out ? 8 : k, cp = s.out ? c : 8;
        const size_t nx = (size_t)n * h * wd * c, nw = (size_t)kp * 9 * cp, ny = (size_t)n * h * wd * k;
        __half *x, *w, *b, *y, *xp, *yp;
        float *ref;
        CK(cudaMalloc(&x, nx * 2));
        CK(cudaMalloc(&w, nw * 2));
        CK(cudaMalloc(&b, kp * 2));
        CK(cudaMalloc(&y, ny * 2));
        CK(cudaMalloc(&ref, ny * 4));
        fill<<<(unsigned)((nx + 255) / 256), 256>>>(x, nx, 3, 1.f);
        fill<<<(unsigned)((nw + 255) / 256), 256>>>(w, nw, 5, 1.f / sqrtf(9.f * c));
        fill<<<1, 256>>>(b, kp, 7, 0.5f);
        // Zero the padding: filter rows past k (out) or columns past c (in), bias past k.
        std::vector<__half> hw(nw), hb(kp);
        CK(cudaMemcpy(hw.data(), w, nw * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hb.data(), b, kp * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < nw; ++i)
            if ((s.out && (int)(i / (9 * cp)) >= k) || (!s.out && (int)(i % cp) >= c)) hw[i] = __float2half(0.f);
        for (int i = k; i < kp; ++i) hb[i] = __float2half(0.f);
        CK(cudaMemcpy(w, hw.data(), nw * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(b, hb.data(), kp * 2, cudaMemcpyHostToDevice));
        reference<<<(unsigned)((ny + 255) / 256), 256>>>(x, !s.out, w, b, ref, s.out, n, h, wd, c, cp, k);
        std::vector<float> r(ny);
        CK(cudaMemcpy(r.data(), ref, ny * 4, cudaMemcpyDeviceToHost));
        std::vector<__half> got(ny);
        // Tiles of 16 pixels per warp of edge_out: 1 and, where the row holds 64 pixels, 4.
        float t_ours[2] = {0.f, 0.f};
        double err = 0, top = 0;
        for (int mt : {1, 4}) {
            if (!s.out && mt == 4) continue;
            auto ours = [&](int) {
                if (!s.out) edge_in4_f16<<<n * h * wd / 16, (k / 2 + 31) / 32 * 32, 0, st>>>(x, w, b, y, h, wd, cp, k);
                else if (mt == 1) edge_out_f16<<<n * h * wd / 16, 288, 0, st>>>(x, w, b, y, h, wd, c, k);
                else edge_out_m4_f16<<<n * h * wd / 64, 288, 0, st>>>(x, w, b, y, h, wd, c, k);
            };
            CK(cudaMemset(y, 0xFF, ny * 2));
            ours(0);
            CK(cudaStreamSynchronize(st));
            CK(cudaGetLastError());
            CK(cudaMemcpy(got.data(), y, ny * 2, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < ny; ++i) {
                const float v = __half2float(got[i]);
                err = std::max(err, std::isfinite(v) ? (double)fabsf(v - r[i]) : 1e30);
                top = std::max(top, (double)fabsf(r[i]));
            }
            t_ours[mt == 4] = time_graph(st, ours);
        }
        // The engine's route before: cuDNN on the padded channels-last operands, then the transpose.
        const int cin = s.out ? c : 8, cout = s.out ? 8 : k;
        CK(cudaMalloc(&xp, (size_t)n * h * wd * cin * 2));
        CK(cudaMalloc(&yp, (size_t)n * h * wd * cout * 2));
        CK(cudaMemset(xp, 0, (size_t)n * h * wd * cin * 2));
        const EngineConv engine(dn, n, cin, cout, h);
        const int trows = s.out ? n * h * wd : n * 4, tcols = s.out ? 8 : h * wd;
        auto before = [&](int) {
            if (!s.out) transpose<<<dim3((tcols + 31) / 32, (trows + 31) / 32), dim3(32, 8), 0, st>>>(x, xp, trows, tcols);
            engine.run(s.out ? x : xp, w, b, nullptr, yp);
            if (s.out) transpose<<<dim3((tcols + 31) / 32, (trows + 31) / 32), dim3(32, 8), 0, st>>>(yp, y, trows, tcols);
        };
        before(0);
        CK(cudaStreamSynchronize(st));
        const float t_before = time_graph(st, before);
        printf("%-28s ours %7.2f us (4 tiles a warp %7.2f; err %.2e rel)  cuDNN padded + transpose %7.2f us\n", s.what,
               t_ours[0], t_ours[1], err / top, t_before);
        CK(cudaFree(x)); CK(cudaFree(w)); CK(cudaFree(b)); CK(cudaFree(y)); CK(cudaFree(ref));
        CK(cudaFree(xp)); CK(cudaFree(yp));
    }
    printf("done\n");
    return 0;
}
