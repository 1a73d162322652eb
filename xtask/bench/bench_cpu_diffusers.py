"""diffusers' side of `cargo xtask bench cpu`: the SD1.5 UNet and VAE with random weights on the CPU in float32.

One CFG UNet step (batch 2, latent 32x32 = 256x256 pixels, 77x768 text context) and one VAE decode of a 256x256
image, both networks alive together as in sdhive-bench, then the process's peak RSS. The architecture dicts are
the diffusers config fields of runwayml/stable-diffusion-v1-5 (unet/ and vae/).

usage: python bench_cpu_diffusers.py [--iters N] [--warmup N] [--threads N] [--latent N]
Prints one line `SDHIVE_DIFFUSERS_JSON {...}` on stdout (progress on stderr); exit 3 when torch or diffusers
cannot be imported, so the caller can say why it has no reference figures.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

SD15_UNET = dict(
    act_fn="silu",
    attention_head_dim=8,
    block_out_channels=[320, 640, 1280, 1280],
    cross_attention_dim=768,
    down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    norm_num_groups=32,
    sample_size=64,
)
SD15_VAE = dict(
    block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    latent_channels=4,
    layers_per_block=2,
    norm_num_groups=32,
)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def timing(ms):
    return {"ms": ms, "median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms), "min_ms": min(ms)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--latent", type=int, default=32)
    args = ap.parse_args()
    try:
        import torch
        import diffusers
        from diffusers import AutoencoderKL, UNet2DConditionModel
    except Exception as e:  # noqa: BLE001 - any import failure means "no reference here"
        print(f"cannot import torch/diffusers: {e}", file=sys.stderr)
        sys.exit(3)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lat = args.latent
    log(f"diffusers {diffusers.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, f32")

    t = time.perf_counter()
    unet = UNet2DConditionModel(**SD15_UNET).eval()
    unet_build_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    vae = AutoencoderKL(**SD15_VAE).eval()
    vae_build_ms = (time.perf_counter() - t) * 1e3

    x = torch.randn(2, 4, lat, lat)
    ctx = torch.randn(2, 77, 768)
    z = torch.randn(1, 4, lat, lat)
    unet_ms, vae_ms = [], []
    with torch.inference_mode():
        for i in range(args.warmup):
            unet(x, torch.tensor(500 - i), ctx)
        for i in range(args.iters):
            # A tensor timestep, as pipelines pass it; a Python int takes a different (slower on GPU) path.
            ts = torch.tensor(999 - 50 * i)
            t = time.perf_counter()
            unet(x, ts, ctx)
            unet_ms.append((time.perf_counter() - t) * 1e3)
            log(f"unet step {i}: {unet_ms[-1]:.0f} ms")
        for _ in range(args.warmup):
            vae.decode(z)
        for i in range(args.iters):
            t = time.perf_counter()
            vae.decode(z)
            vae_ms.append((time.perf_counter() - t) * 1e3)
            log(f"vae decode {i}: {vae_ms[-1]:.0f} ms")

    # ru_maxrss is in KiB on Linux: the process's high-water mark, the same quantity as VmHWM.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "threads": torch.get_num_threads(),
        "latent": lat,
        "unet_build_ms": unet_build_ms,
        "vae_build_ms": vae_build_ms,
        "unet_step_b2": timing(unet_ms),
        "vae_decode": timing(vae_ms),
        "peak_rss_bytes": peak,
    }
    print("SDHIVE_DIFFUSERS_JSON " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
