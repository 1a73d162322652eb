//! AMD GPUs by architecture: which ones the ROCm worker may serve. ROCm on APUs such as Renoir/Cezanne (gfx90c)
//! can panic the kernel, and a GPU whose gfx target the installed ROCm worker carries no code for (Polaris gfx803,
//! say) fails at its first kernel. Such GPUs get the Vulkan worker instead, decided here at planning time (there
//! is no fallback at run time: a crashed kernel cannot fall back), with `rocm_deny` / `rocm_allow` as the
//! operator's override.

use std::path::Path;

/// The default `rocm_deny`: integrated GPUs (APUs) on which ROCm is known to crash or hang the machine, or to
/// fault in its first kernels. Operators with a working setup allow theirs with `rocm_allow`.
pub const DEFAULT_DENY: &[(&str, &str)] = &[
    ("gfx902", "Raven Ridge APU"),
    ("gfx909", "Picasso APU"),
    ("gfx90c", "Renoir/Cezanne APU: ROCm panics the kernel"),
    ("gfx1033", "Van Gogh APU"),
    ("gfx1035", "Rembrandt APU"),
    ("gfx1036", "Raphael/Granite Ridge integrated GPU"),
    ("gfx1103", "Phoenix/Hawk Point APU"),
    ("gfx1150", "Strix Point APU"),
];

/// The gfx name of KFD's `gfx_target_version` (`major·10000 + minor·100 + stepping`, the stepping written in
/// hex): 90012 → `gfx90c`, 110000 → `gfx1100`, 80003 → `gfx803`.
pub fn gfx_name(version: u32) -> Option<String> {
    let (major, minor, stepping) = (version / 10000, (version / 100) % 100, version % 100);
    (major > 0 && minor <= 9 && stepping <= 15).then(|| format!("gfx{major}{minor}{stepping:x}"))
}

/// A gfx name as written by people and tools: lower case, with the `gfx` prefix, feature suffixes dropped
/// (`gfx90a:xnack-` → `gfx90a`).
pub fn normalize(name: &str) -> String {
    let name = name.trim().to_ascii_lowercase();
    let name = name.split(':').next().unwrap_or("");
    if name.starts_with("gfx") {
        name.to_string()
    } else {
        format!("gfx{name}")
    }
}

/// The gfx targets in a worker's `--version` line (`… gfx: gfx1030,gfx1100`); `None` when it names none (a
/// build that does not say what it carries).
pub fn targets_in_version(line: &str) -> Option<Vec<String>> {
    let list = line.split("gfx: ").nth(1)?;
    let list = list.split([')', ';']).next().unwrap_or("");
    let targets: Vec<String> = list.split(',').map(normalize).filter(|t| t.len() > 3).collect();
    (!targets.is_empty()).then_some(targets)
}

/// The gfx targets of the ROCm worker at `binary`, from its `--version` (which its launcher answers even where
/// the HIP runtime is missing). `None` when it is not installed or does not say.
pub async fn installed_targets(binary: &Path) -> Option<Vec<String>> {
    if !binary.is_file() {
        return None;
    }
    let run = tokio::process::Command::new(binary).arg("--version").kill_on_drop(true).output();
    let out = tokio::time::timeout(std::time::Duration::from_secs(10), run).await.ok()?.ok()?;
    targets_in_version(&String::from_utf8_lossy(&out.stdout))
}

