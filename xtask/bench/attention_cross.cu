// Short-key (cross-) attention: attention.cu's cross_attention (all keys of a (batch, head) in shared memory, each
// warp looping over query chunks with the next Q tiles in flight) against the kernels attention.rs takes
// otherwise on an H100 (the Hopper kernels at heads of 40, 64, 80; the key-split mma.sync kernel at 160), at the
// UNets' cross-attention shapes (77 keys), f16: time per call (a CUDA graph of 50 launches, the mean of 5 replays,
// as the UNet's step graph runs them) and the error against an f32 reference. For each cross_attention
// instantiation several grid widths: 1, 2, 3, 4 chunks per warp and `rule`, attention.rs's (the fewest chunks per
// warp that the resident warps allow). Then correctness only (f16 and bf16): ragged
// shapes, strided q (one half of a (B, Sq, 2·H·D) buffer) and k, v (the halves of one (B, Sk, 2·H·D) buffer, as
// the text context's k/v table). Not part of the build. Build here, run on the H100 machine (driver only):
//   nvcc -O3 -arch=sm_90a -std=c++17 xtask/bench/attention_cross.cu -o attention_cross && ./attention_cross
#define SDHIVE_ATTENTION_NO_INSTANCES
#include "../../crates/sdhive-cuda-kernels/src/attention.cu"
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

template <typename T>
using Kernel = void (*)(const T *, const T *, const T *, T *, int, int, int, int, long long, long long, long long,
                        long long, long long, long long, float);
#define ARGS(T)                                                                                                   \
    const T *q, const T *k, const T *v, T *o, int sq, int sk, int d, int heads, long long q_bs, long long q_ss,      \
        long long k_bs, long long k_ss, long long v_bs, long long v_ss, float c
#define PASS q, k, v, o, sq, sk, heads, q_bs, q_ss, k_bs, k_ss, v_bs, v_ss, c

template <int D, int NWG, int BLOCKS> __global__ void __launch_bounds__(128 * NWG, BLOCKS) wgmma(ARGS(__half)) {
    SDHIVE_SM90A((hopper::attention<__half, D, NWG>(PASS)));
}
__global__ void __launch_bounds__(256) split160(ARGS(__half)) {
    flash_attention<__half, 160, 32, 2, 1, 4>(q, k, v, o, sq, sk, d, heads, q_bs, q_ss, k_bs, k_ss, v_bs, v_ss, c);
}
template <typename T, int D, int W, int A, int QB, int MINB>
__global__ void __launch_bounds__(32 * W, MINB) cross(ARGS(T)) {
    cross_attention<T, D, W, A, QB>(PASS);
}

static int sms = 0;
template <typename T> struct Impl {
    const char *name;
    Kernel<T> fn;
    int d, threads, rows, kind; // kind 0: one block per `rows` rows; 1: cross_attention (warps, atoms below)
    int warps = 0, atoms = 0, smem_fixed = 0;
    // Dynamic shared memory for sk keys.
    int smem(int sk) const {
        if (kind == 0) return smem_fixed;
        const int kr = (sk + CROSS_TILE - 1) / CROSS_TILE * CROSS_TILE, ld = (d + 15) / 16 * 16 + 8;
        return (2 * kr + warps * qb * 16 * atoms) * ld * 2;
    }
    int qb = 2;
};
template <typename T, int D, int W, int A, int QB, int MINB = 1> Impl<T> cr(const char *name) {
    Impl<T> i{name, cross<T, D, W, A, QB, MINB>, D, 32 * W, 16 * A, 1};
    i.warps = W;
    i.atoms = A;
    i.qb = QB;
    return i;
}
template <int D, int NWG, int BLOCKS> Impl<__half> wg() {
    constexpr int KC = (D + 15) / 16 * 2, STAGES = D == 40 ? 3 : 4, VCX = D / 8 + (D != 80);
    Impl<__half> i{"wgmma", wgmma<D, NWG, BLOCKS>, D, 128 * NWG, 64 * NWG, 0};
    i.smem_fixed = STAGES * 64 * (KC + VCX) * 16 + (D == 80 ? NWG * 64 * KC * 16 : 0);
    return i;
}
Impl<__half> sp160() {
    Impl<__half> i{"split160", split160, 160, 256, 32, 0};
    i.smem_fixed = 4 * 128 * 168 * 2 > 2 * 128 * 168 * 2 + 32 * 168 * 2 ? 4 * 128 * 168 * 2 : 0;
    i.smem_fixed = std::max(i.smem_fixed, 3 * 32 / 16 * 21 * 512);
    return i;
}

