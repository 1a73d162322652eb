// cuDNN 9 backend (graph) API for the UNets' 3x3 convolutions (stride 1, pad 1, channels-last f16, f32 compute):
// per shape and per graph variant (plain conv / conv + per-channel bias / conv + bias + residual), query engine
// configs with heuristics modes A, B and FALLBACK, enumerate engines by global index (with knob sweeps), finalize
// every plan that will, check its output against the legacy API, and time it the way xtask/bench/conv_gemm.cu
// does (a CUDA graph of 20 calls, best of 5 launches). Compared with the legacy API as the server drives it.
//
// Build: C=~/.cache/sdhive-cuda-13.0/prefix/nvidia (the toolchain `cargo xtask build-cuda` caches; its nvcc on PATH)
//        nvcc -O2 -std=c++17 -arch=sm_90 -I$C/cudnn/include xtask/bench/conv_engines.cu -o conv_engines -L$C/cudnn/lib -l:libcudnn.so.9
// Args:  [-s i,j,..] shape indices   [-v pbr] variants   [-e 0|1] engine enumeration   [-k N] knob-product cap
//        [-b S] enumeration time budget per shape+variant (s)   [-r N] max runtime-compiled finalizations per shape+variant
//        [-E pbr] variants to enumerate engines for   [-n S] hill-climb budget per shape+variant (s)   [-N pbr] its variants   [-q N] runtime-compiled cap for variants p and b (-r is for r)
//          [-l] list every timed plan   [-d S] global deadline (s): after it only heuristic mode A is tried
#include <cudnn.h>
#include <cuda_fp16.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <string>
#include <map>
#include <set>
#include <memory>
#include <functional>
#include <algorithm>
#include <chrono>
#include <stdexcept>

#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

#define CK(x) do { auto e_ = (x); if ((int)e_ != 0) { printf("%s failed %d line %d\n", #x, (int)e_, __LINE__); fflush(stdout); exit(1); } } while (0)

static double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// ---------------------------------------------------------------- backend descriptor helpers
using Desc = std::shared_ptr<void>;
static Desc make(cudnnBackendDescriptorType_t t) {
    cudnnBackendDescriptor_t d = nullptr;
    CK(cudnnBackendCreateDescriptor(t, &d));
    return Desc(d, [](void *p) { cudnnBackendDestroyDescriptor(p); });
}
static void set(const Desc &d, cudnnBackendAttributeName_t n, cudnnBackendAttributeType_t t, int64_t cnt, const void *v) {
    cudnnStatus_t s = cudnnBackendSetAttribute(d.get(), n, t, cnt, v);
    if (s) { char b[200]; snprintf(b, sizeof b, "SetAttribute(%d) failed %d (%s)", (int)n, (int)s, cudnnGetErrorString(s)); throw std::runtime_error(b); }
}
static void set_desc(const Desc &d, cudnnBackendAttributeName_t n, const Desc &v) {
    void *p = v.get();
    set(d, n, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &p);
}
static void fin(const Desc &d, const char *what) {
    cudnnStatus_t s = cudnnBackendFinalize(d.get());
    if (s) { char b[200]; snprintf(b, sizeof b, "Finalize(%s) failed %d (%s)", what, (int)s, cudnnGetErrorString(s)); throw std::runtime_error(b); }
}

static const char *knob_name(int t) {
    static const char *n[] = {"SPLIT_K", "SWIZZLE", "TILE_SIZE", "USE_TEX", "EDGE", "KBLOCK", "LDGA", "LDGB", "CHUNK_K",
                              "SPLIT_H", "WINO_TILE", "MULTIPLY", "SPLIT_K_BUF", "TILEK", "STAGES", "REDUCTION_MODE",
                              "CTA_SPLIT_K_MODE", "SPLIT_K_SLC", "IDX_MODE", "SLICED", "SPLIT_RS", "SINGLEBUFFER", "LDGC",
                              "SPECFILT", "KERNEL_CFG", "WORKSPACE", "TILE_CGA", "TILE_CGA_M", "TILE_CGA_N", "BLOCK_SIZE",
                              "OCCUPANCY", "ARRAY_SIZE_PER_THREAD", "NUM_C_PER_BLOCK", "SPLIT_COLS", "TILE_ROWS", "TILE_COLS",
                              "LOAD_SIZE", "CTA_COUNT", "STREAM_K", "SPLIT_P_SLC", "TILE_M", "TILE_N", "WARP_SPEC_CFG",
                              "SWAP_AB", "INPUT_TMA_ENABLE", "OUTPUT_TMA_ENABLE"};
    return t >= 0 && t < (int)(sizeof n / sizeof *n) ? n[t] : "?";
}

// NHWC tensor described in NCHW dimension order with channels-last strides.
static Desc tensor(int64_t uid, cudnnDataType_t dt, int64_t n, int64_t c, int64_t h, int64_t w, bool virt) {
    Desc t = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    int64_t dims[4] = {n, c, h, w}, str[4] = {h * w * c, 1, w * c, c}, align = 16;
    set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
    set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims);
    set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, str);
    bool v = virt;
    set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &v);
    fin(t, "tensor");
    return t;
}

static Desc pointwise_add(const Desc &x, const Desc &b, const Desc &y, std::vector<Desc> &keep) {
    Desc pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    cudnnPointwiseMode_t mode = CUDNN_POINTWISE_ADD;
    cudnnDataType_t prec = CUDNN_DATA_FLOAT;
    set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    fin(pw, "pointwise");
    Desc op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    fin(op, "pointwise op");
    keep.push_back(pw);
    return op;
}

enum { UID_X = 1, UID_W = 2, UID_Y = 3, UID_CONV = 4, UID_BIAS = 5, UID_SUM = 6, UID_RES = 7, UID_SUM2 = 8 };

