//! `cargo xtask rocm`: builds `sd-worker-rocm` (stable-diffusion.cpp on ggml's HIP backend) and checks that it
//! refuses to run where it cannot. Debian 12 has no hipBLAS/rocBLAS, so the build runs in a Debian sid root with
//! ROCm 6.4 (`xtask/scripts/rocm-root.sh`, made once and kept outside the clone) entered with chroot, with this
//! workspace, the Rust toolchain, the cargo registry and the build folder (`~/.cache/sdhive-rocm-target`, its own:
//! what is linked there needs sid's glibc) bind-mounted at their own paths. The gfx targets are `GFX_NAME`
//! (default `gfx1030;gfx1100`: RDNA2 and RDNA3 desktop cards), which the worker then names in `--version` and
//! `/v1/info`. ggml's flash-attention kernels are not built (`GGML_CUDA_FA=OFF`, through a CMake toolchain
//! file, the one way into diffusion-rs-sys's CMake call): the engine never asks stable-diffusion.cpp for flash
//! attention, and they were 37 % of the HIP compile.
//!
//! The checks, with no AMD GPU here: in a root that holds only the C and C++ runtime (a machine without ROCm),
//! the launcher answers `--version` with those targets and refuses `generate` naming rocm and the missing HIP
//! libraries; in the sid root, where the HIP runtime is installed but there is no GPU (no `/dev/kfd`), the engine
//! starts and refuses naming rocm and the device it did not find. Neither writes an image.

use crate::util::{script_output, workspace_root};
use anyhow::{bail, ensure, Context, Result};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const DEFAULT_TARGETS: &str = "gfx1030;gfx1100";
/// Read by CMake before ggml's options are declared, so this value stands.
const TOOLCHAIN_FILE: &str =
    "set(GGML_CUDA_FA OFF CACHE BOOL \"sdhive never asks for flash attention\" FORCE)\n";
/// The stamp of the root the build folder was made with: a new root (other compilers) starts it afresh.
const STAMP: &str = ".sdhive-root";

pub fn run() -> Result<()> {
    prepare()?.build_and_check()
}

/// The sid root made, its build folder ready, the folders mounted: everything before the build, where only the
/// machine (network, disk, privileges) can fail.
pub fn prepare() -> Result<Prepared> {
    let root = workspace_root();
    ensure!(is_root(), "cargo xtask rocm builds in a chroot and bind-mounts folders: run it as root");
    let sid = PathBuf::from(script_output(&root.join("xtask/scripts/rocm-root.sh"))?);
    let home = home()?;
    let targets = std::env::var("GFX_NAME").ok().filter(|t| !t.trim().is_empty());
    let targets = targets.unwrap_or_else(|| DEFAULT_TARGETS.to_string());
    let target_dir = build_dir(&home);
    let stamp = std::fs::read_to_string(sid.join(STAMP)).context("the sid root has no stamp")?;
    if std::fs::read_to_string(target_dir.join(STAMP)).ok().as_deref() != Some(stamp.as_str()) {
        let _ = std::fs::remove_dir_all(&target_dir);
    }
    std::fs::create_dir_all(&target_dir)
        .with_context(|| format!("cannot create {}", target_dir.display()))?;
    std::fs::write(target_dir.join(STAMP), &stamp)?;
    let toolchain_file = target_dir.join("sdhive-rocm.cmake");
    std::fs::write(&toolchain_file, TOOLCHAIN_FILE)
        .with_context(|| format!("cannot write {}", toolchain_file.display()))?;
    let cargo_home = std::env::var_os("CARGO_HOME").map_or_else(|| home.join(".cargo"), PathBuf::from);
    let rustup_home = std::env::var_os("RUSTUP_HOME").map_or_else(|| home.join(".rustup"), PathBuf::from);

    let mounts = Mounts::bind(
        &sid,
        &[Path::new("/proc"), Path::new("/dev"), &root, &cargo_home, &rustup_home, &target_dir],
    )?;
    let path =
        format!("/usr/lib/llvm-21/bin:{}:/usr/local/bin:/usr/bin:/bin", cargo_home.join("bin").display());
    let mut env: Vec<(&'static str, OsString)> = vec![
        // The HIP compiler is clang-21 (hipcc's); the build calls `clang`/`clang++`, found first here.
        ("PATH", path.into()),
        ("HOME", home.clone().into()),
        ("CARGO_HOME", cargo_home.clone().into()),
        ("RUSTUP_HOME", rustup_home.clone().into()),
        ("CARGO_TARGET_DIR", target_dir.clone().into()),
        ("CARGO_TERM_COLOR", "never".into()),
        ("HIP_PATH", "/usr".into()),
        ("GFX_NAME", targets.clone().into()),
        ("CMAKE_TOOLCHAIN_FILE", toolchain_file.into()),
    ];
    if let Some(toolchain) = std::env::var_os("RUSTUP_TOOLCHAIN") {
        env.push(("RUSTUP_TOOLCHAIN", toolchain));
    }
    Ok(Prepared { root, sid, targets, target_dir, env, mounts })
}