static std::vector<Impl<__half>> impls = {
    wg<40, 2, 2>(),
    cr<__half, 40, 4, 1, 2>("x40 w4 a1 q2"),
    cr<__half, 40, 4, 1, 3>("x40 w4 a1 q3"),
    cr<__half, 40, 4, 2, 2, 2>("x40 w4 a2 q2 *"),
    cr<__half, 40, 8, 1, 2>("x40 w8 a1 q2"),
    cr<__half, 40, 8, 2, 2>("x40 w8 a2 q2"),
    cr<__half, 40, 4, 1, 2, 5>("x40 w4 a1 q2 b5"),
    wg<64, 3, 1>(),
    cr<__half, 64, 4, 1, 2, 3>("x64 w4 a1 q2 *"),
    cr<__half, 64, 4, 1, 3>("x64 w4 a1 q3"),
    cr<__half, 64, 4, 2, 2>("x64 w4 a2 q2"),
    cr<__half, 64, 8, 1, 2>("x64 w8 a1 q2"),
    cr<__half, 64, 8, 2, 2>("x64 w8 a2 q2"),
    wg<80, 2, 2>(),
    cr<__half, 80, 4, 1, 2>("x80 w4 a1 q2"),
    cr<__half, 80, 4, 2, 2>("x80 w4 a2 q2"),
    cr<__half, 80, 8, 1, 2>("x80 w8 a1 q2 *"),
    cr<__half, 80, 2, 1, 2>("x80 w2 a1 q2"),
    sp160(),
    cr<__half, 160, 4, 1, 2, 2>("x160 w4 a1 q2 *"),
    cr<__half, 160, 8, 1, 2>("x160 w8 a1 q2"),
    cr<__half, 160, 2, 1, 2>("x160 w2 a1 q2"),
};
// attention.cu's instantiations (CROSS_BOTH; * above), f16 and bf16, for the correctness pass.
template <typename T> std::vector<Impl<T>> chosen() {
    return {cr<T, 40, 4, 2, 2, 2>("x40"), cr<T, 64, 4, 1, 2, 3>("x64"), cr<T, 80, 8, 1, 2, 1>("x80"),
            cr<T, 160, 4, 1, 2, 2>("x160")};
}

template <typename T> __device__ float tof(T x) { return (float)x; }
template <> __device__ float tof(__half x) { return __half2float(x); }
template <> __device__ float tof(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __host__ float htof(T x);
template <> __host__ float htof(__half x) { return __half2float(x); }
template <> __host__ float htof(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __global__ void fill(T *p, size_t n, unsigned seed) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) {
        unsigned x = (unsigned)i * 2654435761u ^ seed;
        x ^= x >> 13;
        x *= 0x5bd1e995;
        x ^= x >> 15;
        p[i] = T(((x & 0xffff) / 65535.f - 0.5f) * 4.f);
    }
}
// fp32 reference, the kernels' strides, output contiguous (B, Sq, H·D); two passes over the keys.
template <typename T>
__global__ void naive(const T *q, const T *k, const T *v, float *o, int sq, int sk, int heads, int d, long long q_bs,
                      long long q_ss, long long k_bs, long long k_ss, long long v_bs, long long v_ss, float scale) {
    int r = blockIdx.x * blockDim.x + threadIdx.x, h = blockIdx.y, b = blockIdx.z;
    if (r >= sq) return;
    const T *qr = q + b * q_bs + r * q_ss + h * d;
    float m = -1e30f;
    for (int j = 0; j < sk; ++j) {
        const T *kr = k + b * k_bs + j * k_ss + h * d;
        float s = 0;
        for (int c = 0; c < d; ++c) s += tof(qr[c]) * tof(kr[c]);
        m = fmaxf(m, s * scale);
    }
    float acc[160];
    for (int c = 0; c < d; ++c) acc[c] = 0;
    float l = 0;
    for (int j = 0; j < sk; ++j) {
        const T *kr = k + b * k_bs + j * k_ss + h * d, *vr = v + b * v_bs + j * v_ss + h * d;
        float s = 0;
        for (int c = 0; c < d; ++c) s += tof(qr[c]) * tof(kr[c]);
        float p = expf(s * scale - m);
        l += p;
        for (int c = 0; c < d; ++c) acc[c] += p * tof(vr[c]);
    }
    float *orow = o + (b * (long long)sq + r) * heads * d + h * d;
    for (int c = 0; c < d; ++c) orow[c] = acc[c] / l;
}

static bool check(const char *what) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) printf("  %s: CUDA error: %s\n", what, cudaGetErrorString(e));
    return e == cudaSuccess;
}

struct Shape { const char *what; int b, sq, sk, h, d; bool packed; };

