"""diffusers' side of `cargo xtask bench cpu`: the SD1.5 UNet and VAE with random weights on the CPU in float32.

One CFG UNet step (batch 2, latent 32x32 = 256x256 pixels, 77x768 text context) and one VAE decode of a 256x256
image, both networks alive together as in sdhive-bench, then the process's peak RSS. The architecture dicts are
the diffusers config fields of runwayml/stable-diffusion-v1-5 (unet/ and vae/).

usage: python bench_cpu_diffusers.py [--iters N] [--warmup N] [--threads N] [--latent N] [--serve]
Prints one line `SDHIVE_DIFFUSERS_JSON {...}` on stdout (progress on stderr); exit 3 when torch or diffusers
cannot be imported, so the caller can say why it has no reference figures.

With --serve it speaks sdhive-bench's protocol instead: after building both networks it prints
`{"ready": true, ...}`, then answers each stdin command (`unet`, `vae`, `report`, `quit`) with one JSON line, so
`cargo xtask bench cpu` can alternate single calls of both implementations under the same background load.
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


def timing(calls):
    ms = [c["ms"] for c in calls]
    return {
        "ms": ms,
        "cpu_ms": [c["cpu_ms"] for c in calls],
        "median_ms": statistics.median(ms),
        "mean_ms": statistics.fmean(ms),
        "min_ms": min(ms),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--latent", type=int, default=32)
    ap.add_argument("--serve", action="store_true")
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
    calls = {"unet": 0}

    def unet_step():
        # A tensor timestep, as pipelines pass it; it moves like a sampler's so no call is special.
        ts = torch.tensor(999 - 50 * (calls["unet"] % 20))
        calls["unet"] += 1
        return timed(lambda: unet(x, ts, ctx))

    def vae_decode():
        return timed(lambda: vae.decode(z))

    def report(unet_timing=None, vae_timing=None):
        # ru_maxrss is in KiB on Linux: the process's high-water mark, the same quantity as VmHWM.
        return {
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "threads": torch.get_num_threads(),
            "latent": lat,
            "unet_build_ms": unet_build_ms,
            "vae_build_ms": vae_build_ms,
            "unet_step_b2": unet_timing,
            "vae_decode": vae_timing,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }

    with torch.inference_mode():
        if args.serve:
            say({"ready": True, "threads": torch.get_num_threads()})
            for line in sys.stdin:
                cmd = line.strip()
                if cmd == "unet":
                    say(unet_step())
                elif cmd == "vae":
                    say(vae_decode())
                elif cmd == "report":
                    say(report())
                elif cmd in ("quit", ""):
                    break
                else:
                    log(f"unknown command {cmd!r} (expected unet, vae, report or quit)")
                    sys.exit(2)
            return
        for _ in range(args.warmup):
            unet_step()
        unet_calls = []
        for i in range(args.iters):
            unet_calls.append(unet_step())
            log(f"unet step {i}: {unet_calls[-1]['ms']:.0f} ms (cpu {unet_calls[-1]['cpu_ms']:.0f} ms)")
        for _ in range(args.warmup):
            vae_decode()
        vae_calls = []
        for i in range(args.iters):
            vae_calls.append(vae_decode())
            log(f"vae decode {i}: {vae_calls[-1]['ms']:.0f} ms (cpu {vae_calls[-1]['cpu_ms']:.0f} ms)")
    print("SDHIVE_DIFFUSERS_JSON " + json.dumps(report(timing(unet_calls), timing(vae_calls))), flush=True)


def timed(fn):
    t, c = time.perf_counter(), time.process_time()
    fn()
    return {"ms": (time.perf_counter() - t) * 1e3, "cpu_ms": (time.process_time() - c) * 1e3}


def say(obj):
    print(json.dumps(obj), flush=True)


if __name__ == "__main__":
    main()
