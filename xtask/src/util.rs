//! Small process helpers shared by the tasks.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root: xtask's manifest lives one level below it.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Where cargo puts build outputs: `$CARGO_TARGET_DIR` (relative to the workspace root) or `<root>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR").filter(|d| !d.is_empty()) {
        Some(d) => workspace_root().join(d),
        None => workspace_root().join("target"),
    }
}

pub fn cargo(root: &Path, args: &[&str]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(root, &cargo, args)
}

/// Runs `program args…` in `dir`, echoing the command; fails naming it when it fails.
pub fn run(dir: &Path, program: &str, args: &[&str]) -> Result<()> {
    let name = Path::new(program).file_name().map_or(program.into(), |n| n.to_string_lossy());
    eprintln!("xtask: {name} {}", args.join(" "));
    let status = Command::new(program)
        .args(args)
        .current_dir(dir)
        .status()
        .with_context(|| format!("running {name} {}", args.join(" ")))?;
    if !status.success() {
        bail!("{name} {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// Runs a helper script that prints one line (a path) and returns it; the script's progress and errors go to
/// stderr as they come.
pub fn script_output(script: &Path) -> Result<String> {
    let out = Command::new(script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed ({})", script.display(), out.status);
    }
    Ok(String::from_utf8(out.stdout)
        .with_context(|| format!("{} printed a path that is not UTF-8", script.display()))?
        .trim()
        .to_string())
}
