//! Device selection shared by every `sd-worker-*` binary: which compute backend a binary was built for, which
//! engine drives it, opening device `index` on it (with a start-up check that it computes), and describing that
//! device (name, memory, driver) for logs and registration. A binary only ever runs on the backend it was built
//! for — asking for another is an error, never a silent CPU fallback.

#[cfg(any(feature = "vulkan", feature = "rocm"))]
mod ggml;

#[cfg(any(feature = "cuda", all(feature = "metal", target_os = "macos"), test))]
mod check;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(all(feature = "metal", target_os = "macos"))]
mod metal;

use candle_core::{DType, Device};
use serde::Serialize;
use std::fmt;
use std::str::FromStr;
use thiserror::Error;

/// A compute backend; each has its own worker binary (`sd-worker-<name>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Cpu,
    Cuda,
    Metal,
    Rocm,
    Vulkan,
}

impl Backend {
    pub const ALL: [Backend; 5] =
        [Backend::Cpu, Backend::Cuda, Backend::Metal, Backend::Rocm, Backend::Vulkan];

    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Metal => "metal",
            Backend::Rocm => "rocm",
            Backend::Vulkan => "vulkan",
        }
    }

    /// The worker binary built for this backend.
    pub fn binary_name(self) -> String {
        format!("sd-worker-{}", self.name())
    }

    /// Which engine runs on this backend: candle where it has kernels, stable-diffusion.cpp (ggml) elsewhere.
    pub fn engine(self) -> EngineKind {
        match self {
            Backend::Cpu | Backend::Cuda | Backend::Metal => EngineKind::Candle,
            Backend::Rocm | Backend::Vulkan => EngineKind::SdCpp,
        }
    }

    /// The GPU targets this worker binary was compiled for, where the backend's build chooses them: the ROCm
    /// worker's AMD gfx targets (`sdhive_launch::rocm_targets`, which its `--version` names too); empty elsewhere.
    pub fn gfx_targets(self) -> Vec<String> {
        match self {
            Backend::Rocm => sdhive_launch::rocm_targets(),
            _ => Vec::new(),
        }
    }

    /// f32 on CPU, where half precision has no fast kernels; f16 on GPUs, where it halves memory and time.
    pub fn default_dtype(self) -> DType {
        match self {
            Backend::Cpu => DType::F32,
            _ => DType::F16,
        }
    }

    /// The precision SD3 / SD3.5 models run in when the command line names none: bf16 on CUDA, as diffusers'
    /// SD3.5 model cards load them (T5-XXL and SD3.5-large's activations overflow f16); otherwise as other models.
    pub fn default_sd3_dtype(self) -> DType {
        match self {
            Backend::Cuda => DType::BF16,
            other => other.default_dtype(),
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown backend `{0}` (expected one of: cpu, cuda, metal, rocm, vulkan)")]
pub struct ParseBackendError(pub String);

impl FromStr for Backend {
    type Err = ParseBackendError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let wanted = s.trim().to_ascii_lowercase();
        Backend::ALL.into_iter().find(|b| b.name() == wanted).ok_or_else(|| ParseBackendError(s.to_string()))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    Candle,
    SdCpp,
}

impl EngineKind {
    /// Whether the engine loads single-file GGUF checkpoints: stable-diffusion.cpp reads them natively (and keeps
    /// their quantised weights); candle has no GGUF loader for these models. Workers and the hive both ask here.
    pub fn loads_gguf(self) -> bool {
        self == EngineKind::SdCpp
    }

    /// The engine's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Candle => "the candle engine",
            EngineKind::SdCpp => "stable-diffusion.cpp",
        }
    }
}

/// An opened device, as the engine for its backend needs it.
#[derive(Debug, Clone)]
pub enum DeviceHandle {
    Candle(Device),
    /// ggml's device name (`Vulkan0`, `ROCm1`) for the stable-diffusion.cpp engine.
    Ggml(String),
}

impl DeviceHandle {
    /// The candle device, for the candle engine; `None` for a ggml device.
    pub fn candle(&self) -> Option<&Device> {
        match self {
            DeviceHandle::Candle(d) => Some(d),
            DeviceHandle::Ggml(_) => None,
        }
    }
}

/// What a worker reports about the device it opened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceInfo {
    pub backend: Backend,
    pub index: usize,
    /// Marketing name (CPU model, GPU name).
    pub name: String,
    pub memory_total_bytes: Option<u64>,
    /// For the CPU, memory available to new allocations (MemAvailable), not the kernel's narrower "free".
    pub memory_free_bytes: Option<u64>,
    pub driver: Option<String>,
    /// CPU only: the compute threads candle uses.
    pub threads: Option<usize>,
}

#[derive(Debug, Error)]
pub enum DeviceError {
    #[error("this binary was built without {backend} support; use {}", backend.binary_name())]
    NotCompiled { backend: Backend },
    #[error("there is no {backend} device {index} ({available} available)")]
    NoSuchDevice { backend: Backend, index: usize, available: usize },
    #[error("cannot open {backend} device {index}: {message}")]
    Init { backend: Backend, index: usize, message: String },
    #[error("--placement names `{device}`, but {} runs modules only on the cpu and {backend} devices", backend.binary_name())]
    ForeignDevice { backend: Backend, device: String },
}

