//! SD3 from a single file and through its public API, on the tiny random models of `xtask/fixtures/gen_sd3.py`
//! (float32, CPU): the SAI-layout file generates exactly what its diffusers folder does (the f16 SD3.5 file
//! within f16 rounding), and bad requests are refused naming the field. Parity of the folders with diffusers'
//! `StableDiffusion3Pipeline` is the library's `sd3_tests` (which also run on a GPU).

use candle_core::{DType, Device, Tensor};
use sdhive_candle::{Sd3Model, Sd3Request};
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    match std::env::var_os("SDHIVE_FIXTURES") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

fn max_diff(ours: &Tensor, want: &Tensor) -> f32 {
    assert_eq!(ours.dims(), want.dims());
    (ours.to_dtype(DType::F32).unwrap() - want.to_dtype(DType::F32).unwrap())
        .and_then(|t| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
        .unwrap()
}

#[test]
fn bad_sizes_and_steps_are_refused_naming_the_field() {
    let sd3 = Sd3Model::from_dir(&fixtures().join("models/sd3"), DType::F32, &Device::Cpu, false).unwrap();
    let mut req = Sd3Request::new("x", 1);
    req.width = 72;
    let e = sd3.generate(&req).err().expect("72 is not a multiple of 16").to_string();
    assert!(e.contains("`width`"), "{e}");
    let mut req = Sd3Request::new("x", 1);
    req.steps = 0;
    let e = sd3.generate(&req).err().expect("no steps").to_string();
    assert!(e.contains("`steps`"), "{e}");
}

/// A small request (2 steps, 64²) with guidance, for comparing two loads of one model.
fn small_request() -> Sd3Request {
    Sd3Request {
        negative_prompt: "blurry".into(),
        width: 64,
        height: 64,
        steps: 2,
        guidance_scale: 5.0,
        max_sequence_length: 32,
        ..Sd3Request::new("a red fox in the snow", 7)
    }
}

#[test]
fn sd3_single_file_generates_exactly_as_its_folder() {
    let models = fixtures().join("models");
    let folder = Sd3Model::from_dir(&models.join("sd3"), DType::F32, &Device::Cpu, true).unwrap();
    let file = Sd3Model::from_single_file(
        &models.join("sd3.safetensors"),
        Some(&models.join("sd3")),
        DType::F32,
        &Device::Cpu,
        true,
    )
    .unwrap_or_else(|e| panic!("sd3.safetensors: {e}"));
    let req = small_request();
    let (a, b) = (folder.generate(&req).unwrap(), file.generate(&req).unwrap());
    assert_eq!(max_diff(&a.latents, &b.latents), 0.0, "single file vs folder latents");
    assert_eq!(a.image.data, b.image.data);
    // T5 from the file counts: leaving it out changes the result.
    let no_t5 = Sd3Model::from_single_file(
        &models.join("sd3.safetensors"),
        Some(&models.join("sd3")),
        DType::F32,
        &Device::Cpu,
        false,
    )
    .unwrap();
    assert!(max_diff(&no_t5.generate(&req).unwrap().latents, &a.latents) > 1e-3);
}

#[test]
fn sd35m_f16_single_file_is_within_f16_rounding_of_its_folder() {
    let models = fixtures().join("models");
    let folder = Sd3Model::from_dir(&models.join("sd35m"), DType::F32, &Device::Cpu, true).unwrap();
    let file = Sd3Model::from_single_file(
        &models.join("sd35m.safetensors"),
        Some(&models.join("sd35m")),
        DType::F32,
        &Device::Cpu,
        true,
    )
    .unwrap_or_else(|e| panic!("sd35m.safetensors: {e}"));
    let req = small_request();
    let (a, b) = (folder.generate(&req).unwrap(), file.generate(&req).unwrap());
    let d = max_diff(&a.latents, &b.latents);
    let scale = max_diff(&a.latents, &a.latents.zeros_like().unwrap());
    eprintln!(
        "sd35m: single file (f16 weights) vs folder: latents max abs diff {d:.3e} (latents up to {scale:.2})"
    );
    // The transformer and VAE weights were rounded to f16 (relative 2^-11); the text encoders are the folder's.
    assert!(d > 0.0 && d <= 2e-3 * scale.max(1.0), "latents differ by {d}");

    let e =
        Sd3Model::from_single_file(&models.join("sd35m.safetensors"), None, DType::F32, &Device::Cpu, true)
            .err()
            .expect("no text encoders without a config folder")
            .to_string();
    assert!(e.contains("sd35m.safetensors") && e.contains("text_encoder_2"), "{e}");
}
