"""The CUDA benchmark table, on the GPU machine (`cargo xtask bench cuda` prepares the folder this runs from):
sdhive (sdhive-bench, fp16, random weights) and diffusers eager and torch.compile'd on the same shapes, each in
its own process, and a Markdown table of medians with the ratios sdhive / diffusers.

    python3 cuda_table.py BUNDLE_DIR OUT_DIR [--skip-ours] [--skip-eager] [--skip-compiled] [--skip-sdxl]
    python3 cuda_table.py --table RESULT.json...   (merge the JSON of several partial runs into one table)

Rows: UNet step (CFG batch 2; each call timed on its own, and 20-step schedules issued back to back as a
denoising loop and the anchors' script issue them, per step), VAE decode, text encode (prompt + negative), seconds per image end to end
(20 steps, CFG 7: SD1.5 512², SDXL 1024²) and the end-to-end runs' peak device memory, read for each process
from nvidia-smi every 50 ms (CUDA context included, for both sides alike).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

TABLE_ONLY = len(sys.argv) > 1 and sys.argv[1] == "--table"
BUNDLE, OUT = ("", "") if TABLE_ONLY else (sys.argv[1], sys.argv[2])
FLAGS = set(sys.argv[3:])
BIN = os.path.join(BUNDLE, "bin")
ENV = {**os.environ, "PYTHONPATH": os.path.join(BUNDLE, "site") + ":" + os.environ.get("PYTHONPATH", "")}
LOG = None if TABLE_ONLY else open(os.path.join(OUT, "cuda_table.log"), "a")


def peak_memory(pid: int, stop: threading.Event, out: list[int]) -> None:
    while not stop.is_set():
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True).stdout
        for line in q.splitlines():
            p, _, mib = line.partition(",")
            if p.strip() == str(pid):
                out[0] = max(out[0], int(mib.strip()))
        time.sleep(0.05)


def run(label: str, cmd: list[str], timeout: int) -> tuple[list[dict], int]:
    """Runs one process, returns its JSON lines and its peak device memory in MiB."""
    LOG.write(f"=== {label}: {' '.join(cmd)}\n")
    LOG.flush()
    t = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=LOG, text=True, env=ENV)
    peak, stop = [0], threading.Event()
    th = threading.Thread(target=peak_memory, args=(p.pid, stop, peak), daemon=True)
    th.start()
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        LOG.write(f"{label}: timed out after {timeout} s\n")
    stop.set()
    th.join()
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    LOG.write(out + f"{label}: exit {p.returncode}, {time.time() - t:.0f} s, peak {peak[0]} MiB\n")
    LOG.flush()
    print(f"{label}: exit {p.returncode} in {time.time() - t:.0f} s, peak {peak[0]} MiB", flush=True)
    return rows, peak[0]


def measure() -> dict:
    ours: dict[str, float] = {}
    mem: dict[str, dict[str, int]] = {"ours": {}, "eager": {}, "compiled": {}}
    ref: dict[str, dict[str, float]] = {"eager": {}, "compiled": {}}
    bench = os.path.join(BIN, "sdhive-bench")
    xl = "--skip-sdxl" not in FLAGS
    for fam, tmpl, path in [("sd15", "sd1", "/tmp/bench_sd15"), ("sdxl", "sdxl", "/tmp/bench_sdxl")][: 2 if xl else 1]:
        if not os.path.exists(os.path.join(path, "model_index.json")):
            run(f"write {fam}", [bench, "--write-model", path, "--model", fam, "--template",
                                 f"tests/fixtures/models/{tmpl}"], 300)
    common = ["--device", "cuda", "--dtype", "f16"]
    if "--skip-ours" not in FLAGS:
        measure_ours(bench, common, xl, ours, mem)
    script = os.path.join(BUNDLE, "bench_cuda_diffusers.py")
    if "--skip-eager" not in FLAGS:
        measure_eager(script, xl, ref, mem)
    if "--skip-compiled" not in FLAGS:
        measure_compiled(script, ref, mem)
    return {"ours": ours, "diffusers": ref, "peak_mib": mem}


def measure_ours(bench, common, xl, ours, mem) -> None:
    rows, _ = run("ours sd15 unet+vae", [bench, *common, "--latent", "64", "--iters", "20", "--warmup", "3"], 300)
    for r in rows:
        ours["unet-sd15"] = r["unet_step_b2"]["median_ms"]
        ours["unet-sd15-b2b"] = r["unet_schedule_b2"]["median_ms"]
        ours["vae-sd15"] = r["vae_decode"]["median_ms"]
    for fam in ["sd15", "sdxl"][: 2 if xl else 1]:
        rows, _ = run(f"ours {fam} text", [bench, *common, "--model", fam, "--only", "text", "--iters", "10",
                                           "--warmup", "3"], 300)
        for r in rows:
            ours[f"text-{fam}"] = r["text_encode"]["median_ms"]
    if xl:
        rows, _ = run("ours sdxl unet", [bench, *common, "--model", "sdxl", "--latent", "128", "--only", "unet",
                                         "--iters", "10", "--warmup", "3"], 300)
        for r in rows:
            ours["unet-sdxl"] = r["unet_step_b2"]["median_ms"]
            ours["unet-sdxl-b2b"] = r["unet_schedule_b2"]["median_ms"]
    for fam, size, iters in [("sd15", 512, 3), ("sdxl", 1024, 2)][: 2 if xl else 1]:
        rows, peak = run(f"ours {fam} e2e", [bench, *common, "--model", fam, "--e2e", f"/tmp/bench_{fam}", "--size",
                                             str(size), "--steps", "20", "--iters", str(iters), "--warmup", "1"], 400)
        for r in rows:
            ours[f"e2e-{fam}"] = r["e2e"]["median_ms"]
        mem["ours"][f"e2e-{fam}"] = peak



def record(into: dict, part: str, row: dict) -> None:
    """One diffusers part's median, and for the UNet parts the back-to-back median as PART-b2b."""
    into[part] = row["median_ms"]
    if "schedule_median_ms" in row:
        into[part + "-b2b"] = row["schedule_median_ms"]


