"""diffusers' side of the switch benchmark: `from_pretrained(dir, torch_dtype=float16).to("cuda")` of each model
folder, timed as a model switch is (the previous pipeline freed first, the files in the page cache: one
untimed load of each first). Prints one JSON line: {"model": dir, "ms": [...]} per model.

    python3 bench_switch_diffusers.py DIR [DIR ...]
"""

from __future__ import annotations

import gc
import json
import sys
import time

import torch
from diffusers import DiffusionPipeline

LOADS = 3


def load(path: str) -> float:
    t = time.perf_counter()
    pipe = DiffusionPipeline.from_pretrained(path, torch_dtype=torch.float16).to("cuda")
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    del pipe
    gc.collect()
    torch.cuda.empty_cache()
    return ms


def main() -> None:
    dirs = sys.argv[1:]
    for d in dirs:
        load(d)
    times: dict[str, list[float]] = {d: [] for d in dirs}
    for _ in range(LOADS):
        for d in dirs:
            times[d].append(load(d))
            print(f"diffusers {d}: {times[d][-1]:.0f} ms", file=sys.stderr, flush=True)
    for d in dirs:
        print(json.dumps({"model": d, "ms": times[d]}), flush=True)


if __name__ == "__main__":
    main()
