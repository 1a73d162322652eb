"""The memory planner on a real GPU (part `memory` of gpu_proof.sh): a `sd-worker-cuda serve` on the full-size
random SD1.5, jobs sent while this process holds GPU memory so that only a set amount stays free, and one job
whose memory is taken away while it runs (an out-of-memory mid-job must fail that job, not the worker).

    python3 gpu_memory.py SD_WORKER_CUDA MODEL_DIR OUT_DIR

Prints one line per job: free memory when sent, HTTP status, seconds, the worker's plan line, the error text.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import torch

MIB = 1 << 20


def main() -> None:
    worker, model, out = sys.argv[1:4]
    log_path = "/tmp/memory_worker.log"
    log = open(log_path, "w")
    srv = subprocess.Popen(
        [worker, "serve", "--model", model, "--host", "127.0.0.1", "--port", "0"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "RUST_LOG": "info"},
    )
    base = None
    for _ in range(600):
        text = open(log_path).read()
        m = re.search(r"listening on (http://\S+)", text)
        if m:
            base = m.group(1)
            break
        if srv.poll() is not None:
            sys.exit(f"the worker exited ({srv.returncode}):\n{text[-3000:]}")
        time.sleep(0.2)
    if base is None:
        sys.exit("the worker did not start listening")

    def get(path: str):
        with urllib.request.urlopen(base + path, timeout=30) as r:
            return json.load(r)

    for _ in range(300):
        try:
            if urllib.request.urlopen(base + "/ready", timeout=5).status == 200:
                break
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.5)
    info = get("/v1/info")
    mem = info.get("memory")
    print("/v1/info memory:", json.dumps(mem))

    def job(size: int, steps: int = 4) -> tuple[int, float, str]:
        body = json.dumps({"prompt": "a red cube", "size": f"{size}x{size}", "steps": steps, "seed": 7}).encode()
        req = urllib.request.Request(
            base + "/v1/images/generations", data=body, headers={"content-type": "application/json"}
        )
        t = time.time()
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                r.read()
                return r.status, time.time() - t, ""
        except urllib.error.HTTPError as e:
            return e.code, time.time() - t, e.read().decode(errors="replace")[:300]

    hog: list[torch.Tensor] = []

    def leave(mib: int | None) -> int:
        hog.clear()
        torch.cuda.empty_cache()
        if mib is not None:
            free = torch.cuda.mem_get_info()[0]
            if free > mib * MIB:
                hog.append(torch.empty(free - mib * MIB, dtype=torch.uint8, device="cuda"))
        return torch.cuda.mem_get_info()[0] // MIB

    def plan_lines_since(n: int) -> tuple[int, str]:
        lines = open(log_path).read().splitlines()
        new = [l for l in lines[n:] if "memory plan" in l]
        return len(lines), (re.sub(r"\x1b\[[0-9;]*m", "", new[-1])[-160:] if new else "plain")

    seen = len(open(log_path).read().splitlines())
    for free_mib, size in [(None, 512), (None, 768), (4000, 768), (2600, 768), (1500, 512), (None, 512)]:
        free_now = leave(free_mib)
        status, secs, err = job(size)
        seen, plan = plan_lines_since(seen)
        alive = srv.poll() is None
        print(f"free {free_now:6d} MiB  {size}²  HTTP {status}  {secs:5.1f} s  worker alive {alive}  plan: {plan}  {err}")

    # Memory taken while the job runs: the UNet steps start with the memory they planned for, then this process
    # takes all but 64 MiB, so the VAE decode (the biggest buffers of the job) cannot allocate. The job is larger
    # than any before it, so the worker's stream-ordered pool has never held buffers that size, and long enough
    # (60 steps at 1024²) that the squeeze lands mid-denoising, a moment after the worker logs the job's start.
    leave(None)
    result: dict[str, tuple[int, float, str]] = {}
    started = len([l for l in open(log_path).read().splitlines() if "job started" in l])
    t = threading.Thread(target=lambda: result.setdefault("r", job(1024, steps=60)))
    t.start()
    for _ in range(200):
        if len([l for l in open(log_path).read().splitlines() if "job started" in l]) > started:
            break
        time.sleep(0.05)
    time.sleep(0.5)
    squeezed = leave(64)
    t.join()
    status, secs, err = result["r"]
    print(f"squeezed to {squeezed} MiB mid-job: HTTP {status}  {secs:5.1f} s  worker alive {srv.poll() is None}  {err}")
    leave(None)
    status, secs, err = job(512)
    print(f"after the squeeze, free {torch.cuda.mem_get_info()[0] // MIB} MiB: HTTP {status}  {secs:5.1f} s  "
          f"worker alive {srv.poll() is None}  {err}")
    srv.terminate()
    srv.wait(timeout=30)


if __name__ == "__main__":
    main()
