"""Sums `ncu --csv --page raw --metrics gpu__time_duration.sum` output by kernel name: total GPU time, launches
and share per kernel, largest first (the profile of one UNet step or VAE decode, by kernel).

    python3 ncu_sum.py NCU_CSV [TOP]
"""
import csv
import sys
from collections import defaultdict


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    cols = rows[header]
    name_at, time_at = cols.index("Kernel Name"), cols.index("gpu__time_duration.sum")
    unit = rows[header + 1][time_at] if len(rows) > header + 1 else "ns"
    scale = {"ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "nsecond": 1e-6}.get(unit, 1e-6)
    total, count = defaultdict(float), defaultdict(int)
    for r in rows[header + 2:]:
        try:
            t = float(r[time_at].replace(",", "")) * scale
        except (ValueError, IndexError):
            continue
        name = r[name_at].split("(")[0][:90]
        total[name] += t
        count[name] += 1
    all_ms = sum(total.values())
    print(f"{sum(count.values())} launches, {all_ms:.2f} ms of kernel time")
    for name, t in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{t:9.2f} ms {100 * t / all_ms:5.1f} % {count[name]:6d}  {name}")


if __name__ == "__main__":
    main()
