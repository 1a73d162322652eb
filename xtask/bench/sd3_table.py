"""The SD3.5 benchmark on a GPU machine: full-size random SD3.5-medium and SD3.5-large (bf16, written by
bench_sd3_diffusers.py on first use), 1024², 28 flow-Euler steps, CFG 7. For each model: sdhive-bench --sd3 (the
candle engine's SD3 pipeline) against diffusers' StableDiffusion3Pipeline eager and with the transformer compiled,
each in its own process, with its peak device memory (nvidia-smi, CUDA context included); then both sides with T5
left out (the 24 GB question for SD3.5-large). Prints a markdown table and writes OUT_DIR/sd3_<models>.json. run.sh calls it
with `--sd3`:

    bash BUNDLE/run.sh OUT_DIR --sd3 [--models sd35m,sd35l] [--skip-compiled]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench_run import run_json_peak

BUNDLE, OUT = sys.argv[1], sys.argv[2]
BIN = os.path.join(BUNDLE, "bin")
SCRIPT = os.path.join(BUNDLE, "bench_sd3_diffusers.py")
TEMPLATE = "tests/fixtures/models/sd3"
ROOT = os.environ.get("SD3_BENCH_DIR", "/tmp/bench_sd3")
NAMES = {"sd35m": "SD3.5-medium", "sd35l": "SD3.5-large", "sd3m": "SD3-medium"}


def folder(model: str) -> str:
    """The model's folder, written first if missing; text encoders are shared with another model's folder."""
    d = os.path.join(ROOT, model)
    if not os.path.exists(os.path.join(d, "transformer", "config.json")):
        cmd = [sys.executable, SCRIPT, "write", d, "--model", model, "--template", TEMPLATE]
        others = [os.path.join(ROOT, m) for m in NAMES if m != model]
        encoders = [o for o in others if os.path.exists(os.path.join(o, "text_encoder_3", "config.json"))]
        subprocess.run(cmd + (["--encoders", encoders[0]] if encoders else []), check=True)
    return d


def side(label: str, cmd: list[str], log: str) -> dict:
    rows, peak = run_json_peak(OUT, cmd, log)
    print(f"{label}: peak {peak} MiB; {json.dumps(rows)}", flush=True)
    return {"rows": rows, "peak_mib": peak}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="sd35m,sd35l")
    ap.add_argument("--skip-compiled", action="store_true")
    ap.add_argument("--iters", default="2")
    a = ap.parse_args(sys.argv[3:])
    os.makedirs(OUT, exist_ok=True)
    bench = os.path.join(BIN, "sdhive-bench")
    results: dict = {}
    for model in a.models.split(","):
        d = folder(model)
        ours = [bench, "--device", "cuda", "--dtype", "bf16", "--sd3", d, "--size", "1024", "--steps", "28",
                "--iters", a.iters, "--warmup", "1"]
        ref = [sys.executable, SCRIPT, "time", d, "--iters", a.iters]
        r = {"ours": side(f"{model} sdhive", ours, f"sd3_{model}_ours.log"),
             "eager": side(f"{model} diffusers", ref, f"sd3_{model}_diffusers.log")}
        if not a.skip_compiled:
            r["compiled"] = side(f"{model} diffusers compiled", ref + ["--compile"], f"sd3_{model}_compiled.log")
        r["ours_no_t5"] = side(f"{model} sdhive no T5", ours + ["--no-t5"], f"sd3_{model}_ours_no_t5.log")
        r["eager_no_t5"] = side(f"{model} diffusers no T5", ref + ["--no-t5"], f"sd3_{model}_diffusers_no_t5.log")
        results[model] = r
        with open(os.path.join(OUT, f"sd3_{a.models.replace(',', '_')}.json"), "w") as f:
            json.dump(results, f, indent=1)
    print("\n| model, 1024², 28 steps, CFG 7, bf16 | step ms | s/image | peak MiB | step vs diffusers | s/image vs |")
    print("|---|---|---|---|---|---|")
    for model, r in results.items():
        o = r["ours"]["rows"][0]
        ref_rows = {k: {row["part"].split("-")[0]: row for row in v["rows"]} for k, v in r.items() if not k.startswith("ours")}
        e = ref_rows["eager"]
        print(f"| {NAMES[model]} sdhive | {o['step']['median_ms']:.1f} | {o['e2e']['median_ms'] / 1000:.2f} | "
              f"{r['ours']['peak_mib']} | {o['step']['median_ms'] / e['step']['median_ms']:.2f}× eager | "
              f"{o['e2e']['median_ms'] / e['e2e']['median_ms']:.2f}× eager |")
        for k in ["eager", "compiled"]:
            if k in ref_rows:
                x = ref_rows[k]
                print(f"| {NAMES[model]} diffusers {k} | {x['step']['median_ms']:.1f} | "
                      f"{x['e2e']['median_ms'] / 1000:.2f} | {r[k]['peak_mib']} | | |")
        if "ours_no_t5" in r:
            on = r["ours_no_t5"]["rows"][0]
            en = ref_rows["eager_no_t5"]
            print(f"| {NAMES[model]} no T5 sdhive | | {on['e2e']['median_ms'] / 1000:.2f} | "
                  f"{r['ours_no_t5']['peak_mib']} | | |")
            print(f"| {NAMES[model]} no T5 diffusers eager | | {en['e2e']['median_ms'] / 1000:.2f} | "
                  f"{r['eager_no_t5']['peak_mib']} | | |")


if __name__ == "__main__":
    main()
