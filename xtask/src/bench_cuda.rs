//! `cargo xtask bench cuda`: everything the CUDA benchmark needs on a GPU machine that has no Rust — the release
//! `sdhive-bench` and `sd-worker-cuda`, the diffusers wheel for the reference side (the machine provides PyTorch,
//! transformers and the CUDA 13 libraries), and the scripts — in one folder.
//! On the GPU machine, from a checkout of this repository (the fixtures' tokenizers are templates for the random
//! models): `bash <folder>/run.sh OUT_DIR` prints the side-by-side table (xtask/bench/cuda_table.py).

use crate::cuda;
use crate::util::{target_dir, workspace_root};
use anyhow::{ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The reference side's Python packages beyond what a PyTorch machine has (torch, torchvision, transformers,
/// huggingface_hub, safetensors, numpy, Pillow): diffusers and spandrel (with einops), pinned to what the reference
/// interpreter of this repository runs.
const WHEELS: [&str; 4] = ["diffusers==0.42.1", "importlib_metadata", "spandrel==0.4.2", "einops"];

/// The GPU machine's Python (the PyTorch images ship 3.12).
const PYTHON_VERSION: &str = "3.12";

pub fn run(out: Option<PathBuf>, python: &str) -> Result<()> {
    let root = workspace_root();
    let out = out.unwrap_or_else(|| target_dir().join("bench-cuda"));
    // With cuDNN, as the fast build is meant to run (the GPU machine has libcudnn 9 beside PyTorch).
    cuda::build(cuda::Extras { bench: true, tests: false, cudnn: true, dev: false })?;
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let release = target_dir().join("release");
    let staged = out.join("bin");
    std::fs::create_dir_all(&staged)?;
    for exe in ["sdhive-bench", "sd-worker-cuda", cuda::ENGINE] {
        let dst = staged.join(exe);
        std::fs::copy(release.join(exe), &dst).with_context(|| format!("copying {exe}"))?;
        run_cmd(Command::new("strip").arg(&dst), "strip")?;
    }
    // One archive: the binaries share candle's kernels, which xz then stores once.
    run_cmd(
        Command::new("tar").arg("-cJf").arg(out.join("bins.tar.xz")).arg("-C").arg(&staged).args(["."]),
        "tar",
    )?;
    std::fs::remove_dir_all(&staged)?;
    let wheels = out.join("wheels");
    std::fs::create_dir_all(&wheels)?;
    run_cmd(
        Command::new(python)
            .args(["-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"])
            .args(["--python-version", PYTHON_VERSION, "--platform", "manylinux_2_28_x86_64"])
            .args(["--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64"])
            .arg("-d")
            .arg(&wheels)
            .args(WHEELS),
        "pip download of the reference wheels",
    )?;
    for f in [
        "bench_cuda_diffusers.py",
        "cuda_table.py",
        "run.sh",
        "bench_switch_diffusers.py",
        "switch_table.py",
        "make_lora.py",
        "bench_lora_diffusers.py",
        "lora_table.py",
        "bench_esrgan_spandrel.py",
        "upscale_table.py",
        "bench_hires_diffusers.py",
        "hires_table.py",
        "bench_run.py",
        "serve_table.py",
        "bench_serve_diffusers.py",
        "bench_sd3_diffusers.py",
        "sd3_table.py",
        "kernel_groups.py",
    ] {
        copy(&root.join("xtask/bench").join(f), &out.join(f))?;
    }
    // The switch benchmark's single-file checkpoints are converted from the random folders on the GPU machine.
    copy(&root.join("xtask/fixtures/gen_single_file.py"), &out.join("gen_single_file.py"))?;
    let size: u64 = walk_size(&out)?;
    eprintln!(
        "xtask: {} ({:.0} MiB). On the GPU machine, from the repository root: bash {}/run.sh OUT_DIR",
        out.display(),
        size as f64 / (1 << 20) as f64,
        out.display()
    );
    Ok(())
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    Ok(())
}

fn walk_size(dir: &Path) -> Result<u64> {
    let mut n = 0;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let m = e.metadata()?;
        n += if m.is_dir() { walk_size(&e.path())? } else { m.len() };
    }
    Ok(n)
}

fn run_cmd(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {what}"))?;
    ensure!(status.success(), "{what} failed ({status})");
    Ok(())
}
