//! Runtime device detection: asks each vendor's tool (`nvidia-smi`, `rocm-smi` or the KFD sysfs topology,
//! `vulkaninfo --summary`, `system_profiler` on macOS) and `/proc` for the CPU, and parses what they print.
//! A missing tool means "no devices of that kind", never an error: most nodes have one vendor at most.

use serde::Serialize;
use shared_worker::Backend;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

/// One device as one backend sees it. A physical GPU can appear twice (CUDA and Vulkan); `plan` pairs them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Device {
    pub backend: Backend,
    /// The index the worker's `--device` takes on this backend.
    pub index: usize,
    pub vendor: Vendor,
    pub name: String,
    pub memory_total_bytes: Option<u64>,
    pub memory_free_bytes: Option<u64>,
    pub driver: Option<String>,
    /// A CPU rasteriser posing as a GPU (llvmpipe, SwiftShader): never worth a worker.
    pub software: bool,
    /// An AMD GPU's gfx target (`gfx1100`), from KFD's topology or rocm-smi: which ROCm builds can serve it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arch: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Vendor {
    Nvidia,
    Amd,
    Intel,
    Apple,
    Other,
}

impl Vendor {
    /// From a PCI vendor id (`0x10de`, `4318`).
    pub fn from_pci(id: &str) -> Vendor {
        let id = id.trim();
        let parsed = match id.strip_prefix("0x").or_else(|| id.strip_prefix("0X")) {
            Some(hex) => u32::from_str_radix(hex, 16).ok(),
            None => id.parse().ok(),
        };
        match parsed {
            Some(0x10de) => Vendor::Nvidia,
            Some(0x1002) => Vendor::Amd,
            Some(0x8086) => Vendor::Intel,
            Some(0x106b) => Vendor::Apple,
            _ => Vendor::Other,
        }
    }
}

const MIB: u64 = 1024 * 1024;

fn device(backend: Backend, index: usize, vendor: Vendor, name: impl Into<String>) -> Device {
    Device {
        backend,
        index,
        vendor,
        name: name.into(),
        memory_total_bytes: None,
        memory_free_bytes: None,
        driver: None,
        software: false,
        arch: None,
    }
}

/// `nvidia-smi --query-gpu=index,name,memory.total,memory.free,driver_version --format=csv,noheader,nounits`
/// (memory in MiB).
pub fn parse_nvidia_smi(out: &str) -> Vec<Device> {
    out.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            let [index, name, total, free, driver] = fields[..] else { return None };
            let mib = |v: &str| v.parse::<u64>().ok().map(|m| m * MIB);
            let mut d = device(Backend::Cuda, index.parse().ok()?, Vendor::Nvidia, name);
            d.memory_total_bytes = mib(total);
            d.memory_free_bytes = mib(free);
            d.driver = Some(driver.to_string()).filter(|s| !s.is_empty() && s != "[N/A]");
            Some(d)
        })
        .collect()
}

/// `rocm-smi --showproductname --showmeminfo vram --json`: `{"card0": {"Card series": …, "VRAM Total Memory
/// (B)": "…", "VRAM Total Used Memory (B)": "…"}, …}`. rocm-smi numbers cards as HIP does, so `cardN` is the
/// ROCm worker's device N.
pub fn parse_rocm_smi(out: &str) -> Vec<Device> {
    let Ok(serde_json::Value::Object(root)) = serde_json::from_str::<serde_json::Value>(out) else {
        return Vec::new();
    };
    let driver =
        root.get("system").and_then(|s| s.get("Driver version")).and_then(|v| v.as_str()).map(String::from);
    let mut devices: Vec<Device> = root
        .iter()
        .filter_map(|(key, card)| {
            let index: usize = key.strip_prefix("card")?.parse().ok()?;
            // rocm-smi versions differ in capitals ("Card series", "Card Series").
            let text = |k: &str| {
                let card = card.as_object()?;
                let v = card.iter().find(|(key, _)| key.eq_ignore_ascii_case(k)).map(|(_, v)| v)?;
                v.as_str().map(str::trim).filter(|s| !s.is_empty())
            };
            let bytes = |k: &str| text(k).and_then(|v| v.parse::<u64>().ok());
            let name = text("Card series").or(text("Card SKU")).or(text("Card model")).unwrap_or("AMD GPU");
            let mut d = device(Backend::Rocm, index, Vendor::Amd, name);
            d.memory_total_bytes = bytes("VRAM Total Memory (B)");
            d.memory_free_bytes = d
                .memory_total_bytes
                .zip(bytes("VRAM Total Used Memory (B)"))
                .map(|(t, u)| t.saturating_sub(u));
            d.driver = driver.clone();
            d.arch = text("GFX Version").map(crate::amd::normalize);
            Some(d)
        })
        .collect();
    devices.sort_by_key(|d| d.index);
    devices
}

