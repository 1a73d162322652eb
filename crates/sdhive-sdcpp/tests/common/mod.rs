//! The engine the ignored tests share: the full-size SD1.5 with deterministic random weights (written by `cargo
//! xtask random-model`; its folder in `SDHIVE_SD15_RANDOM`) at f16, on ggml's CPU backend so that any machine can
//! run it, or on the ggml device `SDHIVE_STOP_TEST_DEVICE` names (`Vulkan0` in a build with the `vulkan` feature,
//! on a GPU: docs/gpu.md).

use sdhive_engine::{GenerateRequest, Placement, Sampler};
use sdhive_modelsource::{ModelLocation, ResolvedModel};
use sdhive_sdcpp::{LoadOptions, SdCppEngine, WeightType};
use std::path::PathBuf;

/// The random SD1.5's folder.
pub fn model_dir() -> PathBuf {
    std::env::var_os("SDHIVE_SD15_RANDOM")
        .map(PathBuf::from)
        .expect("SDHIVE_SD15_RANDOM must name the folder `cargo xtask random-model` writes")
}

pub fn engine() -> SdCppEngine {
    let dir = model_dir();
    let model = ResolvedModel {
        name: "sd15-random".into(),
        location: ModelLocation::DiffusersDir(dir.clone()),
        vae: None,
    };
    // stable-diffusion.cpp's own log (why a load failed, which device it took) at RUST_LOG=sdcpp=info.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let device = match std::env::var("SDHIVE_STOP_TEST_DEVICE") {
        Ok(wanted) => {
            let found = sdhive_sdcpp::device::find(&wanted).unwrap_or_else(|| {
                panic!("no ggml device {wanted}; ggml found {:?}", sdhive_sdcpp::device::list())
            });
            eprintln!("stop test on ggml device {} ({})", found.name, found.description);
            found.name
        }
        Err(_) => "CPU".into(),
    };
    let opts = LoadOptions {
        backend_name: device.to_lowercase(),
        device_name: device.to_lowercase(),
        ggml_device: device,
        weight_type: Some(WeightType::F16),
        placement: Placement::default(),
        threads: None,
        memory_budget: None,
    };
    SdCppEngine::load(&model, opts).unwrap_or_else(|e| panic!("cannot load {}: {e}", dir.display()))
}

/// The golden case `tests/fixtures/golden/sd15_random_euler.json` as a request: 64², 4 Euler steps, seed 42.
pub fn golden_request(prompt: String) -> GenerateRequest {
    GenerateRequest {
        prompt,
        steps: 4,
        cfg_scale: 7.0,
        width: Some(64),
        height: Some(64),
        seed: Some(42),
        sampler: Sampler::Euler,
        ..GenerateRequest::default()
    }
}
