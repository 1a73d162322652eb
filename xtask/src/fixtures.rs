//! Regenerates the committed fixtures: every `xtask/fixtures/gen_*.py` script in a fixed order (the tiny models
//! first; the others read them).

use crate::util::workspace_root;
use anyhow::{bail, Context, Result};
use std::process::Command;

const SCRIPTS: &[&str] = &["gen_models.py", "gen_single_file.py", "gen_external_vae.py", "gen_schedulers.py"];

pub fn run(python: &str) -> Result<()> {
    let root = workspace_root();
    for script in SCRIPTS {
        let path = root.join("xtask/fixtures").join(script);
        eprintln!("xtask: {python} {}", path.display());
        let status = Command::new(python)
            .arg(&path)
            .current_dir(&root)
            .status()
            .with_context(|| format!("running {python} {}", path.display()))?;
        if !status.success() {
            bail!("{} failed ({status})", path.display());
        }
    }
    Ok(())
}
