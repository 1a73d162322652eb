"""The hires-fix benchmark on a GPU machine: SD1.5 512² → 1024² (20 steps, "Latent" ×2, a second pass of 20 steps
at strength 0.5: 10 run), fp16, random full-size weights (written by sdhive-bench --write-model), end to end per
image: sdhive-bench --e2e --hires against diffusers composed the same way (bench_hires_diffusers.py), alternated
twice so both see the same machine state. Prints a markdown table and writes OUT_DIR/hires.json. run.sh calls it
with `--hires`:

    bash BUNDLE/run.sh OUT_DIR --hires
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench_run import run_json

BUNDLE, OUT = sys.argv[1], sys.argv[2]
BIN = os.path.join(BUNDLE, "bin")
MODEL = "/tmp/bench_sd15"
ITERS = "5"




def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    bench = os.path.join(BIN, "sdhive-bench")
    if not os.path.exists(os.path.join(MODEL, "model_index.json")):
        subprocess.run([bench, "--write-model", MODEL, "--model", "sd15", "--template", "tests/fixtures/models/sd1"],
                       check=True)
    ours, ref = [], []
    for _ in range(2):
        ours.append(run_json(OUT, [bench, "--device", "cuda", "--dtype", "f16", "--model", "sd15", "--e2e", MODEL,
                                   "--hires", "--size", "512", "--steps", "20", "--iters", ITERS, "--warmup", "1"],
                             "hires_ours.log", append=True)[0])
        ref.append(run_json(OUT, [sys.executable, os.path.join(BUNDLE, "bench_hires_diffusers.py"), MODEL, ITERS],
                            "hires_diffusers.log", append=True)[0])
    with open(os.path.join(OUT, "hires.json"), "w") as f:
        json.dump({"ours": ours, "diffusers": ref}, f, indent=1)
    o = min(r["e2e"]["median_ms"] for r in ours)
    d = min(r["median_ms"] for r in ref)
    print(f"| SD1.5 hires 512² → 1024² (20 + 10 steps), f16, {ref[0]['device']} | s/image | vs diffusers |")
    print("|---|---|---|")
    print(f"| sdhive | {o / 1000:.2f} | {o / d:.2f}× |")
    print(f"| diffusers {ref[0]['diffusers']} composed (eager, torch {ref[0]['torch']}) | {d / 1000:.2f} | 1.00× |")
    print(f"\ntarget ≤ 0.50× diffusers: {'met' if o <= 0.5 * d else 'NOT met'} ({o / d:.2f}×); runs: ours "
          f"{[round(r['e2e']['median_ms']) for r in ours]} ms, diffusers {[round(r['median_ms']) for r in ref]} ms")


if __name__ == "__main__":
    main()
