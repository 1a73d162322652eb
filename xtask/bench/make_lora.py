"""A random LoRA for a diffusers model folder, for the LoRA benchmark: rank R on every attention projection
(to_q, to_k, to_v, to_out.0), the transformers' proj_in / proj_out and feed-forward, and every convolution of the
ResNets and resamplers (conv1, conv2, conv_shortcut, down/upsampler conv) of the UNet, written in the diffusers /
PEFT layout (`unet.<module>.lora_A.weight`, `lora_B.weight`) that both sdhive and diffusers' `load_lora_weights`
read. Values are small normals (seeded), so the merged model stays finite. Needs numpy and safetensors only.

    python3 make_lora.py MODEL_DIR OUT.safetensors [--rank 32] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct

import numpy as np
from safetensors.numpy import save_file

TARGETS = re.compile(
    r"(attn[12]\.(to_q|to_k|to_v|to_out\.0)|proj_in|proj_out|ff\.net\.0\.proj|ff\.net\.2"
    r"|resnets\.\d+\.(conv1|conv2|conv_shortcut)|(down|up)samplers\.0\.conv)\.weight$"
)


def header_shapes(path: str) -> dict[str, list[int]]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def unet_weights(model_dir: str) -> dict[str, list[int]]:
    unet = os.path.join(model_dir, "unet")
    shapes: dict[str, list[int]] = {}
    for name in sorted(os.listdir(unet)):
        if name.endswith(".safetensors"):
            shapes.update(header_shapes(os.path.join(unet, name)))
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in unet_weights(args.model_dir).items():
        if not TARGETS.search(name) or len(shape) not in (2, 4):
            continue
        module = name[: -len(".weight")]
        r = min(args.rank, shape[0], shape[1])
        if len(shape) == 2:
            a = rng.standard_normal((r, shape[1]), dtype=np.float32) / np.sqrt(shape[1])
            b = rng.standard_normal((shape[0], r), dtype=np.float32) * (0.01 / np.sqrt(r))
        else:
            fan_in = shape[1] * shape[2] * shape[3]
            a = rng.standard_normal((r, shape[1], shape[2], shape[3]), dtype=np.float32) / np.sqrt(fan_in)
            b = rng.standard_normal((shape[0], r, 1, 1), dtype=np.float32) * (0.01 / np.sqrt(r))
        out[f"unet.{module}.lora_A.weight"] = a.astype(np.float16)
        out[f"unet.{module}.lora_B.weight"] = b.astype(np.float16)
    if not out:
        raise SystemExit(f"no LoRA targets found in {args.model_dir}/unet")
    save_file(out, args.out)
    size = sum(v.nbytes for v in out.values())
    print(f"wrote {args.out}: {len(out) // 2} modules, rank {args.rank}, {size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