/// A GPU node of KFD's topology (`/sys/class/kfd/kfd/topology/nodes/N/properties`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KfdGpu {
    pub vendor_id: u32,
    pub device_id: u32,
    /// From `gfx_target_version`.
    pub arch: Option<String>,
}

/// One `properties` file of a KFD topology node; `None` for CPU nodes (`simd_count 0`).
pub fn parse_kfd_properties(text: &str) -> Option<KfdGpu> {
    let get = |key: &str| {
        text.lines().find_map(|l| {
            let mut parts = l.split_whitespace();
            (parts.next() == Some(key)).then(|| parts.next().and_then(|v| v.parse::<u32>().ok())).flatten()
        })
    };
    if get("simd_count").unwrap_or(0) == 0 {
        return None;
    }
    Some(KfdGpu {
        vendor_id: get("vendor_id").unwrap_or(0),
        device_id: get("device_id").unwrap_or(0),
        arch: get("gfx_target_version").and_then(crate::amd::gfx_name),
    })
}

/// The GPU nodes of a KFD topology folder, in node order (HIP's order).
pub fn kfd_gpus(root: &Path) -> Vec<KfdGpu> {
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    let mut nodes: Vec<(u32, std::path::PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path())))
        .collect();
    nodes.sort();
    nodes
        .iter()
        .filter_map(|(_, p)| parse_kfd_properties(&std::fs::read_to_string(p.join("properties")).ok()?))
        .collect()
}

/// Without rocm-smi: the GPU nodes of the KFD topology as ROCm devices.
pub fn rocm_from_kfd(gpus: &[KfdGpu]) -> Vec<Device> {
    gpus.iter()
        .enumerate()
        .map(|(i, g)| {
            let name = match &g.arch {
                Some(arch) => format!("AMD GPU 0x{:04x} ({arch})", g.device_id),
                None => format!("AMD GPU 0x{:04x}", g.device_id),
            };
            let mut d = device(Backend::Rocm, i, Vendor::Amd, name);
            d.arch = g.arch.clone();
            d
        })
        .collect()
}

/// The ROCm devices from rocm-smi when it answered, else from KFD; architectures rocm-smi left out are taken
/// from KFD by position (both number GPUs as HIP does).
pub fn amd_devices(rocm_smi: Vec<Device>, kfd: &[KfdGpu]) -> Vec<Device> {
    if rocm_smi.is_empty() {
        return rocm_from_kfd(kfd);
    }
    let mut devices = rocm_smi;
    for (i, d) in devices.iter_mut().enumerate() {
        if d.arch.is_none() {
            d.arch = kfd.get(i).and_then(|g| g.arch.clone());
        }
    }
    devices
}

