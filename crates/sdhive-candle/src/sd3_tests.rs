//! SD3 parity with diffusers' `StableDiffusion3Pipeline` (goldens of `xtask/fixtures/gen_sd3.py`): SD3-medium,
//! SD3.5-medium (MMDiT-X) and SD3.5-large (qk RMSNorm) from their diffusers folders — the seed's noise, the final
//! latents and the 8-bit image. On the CPU in f32 by default; `SDHIVE_TEST_DEVICE` / `SDHIVE_TEST_DTYPE` run the
//! same cases on a GPU in half precision against the same f32 goldens, with that dtype's tolerances.

use crate::parity_tests::fixtures;
use crate::sd3::{Sd3Model, Sd3Request};
use crate::test_device::test_device;
use candle_core::{DType, Device, Tensor};

fn max_abs(t: &Tensor) -> f32 {
    t.abs().and_then(|t| t.flatten_all()?.max(0)?.to_scalar::<f32>()).expect("max")
}

fn case(model: &str) {
    let dev = test_device();
    let golden = fixtures().join(format!("golden/sd3_pipe_{model}.safetensors"));
    let g = candle_core::safetensors::load(&golden, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e} (run xtask/fixtures/gen_sd3.py)", golden.display()));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("golden/sd3.json")).expect("sd3.json"))
            .expect("sd3.json is JSON");
    let p = &json["pipeline"];
    let number = |key: &str| p[key].as_u64().unwrap_or_else(|| panic!("pipeline.{key}")) as usize;
    let prompt = json["goldens"][format!("sd3_pipe_{model}.safetensors")]["prompt"].as_str().expect("prompt");
    let sd3 = Sd3Model::from_dir(&fixtures().join("models").join(model), dev.dtype, &dev.device, true)
        .unwrap_or_else(|e| panic!("{model}: {e}"));
    let req = Sd3Request {
        prompt: prompt.into(),
        negative_prompt: p["negative_prompt"].as_str().expect("negative_prompt").into(),
        width: number("width"),
        height: number("height"),
        steps: number("num_inference_steps"),
        guidance_scale: p["guidance_scale"].as_f64().expect("guidance_scale"),
        seed: p["seed"].as_u64().expect("seed"),
        max_sequence_length: number("max_sequence_length"),
        init_image: None,
        strength: 0.75,
    };
    let out = sd3.generate(&req).unwrap_or_else(|e| panic!("{model}: {e}"));
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).and_then(|t| t.to_dtype(DType::F32)).expect("to cpu");
    let noise = (cpu(&out.noise) - &g["noise"]).expect("noise diff");
    assert_eq!(max_abs(&noise), 0.0, "{model}: the seed's noise");
    let want = &g["latents"];
    let rel = max_abs(&(cpu(&out.latents) - want).expect("latent diff")) / max_abs(want).max(1.0);
    let want_u8: Vec<u8> = g["image_u8"].flatten_all().and_then(|t| t.to_vec1()).expect("image_u8");
    assert_eq!(out.image.data.len(), want_u8.len());
    let off = out.image.data.iter().zip(&want_u8).filter(|(a, b)| a.abs_diff(**b) > 1).count();
    let worst = out.image.data.iter().zip(&want_u8).map(|(a, b)| a.abs_diff(*b)).max().unwrap_or(0);
    eprintln!(
        "{model} on {}: final latents rel {rel:.3e}, {off} values off by > 1 level, worst {worst}",
        dev.label
    );
    let tol = dev.tolerance;
    assert!(rel <= tol.latent_rel, "{model}: final latents differ by {rel} (tolerance {})", tol.latent_rel);
    assert!(
        off as f32 <= tol.pixels_off * want_u8.len() as f32,
        "{model}: {off} of {} image values off by more than one level",
        want_u8.len()
    );
}

#[test]
fn sd3_medium() {
    case("sd3");
}

#[test]
fn sd35_medium_dual_attention() {
    case("sd35m");
}

#[test]
fn sd35_large_qk_norm() {
    case("sd35l");
}

