#!/usr/bin/env bash
# The CUDA proof run, on a GPU machine without Rust: the binaries built here by `cargo xtask build-cuda --bench
# --tests` (stripped, in CARRY/bins.tar.xz as sd-worker-cuda with its engine, sdhive-bench and
# sdhive-candle-tests) sit in CARRY with the diffusers wheels and bench_cuda_diffusers.py; run from the repository
# root (the committed fixtures are read from tests/fixtures). Logs go to $OUT (default /tmp/out).
#   bash gpu_proof.sh CARRY [parts…]
# parts: version kernels parity generate placement memory hive vulkan-stop levers unoptimised bench ncu nsys
# diffusers
# (default: all).
# `kernels` runs sdhive-cuda-kernels-tests; `levers` times the SD1.5 UNet step and VAE decode (and the SDXL step)
# with sdhive-bench-base (a build before the levers, when the tar has it), without the fused kernels
# (SDHIVE_FUSED_KERNELS=0), without the fused attention (SDHIVE_FUSED_ATTENTION=0), without the cuBLASLt linears
# (SDHIVE_FUSED_LINEAR=0), with NCHW maps instead of channels-last (SDHIVE_CHANNELS_LAST=0), without the UNet step's
# CUDA graph (SDHIVE_CUDA_GRAPHS=0) and with everything (a
# --cudnn build: with cuDNN; SDHIVE_CUDNN=0 turns it off). `placement` and
# `memory` use the full-size SD1.5 with deterministic random weights (xtask/fixtures/gen_sd15_random.py, numpy);
# `hive` also wants CARRY/sd-worker-vulkan.xz and sd-worker-vulkan-engine.xz, and the Vulkan loader and
# vulkaninfo as Debian packages in CARRY/debs. `vulkan-stop` runs the stable-diffusion.cpp engine's
# stop-inside-an-image test on the GPU through ggml's Vulkan backend: CARRY/stop_mid_image.xz is its test binary
# (`cargo test -p sd-worker-vulkan -p sdhive-sdcpp --features sd-worker-vulkan/vulkan,sdhive-sdcpp/vulkan
# --no-run`, stripped), with the loader in CARRY/debs.
set -u -o pipefail
CARRY=${1:?usage: gpu_proof.sh CARRY [parts…]}
shift
PARTS=${*:-version kernels parity generate placement memory hive vulkan-stop levers unoptimised bench ncu nsys diffusers}
OUT=${OUT:-/tmp/out}
B=/tmp/sdhive-bin
L=$OUT/proof.log
mkdir -p "$B" "$OUT"
# One tar for the three binaries: they share candle's kernels, which xz then stores once.
tar -xJf "$CARRY/bins.tar.xz" -C "$B"
# The driver's libcuda plus CUDA 13 cuBLAS/cuRAND/NVRTC/cudart and cuDNN 9: PyTorch's nvidia/* wheels, else a
# CUDA install.
libs=$(python3 -c 'import glob, os, site; print(":".join(d for p in site.getsitepackages() for d in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))))')
export LD_LIBRARY_PATH="$libs:/usr/local/cuda/lib64"
export SDHIVE_FIXTURES=$PWD/tests/fixtures RUST_LOG=${RUST_LOG:-info} PYTHONUNBUFFERED=1
TIMEFORMAT='wall %R s'
step() { echo "=== $(date -u +%T) $*" | tee -a "$L"; }
has() { [[ " $PARTS " == *" $1 "* ]]; }
# The Vulkan loader from CARRY/debs and NVIDIA's Vulkan driver through its EGL library: the container's ICD
# manifest names libGLX_nvidia, which hands out no vkCreateInstance without a display (seen on the H100 machines
# on 2026-11-22), while the same driver's libEGL_nvidia serves Vulkan headless.
vulkan_setup() {
    for d in "$CARRY"/debs/*.deb; do dpkg -x "$d" /; done
    ldconfig
    printf '{"file_format_version":"1.0.1","ICD":{"library_path":"libEGL_nvidia.so.0","api_version":"1.4.312"}}\n' \
        >/tmp/nvidia_egl_icd.json
    export VK_DRIVER_FILES=/tmp/nvidia_egl_icd.json
}
sd15_random() {
    [ -f /tmp/sd15r/model_index.json ] && return
    step "write the full-size random SD1.5 (numpy)"
    timeout 300 python3 xtask/fixtures/gen_sd15_random.py --write /tmp/sd15r 2>&1 | tail -1 | tee -a "$L"
}

step machine
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$L"
ldd "$B/sd-worker-cuda-engine" | grep -E "cuda|cublas|curand|nvrtc|not found" | tee -a "$L"

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

if has kernels; then
    step "fused CUDA kernels against candle's ops"
    timeout 120 "$B/sdhive-cuda-kernels-tests" --test-threads 1 --nocapture >/tmp/kernels.log 2>&1
    echo "exit status $?" >>/tmp/kernels.log
    cp /tmp/kernels.log "$OUT/kernels.log"
    grep -E -A1 "rel diff|test result|panicked|exit status" /tmp/kernels.log | grep -v "^--" | tee -a "$L"
fi

if has levers; then
    # name | binary | environment (each switch turns one lever off).
    for v in "base|sdhive-bench-base|" "kernels-off|sdhive-bench|SDHIVE_FUSED_KERNELS=0 SDHIVE_FUSED_ATTENTION=0" \
        "attention-off|sdhive-bench|SDHIVE_FUSED_ATTENTION=0" "linear-off|sdhive-bench|SDHIVE_FUSED_LINEAR=0" \
        "channels-last-off|sdhive-bench|SDHIVE_CHANNELS_LAST=0" "graphs-off|sdhive-bench|SDHIVE_CUDA_GRAPHS=0" \
        "all|sdhive-bench|"; do
        IFS='|' read -r name exe envs <<<"$v"
        [ -x "$B/$exe" ] || continue
        step "lever $name: SD1.5 UNet b2 512² + VAE decode 512², f16"
        # shellcheck disable=SC2086
        env $envs timeout 180 "$B/$exe" --device cuda --dtype f16 \
            --latent 64 --iters 20 --warmup 3 2>>"$L" | tee -a "$L" | python3 -c \
            'import json,sys; r=json.loads(sys.stdin.read()); print("UNet %.1f ms, VAE %.1f ms" % (r["unet_step_b2"]["median_ms"], r["vae_decode"]["median_ms"]))' \
            | tee -a "$L"
        [ "$name" = base ] || [ "$name" = kernels-off ] && continue
        step "lever $name: SDXL UNet b2 1024², f16"
        # shellcheck disable=SC2086
        env $envs timeout 180 "$B/$exe" --device cuda --dtype f16 --model sdxl --latent 128 \
            --only unet --iters 10 --warmup 3 2>>"$L" | tee -a "$L" | python3 -c \
            'import json,sys; r=json.loads(sys.stdin.read()); print("SDXL UNet %.1f ms" % r["unet_step_b2"]["median_ms"])' \
            | tee -a "$L"
    done
fi

if has unoptimised; then
    sd15_random
    # The issue's check after every optimisation: one full-size image with every kernel against candle's plain ops.
    for v in "plain|0" "optimised|1"; do
        name=${v%%|*} fused=${v#*|}
        step "sd-worker-cuda sd15-random 512² 20 steps Euler f16, SDHIVE_FUSED_KERNELS=$fused"
        { time SDHIVE_FUSED_KERNELS=$fused timeout 180 "$B/sd-worker-cuda" generate --model /tmp/sd15r --prompt \
            "a red cube on a wooden table" --steps 20 --sampler Euler --width 512 --height 512 --seed 42 \
            -o "/tmp/u512_$name.png"; } 2>&1 | tail -3 | tee -a "$L"
    done
    python3 - /tmp/u512_plain.png /tmp/u512_optimised.png <<'PY' 2>&1 | tee -a "$L"
import sys
import numpy as np
from PIL import Image
a, b = (np.asarray(Image.open(p).convert("RGB")).astype(np.int64) for p in sys.argv[1:3])
d = np.abs(a - b); mse = (d ** 2).mean()
print("512² optimised vs candle's plain ops: mean |d| %.3f, max %d, values off by >2 levels %d of %d, PSNR %s dB"
      % (d.mean(), d.max(), (d > 2).sum(), d.size, "%.2f" % (10 * np.log10(255 ** 2 / mse)) if mse else "inf"))
PY
fi

if has parity; then
    for dt in f32 f16 bf16; do
        step "parity tests on cuda:0 $dt"
        SDHIVE_TEST_DEVICE=cuda SDHIVE_TEST_DTYPE=$dt timeout 240 "$B/sdhive-candle-tests" --test-threads 1 \
            --nocapture parity_tests >/tmp/parity_$dt.log 2>&1
        echo "exit status $?" >>/tmp/parity_$dt.log
        grep -E "parity tests on|latent rel|max diff|single-file|placed|test result|panicked|exit status" \
            /tmp/parity_$dt.log | tee -a "$L" >/dev/null
        grep -E "test result|exit status" /tmp/parity_$dt.log
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

if has placement; then
    sd15_random
    # The committed diffusers image for these weights: 64², 4 steps Euler, CFG 7, seed 42.
    G=(--prompt "a red cube on a wooden table" --steps 4 --cfg-scale 7 --width 64 --height 64 --seed 42 --sampler Euler)
    for v in "plain|" "tecpu|--placement te=cpu" "offload|--placement te=cpu --offload te,vae" "unetoff|--offload unet"; do
        name=${v%%|*} flags=${v#*|}
        step "sd-worker-cuda sd15-random 64² f16, $name: $flags"
        # shellcheck disable=SC2086
        timeout 120 "$B/sd-worker-cuda" generate --model /tmp/sd15r "${G[@]}" $flags -o "/tmp/p64_$name.png" \
            >"/tmp/p64_$name.log" 2>&1
        echo "exit status $?" | tee -a "$L"
        grep -E "^Error|Caused|^ +[0-9]: [a-z]" "/tmp/p64_$name.log" | head -5 | tee -a "$L"
    done
    for v in "plain|" "offload|--placement te=cpu --offload te,vae"; do
        name=${v%%|*} flags=${v#*|}
        step "sd-worker-cuda sd15-random 512² 20 steps f16, $name: $flags"
        # shellcheck disable=SC2086
        { time timeout 180 "$B/sd-worker-cuda" generate --model /tmp/sd15r --prompt "a red cube on a wooden table" \
            --steps 20 --width 512 --height 512 --seed 42 $flags -o "/tmp/p512_$name.png"; } 2>&1 | tail -3 | tee -a "$L"
    done
    step "images against diffusers and against the all-GPU run"
    python3 - /tmp <<'PY' 2>&1 | tee -a "$L"
import os, sys
import numpy as np
from PIL import Image
out = sys.argv[1]
load = lambda p: np.asarray(Image.open(p).convert("RGB")).astype(np.int64)
def cmp(a, b):
    d = np.abs(a - b); mse = (d ** 2).mean()
    return "mean |d| %.3f, max %d, PSNR %s dB" % (d.mean(), d.max(), "%.2f" % (10 * np.log10(255 ** 2 / mse)) if mse else "inf")
gold = load("tests/fixtures/golden/sd15_random_euler.png")
for n in ["plain", "tecpu", "offload", "unetoff"]:
    p = os.path.join(out, f"p64_{n}.png")
    if os.path.exists(p):
        print(f"64² {n:8} vs diffusers: {cmp(load(p), gold)};  vs plain: {cmp(load(p), load(os.path.join(out, 'p64_plain.png')))}")
a, b = (os.path.join(out, f"p512_{n}.png") for n in ["plain", "offload"])
if os.path.exists(a) and os.path.exists(b):
    print("512² te=cpu + offload te,vae vs all-GPU:", cmp(load(b), load(a)))
PY
fi

if has memory; then
    sd15_random
    step "memory plan: /v1/info, planned jobs under squeezed free memory, an out-of-memory mid-job"
    RUST_LOG=info timeout 420 python3 xtask/bench/gpu_memory.py "$B/sd-worker-cuda" /tmp/sd15r "$OUT" 2>&1 | tee -a "$L"
fi

if has hive; then
    step "hive on this machine: detection, the worker it runs, the Vulkan worker when CUDA is excluded"
    vulkan_setup
    W=/tmp/hive-bin
    mkdir -p "$W"
    cp "$B/hive" "$B"/sd-worker-cuda* "$W/"
    if [ -f "$CARRY/sd-worker-vulkan.xz" ]; then
        # The launcher and its engine (sdhive-launch).
        for f in sd-worker-vulkan sd-worker-vulkan-engine; do
            xz -dc "$CARRY/$f.xz" >"$W/$f" && chmod +x "$W/$f"
        done
    else
        # Without the Vulkan worker (too big to travel beside the repository) the hive's plan is still shown
        # with a stand-in file; gpu_hive.py then runs only the CUDA worker.
        printf '#!/bin/sh\necho "stand-in for sd-worker-vulkan" >&2; exit 1\n' >"$W/sd-worker-vulkan.standin"
        cp "$W/sd-worker-vulkan.standin" "$W/sd-worker-vulkan" && chmod +x "$W/sd-worker-vulkan"
    fi
    vulkaninfo --summary 2>&1 | grep -E "deviceName|deviceType|driverName|apiVersion" | tee -a "$L"
    "$W/hive" devices 2>&1 | tee -a "$L"
    "$W/hive" devices --exclude cuda 2>&1 | tee -a "$L"
    sd15_random
    timeout 300 python3 xtask/bench/gpu_hive.py "$W" /tmp/sd15r 2>&1 | tee -a "$L"
fi

if has vulkan-stop && [ -f "$CARRY/stop_mid_image.xz" ]; then
    step "stop inside an image: stable-diffusion.cpp on ggml's Vulkan backend (the GPU), random SD1.5 64², 4 steps"
    vulkan_setup
    sd15_random
    xz -dc "$CARRY/stop_mid_image.xz" >/tmp/stop_mid_image && chmod +x /tmp/stop_mid_image
    SDHIVE_SD15_RANDOM=/tmp/sd15r SDHIVE_STOP_TEST_DEVICE=Vulkan0 RUST_LOG=sdcpp=info timeout 300 \
        /tmp/stop_mid_image --include-ignored --nocapture --test-threads 1 >/tmp/vulkan_stop.log 2>&1
    echo "exit status $?" >>/tmp/vulkan_stop.log
    cp /tmp/vulkan_stop.log "$OUT/vulkan_stop.log"
    grep -E "stop test on|total params|generate_image completed|test result|panicked|exit status" /tmp/vulkan_stop.log |
        sed 's/\x1b\[[0-9;]*m//g' | tee -a "$L"
fi

if has bench; then
    step "sdhive-bench SD1.5 UNet b2 512² + VAE decode 512², f16"
    timeout 180 "$B/sdhive-bench" --device cuda --dtype f16 --latent 64 --iters 20 --warmup 3 2>&1 | tee -a "$L"
    step "sdhive-bench SDXL UNet b2 1024², f16"
    timeout 180 "$B/sdhive-bench" --device cuda --dtype f16 --model sdxl --latent 128 --only unet --iters 10 \
        --warmup 3 2>&1 | tee -a "$L"
fi

if has ncu; then
    # Per-kernel GPU time of the timed calls only (sdhive-bench opens a CUDA profiler range around them): one SD1.5
    # UNet step, one SD1.5 VAE decode and one SDXL UNet step, summed by kernel name (xtask/bench/ncu_sum.py). The
    # sum against the call's wall time says whether it is bound by the GPU or by the host launching kernels.
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    BENCH=$B/sdhive-bench
    [ -x "$B/sdhive-bench-cudnn" ] && BENCH=$B/sdhive-bench-cudnn
    for v in "sd15_unet|--latent 64 --only unet" "sd15_vae|--latent 64 --only vae" \
        "sdxl_unet|--model sdxl --latent 128 --only unet"; do
        name=${v%%|*} flags=${v#*|}
        step "ncu $name ($(basename "$BENCH"), f16)"
        # shellcheck disable=SC2086
        timeout 300 "$NCU" --profile-from-start off --csv --page raw --metrics gpu__time_duration.sum "$BENCH" \
            --device cuda --dtype f16 $flags --iters 1 --warmup 1 >"/tmp/ncu_$name.csv" 2>"/tmp/ncu_$name.err"
        echo "ncu exit status $?" | tee -a "$L"
        python3 xtask/bench/ncu_sum.py "/tmp/ncu_$name.csv" 25 2>&1 | tee "$OUT/ncu_$name.txt" | tee -a "$L"
    done
fi

if has nsys; then
    # Per-kernel GPU time (sums by kernel name) of SD1.5 and SDXL UNet steps and the SD1.5 VAE decode, from Nsight
    # Systems when the machine has it: much cheaper than ncu's per-kernel replay for SDXL's thousands of launches.
    NSYS=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/bin/nsys 2>/dev/null | head -1)
    if [ -z "$NSYS" ]; then
        echo "no nsys on this machine" | tee -a "$L"
    else
        for v in "sd15_unet|--latent 64 --only unet" "sd15_vae|--latent 64 --only vae" \
            "sdxl_unet|--model sdxl --latent 128 --only unet"; do
            name=${v%%|*} flags=${v#*|}
            step "nsys $name"
            # shellcheck disable=SC2086
            timeout 240 "$NSYS" profile -t cuda -o "/tmp/nsys_$name" --force-overwrite true "$B/sdhive-bench" \
                --device cuda --dtype f16 $flags --iters 3 --warmup 1 >/dev/null 2>&1
            timeout 120 "$NSYS" stats -r cuda_gpu_kern_sum -f csv -o "$OUT/nsys_$name" "/tmp/nsys_$name.nsys-rep" \
                >/dev/null 2>&1
            echo "nsys $name exit status $?" | tee -a "$L"
        done
    fi
fi

if has diffusers; then
    step "diffusers eager (SDPA) fp16, same machine"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$CARRY"/*.whl 2>&1 | tail -2 | tee -a "$L"
    PYTHONPATH=/tmp/site timeout 300 python3 "$CARRY/bench_cuda_diffusers.py" 2>&1 | grep -v Warning | tee -a "$L"
fi
step done
