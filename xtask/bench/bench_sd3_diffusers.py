"""diffusers reference timings for SD3 / SD3.5 on a CUDA GPU, random weights with the real architectures (the figures
sdhive-bench --sd3 is compared with; xtask/bench/sd3_table.py runs both).

usage:
  python3 bench_sd3_diffusers.py write DIR --model sd3m|sd35m|sd35l --template tests/fixtures/models/sd3 [--encoders D]
      a full-size random diffusers folder (bf16 weights, made on the GPU from torch seed 0): the transformer and
      VAE of the model, CLIP-L, CLIP-G and T5-XXL (linked from --encoders, another written folder, when given);
      tokenizers, scheduler and model_index.json from the template.
  python3 bench_sd3_diffusers.py time DIR [--compile] [--no-t5] [--size 1024] [--steps 28] [--iters 2]
      the transformer step (one CFG call: batch 2, 77 + 256 context tokens) and whole images
      (StableDiffusion3Pipeline, flow Euler, CFG 7) in bf16.
  python3 bench_sd3_diffusers.py profile DIR [--compile] [--size 1024]
      the transformer step's GPU time by kernel (torch.profiler over 3 steps, per step), grouped as
      kernel_groups.py groups sdhive's, and SDPA's flash, cuDNN and efficient backends alone at the step's
      attention shapes.
Prints JSON lines {"part", "median_ms", "ms", "peak_allocated_bytes"}. --compile: torch.compile of the
transformer (mode from $CMODE, default "default": max-autotune's kernel search on every GEMM shape of SD3.5 takes
longer than a benchmark call may; compiled in the untimed warm-up)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch

from bench_cuda_diffusers import timed

DEV, DT = "cuda", torch.bfloat16
BASE = dict(attention_head_dim=64, in_channels=16, out_channels=16, patch_size=2, joint_attention_dim=4096,
            pooled_projection_dim=2048, sample_size=128)
TRANSFORMERS = {
    "sd3m": BASE | dict(num_attention_heads=24, num_layers=24, caption_projection_dim=1536, pos_embed_max_size=192),
    "sd35m": BASE | dict(num_attention_heads=24, num_layers=24, caption_projection_dim=1536, pos_embed_max_size=384,
                         qk_norm="rms_norm", dual_attention_layers=list(range(13))),
    "sd35l": BASE | dict(num_attention_heads=38, num_layers=38, caption_projection_dim=2432, pos_embed_max_size=192,
                         qk_norm="rms_norm"),
}
VAE = dict(block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
           up_block_types=["UpDecoderBlock2D"] * 4, latent_channels=16, layers_per_block=2, norm_num_groups=32,
           scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
           sample_size=1024, force_upcast=True)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              max_position_embeddings=77, hidden_act="gelu", projection_dim=1280)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24,
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
              layer_norm_epsilon=1e-6, dropout_rate=0.0)


def save(module, path: str) -> None:
    module.to(DT).save_pretrained(path, safe_serialization=True, max_shard_size="10GB")


def write(a) -> None:
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel
    torch.manual_seed(0)
    os.makedirs(a.dir, exist_ok=True)
    for sub in ["tokenizer", "tokenizer_2", "tokenizer_3", "scheduler"]:
        shutil.copytree(os.path.join(a.template, sub), os.path.join(a.dir, sub), dirs_exist_ok=True)
    shutil.copy(os.path.join(a.template, "model_index.json"), a.dir)
    t = time.time()
    with torch.device(DEV):
        save(SD3Transformer2DModel(**TRANSFORMERS[a.model]), os.path.join(a.dir, "transformer"))
        torch.cuda.empty_cache()
        save(AutoencoderKL(**VAE), os.path.join(a.dir, "vae"))
        for sub, make in [("text_encoder", lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_L))),
                          ("text_encoder_2", lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_G))),
                          ("text_encoder_3", lambda: T5EncoderModel(T5Config(**T5_XXL)))]:
            target = os.path.join(a.dir, sub)
            if a.encoders:
                if not os.path.exists(target):
                    os.symlink(os.path.abspath(os.path.join(a.encoders, sub)), target)
            else:
                save(make(), target)
            torch.cuda.empty_cache()
    print(json.dumps({"wrote": a.dir, "model": a.model, "seconds": round(time.time() - t, 1)}), flush=True)


def report(part: str, ms: list[float]) -> None:
    print(json.dumps({"part": part, "median_ms": statistics.median(ms), "ms": [round(m, 2) for m in ms],
                      "peak_allocated_bytes": torch.cuda.max_memory_allocated()}), flush=True)


def time_model(a) -> None:
    from diffusers import StableDiffusion3Pipeline
    extra = {"text_encoder_3": None, "tokenizer_3": None} if a.no_t5 else {}
    pipe = StableDiffusion3Pipeline.from_pretrained(a.dir, torch_dtype=DT, **extra).to(DEV)
    pipe.set_progress_bar_config(disable=True)
    if a.compile:
        pipe.transformer = torch.compile(pipe.transformer, mode=os.environ.get("CMODE", "default"),
                                         fullgraph=True)
    tr = pipe.transformer
    cfg = tr.config
    side = a.size // 8
    x = torch.randn(2, cfg.in_channels, side, side, device=DEV, dtype=DT)
    ctx = torch.randn(2, 77 + 256, cfg.joint_attention_dim, device=DEV, dtype=DT)
    pooled = torch.randn(2, cfg.pooled_projection_dim, device=DEV, dtype=DT)
    ts = [torch.full((2,), 1000.0 - 30 * i, device=DEV, dtype=DT) for i in range(a.steps)]
    state = {"i": 0}

    def step():
        state["i"] += 1
        tr(hidden_states=x, timestep=ts[state["i"] % len(ts)], encoder_hidden_states=ctx, pooled_projections=pooled,
           return_dict=False)

    suffix = ("-compiled" if a.compile else "") + ("-no-t5" if a.no_t5 else "")
    with torch.inference_mode():
        report("step" + suffix, timed(step, 5 if a.compile else 2, 10))
    g = torch.Generator(DEV)

    def image():
        pipe("a photo of a cat sitting on a wooden table", negative_prompt="blurry", height=a.size, width=a.size,
             num_inference_steps=a.steps, guidance_scale=7.0, generator=g.manual_seed(42), output_type="np")

    report("e2e" + suffix, timed(image, 1, a.iters))


def attention_shapes(cfg, side: int) -> list[tuple[str, int, int]]:
    """(what, query/key tokens, heads) of the step's attention calls: the joint one, and MMDiT-X's image-only one."""
    image = (side // cfg.patch_size) ** 2
    out = [("joint", image + 77 + 256, cfg.num_attention_heads)]
    if cfg.get("dual_attention_layers"):
        out.append(("image", image, cfg.num_attention_heads))
    return out


def profile_model(a) -> None:
    from diffusers import SD3Transformer2DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile
    from kernel_groups import print_groups
    tr = SD3Transformer2DModel.from_pretrained(os.path.join(a.dir, "transformer"), torch_dtype=DT).to(DEV)
    if a.compile:
        tr = torch.compile(tr, mode=os.environ.get("CMODE", "default"), fullgraph=True)
    cfg = tr.config
    side = a.size // 8
    x = torch.randn(2, cfg.in_channels, side, side, device=DEV, dtype=DT)
    ctx = torch.randn(2, 77 + 256, cfg.joint_attention_dim, device=DEV, dtype=DT)
    pooled = torch.randn(2, cfg.pooled_projection_dim, device=DEV, dtype=DT)
    t = torch.full((2,), 500.0, device=DEV, dtype=DT)

    def step():
        tr(hidden_states=x, timestep=t, encoder_hidden_states=ctx, pooled_projections=pooled, return_dict=False)

    with torch.inference_mode():
        for _ in range(5 if a.compile else 2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3 / 3, e.count // 3) for e in prof.key_averages()
            if e.device_time_total > 0]
    print_groups("diffusers" + (" compiled" if a.compile else " eager"), rows)
    for what, n, heads in attention_shapes(cfg, side):
        q, k, v = (torch.randn(2, heads, n, cfg.attention_head_dim, device=DEV, dtype=DT) for _ in range(3))
        flop = 4 * 2 * heads * n * n * cfg.attention_head_dim
        for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
            try:
                with sdpa_kernel(backend), torch.inference_mode():
                    ms = statistics.median(timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                                                 3, 20))
                print(json.dumps({"part": f"sdpa-{name}", "shape": [2, n, heads, cfg.attention_head_dim],
                                  "what": what, "median_ms": ms, "tflops": flop / ms / 1e9}), flush=True)
            except RuntimeError as e:
                print(json.dumps({"part": f"sdpa-{name}", "what": what, "error": str(e)[:200]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("dir")
    w.add_argument("--model", choices=sorted(TRANSFORMERS), required=True)
    w.add_argument("--template", required=True)
    w.add_argument("--encoders")
    t = sub.add_parser("time")
    t.add_argument("dir")
    t.add_argument("--compile", action="store_true")
    t.add_argument("--no-t5", action="store_true")
    t.add_argument("--size", type=int, default=1024)
    t.add_argument("--steps", type=int, default=28)
    t.add_argument("--iters", type=int, default=2)
    p = sub.add_parser("profile")
    p.add_argument("dir")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--size", type=int, default=1024)
    a = ap.parse_args()
    {"write": write, "time": time_model, "profile": profile_model}[a.cmd](a)


if __name__ == "__main__":
    main()
