//! A Python interpreter that can import the client libraries a test drives the server with (the `openai` SDK,
//! `webuiapi`): `SDHIVE_TEST_PYTHON`, else `python3` when it has them, else a venv under the target directory
//! with them installed from PyPI (once; later runs reuse it).

use std::path::{Path, PathBuf};
use std::process::Command;

fn imports(python: &Path, modules: &[&str]) -> bool {
    let statement = format!("import {}", modules.join(", "));
    Command::new(python).args(["-c", &statement]).output().is_ok_and(|o| o.status.success())
}

/// A Python that can import `modules` (PyPI packages of the same names); `venv` names the folder the packages
/// are installed into when neither the environment's nor the system's Python has them.
pub fn python_with(modules: &[&str], venv: &str) -> Result<PathBuf, String> {
    let listed = modules.join(", ");
    if let Some(python) = std::env::var_os("SDHIVE_TEST_PYTHON") {
        let python = PathBuf::from(python);
        return if imports(&python, modules) {
            Ok(python)
        } else {
            Err(format!("SDHIVE_TEST_PYTHON={} cannot `import {listed}`", python.display()))
        };
    }
    let system = PathBuf::from("python3");
    if imports(&system, modules) {
        return Ok(system);
    }
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join(venv);
    let python = venv.join("bin/python");
    if imports(&python, modules) {
        return Ok(python);
    }
    let run = |cmd: &mut Command| -> Result<(), String> {
        let out = cmd.output().map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{cmd:?} failed:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    };
    run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    run(Command::new(&python).args(["-m", "pip", "install", "--quiet"]).args(modules))?;
    if imports(&python, modules) {
        Ok(python)
    } else {
        Err(format!("installed {listed} into {} but they cannot be imported", venv.display()))
    }
}
