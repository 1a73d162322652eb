//! Regenerates the committed fixtures of the scripts below, in order (the tiny models first; the others read them;
//! SD3's LoRA goldens read SD3's models). The other scripts are run by hand, as xtask/fixtures/README.md says.

use crate::util::workspace_root;
use anyhow::{bail, Context, Result};
use std::process::Command;

const SCRIPTS: &[&str] = &[
    "gen_models.py",
    "gen_single_file.py",
    "gen_external_vae.py",
    "gen_schedulers.py",
    "gen_sd3.py",
    "gen_sd3_lora.py",
];

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
