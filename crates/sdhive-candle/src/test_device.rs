//! Where the parity tests run: the CPU in f32 unless `SDHIVE_TEST_DEVICE` (`cpu`, `cuda`, `cuda:N`) and
//! `SDHIVE_TEST_DTYPE` (`f32`, `f16`, `bf16`) say otherwise, so the same test binary, built with the `cuda`
//! feature, checks a GPU against the committed diffusers goldens. Half precision gets its own tolerances.

use candle_core::{DType, Device};
use std::sync::OnceLock;

/// How far a run may drift from diffusers' f32 CPU goldens.
#[derive(Debug, Clone, Copy)]
pub struct Tolerance {
    /// Final latents: max |ours − diffusers| over max |diffusers| (at least 1).
    pub latent_rel: f32,
    /// 8-bit images: the fraction of channel values allowed to differ by more than one level.
    pub pixels_off: f32,
    /// Text conditioning: max abs diff (f32), or relative to the embedding's magnitude (half precision).
    pub text: f32,
}

pub struct TestDevice {
    pub device: Device,
    pub dtype: DType,
    pub tolerance: Tolerance,
    pub label: String,
}

/// The chosen device, opened once per test process (a CUDA context is costly and tests run in parallel).
pub fn test_device() -> &'static TestDevice {
    static DEVICE: OnceLock<TestDevice> = OnceLock::new();
    DEVICE.get_or_init(|| {
        let spec = std::env::var("SDHIVE_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
        let dtype = match std::env::var("SDHIVE_TEST_DTYPE").as_deref() {
            Err(_) | Ok("f32") => DType::F32,
            Ok("f16") => DType::F16,
            Ok("bf16") => DType::BF16,
            Ok(other) => panic!("SDHIVE_TEST_DTYPE={other}: expected f32, f16 or bf16"),
        };
        let device = open(&spec);
        // Half precision: about twice the worst case measured on an H100 over the 24 pipeline cases (f16: latents
        // 5.0e-3, 0.3% of channel values off by more than one level, text 2.0e-3; bf16: 3.5e-2, 31%, 1.7e-2;
        // docs/gpu.md). bf16 keeps 8 mantissa bits, so its images drift visibly on these random tiny models.
        let tolerance = match dtype {
            DType::F16 => Tolerance { latent_rel: 1e-2, pixels_off: 0.01, text: 5e-3 },
            DType::BF16 => Tolerance { latent_rel: 7e-2, pixels_off: 0.45, text: 3e-2 },
            _ => Tolerance { latent_rel: 1e-4, pixels_off: 0.01, text: 1e-4 },
        };
        let label = format!("{spec} {dtype:?}");
        eprintln!("parity tests on {label}, tolerance {tolerance:?}");
        TestDevice { device, dtype, tolerance, label }
    })
}

fn open(spec: &str) -> Device {
    let spec = spec.trim().to_ascii_lowercase();
    if spec == "cpu" {
        return Device::Cpu;
    }
    let index = match spec.strip_prefix("cuda") {
        Some("") => 0,
        Some(rest) => rest
            .strip_prefix(':')
            .and_then(|i| i.parse().ok())
            .unwrap_or_else(|| panic!("SDHIVE_TEST_DEVICE={spec}: expected cpu, cuda or cuda:N")),
        None => panic!("SDHIVE_TEST_DEVICE={spec}: expected cpu, cuda or cuda:N"),
    };
    // Without the `cuda` feature candle reports that it was not compiled in, which is the message wanted here.
    let device = Device::new_cuda(index).unwrap_or_else(|e| panic!("SDHIVE_TEST_DEVICE={spec}: {e}"));
    // As the workers do (shared-worker's `cuda::single_stream`): one stream, so no per-launch event tracking.
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = &device {
        // SAFETY: the tests use only the device's own stream.
        unsafe { d.disable_event_tracking() };
    }
    device
}
