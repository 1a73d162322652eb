"""What the benchmark table scripts share: running one side of a comparison and reading its JSON lines."""

from __future__ import annotations

import json
import os
import subprocess


def run_json(out_dir: str, cmd: list[str], log: str, append: bool = False) -> list[dict]:
    """Runs `cmd` with its stderr in `out_dir/log` (appended to when the same side runs more than once) and returns
    the JSON objects it printed, one per line."""
    with open(os.path.join(out_dir, log), "a" if append else "w") as err:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]
