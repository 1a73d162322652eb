"""The model-switch benchmark on a GPU machine: full-size random SD1.5 and SDXL (f16 diffusers folders written by
sdhive-bench), switched by sdhive-bench from disk (page cache warm) and from the RAM cache, against diffusers'
`from_pretrained(...).to("cuda")` of the same folders, in one run. Prints a markdown table and writes
OUT_DIR/switch.json. run.sh calls it with `--switch`:

    bash BUNDLE/run.sh OUT_DIR --switch
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from bench_run import run_json

BUNDLE, OUT = sys.argv[1], sys.argv[2]
BIN = os.path.join(BUNDLE, "bin")
MODELS = [("sd15", "sd1", "/tmp/bench_sd15"), ("sdxl", "sdxl", "/tmp/bench_sdxl")]




def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    bench = os.path.join(BIN, "sdhive-bench")
    for fam, tmpl, path in MODELS:
        if not os.path.exists(os.path.join(path, "model_index.json")):
            subprocess.run([bench, "--write-model", path, "--model", fam, "--template",
                            f"tests/fixtures/models/{tmpl}"], check=True)
    dirs = [p for _, _, p in MODELS]
    ours = run_json(OUT, [bench, "--device", "cuda", "--dtype", "f16", *[a for d in dirs for a in ("--switch", d)],
                  "--switches", "20"], "switch_ours.log")[0]
    ref = {r["model"]: r["ms"] for r in run_json(OUT, [sys.executable, os.path.join(BUNDLE, "bench_switch_diffusers.py"),
                                               *dirs], "switch_diffusers.log")}
    with open(os.path.join(OUT, "switch.json"), "w") as f:
        json.dump({"ours": ours, "diffusers": ref}, f, indent=1)
    print("| model | sdhive from disk | from disk, filling the RAM cache | from the RAM cache | diffusers from_pretrained + .to(cuda) | disk / diffusers | RAM cache / diffusers |")
    print("|---|---|---|---|---|---|---|")
    for (fam, _, path), row in zip(MODELS, ours["switch"]):
        d = statistics.median(ref[path])
        disk, ram = row["disk"]["median_ms"], row["ram"]["median_ms"]
        fill = row["disk_into_cache_ms"]
        print(f"| {fam} | {disk / 1e3:.2f} s | {fill / 1e3:.2f} s | {ram / 1e3:.2f} s | {d / 1e3:.2f} s | "
              f"{disk / d:.2f}× | {ram / d:.2f}× |")
    used = [u for u in ours["device_used_bytes"] if u is not None]
    if used:
        print(f"\ndevice used after {len(used)} cached switches: first {used[0] >> 20} MiB, last {used[-1] >> 20} MiB, "
              f"max {max(used) >> 20} MiB; host cache {ours['host_cache_bytes'] >> 20} MiB")


if __name__ == "__main__":
    main()
