"""spandrel's side of the upscaler benchmark, on the same model file and image as `sdhive-bench --upscale-bench`:
the RRDBNet loaded by spandrel (`ModelLoader().load_from_file`), in float16 on CUDA, fed the benchmark image as A1111
feeds it (RGB -> BGR, /255, the model's dtype), timed as `model(x)` under `torch.inference_mode()`: warm-up calls,
then each call between two `torch.cuda.synchronize()`, the median reported. With `--cudnn-benchmark` cuDNN picks
its algorithms by timing them (A1111's `cudnn_benchmark` option; off by default, as in A1111 and spandrel).
Prints one JSON line.

    python3 bench_esrgan_spandrel.py MODEL.safetensors [ITERS] [--size 512] [--cudnn-benchmark]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from spandrel import ModelLoader


def pixel_image(side: int) -> np.ndarray:
    """sdhive-bench's `pixel(x, y, c)`: the same bytes on both sides."""
    y, x, c = np.meshgrid(np.arange(side), np.arange(side), np.arange(3), indexing="ij")
    return ((x * 7 + y * 13 + c * 71 + (x * y) % 31 * 5) % 256).astype(np.uint8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("iters", nargs="?", type=int, default=10)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cudnn-benchmark", action="store_true")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    desc = ModelLoader().load_from_file(args.model)
    model = desc.model.eval().half().cuda()
    img = pixel_image(args.size)[:, :, ::-1]  # BGR, as A1111's pil_image_to_torch_bgr
    x = torch.from_numpy(np.ascontiguousarray(np.transpose(img, (2, 0, 1))) / 255).unsqueeze(0)
    x = x.to(device="cuda", dtype=torch.float16)

    with torch.inference_mode():
        out = model(x)
        for _ in range(args.warmup):
            model(x)
        times = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model(x)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
    o = out.float()
    print(json.dumps({
        "model": f"{desc.architecture.name} {' '.join(desc.tags)} x{desc.scale}",
        "size": args.size, "output": list(out.shape), "cudnn_benchmark": args.cudnn_benchmark,
        "ms": times, "median_ms": statistics.median(times), "min_ms": min(times),
        "out_mean": float(o.mean()), "out_std": float(o.std(correction=0)),
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "torch": torch.__version__, "device": torch.cuda.get_device_name(),
    }))


if __name__ == "__main__":
    main()
