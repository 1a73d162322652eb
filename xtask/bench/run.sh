#!/usr/bin/env bash
# The CUDA benchmark on a GPU machine (no Rust needed), from the repository root:
#   bash BUNDLE/run.sh OUT_DIR [--skip-compiled] [--skip-sdxl]
#   bash BUNDLE/run.sh OUT_DIR --switch [--folders-only|--files-only]
#                                                (the model-switch benchmark instead: switch_table.py)
#   bash BUNDLE/run.sh OUT_DIR --lora            (the LoRA merge benchmark instead: lora_table.py)
#   bash BUNDLE/run.sh OUT_DIR --hires           (the hires-fix benchmark instead: hires_table.py)
#   bash BUNDLE/run.sh OUT_DIR --upscale         (the ESRGAN upscaler against spandrel instead: upscale_table.py)
#   bash BUNDLE/run.sh OUT_DIR --serve [--skip-sdxl|--only-sdxl] [--max-batch 1,8] [--worker-args "ARGS"]
#                                                (the HTTP serving benchmark instead: serve_table.py)
#   bash BUNDLE/run.sh OUT_DIR --sd3 [--models sd35m,sd35l] [--skip-compiled]
#                                                (SD3.5 against diffusers instead: sd3_table.py)
# BUNDLE is what `cargo xtask bench cuda` wrote. The machine provides the NVIDIA driver, Python with PyTorch
# (CUDA 13), and through PyTorch's wheels or a CUDA 13 install the cuBLAS, cuRAND, NVRTC and cuDNN 9 libraries.
set -euo pipefail
B=$(cd "$(dirname "$0")" && pwd)
OUT=${1:?usage: run.sh OUT_DIR [--skip-compiled] [--skip-sdxl]}
shift
mkdir -p "$OUT" "$B/bin"
tar -xJf "$B/bins.tar.xz" -C "$B/bin"
[ -d "$B/site" ] || python3 -m pip install -q --no-index --no-deps --target "$B/site" "$B"/wheels/*.whl
# The CUDA libraries the binaries link: PyTorch's nvidia/* wheels, else a CUDA install.
libs=$(python3 -c 'import glob, os, site; print(":".join(d for p in site.getsitepackages() for d in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))))')
export LD_LIBRARY_PATH="$libs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
if [ "${1:-}" = --switch ]; then
    shift
    PYTHONPATH="$B/site:${PYTHONPATH:-}" python3 "$B/switch_table.py" "$B" "$OUT" "$@"
elif [ "${1:-}" = --lora ]; then
    PYTHONPATH="$B/site:${PYTHONPATH:-}" python3 "$B/lora_table.py" "$B" "$OUT"
elif [ "${1:-}" = --hires ]; then
    PYTHONPATH="$B/site:${PYTHONPATH:-}" python3 "$B/hires_table.py" "$B" "$OUT"
elif [ "${1:-}" = --serve ]; then
    shift
    PYTHONPATH="$B/site:${PYTHONPATH:-}" python3 "$B/serve_table.py" "$B" "$OUT" "$@"
elif [ "${1:-}" = --sd3 ]; then
    shift
    PYTHONPATH="$B/site:${PYTHONPATH:-}" python3 "$B/sd3_table.py" "$B" "$OUT" "$@"
elif [ "${1:-}" = --upscale ]; then
    PYTHONPATH="$B/site:${PYTHONPATH:-}" python3 "$B/upscale_table.py" "$B" "$OUT"
else
    python3 "$B/cuda_table.py" "$B" "$OUT" "$@"
fi