template <typename T> struct Bufs {
    Shape s;
    T *q, *kv, *o, *k, *v;
    long long hs, q_ss, kv_ss, q_bs, kv_bs;
    size_t nq;
    std::vector<float> exact;
    Bufs(const Shape &s_) : s(s_) {
        hs = (long long)s.h * s.d;
        q_ss = s.packed ? 2 * hs : hs;
        kv_ss = 2 * hs;
        q_bs = s.sq * q_ss;
        kv_bs = s.sk * kv_ss;
        nq = (size_t)s.b * s.sq * hs;
        const size_t nqa = (size_t)s.b * s.sq * q_ss, nkv = (size_t)s.b * s.sk * kv_ss;
        cudaMalloc(&q, nqa * sizeof(T));
        cudaMalloc(&kv, nkv * sizeof(T));
        cudaMalloc(&o, nq * sizeof(T));
        fill<T><<<(nqa + 255) / 256, 256>>>(q, nqa, 1);
        fill<T><<<(nkv + 255) / 256, 256>>>(kv, nkv, 2);
        k = kv;
        v = kv + hs;
        float *of;
        cudaMalloc(&of, nq * 4);
        naive<T><<<dim3((s.sq + 127) / 128, s.h, s.b), 128>>>(q, k, v, of, s.sq, s.sk, s.h, s.d, q_bs, q_ss, kv_bs,
                                                              kv_ss, kv_bs, kv_ss, 1.f / sqrtf((float)s.d));
        check("reference");
        exact.resize(nq);
        cudaMemcpy(exact.data(), of, nq * 4, cudaMemcpyDeviceToHost);
        cudaFree(of);
    }
    ~Bufs() {
        cudaFree(q);
        cudaFree(kv);
        cudaFree(o);
    }
};

struct Res { bool ok; double us, max_err, mean_err; int gx; };

// gx: blocks per (batch, head) for cross_attention.
template <typename T> Res measure(Bufs<T> &B, const Impl<T> &k_, int gx, bool timed) {
    const Shape &s = B.s;
    Res r{false, 0, 0, 0, gx};
    const float scale_log2 = 1.f / sqrtf((float)s.d) * 1.4426950408889634f;
    const int smem = k_.smem(s.sk);
    cudaFuncSetAttribute(k_.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const dim3 grid(k_.kind == 0 ? (s.sq + k_.rows - 1) / k_.rows : gx, s.h, s.b);
    auto launch = [&](cudaStream_t st) {
        k_.fn<<<grid, k_.threads, smem, st>>>(B.q, B.k, B.v, B.o, s.sq, s.sk, s.d, s.h, B.q_bs, B.q_ss, B.kv_bs,
                                              B.kv_ss, B.kv_bs, B.kv_ss, scale_log2);
    };
    cudaMemset(B.o, 0xff, B.nq * sizeof(T));
    launch(0);
    if (!check(k_.name)) return r;
    std::vector<T> got(B.nq);
    cudaMemcpy(got.data(), B.o, B.nq * sizeof(T), cudaMemcpyDeviceToHost);
    double sum = 0;
    for (size_t i = 0; i < B.nq; ++i) {
        double e = fabs((double)htof(got[i]) - B.exact[i]);
        if (!(e <= 1e30)) e = INFINITY;
        r.max_err = fmax(r.max_err, e);
        sum += e;
    }
    r.mean_err = sum / B.nq;
    if (timed) {
        cudaStream_t st;
        cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
        cudaGraph_t gph;
        cudaGraphExec_t ex;
        const int reps = 50;
        cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal);
        for (int i = 0; i < reps; ++i) launch(st);
        cudaStreamEndCapture(st, &gph);
        cudaGraphInstantiate(&ex, gph, 0);
        cudaGraphLaunch(ex, st);
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        cudaEventRecord(e0, st);
        for (int i = 0; i < 5; ++i) cudaGraphLaunch(ex, st);
        cudaEventRecord(e1, st);
        cudaEventSynchronize(e1);
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        r.us = ms * 1e3 / (5 * reps);
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
        cudaGraphExecDestroy(ex);
        cudaGraphDestroy(gph);
        cudaStreamDestroy(st);
    }
    r.ok = check(k_.name);
    return r;
}

// attention.rs's grid rule for cross_attention: as few chunks per warp as the resident warps (`occ` blocks per SM)
// allow, then as many blocks per (batch, head) as give each warp that many.
static int fill_gx(const Shape &s, int occ, int warps, int atoms) {
    const int chunks = (s.sq + 16 * atoms - 1) / (16 * atoms), slots = sms * occ * warps;
    const long long total = (long long)chunks * s.b * s.h;
    const int cpw = std::max(1LL, (total + slots - 1) / slots);
    return (chunks + warps * cpw - 1) / (warps * cpw);
}