/// Opens device `index` of `backend` and describes it. GPU devices are checked by computing on them before they
/// are returned.
pub fn init(backend: Backend, index: usize) -> Result<(DeviceHandle, DeviceInfo), DeviceError> {
    match backend {
        Backend::Cpu => init_cpu(index).map(|(d, i)| (DeviceHandle::Candle(d), i)),
        #[cfg(feature = "cuda")]
        Backend::Cuda => cuda::init(index).map(|(d, i)| (DeviceHandle::Candle(d), i)),
        #[cfg(all(feature = "metal", target_os = "macos"))]
        Backend::Metal => metal::init(index).map(|(d, i)| (DeviceHandle::Candle(d), i)),
        #[cfg(feature = "vulkan")]
        Backend::Vulkan => ggml::init(backend, "Vulkan", index),
        #[cfg(feature = "rocm")]
        Backend::Rocm => ggml::init(backend, "ROCm", index),
        // Each GPU backend is compiled into its own binary (its crate feature); others cannot drive it.
        _ => Err(DeviceError::NotCompiled { backend }),
    }
}

/// The candle device a `--placement` entry (`named`, `index`, as the operator wrote them) names, for a worker of
/// `backend` that opened `main` as its device `main_index`: the CPU, the worker's own device (the same handle,
/// so its tensors need no copy), or another device of the same backend, opened and checked like the first.
pub fn placement_device(
    backend: Backend,
    main: &Device,
    main_index: usize,
    named: &str,
    index: usize,
) -> Result<Device, DeviceError> {
    if named == Backend::Cpu.name() {
        return Ok(Device::Cpu);
    }
    if named != backend.name() || backend.engine() != EngineKind::Candle {
        return Err(DeviceError::ForeignDevice { backend, device: format!("{named}{index}") });
    }
    if index == main_index {
        return Ok(main.clone());
    }
    match init(backend, index)? {
        (DeviceHandle::Candle(d), _) => Ok(d),
        (DeviceHandle::Ggml(_), _) => {
            Err(DeviceError::ForeignDevice { backend, device: format!("{named}{index}") })
        }
    }
}

/// The backends this build can drive.
pub fn compiled_backends() -> Vec<Backend> {
    let mut out = vec![Backend::Cpu];
    for (compiled, backend) in [
        (cfg!(feature = "cuda"), Backend::Cuda),
        (cfg!(all(feature = "metal", target_os = "macos")), Backend::Metal),
        (cfg!(feature = "vulkan"), Backend::Vulkan),
        (cfg!(feature = "rocm"), Backend::Rocm),
    ] {
        if compiled {
            out.push(backend);
        }
    }
    out
}

/// `(total, free)` memory of an opened device now, cheap enough for every health check; `None`s where the
/// backend cannot say.
pub fn memory(device: &DeviceHandle) -> (Option<u64>, Option<u64>) {
    match device {
        DeviceHandle::Candle(Device::Cpu) => {
            parse_meminfo(&std::fs::read_to_string("/proc/meminfo").unwrap_or_default())
        }
        #[cfg(feature = "cuda")]
        DeviceHandle::Candle(d @ Device::Cuda(_)) => cuda::memory(d),
        #[cfg(any(feature = "vulkan", feature = "rocm"))]
        DeviceHandle::Ggml(name) => ggml::memory(name),
        _ => (None, None),
    }
}

fn init_cpu(index: usize) -> Result<(Device, DeviceInfo), DeviceError> {
    // The CPU is one device however many cores it has; other indexes would silently alias it.
    if index != 0 {
        return Err(DeviceError::NoSuchDevice { backend: Backend::Cpu, index, available: 1 });
    }
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let (memory_total_bytes, memory_free_bytes) = parse_meminfo(&meminfo);
    let info = DeviceInfo {
        backend: Backend::Cpu,
        index,
        name: parse_cpu_model(&cpuinfo).unwrap_or_else(|| format!("{} CPU", std::env::consts::ARCH)),
        memory_total_bytes,
        memory_free_bytes,
        driver: None,
        threads: Some(candle_core::utils::get_num_threads()),
    };
    Ok((Device::Cpu, info))
}

/// The first `model name` line (x86) or, failing that, `Model`/`Hardware` (some ARM kernels).
fn parse_cpu_model(cpuinfo: &str) -> Option<String> {
    for key in ["model name", "Model", "Hardware"] {
        let found = cpuinfo.lines().find_map(|line| {
            let (k, v) = line.split_once(':')?;
            (k.trim() == key && !v.trim().is_empty()).then(|| v.trim().to_string())
        });
        if found.is_some() {
            return found;
        }
    }
    None
}