/// `vulkaninfo --summary`: the `GPUn:` blocks of `key = value` lines under `Devices:`.
pub fn parse_vulkaninfo_summary(out: &str) -> Vec<Device> {
    let mut devices = Vec::new();
    let mut current: Option<(usize, Vec<(String, String)>)> = None;
    let finish = |block: Option<(usize, Vec<(String, String)>)>, devices: &mut Vec<Device>| {
        let Some((index, fields)) = block else { return };
        let get = |k: &str| fields.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
        let vendor = get("vendorID").map(Vendor::from_pci).unwrap_or(Vendor::Other);
        let mut d = device(Backend::Vulkan, index, vendor, get("deviceName").unwrap_or("Vulkan device"));
        d.driver = get("driverInfo").or(get("driverVersion")).map(String::from);
        d.software = get("deviceType").is_some_and(|t| t.ends_with("_CPU"));
        devices.push(d);
    };
    for line in out.lines() {
        let trimmed = line.trim();
        if let Some(n) = trimmed.strip_prefix("GPU").and_then(|r| r.strip_suffix(':')) {
            if let Ok(index) = n.parse() {
                finish(current.take(), &mut devices);
                current = Some((index, Vec::new()));
                continue;
            }
        }
        if let (Some((_, fields)), Some((k, v))) = (current.as_mut(), trimmed.split_once('=')) {
            fields.push((k.trim().to_string(), v.trim().to_string()));
        } else if !trimmed.is_empty() && !line.starts_with([' ', '\t']) && !trimmed.starts_with('=') {
            // A new unindented section ends the device list.
            finish(current.take(), &mut devices);
        }
    }
    finish(current.take(), &mut devices);
    devices
}

/// `system_profiler SPDisplaysDataType` (macOS): one device per `Chipset Model:`, in listing order (Metal's).
pub fn parse_system_profiler(out: &str) -> Vec<Device> {
    let mut devices: Vec<Device> = Vec::new();
    for line in out.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("Chipset Model:") {
            let index = devices.len();
            devices.push(device(Backend::Metal, index, Vendor::Apple, name.trim()));
        } else if let (Some(d), Some(v)) = (devices.last_mut(), line.strip_prefix("Vendor:")) {
            let id = v.split('(').nth(1).and_then(|r| r.split(')').next()).unwrap_or("");
            d.vendor = Vendor::from_pci(id);
        } else if let (Some(d), Some(v)) = (devices.last_mut(), line.strip_prefix("VRAM (Total):")) {
            d.memory_total_bytes = parse_size(v);
        }
    }
    devices
}

/// `8 GB`, `1536 MB`.
fn parse_size(s: &str) -> Option<u64> {
    let mut parts = s.split_whitespace();
    let n: u64 = parts.next()?.parse().ok()?;
    match parts.next()? {
        "GB" => Some(n * 1024 * MIB),
        "MB" => Some(n * MIB),
        _ => None,
    }
}

/// The CPU from `/proc/cpuinfo` and `/proc/meminfo` (`MemAvailable` as "free", as the CPU worker reports).
pub fn parse_cpu(cpuinfo: &str, meminfo: &str) -> Device {
    let name = cpuinfo
        .lines()
        .find_map(|l| l.split_once(':').filter(|(k, _)| k.trim() == "model name").map(|(_, v)| v.trim()))
        .unwrap_or("CPU");
    let kib = |key: &str| {
        meminfo.lines().find_map(|l| {
            let rest = l.strip_prefix(key)?.strip_prefix(':')?;
            rest.split_whitespace().next()?.parse::<u64>().ok().map(|k| k * 1024)
        })
    };
    let mut d = device(Backend::Cpu, 0, Vendor::Other, name);
    d.memory_total_bytes = kib("MemTotal");
    d.memory_free_bytes = kib("MemAvailable");
    d
}