template <typename T> int occupancy(const Impl<T> &k_, int sk) {
    int nb = 0, smem = k_.smem(sk);
    cudaFuncSetAttribute(k_.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, k_.fn, k_.threads, smem);
    return nb;
}

template <typename T> void correctness(const char *tname) {
    const Shape shapes[] = {
        {"ragged", 1, 1000, 50, 3, 0, false}, {"ragged", 2, 333, 128, 2, 0, true}, {"one key", 1, 77, 1, 2, 0, false},
        {"ragged", 2, 100, 17, 3, 0, true},   {"sk 113", 1, 517, 113, 2, 0, false}, {"sk 96", 1, 40, 96, 5, 0, true},
        {"cross", 2, 4096, 77, 8, 0, true},
    };
    for (auto &k_ : chosen<T>()) {
        for (Shape s : shapes) {
            s.d = k_.d;
            Bufs<T> B(s);
            const int occ = occupancy(k_, s.sk);
            for (int gx : {1, 3, fill_gx(s, occ, k_.warps, k_.atoms), 1 << 20}) {
                Res r = measure(B, k_, gx, false);
                printf("%s %-5s %-8s B %d Sq %4d Sk %3d H %d D %3d%s gx %7d: err max %.2e mean %.2e%s\n", tname,
                       k_.name, s.what, s.b, s.sq, s.sk, s.h, s.d, s.packed ? " packed" : "       ", gx, r.max_err,
                       r.mean_err, r.ok ? "" : " CUDA ERROR");
            }
        }
    }
}

int main() {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    for (auto &k_ : impls) {
        cudaFuncAttributes at;
        cudaFuncGetAttributes(&at, k_.fn);
        printf("%-18s regs %3d spill %3zu B  smem(77) %6d  blocks/SM %d\n", k_.name, at.numRegs, at.localSizeBytes,
               k_.smem(77), occupancy(k_, 77));
    }
    for (auto &k_ : chosen<__nv_bfloat16>()) {
        cudaFuncAttributes at;
        cudaFuncGetAttributes(&at, k_.fn);
        printf("bf16 %-13s regs %3d spill %3zu B  blocks/SM %d\n", k_.name, at.numRegs, at.localSizeBytes,
               occupancy(k_, 77));
    }
    if (!check("setup")) return 1;
    const Shape shapes[] = {
        {"sd15 64x64", 2, 4096, 77, 8, 40, false},  {"sd15 32x32", 2, 1024, 77, 8, 80, false},
        {"sd15 16x16", 2, 256, 77, 8, 160, false},  {"sd15 8x8", 2, 64, 77, 8, 160, false},
        {"sdxl 64x64", 2, 4096, 77, 10, 64, false}, {"sdxl 32x32", 2, 1024, 77, 20, 64, false},
        {"128 keys", 2, 4096, 128, 8, 40, false},   {"128 keys", 2, 1024, 128, 8, 80, false},
        {"128 keys", 2, 256, 128, 8, 160, false},   {"128 keys", 2, 4096, 128, 10, 64, false},
    };
    for (int pass = 0; pass < 2; ++pass)
        for (auto &s : shapes) {
            Bufs<__half> B(s);
            printf("== %s (%d, %d, %d, %d, %d) pass %d\n", s.what, s.b, s.sq, s.sk, s.h, s.d, pass);
            for (auto &k_ : impls) {
                if (k_.d != s.d) continue;
                if (k_.kind == 0) {
                    Res r = measure(B, k_, 0, true);
                    printf("  %-18s            %7.2f us  err max %.2e mean %.2e%s\n", k_.name, r.us, r.max_err,
                           r.mean_err, r.ok ? "" : " CUDA ERROR");
                    continue;
                }
                const int chunks = (s.sq + 16 * k_.atoms - 1) / (16 * k_.atoms), occ = occupancy(k_, s.sk);
                const int fx = fill_gx(s, occ, k_.warps, k_.atoms);
                printf("  %-18s", k_.name);
                for (int cpw : {1, 2, 3, 4, 0}) {
                    const int gx = cpw ? std::max(1, (chunks + k_.warps * cpw - 1) / (k_.warps * cpw)) : fx;
                    Res r = measure(B, k_, gx, true);
                    printf(" | %s%d %6.2f", cpw ? "c" : "rule", cpw ? cpw : gx, r.us);
                    if (!r.ok || r.max_err > 0.05) printf(" ERR %.2e", r.max_err);
                }
                Res r = measure(B, k_, fx, false);
                printf(" | err max %.2e mean %.2e\n", r.max_err, r.mean_err);
            }
        }
    correctness<__half>("f16 ");
    correctness<__nv_bfloat16>("bf16");
    return 0;
}
