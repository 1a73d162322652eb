//! `cargo xtask webui`: the web page's checks. Installs the frontend's packages (`npm ci`), rebuilds `web/dist`
//! and fails if the build differs from what is committed (the binaries embed the committed files), type-checks,
//! builds the hive and the CPU worker, then runs the browser tests (Playwright driving Debian's Chromium against a
//! real hive on the fixture models).

use crate::util::{self, cargo, target_dir, workspace_root};
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;

pub fn run() -> Result<()> {
    let root = workspace_root();
    let web = root.join("web");
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    if !Path::new(&chromium).is_file() {
        bail!(
            "{chromium} not found: the browser tests need Debian's `chromium` package (or CHROMIUM=<path>)"
        );
    }
    for tool in ["node", "npm"] {
        Command::new(tool)
            .arg("--version")
            .output()
            .with_context(|| format!("`{tool}` not found: the web page's build needs Node.js and npm"))?;
    }
    util::run(&web, "npm", &["ci", "--no-audit", "--no-fund"])?;
    util::run(&web, "npm", &["run", "build"])?;
    let changed = Command::new("git")
        .args(["status", "--porcelain", "--", "web/dist"])
        .current_dir(&root)
        .output()
        .context("running git status")?;
    let changed = String::from_utf8_lossy(&changed.stdout);
    if !changed.trim().is_empty() {
        bail!("web/dist differs from a fresh build of web/: commit the output of `npm run build`\n{changed}");
    }
    util::run(&web, "npm", &["run", "check"])?;
    // The profile the end-to-end tests of `cargo test` build their binaries with, so CI compiles them once.
    cargo(&root, &["build", "--quiet", "-p", "sdhive-hive", "-p", "sd-worker-cpu", "--profile", "test"])?;
    let hive = target_dir().join("debug").join("hive");
    let status = Command::new("npx")
        .args(["--no-install", "playwright", "test"])
        .current_dir(&web)
        .env("SDHIVE_HIVE_BIN", &hive)
        .env("CHROMIUM", &chromium)
        .status()
        .context("running npx playwright test")?;
    if !status.success() {
        bail!("browser tests failed ({status}); screenshots and traces are in web/test-results");
    }
    Ok(())
}