/// Runs a tool with a deadline; `None` if it is absent, fails, or hangs (a wedged driver must not wedge the
/// hive's start-up).
async fn run_tool(program: &str, args: &[&str]) -> Option<String> {
    let child = tokio::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(Duration::from_secs(15), child).await {
        Ok(Ok(out)) if out.status.success() => Some(String::from_utf8_lossy(&out.stdout).into_owned()),
        Ok(Ok(out)) => {
            tracing::warn!(tool = program, status = %out.status, "device query failed");
            None
        }
        Ok(Err(e)) => {
            tracing::debug!(tool = program, "not available: {e}");
            None
        }
        Err(_) => {
            tracing::warn!(tool = program, "device query timed out");
            None
        }
    }
}

/// The free memory of one device now, asked of the tool that reports it (`nvidia-smi`, `rocm-smi`,
/// `/proc/meminfo`); `None` where none does (Vulkan, Metal) or the query fails.
pub async fn free_memory(backend: Backend, index: usize) -> Option<u64> {
    let found = match backend {
        Backend::Cuda => {
            let id = index.to_string();
            let query = "--query-gpu=index,name,memory.total,memory.free,driver_version";
            let args = [query, "--format=csv,noheader,nounits", "-i", id.as_str()];
            run_tool("nvidia-smi", &args).await.as_deref().map(parse_nvidia_smi).unwrap_or_default()
        }
        Backend::Rocm => {
            let args = ["--showproductname", "--showmeminfo", "vram", "--json"];
            run_tool("rocm-smi", &args).await.as_deref().map(parse_rocm_smi).unwrap_or_default()
        }
        Backend::Cpu => {
            let meminfo = tokio::fs::read_to_string("/proc/meminfo").await.unwrap_or_default();
            vec![parse_cpu("", &meminfo)]
        }
        Backend::Vulkan | Backend::Metal => Vec::new(),
    };
    found.into_iter().find(|d| d.index == index).and_then(|d| d.memory_free_bytes)
}

