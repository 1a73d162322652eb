//! The CI sequence. `.ci/run` calls the README's test command, which is `cargo xtask ci`.
//!
//! After the workspace's tests come the web page's checks and browser tests (`cargo xtask webui`) and the
//! deployment files' checks (`cargo xtask k8s`). After the CPU checks it builds `sd-worker-cuda` with the
//! CUDA toolchain (as `cargo xtask build-cuda` does, in the dev profile: CI proves it builds, the release
//! build is for GPUs) and runs it on this GPU-less machine, where it must fail naming cuda and the missing
//! driver (with a driver-less libcuda) or the missing libcuda.so.1 (with none); then builds it again with
//! cuDNN. `SDHIVE_CI_SKIP_CUDA=1` skips that part for quick local iterations only; CI runs it.

use crate::cuda;
use crate::util::{cargo, workspace_root};
use anyhow::Result;

pub fn run() -> Result<()> {
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
    Ok(())
}

const SDCPP: &str = "sdhive-sdcpp";
