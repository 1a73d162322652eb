//! The second engine: stable-diffusion.cpp (ggml) through `diffusion-rs-sys`, for the backends candle cannot
//! drive (Vulkan, ROCm). It implements the same [`sdhive_engine::Engine`] as the candle engine, so the serving
//! layers never know which one they talk to; what it cannot do the same way is stated in [`SdCppEngine::info`]
//! and in docs/api.md.

mod callbacks;
mod convert;
pub mod device;
mod engine;
mod model_info;
mod networks;
mod params;
pub mod sd3;
mod upscale;

pub use convert::{convert_to_gguf, ConvertError, GgufType};
pub use device::{GgmlDevice, GgmlDeviceError};
pub use engine::{LoadError, LoadOptions, SdCppEngine, WeightType};
pub use model_info::{GgufWeights, ModelInfo};
pub use params::{Placement, PlacementError};

/// stable-diffusion.cpp's version string, e.g. `master-… (commit)`.
pub fn sdcpp_version() -> String {
    // SAFETY: both return pointers to static NUL-terminated strings.
    let (version, commit) = unsafe {
        (
            std::ffi::CStr::from_ptr(diffusion_rs_sys::sd_version()),
            std::ffi::CStr::from_ptr(diffusion_rs_sys::sd_commit()),
        )
    };
    format!("{} ({})", version.to_string_lossy(), commit.to_string_lossy())
}
