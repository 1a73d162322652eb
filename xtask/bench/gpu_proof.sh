#!/usr/bin/env bash
# The CUDA proof run, on a GPU machine without Rust: the binaries built here by `cargo xtask build-cuda --bench
# --tests` (stripped, in CARRY/bins.tar.xz as sd-worker-cuda, sdhive-bench and sdhive-candle-tests) sit in CARRY
# with the diffusers wheels and bench_cuda_diffusers.py; run from
# the repository root (the committed fixtures are read from tests/fixtures). Logs go to $OUT (default /tmp/out).
#   bash gpu_proof.sh CARRY [parts…]      parts: version parity generate bench ncu diffusers (default: all)
set -u -o pipefail
CARRY=${1:?usage: gpu_proof.sh CARRY [parts…]}
shift
PARTS=${*:-version parity generate bench ncu diffusers}
OUT=${OUT:-/tmp/out}
B=/tmp/sdhive-bin
L=$OUT/proof.log
mkdir -p "$B" "$OUT"
# One tar for the three binaries: they share candle's kernels, which xz then stores once.
tar -xJf "$CARRY/bins.tar.xz" -C "$B"
# The driver's libcuda plus CUDA 13 cuBLAS/cuRAND/NVRTC/cudart (the toolkit's and torch's wheels).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib
export SDHIVE_FIXTURES=$PWD/tests/fixtures RUST_LOG=${RUST_LOG:-info} PYTHONUNBUFFERED=1
TIMEFORMAT='wall %R s'
step() { echo "=== $(date -u +%T) $*" | tee -a "$L"; }
has() { [[ " $PARTS " == *" $1 "* ]]; }

step machine
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$L"
ldd "$B/sd-worker-cuda" | grep -E "cuda|cublas|curand|nvrtc|not found" | tee -a "$L"

if has version; then
    step "sd-worker-cuda --version"
    "$B/sd-worker-cuda" --version 2>&1 | tee -a "$L"
    step "device init + tiny fixture model (start-up check logged)"
    timeout 120 "$B/sd-worker-cuda" generate --model tests/fixtures/models/sd1 --prompt "a cat" --steps 4 \
        --seed 1 -o /tmp/tiny.png 2>&1 | tee -a "$L"
    step "missing device index"
    timeout 60 "$B/sd-worker-cuda" generate --model tests/fixtures/models/sd1 --prompt "a cat" --device 7 \
        -o /tmp/none.png 2>&1 | grep -iE "^error|cuda device" | tee -a "$L"
    echo "exit status ${PIPESTATUS[0]}" | tee -a "$L"
fi

if has parity; then
    for dt in f32 f16 bf16; do
        step "parity tests on cuda:0 $dt"
        SDHIVE_TEST_DEVICE=cuda SDHIVE_TEST_DTYPE=$dt timeout 240 "$B/sdhive-candle-tests" --test-threads 1 \
            --nocapture parity_tests >"$OUT/parity_$dt.log" 2>&1
        echo "exit status $?" >>"$OUT/parity_$dt.log"
        grep -E "parity tests on|latent rel|max diff|single-file|test result|panicked|exit status" \
            "$OUT/parity_$dt.log" | tee -a "$L" >/dev/null
        grep -E "test result|exit status" "$OUT/parity_$dt.log"
    done
fi

if has generate; then
    step "write full-size random SD1.5"
    timeout 180 "$B/sdhive-bench" --write-model /tmp/sd15 --model sd15 --template tests/fixtures/models/sd1 2>&1 | tee -a "$L"
    for dt in f16 bf16; do
        step "generate SD1.5 512² 20 steps Euler a, CFG 7, $dt (the bf16 image is not kept)"
        { time timeout 180 "$B/sd-worker-cuda" generate --model /tmp/sd15 --prompt "a photo of a cat" \
            --steps 20 --width 512 --height 512 --seed 42 --dtype $dt -o "/tmp/sd15_512_$dt.png"; } 2>&1 | tee -a "$L"
    done
    step "write full-size random SDXL"
    timeout 240 "$B/sdhive-bench" --write-model /tmp/sdxl --model sdxl --template tests/fixtures/models/sdxl 2>&1 | tee -a "$L"
    step "generate SDXL 1024² 20 steps Euler a, CFG 7, f16"
    { time timeout 240 "$B/sd-worker-cuda" generate --model /tmp/sdxl --prompt "a photo of a cat" --steps 20 \
        --width 1024 --height 1024 --seed 42 -o "$OUT/sdxl_1024_f16.png"; } 2>&1 | tee -a "$L"
    cp /tmp/sd15_512_f16.png "$OUT/" 2>/dev/null
    rm -rf /tmp/sd15 /tmp/sdxl
fi

if has bench; then
    step "sdhive-bench SD1.5 UNet b2 512² + VAE decode 512², f16"
    timeout 180 "$B/sdhive-bench" --device cuda --dtype f16 --latent 64 --iters 20 --warmup 3 2>&1 | tee -a "$L"
    step "sdhive-bench SDXL UNet b2 1024², f16"
    timeout 180 "$B/sdhive-bench" --device cuda --dtype f16 --model sdxl --latent 128 --only unet --iters 10 \
        --warmup 3 2>&1 | tee -a "$L"
fi

if has ncu; then
    # Per-kernel GPU time of one SD1.5 UNet step (plus the random-weight build's few kernels): its sum against the
    # step's wall time says whether the step is bound by the GPU or by the host launching kernels.
    step "ncu per-kernel GPU time, one SD1.5 UNet step b2 512² f16"
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    timeout 240 "$NCU" --metrics gpu__time_duration.sum --print-summary per-kernel "$B/sdhive-bench" --device cuda \
        --dtype f16 --latent 64 --iters 1 --warmup 0 --only unet >"$OUT/ncu_unet.txt" 2>&1
    echo "ncu exit status $?" | tee -a "$L"
fi

if has diffusers; then
    step "diffusers eager (SDPA) fp16, same machine"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$CARRY"/*.whl 2>&1 | tail -2 | tee -a "$L"
    PYTHONPATH=/tmp/site timeout 300 python3 "$CARRY/bench_cuda_diffusers.py" 2>&1 | grep -v Warning | tee -a "$L"
fi
step done