pub struct Prepared {
    root: PathBuf,
    sid: PathBuf,
    targets: String,
    target_dir: PathBuf,
    env: Vec<(&'static str, OsString)>,
    mounts: Mounts,
}

impl Prepared {
    /// Lints and builds sd-worker-rocm, then checks its refusals; any failure here is the code's.
    pub fn build_and_check(self) -> Result<()> {
        let Prepared { root, sid, targets, target_dir, env, mounts } = self;

        let started = std::time::Instant::now();
        let cargo = |args: &[&str]| -> Result<()> {
            let out = in_root(&sid, &root, &env, "cargo", args)?;
            ensure!(
                out.status.success(),
                "cargo {} in {} failed ({})",
                args.join(" "),
                sid.display(),
                out.status
            );
            Ok(())
        };
        // The code behind the `rocm` features (shared-worker's device opening, the worker's backend) is linted
        // here only; the build script's run (ggml) is shared with the build.
        let built = cargo(&[
            "clippy",
            "-p",
            "sd-worker-rocm",
            "--features",
            "rocm",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ])
        .and_then(|()| cargo(&["build", "-p", "sd-worker-rocm", "--features", "rocm"]));
        eprintln!(
            "xtask: sd-worker-rocm for {targets} linted and built in {:.0} s (in {})",
            started.elapsed().as_secs_f64(),
            sid.display()
        );
        built?;
        ensure_no_flash_attention(&target_dir)?;
        let exe = target_dir.join("debug/sd-worker-rocm");

        // A machine without ROCm: a root with the C and C++ runtime only.
        let bare = BareRoot::make(&sid, &exe)?;
        let version = bare.run(&["--version"])?;
        let line = String::from_utf8_lossy(&version.stdout).trim().to_string();
        let want = sdhive_launch::parse_targets(&targets).join(",");
        ensure!(
            version.status.success() && line.contains(&format!("gfx: {want}")),
            "sd-worker-rocm --version without the HIP runtime must name its gfx targets ({want}); it said: {line}"
        );
        eprintln!("xtask: sd-worker-rocm --version without ROCm: {line}");
        let no_hip = bare
            .run(&["generate", "--model", "/model", "--prompt", "a cat", "--steps", "1", "-o", "/x.png"])?;
        refuses("without the HIP runtime", &no_hip, &["libamdhip64"], &bare.path.join("x.png"))?;
        drop(bare);

        // The sid root: the HIP runtime, but no AMD GPU.
        let out = std::env::temp_dir().join("sdhive-rocm-no-gpu.png");
        let _ = std::fs::remove_file(&out);
        let model = root.join("tests/fixtures/models/sd1").to_string_lossy().into_owned();
        let (exe_arg, out_arg) = (exe.to_string_lossy().into_owned(), out.to_string_lossy().into_owned());
        let args = ["generate", "--model", &model, "--prompt", "a cat", "--steps", "1", "-o", &out_arg];
        let no_gpu = in_root(&sid, &root, &env, &exe_arg, &args)?;
        refuses("with the HIP runtime and no AMD GPU", &no_gpu, &["device"], &out)?;
        drop(mounts);
        Ok(())
    }
}

/// ggml's CMake cache of this build (the newest: an older configuration may be left beside it) says its
/// flash-attention kernels were left out, so the toolchain file took.
fn ensure_no_flash_attention(target_dir: &Path) -> Result<()> {
    let builds = target_dir.join("debug/build");
    let cache = std::fs::read_dir(&builds)
        .with_context(|| format!("cannot list {}", builds.display()))?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("diffusion-rs-sys-"))
        .map(|e| e.path().join("out/build/CMakeCache.txt"))
        .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
        .with_context(|| format!("no CMake cache of diffusion-rs-sys under {}", builds.display()))?;
    let text = std::fs::read_to_string(&cache)?;
    ensure!(
        text.lines().any(|l| l == "GGML_CUDA_FA:BOOL=OFF"),
        "{} does not have GGML_CUDA_FA off: the toolchain file was not used",
        cache.display()
    );
    Ok(())
}

