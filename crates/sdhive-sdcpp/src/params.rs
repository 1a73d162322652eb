//! Our request vocabulary in stable-diffusion.cpp's terms: A1111 sampler and schedule names to sd.cpp's sample
//! methods and schedulers, and a [`Placement`] to sd.cpp's backend assignment strings (where each module runs,
//! and where its weights are kept).

use diffusion_rs_sys as sys;
use sdhive_engine::{DeviceRef, Module, Sampler, Schedule};
pub use sdhive_engine::{Placement, PlacementError};

/// The samplers this engine runs, in A1111 names. PNDM has no counterpart in sd.cpp (its iPNDM is another
/// algorithm), so it is not offered rather than approximated.
pub const SAMPLERS: [Sampler; 5] =
    [Sampler::Euler, Sampler::EulerA, Sampler::Ddim, Sampler::DpmPp2M, Sampler::Lcm];

/// sd.cpp's sample method for `sampler`, or `None` where it has none.
pub fn sample_method(sampler: Sampler) -> Option<sys::sample_method_t> {
    use sys::sample_method_t as M;
    Some(match sampler {
        Sampler::Euler => M::EULER_SAMPLE_METHOD,
        Sampler::EulerA => M::EULER_A_SAMPLE_METHOD,
        // sd.cpp's DDIM spaces its timesteps "trailing"; diffusers' DDIM for SD1.5 configs uses "leading", so
        // the two differ step for step although both are DDIM (docs/api.md says so).
        Sampler::Ddim => M::DDIM_TRAILING_SAMPLE_METHOD,
        Sampler::DpmPp2M => M::DPMPP2M_SAMPLE_METHOD,
        Sampler::Lcm => M::LCM_SAMPLE_METHOD,
        Sampler::Pndm => return None,
    })
}

/// `Automatic` is the sampler's default in sd.cpp (its discrete schedule for SD models), like diffusers' use of
/// the model's scheduler config; Karras maps to Karras.
pub fn scheduler(schedule: Schedule, automatic: sys::scheduler_t) -> sys::scheduler_t {
    match schedule {
        Schedule::Automatic => automatic,
        Schedule::Karras => sys::scheduler_t::KARRAS_SCHEDULER,
    }
}

/// ggml's device name for one of ours: `vulkan1` → `Vulkan1`, `rocm0` → `ROCm0`, `cuda0` → `CUDA0`, `cpu` →
/// `CPU`. `None` for backends ggml has no device for in any build.
pub fn ggml_device_name(device: &DeviceRef) -> Option<String> {
    let prefix = match device.backend.as_str() {
        "cpu" => return Some("CPU".into()),
        "vulkan" => "Vulkan",
        "rocm" => "ROCm",
        "cuda" => "CUDA",
        "metal" => "Metal",
        _ => return None,
    };
    Some(format!("{prefix}{}", device.index))
}

/// The two assignment strings sd.cpp takes: `backend` (where each module computes; the worker's own device
/// for every module not placed elsewhere) and `params_backend` (where weights live between uses: the CPU for
/// offloaded modules).
pub fn backend_specs(own_device: &str, placement: &Placement) -> Result<(String, String), PlacementError> {
    let mut runtime = vec![own_device.to_string()];
    for (module, device) in &placement.devices {
        let name =
            ggml_device_name(device).ok_or_else(|| PlacementError::UnknownDevice(device.to_string()))?;
        runtime.push(format!("{}={name}", sdcpp_module(*module)));
    }
    let params: Vec<String> = placement.offload.iter().map(|m| format!("{}=CPU", sdcpp_module(*m))).collect();
    Ok((runtime.join(","), params.join(",")))
}

fn sdcpp_module(module: Module) -> &'static str {
    match module {
        Module::Diffusion => "diffusion",
        Module::TextEncoder => "te",
        Module::Vae => "vae",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_offered_sampler_maps_and_pndm_does_not() {
        for s in SAMPLERS {
            assert!(sample_method(s).is_some(), "{s:?}");
        }
        assert!(sample_method(Sampler::Pndm).is_none());
        let auto = sys::scheduler_t::DISCRETE_SCHEDULER;
        assert_eq!(scheduler(Schedule::Automatic, auto), auto);
        assert_eq!(scheduler(Schedule::Karras, auto), sys::scheduler_t::KARRAS_SCHEDULER);
    }

    #[test]
    fn placement_becomes_sdcpp_assignments() {
        let p = Placement::parse("te=cpu,unet=vulkan0", "vae").unwrap();
        let (runtime, params) = backend_specs("Vulkan0", &p).unwrap();
        assert_eq!(runtime, "Vulkan0,te=CPU,diffusion=Vulkan0");
        assert_eq!(params, "vae=CPU");
        let (runtime, params) = backend_specs("ROCm1", &Placement::default()).unwrap();
        assert_eq!((runtime.as_str(), params.as_str()), ("ROCm1", ""));
        let p = Placement::parse("vae=rocm2", "").unwrap();
        assert_eq!(backend_specs("ROCm0", &p).unwrap().0, "ROCm0,vae=ROCm2");
    }
}
