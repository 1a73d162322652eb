"""The LoRA benchmark on a GPU machine: a full-size random SDXL (f16 diffusers folder written by sdhive-bench) and
two random rank-32 LoRAs on every attention and convolution layer of its UNet (make_lora.py), merged and switched
by sdhive-bench --lora-model and by diffusers' load_lora_weights + fuse_lora (bench_lora_diffusers.py), in one run.
Prints a markdown table and writes OUT_DIR/lora.json. run.sh calls it with `--lora`:

    bash BUNDLE/run.sh OUT_DIR --lora
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench_run import run_json

BUNDLE, OUT = sys.argv[1], sys.argv[2]
BIN = os.path.join(BUNDLE, "bin")
MODEL = "/tmp/bench_sdxl"
LORAS = ["/tmp/bench_lora_a.safetensors", "/tmp/bench_lora_b.safetensors"]




def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    bench = os.path.join(BIN, "sdhive-bench")
    if not os.path.exists(os.path.join(MODEL, "model_index.json")):
        subprocess.run([bench, "--write-model", MODEL, "--model", "sdxl", "--template", "tests/fixtures/models/sdxl"],
                       check=True)
    for seed, path in enumerate(LORAS):
        if not os.path.exists(path):
            subprocess.run([sys.executable, os.path.join(BUNDLE, "make_lora.py"), MODEL, path, "--rank", "32",
                            "--seed", str(seed)], check=True)
    ours = run_json(OUT, [bench, "--device", "cuda", "--dtype", "f16", "--lora-model", MODEL, "--lora", LORAS[0],
                  "--lora", LORAS[1], "--iters", "7"], "lora_ours.log")[0]
    ref = run_json(OUT, [sys.executable, os.path.join(BUNDLE, "bench_lora_diffusers.py"), MODEL, *LORAS, "5"],
                "lora_diffusers.log")[0]
    with open(os.path.join(OUT, "lora.json"), "w") as f:
        json.dump({"ours": ours, "diffusers": ref}, f, indent=1)
    m = lambda k: ours[k]["median_ms"]
    print("| SDXL, f16, rank-32 LoRA on every attention and conv layer | sdhive | diffusers (load_lora_weights + fuse_lora) | ratio |")
    print("|---|---|---|---|")
    print(f"| merge one LoRA (from none) | {m('apply'):.0f} ms | {ref['apply_ms']:.0f} ms | {m('apply') / ref['apply_ms']:.2f}× |")
    print(f"| switch to the other LoRA | {m('switch'):.0f} ms | {ref['switch_ms']:.0f} ms | {m('switch') / ref['switch_ms']:.2f}× |")
    first = ours["first_merge_phases"]
    print(f"| first use of a LoRA (file read and parsed) | {ours['first_merge_ms']:.0f} ms (reading {first['read_ms']:.0f} ms) | – | – |")
    print(f"| take the LoRA out | {m('remove'):.0f} ms | – | – |")
    print(f"| UNet step, plain | {m('plain_step'):.2f} ms | {ref['plain_step_ms']:.2f} ms | {m('plain_step') / ref['plain_step_ms']:.2f}× |")
    print(f"| UNet step, LoRA merged | {m('merged_step'):.2f} ms | {ref['fused_step_ms']:.2f} ms | {m('merged_step') / ref['fused_step_ms']:.2f}× |")
    for what in ("apply", "switch"):
        p = ours[f"{what}_phases"]
        print(f"{what}: host time restoring {p['restore_ms']:.0f} ms, reading files {p['read_ms']:.0f} ms, "
              f"resolving and merging {p['merge_ms']:.0f} ms (medians; the rest is the device finishing)")
    check = ours["merge_check"]
    print(f"\nmerged in place vs built from host weights with the deltas added (UNet output, max |diff| / max |out|): "
          f"{check['merged_vs_host_merged']:.2e}; the plain network vs that: {check['plain_vs_host_merged']:.2e}")
    used = ours["device_used_bytes"]
    print(f"\nkept to take the LoRA out: {ours['kept_bytes'] / 2**20:.0f} MiB of device memory; device used plain "
          f"{(used['plain'] or 0) >> 20} MiB, merged {(used['merged'] or 0) >> 20} MiB, after removal "
          f"{(used['after_removal'] or 0) >> 20} MiB")


if __name__ == "__main__":
    main()
