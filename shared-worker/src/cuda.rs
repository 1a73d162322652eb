//! The CUDA backend: opening an NVIDIA GPU through candle, describing it from driver queries, and proving at start
//! that it computes correctly (a small matmul checked against the CPU), so a broken driver or a binary built for
//! another architecture fails at start-up with a clear message instead of producing garbage images.

use crate::{Backend, DeviceError, DeviceInfo};
use candle_core::cuda::cudarc::driver::{result, sys, CudaContext, DriverError};
use candle_core::Device;

fn init_err(index: usize, message: String) -> DeviceError {
    DeviceError::Init { backend: Backend::Cuda, index, message }
}

/// `CUDA_ERROR_NO_DEVICE (100)` and friends, with what they mean for an operator.
fn describe(what: &str, e: DriverError) -> String {
    let code = e.0 as i32;
    let hint = match e.0 {
        sys::CUresult::CUDA_ERROR_NO_DEVICE => ": no CUDA device is visible (check CUDA_VISIBLE_DEVICES)",
        sys::CUresult::CUDA_ERROR_STUB_LIBRARY => {
            ": the libcuda.so.1 found is a stub, no NVIDIA driver is installed on this machine"
        }
        sys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
            ": the NVIDIA driver is older than the CUDA this binary was built with (13.0)"
        }
        sys::CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH => {
            ": the NVIDIA kernel module and libcuda versions differ"
        }
        _ => "",
    };
    format!("{what} failed: {:?} (code {code}){hint}", e.0)
}

/// The CUDA devices the driver sees; an error when there is no usable driver.
pub fn device_count() -> Result<usize, String> {
    result::init().map_err(|e| describe("cuInit (no usable NVIDIA driver)", e))?;
    let n = result::device::get_count().map_err(|e| describe("cuDeviceGetCount", e))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

pub fn init(index: usize) -> Result<(Device, DeviceInfo), DeviceError> {
    let available = device_count().map_err(|m| init_err(index, m))?;
    if index >= available {
        return Err(DeviceError::NoSuchDevice { backend: Backend::Cuda, index, available });
    }
    let device =
        Device::new_cuda(index).map_err(|e| init_err(index, format!("creating the context: {e}")))?;
    single_stream(&device);
    let ctx = context(&device).ok_or_else(|| init_err(index, "candle returned a non-CUDA device".into()))?;
    let name = ctx.name().map_err(|e| init_err(index, describe("cuDeviceGetName", e)))?;
    let (free, total) = ctx.mem_get_info().map_err(|e| init_err(index, describe("cuMemGetInfo", e)))?;
    let (major, minor) =
        ctx.compute_capability().map_err(|e| init_err(index, describe("cuDeviceGetAttribute", e)))?;
    let info = DeviceInfo {
        backend: Backend::Cuda,
        index,
        name: format!("{name} (sm_{major}{minor})"),
        memory_total_bytes: Some(total as u64),
        memory_free_bytes: Some(free as u64),
        driver: driver_version(),
        threads: None,
    };
    crate::check::matmul_matches_cpu(Backend::Cuda, &device)
        .map_err(|m| init_err(index, format!("start-up check on {name}: {m}")))?;
    Ok((device, info))
}

/// candle runs everything a device does on one stream of its own, which puts cudarc in multi-stream mode: every
/// allocation then creates a CUDA event and every kernel launch records and waits on events for its arguments,
/// a few microseconds of driver calls per launch for ordering that one stream already guarantees. The worker never
/// uses a second stream, so the tracking is switched off before any tensor exists.
pub fn single_stream(device: &Device) {
    if let Device::Cuda(d) = device {
        // SAFETY: all work on this device goes through the single candle stream (the engine thread, and copies to
        // the host that synchronise it), so stream order alone orders every use and free of a buffer.
        unsafe { d.disable_event_tracking() };
    }
}

fn context(device: &Device) -> Option<std::sync::Arc<CudaContext>> {
    match device {
        Device::Cuda(d) => Some(d.cuda_stream().context().clone()),
        _ => None,
    }
}

/// `(total, free)` device memory now, for health and metrics; `None`s when the query fails.
pub fn memory(device: &Device) -> (Option<u64>, Option<u64>) {
    match context(device).map(|c| c.mem_get_info()) {
        Some(Ok((free, total))) => (Some(total as u64), Some(free as u64)),
        _ => (None, None),
    }
}

/// The CUDA version the driver supports, e.g. "CUDA 13.0" (the driver's own release number needs NVML).
fn driver_version() -> Option<String> {
    let mut v: std::ffi::c_int = 0;
    // SAFETY: cuDriverGetVersion writes one int through a valid pointer and needs no context.
    let r = unsafe { sys::cuDriverGetVersion(&mut v) };
    (r == sys::CUresult::CUDA_SUCCESS).then(|| format!("CUDA {}.{}", v / 1000, (v % 1000) / 10))
}
