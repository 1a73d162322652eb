//! Per-module device placement (`--placement te=cpu,vae=vulkan0,unet=vulkan0`) and weight offload
//! (`--offload te,vae`), parsed once for both engines. Module names and aliases follow stable-diffusion.cpp's
//! `--backend` option (diffusion/unet/model, te/clip/text_encoder, vae/first_stage), devices are a backend name
//! and an index as the worker binaries number them (`cpu`, `cuda0`, `vulkan1`, `rocm0`, `metal0`).

use std::fmt;
use thiserror::Error;

/// The parts of a pipeline that can live on different devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Module {
    /// The denoiser (UNet).
    Diffusion,
    /// The text encoder(s).
    TextEncoder,
    Vae,
}

impl Module {
    pub const ALL: [Module; 3] = [Module::Diffusion, Module::TextEncoder, Module::Vae];

    pub fn name(self) -> &'static str {
        match self {
            Module::Diffusion => "unet",
            Module::TextEncoder => "te",
            Module::Vae => "vae",
        }
    }

    pub fn parse(s: &str) -> Option<Module> {
        let key: String = s.trim().to_ascii_lowercase().chars().filter(|c| !matches!(c, '-' | '_')).collect();
        match key.as_str() {
            "unet" | "diffusion" | "model" | "dit" => Some(Module::Diffusion),
            "te" | "clip" | "textencoder" | "textencoders" | "text" | "cond" => Some(Module::TextEncoder),
            "vae" | "firststage" | "autoencoder" => Some(Module::Vae),
            _ => None,
        }
    }
}

/// A device as the operator names it: a backend (`cpu`, `cuda`, `vulkan`, `rocm`, `metal`) and an index.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceRef {
    pub backend: String,
    pub index: usize,
}

impl fmt::Display for DeviceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.backend == "cpu" {
            f.write_str("cpu")
        } else {
            write!(f, "{}{}", self.backend, self.index)
        }
    }
}

const BACKENDS: [&str; 5] = ["cpu", "cuda", "vulkan", "rocm", "metal"];

impl DeviceRef {
    pub fn parse(s: &str) -> Option<DeviceRef> {
        let lower = s.trim().to_ascii_lowercase();
        let split = lower.find(|c: char| c.is_ascii_digit()).unwrap_or(lower.len());
        let (backend, index) = lower.split_at(split);
        if !BACKENDS.contains(&backend) {
            return None;
        }
        let index = if index.is_empty() { 0 } else { index.parse().ok()? };
        if backend == "cpu" && index != 0 {
            return None;
        }
        Some(DeviceRef { backend: backend.to_string(), index })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlacementError {
    #[error("--placement: `{0}` is not MODULE=DEVICE (e.g. te=cpu,unet=cuda0,vae=cuda0)")]
    Syntax(String),
    #[error("--placement/--offload: unknown module `{0}` (use unet, te or vae; aliases diffusion, clip, first_stage)")]
    UnknownModule(String),
    #[error("--placement: unknown device `{0}` (use cpu, cuda0, vulkan0, rocm0, metal0, …)")]
    UnknownDevice(String),
    #[error("--placement: module `{0}` is placed twice")]
    Duplicate(&'static str),
}

/// Where each module runs (absent: the worker's own device) and which modules keep their weights in host
/// memory until used.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    pub devices: Vec<(Module, DeviceRef)>,
    pub offload: Vec<Module>,
}

impl Placement {
    /// Parses `--placement` (comma-separated MODULE=DEVICE) and `--offload` (comma-separated modules); empty
    /// strings mean "nothing".
    pub fn parse(placement: &str, offload: &str) -> Result<Placement, PlacementError> {
        let mut out = Placement::default();
        for part in placement.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (module, device) = part.split_once('=').ok_or_else(|| PlacementError::Syntax(part.into()))?;
            let m =
                Module::parse(module).ok_or_else(|| PlacementError::UnknownModule(module.trim().into()))?;
            let d = DeviceRef::parse(device)
                .ok_or_else(|| PlacementError::UnknownDevice(device.trim().into()))?;
            if out.devices.iter().any(|(seen, _)| *seen == m) {
                return Err(PlacementError::Duplicate(m.name()));
            }
            out.devices.push((m, d));
        }
        for name in offload.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let m = Module::parse(name).ok_or_else(|| PlacementError::UnknownModule(name.into()))?;
            if !out.offload.contains(&m) {
                out.offload.push(m);
            }
        }
        Ok(out)
    }

    pub fn is_default(&self) -> bool {
        self.devices.is_empty() && self.offload.is_empty()
    }

    /// The device `module` runs on, if placed explicitly.
    pub fn device_of(&self, module: Module) -> Option<&DeviceRef> {
        self.devices.iter().find(|(m, _)| *m == module).map(|(_, d)| d)
    }

    pub fn offloaded(&self, module: Module) -> bool {
        self.offload.contains(&module)
    }
}

impl fmt::Display for Placement {
    /// The canonical form, e.g. `unet=vulkan0,te=cpu; offload te`; `default` when nothing is set.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_default() {
            return f.write_str("default");
        }
        let placed: Vec<String> = self.devices.iter().map(|(m, d)| format!("{}={d}", m.name())).collect();
        f.write_str(&placed.join(","))?;
        if !self.offload.is_empty() {
            let names: Vec<&str> = self.offload.iter().map(|m| m.name()).collect();
            if !placed.is_empty() {
                f.write_str("; ")?;
            }
            write!(f, "offload {}", names.join(","))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_modules_aliases_and_devices() {
        let p = Placement::parse("te=cpu, first_stage=Vulkan0,diffusion=vulkan1", "clip,vae,te").unwrap();
        assert_eq!(p.device_of(Module::TextEncoder), Some(&DeviceRef { backend: "cpu".into(), index: 0 }));
        assert_eq!(p.device_of(Module::Vae).unwrap().to_string(), "vulkan0");
        assert_eq!(p.device_of(Module::Diffusion).unwrap().to_string(), "vulkan1");
        assert_eq!(p.offload, vec![Module::TextEncoder, Module::Vae]);
        assert_eq!(p.to_string(), "te=cpu,vae=vulkan0,unet=vulkan1; offload te,vae");
        assert_eq!(DeviceRef::parse("cuda").unwrap().to_string(), "cuda0");
        assert!(Placement::parse("", "").unwrap().is_default());
        assert_eq!(Placement::parse("", "").unwrap().to_string(), "default");
    }

    #[test]
    fn rejects_what_it_cannot_place() {
        assert_eq!(Placement::parse("te", ""), Err(PlacementError::Syntax("te".into())));
        assert_eq!(Placement::parse("lora=cpu", ""), Err(PlacementError::UnknownModule("lora".into())));
        assert_eq!(Placement::parse("te=tpu0", ""), Err(PlacementError::UnknownDevice("tpu0".into())));
        assert_eq!(Placement::parse("te=cpu1", ""), Err(PlacementError::UnknownDevice("cpu1".into())));
        assert_eq!(Placement::parse("te=cpu,clip=cuda0", ""), Err(PlacementError::Duplicate("te")));
        assert!(Placement::parse("", "unet,bogus").unwrap_err().to_string().contains("`bogus`"));
    }
}