/// Whether an earlier run left the sid root and a built engine on this machine (a build then takes a minute).
pub fn is_warm() -> bool {
    let Ok(home) = home() else { return false };
    // Where rocm-root.sh keeps the root.
    let sid = std::env::var_os("SDHIVE_ROCM_ROOT")
        .map_or_else(|| home.join(".cache/sdhive/rocm-sid"), PathBuf::from);
    sid.join(STAMP).is_file() && build_dir(&home).join("debug/sd-worker-rocm-engine").is_file()
}

fn home() -> Result<PathBuf> {
    std::env::var_os("HOME").map(PathBuf::from).context("HOME is not set")
}

/// The ROCm build's own folder (what is linked there needs sid's glibc).
fn build_dir(home: &Path) -> PathBuf {
    home.join(".cache/sdhive-rocm-target")
}

/// GB free on the disk of the home folder (where the root and the build folder go); `None` where df cannot say.
pub fn free_gb() -> Option<u64> {
    let home = std::env::var_os("HOME")?;
    let out = Command::new("df").arg("-Pk").arg(home).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let kb: u64 = text.lines().nth(1)?.split_whitespace().nth(3)?.parse().ok()?;
    Some(kb / (1024 * 1024))
}

pub fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// A root holding the launcher, the engine, the dynamic loader and the C/C++ runtime libraries from the sid
/// root, and nothing of ROCm; removed when dropped.
struct BareRoot {
    path: PathBuf,
    mounts: Option<Mounts>,
}

