//! The Metal backend (macOS only): opening an Apple GPU through candle and checking it like the CUDA backend.
//! Not built or run by Linux CI: candle's Metal backend needs Apple's frameworks.

use crate::{Backend, DeviceError, DeviceInfo};
use candle_core::Device;

pub fn init(index: usize) -> Result<(Device, DeviceInfo), DeviceError> {
    let err = |message: String| DeviceError::Init { backend: Backend::Metal, index, message };
    let device = Device::new_metal(index).map_err(|e| err(format!("creating the device: {e}")))?;
    crate::check::matmul_matches_cpu(Backend::Metal, &device)
        .map_err(|m| err(format!("start-up check: {m}")))?;
    let info = DeviceInfo {
        backend: Backend::Metal,
        index,
        name: format!("Apple GPU {index} (Metal)"),
        // Unified memory: the system's, as the CPU reports it.
        memory_total_bytes: None,
        memory_free_bytes: None,
        driver: None,
        threads: None,
    };
    Ok((device, info))
}
