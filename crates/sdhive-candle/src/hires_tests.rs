//! Hires-fix parity with diffusers composed as `xtask/fixtures/gen_hires.py` documents (first pass to latents,
//! the upscaler, img2img at the new size with the seed's generator): every case of `golden/hires.json` runs
//! through the engine's `generate` on the tiny fixture models and must give diffusers' 8-bit image within one
//! level on 99% of the channel values (half precision: `test_device`'s tolerance).

use crate::engine::{CandleEngine, LoadOptions};
use crate::model::SdModel;
use crate::parity_tests::fixtures;
use crate::test_device::test_device;
use sdhive_engine::{
    decode_image, Control, Engine, GenerateRequest, HiresFix, HiresUpscaler, Sampler, Schedule,
};
use serde_json::Value;
use std::collections::HashMap;

fn request(case: &Value) -> GenerateRequest {
    let s = |k: &str| case[k].as_str().map(str::to_string);
    let n = |k: &str| case[k].as_f64();
    let sampler = |k: &str| s(k).map(|name| Sampler::parse(&name).expect("fixture sampler").0);
    let upscaler_name = s("hr_upscaler").expect("hr_upscaler");
    let upscaler = HiresUpscaler::builtin(&upscaler_name).unwrap_or_else(|| HiresUpscaler::Model {
        path: fixtures().join("upscalers/models").join(format!("{upscaler_name}.safetensors")),
        name: upscaler_name,
    });
    GenerateRequest {
        prompt: s("prompt").expect("prompt"),
        negative_prompt: s("negative_prompt").unwrap_or_default(),
        steps: n("steps").expect("steps") as u32,
        cfg_scale: n("cfg_scale").expect("cfg") as f32,
        width: Some(n("width").expect("width") as u32),
        height: Some(n("height").expect("height") as u32),
        seed: Some(n("seed").expect("seed") as u64),
        sampler: sampler("sampler").expect("sampler"),
        schedule: Schedule::Automatic,
        hires: Some(HiresFix {
            upscaler,
            scale: n("hr_scale").expect("hr_scale") as f32,
            resize_x: n("hr_resize_x").unwrap_or(0.0) as u32,
            resize_y: n("hr_resize_y").unwrap_or(0.0) as u32,
            steps: n("hr_second_pass_steps").unwrap_or(0.0) as u32,
            denoising_strength: n("denoising_strength").expect("denoise") as f32,
            sampler: sampler("hr_sampler_name"),
            schedule: None,
            prompt: s("hr_prompt"),
            negative_prompt: s("hr_negative_prompt"),
            cfg_scale: n("hr_cfg").map(|v| v as f32),
        }),
        ..Default::default()
    }
}

#[test]
fn every_hires_case_matches_diffusers_composed() {
    let (dev, dtype) = (&test_device().device, test_device().dtype);
    let cases: Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("golden/hires.json")).expect("golden/hires.json"),
    )
    .expect("hires.json");
    let cases = cases.as_array().expect("a list of cases");
    assert!(cases.len() >= 15, "expected every hires case, found {}", cases.len());
    let mut engines: HashMap<String, CandleEngine> = HashMap::new();
    let mut failures = Vec::new();
    for case in cases {
        let name = case["case"].as_str().unwrap_or("?");
        let model = case["model"].as_str().expect("model").to_string();
        let engine = engines.entry(model.clone()).or_insert_with(|| {
            let m = SdModel::from_diffusers_dir(&model, &fixtures().join("models").join(&model), dev, dtype)
                .unwrap_or_else(|e| panic!("loading fixture model {model}: {e}"));
            CandleEngine::from_model(m, LoadOptions::single_device(dev, dtype, "test", "test"))
        });
        let req = request(case);
        let mut steps = Vec::new();
        let out = engine
            .generate(&req, &mut |p| {
                steps.push((p.step, p.steps));
                Control::Continue
            })
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let ours = &out.images[0].image;
        let png =
            std::fs::read(fixtures().join("golden").join(case["file"].as_str().expect("file"))).unwrap();
        let want = decode_image(&png, 1 << 24).unwrap();
        assert_eq!((ours.width, ours.height), (want.width, want.height), "{name}: size");
        let off = ours.data.iter().zip(&want.data).filter(|(a, b)| a.abs_diff(**b) > 1).count();
        let max = ours.data.iter().zip(&want.data).map(|(a, b)| a.abs_diff(*b)).max().unwrap_or(0);
        eprintln!("{name:24} pixels off by >1: {off}/{}  max level diff {max}", want.data.len());
        if off as f32 > test_device().tolerance.pixels_off * want.data.len() as f32 {
            failures.push(name.to_string());
        }
        // Progress counts both passes as one run of steps, ending at its total.
        let total = steps.last().map(|s| s.1).unwrap_or(0);
        assert!(
            steps.iter().enumerate().all(|(i, s)| *s == (i as u32 + 1, total)),
            "{name}: steps {steps:?}"
        );
        assert!(out.images[0].infotext.contains("Hires upscaler: "), "{name}: infotext");
    }
    assert!(failures.is_empty(), "hires cases off diffusers on {}: {failures:?}", test_device().label);
}
