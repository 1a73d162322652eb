//! Which worker runs where: pairs the views of one physical GPU across backends, picks a backend per device
//! (CUDA → ROCm → Vulkan → Metal → CPU, unless the operator pins, excludes or forces one), checks that the
//! worker binary exists (a missing one is reported, never silently skipped), and hands out the models to
//! preload (round robin; models beyond the device count load on demand and are listed as such).

use crate::config::{CpuPolicy, HiveConfig};
use crate::detect::{Device, Vendor};
use serde::Serialize;
use shared_worker::Backend;
use std::path::{Path, PathBuf};

/// `backend` or `backend:index`, as `pin` and `exclude` take them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpec {
    pub backend: Backend,
    pub index: Option<usize>,
}

impl DeviceSpec {
    pub fn parse(s: &str) -> Result<DeviceSpec, String> {
        let (backend, index) = match s.split_once(':') {
            Some((b, i)) => {
                let i = i.trim().parse().map_err(|_| format!("`{s}`: the device index must be a number"))?;
                (b, Some(i))
            }
            None => (s, None),
        };
        let backend = backend.parse::<Backend>().map_err(|e| format!("`{s}`: {e}"))?;
        Ok(DeviceSpec { backend, index })
    }

    fn matches(&self, d: &Device) -> bool {
        self.backend == d.backend && self.index.is_none_or(|i| i == d.index)
    }
}

/// Preference when one device is reachable through several backends.
pub fn priority(b: Backend) -> u8 {
    match b {
        Backend::Cuda => 0,
        Backend::Rocm => 1,
        Backend::Vulkan => 2,
        Backend::Metal => 3,
        Backend::Cpu => 4,
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Status {
    /// A worker is planned here.
    Selected {
        /// What it preloads; `None`: the first checkpoint of the models dirs.
        model: Option<String>,
        worker_id: String,
        /// Further workers on the same device (`cpu_workers`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        more: Vec<MoreWorker>,
        /// The most workers the device runs, those started on demand included (`max_workers_per_device`,
        /// `max_cpu_workers`).
        max_workers: usize,
        /// `device_memory` for this device, when stated.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stated_memory_bytes: Option<u64>,
    },
    /// Usable, but no model was configured.
    Idle,
    /// The worker binary for this backend is not installed; another backend (or none) serves the device.
    MissingBinary {
        binary: PathBuf,
    },
    /// The same physical device is served through a preferred backend.
    Shadowed {
        by: String,
    },
    Excluded,
    /// Not the backend forced by `backend`, or not the pinned one.
    NotChosen,
    /// A software rasteriser; the CPU backend covers the CPU.
    Software,
    /// ROCm may not serve this AMD GPU (`rocm_deny`, or a gfx target the installed ROCm worker lacks); the
    /// next backend of the device does.
    RocmRefused {
        reason: String,
        /// The view serving the device instead (`vulkan:0`), if any.
        served_by: Option<String>,
    },
    /// The CPU is left alone because GPUs are serving (`cpu = "auto"`).
    CpuNotNeeded,
}

/// A second (third, …) worker on one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MoreWorker {
    pub worker_id: String,
    pub model: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Row {
    /// Physical device number on this node (views of one GPU share it).
    pub physical: usize,
    #[serde(flatten)]
    pub device: Device,
    pub binary_present: bool,
    #[serde(flatten)]
    pub status: Status,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedWorker {
    pub worker_id: String,
    pub backend: Backend,
    pub device_index: usize,
    /// `--model`: what it loads first; `None` lets it load the first checkpoint of its models dirs.
    pub model: Option<String>,
    pub binary: PathBuf,
}

#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub rows: Vec<Row>,
    pub workers: Vec<PlannedWorker>,
    /// Configured models no worker preloads (more models than workers): they load on demand.
    pub on_demand: Vec<String>,
}

/// Where a backend's worker binary is expected.
pub fn binary_path(workers_dir: &Path, backend: Backend) -> PathBuf {
    workers_dir.join(format!("{}{}", backend.binary_name(), std::env::consts::EXE_SUFFIX))
}

/// The first file of `backend`'s worker that is not installed: the binary, and for the backends started through
/// a launcher (sdhive-launch) the engine beside it, without which the launcher only refuses.
fn missing_file(binary: &Path, backend: Backend, binary_exists: &impl Fn(&Path) -> bool) -> Option<PathBuf> {
    let engine = sdhive_launch::engine_for(backend.name()).map(|_| sdhive_launch::engine_path(binary));
    std::iter::once(binary.to_path_buf()).chain(engine).find(|p| !binary_exists(p))
}

/// `--workers-dir`, else the folder holding the hive executable.
pub fn workers_dir(config: &HiveConfig) -> PathBuf {
    config.workers_dir.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(Path::to_path_buf))
            .unwrap_or_else(|| PathBuf::from("."))
    })
}

