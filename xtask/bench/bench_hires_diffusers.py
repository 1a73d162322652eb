"""diffusers composed as sdhive's hires fix documents it, timed on a CUDA GPU in fp16 with the random full-size SD1.5
folder sdhive-bench --write-model writes: txt2img 512² (20 Euler steps, CFG 7, output_type="latent"), the latents
interpolated ×2 ("Latent": bilinear), img2img of the same components at 1024² (20 steps at strength 0.5: 10 run,
CFG 7), decoded to 8-bit pixels. The same work as `sdhive-bench --e2e DIR --hires` (hires_table.py runs both).

usage: python3 bench_hires_diffusers.py SD15_DIR ITERS
Prints one JSON line: {"median_ms", "ms": [...], "peak_allocated_bytes", "torch", "diffusers", "device"}."""

from __future__ import annotations

import json
import statistics
import sys
import time

import diffusers
import torch
import torch.nn.functional as F
from diffusers import EulerDiscreteScheduler, StableDiffusionImg2ImgPipeline, StableDiffusionPipeline

DEV, DT = "cuda", torch.float16
PROMPT, NEGATIVE = "a photo of a cat sitting on a wooden table", "blurry"


def main() -> None:
    folder, iters = sys.argv[1], int(sys.argv[2])
    txt = StableDiffusionPipeline.from_pretrained(folder, torch_dtype=DT, safety_checker=None,
                                                  requires_safety_checker=False)
    txt.scheduler = EulerDiscreteScheduler.from_config(txt.scheduler.config)
    txt = txt.to(DEV)
    txt.set_progress_bar_config(disable=True)
    # sdhive-bench --write-model writes no `sample_size` (it only sets default sizes); img2img's constructor
    # compares it with 64, as SD1.5's own config has it.
    if txt.unet.config.sample_size is None:
        txt.unet.register_to_config(sample_size=64)
    i2i = StableDiffusionImg2ImgPipeline(**txt.components)
    i2i.set_progress_bar_config(disable=True)
    g = torch.Generator(DEV)

    def image():
        latents = txt(PROMPT, negative_prompt=NEGATIVE, height=512, width=512, num_inference_steps=20,
                      guidance_scale=7.0, generator=g.manual_seed(42), output_type="latent").images
        up = F.interpolate(latents, size=(128, 128), mode="bilinear", antialias=False)
        i2i(PROMPT, negative_prompt=NEGATIVE, image=up, strength=0.5, num_inference_steps=20, guidance_scale=7.0,
            generator=g.manual_seed(42), output_type="np")

    with torch.inference_mode():
        image()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ms = []
        for _ in range(iters):
            t = time.perf_counter()
            image()
            torch.cuda.synchronize()
            ms.append((time.perf_counter() - t) * 1000)
    print(json.dumps({"median_ms": statistics.median(ms), "ms": [round(m, 1) for m in ms],
                      "peak_allocated_bytes": torch.cuda.max_memory_allocated(), "torch": torch.__version__,
                      "diffusers": diffusers.__version__, "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
