"""Sums `ncu --csv --page raw --metrics gpu__time_duration.sum` output by kernel name: total GPU time, launches
and share per kernel, largest first (the profile of one UNet step or VAE decode, by kernel). The CSV is read by
kernel_groups.py's `from_ncu`.

    python3 ncu_sum.py NCU_CSV [TOP]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_groups import from_ncu  # noqa: E402


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30
    rows = from_ncu(path, 1)
    all_ms = sum(ms for _, ms, _ in rows)
    print(f"{sum(n for *_, n in rows)} launches, {all_ms:.2f} ms of kernel time")
    for name, ms, n in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"{ms:9.2f} ms {100 * ms / all_ms:5.1f} % {n:6d}  {name[:90]}")


if __name__ == "__main__":
    main()
