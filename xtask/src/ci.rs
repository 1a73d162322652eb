//! The CI sequence. `.ci/run` calls the README's test command, which is `cargo xtask ci`.
//!
//! After the workspace's tests come the web page's checks and browser tests (`cargo xtask webui`) and the
//! deployment files' checks (`cargo xtask k8s`). After the CPU checks it builds `sd-worker-cuda` with the
//! CUDA toolchain (as `cargo xtask build-cuda` does, in the dev profile: CI proves it builds, the release
//! build is for GPUs) and runs it on this GPU-less machine, where it must fail naming cuda and the missing
//! driver (with a driver-less libcuda) or the missing libcuda.so.1 (with none); then builds it again with
//! cuDNN. `SDHIVE_CI_SKIP_CUDA=1` skips that part for quick local iterations only; CI runs it.
//!
//! Last comes `sd-worker-rocm` (`cargo xtask rocm`), when it fits in the run's 70-minute budget: cold (the Debian
//! sid root with ROCm to make, ggml's HIP kernels to compile for two gfx targets) it took 16.5 minutes on two
//! cores, reached at minute 36 of a run on a fresh machine that ended at minute 52; with the root and its build
//! folder kept from an earlier run on this machine it takes about one. The run says which it did, or why not.

use crate::cuda;
use crate::util::{cargo, workspace_root};
use anyhow::Result;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// What the whole CI run may take (its hard limit is 90 minutes).
const BUDGET: Duration = Duration::from_secs(70 * 60);
/// `cargo xtask rocm` on two cores: from nothing (measured 16.5 min: the root 1.5, lint and build 14.7; with a
/// margin for a slower machine), and with the root and build folder kept (measured under a minute).
const ROCM_COLD: Duration = Duration::from_secs(20 * 60);
const ROCM_WARM: Duration = Duration::from_secs(3 * 60);
/// Disk the ROCm build adds: the root (2.5 GB, 1.3 GB downloaded) and its build folder (2.6 GB); a warm one
/// rebuilds the workspace's crates only.
const ROCM_COLD_DISK_GB: u64 = 8;
const ROCM_WARM_DISK_GB: u64 = 2;

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
    match rocm_decision(started.elapsed(), crate::rocm::is_warm(), crate::rocm::free_gb()) {
        Ok(plan) => {
            eprintln!("xtask: {plan}");
            // The root's packages come from Debian's registry and the build needs chroot: where the machine
            // cannot give them, the run says so and goes on; what fails after that is the code's and fails it.
            match crate::rocm::prepare() {
                Ok(prepared) => prepared.build_and_check(),
                Err(e) => {
                    eprintln!("xtask: NOT building sd-worker-rocm in this run: this machine could not prepare it: {e:#}");
                    Ok(())
                }
            }
        }
        Err(why) => {
            eprintln!("xtask: NOT building sd-worker-rocm in this run: {why} (run `cargo xtask rocm` alone)");
            Ok(())
        }
    }
}

/// Whether the ROCm build runs, `elapsed` into the CI run: what it will do, or why not.
fn rocm_decision(elapsed: Duration, warm: bool, free_gb: Option<u64>) -> Result<String, String> {
    let (cost, room) = if warm { (ROCM_WARM, ROCM_WARM_DISK_GB) } else { (ROCM_COLD, ROCM_COLD_DISK_GB) };
    let kind = if warm { "warm" } else { "cold" };
    let minutes = |d: Duration| d.as_secs() / 60;
    if let Some(free) = free_gb.filter(|&gb| gb < room) {
        return Err(format!("a {kind} build needs about {room} GB of disk, {free} GB are free"));
    }
    if elapsed + cost > BUDGET {
        return Err(format!(
            "{} min have passed and a {kind} build takes about {} more, past {} min",
            minutes(elapsed),
            minutes(cost),
            minutes(BUDGET)
        ));
    }
    Ok(format!(
        "{} min have passed; building sd-worker-rocm ({kind}, about {} min)",
        minutes(elapsed),
        minutes(cost)
    ))
}

const SDCPP: &str = "sdhive-sdcpp";

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    #[test]
    fn the_rocm_build_runs_only_where_it_fits() {
        // A cold CI run on a fresh machine reached the step at 36 min and ended at 52.
        assert!(rocm_decision(36 * MIN, false, Some(50)).is_ok());
        assert!(rocm_decision(50 * MIN, false, Some(50)).is_ok(), "a cold build ends by minute 70");
        assert!(rocm_decision(51 * MIN, false, Some(50)).unwrap_err().contains("past 70 min"));
        assert!(rocm_decision(67 * MIN, true, Some(50)).is_ok());
        assert!(rocm_decision(68 * MIN, true, Some(50)).unwrap_err().contains("past 70 min"));
        assert!(rocm_decision(10 * MIN, false, Some(5)).unwrap_err().contains("8 GB of disk, 5 GB are free"));
        assert!(rocm_decision(10 * MIN, true, None).is_ok());
    }
}