def measure_eager(script, xl, ref, mem) -> None:
    parts = "unet-sd15,vae-sd15,text-sd15" + (",unet-sdxl,text-sdxl" if xl else "")
    rows, _ = run("diffusers eager", ["python3", script, parts], 600)
    for r in rows:
        record(ref["eager"], r["part"], r)
    for fam in ["sd15", "sdxl"][: 2 if xl else 1]:
        rows, peak = run(f"diffusers eager {fam} e2e", ["python3", script, f"e2e-{fam}", f"--{fam}",
                                                        f"/tmp/bench_{fam}"], 600)
        for r in rows:
            ref["eager"][r["part"]] = r["median_ms"]
        mem["eager"][f"e2e-{fam}"] = peak


def measure_compiled(script, ref, mem) -> None:
    rows, _ = run("diffusers compiled", ["python3", script, "unet-sd15,vae-sd15", "--compile"], 600)
    for r in rows:
        record(ref["compiled"], r["part"].removesuffix("-compiled"), r)
    rows, peak = run("diffusers compiled sd15 e2e", ["python3", script, "e2e-sd15", "--compile", "--sd15",
                                                     "/tmp/bench_sd15"], 600)
    for r in rows:
        ref["compiled"]["e2e-sd15"] = r["median_ms"]
    mem["compiled"]["e2e-sd15"] = peak


def merge(results: list[dict]) -> dict:
    out = {"ours": {}, "diffusers": {"eager": {}, "compiled": {}}, "peak_mib": {"ours": {}, "eager": {}, "compiled": {}}}
    for r in results:
        out["ours"].update(r["ours"])
        for k in ("eager", "compiled"):
            out["diffusers"][k].update(r["diffusers"][k])
        for k in ("ours", "eager", "compiled"):
            out["peak_mib"][k].update(r["peak_mib"][k])
    return out


def table(res: dict) -> str:
    ours, ref, mem = res["ours"], res["diffusers"], res["peak_mib"]

    names = [("unet-sd15", "SD1.5 UNet step 512², CFG batch 2, per call (ms)"),
             ("unet-sd15-b2b", "SD1.5 UNet step, 20-step schedules back to back (ms per step)"),
             ("vae-sd15", "SD1.5 VAE decode 512² (ms)"),
             ("text-sd15", "SD1.5 text encode, prompt + negative (ms)"), ("e2e-sd15", "SD1.5 512², 20 steps (s/image)"),
             ("unet-sdxl", "SDXL UNet step 1024², CFG batch 2, per call (ms)"),
             ("unet-sdxl-b2b", "SDXL UNet step, 20-step schedules back to back (ms per step)"),
             ("text-sdxl", "SDXL text encode (ms)"),
             ("e2e-sdxl", "SDXL 1024², 20 steps (s/image)")]

    def cell(v: float | None, key: str) -> str:
        if v is None:
            return "—"
        return f"{v / 1000:.2f}" if key.startswith("e2e") else f"{v:.1f}"

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}×" if a and b else "—"

    lines = ["| work (fp16) | sdhive | diffusers eager | ratio | diffusers compiled | ratio |", "|---|---|---|---|---|---|"]
    for key, label in names:
        o, e, c = ours.get(key), ref["eager"].get(key), ref["compiled"].get(key)
        lines.append(f"| {label} | {cell(o, key)} | {cell(e, key)} | {ratio(o, e)} | {cell(c, key)} | {ratio(o, c)} |")
    for key, label in [("e2e-sd15", "peak device memory, SD1.5 e2e (MiB)"), ("e2e-sdxl", "peak device memory, SDXL e2e (MiB)")]:
        o, e, c = mem["ours"].get(key), mem["eager"].get(key), mem["compiled"].get(key)
        fmt = lambda v: str(v) if v else "—"
        lines.append(f"| {label} | {fmt(o)} | {fmt(e)} | {ratio(o, e)} | {fmt(c)} | {ratio(o, c)} |")
    return "\n".join(lines)


def main() -> None:
    if TABLE_ONLY:
        print(table(merge([json.load(open(p)) for p in sys.argv[2:]])))
        return
    res = measure()
    with open(os.path.join(OUT, "cuda_table.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(table(res))


if __name__ == "__main__":
    main()
