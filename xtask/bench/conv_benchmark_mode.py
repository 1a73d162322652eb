# Measured and not taken (docs/benchmarks.md): run with python3 conv_benchmark_mode.py OUT.json on a GPU machine.
# Does timing cuDNN's engine configurations per shape (torch.backends.cudnn.benchmark) beat its heuristics on
# SD1.5's 3x3 convolutions (UNet at 64^2 latents, N = 2/14/16 rows; VAE decoder at 512^2, N = 1)? f16 channels-last.
import torch, json, sys, statistics
import torch.nn.functional as F
torch.backends.cuda.matmul.allow_tf32 = False
def unet_shapes():
    s = []  # (cin, cout, hw, stride, count)
    s.append((4, 320, 64, 1, 1))
    s.append((320, 320, 64, 1, 4)); s.append((320, 320, 64, 2, 1))
    s.append((320, 640, 32, 1, 1)); s.append((640, 640, 32, 1, 3)); s.append((640, 640, 32, 2, 1))
    s.append((640, 1280, 16, 1, 1)); s.append((1280, 1280, 16, 1, 3)); s.append((1280, 1280, 16, 2, 1))
    s.append((1280, 1280, 8, 1, 4 + 4))  # down block 3 + mid
    s.append((2560, 1280, 8, 1, 3)); s.append((1280, 1280, 8, 1, 3)); s.append((1280, 1280, 16, 1, 1))  # up0 + upsample conv
    s.append((2560, 1280, 16, 1, 2)); s.append((1920, 1280, 16, 1, 1)); s.append((1280, 1280, 16, 1, 3)); s.append((1280, 1280, 32, 1, 1))
    s.append((1920, 640, 32, 1, 1)); s.append((1280, 640, 32, 1, 1)); s.append((960, 640, 32, 1, 1)); s.append((640, 640, 32, 1, 3)); s.append((640, 640, 64, 1, 1))
    s.append((960, 320, 64, 1, 1)); s.append((640, 320, 64, 1, 2)); s.append((320, 320, 64, 1, 3))
    s.append((320, 4, 64, 1, 1))
    return s
def vae_shapes():
    s = [(4, 512, 64, 1, 1), (512, 512, 64, 1, 4 + 6), (512, 512, 128, 1, 1 + 6), (512, 512, 256, 1, 1),
         (512, 256, 256, 1, 1), (256, 256, 256, 1, 5), (256, 256, 512, 1, 1), (256, 128, 512, 1, 1), (128, 128, 512, 1, 5), (128, 3, 512, 1, 1)]
    return s
def time_shape(n, cin, cout, hw, stride, reps=20):
    x = torch.randn(n, cin, hw, hw, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    w = (torch.randn(cout, cin, 3, 3, device="cuda", dtype=torch.float16) * 0.02).to(memory_format=torch.channels_last)
    b = torch.randn(cout, device="cuda", dtype=torch.float16)
    for _ in range(3):
        y = F.conv2d(x, w, b, stride=stride, padding=1)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(2): F.conv2d(x, w, b, stride=stride, padding=1)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            for _ in range(reps): F.conv2d(x, w, b, stride=stride, padding=1)
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); e.record(); e.synchronize()
        ts.append(a.elapsed_time(e) * 1000 / reps)
    return statistics.median(ts)
out = {}
for name, shapes, ns in [("unet", unet_shapes(), [2, 14, 16]), ("vae", vae_shapes(), [1])]:
    for n in ns:
        rows = []
        for (cin, cout, hw, st, cnt) in shapes:
            r = {}
            for bm in (False, True):
                torch.backends.cudnn.benchmark = bm
                r[bm] = time_shape(n, cin, cout, hw, st)
            rows.append((cin, cout, hw, st, cnt, r[False], r[True]))
            print(f"{name} N={n} {cin}->{cout} {hw}^2 s{st} x{cnt}: heur {r[False]:.1f} us  bench {r[True]:.1f} us  {r[True]/r[False]:.3f}", flush=True)
        th = sum(r[4] * r[5] for r in rows); tb = sum(r[4] * r[6] for r in rows)
        print(f"== {name} N={n}: heuristics {th/1000:.3f} ms, benchmark {tb/1000:.3f} ms, ratio {tb/th:.3f}", flush=True)
        out[f"{name}{n}"] = rows
json.dump(out, open(sys.argv[1], "w"))
