//! The CI sequence. `.ci/run` calls the README's test command, which is `cargo xtask ci`.

use crate::util::{cargo, workspace_root};
use anyhow::Result;

pub fn run() -> Result<()> {
    let root = workspace_root();
    cargo(&root, &["fmt", "--all", "--check"])?;
    cargo(&root, &["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"])?;
    cargo(&root, &["test", "--workspace"])?;
    Ok(())
}
