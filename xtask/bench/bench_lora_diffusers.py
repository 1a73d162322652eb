"""diffusers' side of the LoRA benchmark, on the same model folder and LoRA files as sdhive-bench --lora-model:
`load_lora_weights` + `fuse_lora` of the first LoRA (from none; `unfuse_lora` + `unload_lora_weights` untimed
between runs), a switch to the other LoRA (unfuse, unload, load, fuse), and the UNet's CFG step (batch 2, 20-step
schedule queued back to back) plain and with the LoRA fused. Prints one JSON line.

    python3 bench_lora_diffusers.py MODEL_DIR LORA_A LORA_B [ITERS]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from diffusers import DiffusionPipeline


def timed(f) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    model, a, b = sys.argv[1:4]
    iters = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    pipe = DiffusionPipeline.from_pretrained(model, torch_dtype=torch.float16).to("cuda")
    unet = pipe.unet
    cfg = unet.config
    # The bench models are written from the tiny fixtures' configs (64 pixels): the family's native size instead.
    side = 128 if cfg.addition_embed_type == "text_time" else 64
    dev, dt = "cuda", torch.float16
    sample = torch.randn(2, 4, side, side, device=dev, dtype=dt)
    ctx_dim = cfg.cross_attention_dim if isinstance(cfg.cross_attention_dim, int) else cfg.cross_attention_dim[0]
    context = torch.randn(2, 77, ctx_dim, device=dev, dtype=dt)
    added = None
    if cfg.addition_embed_type == "text_time":
        pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        added = {"text_embeds": torch.randn(2, pooled, device=dev, dtype=dt),
                 "time_ids": torch.randn(2, 6, device=dev, dtype=dt)}
    timesteps = [999 - 50 * i for i in range(20)]

    @torch.no_grad()
    def schedule() -> None:
        for t in timesteps:
            unet(sample, t, encoder_hidden_states=context, added_cond_kwargs=added)

    def step_ms() -> list[float]:
        schedule()
        return [timed(schedule) / len(timesteps) for _ in range(iters)]

    def unload() -> None:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()

    def load(path: str) -> None:
        pipe.load_lora_weights(path, adapter_name="x")
        pipe.fuse_lora()

    plain = step_ms()
    load(a)
    unload()
    apply = []
    for _ in range(iters):
        apply.append(timed(lambda: load(a)))
        print(f"diffusers apply: {apply[-1]:.0f} ms", file=sys.stderr, flush=True)
        unload()
    load(a)
    fused = step_ms()
    switch = []
    for i in range(iters):
        nxt = b if i % 2 == 0 else a
        switch.append(timed(lambda: (unload(), load(nxt))))
        print(f"diffusers switch: {switch[-1]:.0f} ms", file=sys.stderr, flush=True)
    print(json.dumps({"plain_step_ms": statistics.median(plain), "fused_step_ms": statistics.median(fused),
                      "apply_ms": statistics.median(apply), "switch_ms": statistics.median(switch),
                      "apply": apply, "switch": switch}), flush=True)


if __name__ == "__main__":
    main()
