"""The hive on a GPU machine (part `hive` of gpu_proof.sh): `hive serve` with the worker binaries in WORKERS_DIR,
once as configured by default and once with CUDA excluded; each time the workers it spawned, their state, and
one image generated through the hive.

    python3 gpu_hive.py WORKERS_DIR MODEL_DIR [default,no-cuda]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

PORT = 7833


def http(method: str, path: str, body: dict | None = None, timeout: float = 30):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"http://127.0.0.1:{PORT}{path}", data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:300]
    except (urllib.error.URLError, ConnectionError) as e:
        return 0, str(e)


def run(workers_dir: str, model: str, extra: list[str], label: str) -> None:
    log_path = f"/tmp/hive_{label}.log"
    log = open(log_path, "w")
    hive = subprocess.Popen(
        [f"{workers_dir}/hive", "serve", "--model", model, "--bind", f"127.0.0.1:{PORT}", *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    t0 = time.time()
    status = 0
    while time.time() - t0 < 150 and hive.poll() is None:
        status, _ = http("GET", "/ready", timeout=5)
        if status == 200:
            break
        time.sleep(1)
    _, workers = http("GET", "/v1/workers")
    print(f"[{label}] hive {' '.join(extra) or '(defaults)'}: /ready {status} after {time.time() - t0:.0f} s")
    for w in workers.get("workers", []) if isinstance(workers, dict) else []:
        keep = {k: w.get(k) for k in ("id", "backend", "device", "state", "binary", "pid", "model", "models")}
        print(f"[{label}]   worker {json.dumps({k: v for k, v in keep.items() if v is not None})}")
    if status == 200:
        t = time.time()
        code, body = http(
            "POST",
            "/v1/images/generations",
            {"prompt": "a red cube on a wooden table", "size": "512x512", "steps": 20, "seed": 42},
            timeout=240,
        )
        n = len(body.get("data", [])) if isinstance(body, dict) else 0
        print(f"[{label}]   POST /v1/images/generations 512² 20 steps via the hive: HTTP {code}, {n} image(s), "
              f"{time.time() - t:.1f} s {'' if code == 200 else body}")
    hive.send_signal(signal.SIGTERM)
    try:
        hive.wait(timeout=60)
    except subprocess.TimeoutExpired:
        hive.kill()
    tail = open(log_path).read().splitlines()[-6:]
    print(f"[{label}]   hive exit {hive.returncode}; last log lines:")
    for line in tail:
        print(f"[{label}]     {line[-200:]}")


def main() -> None:
    workers_dir, model = sys.argv[1:3]
    which = (sys.argv[3] if len(sys.argv) > 3 else "default,no-cuda").split(",")
    if "default" in which:
        run(workers_dir, model, [], "default")
    if "no-cuda" in which and not os.path.exists(f"{workers_dir}/sd-worker-vulkan.standin"):
        run(workers_dir, model, ["--exclude", "cuda"], "no-cuda")


if __name__ == "__main__":
    main()
