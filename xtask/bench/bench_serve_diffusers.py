"""diffusers' side of the serving benchmark (serve_table.py): the requests sdhive-bench --serve-bench sends, served
one at a time as A1111 serves them: the pipeline (StableDiffusionPipeline / StableDiffusionXLPipeline, Euler a =
EulerAncestralDiscreteScheduler, CFG 7), then the PNG with the infotext in a `parameters` text chunk (PIL, as
A1111's API encodes), base64 and the JSON answer. Each request is timed from its start to the finished answer.
Prints one JSON line: per-request times, their median and p90, images per second over the timed requests, and
torch's peak allocation.

    python3 bench_serve_diffusers.py --model DIR --family sd15|sdxl --size 512 --steps 20 --requests 20 --warmup 2
        [--device cuda|cpu] [--dtype f16|f32]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import time

import torch

# The prompts and seeds of crates/sdhive-bench/src/serving.rs, request by request.
SEED_BASE = 1000
SUBJECTS = ["a red fox", "an old lighthouse", "a bowl of ramen", "a vintage motorcycle", "a snowy mountain cabin",
            "a portrait of an astronaut", "a field of sunflowers", "a steampunk airship",
            "a cat sleeping on a windowsill", "a medieval castle", "a neon-lit street market", "a koi pond"]
PLACES = ["at dawn", "in the rain", "under a starry sky", "in autumn", "at golden hour", "in thick fog"]
STYLES = ["highly detailed photograph", "oil painting", "watercolor illustration", "cinematic lighting, 35mm",
          "digital art, trending on artstation"]
NEGATIVE = ["blurry", "lowres, watermark", "deformed, bad anatomy", "oversaturated, jpeg artifacts"]
CFG = 7.0


def prompt(i: int) -> str:
    s, p = len(SUBJECTS), len(PLACES)
    return f"{SUBJECTS[i % s]} {PLACES[(i // s) % p]}, {STYLES[(i // (s * p)) % len(STYLES)]}"


def percentile(v: list[float], q: float) -> float:
    s = sorted(v)
    pos = q / 100 * (len(s) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--family", choices=["sd15", "sdxl"], required=True)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["f16", "f32"], default="f16")
    a = ap.parse_args()
    if a.requests < 1:
        raise SystemExit("--requests must be at least 1")

    import diffusers
    from diffusers import EulerAncestralDiscreteScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline
    from PIL import PngImagePlugin

    dt = torch.float16 if a.dtype == "f16" else torch.float32
    if a.family == "sdxl":
        pipe = StableDiffusionXLPipeline.from_pretrained(a.model, torch_dtype=dt)
    else:
        pipe = StableDiffusionPipeline.from_pretrained(a.model, torch_dtype=dt, safety_checker=None,
                                                       requires_safety_checker=False)
    pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config)
    pipe = pipe.to(a.device)
    pipe.set_progress_bar_config(disable=True)
    cuda = a.device.startswith("cuda")

    def serve(i: int) -> str:
        """One request, answered as A1111's /sdapi/v1/txt2img answers it."""
        p, n, seed = prompt(i), NEGATIVE[i % len(NEGATIVE)], SEED_BASE + i
        g = torch.Generator(a.device).manual_seed(seed)
        image = pipe(p, negative_prompt=n, height=a.size, width=a.size, num_inference_steps=a.steps,
                     guidance_scale=CFG, generator=g, output_type="pil").images[0]
        infotext = (f"{p}\nNegative prompt: {n}\nSteps: {a.steps}, Sampler: Euler a, CFG scale: {CFG:g}, "
                    f"Seed: {seed}, Size: {a.size}x{a.size}")
        meta = PngImagePlugin.PngInfo()
        meta.add_text("parameters", infotext)
        buf = io.BytesIO()
        image.save(buf, format="PNG", pnginfo=meta)
        b64 = base64.b64encode(buf.getvalue()).decode("ascii")
        params = {"prompt": p, "negative_prompt": n, "seed": seed, "steps": a.steps, "cfg_scale": CFG,
                  "width": a.size, "height": a.size, "sampler_name": "Euler a"}
        return json.dumps({"images": [b64], "parameters": params, "info": json.dumps({"infotexts": [infotext]})})

    with torch.inference_mode():
        for i in range(a.warmup):
            serve(i)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        ms = []
        start = time.perf_counter()
        for i in range(a.warmup, a.warmup + a.requests):
            t = time.perf_counter()
            answer = serve(i)
            ms.append((time.perf_counter() - t) * 1e3)
            print(f"diffusers request {i}: {ms[-1]:.1f} ms, answer {len(answer)} bytes", file=sys.stderr, flush=True)
        wall = time.perf_counter() - start
    print(json.dumps({
        "family": a.family, "size": a.size, "steps": a.steps, "requests": a.requests,
        "median_ms": statistics.median(ms), "p90_ms": percentile(ms, 90), "mean_ms": statistics.fmean(ms),
        "ms": [round(m, 2) for m in ms], "images_per_s": a.requests / wall,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "diffusers": diffusers.__version__,
    }), flush=True)


if __name__ == "__main__":
    main()
