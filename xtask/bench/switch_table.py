"""The model-switch benchmark on a GPU machine: full-size random SD1.5 and SDXL, as f16 diffusers folders (written by
sdhive-bench) and as single-file checkpoints in the original LDM / SGM layout (the same weights, converted here by
gen_single_file.py and checked against diffusers' own `from_single_file` reading, weight by weight), switched by
sdhive-bench from disk (page cache warm) and from the RAM cache, against diffusers' `from_pretrained(...)` /
`from_single_file(...)` + `.to("cuda")` of the same files, in one run. Each format is one sdhive-bench run of 20
cached switches, with the device memory after each. Prints a markdown table and writes OUT_DIR/switch.json. run.sh
calls it with `--switch`:

    bash BUNDLE/run.sh OUT_DIR --switch [--folders-only | --files-only]
    python3 switch_table.py --table OUT_DIR/switch.json      (the table again, from a run's JSON)

A single file sits beside its folder (`/tmp/bench_sd15.safetensors` next to `/tmp/bench_sd15/`): the folder is the
file's config for both sides (sdhive reads a same-named folder beside a checkpoint as diffusers reads `config=`),
because the random text encoders' vocabulary is the fixture tokenizer's, not CLIP's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from bench_run import run_json

MODELS = [("sd15", "sd1", "/tmp/bench_sd15"), ("sdxl", "sdxl", "/tmp/bench_sdxl")]
SWITCHES = "20"


def single_file(fam: str, folder: str) -> str:
    """`folder`.safetensors in the original layout, written once (staged, checked by diffusers, then renamed)."""
    path = folder + ".safetensors"
    if os.path.exists(path):
        return path
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    import gen_single_file as g

    src = Path(folder)
    ckpt = g.build_sdxl(src) if fam == "sdxl" else g.build_sd(src, openclip=False)
    ckpt = g.cast(ckpt, torch.float16)
    staged = Path(path + ".partial.safetensors")
    save_file(ckpt, str(staged), metadata={"format": "pt"})
    del ckpt
    pipeline, components = {"sd15": ("StableDiffusionPipeline", ["unet", "vae", "text_encoder"]),
                            "sdxl": ("StableDiffusionXLPipeline",
                                     ["unet", "vae", "text_encoder", "text_encoder_2"])}[fam]
    g.verify(staged, src, pipeline, components, torch.float16)
    os.replace(staged, path)
    print(f"wrote {path} ({os.path.getsize(path) >> 20} MiB)", flush=True)
    return path


def ours(bench: str, out: str, paths: list[str], log: str) -> dict:
    return run_json(out, [bench, "--device", "cuda", "--dtype", "f16", *[a for p in paths for a in ("--switch", p)],
                          "--switches", SWITCHES], log)[0]


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--table":
        with open(sys.argv[2]) as f:
            print(table(json.load(f)))
        return
    bundle, out = sys.argv[1], sys.argv[2]
    flags = set(sys.argv[3:])
    unknown = flags - {"--folders-only", "--files-only"}
    if unknown or len(flags) > 1:
        raise SystemExit(f"usage: switch_table.py BUNDLE OUT_DIR [--folders-only | --files-only] (got {sys.argv[3:]})")
    os.makedirs(out, exist_ok=True)
    bench = os.path.join(bundle, "bin", "sdhive-bench")
    for fam, tmpl, path in MODELS:
        if not os.path.exists(os.path.join(path, "model_index.json")):
            subprocess.run([bench, "--write-model", path, "--model", fam, "--template",
                            f"tests/fixtures/models/{tmpl}"], check=True)
    runs = []
    if "--files-only" not in flags:
        runs.append(("folder", [p for _, _, p in MODELS]))
    if "--folders-only" not in flags:
        sys.path.insert(0, bundle)
        runs.append(("single file", [single_file(fam, p) for fam, _, p in MODELS]))
    res: dict = {"runs": []}
    for fmt, paths in runs:
        tag = fmt.replace(" ", "_")
        o = ours(bench, out, paths, f"switch_ours_{tag}.log")
        ref = {r["model"]: r["ms"] for r in run_json(out, [sys.executable, os.path.join(bundle,
                                                                                         "bench_switch_diffusers.py"),
                                                           *paths], f"switch_diffusers_{tag}.log")}
        res["runs"].append({"format": fmt, "paths": paths, "ours": o, "diffusers": ref})
    with open(os.path.join(out, "switch.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(table(res))


def table(res: dict) -> str:
    lines = ["| model | format | sdhive from disk | from disk, filling the RAM cache | from the RAM cache | "
             "diffusers `from_pretrained` / `from_single_file` + .to(cuda) | disk / diffusers | RAM cache / diffusers |",
             "|---|---|---|---|---|---|---|---|"]
    notes = []
    for run in res["runs"]:
        o, ref = run["ours"], run["diffusers"]
        for (fam, _, _), path, row in zip(MODELS, run["paths"], o["switch"]):
            d = statistics.median(ref[path])
            disk, ram = row["disk"]["median_ms"], row["ram"]["median_ms"]
            fill = row["disk_into_cache_ms"]
            lines.append(f"| {fam} | {run['format']} | {disk / 1e3:.2f} s | {fill / 1e3:.2f} s | {ram / 1e3:.2f} s | "
                         f"{d / 1e3:.2f} s | {disk / d:.2f}× | {ram / d:.2f}× |")
        used = [u for u in o["device_used_bytes"] if u is not None]
        if used:
            notes.append(f"{run['format']}s: device used after {len(used)} cached switches: first {used[0] >> 20} "
                         f"MiB, last {used[-1] >> 20} MiB, max {max(used) >> 20} MiB; host cache "
                         f"{o['host_cache_bytes'] >> 20} MiB")
    return "\n".join(lines + [""] + notes)


if __name__ == "__main__":
    main()
