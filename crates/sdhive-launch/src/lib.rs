//! The first step of each GPU worker binary. The engine binary (`sd-worker-<backend>-engine`, installed beside
//! the launcher) links its GPU libraries: libcuda and cuBLAS, libvulkan, HIP. On a machine that lacks one, the
//! dynamic loader stops it before `main` with exit 127 and a message that names neither the backend nor what to
//! install. The launcher links none of them: it asks the loader which of the engine's libraries it cannot find
//! (glibc's `LD_TRACE_LOADED_OBJECTS`, what `ldd` does), and either refuses, naming the backend, the missing
//! libraries and what provides them, or replaces itself with the engine (exec: the same process id, arguments
//! and signals, so the hive and service managers see one process), which then opens and verifies the device.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What a backend's engine needs from the machine.
#[derive(Debug)]
pub struct Engine {
    /// The backend's name, as `--version` and `/v1/info` report it.
    pub backend: &'static str,
    /// What provides a missing library, by the start of its file name; the first match applies.
    pub provides: &'static [(&'static str, &'static str)],
    /// What provides any other missing library.
    pub otherwise: &'static str,
}

pub const CUDA: Engine = Engine {
    backend: "cuda",
    provides: &[
        ("libcuda.so", "the NVIDIA driver's CUDA library: no NVIDIA driver is installed"),
        ("libcudnn", "cuDNN 9 for CUDA 13: the nvidia-cudnn-cu13 wheel or NVIDIA's cuDNN packages"),
    ],
    otherwise:
        "the CUDA 13 runtime libraries: a CUDA 13 install, or NVIDIA's PyPI wheels (nvidia-cublas and \
                nvidia-curand) with their lib folders on LD_LIBRARY_PATH",
};

pub const VULKAN: Engine = Engine {
    backend: "vulkan",
    provides: &[(
        "libvulkan.so",
        "the Vulkan loader (Debian/Ubuntu: libvulkan1) and a GPU driver with Vulkan",
    )],
    otherwise: "a system library of the Vulkan engine",
};

pub const ROCM: Engine = Engine {
    backend: "rocm",
    provides: &[],
    otherwise:
        "ROCm's HIP runtime and hipBLAS/rocBLAS (a ROCm install with its lib folder on the loader's path)",
};