// ReLU with lower clip -3e38: the identity on finite values, to match "conv + add(s) + activation" patterns.
static Desc pointwise_relu_identity(const Desc &x, const Desc &y, std::vector<Desc> &keep) {
    Desc pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    cudnnPointwiseMode_t mode = CUDNN_POINTWISE_RELU_FWD;
    cudnnDataType_t prec = CUDNN_DATA_FLOAT;
    double clip = -3.0e38;
    set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    set(pw, CUDNN_ATTR_POINTWISE_RELU_LOWER_CLIP, CUDNN_TYPE_DOUBLE, 1, &clip);
    fin(pw, "relu");
    Desc op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    fin(op, "relu op");
    keep.push_back(pw);
    return op;
}
static bool has_bias(char v) { return v != 'p'; }
static bool has_res(char v) { return v == 'r' || v == 'z' || v == 'i'; }
static const char *variant_name(char v) {
    switch (v) {
    case 'p': return "conv";
    case 'b': return "conv+bias";
    case 'r': return "conv+bias+res";
    case 'z': return "conv+res+bias";
    case 'i': return "conv+res+bias+idrelu";
    case 'a': return "conv+bias+idrelu";
    }
    return "?";
}

struct Graph { Desc graph; std::vector<Desc> keep; int64_t engines = 0; };

