//! The CUDA toolchain and build, on machines with neither a GPU nor a CUDA install: `cargo xtask cuda-toolchain`
//! fetches NVIDIA's PyPI wheels (CUDA 13.0, pinned) into a cache outside the clone, and `cargo xtask build-cuda`
//! builds `sd-worker-cuda` (and, on request, the CUDA bench and parity-test binaries) against it.
//!
//! Why 13.0: the driver JIT-compiles candle's PTX and refuses PTX from a newer nvcc than it knows; the H100 hosts
//! run a CUDA 13.0 driver. `libcuda` belongs to the driver and ships in no wheel, so the link uses a stub with
//! soname `libcuda.so.1` whose symbols are learnt from the linker (see [`Stub`]), never kept by hand; at run time
//! the real driver library is loaded instead.

use crate::util::{target_dir, workspace_root};
use anyhow::{bail, Context, Result};
use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Wheels of CUDA 13.0 with what candle's build (nvcc, headers) and link (cublas, curand, nvrtc, cudart) need.
const WHEELS: [&str; 8] = [
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-cccl==13.0.85",
    "nvidia-cublas==13.0.2.14",
    "nvidia-curand==10.4.0.35",
    "nvidia-cuda-nvrtc==13.0.88",
];

/// Libraries linked as `-lNAME` that the wheels ship only with versioned names.
const UNVERSIONED: [&str; 5] = ["cublas", "cublasLt", "cudart", "curand", "nvrtc"];
/// cuDNN for `--cudnn` builds: the release PyTorch 2.15 (CUDA 13) ships, so the worker finds the same library
/// beside a PyTorch install at run time.
const CUDNN_WHEEL: &str = "nvidia-cudnn-cu13==9.26.0.51";

/// Hopper (H100/H200): candle compiles its kernels for one architecture per build.
pub const DEFAULT_COMPUTE_CAP: &str = "90";

/// Where the toolchain lives: `$SDHIVE_CUDA_HOME`, else `~/.cache/sdhive-cuda-13.0`.
pub struct Toolchain {
    pub home: PathBuf,
}

impl Toolchain {
    pub fn locate() -> Result<Self> {
        if let Some(h) = std::env::var_os("SDHIVE_CUDA_HOME").filter(|h| !h.is_empty()) {
            return Ok(Toolchain { home: PathBuf::from(h) });
        }
        let home = std::env::var_os("HOME").context("HOME is not set; set SDHIVE_CUDA_HOME")?;
        Ok(Toolchain { home: Path::new(&home).join(".cache/sdhive-cuda-13.0") })
    }

    /// `CUDA_ROOT`: the unpacked wheels' `nvidia/cu13`.
    pub fn root(&self) -> PathBuf {
        self.home.join("prefix/nvidia/cu13")
    }

    pub fn lib(&self) -> PathBuf {
        self.root().join("lib")
    }

    /// The unpacked cuDNN wheel's libraries (`--cudnn` builds only).
    pub fn cudnn_lib(&self) -> PathBuf {
        self.home.join("prefix/nvidia/cudnn/lib")
    }

    /// The folder holding the generated `libcuda.so` link stub.
    pub fn stub_dir(&self) -> PathBuf {
        self.home.join("stub")
    }

    fn nvcc(&self) -> PathBuf {
        self.root().join("bin/nvcc")
    }

    /// The environment for `cargo build --features cuda`.
    pub fn build_env(&self) -> Vec<(&'static str, OsString)> {
        let root = self.root().into_os_string();
        let mut path = self.root().join("bin").into_os_string();
        if let Some(p) = std::env::var_os("PATH") {
            path.push(":");
            path.push(p);
        }
        let mut libs = self.lib().into_os_string();
        libs.push(":");
        libs.push(self.stub_dir());
        let cap = std::env::var_os("CUDA_COMPUTE_CAP").unwrap_or_else(|| DEFAULT_COMPUTE_CAP.into());
        vec![
            ("CUDA_ROOT", root.clone()),
            ("CUDA_PATH", root),
            ("PATH", path),
            ("LIBRARY_PATH", libs),
            // Without it candle-kernels' build runs nvidia-smi, which a GPU-less machine lacks.
            ("CUDA_COMPUTE_CAP", cap),
        ]
    }

    /// `LD_LIBRARY_PATH` for running a CUDA binary here: the wheels' libraries and the stub standing in for the
    /// absent driver, so the binary starts and reports that there is no driver.
    pub fn run_library_path(&self) -> OsString {
        let mut p = self.lib().into_os_string();
        p.push(":");
        p.push(self.stub_dir());
        p
    }