/// Only `[A-Za-z0-9._-]{1,64}`: ids end up in URLs, logs and argv.
pub fn valid_worker_id(id: &str) -> bool {
    (1..=64).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// The node's name reduced to worker-id characters.
pub fn host_prefix() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    let clean: String = host
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '-' })
        .take(40)
        .collect();
    if clean.is_empty() {
        "hive".into()
    } else {
        clean
    }
}

/// Groups device views into physical devices: the k-th NVIDIA (AMD) Vulkan device is taken to be CUDA (ROCm)
/// device k, which holds when both enumerate in PCI order (set `CUDA_DEVICE_ORDER=PCI_BUS_ID`); pin or
/// exclude by `backend:index` where that assumption fails.
fn physical_groups(devices: &[Device]) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut by_vendor: Vec<(Vendor, Vec<usize>)> = Vec::new();
    for (i, d) in devices.iter().enumerate() {
        if matches!(d.backend, Backend::Cuda | Backend::Rocm) {
            groups.push(vec![i]);
            match by_vendor.iter_mut().find(|(v, _)| *v == d.vendor) {
                Some((_, list)) => list.push(groups.len() - 1),
                None => by_vendor.push((d.vendor, vec![groups.len() - 1])),
            }
        }
    }
    let mut seen: Vec<(Vendor, usize)> = Vec::new();
    for (i, d) in devices.iter().enumerate() {
        match d.backend {
            Backend::Cuda | Backend::Rocm => {}
            Backend::Vulkan if !d.software => {
                let k = match seen.iter_mut().find(|(v, _)| *v == d.vendor) {
                    Some((_, n)) => {
                        *n += 1;
                        *n - 1
                    }
                    None => {
                        seen.push((d.vendor, 1));
                        0
                    }
                };
                let native = by_vendor.iter().find(|(v, _)| *v == d.vendor).and_then(|(_, g)| g.get(k));
                match native {
                    Some(&g) => groups[g].push(i),
                    None => groups.push(vec![i]),
                }
            }
            _ => groups.push(vec![i]),
        }
    }
    groups
}

/// What is installed where the hive looks for worker binaries. Closures `Fn(&Path) -> bool` answer `exists`
/// (and know no ROCm targets), so tests need no files.
pub trait Installed {
    fn exists(&self, path: &Path) -> bool;
    /// The gfx targets the installed ROCm worker carries; `None`: unknown (not installed, or it does not say).
    fn rocm_targets(&self) -> Option<&[String]> {
        None
    }
}

impl<F: Fn(&Path) -> bool> Installed for F {
    fn exists(&self, path: &Path) -> bool {
        self(path)
    }
}

/// The real file system, and the ROCm worker's targets read from its `--version`.
#[derive(Debug, Clone, Default)]
pub struct Probe {
    pub rocm_targets: Option<Vec<String>>,
}

impl Probe {
    pub async fn read(config: &HiveConfig) -> Probe {
        let rocm = binary_path(&workers_dir(config), Backend::Rocm);
        Probe { rocm_targets: crate::amd::installed_targets(&rocm).await }
    }
}

impl Installed for Probe {
    fn exists(&self, path: &Path) -> bool {
        path.is_file()
    }
    fn rocm_targets(&self) -> Option<&[String]> {
        self.rocm_targets.as_deref()
    }
}