// variant 'p': y = conv(x, w); 'b': y = conv(x, w) + bias[k]; 'r': y = (conv(x, w) + bias[k]) + res;
// 'z': y = (conv + res) + bias; 'i': y = relu_clip(-3e38)((conv + res) + bias); 'a': y = relu_clip(-3e38)(conv + bias)
static Graph build_graph(cudnnHandle_t h, int n, int hw, int c, int k, char variant) {
    Graph g;
    Desc x = tensor(UID_X, CUDNN_DATA_HALF, n, c, hw, hw, false);
    Desc w = tensor(UID_W, CUDNN_DATA_HALF, k, c, 3, 3, false);  // KRSC: dims K,C,R,S with strides RSC,1,SC,C
    Desc y = tensor(UID_Y, CUDNN_DATA_HALF, n, k, hw, hw, false);
    Desc conv_out = variant == 'p' ? y : tensor(UID_CONV, CUDNN_DATA_FLOAT, n, k, hw, hw, true);
    g.keep = {x, w, y, conv_out};

    Desc cd = make(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
    cudnnDataType_t ct = CUDNN_DATA_FLOAT;
    cudnnConvolutionMode_t cm = CUDNN_CROSS_CORRELATION;
    int64_t sd = 2, one[2] = {1, 1}, pad[2] = {1, 1};
    set(cd, CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &ct);
    set(cd, CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &cm);
    set(cd, CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &sd);
    set(cd, CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, 2, one);
    set(cd, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, 2, one);
    set(cd, CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, 2, pad);
    set(cd, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, 2, pad);
    fin(cd, "conv desc");
    g.keep.push_back(cd);

    Desc op = make(CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR);
    float alpha = 1.f, beta = 0.f;
    set_desc(op, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, x);
    set_desc(op, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, w);
    set_desc(op, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, conv_out);
    set_desc(op, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, cd);
    set(op, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_TYPE_FLOAT, 1, &alpha);
    set(op, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, CUDNN_TYPE_FLOAT, 1, &beta);
    fin(op, "conv op");
    std::vector<Desc> ops = {op};
    if (variant == 'z' || variant == 'i' || variant == 'a') {
        Desc bias = tensor(UID_BIAS, CUDNN_DATA_HALF, 1, k, 1, 1, false);
        Desc sum = tensor(UID_SUM, CUDNN_DATA_FLOAT, n, k, hw, hw, true);
        g.keep.push_back(bias); g.keep.push_back(sum);
        if (variant == 'a') {
            ops.push_back(pointwise_add(conv_out, bias, sum, g.keep));
            ops.push_back(pointwise_relu_identity(sum, y, g.keep));
        } else {
            Desc res = tensor(UID_RES, CUDNN_DATA_HALF, n, k, hw, hw, false);
            g.keep.push_back(res);
            ops.push_back(pointwise_add(conv_out, res, sum, g.keep));
            if (variant == 'z') {
                ops.push_back(pointwise_add(sum, bias, y, g.keep));
            } else {
                Desc sum2 = tensor(UID_SUM2, CUDNN_DATA_FLOAT, n, k, hw, hw, true);
                g.keep.push_back(sum2);
                ops.push_back(pointwise_add(sum, bias, sum2, g.keep));
                ops.push_back(pointwise_relu_identity(sum2, y, g.keep));
            }
        }
    } else if (variant != 'p') {
        Desc bias = tensor(UID_BIAS, CUDNN_DATA_HALF, 1, k, 1, 1, false);
        g.keep.push_back(bias);
        if (variant == 'b') {
            ops.push_back(pointwise_add(conv_out, bias, y, g.keep));
        } else {
            Desc sum = tensor(UID_SUM, CUDNN_DATA_FLOAT, n, k, hw, hw, true);
            Desc res = tensor(UID_RES, CUDNN_DATA_HALF, n, k, hw, hw, false);
            g.keep.push_back(sum); g.keep.push_back(res);
            ops.push_back(pointwise_add(conv_out, bias, sum, g.keep));
            ops.push_back(pointwise_add(sum, res, y, g.keep));
        }
    }
    g.graph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    set(g.graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
    std::vector<void *> raw;
    for (auto &o : ops) raw.push_back(o.get());
    set(g.graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, (int64_t)raw.size(), raw.data());
    fin(g.graph, "operation graph");
    for (auto &o : ops) g.keep.push_back(o);
    int64_t cnt = 0;
    CK(cudnnBackendGetAttribute(g.graph.get(), CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT, CUDNN_TYPE_INT64, 1, &cnt, &g.engines));
    return g;
}

// ---------------------------------------------------------------- engine configs
using Knobs = std::vector<std::pair<int, int64_t>>;  // (knob type, value), sorted by type
struct Cfg {
    Desc cfg;
    int64_t engine = -1;
    Knobs knobs;
    bool rtc = false;
    std::string src;  // "A3" = heuristic mode A rank 3, "B0", "F1", "E" = enumerated, "N" = neighbour of a timed config
    std::string key() const {
        std::string s = std::to_string(engine) + ":";
        for (auto &kv : knobs) s += std::to_string(kv.first) + "=" + std::to_string(kv.second) + ",";
        return s;
    }
    std::string knob_str() const {
        std::string s;
        for (auto &kv : knobs) s += std::string(s.empty() ? "" : " ") + knob_name(kv.first) + "=" + std::to_string(kv.second);
        return s.empty() ? "-" : s;
    }
};

static bool engine_is_rtc(const Desc &eng) {
    cudnnBackendBehaviorNote_t notes[16]; int64_t n = 0;
    if (cudnnBackendGetAttribute(eng.get(), CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, CUDNN_TYPE_BEHAVIOR_NOTE, 16, &n, notes)) return false;
    for (int i = 0; i < n; ++i) if (notes[i] == CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION) return true;
    return false;
}

static void describe_cfg(Cfg &c) {
    Desc eng = make(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    void *ep = eng.get(); int64_t n = 0;
    CK(cudnnBackendGetAttribute(c.cfg.get(), CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &ep));
    CK(cudnnBackendGetAttribute(eng.get(), CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &c.engine));
    c.rtc = engine_is_rtc(eng);
    std::vector<Desc> kc; std::vector<void *> raw;
    for (int i = 0; i < CUDNN_KNOB_TYPE_COUNTS; ++i) { kc.push_back(make(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR)); raw.push_back(kc.back().get()); }
    int64_t nk = 0;
    CK(cudnnBackendGetAttribute(c.cfg.get(), CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR, CUDNN_KNOB_TYPE_COUNTS, &nk, raw.data()));
    c.knobs.clear();
    for (int i = 0; i < nk; ++i) {
        cudnnBackendKnobType_t t; int64_t v = 0, m = 0;
        CK(cudnnBackendGetAttribute(raw[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &m, &t));
        CK(cudnnBackendGetAttribute(raw[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, 1, &m, &v));
        c.knobs.push_back({(int)t, v});
    }
    std::sort(c.knobs.begin(), c.knobs.end());
}

static std::vector<Cfg> heuristic_cfgs(const Graph &g, cudnnBackendHeurMode_t mode, const char *tag, double *secs) {
    std::vector<Cfg> out;
    double t0 = now_s();
    Desc heur = make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    set_desc(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, g.graph);
    set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    cudnnStatus_t s = cudnnBackendFinalize(heur.get());
    if (s) { printf("    heuristics %s: finalize failed %d (%s)\n", tag, (int)s, cudnnGetErrorString(s)); return out; }
    int64_t count = 0;
    s = cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
    if (s || count <= 0) { if (secs) *secs = now_s() - t0; return out; }
    std::vector<Desc> cfgs; std::vector<void *> raw;
    for (int64_t i = 0; i < count; ++i) { cfgs.push_back(make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)); raw.push_back(cfgs.back().get()); }
    int64_t got = 0;
    s = cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, raw.data());
    if (s) { printf("    heuristics %s: results failed %d\n", tag, (int)s); return out; }
    if (secs) *secs = now_s() - t0;
    for (int64_t i = 0; i < got; ++i) {
        Cfg c; c.cfg = cfgs[i]; c.src = std::string(tag) + std::to_string(i);
        describe_cfg(c);
        out.push_back(c);
    }
    return out;
}

struct KnobInfo { int type; int64_t mn, mx, stride; };
// Values to try for a knob around cur: all of them when there are at most 64, else the ends, powers of two,
// and cur's neighbours, halves and doubles.
static std::vector<int64_t> knob_values(const KnobInfo &k, int64_t cur) {
    int64_t stp = k.stride > 0 ? k.stride : 1;
    std::set<int64_t> v;
    if ((k.mx - k.mn) / stp + 1 <= 64) {
        for (int64_t q = k.mn; q <= k.mx; q += stp) v.insert(q);
    } else {
        v.insert(k.mn); v.insert(k.mx);
        for (int64_t p = 1; p <= k.mx; p *= 2) if (p >= k.mn) v.insert(p);
        for (int64_t c : {cur - 2 * stp, cur - stp, cur + stp, cur + 2 * stp, cur / 2, cur * 2, cur * 3 / 2, cur * 3 / 4})
            if (c >= k.mn && c <= k.mx) v.insert(c);
    }
    return std::vector<int64_t>(v.begin(), v.end());
}
static bool engine_by_index(const Graph &g, int64_t idx, Desc &eng, std::vector<KnobInfo> &ki, bool &rtc) {
    eng = make(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    set_desc(eng, CUDNN_ATTR_ENGINE_OPERATION_GRAPH, g.graph);
    set(eng, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &idx);
    if (cudnnBackendFinalize(eng.get())) return false;
    rtc = engine_is_rtc(eng);
    std::vector<Desc> kd; std::vector<void *> raw;
    for (int i = 0; i < CUDNN_KNOB_TYPE_COUNTS; ++i) { kd.push_back(make(CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR)); raw.push_back(kd.back().get()); }
    int64_t nk = 0;
    if (cudnnBackendGetAttribute(eng.get(), CUDNN_ATTR_ENGINE_KNOB_INFO, CUDNN_TYPE_BACKEND_DESCRIPTOR, CUDNN_KNOB_TYPE_COUNTS, &nk, raw.data())) nk = 0;
    ki.clear();
    for (int i = 0; i < nk; ++i) {
        KnobInfo k; cudnnBackendKnobType_t t; int64_t m;
        CK(cudnnBackendGetAttribute(raw[i], CUDNN_ATTR_KNOB_INFO_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &m, &t));
        CK(cudnnBackendGetAttribute(raw[i], CUDNN_ATTR_KNOB_INFO_MINIMUM_VALUE, CUDNN_TYPE_INT64, 1, &m, &k.mn));
        CK(cudnnBackendGetAttribute(raw[i], CUDNN_ATTR_KNOB_INFO_MAXIMUM_VALUE, CUDNN_TYPE_INT64, 1, &m, &k.mx));
        CK(cudnnBackendGetAttribute(raw[i], CUDNN_ATTR_KNOB_INFO_STRIDE, CUDNN_TYPE_INT64, 1, &m, &k.stride));
        k.type = (int)t;
        ki.push_back(k);
    }
    return true;
}

// An engine config from an engine descriptor and explicit knob choices (empty = the engine's defaults).
static bool make_cfg_(const Desc &eng, const Knobs &knobs, Desc &cfg);
static bool make_cfg(const Desc &eng, const Knobs &knobs, Desc &cfg) {
    try { return make_cfg_(eng, knobs, cfg); } catch (std::exception &) { return false; }
}
static bool make_cfg_(const Desc &eng, const Knobs &knobs, Desc &cfg) {
    std::vector<Desc> kc; std::vector<void *> raw;
    for (auto &kv : knobs) {
        Desc d = make(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR);
        cudnnBackendKnobType_t t = (cudnnBackendKnobType_t)kv.first; int64_t v = kv.second;
        set(d, CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &t);
        set(d, CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, 1, &v);
        if (cudnnBackendFinalize(d.get())) return false;
        kc.push_back(d); raw.push_back(d.get());
    }
    cfg = make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    set_desc(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, eng);
    if (!raw.empty()) set(cfg, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR, (int64_t)raw.size(), raw.data());
    return cudnnBackendFinalize(cfg.get()) == CUDNN_STATUS_SUCCESS;
}

// ---------------------------------------------------------------- device helpers
__global__ void fill(__half *p, long long n, unsigned seed, float scale) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 16; h *= 0x7feb352d; h ^= h >> 15; h *= 0x846ca68b; h ^= h >> 16;
    p[i] = __float2half(((h & 0xffffff) / 16777216.f * 2.f - 1.f) * scale);
}
// max |y - (ref + bias[c] + res)| (NaN counts as 1e30) and max |expected|, as non-negative float bits.
__global__ void check(const __half *y, const __half *ref, const __half *bias, const __half *res, long long n, int k, unsigned *out) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float e = __half2float(ref[i]);
    if (bias) e += __half2float(bias[i % k]);
    if (res) e += __half2float(res[i]);
    float d = fabsf(__half2float(y[i]) - e);
    if (!(d <= 1e30f)) d = 1e30f;
    atomicMax(out, __float_as_uint(d));
    atomicMax(out + 1, __float_as_uint(fabsf(e)));
}

// A CUDA graph of 20 calls, best of 5 launches, in us per call; < 0 when the calls fail or cannot be captured.
static float time_graph(cudaStream_t st, const std::function<bool()> &f) {
    cudaGraph_t g; cudaGraphExec_t ge;
    if (cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal)) { cudaGetLastError(); return -1; }
    bool ok = true;
    for (int i = 0; i < 20 && ok; ++i) ok = f();
    cudaError_t e = cudaStreamEndCapture(st, &g);
    if (!ok || e) { if (!e) cudaGraphDestroy(g); cudaGetLastError(); return -2; }
    if (cudaGraphInstantiate(&ge, g, 0)) { cudaGraphDestroy(g); cudaGetLastError(); return -3; }
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    cudaGraphLaunch(ge, st); cudaStreamSynchronize(st);
    float best = 1e9;
    for (int r = 0; r < 5; ++r) {
        cudaEventRecord(e0, st); cudaGraphLaunch(ge, st); cudaEventRecord(e1, st); cudaEventSynchronize(e1);
        float ms; cudaEventElapsedTime(&ms, e0, e1); best = std::min(best, ms);
    }
    cudaEventDestroy(e0); cudaEventDestroy(e1);
    cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
    if (cudaGetLastError()) return -4;
    return best * 1000 / 20;
}

// Without a graph: 20 calls between events, best of 5 (for plans that cannot be captured).
static float time_loop(cudaStream_t st, const std::function<bool()> &f) {
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    bool ok = f(); cudaStreamSynchronize(st);
    float best = 1e9;
    for (int r = 0; r < 5 && ok; ++r) {
        cudaEventRecord(e0, st);
        for (int i = 0; i < 20 && ok; ++i) ok = f();
        cudaEventRecord(e1, st); cudaEventSynchronize(e1);
        float ms; cudaEventElapsedTime(&ms, e0, e1); best = std::min(best, ms);
    }
    cudaEventDestroy(e0); cudaEventDestroy(e1);
    if (!ok || cudaGetLastError()) return -1;
    return best * 1000 / 20;
}

// ---------------------------------------------------------------- main
struct Result { Cfg c; float us; double fin_ms; int64_t ws; float err; };

int main(int argc, char **argv) {
    struct S { const char *what; int n, hw, c, k, count; } shapes[] = {
        {"sd15 64 320>320", 2, 64, 320, 320, 10}, {"sd15 64 640>320", 2, 64, 640, 320, 2},
        {"sd15 32 320>640", 2, 32, 320, 640, 1}, {"sd15 32 640>640", 2, 32, 640, 640, 8}, {"sd15 32 1280>640", 2, 32, 1280, 640, 1},
        {"sd15 16 640>1280", 2, 16, 640, 1280, 1}, {"sd15 16 1280>1280", 2, 16, 1280, 1280, 8}, {"sd15 16 2560>1280", 2, 16, 2560, 1280, 2},
        {"sd15 8 1280>1280", 2, 8, 1280, 1280, 12}, {"sd15 8 2560>1280", 2, 8, 2560, 1280, 3},
        {"out 320>8", 2, 64, 320, 8, 0}, {"in 8>320", 2, 64, 8, 320, 0}, {"sdxl out 320>8", 2, 128, 320, 8, 0}, {"sdxl in 8>320", 2, 128, 8, 320, 0},
        {"m256 16 1280>1280", 1, 16, 1280, 1280, 0}, {"m256 8 1280>1280", 4, 8, 1280, 1280, 0}, {"m256 8 2560>1280", 4, 8, 2560, 1280, 0}, {"m512 8 1280>1280", 8, 8, 1280, 1280, 0},
        {"m64 8 1280>1280", 1, 8, 1280, 1280, 0}, {"m64 8 2560>1280", 1, 8, 2560, 1280, 0},
        {"sdxl 32 1280>1280", 2, 32, 1280, 1280, 20}, {"sdxl 32 2560>1280", 2, 32, 2560, 1280, 2}, {"sdxl 64 640>640", 2, 64, 640, 640, 8},
    };
    const int nshapes = sizeof shapes / sizeof *shapes;
    std::vector<int> sel; std::string variants = "pbr", enum_variants = "pbr", nb_variants = "pbr"; bool enumerate = false, list = false;
    int knob_cap = 48, rtc_cap = 4, rtc_cap_pb = 0; double enum_budget = 4.0, deadline = 1e9, nb_budget = 1.5;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
        if (a == "-s") { std::string v = next(); for (char *p = strtok(&v[0], ","); p; p = strtok(nullptr, ",")) sel.push_back(atoi(p)); }
        else if (a == "-v") variants = next();
        else if (a == "-E") enum_variants = next();
        else if (a == "-n") nb_budget = atof(next().c_str());
        else if (a == "-N") nb_variants = next();
        else if (a == "-q") rtc_cap_pb = atoi(next().c_str());
        else if (a == "-e") enumerate = atoi(next().c_str()) != 0;
        else if (a == "-k") knob_cap = atoi(next().c_str());
        else if (a == "-r") rtc_cap = atoi(next().c_str());
        else if (a == "-b") enum_budget = atof(next().c_str());
        else if (a == "-d") deadline = atof(next().c_str());
        else if (a == "-l") list = true;
    }
    if (sel.empty()) for (int i = 0; i < nshapes; ++i) sel.push_back(i);
    double t_start = now_s();

    printf("cudnn version %zu (headers %d), cudart %zu\n", cudnnGetVersion(), CUDNN_VERSION, cudnnGetCudartVersion());
    cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0); printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    cudnnHandle_t dn; CK(cudnnCreate(&dn));
    cudaStream_t st; cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    CK(cudnnSetStream(dn, st));
    size_t legacy_ws = 64 << 20, max_ws = 512ull << 20;
    void *ws; CK(cudaMalloc(&ws, max_ws));
    size_t mx = 0, mw = 0, my = 0;
    for (auto &s : shapes) {
        mx = std::max(mx, (size_t)s.n * s.hw * s.hw * s.c); mw = std::max(mw, (size_t)s.k * 9 * s.c); my = std::max(my, (size_t)s.n * s.hw * s.hw * s.k);
    }
    __half *x, *w, *y, *yref, *bias, *res; unsigned *chk;
    CK(cudaMalloc(&x, mx * 2)); CK(cudaMalloc(&w, mw * 2)); CK(cudaMalloc(&y, my * 2)); CK(cudaMalloc(&yref, my * 2));
    CK(cudaMalloc(&res, my * 2)); CK(cudaMalloc(&bias, 4096 * 2)); CK(cudaMalloc(&chk, 8));
    fill<<<(mx + 255) / 256, 256, 0, st>>>(x, mx, 1, 1.f);
    fill<<<(my + 255) / 256, 256, 0, st>>>(res, my, 3, 1.f);
    fill<<<16, 256, 0, st>>>(bias, 4096, 4, 1.f);

    for (int si : sel) {
        if (si < 0 || si >= nshapes) continue;
        const S &s = shapes[si];
        long long m = (long long)s.n * s.hw * s.hw, ny = m * s.k;
        fill<<<(s.k * 9 * s.c + 255) / 256, 256, 0, st>>>(w, (long long)s.k * 9 * s.c, 2 + si, 1.f / sqrtf(9.f * s.c));
        // ---- legacy API, as conv_gemm.cu / the server drive it
        cudnnTensorDescriptor_t xd, yd, bd; cudnnFilterDescriptor_t wd; cudnnConvolutionDescriptor_t cd; cudnnActivationDescriptor_t ad;
        CK(cudnnCreateTensorDescriptor(&xd)); CK(cudnnCreateTensorDescriptor(&yd)); CK(cudnnCreateTensorDescriptor(&bd));
        CK(cudnnCreateFilterDescriptor(&wd)); CK(cudnnCreateConvolutionDescriptor(&cd)); CK(cudnnCreateActivationDescriptor(&ad));
        CK(cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NHWC, CUDNN_DATA_HALF, s.n, s.c, s.hw, s.hw));
        CK(cudnnSetTensor4dDescriptor(yd, CUDNN_TENSOR_NHWC, CUDNN_DATA_HALF, s.n, s.k, s.hw, s.hw));
        CK(cudnnSetTensor4dDescriptor(bd, CUDNN_TENSOR_NHWC, CUDNN_DATA_HALF, 1, s.k, 1, 1));
        CK(cudnnSetFilter4dDescriptor(wd, CUDNN_DATA_HALF, CUDNN_TENSOR_NHWC, s.k, s.c, 3, 3));
        CK(cudnnSetConvolution2dDescriptor(cd, 1, 1, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
        CK(cudnnSetConvolutionMathType(cd, CUDNN_TENSOR_OP_MATH));
        CK(cudnnSetActivationDescriptor(ad, CUDNN_ACTIVATION_IDENTITY, CUDNN_NOT_PROPAGATE_NAN, 0.0));
        float one = 1.f, zero = 0.f;
        cudnnConvolutionFwdAlgoPerf_t perf[8]; int got = 0;
        CK(cudnnGetConvolutionForwardAlgorithm_v7(dn, xd, wd, cd, yd, 8, &got, perf));
        cudnnConvolutionFwdAlgo_t algo = perf[0].algo;
        CK(cudnnConvolutionForward(dn, &one, xd, x, wd, w, cd, algo, ws, legacy_ws, &zero, yd, yref));
        CK(cudaStreamSynchronize(st));
        float t_plain = time_graph(st, [&] { return cudnnConvolutionForward(dn, &one, xd, x, wd, w, cd, algo, ws, legacy_ws, &zero, yd, y) == 0; });
        float t_bias = time_graph(st, [&] {
            return cudnnConvolutionBiasActivationForward(dn, &one, xd, x, wd, w, cd, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
                                                         ws, legacy_ws, &zero, yd, y, bd, bias, ad, yd, y) == 0; });
        float t_res = time_graph(st, [&] {
            return cudnnConvolutionBiasActivationForward(dn, &one, xd, x, wd, w, cd, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
                                                         ws, legacy_ws, &one, yd, res, bd, bias, ad, yd, y) == 0; });
        printf("\n=== [%d] %s  n %d %dx%d %d>%d (M %lld K %d N %d)  legacy: v7 algo %d plain %.1f us | biasact(precomp) %.1f us | biasact+z %.1f us\n",
               si, s.what, s.n, s.hw, s.hw, s.c, s.k, m, 9 * s.c, s.k, (int)algo, t_plain, t_bias, t_res);
        fflush(stdout);

        for (char variant : variants) {
            double tv = now_s();
            bool late = now_s() - t_start > deadline;
            Graph g;
            try {
                g = build_graph(dn, s.n, s.hw, s.c, s.k, variant);
            } catch (std::exception &e) {
                printf("  [%c] %-16s graph not built: %s\n  SUMMARY %-18s %c graph not supported\n", variant, variant_name(variant), e.what(), s.what, variant);
                fflush(stdout);
                continue;
            }
            Desc vp = make(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
            std::vector<int64_t> uids = {UID_X, UID_W, UID_Y};
            std::vector<void *> ptrs = {x, w, y};
            if (has_bias(variant)) { uids.push_back(UID_BIAS); ptrs.push_back(bias); }
            if (has_res(variant)) { uids.push_back(UID_RES); ptrs.push_back(res); }
            set(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, (int64_t)uids.size(), uids.data());
            set(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, (int64_t)ptrs.size(), ptrs.data());
            set(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
            fin(vp, "variant pack");

            std::vector<Result> results; std::set<std::string> seen;
            int n_fail_plan = 0, n_fail_exec = 0, n_bad = 0, n_rtc_skipped = 0, n_rtc = 0, n_big_ws = 0, n_nograph = 0;
            double fin_total = 0;
            float best_us = 1e9;
            int n_screened = 0;
            int rtc_cap_v = std::min(late ? 1 : 1 << 30, has_res(variant) ? rtc_cap : rtc_cap_pb);
            // Finalize a plan for the config, check it and time it; returns the index into results or -1.
            auto try_cfg = [&](Cfg &c) -> int {
                std::string key = c.key();
                if (seen.count(key)) return -1;
                seen.insert(key);
                if (c.rtc) { if (n_rtc >= rtc_cap_v) { n_rtc_skipped++; return -1; } n_rtc++; }
                double t0 = now_s();
                Desc plan = make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
                set(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &dn);
                set_desc(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, c.cfg);
                cudnnStatus_t st_ = cudnnBackendFinalize(plan.get());
                double fin_ms = (now_s() - t0) * 1e3;
                fin_total += fin_ms / 1e3;
                if (st_) { n_fail_plan++; if (list) printf("      %-4s eng %3lld %-40s plan finalize failed %d (%.1f ms)\n", c.src.c_str(), (long long)c.engine, c.knob_str().c_str(), (int)st_, fin_ms); return -1; }
                int64_t wsz = 0, cnt = 0;
                CK(cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &cnt, &wsz));
                if ((size_t)wsz > max_ws) { n_big_ws++; return -1; }
                cudaMemsetAsync(y, 0xff, ny * 2, st);  // NaN-fill: catches plans that do not write every output
                cudaMemsetAsync(chk, 0, 8, st);
                cudnnStatus_t es = cudnnBackendExecute(dn, plan.get(), vp.get());
                cudaError_t ce = cudaStreamSynchronize(st);
                if (es || ce) { n_fail_exec++; cudaGetLastError(); if (list) printf("      %-4s eng %3lld %-40s execute failed %d/%d\n", c.src.c_str(), (long long)c.engine, c.knob_str().c_str(), (int)es, (int)ce); return -1; }
                check<<<(ny + 255) / 256, 256, 0, st>>>(y, yref, has_bias(variant) ? bias : nullptr, has_res(variant) ? res : nullptr, ny, s.k, chk);
                unsigned hc[2]; cudaMemcpy(hc, chk, 8, cudaMemcpyDeviceToHost);
                float err, mag; memcpy(&err, &hc[0], 4); memcpy(&mag, &hc[1], 4);
                float tol = 0.02f + 0.004f * mag;
                if (err > tol) {
                    n_bad++;
                    printf("      %-4s eng %3lld %-40s%s ws %9lld WRONG OUTPUT: max err %.4f (max |ref| %.3f)\n", c.src.c_str(), (long long)c.engine,
                           c.knob_str().c_str(), c.rtc ? " rtc" : "", (long long)wsz, err, mag);
                    return -1;
                }
                // quick screen: 3 back-to-back calls between events; clearly slow plans are not timed further
                cudaEvent_t q0, q1; cudaEventCreate(&q0); cudaEventCreate(&q1);
                cudaEventRecord(q0, st);
                for (int i = 0; i < 3; ++i) cudnnBackendExecute(dn, plan.get(), vp.get());
                cudaEventRecord(q1, st); cudaEventSynchronize(q1);
                float qms = 0; cudaEventElapsedTime(&qms, q0, q1); cudaEventDestroy(q0); cudaEventDestroy(q1);
                float quick = qms * 1000 / 3;
                if (quick > 2 * best_us + 10) {
                    n_screened++;
                    if (list) printf("      %-4s eng %3lld %-40s%s ws %9lld fin %7.1f ms  quick %8.1f us (screened out)\n", c.src.c_str(), (long long)c.engine,
                                     c.knob_str().c_str(), c.rtc ? " rtc" : "", (long long)wsz, fin_ms, quick);
                    return -1;
                }
                float us = time_graph(st, [&] { return cudnnBackendExecute(dn, plan.get(), vp.get()) == 0; });
                float us_loop = -1;
                if (us < 0) { n_nograph++; us_loop = time_loop(st, [&] { return cudnnBackendExecute(dn, plan.get(), vp.get()) == 0; }); }
                if (list || us < 0) printf("      %-4s eng %3lld %-40s%s ws %9lld fin %7.1f ms  %8.1f us  err %.4f%s%s\n", c.src.c_str(), (long long)c.engine,
                                 c.knob_str().c_str(), c.rtc ? " rtc" : "", (long long)wsz, fin_ms, us < 0 ? us_loop : us, err, err > tol ? " BAD" : "",
                                 us < 0 ? " (NOT graph-capturable; loop timing)" : "");
                if (us < 0) return -1;
                results.push_back({c, us, fin_ms, wsz, err});
                best_us = std::min(best_us, us);
                return (int)results.size() - 1;
            };

            double hs[3] = {0, 0, 0};
            std::vector<Cfg> ha = heuristic_cfgs(g, CUDNN_HEUR_MODE_A, "A", &hs[0]);
            std::vector<Cfg> hb = late ? std::vector<Cfg>() : heuristic_cfgs(g, CUDNN_HEUR_MODE_B, "B", &hs[1]);
            std::vector<Cfg> hf = late ? std::vector<Cfg>() : heuristic_cfgs(g, CUDNN_HEUR_MODE_FALLBACK, "F", &hs[2]);
            if (!ha.empty() && !hb.empty()) {
                int same = 0;
                for (size_t i = 0; i < std::min(ha.size(), hb.size()); ++i) same += ha[i].key() == hb[i].key();
                printf("    heuristics: A0 eng %lld [%s], B0 eng %lld [%s]; %d of %zu ranks identical in A and B\n", (long long)ha[0].engine, ha[0].knob_str().c_str(),
                       (long long)hb[0].engine, hb[0].knob_str().c_str(), same, std::min(ha.size(), hb.size()));
            }
            // mode A's first config that finalizes and passes (the "just take heuristics" choice)
            int a_first = -1; std::string a_first_src;
            for (auto &c : ha) {
                int r = try_cfg(c);
                if (r >= 0 && a_first < 0) { a_first = r; a_first_src = c.src; }
            }
            for (auto *hv : {&hb, &hf}) for (auto &c : *hv) try_cfg(c);
            int n_heur_ok = (int)results.size();
            float best_heur = best_us;
            // engines by global index, with knob sweeps
            int n_eng_ok = 0, n_enum_cfg = 0;
            if (enumerate && !late && enum_variants.find(variant) != std::string::npos) {
                double t_enum = now_s();
                for (int64_t e = 0; e < g.engines && now_s() - t_enum < enum_budget; ++e) {
                    Desc eng; std::vector<KnobInfo> ki; bool rtc = false;
                    if (!engine_by_index(g, e, eng, ki, rtc)) continue;
                    n_eng_ok++;
                    if (list) {
                        printf("    engine %lld%s knobs:", (long long)e, rtc ? " (rtc)" : "");
                        for (auto &k : ki) printf(" %s[%lld..%lld/%lld]", knob_name(k.type), (long long)k.mn, (long long)k.mx, (long long)k.stride);
                        printf("\n");
                    }
                    // default knobs first
                    { Cfg c; c.engine = e; c.rtc = rtc; c.src = "E"; if (make_cfg(eng, {}, c.cfg)) { describe_cfg(c); c.src = "E"; n_enum_cfg++; try_cfg(c); } }
                    // full product of knob values if small enough, else evenly spaced picks of it
                    std::vector<std::vector<int64_t>> vals;
                    double prod = 1;
                    for (auto &k : ki) {
                        std::vector<int64_t> v;
                        int64_t stp = k.stride > 0 ? k.stride : 1;
                        for (int64_t q = k.mn; q <= k.mx && v.size() < 4096; q += stp) v.push_back(q);
                        if (v.empty()) v.push_back(k.mn);
                        vals.push_back(v); prod *= v.size();
                    }
                    if (ki.empty() || rtc) continue;
                    long long total = (long long)std::min(prod, 1e15), picks = std::min<long long>(total, knob_cap);
                    for (long long p = 0; p < picks && now_s() - t_enum < enum_budget; ++p) {
                        long long idx = picks == total ? p : (long long)((double)p * total / picks);
                        Knobs kn;
                        for (size_t q = 0; q < ki.size(); ++q) { kn.push_back({ki[q].type, vals[q][idx % vals[q].size()]}); idx /= vals[q].size(); }
                        std::sort(kn.begin(), kn.end());
                        Cfg c; c.engine = e; c.rtc = rtc; c.src = "E"; c.knobs = kn;
                        if (seen.count(c.key())) continue;
                        if (!make_cfg(eng, kn, c.cfg)) { seen.insert(c.key()); continue; }
                        n_enum_cfg++; try_cfg(c);
                    }
                }
            }
            // Hill climb: one-knob-at-a-time neighbours of the 3 fastest configs so far, then of any new best.
            int n_nb = 0;
            if (nb_budget > 0 && !late && nb_variants.find(variant) != std::string::npos) {
                double t_nb = now_s();
                std::vector<Result> top = results;
                std::sort(top.begin(), top.end(), [](const Result &a, const Result &b) { return a.us < b.us; });
                if (top.size() > 3) top.resize(3);
                std::vector<Cfg> queue;
                for (auto &r : top) if (!r.c.rtc) queue.push_back(r.c);
                std::map<int64_t, Result> best_per_engine;
                for (auto &r : results) if (!r.c.rtc && (!best_per_engine.count(r.c.engine) || r.us < best_per_engine[r.c.engine].us)) best_per_engine[r.c.engine] = r;
                for (auto &kv : best_per_engine) if (kv.second.us < 1.5f * best_us) queue.push_back(kv.second.c);
                std::set<std::string> expanded;
                while (!queue.empty() && now_s() - t_nb < nb_budget) {
                    Cfg base = queue.front(); queue.erase(queue.begin());
                    if (expanded.count(base.key())) continue;
                    expanded.insert(base.key());
                    Desc eng; std::vector<KnobInfo> ki; bool rtc;
                    if (!engine_by_index(g, base.engine, eng, ki, rtc)) continue;
                    for (auto &k : ki) {
                        int64_t cur = k.mn;
                        for (auto &kv : base.knobs) if (kv.first == k.type) cur = kv.second;
                        for (int64_t q : knob_values(k, cur)) {
                            if (now_s() - t_nb >= nb_budget) break;
                            Knobs kn = base.knobs;
                            bool found = false;
                            for (auto &kv : kn) if (kv.first == k.type) { kv.second = q; found = true; }
                            if (!found) kn.push_back({k.type, q});
                            std::sort(kn.begin(), kn.end());
                            Cfg c; c.engine = base.engine; c.rtc = false; c.src = "N"; c.knobs = kn;
                            if (seen.count(c.key())) continue;
                            if (!make_cfg(eng, kn, c.cfg)) { seen.insert(c.key()); continue; }
                            n_nb++;
                            float before = best_us;
                            int r = try_cfg(c);
                            if (r >= 0 && results[r].us < before) queue.insert(queue.begin(), results[r].c);
                        }
                    }
                }
            }
            // ---- report
            std::vector<int> order(results.size());
            for (size_t i = 0; i < order.size(); ++i) order[i] = (int)i;
            std::sort(order.begin(), order.end(), [&](int a, int b) { return results[a].us < results[b].us; });
            float legacy = variant == 'p' ? t_plain : has_res(variant) ? t_res : t_bias;
            printf("  [%c] %-16s legacy %6.1f | heur A %zu B %zu F %zu cfgs (%.1f/%.1f/%.1f ms), %d ok | engines %lld, %d finalize, %d enum cfgs | "
                   "plan fail %d exec fail %d wrong %d no-graph %d screened %d rtc %d (skipped %d) ws>512M %d | hill-climb cfgs %d | finalize total %.2f s, variant %.1f s\n",
                   variant, variant_name(variant), legacy, ha.size(), hb.size(), hf.size(),
                   hs[0] * 1e3, hs[1] * 1e3, hs[2] * 1e3, n_heur_ok, (long long)g.engines, n_eng_ok, n_enum_cfg, n_fail_plan, n_fail_exec, n_bad,
                   n_nograph, n_screened, n_rtc, n_rtc_skipped, n_big_ws, n_nb, fin_total, now_s() - tv);
            if (a_first >= 0) {
                auto &r = results[a_first];
                printf("      A-first (%s): %6.1f us  eng %lld %s ws %lld fin %.1f ms\n", a_first_src.c_str(), r.us, (long long)r.c.engine, r.c.knob_str().c_str(), (long long)r.ws, r.fin_ms);
            } else printf("      A-first: none finalized\n");
            for (size_t i = 0; i < order.size() && i < 5; ++i) {
                auto &r = results[order[i]];
                printf("      #%zu %-4s %6.1f us  eng %3lld%s %s ws %lld fin %.1f ms err %.4f\n", i + 1, r.c.src.c_str(), r.us, (long long)r.c.engine,
                       r.c.rtc ? " rtc" : "", r.c.knob_str().c_str(), (long long)r.ws, r.fin_ms, r.err);
            }
            if (!order.empty()) {
                auto &b = results[order[0]];
                printf("  SUMMARY %-18s %c legacy %6.1f  Afirst %6.1f  bestHeur %6.1f  best %6.1f  (%.2fx vs legacy) eng %lld [%s] ws %lld src %s\n", s.what, variant, legacy,
                       a_first >= 0 ? results[a_first].us : -1.f, best_heur < 1e8 ? best_heur : -1.f, b.us, legacy / b.us, (long long)b.c.engine, b.c.knob_str().c_str(), (long long)b.ws, b.c.src.c_str());
            } else printf("  SUMMARY %-18s %c legacy %6.1f  no backend plan\n", s.what, variant, legacy);
            fflush(stdout);
        }
        cudnnDestroyTensorDescriptor(xd); cudnnDestroyTensorDescriptor(yd); cudnnDestroyTensorDescriptor(bd);
        cudnnDestroyFilterDescriptor(wd); cudnnDestroyConvolutionDescriptor(cd); cudnnDestroyActivationDescriptor(ad);
    }
    printf("\ntotal %.1f s\n", now_s() - t_start);
    return 0;
}