/// (MemTotal, MemAvailable) in bytes; /proc/meminfo counts in KiB.
fn parse_meminfo(meminfo: &str) -> (Option<u64>, Option<u64>) {
    let field = |name: &str| {
        meminfo.lines().find_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix(':')?;
            let kib: u64 = rest.split_whitespace().next()?.parse().ok()?;
            kib.checked_mul(1024)
        })
    };
    (field("MemTotal"), field("MemAvailable"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_names_the_cpu_the_worker_device_or_refuses() {
        let cpu = placement_device(Backend::Cpu, &Device::Cpu, 0, "cpu", 0).expect("cpu");
        assert!(cpu.is_cpu());
        let err = placement_device(Backend::Cpu, &Device::Cpu, 0, "vulkan", 1).unwrap_err();
        assert!(matches!(err, DeviceError::ForeignDevice { .. }));
        assert!(err.to_string().contains("`vulkan1`") && err.to_string().contains("sd-worker-cpu"), "{err}");
        // A CUDA worker's other devices are opened (and checked) like its own; without the feature, refused.
        if !cfg!(feature = "cuda") {
            let err = placement_device(Backend::Cuda, &Device::Cpu, 0, "cuda", 1).unwrap_err();
            assert!(matches!(err, DeviceError::NotCompiled { .. }), "{err}");
        }
    }

    #[test]
    fn backend_names_round_trip() {
        for b in Backend::ALL {
            assert_eq!(b.name().parse::<Backend>(), Ok(b));
            assert_eq!(b.to_string(), b.name());
        }
        assert_eq!(" CUDA ".parse::<Backend>(), Ok(Backend::Cuda));
        assert!("tpu".parse::<Backend>().unwrap_err().to_string().contains("cpu, cuda"));
        assert_eq!(serde_json::to_string(&Backend::Rocm).unwrap(), "\"rocm\"");
    }

    #[test]
    fn cpu_init_describes_this_machine() {
        let (device, info) = init(Backend::Cpu, 0).unwrap();
        assert!(device.candle().unwrap().is_cpu());
        assert_eq!(info.backend, Backend::Cpu);
        assert!(!info.name.is_empty());
        assert!(info.threads.unwrap() >= 1);
        if cfg!(target_os = "linux") {
            let total = info.memory_total_bytes.unwrap();
            assert!(total > 0 && info.memory_free_bytes.unwrap() <= total);
        }
        let json = serde_json::to_value(&info).unwrap();
        assert_eq!(json["backend"], "cpu");
    }

    #[test]
    fn gpu_backends_are_not_compiled_in_and_never_fall_back() {
        let missing = Backend::ALL.into_iter().filter(|b| !compiled_backends().contains(b));
        for b in missing {
            let err = init(b, 0).unwrap_err();
            assert!(matches!(err, DeviceError::NotCompiled { backend } if backend == b));
            assert_eq!(
                err.to_string(),
                format!("this binary was built without {b} support; use sd-worker-{b}")
            );
        }
        assert!(matches!(init(Backend::Cpu, 1), Err(DeviceError::NoSuchDevice { index: 1, .. })));
        if !cfg!(feature = "cuda") {
            assert!(!compiled_backends().contains(&Backend::Cuda));
        }
    }

    #[test]
    fn cpu_memory_is_reported() {
        if cfg!(target_os = "linux") {
            let (total, free) = memory(&DeviceHandle::Candle(Device::Cpu));
            assert!(total.unwrap() >= free.unwrap());
        }
    }

    /// With the `cuda` feature: a real device passes the start-up check and reports itself; a machine without
    /// driver or device fails with an error naming cuda, never a CPU device.
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_init_either_verifies_a_gpu_or_names_the_cause() {
        match init(Backend::Cuda, 0) {
            Ok((device, info)) => {
                assert!(device.candle().is_some_and(|d| d.is_cuda()));
                assert!(info.memory_total_bytes.unwrap() > 0);
                assert!(matches!(memory(&device), (Some(_), Some(_))));
                let count = cuda::device_count().unwrap();
                let err = init(Backend::Cuda, count).unwrap_err();
                assert!(matches!(err, DeviceError::NoSuchDevice { available, .. } if available == count));
            }
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("cuda"), "{msg}");
                assert!(matches!(e, DeviceError::Init { .. } | DeviceError::NoSuchDevice { .. }), "{msg}");
            }
        }
    }

    #[test]
    fn parses_proc_files() {
        let cpuinfo =
            "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) CPU @ 2.20GHz\n";
        assert_eq!(parse_cpu_model(cpuinfo).as_deref(), Some("Intel(R) Xeon(R) CPU @ 2.20GHz"));
        assert_eq!(parse_cpu_model("Hardware\t: BCM2835\n").as_deref(), Some("BCM2835"));
        assert_eq!(parse_cpu_model(""), None);
        let meminfo = "MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    8192 kB\n";
        assert_eq!(parse_meminfo(meminfo), (Some(16384 * 1024), Some(8192 * 1024)));
        assert_eq!(parse_meminfo("garbage"), (None, None));
    }
}
