//! Helpers for the end-to-end tests in `e2e/`: locating (and building, when needed) the worker binaries and
//! the fixture models, so each test only says what it runs and what it expects.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// `tests/fixtures`, where the tiny models and images live.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// The `sd-worker-cpu` binary: `SD_WORKER_CPU_BIN` if set, else built with `cargo build` into the target
/// directory this test runs from. A bin-only package cannot be a dependency, so `CARGO_BIN_EXE_*` is not
/// available here; building it explicitly also guarantees the tests never run a stale binary.
pub fn worker_cpu() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = std::env::var_os("SD_WORKER_CPU_BIN") {
            return PathBuf::from(bin);
        }
        build_bin("sd-worker-cpu", "sd-worker-cpu")
    })
}

/// The `hive` binary (package `sdhive-hive`): `SDHIVE_HIVE_BIN` if set, else built like [`worker_cpu`], into
/// the same folder, which is where the hive looks for worker binaries. Builds the CPU worker too.
pub fn hive() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = std::env::var_os("SDHIVE_HIVE_BIN") {
            return PathBuf::from(bin);
        }
        worker_cpu();
        build_bin("sdhive-hive", "hive")
    })
}

fn build_bin(package: &str, bin_name: &str) -> PathBuf {
    // The test executable is <target>/<profile>/deps/<name>-<hash>.
    let exe = std::env::current_exe().expect("cannot locate the test executable");
    let profile_dir =
        exe.parent().and_then(Path::parent).expect("test executable is not in <target>/<profile>/deps");
    let target_dir = profile_dir.parent().expect("profile folder has no parent");
    // `cargo test` builds with the `test` profile into `debug/`; building the binary with the same profile reuses
    // the libraries it just compiled instead of building a second, differently optimised copy.
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "test",
        Some(other) => other,
    };
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let status = Command::new(env!("CARGO"))
        .args(["build", "--quiet", "-p", package, "--profile", profile, "--manifest-path"])
        .arg(&manifest)
        .env("CARGO_TARGET_DIR", target_dir)
        .status()
        .expect("cannot run cargo");
    assert!(status.success(), "cargo build -p {package} failed");
    let bin = profile_dir.join(format!("{bin_name}{}", std::env::consts::EXE_SUFFIX));
    assert!(bin.is_file(), "{} was not built", bin.display());
    bin
}

/// Runs the CPU worker with `args`.
pub fn run_worker(args: &[&str]) -> Output {
    Command::new(worker_cpu()).args(args).output().expect("cannot start sd-worker-cpu")
}