/// Decides every device's fate.
pub fn plan(devices: &[Device], config: &HiveConfig, installed: impl Installed) -> Plan {
    let binary_exists = |p: &Path| installed.exists(p);
    let dir = workers_dir(config);
    let forced: Option<Backend> = config.backend.as_deref().and_then(|b| b.parse().ok());
    let pins: Vec<DeviceSpec> = config.pin.iter().filter_map(|s| DeviceSpec::parse(s).ok()).collect();
    let excludes: Vec<DeviceSpec> = config.exclude.iter().filter_map(|s| DeviceSpec::parse(s).ok()).collect();
    let host = host_prefix();

    let mut rows: Vec<Row> = Vec::new();
    // (row index, physical) of the view chosen for each served device.
    let mut chosen: Vec<usize> = Vec::new();
    let mut cpu_rows: Vec<usize> = Vec::new();
    for (physical, mut members) in physical_groups(devices).into_iter().enumerate() {
        members.sort_by_key(|&i| priority(devices[i].backend));
        let device_excluded =
            members.iter().any(|&i| excludes.iter().any(|e| e.index.is_some() && e.matches(&devices[i])));
        let pinned: Option<Backend> =
            members.iter().find_map(|&i| pins.iter().find(|p| p.matches(&devices[i])).map(|p| p.backend));
        let mut served_by: Option<String> = None;
        let mut refused_rows = Vec::new();
        for &i in &members {
            let d = &devices[i];
            let missing = missing_file(&binary_path(&dir, d.backend), d.backend, &binary_exists);
            let present = missing.is_none();
            let status = if d.software {
                Status::Software
            } else if device_excluded || excludes.iter().any(|e| e.index.is_none() && e.backend == d.backend)
            {
                Status::Excluded
            } else if forced.is_some_and(|f| f != d.backend) || pinned.is_some_and(|p| p != d.backend) {
                Status::NotChosen
            } else if let Some(by) = &served_by {
                Status::Shadowed { by: by.clone() }
            } else if let Some(reason) = rocm_refusal(d, config, &installed) {
                refused_rows.push(rows.len());
                Status::RocmRefused { reason, served_by: None }
            } else if let Some(binary) = missing {
                Status::MissingBinary { binary }
            } else {
                served_by = Some(format!("{}:{}", d.backend, d.index));
                if d.backend == Backend::Cpu {
                    cpu_rows.push(rows.len());
                } else {
                    chosen.push(rows.len());
                }
                Status::Idle
            };
            rows.push(Row { physical, device: d.clone(), binary_present: present, status });
        }
        for r in refused_rows {
            if let Status::RocmRefused { served_by: by, .. } = &mut rows[r].status {
                by.clone_from(&served_by);
            }
        }
    }
    match config.cpu {
        CpuPolicy::Always => chosen.extend(cpu_rows),
        CpuPolicy::Auto if chosen.is_empty() => chosen.extend(cpu_rows),
        CpuPolicy::Auto | CpuPolicy::Never => {
            for r in cpu_rows {
                rows[r].status = Status::CpuNotNeeded;
            }
        }
    }
    chosen.sort();
    let mut workers = Vec::new();
    // With a model library, a worker needs no `--model`: it loads the library's first checkpoint.
    if !config.models.is_empty() || !config.models_dirs.is_empty() {
        let model_for =
            |n: usize| (!config.models.is_empty()).then(|| config.models[n % config.models.len()].clone());
        for &r in &chosen {
            let d = rows[r].device.clone();
            let count = if d.backend == Backend::Cpu { config.cpu_workers.max(1) } else { 1 };
            let mut ids = Vec::new();
            for k in 0..count {
                let suffix = if k == 0 { String::new() } else { format!(".{k}") };
                let worker_id = format!("{host}-{}{}{suffix}", d.backend, d.index);
                let model = model_for(workers.len());
                ids.push(MoreWorker { worker_id: worker_id.clone(), model: model.clone() });
                workers.push(PlannedWorker {
                    worker_id,
                    backend: d.backend,
                    device_index: d.index,
                    model,
                    binary: binary_path(&dir, d.backend),
                });
            }
            let first = ids.remove(0);
            rows[r].status = Status::Selected {
                model: first.model,
                worker_id: first.worker_id,
                more: ids,
                max_workers: config.max_workers(d.backend).max(count),
                stated_memory_bytes: config.stated_memory(d.backend, d.index),
            };
        }
    }
    let on_demand = config.models.iter().skip(workers.len()).cloned().collect();
    Plan { rows, workers, on_demand }
}

fn rocm_refusal(d: &Device, config: &HiveConfig, installed: &impl Installed) -> Option<String> {
    if d.backend != Backend::Rocm {
        return None;
    }
    crate::amd::refusal(d.arch.as_deref(), installed.rocm_targets(), &config.rocm_deny, &config.rocm_allow)
}