/// The engine behind the launcher of `backend` (its name: "cuda", "vulkan", "rocm"); `None` for the backends
/// whose binary is the worker itself (cpu, metal).
pub fn engine_for(backend: &str) -> Option<&'static Engine> {
    [&CUDA, &VULKAN, &ROCM].into_iter().find(|e| e.backend == backend)
}

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("cannot locate this executable (to find the {backend} engine beside it): {source}")]
    CurrentExe { backend: &'static str, source: std::io::Error },
    #[error("the {backend} engine {} is missing; it is installed beside this launcher", path.display())]
    MissingEngine { backend: &'static str, path: PathBuf },
    #[error("the {} backend cannot start on this machine: {}", engine.backend, describe_missing(engine, missing))]
    MissingLibraries { engine: &'static Engine, missing: Vec<String> },
    #[error("cannot start the {backend} engine {}: {source}", path.display())]
    Exec { backend: &'static str, path: PathBuf, source: std::io::Error },
}

/// The engine of the launcher at `launcher`: the same file name with `-engine` appended, in the same folder.
pub fn engine_path(launcher: &Path) -> PathBuf {
    let mut name = launcher.file_name().map(OsString::from).unwrap_or_default();
    name.push("-engine");
    launcher.with_file_name(name)
}

/// The AMD gfx targets compiled into the ROCm engine: `GFX_NAME` when the workspace was built (what
/// stable-diffusion.cpp's build hands to ggml as `AMDGPU_TARGETS`; launcher and engine are built together, so
/// they agree). Empty when it was not set (ggml then picks the build machine's GPUs, unknown here).
pub fn rocm_targets() -> Vec<String> {
    parse_targets(option_env!("GFX_NAME").unwrap_or(""))
}

/// `gfx1030;gfx1100` (CMake's list), `gfx1030,gfx1100` or space-separated.
pub fn parse_targets(list: &str) -> Vec<String> {
    list.split([';', ',', ' ']).map(str::trim).filter(|t| !t.is_empty()).map(String::from).collect()
}

/// The `--version` line of a worker binary, shared by the launcher and the engine so they print the same. The
/// ROCm worker's names its gfx targets (`gfx: gfx1030,gfx1100`), which the hive reads before planning.
pub fn version_line(backend: &str) -> String {
    let targets = rocm_targets();
    if backend == ROCM.backend && !targets.is_empty() {
        format!("{} (backend: {backend}, gfx: {})", env!("CARGO_PKG_VERSION"), targets.join(","))
    } else {
        format!("{} (backend: {backend})", env!("CARGO_PKG_VERSION"))
    }
}

/// The libraries the dynamic loader reports as not found in its trace output (`\tlibcuda.so.1 => not found`).
pub fn not_found(trace: &str) -> Vec<String> {
    trace
        .lines()
        .filter_map(|l| l.trim().strip_suffix("=> not found"))
        .map(|name| name.trim().to_string())
        .collect()
}

/// The engine's libraries this machine's loader cannot find (with the launcher's environment, so
/// `LD_LIBRARY_PATH` counts). Empty where the loader gives no trace (not glibc): the engine is then started and
/// the loader has the last word.
pub fn missing_libraries(engine: &Path) -> Vec<String> {
    let trace = Command::new(engine).env("LD_TRACE_LOADED_OBJECTS", "1").output();
    match trace {
        Ok(out) => not_found(&String::from_utf8_lossy(&out.stdout)),
        Err(_) => Vec::new(),
    }
}

fn describe_missing(engine: &Engine, missing: &[String]) -> String {
    let mut parts: Vec<String> = Vec::new();
    for lib in missing {
        let fix = engine
            .provides
            .iter()
            .find(|(prefix, _)| lib.starts_with(prefix))
            .map_or(engine.otherwise, |p| p.1);
        match parts.iter_mut().find(|p| p.ends_with(&format!("({fix})"))) {
            // Libraries with one remedy share one clause: "libcublas.so.13, libcurand.so.10 (…)".
            Some(p) => {
                let at = p.find(" (").unwrap_or(p.len());
                p.insert_str(at, &format!(", {lib}"));
            }
            None => parts.push(format!("{lib} ({fix})")),
        }
    }
    format!("the dynamic loader does not find {}", parts.join("; "))
}

/// Starts the engine of `engine`'s backend in place of this process, with this process's arguments, once the
/// loader can resolve all its libraries. Returns only when it cannot: with the reason, or with `Ok` when asked
/// for `--version` alone, which is answered here so that it works where the engine cannot load.
pub fn launch(engine: &'static Engine) -> Result<(), LaunchError> {
    let backend = engine.backend;
    let me = std::env::current_exe().map_err(|source| LaunchError::CurrentExe { backend, source })?;
    let path = engine_path(&me);
    if !path.is_file() {
        return Err(LaunchError::MissingEngine { backend, path });
    }
    let mut args = std::env::args_os();
    let argv0 = args.next().unwrap_or_else(|| me.as_os_str().to_owned());
    let rest: Vec<OsString> = args.collect();
    let missing = missing_libraries(&path);
    if !missing.is_empty() {
        if rest.len() == 1 && (rest[0] == "--version" || rest[0] == "-V") {
            let name = me.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            println!("{name} {}", version_line(backend));
            return Ok(());
        }
        return Err(LaunchError::MissingLibraries { engine, missing });
    }
    let source = Command::new(&path).arg0(argv0).args(rest).exec();
    Err(LaunchError::Exec { backend, path, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gfx_target_lists() {
        assert_eq!(parse_targets("gfx1030;gfx1100"), ["gfx1030", "gfx1100"]);
        assert_eq!(parse_targets(" gfx90a, gfx942 "), ["gfx90a", "gfx942"]);
        assert!(parse_targets("").is_empty());
        // Only the ROCm worker names targets.
        assert!(!version_line("cuda").contains("gfx"));
    }

    #[test]
    fn the_engine_sits_beside_the_launcher() {
        assert_eq!(
            engine_path(Path::new("/opt/sdhive/bin/sd-worker-cuda")),
            PathBuf::from("/opt/sdhive/bin/sd-worker-cuda-engine")
        );
    }

    #[test]
    fn only_the_gpu_backends_that_link_gpu_libraries_have_an_engine() {
        assert_eq!(engine_for("cuda").map(|e| e.backend), Some("cuda"));
        assert_eq!(engine_for("vulkan").map(|e| e.backend), Some("vulkan"));
        assert_eq!(engine_for("rocm").map(|e| e.backend), Some("rocm"));
        assert!(engine_for("cpu").is_none() && engine_for("metal").is_none());
    }

    #[test]
    fn the_loader_trace_gives_the_missing_libraries() {
        let trace = "\tlinux-vdso.so.1 (0x00007f523643a000)\n\tlibcuda.so.1 => not found\n\
                     \tlibcublas.so.13 => not found\n\tlibm.so.6 => /lib/x86_64-linux-gnu/libm.so.6 (0x7f52)\n";
        assert_eq!(not_found(trace), ["libcuda.so.1", "libcublas.so.13"]);
        assert!(not_found("\tlibc.so.6 => /lib/libc.so.6 (0x1)\n").is_empty());
    }

    #[test]
    fn the_refusal_names_the_backend_each_library_and_its_remedy() {
        let missing =
            ["libcuda.so.1", "libcublas.so.13", "libcurand.so.10", "libcudnn.so.9"].map(String::from);
        let e = LaunchError::MissingLibraries { engine: &CUDA, missing: missing.to_vec() };
        let text = e.to_string();
        assert!(text.starts_with("the cuda backend cannot start on this machine"), "{text}");
        assert!(
            text.contains("libcuda.so.1 (the NVIDIA driver's CUDA library: no NVIDIA driver is installed)"),
            "{text}"
        );
        assert!(text.contains("libcublas.so.13, libcurand.so.10 (the CUDA 13 runtime libraries"), "{text}");
        assert!(text.contains("libcudnn.so.9 (cuDNN 9"), "{text}");
        let vk = LaunchError::MissingLibraries { engine: &VULKAN, missing: vec!["libvulkan.so.1".into()] };
        assert!(vk.to_string().contains("libvulkan.so.1 (the Vulkan loader"), "{vk}");
    }

    /// The real loader on a real executable: one linked against a library that is then deleted.
    #[test]
    fn the_loader_reports_a_library_that_is_absent() {
        let dir = std::env::temp_dir().join(format!("sdhive-launch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cc = |args: &[&str]| {
            let status =
                Command::new("cc").args(args).current_dir(&dir).status().expect("this test needs cc");
            assert!(status.success(), "cc {args:?}");
        };
        std::fs::write(dir.join("absent.c"), "int sdhive_absent(void) { return 0; }\n").unwrap();
        std::fs::write(
            dir.join("main.c"),
            "int sdhive_absent(void);\nint main(void) { return sdhive_absent(); }\n",
        )
        .unwrap();
        cc(&["-shared", "-fPIC", "-o", "libsdhive_absent.so", "absent.c"]);
        cc(&["-o", "needs-absent", "main.c", "-L.", "-lsdhive_absent"]);
        let exe = dir.join("needs-absent");
        std::fs::remove_file(dir.join("libsdhive_absent.so")).unwrap();
        let missing = missing_libraries(&exe);
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(missing, ["libsdhive_absent.so"]);
    }
}
