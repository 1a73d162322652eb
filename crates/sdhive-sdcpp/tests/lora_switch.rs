//! LoRAs through stable-diffusion.cpp on the random SD1.5 (`common`): the random LoRA `cargo xtask random-model`
//! writes beside it changes the image, and the next job without it computes the plain image again, byte for
//! byte: the engine runs sd.cpp's LoRAs as per-call adapters, replaced by each call's set. Ignored by default
//! because it needs that 2 GB model; `cargo xtask vulkan` writes the model and runs it (and checks the LoRA image
//! itself against diffusers', on lavapipe).

mod common;

use sdhive_engine::{Control, Engine, GenerateRequest, LoraUse};

fn request(lora: Option<f32>) -> GenerateRequest {
    let loras: Vec<LoraUse> = lora
        .map(|w| LoraUse {
            name: "sd15_random_lora".into(),
            path: common::model_dir().join("Lora/sd15_random_lora.safetensors"),
            te: w,
            unet: w,
            hash: None,
        })
        .into_iter()
        .collect();
    let tag = lora.map(|w| format!(" <lora:sd15_random_lora:{w}>")).unwrap_or_default();
    GenerateRequest { loras, ..common::golden_request(format!("a red cube on a wooden table{tag}")) }
}

fn image(engine: &mut impl Engine, req: &GenerateRequest) -> Vec<u8> {
    let out = engine.generate(req, &mut |_| Control::Continue).unwrap_or_else(|e| panic!("{e}"));
    out.images.into_iter().next().expect("one image").image.data
}

fn mean_abs_diff(a: &[u8], b: &[u8]) -> f64 {
    a.iter().zip(b).map(|(x, y)| f64::from(x.abs_diff(*y))).sum::<f64>() / a.len() as f64
}

#[test]
#[ignore = "needs the random SD1.5 named by SDHIVE_SD15_RANDOM; cargo xtask vulkan runs it"]
fn a_lora_changes_the_image_and_the_next_job_without_it_is_plain_again() {
    let mut engine = common::engine();
    let plain = image(&mut engine, &request(None));
    let with_lora = image(&mut engine, &request(Some(0.8)));
    let moved = mean_abs_diff(&plain, &with_lora);
    // diffusers' images with and without this LoRA differ by 34 levels on average.
    assert!(moved > 5.0, "the LoRA moved the image by only {moved:.2} levels on average: was it applied?");
    let after = image(&mut engine, &request(None));
    assert!(after == plain, "the image after a LoRA job differs from the plain one: the LoRA stayed merged");
}