/// Every device this machine has, per backend; the CPU is always there.
pub async fn detect() -> Vec<Device> {
    let mut devices = Vec::new();
    let nvidia = run_tool(
        "nvidia-smi",
        &["--query-gpu=index,name,memory.total,memory.free,driver_version", "--format=csv,noheader,nounits"],
    );
    let rocm = run_tool(
        "rocm-smi",
        &["--showproductname", "--showmeminfo", "vram", "--showdriverversion", "--json"],
    );
    let vulkan = run_tool("vulkaninfo", &["--summary"]);
    let (nvidia, rocm, vulkan) = tokio::join!(nvidia, rocm, vulkan);
    devices.extend(nvidia.as_deref().map(parse_nvidia_smi).unwrap_or_default());
    let amd = rocm.as_deref().map(parse_rocm_smi).unwrap_or_default();
    devices.extend(amd_devices(amd, &kfd_gpus(Path::new("/sys/class/kfd/kfd/topology/nodes"))));
    devices.extend(vulkan.as_deref().map(parse_vulkaninfo_summary).unwrap_or_default());
    if cfg!(target_os = "macos") {
        let out = run_tool("system_profiler", &["SPDisplaysDataType"]).await;
        devices.extend(out.as_deref().map(parse_system_profiler).unwrap_or_default());
    }
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    devices.push(parse_cpu(&read("/proc/cpuinfo"), &read("/proc/meminfo")));
    devices
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> String {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    #[test]
    fn nvidia_smi_h100() {
        let d = parse_nvidia_smi(&fixture("nvidia-smi-h100x2.csv"));
        assert_eq!(d.len(), 2);
        assert_eq!((d[0].backend, d[0].index, d[0].vendor), (Backend::Cuda, 0, Vendor::Nvidia));
        assert_eq!(d[0].name, "NVIDIA H100 80GB HBM3");
        assert_eq!(d[0].memory_total_bytes, Some(81559 * MIB));
        assert_eq!(d[0].memory_free_bytes, Some(81003 * MIB));
        assert_eq!(d[0].driver.as_deref(), Some("550.54.15"));
        assert_eq!(d[1].index, 1);
        // Garbage (a driver error message) yields nothing rather than a bogus device.
        assert!(parse_nvidia_smi("NVIDIA-SMI has failed because it couldn't communicate").is_empty());
    }

    #[test]
    fn rocm_smi_two_gpus() {
        let d = parse_rocm_smi(&fixture("rocm-smi-mi210x2.json"));
        assert_eq!(d.len(), 2);
        assert_eq!((d[1].backend, d[1].index, d[1].vendor), (Backend::Rocm, 1, Vendor::Amd));
        assert_eq!(d[0].name, "AMD Instinct MI210");
        assert_eq!(d[0].memory_total_bytes, Some(68_702_699_520));
        assert_eq!(d[0].memory_free_bytes, Some(68_702_699_520 - 10_960_896));
        assert_eq!(d[0].driver.as_deref(), Some("6.3.6"));
        assert!(parse_rocm_smi("not json").is_empty());
    }

    #[test]
    fn kfd_topology_skips_cpu_nodes() {
        assert_eq!(parse_kfd_properties("cpu_cores_count 64\nsimd_count 0\nvendor_id 0\n"), None);
        let gpu =
            "cpu_cores_count 0\nsimd_count 416\ngfx_target_version 90010\nvendor_id 4098\ndevice_id 29631\n";
        let want = KfdGpu { vendor_id: 4098, device_id: 29631, arch: Some("gfx90a".into()) };
        assert_eq!(parse_kfd_properties(gpu), Some(want));
        assert_eq!(Vendor::from_pci("4098"), Vendor::Amd);
    }

    #[test]
    fn vulkaninfo_nvidia_and_llvmpipe() {
        let d = parse_vulkaninfo_summary(&fixture("vulkaninfo-summary.txt"));
        assert_eq!(d.len(), 2, "{d:?}");
        assert_eq!((d[0].backend, d[0].index, d[0].vendor), (Backend::Vulkan, 0, Vendor::Nvidia));
        assert_eq!(d[0].name, "NVIDIA H100 80GB HBM3");
        assert!(!d[0].software);
        assert_eq!(d[1].index, 1);
        assert!(d[1].software, "llvmpipe is a CPU device");
        assert!(d[1].name.starts_with("llvmpipe"));
    }

    #[test]
    fn system_profiler_apple_silicon() {
        let d = parse_system_profiler(&fixture("system-profiler-m2.txt"));
        assert_eq!(d.len(), 1);
        assert_eq!(
            (d[0].backend, d[0].vendor, d[0].name.as_str()),
            (Backend::Metal, Vendor::Apple, "Apple M2 Max")
        );
    }

    #[test]
    fn cpu_from_proc() {
        let d = parse_cpu(
            "processor\t: 0\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n",
            "MemTotal:       65842236 kB\nMemFree:         1000 kB\nMemAvailable:   50000000 kB\n",
        );
        assert_eq!(d.name, "AMD EPYC 7B13 64-Core Processor");
        assert_eq!(d.memory_total_bytes, Some(65_842_236 * 1024));
        assert_eq!(d.memory_free_bytes, Some(50_000_000 * 1024));
    }

    /// On this machine: whatever tools are missing, detection finishes and finds the CPU.
    #[tokio::test]
    async fn live_detection_always_has_the_cpu() {
        let d = detect().await;
        assert_eq!(d.iter().filter(|d| d.backend == Backend::Cpu).count(), 1, "{d:?}");
        let cpu = d.iter().find(|d| d.backend == Backend::Cpu).unwrap();
        assert!(cpu.memory_total_bytes.is_some_and(|m| m > 0), "{cpu:?}");
        // Read again when deciding whether another worker fits.
        let free = free_memory(Backend::Cpu, 0).await;
        assert!(free.is_some_and(|f| f > 0 && f <= cpu.memory_total_bytes.unwrap_or(0)), "{free:?}");
        assert_eq!(free_memory(Backend::Vulkan, 0).await, None, "not reported by any tool");
    }
}
