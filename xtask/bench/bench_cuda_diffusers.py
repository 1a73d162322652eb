"""diffusers reference timings on a CUDA GPU, fp16, random weights with the real SD1.5 / SDXL architectures: the
figures sdhive's CUDA numbers are compared with (xtask/bench/cuda_table.py runs it; docs/benchmarks.md).

usage: python3 bench_cuda_diffusers.py parts [--compile] [--sd15 DIR] [--sdxl DIR]
  parts: comma-separated from unet-sd15, vae-sd15, text-sd15, unet-sdxl, text-sdxl, e2e-sd15, e2e-sdxl
  --compile: torch.compile(mode="reduce-overhead", fullgraph=True) on the UNet (and the VAE decoder); the
             compilation happens in the untimed warm-up calls.
  --sd15/--sdxl: diffusers folders for the end-to-end parts (sdhive-bench --write-model writes them).
Prints one JSON line per part: {"part", "median_ms", "ms": [...], "peak_allocated_bytes"}; the UNet parts also
give "schedule_median_ms" and "schedule_ms": per step of 20-step schedules issued back to back, one synchronisation
per schedule (as ../shared/bench/bench_diffusers.py, the anchors' script, times them). Same work as
sdhive-bench: a UNet step is one CFG call (batch 2, 77 context tokens), a VAE decode one latent, a text encode
the prompt and the negative prompt through every encoder, an end-to-end image 20 Euler steps with CFG 7.
Timesteps go in as device tensors: Python ints force a host sync per step (40% slower eager, measured)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel

torch.manual_seed(0)
DEV, DT = "cuda", torch.float16
SD15 = dict(act_fn="silu", attention_head_dim=8, block_out_channels=[320, 640, 1280, 1280], cross_attention_dim=768,
            down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"], up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
            in_channels=4, out_channels=4, layers_per_block=2, norm_num_groups=32, sample_size=64)
SDXL = dict(act_fn="silu", attention_head_dim=[5, 10, 20], block_out_channels=[320, 640, 1280], cross_attention_dim=2048,
            down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
            up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], transformer_layers_per_block=[1, 2, 10],
            use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816, in_channels=4, out_channels=4, layers_per_block=2,
            norm_num_groups=32, sample_size=128)
SD15_VAE = dict(block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4, latent_channels=4, layers_per_block=2, norm_num_groups=32)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              max_position_embeddings=77, hidden_act="gelu", projection_dim=1280)


def timed(fn, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1000)
    return out


def report(part: str, ms: list[float], schedule: list[float] | None = None) -> None:
    row = {"part": part, "median_ms": statistics.median(ms), "ms": [round(m, 2) for m in ms]}
    if schedule:
        row |= {"schedule_median_ms": statistics.median(schedule), "schedule_ms": [round(m, 3) for m in schedule]}
    print(json.dumps(row | {"peak_allocated_bytes": torch.cuda.max_memory_allocated()}), flush=True)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def compiled(module, on: bool):
    return torch.compile(module, mode=os.environ.get("CMODE", "reduce-overhead"), fullgraph=True) if on else module


def unet_part(cfg, lat, ctx, extra, comp, iters):
    unet = compiled(UNet2DConditionModel(**cfg).to(DEV, DT).eval(), comp)
    x = torch.randn(2, 4, lat, lat, device=DEV, dtype=DT)
    e = torch.randn(2, 77, ctx, device=DEV, dtype=DT)
    kw = {} if extra is None else {"added_cond_kwargs": extra}
    ts = [torch.tensor(999 - i * 50, device=DEV) for i in range(20)]
    state = {"i": 0}

    def step():
        state["i"] += 1
        unet(x, ts[state["i"] % 20], e, **kw)

    def schedule():
        for t in ts:
            unet(x, t, e, **kw)

    with torch.inference_mode():
        per_call = timed(step, 5 if comp else 3, iters)
        return per_call, [ms / len(ts) for ms in timed(schedule, 1, max(3, iters // 2))]


def vae_part(comp, iters):
    vae = AutoencoderKL(**SD15_VAE).to(DEV, DT).eval()
    vae.decoder = compiled(vae.decoder, comp)
    z = torch.randn(1, 4, 64, 64, device=DEV, dtype=DT)
    with torch.inference_mode():
        return timed(lambda: vae.decode(z), 3, iters)


def text_part(configs, iters):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    models = [(CLIPTextModelWithProjection if proj else CLIPTextModel)(CLIPTextConfig(**c)).to(DEV, DT).eval()
              for c, proj in configs]
    ids = torch.tensor([[49406] + [320 + i for i in range(18)] + [49407] * 58], device=DEV)

    def encode():
        for _ in range(2):  # prompt and negative prompt, as encode_prompt runs them
            for m in models:
                m(ids, output_hidden_states=True)

    with torch.inference_mode():
        return timed(encode, 3, iters)


def e2e_part(folder, xl, size, comp, iters):
    from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline
    cls = StableDiffusionXLPipeline if xl else StableDiffusionPipeline
    pipe = cls.from_pretrained(folder, torch_dtype=DT, safety_checker=None, requires_safety_checker=False) \
        if not xl else cls.from_pretrained(folder, torch_dtype=DT)
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    pipe = pipe.to(DEV)
    pipe.set_progress_bar_config(disable=True)
    pipe.unet = compiled(pipe.unet, comp)
    g = torch.Generator(DEV)

    def image():
        pipe("a photo of a cat sitting on a wooden table", negative_prompt="blurry", height=size, width=size,
             num_inference_steps=20, guidance_scale=7.0, generator=g.manual_seed(42), output_type="np")

    return timed(image, 2 if comp else 1, iters)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("parts")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--sd15")
    ap.add_argument("--sdxl")
    a = ap.parse_args()
    xl_extra = {"text_embeds": torch.randn(2, 1280, device=DEV, dtype=DT),
                "time_ids": torch.randn(2, 6, device=DEV, dtype=DT)}
    for part in a.parts.split(","):
        torch.cuda.reset_peak_memory_stats()
        schedule = None
        if part == "unet-sd15":
            ms, schedule = unet_part(SD15, 64, 768, None, a.compile, 20)
        elif part == "unet-sdxl":
            ms, schedule = unet_part(SDXL, 128, 2048, xl_extra, a.compile, 10)
        elif part == "vae-sd15":
            ms = vae_part(a.compile, 10)
        elif part == "text-sd15":
            ms = text_part([(CLIP_L, False)], 10)
        elif part == "text-sdxl":
            ms = text_part([(CLIP_L, False), (CLIP_G, True)], 10)
        elif part == "e2e-sd15":
            ms = e2e_part(a.sd15, False, 512, a.compile, 3)
        elif part == "e2e-sdxl":
            ms = e2e_part(a.sdxl, True, 1024, a.compile, 2)
        else:
            raise SystemExit(f"unknown part {part}")
        report(part + ("-compiled" if a.compile else ""), ms, schedule)


if __name__ == "__main__":
    main()