/// diffusers' `encode_prompt` (T5 at 32 tokens, as the text goldens): the joint context and pooled embedding
/// for each golden prompt, with T5 and with it left out (zeros in its place).
#[test]
fn the_joint_context_is_encode_prompts_with_and_without_t5() {
    let dev = test_device();
    let g = candle_core::safetensors::load(fixtures().join("golden/sd3_text.safetensors"), &Device::Cpu)
        .expect("golden/sd3_text.safetensors");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("golden/sd3.json")).expect("sd3.json"))
            .expect("sd3.json is JSON");
    let seq = json["max_sequence_length"].as_u64().expect("max_sequence_length") as usize;
    let prompts: Vec<&str> =
        json["prompts"].as_array().expect("prompts").iter().map(|p| p.as_str().expect("prompt")).collect();
    let dir = fixtures().join("models/sd3");
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).and_then(|t| t.to_dtype(DType::F32)).expect("to cpu");
    let tol = dev.tolerance.text;
    for with_t5 in [true, false] {
        let sd3 = Sd3Model::from_dir(&dir, dev.dtype, &dev.device, with_t5).expect("sd3 folder");
        assert_eq!(sd3.t5.is_some(), with_t5);
        for (i, prompt) in prompts.iter().enumerate() {
            let (context, pooled) =
                sd3.encode_prompt(prompt, seq).unwrap_or_else(|e| panic!("{prompt:?}: {e}"));
            let key = if with_t5 { format!("prompt_embeds_{i}") } else { format!("prompt_embeds_not5_{i}") };
            let want = &g[&key];
            assert_eq!(context.dims(), want.dims(), "{key}");
            let scale = max_abs(want).max(1.0);
            let d = max_abs(&(cpu(&context) - want).expect("diff")) / scale;
            // Relative to the embedding's magnitude (at least 1), as the SD1/SDXL text parity measures it.
            let want_pooled = &g[&format!("pooled_{i}")];
            let p = max_abs(&(cpu(&pooled) - want_pooled).expect("diff")) / max_abs(want_pooled).max(1.0);
            eprintln!("{key}: context {d:.3e}, pooled {p:.3e}");
            assert!(d <= tol && p <= tol, "{key}: context off by {d}, pooled by {p} (tolerance {tol})");
        }
    }
}

/// diffusers' `StableDiffusion3Img2ImgPipeline` on the fixture init image: the VAE's sample and the noise from one
/// generator in the pipeline's order, the schedule started at `int(n − n·strength)`.
#[test]
fn sd3_img2img() {
    let dev = test_device();
    let g =
        candle_core::safetensors::load(fixtures().join("golden/sd3_img2img_sd3.safetensors"), &Device::Cpu)
            .expect("golden/sd3_img2img_sd3.safetensors (run xtask/fixtures/gen_sd3.py)");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("golden/sd3.json")).expect("sd3.json"))
            .expect("sd3.json is JSON");
    let case = &json["goldens"]["sd3_img2img_sd3.safetensors"];
    let png = std::fs::read(fixtures().join("images/init.png")).expect("init.png");
    let init = sdhive_engine::decode_image(&png, 1 << 20).expect("init.png decodes");
    let sd3 = Sd3Model::from_dir(&fixtures().join("models/sd3"), dev.dtype, &dev.device, true).expect("sd3");
    let req = Sd3Request {
        prompt: case["prompt"].as_str().expect("prompt").into(),
        negative_prompt: json["pipeline"]["negative_prompt"].as_str().expect("negative").into(),
        width: 64,
        height: 64,
        steps: case["num_inference_steps"].as_u64().expect("steps") as usize,
        guidance_scale: json["pipeline"]["guidance_scale"].as_f64().expect("guidance"),
        seed: json["pipeline"]["seed"].as_u64().expect("seed"),
        max_sequence_length: json["pipeline"]["max_sequence_length"].as_u64().expect("length") as usize,
        init_image: Some(init),
        strength: case["strength"].as_f64().expect("strength"),
    };
    let mut reported = Vec::new();
    let out = sd3.generate_with(&req, &mut |step, steps| {
        reported.push((step, steps));
        true
    });
    let out = out.expect("img2img");
    assert_eq!(reported, [(1, 3), (2, 3), (3, 3)], "strength 0.6 of 4 steps runs the last 3");
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).and_then(|t| t.to_dtype(DType::F32)).expect("to cpu");
    let want = &g["latents"];
    let rel = max_abs(&(cpu(&out.latents) - want).expect("diff")) / max_abs(want).max(1.0);
    let want_u8: Vec<u8> = g["image_u8"].flatten_all().and_then(|t| t.to_vec1()).expect("image_u8");
    let off = out.image.data.iter().zip(&want_u8).filter(|(a, b)| a.abs_diff(**b) > 1).count();
    eprintln!("sd3 img2img on {}: final latents rel {rel:.3e}, {off} values off by > 1 level", dev.label);
    let tol = dev.tolerance;
    assert!(rel <= tol.latent_rel, "img2img latents differ by {rel}");
    assert!(
        off as f32 <= tol.pixels_off * want_u8.len() as f32,
        "{off} image values off by more than one level"
    );
    for strength in [0.0, 1.5] {
        let bad = Sd3Request { strength, ..req.clone() };
        let e = sd3.generate(&bad).err().expect("no step to run, or out of range").to_string();
        assert!(e.contains("denoising_strength"), "{strength}: {e}");
    }
}