impl BareRoot {
    fn make(sid: &Path, exe: &Path) -> Result<BareRoot> {
        let path = std::env::temp_dir().join(format!("sdhive-rocm-bare-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        let mut bare = BareRoot { path, mounts: None };
        let libs = bare.path.join("lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&libs)?;
        std::fs::create_dir_all(bare.path.join("lib64"))?;
        let sid_libs = sid.join("usr/lib/x86_64-linux-gnu");
        std::fs::copy(sid_libs.join("ld-linux-x86-64.so.2"), bare.path.join("lib64/ld-linux-x86-64.so.2"))
            .context("copying sid's dynamic loader")?;
        for lib in ["libc.so.6", "libm.so.6", "libgcc_s.so.1", "libstdc++.so.6"] {
            std::fs::copy(sid_libs.join(lib), libs.join(lib))
                .with_context(|| format!("copying sid's {lib}"))?;
        }
        for name in ["sd-worker-rocm", "sd-worker-rocm-engine"] {
            let (from, to) = (exe.with_file_name(name), bare.path.join(name));
            if std::fs::hard_link(&from, &to).is_err() {
                std::fs::copy(&from, &to).with_context(|| format!("copying {}", from.display()))?;
            }
        }
        // The launcher finds the engine beside itself through /proc/self/exe, and asks the loader with stdin on
        // /dev/null.
        bare.mounts = Some(Mounts::bind(&bare.path, &[Path::new("/proc"), Path::new("/dev")])?);
        Ok(bare)
    }

    fn run(&self, args: &[&str]) -> Result<Output> {
        Command::new("chroot")
            .arg(&self.path)
            .arg("/sd-worker-rocm")
            .args(args)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .output()
            .context("cannot run sd-worker-rocm in the bare root")
    }
}

impl Drop for BareRoot {
    fn drop(&mut self) {
        // Unmounted before the folder goes, so nothing of the host's /dev is removed with it.
        drop(self.mounts.take());
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The worker must have failed without an image, naming rocm and one of `names`.
fn refuses(case: &str, out: &Output, names: &[&str], image: &Path) -> Result<()> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let said =
        stderr.lines().find(|l| l.starts_with("Error")).or_else(|| stderr.lines().last()).unwrap_or("");
    eprintln!("xtask: sd-worker-rocm {case} said: {}", said.trim());
    if out.status.success() || image.exists() {
        let _ = std::fs::remove_file(image);
        bail!("sd-worker-rocm generated an image {case}");
    }
    let lower = stderr.to_lowercase();
    ensure!(
        lower.contains("rocm") && names.iter().any(|n| lower.contains(n)),
        "sd-worker-rocm {case} failed without naming rocm and one of {names:?}:\n{stderr}"
    );
    Ok(())
}

/// Runs `program args` inside the sid root, in `dir`, with exactly `env`; its stderr is echoed as it comes
/// (a cold build is long) and kept.
fn in_root(sid: &Path, dir: &Path, env: &[(&str, OsString)], program: &str, args: &[&str]) -> Result<Output> {
    eprintln!("xtask: (in {}) {program} {}", sid.display(), args.join(" "));
    let mut cmd = Command::new("chroot");
    cmd.arg(sid).arg("/usr/bin/env").arg("-i");
    for (k, v) in env {
        let mut kv = OsString::from(format!("{k}="));
        kv.push(v);
        cmd.arg(kv);
    }
    cmd.arg("/bin/sh").arg("-c").arg("cd \"$0\" && exec \"$@\"").arg(dir).arg(program).args(args);
    cmd.stdout(std::process::Stdio::inherit()).stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().context("cannot start chroot (cargo xtask rocm runs as root)")?;
    let mut captured = Vec::new();
    if let Some(mut err) = child.stderr.take() {
        use std::io::{Read, Write};
        let mut buf = [0u8; 8192];
        loop {
            let n = err.read(&mut buf).context("reading the chroot's stderr")?;
            if n == 0 {
                break;
            }
            let _ = std::io::stderr().write_all(&buf[..n]);
            captured.extend_from_slice(&buf[..n]);
        }
    }
    let status = child.wait().context("waiting for the chroot")?;
    Ok(Output { status, stdout: Vec::new(), stderr: captured })
}

/// Bind mounts into a root (the sid root, the bare one), each host path at its own path there; undone when dropped.
struct Mounts {
    points: Vec<PathBuf>,
}

impl Mounts {
    fn bind(root: &Path, paths: &[&Path]) -> Result<Mounts> {
        let mut mounts = Mounts { points: Vec::new() };
        let mut done: Vec<PathBuf> = Vec::new();
        for path in paths {
            let path = path.canonicalize().with_context(|| format!("{} does not exist", path.display()))?;
            // A folder inside one already mounted (the target folder in the workspace) comes with it.
            if done.iter().any(|d| path.starts_with(d)) {
                continue;
            }
            let point = root.join(path.strip_prefix("/").unwrap_or(&path));
            std::fs::create_dir_all(&point).with_context(|| format!("cannot create {}", point.display()))?;
            let already =
                Command::new("mountpoint").arg("-q").arg(&point).status().is_ok_and(|s| s.success());
            if !already {
                let status = Command::new("mount")
                    .arg("--rbind")
                    .arg(&path)
                    .arg(&point)
                    .status()
                    .context("cannot run mount")?;
                ensure!(status.success(), "mount --rbind {} {} failed", path.display(), point.display());
                mounts.points.push(point);
            }
            done.push(path);
        }
        Ok(mounts)
    }
}

impl Drop for Mounts {
    fn drop(&mut self) {
        for point in self.points.iter().rev() {
            let ok = Command::new("umount").arg("-R").arg(point).status().is_ok_and(|s| s.success());
            if !ok {
                let _ = Command::new("umount").arg("-R").arg("-l").arg(point).status();
            }
        }
    }
}
