"""diffusers reference timings on a CUDA GPU, random weights with the real SD1.5 / SDXL architectures, fp16:
the figures `sdhive-bench --device cuda` is compared with (docs/benchmarks.md, CUDA section).
usage: python3 bench_cuda_diffusers.py            eager (SDPA) UNet steps + VAE decode
       python3 bench_cuda_diffusers.py compile    SD1.5 UNet under torch.compile(mode=reduce-overhead)
Needs torch and diffusers (a diffusers wheel + importlib_metadata can be installed with --no-deps).
Same work as sdhive-bench: UNet one CFG step (batch 2, 77 context tokens), VAE decode of one latent."""
import os, sys, time, torch
from diffusers import UNet2DConditionModel, AutoencoderKL

torch.manual_seed(0)
dev, dt = "cuda", torch.float16
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


def bench_unet(cfg, lat, ctx, extra=None, label="", compile=False, n=20):
    unet = UNet2DConditionModel(**cfg).to(dev, dt).eval()
    if compile:
        unet = torch.compile(unet, mode=os.environ.get("CMODE", "reduce-overhead"), fullgraph=True)
    x = torch.randn(2, 4, lat, lat, device=dev, dtype=dt)
    e = torch.randn(2, 77, ctx, device=dev, dtype=dt)
    kw = {} if extra is None else {"added_cond_kwargs": extra}
    ts = [torch.tensor(999 - i * 50, device=dev) for i in range(n)]  # device tensors: ints force a sync per step
    with torch.inference_mode():
        for i in range(5):
            unet(x, ts[i % n], e, **kw)
        torch.cuda.synchronize(); t = time.perf_counter()
        for i in range(n):
            unet(x, ts[i], e, **kw)
        torch.cuda.synchronize(); s = time.perf_counter() - t
    print(f"diffusers_{label}: {n / s:.2f} it/s ({s * 1000 / n:.1f} ms/step)", flush=True)
    del unet; torch.cuda.empty_cache()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "compile":
        bench_unet(SD15, 64, 768, label="sd15_unet_b2_512_compiled", compile=True, n=40)
        sys.exit(0)
    bench_unet(SD15, 64, 768, label="sd15_unet_b2_512_sdpa")
    vae = AutoencoderKL(**SD15_VAE).to(dev, dt).eval()
    z = torch.randn(1, 4, 64, 64, device=dev, dtype=dt)
    with torch.inference_mode():
        vae.decode(z); torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(3):
            vae.decode(z)
        torch.cuda.synchronize()
    print(f"diffusers_sd15_vae_decode_512: {(time.perf_counter() - t) * 1000 / 3:.1f} ms", flush=True)
    del vae
    extra = {"text_embeds": torch.randn(2, 1280, device=dev, dtype=dt), "time_ids": torch.randn(2, 6, device=dev, dtype=dt)}
    bench_unet(SDXL, 128, 2048, extra, label="sdxl_unet_b2_1024_sdpa", n=10)
