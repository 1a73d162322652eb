"""diffusers' side of the switch benchmark: each model loaded as a model switch loads it (the previous pipeline freed
first, the files in the page cache: one untimed load of each first) — a diffusers folder with
`DiffusionPipeline.from_pretrained(dir, torch_dtype=float16).to("cuda")`, a single-file checkpoint (`X.safetensors`,
its config the folder `X/` beside it) with the folder's pipeline class' `from_single_file(file, config=X,
torch_dtype=float16).to("cuda")`. Prints one JSON line {"model": path, "ms": [...]} per model.

    python3 bench_switch_diffusers.py PATH [PATH ...]
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import diffusers
import torch
from diffusers import DiffusionPipeline

LOADS = 3


def pipeline(path: str):
    if not path.endswith(".safetensors"):
        return DiffusionPipeline.from_pretrained(path, torch_dtype=torch.float16)
    config = path.removesuffix(".safetensors")
    with open(os.path.join(config, "model_index.json")) as f:
        index = json.load(f)
    cls = getattr(diffusers, index["_class_name"])
    # What the folder leaves out stays out (sdhive has no safety checker either).
    absent = {k: None for k in ("safety_checker", "feature_extractor", "image_encoder") if k in index}
    return cls.from_single_file(path, config=config, local_files_only=True, torch_dtype=torch.float16, **absent)


def load(path: str) -> float:
    t = time.perf_counter()
    pipe = pipeline(path).to("cuda")
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    del pipe
    gc.collect()
    torch.cuda.empty_cache()
    return ms


def main() -> None:
    paths = sys.argv[1:]
    for p in paths:
        load(p)
    times: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(LOADS):
        for p in paths:
            times[p].append(load(p))
            print(f"diffusers {p}: {times[p][-1]:.0f} ms", file=sys.stderr, flush=True)
    for p in paths:
        print(json.dumps({"model": p, "ms": times[p]}), flush=True)


if __name__ == "__main__":
    main()
