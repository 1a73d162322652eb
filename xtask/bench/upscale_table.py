"""The upscaler benchmark on a GPU machine: a full-size random RRDBNet x4 (64 features, 23 blocks, 32 growth
channels; f16 safetensors written by sdhive-bench) upscaling a 512x512 image untiled in float16, timed by
sdhive-bench --upscale-bench and by spandrel (bench_esrgan_spandrel.py, cuDNN's default algorithm choice and with
cudnn.benchmark), one run each. Prints a markdown table and writes OUT_DIR/upscale.json. run.sh calls it with
`--upscale`:

    bash BUNDLE/run.sh OUT_DIR --upscale
"""

from __future__ import annotations

import json
import os
import sys

from bench_run import run_json

BUNDLE, OUT = sys.argv[1], sys.argv[2]
BIN = os.path.join(BUNDLE, "bin")
MODEL = "/tmp/bench_esrgan_x4.safetensors"
ITERS = "10"




def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    bench = os.path.join(BIN, "sdhive-bench")
    # Writes the model first when it is missing, so spandrel reads the same file.
    ours = run_json(OUT, [bench, "--device", "cuda", "--dtype", "f16", "--upscale-bench", "--upscale-model", MODEL,
                  "--upscale-size", "512", "--warmup", "3", "--iters", ITERS], "upscale_ours.log")[0]
    script = os.path.join(BUNDLE, "bench_esrgan_spandrel.py")
    ref = run_json(OUT, [sys.executable, script, MODEL, ITERS, "--size", "512"], "upscale_spandrel.log")[0]
    tuned = run_json(OUT, [sys.executable, script, MODEL, ITERS, "--size", "512", "--cudnn-benchmark"],
                  "upscale_spandrel_benchmark.log")[0]
    with open(os.path.join(OUT, "upscale.json"), "w") as f:
        json.dump({"ours": ours, "spandrel": ref, "spandrel_cudnn_benchmark": tuned}, f, indent=1)
    net = ours["network"]["median_ms"]
    print(f"| RRDBNet x4 (64nf, 23nb), 512² → 2048², f16, untiled, {ref['device']} | median | vs spandrel |")
    print("|---|---|---|")
    print(f"| sdhive (network) | {net:.1f} ms | {net / ref['median_ms']:.2f}× |")
    print(f"| sdhive (image in, image out) | {ours['image']['median_ms']:.1f} ms | "
          f"{ours['image']['median_ms'] / ref['median_ms']:.2f}× |")
    print(f"| spandrel {ref['torch']} (`model(x)`) | {ref['median_ms']:.1f} ms | 1.00× |")
    print(f"| spandrel, cudnn.benchmark | {tuned['median_ms']:.1f} ms | {tuned['median_ms'] / ref['median_ms']:.2f}× |")
    target = "met" if net <= 0.8 * ref["median_ms"] else "NOT met"
    print(f"\ntarget ≤ 0.80× spandrel: {target} ({net / ref['median_ms']:.2f}×; vs cudnn.benchmark "
          f"{net / tuned['median_ms']:.2f}×)")
    print(f"same network: output mean {ours['out_mean']:.4f} / {ref['out_mean']:.4f}, std {ours['out_std']:.4f} / "
          f"{ref['out_std']:.4f} (sdhive / spandrel)")


if __name__ == "__main__":
    main()
