//! The CI sequence. `.ci/run` calls the README's test command, which is `cargo xtask ci`.
//!
//! After the workspace's tests come the web page's checks and browser tests (`cargo xtask webui`) and the
//! deployment files' checks (`cargo xtask k8s`). After the CPU checks it builds `sd-worker-cuda` with the
//! CUDA toolchain (as `cargo xtask build-cuda` does, in the dev profile: CI proves it builds, the release
//! build is for GPUs) and runs it on this GPU-less machine, where it must fail naming cuda and the missing
//! driver (with a driver-less libcuda) or the missing libcuda.so.1 (with none); then builds it again with
//! cuDNN. `SDHIVE_CI_SKIP_CUDA=1` skips that part for quick local iterations only; CI runs it.
//!
//! Last comes `sd-worker-rocm` (`cargo xtask rocm`), when it fits in the run's time: cold (the Debian sid root
//! with ROCm to make, ggml's HIP kernels to compile for two gfx targets) it takes about 27 minutes on CI's two
//! cores, more than a cold run of everything else leaves of its 70-minute budget; with the root and its build
//! folder kept from an earlier run on this machine it takes about one. The run says which it did and why.

use crate::cuda;
use crate::util::{cargo, workspace_root};
use anyhow::Result;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// What the whole CI run may take (its hard limit is 90 minutes).
const BUDGET: Duration = Duration::from_secs(70 * 60);
/// `cargo xtask rocm` on CI's two cores, measured: from nothing, and with the root and build folder kept.
const ROCM_COLD: Duration = Duration::from_secs(28 * 60);
const ROCM_WARM: Duration = Duration::from_secs(3 * 60);

pub fn run() -> Result<()> {
    let started = run_started();
    let root = workspace_root();
    cargo(&root, &["fmt", "--all", "--check"])?;
    // stable-diffusion.cpp is compiled once, with the Vulkan backend, by the `vulkan` step below; building it a
    // second time for the CPU alone would double the longest compile of the run.
    cargo(&root, &["clippy", "--workspace", "--exclude", SDCPP, "--all-targets", "--", "-D", "warnings"])?;
    cargo(&root, &["test", "--workspace", "--exclude", SDCPP])?;
    crate::webui::run()?;
    crate::k8s::run()?;
    crate::vulkan::run()?;
    if std::env::var("SDHIVE_CI_SKIP_CUDA").is_ok_and(|v| !v.is_empty() && v != "0") {
        eprintln!("xtask: SDHIVE_CI_SKIP_CUDA is set: skipping the CUDA build and check");
        return Ok(());
    }
    let exe = cuda::build(cuda::Extras { dev: true, ..cuda::Extras::default() })?;
    cuda::check_refuses_without_gpu(&exe)?;
    // The cuDNN variant, what GPU machines run: it must build too (only the crates the feature touches rebuild).
    cuda::build(cuda::Extras { dev: true, cudnn: true, ..cuda::Extras::default() })?;
    rocm_when_it_fits(started)
}

/// When the run began: `.ci/run` exports `SDHIVE_CI_STARTED` (seconds since the epoch) before it installs
/// packages; otherwise now.
fn run_started() -> Instant {
    let now = Instant::now();
    let since =
        std::env::var("SDHIVE_CI_STARTED").ok().and_then(|s| s.trim().parse::<u64>().ok()).and_then(|t| {
            let epoch = SystemTime::now().duration_since(UNIX_EPOCH).ok()?.as_secs();
            epoch.checked_sub(t)
        });
    since.and_then(|s| now.checked_sub(Duration::from_secs(s))).unwrap_or(now)
}

fn rocm_when_it_fits(started: Instant) -> Result<()> {
    if !crate::rocm::is_root() {
        eprintln!("xtask: NOT building sd-worker-rocm: its build runs in a chroot, which needs root");
        return Ok(());
    }
    let warm = crate::rocm::is_warm();
    let cost = if warm { ROCM_WARM } else { ROCM_COLD };
    let elapsed = started.elapsed();
    let minutes = |d: Duration| d.as_secs() / 60;
    if elapsed + cost > BUDGET {
        eprintln!(
            "xtask: NOT building sd-worker-rocm in this run: {} min have passed and a {} ROCm build takes about {} \
             more, past the {}-minute budget (run `cargo xtask rocm` alone)",
            minutes(elapsed),
            if warm { "warm" } else { "cold" },
            minutes(cost),
            minutes(BUDGET)
        );
        return Ok(());
    }
    eprintln!(
        "xtask: {} min have passed; building sd-worker-rocm ({}, about {} min)",
        minutes(elapsed),
        if warm { "warm" } else { "cold" },
        minutes(cost)
    );
    crate::rocm::run()
}

const SDCPP: &str = "sdhive-sdcpp";
