//! Opening a ggml device (Vulkan, ROCm) for the stable-diffusion.cpp engine: the device must exist under this
//! backend's name, be a GPU, and pass the engine's start-up matrix-product check.

use crate::{Backend, DeviceError, DeviceHandle, DeviceInfo};
use sdhive_sdcpp::device;

pub fn init(backend: Backend, prefix: &str, index: usize) -> Result<(DeviceHandle, DeviceInfo), DeviceError> {
    // A missing device's message lists what ggml did find (a CPU-only driver, another vendor's GPU).
    let opened = device::open(prefix, index).map_err(|e| DeviceError::Init {
        backend,
        index,
        message: e.to_string(),
    })?;
    let info = DeviceInfo {
        backend,
        index,
        name: opened.description.clone(),
        memory_total_bytes: Some(opened.memory_total_bytes),
        memory_free_bytes: Some(opened.memory_free_bytes),
        driver: Some(format!(
            "ggml {} / stable-diffusion.cpp {}",
            opened.name,
            sdhive_sdcpp::sdcpp_version()
        )),
        threads: None,
    };
    Ok((DeviceHandle::Ggml(opened.name), info))
}

/// `(total, free)` of ggml device `name` now.
pub fn memory(name: &str) -> (Option<u64>, Option<u64>) {
    match device::find(name) {
        Some(d) => (Some(d.memory_total_bytes), Some(d.memory_free_bytes)),
        None => (None, None),
    }
}
