"""GPU time of one step by kernel group (GEMM, attention, norms, elementwise, copies), for sdhive and diffusers
alike: the SD3 step profiles behind docs/benchmarks.md's SD3.5 breakdown. Input: torch.profiler rows
(bench_sd3_diffusers.py profile calls print_groups), or sdhive-bench's timed calls under Nsight Compute
(`ncu --profile-from-start off --csv --page raw --metrics gpu__time_duration.sum`), divided by the steps the
profile holds:

    python3 kernel_groups.py NCU_CSV STEPS [LABEL]
"""
from __future__ import annotations

import csv
import json
import sys
from collections import defaultdict

# First match wins: attention before GEMM (flash kernels' names carry "gemm"-like words in some builds).
GROUPS = [
    ("attention", ("attention", "flash", "fmha", "sdpa", "cudnn_generated_fort_native_sdpa", "attn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "cublas", "matmul", "linear_norm",
              "geglu")),
    ("norm", ("norm", "rms", "layer_norm", "modulat")),
    ("copy", ("copy", "cat", "transpose", "contiguous", "memcpy", "ucopy")),
]


def group(name: str) -> str:
    low = name.lower()
    for g, keys in GROUPS:
        if any(k in low for k in keys):
            return g
    return "other"


def print_groups(label: str, rows: list[tuple[str, float, int]], top: int = 25) -> None:
    """rows: (kernel name, ms per step, launches per step). Prints the groups and the top kernels, and one JSON
    line with the groups."""
    total = sum(ms for _, ms, _ in rows)
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, ms, n in rows:
        g = groups[group(name)]
        g[0] += ms
        g[1] += n
    print(f"{label}: {total:.2f} ms of kernel time per step, {sum(n for *_, n in rows)} launches")
    for g, (ms, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"  {g:10s} {ms:8.2f} ms  {100 * ms / total:5.1f} %  {int(n):5d} launches")
    for name, ms, n in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"    {ms:8.3f} ms  {n:4d}x  [{group(name)}] {name[:110]}")
    print(json.dumps({"part": "groups", "label": label, "total_ms": total,
                      "groups": {g: round(v[0], 3) for g, v in groups.items()}}), flush=True)


def from_ncu(path: str, steps: float) -> list[tuple[str, float, int]]:
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    cols = rows[header]
    name_at, time_at = cols.index("Kernel Name"), cols.index("gpu__time_duration.sum")
    unit = rows[header + 1][time_at] if len(rows) > header + 1 else "ns"
    scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}.get(unit, 1e-6)
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for r in rows[header + 2:]:
        try:
            t = float(r[time_at].replace(",", "")) * scale
        except (ValueError, IndexError):
            continue
        name = r[name_at].split("(")[0]
        total[name] += t
        count[name] += 1
    return [(n, total[n] / steps, round(count[n] / steps)) for n in total]


if __name__ == "__main__":
    print_groups(sys.argv[3] if len(sys.argv) > 3 else "sdhive", from_ncu(sys.argv[1], float(sys.argv[2])))
