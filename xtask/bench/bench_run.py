"""What the benchmark table scripts share: running one side of a comparison and reading its JSON lines."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time


def run_json(out_dir: str, cmd: list[str], log: str, append: bool = False) -> list[dict]:
    """Runs `cmd` with its stderr in `out_dir/log` (appended to when the same side runs more than once) and returns
    the JSON objects it printed, one per line."""
    with open(os.path.join(out_dir, log), "a" if append else "w") as err:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def run_json_peak(out_dir: str, cmd: list[str], log: str) -> tuple[list[dict], int | None]:
    """`run_json`, with the process's peak device memory in MiB as nvidia-smi reports it (CUDA context included),
    sampled every 50 ms; None without nvidia-smi or when the process held no device memory."""
    with open(os.path.join(out_dir, log), "w") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        peak: list[int | None] = [None]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                try:
                    q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                        "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
                except OSError:
                    return
                for line in q.splitlines():
                    pid, _, mib = line.partition(",")
                    if pid.strip() == str(p.pid) and mib.strip().isdigit():
                        peak[0] = max(peak[0] or 0, int(mib.strip()))
                time.sleep(0.05)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        out, _ = p.communicate()
        stop.set()
        th.join()
    if p.returncode != 0:
        raise subprocess.CalledProcessError(p.returncode, cmd, out)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], peak[0]