/// Why ROCm must not serve a GPU of architecture `arch`, or `None` when it may. `built`: the targets of the
/// installed ROCm worker (`None`: unknown, not checked). An unknown architecture is allowed: the check needs it.
pub fn refusal(
    arch: Option<&str>,
    built: Option<&[String]>,
    deny: &[String],
    allow: &[String],
) -> Option<String> {
    let arch = normalize(arch?);
    if allow.iter().any(|a| normalize(a) == arch) {
        return None;
    }
    if deny.iter().any(|d| normalize(d) == arch) {
        let why = DEFAULT_DENY.iter().find(|(g, _)| *g == arch).map_or("in rocm_deny", |(_, why)| why);
        return Some(format!("{arch}: ROCm denied ({why})"));
    }
    match built {
        Some(targets) if !targets.iter().any(|t| normalize(t) == arch) => {
            Some(format!("{arch}: the ROCm worker carries no code for it (built for {})", targets.join(", ")))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deny() -> Vec<String> {
        DEFAULT_DENY.iter().map(|(g, _)| g.to_string()).collect()
    }

    #[test]
    fn gfx_names_from_kfd_versions() {
        assert_eq!(gfx_name(90012).as_deref(), Some("gfx90c"));
        assert_eq!(gfx_name(110000).as_deref(), Some("gfx1100"));
        assert_eq!(gfx_name(110003).as_deref(), Some("gfx1103"));
        assert_eq!(gfx_name(100300).as_deref(), Some("gfx1030"));
        assert_eq!(gfx_name(80003).as_deref(), Some("gfx803"));
        assert_eq!(gfx_name(90010).as_deref(), Some("gfx90a"));
        assert_eq!(gfx_name(0), None);
    }

    #[test]
    fn version_lines_name_their_targets() {
        let line = "sd-worker-rocm 0.1.0 (backend: rocm, gfx: gfx1030,gfx1100)";
        assert_eq!(targets_in_version(line), Some(vec!["gfx1030".to_string(), "gfx1100".to_string()]));
        assert_eq!(targets_in_version("sd-worker-rocm 0.1.0 (backend: rocm)"), None);
    }

    #[test]
    fn deny_allow_and_built_targets() {
        let built = vec!["gfx1030".to_string(), "gfx1100".to_string()];
        let none: Vec<String> = Vec::new();
        assert_eq!(refusal(Some("gfx1100"), Some(&built), &deny(), &none), None);
        let apu = refusal(Some("gfx90c"), Some(&built), &deny(), &none).unwrap();
        assert!(apu.contains("gfx90c: ROCm denied") && apu.contains("panics"), "{apu}");
        let polaris = refusal(Some("gfx803"), Some(&built), &deny(), &none).unwrap();
        assert!(polaris.contains("no code for it (built for gfx1030, gfx1100)"), "{polaris}");
        // Allowed by the operator: neither the deny list nor the built targets stop it.
        assert_eq!(refusal(Some("gfx90c"), Some(&built), &deny(), &["gfx90c".into()]), None);
        assert_eq!(refusal(Some("GFX803"), Some(&built), &deny(), &["gfx803".into()]), None);
        // Unknown targets are not checked; an unknown architecture cannot be.
        assert_eq!(refusal(Some("gfx803"), None, &deny(), &none), None);
        assert_eq!(refusal(None, Some(&built), &deny(), &none), None);
        assert!(refusal(Some("gfx1100"), Some(&built), &["gfx1100".into()], &none)
            .unwrap()
            .contains("in rocm_deny"));
    }
}

/// Planning on the KFD topologies and tool outputs of real machine shapes (`tests/fixtures/kfd`), with a ROCm
/// worker built for gfx1030 and gfx1100.
#[cfg(test)]
mod planning {
    use crate::config::HiveConfig;
    use crate::detect::{self, Device};
    use crate::plan::{self, Installed, Plan, Status};
    use shared_worker::Backend;
    use std::path::Path;

    struct Built;
    impl Installed for Built {
        fn exists(&self, _: &Path) -> bool {
            true
        }
        fn rocm_targets(&self) -> Option<&[String]> {
            static TARGETS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
            Some(TARGETS.get_or_init(|| vec!["gfx1030".into(), "gfx1100".into()]))
        }
    }

    fn fixtures() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
    }

    fn read(name: &str) -> String {
        std::fs::read_to_string(fixtures().join(name)).unwrap()
    }

    /// One AMD Vulkan device per KFD GPU (RADV lists them in the same PCI order), and the CPU.
    fn amd_node(machine: &str) -> Vec<Device> {
        let kfd = detect::kfd_gpus(&fixtures().join("kfd").join(machine).join("nodes"));
        assert!(!kfd.is_empty(), "{machine}: no GPU node");
        let mut devices = detect::amd_devices(Vec::new(), &kfd);
        let vulkan: String = (0..kfd.len())
            .map(|i| format!("GPU{i}:\n\tvendorID = 0x1002\n\tdeviceType = PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU\n\tdeviceName = AMD Radeon (RADV)\n"))
            .collect();
        devices.extend(detect::parse_vulkaninfo_summary(&format!("Devices:\n========\n{vulkan}")));
        devices
            .push(detect::parse_cpu("model name : AMD Ryzen", "MemTotal: 1000 kB\nMemAvailable: 900 kB\n"));
        devices
    }

    fn config(f: impl FnOnce(&mut HiveConfig)) -> HiveConfig {
        let mut c =
            HiveConfig { models: vec!["m".into()], workers_dir: Some("/w".into()), ..Default::default() };
        f(&mut c);
        c
    }

    fn status(p: &Plan, backend: Backend, index: usize) -> Status {
        p.rows.iter().find(|r| r.device.backend == backend && r.device.index == index).unwrap().status.clone()
    }

    fn served(p: &Plan) -> Vec<String> {
        p.workers.iter().map(|w| format!("{}:{}", w.backend, w.device_index)).collect()
    }

    fn refused(p: &Plan, index: usize) -> (String, Option<String>) {
        match status(p, Backend::Rocm, index) {
            Status::RocmRefused { reason, served_by } => (reason, served_by),
            other => panic!("rocm:{index} is {other:?}"),
        }
    }

    #[test]
    fn polaris_without_code_in_the_build_goes_to_vulkan() {
        let p = plan::plan(&amd_node("rx580"), &config(|_| {}), Built);
        assert_eq!(served(&p), ["vulkan:0"]);
        let (reason, by) = refused(&p, 0);
        assert_eq!(reason, "gfx803: the ROCm worker carries no code for it (built for gfx1030, gfx1100)");
        assert_eq!(by.as_deref(), Some("vulkan:0"));
    }

    #[test]
    fn cezanne_apu_is_denied_and_says_why() {
        let p = plan::plan(&amd_node("cezanne"), &config(|_| {}), Built);
        assert_eq!(served(&p), ["vulkan:0"]);
        assert_eq!(refused(&p, 0).0, "gfx90c: ROCm denied (Renoir/Cezanne APU: ROCm panics the kernel)");
        let table = plan::render_table(&p);
        assert!(
            table.contains(
                "gfx90c: ROCm denied (Renoir/Cezanne APU: ROCm panics the kernel), served by vulkan:0"
            ),
            "{table}"
        );
        // The operator's override: ROCm serves it, Vulkan stands aside.
        let p = plan::plan(&amd_node("cezanne"), &config(|c| c.rocm_allow = vec!["gfx90c".into()]), Built);
        assert_eq!(served(&p), ["rocm:0"]);
    }

    #[test]
    fn phoenix_apu_is_denied() {
        let p = plan::plan(&amd_node("phoenix"), &config(|_| {}), Built);
        assert_eq!(served(&p), ["vulkan:0"]);
        assert!(refused(&p, 0).0.starts_with("gfx1103: ROCm denied (Phoenix"));
        // A deny list without it (and a build carrying it) lets ROCm serve it.
        let p = plan::plan(&amd_node("phoenix"), &config(|c| c.rocm_deny.clear()), |_: &Path| true);
        assert_eq!(served(&p), ["rocm:0"]);
    }

    #[test]
    fn rx7900_gets_rocm() {
        let p = plan::plan(&amd_node("rx7900"), &config(|_| {}), Built);
        assert_eq!(served(&p), ["rocm:0"]);
        assert!(matches!(status(&p, Backend::Vulkan, 0), Status::Shadowed { by } if by == "rocm:0"));
    }

    #[test]
    fn a_discrete_gpu_beside_an_apu_splits_by_architecture() {
        let p = plan::plan(&amd_node("dgpu_and_apu"), &config(|_| {}), Built);
        assert_eq!(served(&p), ["rocm:0", "vulkan:1"]);
        assert_eq!(refused(&p, 1).1.as_deref(), Some("vulkan:1"));
    }

    #[test]
    fn mixed_nvidia_and_amd_node() {
        let mut devices = detect::parse_nvidia_smi(&read("nvidia-smi-h100x1.csv"));
        let kfd = detect::kfd_gpus(&fixtures().join("kfd/mixed/nodes"));
        let amd = detect::amd_devices(detect::parse_rocm_smi(&read("rocm-smi-rx7900.json")), &kfd);
        assert_eq!(amd[0].arch.as_deref(), Some("gfx1100"));
        assert_eq!(amd[0].name, "Navi 31 [Radeon RX 7900 XT/7900 XTX/7900M]");
        devices.extend(amd);
        devices.extend(detect::parse_vulkaninfo_summary(&read("vulkaninfo-mixed.txt")));
        let p = plan::plan(&devices, &config(|_| {}), Built);
        assert_eq!(served(&p), ["cuda:0", "rocm:0"]);
        assert!(matches!(status(&p, Backend::Vulkan, 0), Status::Shadowed { by } if by == "cuda:0"));
        assert!(matches!(status(&p, Backend::Vulkan, 1), Status::Shadowed { by } if by == "rocm:0"));
    }

    #[test]
    fn rocm_smi_without_gfx_takes_kfd_architectures_by_position() {
        let smi = r#"{"card0": {"Card Series": "Navi 31", "VRAM Total Memory (B)": "100"}}"#;
        let kfd = detect::kfd_gpus(&fixtures().join("kfd/cezanne/nodes"));
        let d = detect::amd_devices(detect::parse_rocm_smi(smi), &kfd);
        assert_eq!(d[0].arch.as_deref(), Some("gfx90c"));
        assert_eq!(d[0].name, "Navi 31");
    }
}