/// The `hive devices` table.
pub fn render_table(plan: &Plan) -> String {
    let mut out = format!(
        "{:<4} {:<8} {:<5} {:<7} {:<36} {:>10} {:>10} {:<14} STATUS\n",
        "DEV", "BACKEND", "INDEX", "VENDOR", "NAME", "MEM TOTAL", "MEM FREE", "DRIVER"
    );
    let gib = |b: Option<u64>| {
        b.map(|b| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)).unwrap_or("-".into())
    };
    for r in &plan.rows {
        let d = &r.device;
        let status = match &r.status {
            Status::Selected { model, worker_id, more, max_workers, stated_memory_bytes } => {
                let mut text = std::iter::once((worker_id, model))
                    .chain(more.iter().map(|m| (&m.worker_id, &m.model)))
                    .map(|(id, model)| match model {
                        Some(m) => format!("worker {id} (preloads {m})"),
                        None => format!("worker {id} (preloads the models dirs' first checkpoint)"),
                    })
                    .collect::<Vec<_>>()
                    .join("; ");
                let extra = max_workers.saturating_sub(1 + more.len());
                if extra > 0 {
                    let memory = match (
                        stated_memory_bytes,
                        d.memory_free_bytes.is_some() || d.backend == Backend::Cpu,
                    ) {
                        (Some(b), _) => format!("within the stated {}", gib(Some(*b))),
                        (None, true) => "when its free memory fits the model".to_string(),
                        (None, false) => {
                            "when the free memory its workers report fits the model (not detected \
                                           here; device_memory states it)"
                                .to_string()
                        }
                    };
                    text.push_str(&format!("; up to {extra} more on demand, {memory}"));
                }
                text
            }
            Status::Idle => "usable (no model or models dir configured)".into(),
            Status::MissingBinary { binary } => format!("MISSING worker binary {}", binary.display()),
            Status::Shadowed { by } => format!("served as {by}"),
            Status::Excluded => "excluded".into(),
            Status::NotChosen => "not the chosen backend".into(),
            Status::Software => "software renderer, skipped".into(),
            Status::RocmRefused { reason, served_by } => match served_by {
                Some(by) => format!("{reason}, served by {by}"),
                None => format!("{reason}; no other backend serves it (install sd-worker-vulkan)"),
            },
            Status::CpuNotNeeded => "not used (GPUs serve; cpu = \"auto\")".into(),
        };
        let vendor = serde_json::to_value(d.vendor).ok().and_then(|v| v.as_str().map(String::from));
        let name: String = d.name.chars().take(36).collect();
        out.push_str(&format!(
            "{:<4} {:<8} {:<5} {:<7} {:<36} {:>10} {:>10} {:<14} {status}\n",
            r.physical,
            d.backend.name(),
            d.index,
            vendor.unwrap_or_default(),
            name,
            gib(d.memory_total_bytes),
            gib(d.memory_free_bytes),
            d.driver.as_deref().unwrap_or("-"),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(backend: Backend, index: usize, vendor: Vendor, software: bool) -> Device {
        Device {
            backend,
            index,
            vendor,
            name: format!("{backend}{index}"),
            memory_total_bytes: None,
            memory_free_bytes: None,
            driver: None,
            software,
            arch: None,
        }
    }

    /// Two NVIDIA GPUs seen by CUDA and Vulkan, llvmpipe, and the CPU.
    fn node() -> Vec<Device> {
        vec![
            dev(Backend::Cuda, 0, Vendor::Nvidia, false),
            dev(Backend::Cuda, 1, Vendor::Nvidia, false),
            dev(Backend::Vulkan, 0, Vendor::Nvidia, false),
            dev(Backend::Vulkan, 1, Vendor::Nvidia, false),
            dev(Backend::Vulkan, 2, Vendor::Other, true),
            dev(Backend::Cpu, 0, Vendor::Other, false),
        ]
    }

    fn config(f: impl FnOnce(&mut HiveConfig)) -> HiveConfig {
        let mut c =
            HiveConfig { models: vec!["m".into()], workers_dir: Some("/w".into()), ..Default::default() };
        f(&mut c);
        c
    }

    fn all_present(_: &Path) -> bool {
        true
    }

    fn served(p: &Plan) -> Vec<String> {
        p.workers.iter().map(|w| format!("{}:{}", w.backend, w.device_index)).collect()
    }

    fn status_of(p: &Plan, backend: Backend, index: usize) -> Status {
        p.rows.iter().find(|r| r.device.backend == backend && r.device.index == index).unwrap().status.clone()
    }

    #[test]
    fn cuda_beats_vulkan_and_cpu_stays_out_when_gpus_serve() {
        let p = plan(&node(), &config(|_| {}), all_present);
        assert_eq!(served(&p), ["cuda:0", "cuda:1"]);
        assert_eq!(status_of(&p, Backend::Vulkan, 1), Status::Shadowed { by: "cuda:1".into() });
        assert_eq!(status_of(&p, Backend::Vulkan, 2), Status::Software);
        assert_eq!(status_of(&p, Backend::Cpu, 0), Status::CpuNotNeeded);
        let p = plan(&node(), &config(|c| c.cpu = CpuPolicy::Always), all_present);
        assert_eq!(served(&p), ["cuda:0", "cuda:1", "cpu:0"]);
    }

    #[test]
    fn missing_binary_is_reported_and_the_next_backend_serves() {
        let no_cuda = |p: &Path| !p.ends_with("sd-worker-cuda");
        let p = plan(&node(), &config(|_| {}), no_cuda);
        assert_eq!(served(&p), ["vulkan:0", "vulkan:1"]);
        assert_eq!(
            status_of(&p, Backend::Cuda, 0),
            Status::MissingBinary { binary: "/w/sd-worker-cuda".into() }
        );
        // With only the CPU binary installed, the GPUs are reported and the CPU serves.
        let only_cpu = |p: &Path| p.ends_with("sd-worker-cpu");
        let p = plan(&node(), &config(|_| {}), only_cpu);
        assert_eq!(served(&p), ["cpu:0"]);
        assert!(matches!(status_of(&p, Backend::Vulkan, 0), Status::MissingBinary { .. }));
        assert!(render_table(&p).contains("MISSING worker binary /w/sd-worker-vulkan"));
        // A launcher without its engine cannot serve either: the engine is named.
        let no_cuda_engine = |p: &Path| !p.ends_with("sd-worker-cuda-engine");
        let p = plan(&node(), &config(|_| {}), no_cuda_engine);
        assert_eq!(served(&p), ["vulkan:0", "vulkan:1"]);
        assert_eq!(
            status_of(&p, Backend::Cuda, 0),
            Status::MissingBinary { binary: "/w/sd-worker-cuda-engine".into() }
        );
    }

    #[test]
    fn overrides_force_pin_and_exclude() {
        let p = plan(&node(), &config(|c| c.backend = Some("vulkan".into())), all_present);
        assert_eq!(served(&p), ["vulkan:0", "vulkan:1"]);
        assert_eq!(status_of(&p, Backend::Cuda, 0), Status::NotChosen);

        let p = plan(&node(), &config(|c| c.pin = vec!["vulkan:1".into()]), all_present);
        assert_eq!(served(&p), ["cuda:0", "vulkan:1"]);

        let p = plan(&node(), &config(|c| c.exclude = vec!["cuda:0".into()]), all_present);
        assert_eq!(served(&p), ["cuda:1"], "excluding cuda:0 excludes that GPU, not just the view");
        assert_eq!(status_of(&p, Backend::Vulkan, 0), Status::Excluded);

        let p = plan(&node(), &config(|c| c.exclude = vec!["cuda".into()]), all_present);
        assert_eq!(served(&p), ["vulkan:0", "vulkan:1"], "excluding a backend falls through to the next");

        let p = plan(&node(), &config(|c| c.backend = Some("cpu".into())), all_present);
        assert_eq!(served(&p), ["cpu:0"]);
    }

    #[test]
    fn models_go_round_robin_and_ids_are_valid() {
        let p = plan(&node(), &config(|c| c.models = vec!["a".into(), "b".into()]), all_present);
        let models: Vec<Option<&str>> = p.workers.iter().map(|w| w.model.as_deref()).collect();
        assert_eq!(models, [Some("a"), Some("b")]);
        assert!(p.on_demand.is_empty());
        assert!(p.workers.iter().all(|w| valid_worker_id(&w.worker_id)), "{:?}", p.workers);
        let p = plan(&node(), &config(|c| c.models.clear()), all_present);
        assert!(p.workers.is_empty());
        assert_eq!(status_of(&p, Backend::Cuda, 0), Status::Idle);
        // More models than devices: each device preloads one, the rest are named as loaded on demand.
        let three = |c: &mut HiveConfig| c.models = vec!["a".into(), "b".into(), "c".into()];
        let p = plan(&node(), &config(three), all_present);
        assert_eq!(p.on_demand, ["c"]);
        assert!(render_table(&p).contains("worker"), "{}", render_table(&p));
        assert!(render_table(&p).contains("(preloads b)"), "{}", render_table(&p));
        // A models dir without models: every device gets a worker that loads the library's first checkpoint.
        let p = plan(
            &node(),
            &config(|c| {
                c.models.clear();
                c.models_dirs = vec!["/m".into()];
            }),
            all_present,
        );
        assert_eq!(served(&p), ["cuda:0", "cuda:1"]);
        assert!(p.workers.iter().all(|w| w.model.is_none()));
    }

    #[test]
    fn several_cpu_workers_share_the_cpu() {
        let cpu_only = |c: &mut HiveConfig| {
            c.backend = Some("cpu".into());
            c.cpu_workers = 2;
            c.models = vec!["a".into(), "b".into(), "c".into()];
        };
        let p = plan(&node(), &config(cpu_only), all_present);
        assert_eq!(served(&p), ["cpu:0", "cpu:0"]);
        let ids: Vec<&str> = p.workers.iter().map(|w| w.worker_id.as_str()).collect();
        assert!(ids[0].ends_with("-cpu0") && ids[1].ends_with("-cpu0.1"), "{ids:?}");
        assert!(ids.iter().all(|id| valid_worker_id(id)));
        let models: Vec<Option<&str>> = p.workers.iter().map(|w| w.model.as_deref()).collect();
        assert_eq!(models, [Some("a"), Some("b")]);
        assert_eq!(p.on_demand, ["c"]);
        let table = render_table(&p);
        assert!(table.contains("(preloads a)") && table.contains("(preloads b)"), "{table}");
    }

    #[test]
    fn each_device_says_how_many_workers_it_may_run_on_demand() {
        let mut devices = node();
        devices[0].memory_free_bytes = Some(70 << 30);
        let p = plan(&devices, &config(|c| c.device_memory = vec!["cuda:1=40G".into()]), all_present);
        let max = |backend, index| match status_of(&p, backend, index) {
            Status::Selected { max_workers, stated_memory_bytes, .. } => (max_workers, stated_memory_bytes),
            other => panic!("{other:?}"),
        };
        assert_eq!((max(Backend::Cuda, 0), max(Backend::Cuda, 1)), ((2, None), (2, Some(40 << 30))));
        let table = render_table(&p);
        assert!(table.contains("up to 1 more on demand, when its free memory fits the model"), "{table}");
        assert!(table.contains("up to 1 more on demand, within the stated 40.0 GiB"), "{table}");
        // One per GPU: nothing on demand. The CPU keeps cpu_workers unless max_cpu_workers says more.
        let p = plan(&node(), &config(|c| c.max_workers_per_device = 1), all_present);
        assert!(!render_table(&p).contains("on demand"), "{}", render_table(&p));
        let cpu = |c: &mut HiveConfig| {
            c.backend = Some("cpu".into());
            c.cpu_workers = 2;
        };
        let p = plan(&node(), &config(cpu), all_present);
        assert!(matches!(status_of(&p, Backend::Cpu, 0), Status::Selected { max_workers: 2, .. }));
        let p = plan(
            &node(),
            &config(|c| {
                cpu(c);
                c.max_cpu_workers = Some(3);
            }),
            all_present,
        );
        assert!(matches!(status_of(&p, Backend::Cpu, 0), Status::Selected { max_workers: 3, .. }));
    }

    #[test]
    fn worker_ids_and_specs_are_validated() {
        assert!(valid_worker_id("node1-cpu0-4242"));
        assert!(!valid_worker_id(""));
        assert!(!valid_worker_id("a b"));
        assert!(!valid_worker_id("x;rm -rf"));
        assert!(!valid_worker_id(&"a".repeat(65)));
        assert_eq!(DeviceSpec::parse("cuda:1"), Ok(DeviceSpec { backend: Backend::Cuda, index: Some(1) }));
        assert!(DeviceSpec::parse("gpu:1").is_err());
    }
}
