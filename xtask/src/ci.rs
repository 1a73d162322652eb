//! The CI sequence. `.ci/run` calls the README's test command, which is `cargo xtask ci`.

use crate::util::{cargo, workspace_root};
use anyhow::Result;

pub fn run() -> Result<()> {
    let root = workspace_root();
    cargo(&root, &["fmt", "--all", "--check"])?;
    // stable-diffusion.cpp is compiled once, with the Vulkan backend, by the `vulkan` step below; building it a
    // second time for the CPU alone would double the longest compile of the run.
    cargo(&root, &["clippy", "--workspace", "--exclude", SDCPP, "--all-targets", "--", "-D", "warnings"])?;
    cargo(&root, &["test", "--workspace", "--exclude", SDCPP])?;
    crate::vulkan::run()?;
    Ok(())
}

const SDCPP: &str = "sdhive-sdcpp";
