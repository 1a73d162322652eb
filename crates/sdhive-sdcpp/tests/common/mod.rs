//! The engine the ignored tests share: the full-size SD1.5 with deterministic random weights (written by `cargo
//! xtask random-model`; its folder in `SDHIVE_SD15_RANDOM`) at f16, on ggml's CPU backend so that any machine can
//! run it, or on the ggml device `SDHIVE_STOP_TEST_DEVICE` names (`Vulkan0` in a build with the `vulkan` feature,
//! on a GPU: docs/gpu.md); and the golden cases of that model (diffusers' images, xtask/fixtures/gen_sd15_random.py)
//! with the image comparison `cargo xtask vulkan` uses.

// Each test binary includes this module and uses part of it.
#![allow(dead_code)]

use sdhive_engine::{Control, Engine, GenerateRequest, Placement, RgbImage, Sampler};
use sdhive_modelsource::{ModelLocation, ResolvedModel};
use sdhive_sdcpp::{LoadOptions, SdCppEngine, WeightType};
use std::path::{Path, PathBuf};

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
    SdCppEngine::load(&model, load_options()).unwrap_or_else(|e| panic!("cannot load {}: {e}", dir.display()))
}

/// f16 weights on the test's ggml device (see the module doc); sets up logging.
pub fn load_options() -> LoadOptions {
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
    LoadOptions {
        backend_name: device.to_lowercase(),
        device_name: device.to_lowercase(),
        ggml_device: device,
        weight_type: Some(WeightType::F16),
        placement: Placement::default(),
        threads: None,
        memory_budget: None,
        no_t5: false,
    }
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

/// The golden case `tests/fixtures/golden/<name>.json` as written.
pub fn golden_json(name: &str) -> serde_json::Value {
    golden_json_in(&golden_dir(), name)
}

fn golden_json_in(dir: &Path, name: &str) -> serde_json::Value {
    let path = dir.join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("golden case JSON")
}

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden")
}

/// The golden case `tests/fixtures/golden/<name>.{json,png}` (written by xtask/fixtures/gen_sd15_random.py or
/// gen_sd35m_random.py) as a request, and diffusers' image for it.
pub fn golden_case(name: &str) -> (GenerateRequest, RgbImage) {
    golden_case_in(&golden_dir(), name)
}

/// The golden case `<dir>/<name>.{json,png}` as a request, and diffusers' image for it.
pub fn golden_case_in(dir: &Path, name: &str) -> (GenerateRequest, RgbImage) {
    let case = golden_json_in(dir, name);
    let num = |k: &str| case[k].as_f64().unwrap_or_else(|| panic!("golden case {name} lacks {k}"));
    assert_eq!(case["sampler"], "Euler", "{name}");
    let req = GenerateRequest {
        prompt: case["prompt"].as_str().expect("prompt").into(),
        negative_prompt: case["negative_prompt"].as_str().expect("negative_prompt").into(),
        steps: num("steps") as u32,
        cfg_scale: num("cfg_scale") as f32,
        width: Some(num("width") as u32),
        height: Some(num("height") as u32),
        seed: Some(num("seed") as u64),
        sampler: Sampler::Euler,
        ..GenerateRequest::default()
    };
    let png = std::fs::read(dir.join(format!("{name}.png"))).expect("golden image");
    (req, sdhive_engine::decode_image(&png, 1 << 20).expect("golden PNG"))
}

/// The one image of `req`.
pub fn image(engine: &mut dyn Engine, req: &GenerateRequest) -> RgbImage {
    let out = engine.generate(req, &mut |_| Control::Continue).unwrap_or_else(|e| panic!("{e}"));
    out.images.into_iter().next().expect("one image").image
}

/// How far apart two images are, in 8-bit levels, as `cargo xtask vulkan` measures it.
#[derive(Debug)]
pub struct Comparison {
    pub mean_abs: f64,
    pub max_abs: u8,
    pub psnr_db: f64,
}

pub fn compare(a: &RgbImage, b: &RgbImage) -> Comparison {
    assert_eq!((a.width, a.height), (b.width, b.height), "image sizes differ");
    let n = a.data.len() as f64;
    let diffs: Vec<u8> = a.data.iter().zip(&b.data).map(|(x, y)| x.abs_diff(*y)).collect();
    let mse = diffs.iter().map(|d| f64::from(*d).powi(2)).sum::<f64>() / n;
    Comparison {
        mean_abs: diffs.iter().map(|d| f64::from(*d)).sum::<f64>() / n,
        max_abs: diffs.iter().copied().max().unwrap_or(0),
        psnr_db: if mse == 0.0 { f64::INFINITY } else { 10.0 * (255.0f64.powi(2) / mse).log10() },
    }
}

/// An RRDBNet ×4 of the size sd.cpp's ESRGAN runs (64 features, 32 growth channels; one block to stay small) in
/// BasicSR's key layout, with deterministic small weights, written to `path`.
pub fn write_esrgan(path: &std::path::Path) {
    let mut shapes: Vec<(String, Vec<usize>)> = vec![("conv_first".into(), vec![64, 3, 3, 3])];
    for rdb in 1..=3 {
        for (i, cin) in [64, 96, 128, 160, 192].into_iter().enumerate() {
            let cout = if i == 4 { 64 } else { 32 };
            shapes.push((format!("body.0.rdb{rdb}.conv{}", i + 1), vec![cout, cin, 3, 3]));
        }
    }
    for name in ["conv_body", "conv_up1", "conv_up2", "conv_hr"] {
        shapes.push((name.into(), vec![64, 64, 3, 3]));
    }
    shapes.push(("conv_last".into(), vec![3, 64, 3, 3]));
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut state = 12345u64;
    for (name, shape) in shapes {
        let n: usize = shape.iter().product();
        let weights: Vec<u8> = (0..n)
            .flat_map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let v = ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1;
                v.to_le_bytes()
            })
            .collect();
        data.push((format!("{name}.bias"), vec![shape[0]], vec![0u8; shape[0] * 4]));
        data.push((format!("{name}.weight"), shape, weights));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(n, s, d)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("writing the ESRGAN file");
}