    /// The wheels' libraries alone: a machine with the CUDA runtime libraries but no driver at all.
    pub fn runtime_library_path(&self) -> OsString {
        self.lib().into_os_string()
    }
}

/// `cargo xtask cuda-toolchain`: download and unpack the wheels once, then make the unversioned links.
pub fn toolchain() -> Result<Toolchain> {
    let tc = Toolchain::locate()?;
    if tc.nvcc().is_file() {
        eprintln!("xtask: CUDA toolchain present in {}", tc.home.display());
    } else {
        install_wheels(&tc)?;
    }
    link_unversioned(&tc.lib())?;
    eprintln!("xtask: CUDA_ROOT={}", tc.root().display());
    Ok(tc)
}

fn install_wheels(tc: &Toolchain) -> Result<()> {
    let wheels = tc.home.join("wheels");
    std::fs::create_dir_all(&wheels).with_context(|| format!("creating {}", wheels.display()))?;
    let python =
        std::env::var("SDHIVE_PYTHON").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| "python3".into());
    let mut pip = Command::new(&python);
    pip.args(["-m", "pip", "download", "--no-deps", "-d"]).arg(&wheels).args(WHEELS);
    run(&mut pip, "pip download of the CUDA 13.0 wheels")?;
    let prefix = tc.home.join("prefix");
    for entry in std::fs::read_dir(&wheels).with_context(|| format!("reading {}", wheels.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "whl") {
            // unzip keeps the executable bits nvcc and its helpers need (Python's zipfile drops them).
            let mut unzip = Command::new("unzip");
            unzip.arg("-qo").arg(&path).arg("-d").arg(&prefix);
            run(&mut unzip, &format!("unzip {}", path.display()))?;
        }
    }
    if !tc.nvcc().is_file() {
        bail!("the wheels unpacked, but {} is missing", tc.nvcc().display());
    }
    Ok(())
}

/// Downloads and unpacks the cuDNN wheel once and links `libcudnn.so` for the linker.
fn install_cudnn(tc: &Toolchain) -> Result<()> {
    let lib = tc.cudnn_lib();
    if !lib.join("libcudnn.so.9").is_file() {
        let wheels = tc.home.join("wheels-cudnn");
        std::fs::create_dir_all(&wheels).with_context(|| format!("creating {}", wheels.display()))?;
        let python =
            std::env::var("SDHIVE_PYTHON").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| "python3".into());
        let mut pip = Command::new(&python);
        pip.args(["-m", "pip", "download", "--no-deps", "-d"]).arg(&wheels).arg(CUDNN_WHEEL);
        run(&mut pip, "pip download of the cuDNN wheel")?;
        for entry in std::fs::read_dir(&wheels).with_context(|| format!("reading {}", wheels.display()))? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "whl") {
                let mut unzip = Command::new("unzip");
                unzip.arg("-qo").arg(&path).arg("-d").arg(tc.home.join("prefix"));
                run(&mut unzip, &format!("unzip {}", path.display()))?;
            }
        }
    }
    link_unversioned_names(&lib, &["cudnn"])
}

/// `libNAME.so` → `libNAME.so.<major>` for every library linked by name.
fn link_unversioned(lib: &Path) -> Result<()> {
    link_unversioned_names(lib, &UNVERSIONED)
}

