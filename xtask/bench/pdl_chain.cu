// What a kernel boundary costs inside a CUDA graph, and what programmatic dependent launch (PDL) takes off it: 400
// dependent launches of a small copy kernel captured in one graph, per kernel, at four grid sizes, with the PDL
// attribute off (mode 0) and on, the dependent waiting with griddepcontrol.wait first thing (1), also triggering its
// own dependents right after (2) or at its end (3). Not part of the build: the figures in docs/benchmarks.md.
// Build here, run on the GPU machine: nvcc -O3 -arch=sm_90 xtask/bench/pdl_chain.cu -o pdl_chain && ./pdl_chain
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
__global__ void work(const float4 *a, float4 *b, int n, int mode, int reps) {
    if (mode >= 1) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (mode == 2) asm volatile("griddepcontrol.launch_dependents;");
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float4 v = a[i];
        for (int r = 0; r < reps; ++r) { v.x = v.x * 1.0001f + 0.5f; v.y += v.x; v.z += v.y; v.w += v.z; }
        b[i] = v;
    }
    if (mode == 3) asm volatile("griddepcontrol.launch_dependents;");
}
int main() {
    const int N = 400;
    float4 *x, *y;
    size_t maxn = 8192 * 320 / 4 * 2;
    CK(cudaMalloc(&x, maxn * 16)); CK(cudaMalloc(&y, maxn * 16));
    cudaMemset(x, 0, maxn * 16); cudaMemset(y, 0, maxn * 16);
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int shapes[][3] = {{132, 256, 132 * 256}, {64, 512, 64 * 512 * 4}, {528, 256, 528 * 256 * 2}, {1024, 256, (int)maxn}};
    for (auto &sh : shapes) for (int reps : {1, 16}) for (int mode = 0; mode < 4; ++mode) {
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        for (int i = 0; i < N; ++i) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = sh[0]; cfg.blockDim = sh[1]; cfg.stream = s;
            cudaLaunchAttribute at[1];
            at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            at[0].val.programmaticStreamSerializationAllowed = 1;
            cfg.attrs = at; cfg.numAttrs = mode >= 1 ? 1 : 0;
            const float4 *a = (i & 1) ? y : x; float4 *b = (i & 1) ? x : y;
            CK(cudaLaunchKernelEx(&cfg, work, a, b, sh[2], mode, reps));
        }
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        for (int w = 0; w < 3; ++w) CK(cudaGraphLaunch(ge, s));
        cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
        float best = 1e9;
        for (int it = 0; it < 10; ++it) {
            cudaEventRecord(e0, s); CK(cudaGraphLaunch(ge, s)); cudaEventRecord(e1, s); cudaEventSynchronize(e1);
            float ms; cudaEventElapsedTime(&ms, e0, e1); if (ms < best) best = ms;
        }
        printf("grid %5d x %4d n %8d reps %2d mode %d: %.3f us/kernel\n", sh[0], sh[1], sh[2], reps, mode, best * 1000 / N);
        cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
    }
    return 0;
}