fn link_unversioned_names(lib: &Path, libraries: &[&str]) -> Result<()> {
    let names: Vec<String> = std::fs::read_dir(lib)
        .with_context(|| format!("reading {}", lib.display()))?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    for name in libraries {
        let plain = format!("lib{name}.so");
        let prefix = format!("{plain}.");
        let versioned = names
            .iter()
            .filter(|n| {
                n.strip_prefix(&prefix)
                    .is_some_and(|v| !v.is_empty() && v.chars().all(|c| c.is_ascii_digit()))
            })
            .min_by_key(|n| n.len())
            .with_context(|| format!("no {prefix}<version> in {}", lib.display()))?;
        let link = lib.join(&plain);
        if std::fs::symlink_metadata(&link).is_ok() {
            std::fs::remove_file(&link).with_context(|| format!("replacing {}", link.display()))?;
        }
        std::os::unix::fs::symlink(versioned, &link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    Ok(())
}

/// What `build-cuda` builds besides the worker.
#[derive(Debug, Clone, Copy, Default)]
pub struct Extras {
    /// `sdhive-bench` with `--device cuda`.
    pub bench: bool,
    /// The sdhive-candle test binary (parity tests; `SDHIVE_TEST_DEVICE=cuda`).
    pub tests: bool,
    /// Convolutions through cuDNN (the `cudnn` features; the library comes from NVIDIA's PyPI wheel).
    pub cudnn: bool,
    /// The dev profile instead of release: what CI builds to prove the worker builds and refuses to run without
    /// a GPU, sharing most dependencies with the test build and skipping the release optimisation and LTO.
    pub dev: bool,
}

/// `cargo xtask build-cuda`: the release `sd-worker-cuda` (plus `extras`), built against the cached toolchain.
pub fn build(extras: Extras) -> Result<PathBuf> {
    let (profile, out_dir) = if extras.dev { ("--profile=dev", "debug") } else { ("--release", "release") };
    let tc = toolchain()?;
    let root = workspace_root();
    let mut env = tc.build_env();
    let features = if extras.cudnn {
        install_cudnn(&tc)?;
        for (key, value) in env.iter_mut() {
            if *key == "LIBRARY_PATH" {
                value.push(":");
                value.push(tc.cudnn_lib());
            }
        }
        "cuda,cudnn"
    } else {
        "cuda"
    };
    let mut stub = Stub::open(&tc)?;
    if stub.symbols.is_empty() {
        stub.probe(&root, &env, profile, out_dir)?;
    }
    let worker = ["build", profile, "-p", "sd-worker-cuda", "--features", features];
    stub.cargo_linking(&root, &env, &worker)?;
    if extras.bench {
        stub.cargo_linking(&root, &env, &["build", profile, "-p", "sdhive-bench", "--features", features])?;
    }
    if extras.tests {
        let tests = ["test", profile, "-p", "sdhive-candle", "--features", features, "--no-run"];
        stub.cargo_linking(&root, &env, &tests)?;
        let kernel_features = if extras.cudnn { "cudnn" } else { "cuda" };
        let kernels =
            ["test", profile, "-p", "sdhive-cuda-kernels", "--features", kernel_features, "--no-run"];
        stub.cargo_linking(&root, &env, &kernels)?;
    }
    let exe = target_dir().join(out_dir).join("sd-worker-cuda");
    eprintln!("xtask: built {} and {ENGINE} beside it", exe.display());
    Ok(exe)
}

/// The binary that links CUDA; `sd-worker-cuda` is its launcher (sdhive-launch).
pub const ENGINE: &str = "sd-worker-cuda-engine";

/// The `libcuda.so` link stub (soname `libcuda.so.1`) and the driver API symbols it defines. Each symbol returns
/// `CUDA_ERROR_STUB_LIBRARY` (34), as NVIDIA's own toolkit stub does, in case it is ever loaded at run time.
///
/// The symbol list is learnt from the linker, never written by hand: a first link of the worker with an empty
/// stub and unresolved symbols allowed leaves exactly the driver functions the binary needs as undefined dynamic
/// symbols (`nm -D --undefined-only`); a later link that still misses one (another binary, a newer candle) names
/// it in its error, and the stub grows and the link is retried.
struct Stub {
    dir: PathBuf,
    symbols: BTreeSet<String>,
}

impl Stub {
    fn open(tc: &Toolchain) -> Result<Self> {
        let dir = tc.stub_dir();
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let known = std::fs::read_to_string(dir.join("symbols.txt")).unwrap_or_default();
        let symbols = parse_driver_symbols(&known);
        let stub = Stub { dir, symbols };
        stub.compile()?;
        Ok(stub)
    }

    /// Links the worker once with undefined symbols ignored and reads back what stayed undefined.
    fn probe(
        &mut self,
        root: &Path,
        env: &[(&'static str, OsString)],
        profile: &str,
        out_dir: &str,
    ) -> Result<()> {
        let args = [
            "rustc",
            profile,
            "-p",
            "sd-worker-cuda",
            "--features",
            "cuda",
            "--bin",
            ENGINE,
            "--",
            "-C",
            "link-arg=-Wl,--unresolved-symbols=ignore-all",
        ];
        cargo_env(root, env, &args)?;
        let exe = target_dir().join(out_dir).join(ENGINE);
        let out = Command::new("nm")
            .args(["-D", "--undefined-only", "--format=just-symbols"])
            .arg(&exe)
            .output()
            .context("running nm (binutils) on the probe link")?;
        if !out.status.success() {
            bail!("nm -D {} failed: {}", exe.display(), String::from_utf8_lossy(&out.stderr));
        }
        let found = parse_driver_symbols(&String::from_utf8_lossy(&out.stdout));
        if found.is_empty() {
            bail!("the probe link of {} references no CUDA driver symbol", exe.display());
        }
        // The probe binary must not pass for a real one.
        std::fs::remove_file(&exe).with_context(|| format!("removing the probe {}", exe.display()))?;
        self.add(found)
    }

    fn add(&mut self, found: BTreeSet<String>) -> Result<()> {
        self.symbols.extend(found);
        let list: String = self.symbols.iter().map(|s| format!("{s}\n")).collect();
        std::fs::write(self.dir.join("symbols.txt"), list).context("writing the stub's symbols.txt")?;
        self.compile()
    }

    /// (Re)compiles the stub when its source changed.
    fn compile(&self) -> Result<()> {
        let mut c = String::from("/* Generated by `cargo xtask build-cuda`: the libcuda link stub. */\n");
        for s in &self.symbols {
            c.push_str(&format!("int {s}(void) {{ return 34; }}\n"));
        }
        let src = self.dir.join("libcuda_stub.c");
        let so = self.dir.join("libcuda.so");
        if so.is_file() && std::fs::read_to_string(&src).ok().as_deref() == Some(c.as_str()) {
            return Ok(());
        }
        std::fs::write(&src, &c).with_context(|| format!("writing {}", src.display()))?;
        let mut gcc = Command::new(std::env::var("CC").unwrap_or_else(|_| "gcc".into()));
        gcc.args(["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o"]).arg(&so).arg(&src);
        run(&mut gcc, "compiling the libcuda link stub")?;
        let so1 = self.dir.join("libcuda.so.1");
        if std::fs::symlink_metadata(&so1).is_err() {
            std::os::unix::fs::symlink("libcuda.so", &so1).context("linking libcuda.so.1")?;
        }
        eprintln!("xtask: libcuda stub with {} driver symbols in {}", self.symbols.len(), self.dir.display());
        Ok(())
    }

    /// Runs a cargo command that links CUDA binaries, growing the stub and retrying while the linker names
    /// driver symbols it lacks.
    fn cargo_linking(&mut self, root: &Path, env: &[(&'static str, OsString)], args: &[&str]) -> Result<()> {
        for _ in 0..4 {
            let stderr = cargo_env_capture(root, env, args)?;
            let Some(stderr) = stderr else { return Ok(()) };
            let missing: BTreeSet<String> =
                undefined_in_link_errors(&stderr).into_iter().filter(|s| !self.symbols.contains(s)).collect();
            if missing.is_empty() {
                bail!("cargo {} failed", args.join(" "));
            }
            eprintln!("xtask: the link needs {} more driver symbols: {missing:?}", missing.len());
            self.add(missing)?;
        }
        bail!("cargo {} still misses driver symbols after growing the stub 4 times", args.join(" "))
    }
}

/// Driver symbols named in `undefined symbol: cuX` (lld) or ``undefined reference to `cuX'`` (GNU ld) errors.
fn undefined_in_link_errors(stderr: &str) -> BTreeSet<String> {
    let mut names = String::new();
    for line in stderr.lines() {
        let name = if let Some((_, rest)) = line.split_once("undefined symbol: ") {
            rest.trim()
        } else if let Some((_, rest)) = line.split_once("undefined reference to `") {
            rest.trim_end_matches(['\'', ' '])
        } else {
            continue;
        };
        names.push_str(name);
        names.push('\n');
    }
    parse_driver_symbols(&names)
}

/// The driver API names (`cuInit`, `cuMemAlloc_v2`, …) among whitespace-separated symbols. cuBLAS, cuRAND, NVRTC
/// and the runtime (`cublas…`, `curand…`, `cuda…`) continue in lower case and are left out.
fn parse_driver_symbols(text: &str) -> BTreeSet<String> {
    text.split_whitespace()
        .filter(|s| {
            s.strip_prefix("cu").is_some_and(|rest| {
                rest.starts_with(|c: char| c.is_ascii_uppercase())
                    && rest.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            })
        })
        .map(str::to_string)
        .collect()
}

/// CI on a GPU-less machine: the built worker must refuse to run, naming cuda and the cause, and never fall
/// back to the CPU, both where a libcuda without a driver behind it is installed (the engine starts and reports
/// the missing driver) and where there is no libcuda at all (the launcher names the missing library).
pub fn check_refuses_without_gpu(exe: &Path) -> Result<()> {
    let tc = Toolchain::locate()?;
    let cases = [
        ("a libcuda without a driver", tc.run_library_path(), &["driver", "device"][..]),
        ("no libcuda at all", tc.runtime_library_path(), &["libcuda.so.1"][..]),
    ];
    for (case, library_path, names) in cases {
        refuses(exe, case, &library_path, names)?;
    }
    eprintln!("xtask: sd-worker-cuda refuses to run without a GPU, as it must");
    Ok(())
}

/// Runs `exe generate` with `library_path`; it must fail without an image, naming cuda and one of `names`.
fn refuses(exe: &Path, case: &str, library_path: &OsString, names: &[&str]) -> Result<()> {
    let root = workspace_root();
    let out_png = std::env::temp_dir().join(format!("sdhive-cuda-ci-{}.png", std::process::id()));
    let output = Command::new(exe)
        .args(["generate", "--model", "tests/fixtures/models/sd1", "--prompt", "a cat", "--steps", "1", "-o"])
        .arg(&out_png)
        .env("LD_LIBRARY_PATH", library_path)
        .current_dir(&root)
        .output()
        .with_context(|| format!("running {}", exe.display()))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("xtask: sd-worker-cuda with {case} said: {}", stderr.trim());
    if output.status.success() || out_png.exists() {
        let _ = std::fs::remove_file(&out_png);
        bail!("sd-worker-cuda generated an image with {case}");
    }
    let lower = stderr.to_lowercase();
    if !lower.contains("cuda") || !names.iter().any(|n| lower.contains(&n.to_lowercase())) {
        bail!("sd-worker-cuda with {case} failed without naming cuda and one of {names:?}: {stderr}");
    }
    Ok(())
}

fn cargo_env(root: &Path, env: &[(&'static str, OsString)], args: &[&str]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("xtask: cargo {} (CUDA toolchain)", args.join(" "));
    let mut cmd = Command::new(cargo);
    cmd.args(args).current_dir(root).envs(env.iter().map(|(k, v)| (k, v)));
    run(&mut cmd, &format!("cargo {}", args.join(" ")))
}

/// Like [`cargo_env`], echoing cargo's stderr as it comes; `Some(stderr)` when cargo failed.
fn cargo_env_capture(root: &Path, env: &[(&'static str, OsString)], args: &[&str]) -> Result<Option<String>> {
    use std::io::{BufRead, BufReader};
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("xtask: cargo {} (CUDA toolchain)", args.join(" "));
    let mut child = Command::new(cargo)
        .args(args)
        .current_dir(root)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("starting cargo {}", args.join(" ")))?;
    let mut captured = String::new();
    if let Some(err) = child.stderr.take() {
        for line in BufReader::new(err).lines() {
            let line = line.context("reading cargo's output")?;
            eprintln!("{line}");
            captured.push_str(&line);
            captured.push('\n');
        }
    }
    let status = child.wait().context("waiting for cargo")?;
    Ok((!status.success()).then_some(captured))
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd.status().with_context(|| format!("starting {what}"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_driver_api_symbols_go_into_the_stub() {
        let nm = "cuInit\ncuMemAlloc_v2\ncublasCreate_v2\ncurandCreateGenerator\ncudaMalloc\nnvrtcVersion\n\
                  memcpy\n_ZN6cudarc6driver3sys6cuInit17h0E\ncuDevicePrimaryCtxRetain\n\ncuInit\n";
        let got: Vec<String> = parse_driver_symbols(nm).into_iter().collect();
        assert_eq!(got, ["cuDevicePrimaryCtxRetain", "cuInit", "cuMemAlloc_v2"]);
    }

    #[test]
    fn missing_symbols_are_read_from_lld_and_gnu_ld_errors() {
        let stderr = "  = note: rust-lld: error: undefined symbol: cuCtxSynchronize\n\
                      >>> referenced by core.rs\n\
                      core.rs:(.text+0x1): undefined reference to `cuGraphLaunch'\n\
                      rust-lld: error: undefined symbol: cublasCreate_v2\n";
        let got: Vec<String> = undefined_in_link_errors(stderr).into_iter().collect();
        assert_eq!(got, ["cuCtxSynchronize", "cuGraphLaunch"]);
    }
}
