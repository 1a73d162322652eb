//! SD3 parity with diffusers' `StableDiffusion3Pipeline` (goldens of `xtask/fixtures/gen_sd3.py`): SD3-medium,
//! SD3.5-medium (MMDiT-X) and SD3.5-large (qk RMSNorm) from their diffusers folders — the seed's noise, the final
//! latents and the 8-bit image; DPM++ 2M on flow sigmas, skip-layer guidance, the turbo setting (no CFG) and
//! `StableDiffusion3InpaintPipeline`, also through the `Engine` with what it refuses. On the CPU in f32 by default; `SDHIVE_TEST_DEVICE` /
//! `SDHIVE_TEST_DTYPE` run the same cases on a GPU in half precision against the same f32 goldens, with that
//! dtype's tolerances.

use crate::parity_tests::fixtures;
use crate::sd3::{Sd3Model, Sd3Output, Sd3Request};
use crate::sd3_engine::Sd3Engine;
use crate::test_device::test_device;
use candle_core::{DType, Device, Tensor};
use sdhive_engine::{Control, Engine, EngineError, GenerateRequest, Sampler, Schedule, SkipLayerGuidance};
use sdhive_schedulers::FlowSampler;
use std::collections::HashMap;

pub(crate) fn max_abs(t: &Tensor) -> f32 {
    t.to_dtype(DType::F32).and_then(|t| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()).expect("max")
}

/// The SD3 model `model` of the fixtures on the test device.
pub(crate) fn load_model(model: &str) -> Sd3Model {
    let dev = test_device();
    Sd3Model::from_dir(&fixtures().join("models").join(model), dev.dtype, &dev.device, true)
        .unwrap_or_else(|e| panic!("{model}: {e}"))
}

/// The request of a golden file's `pipeline` settings (64², few steps, CFG, seed, negative prompt, T5 length).
pub(crate) fn pipeline_request(p: &serde_json::Value, prompt: &str) -> Sd3Request {
    let number = |key: &str| p[key].as_u64().unwrap_or_else(|| panic!("pipeline.{key}")) as usize;
    Sd3Request {
        prompt: prompt.into(),
        negative_prompt: p["negative_prompt"].as_str().expect("negative_prompt").into(),
        width: number("width"),
        height: number("height"),
        steps: number("num_inference_steps"),
        guidance_scale: p["guidance_scale"].as_f64().expect("guidance_scale"),
        max_sequence_length: number("max_sequence_length"),
        ..Sd3Request::new(prompt, p["seed"].as_u64().expect("seed"))
    }
}

fn case(model: &str) {
    let golden = fixtures().join(format!("golden/sd3_pipe_{model}.safetensors"));
    let g = candle_core::safetensors::load(&golden, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e} (run xtask/fixtures/gen_sd3.py)", golden.display()));
    let json = sd3_json();
    let prompt = json["goldens"][format!("sd3_pipe_{model}.safetensors")]["prompt"].as_str().expect("prompt");
    let sd3 = load_model(model);
    let req = pipeline_request(&json["pipeline"], prompt);
    let out = sd3.generate(&req).unwrap_or_else(|e| panic!("{model}: {e}"));
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).and_then(|t| t.to_dtype(DType::F32)).expect("to cpu");
    let noise = (cpu(&out.noise) - &g["noise"]).expect("noise diff");
    assert_eq!(max_abs(&noise), 0.0, "{model}: the seed's noise");
    assert_matches(model, &out, &g);
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
                sd3.encode_prompt(prompt, seq, 1).unwrap_or_else(|e| panic!("{prompt:?}: {e}"));
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

/// A1111's clip skip n as diffusers' `encode_prompt(clip_skip=n − 1)`: each CLIP's prompt states from an earlier
/// layer (3 reads the tiny CLIPs' embedding output), the pooled outputs unchanged; far from clip skip 1. A skip past
/// the embedding output is refused naming `clip_skip`.
#[test]
fn clip_skip_is_encode_prompts_clip_skip_minus_one() {
    let dev = test_device();
    let g = load_golden("sd3_text.safetensors");
    let json = sd3_json();
    let seq = json["max_sequence_length"].as_u64().expect("max_sequence_length") as usize;
    let prompts: Vec<&str> =
        json["prompts"].as_array().expect("prompts").iter().map(|p| p.as_str().expect("prompt")).collect();
    let skips: Vec<u32> = json["goldens"]["sd3_text.safetensors"]["a1111_clip_skips"]
        .as_array()
        .expect("a1111_clip_skips (run xtask/fixtures/gen_sd3.py --only text)")
        .iter()
        .map(|n| n.as_u64().expect("clip skip") as u32)
        .collect();
    assert_eq!(skips, [2, 3]);
    let sd3 = load_model("sd3");
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).and_then(|t| t.to_dtype(DType::F32)).expect("to cpu");
    let rel = |a: &Tensor, want: &Tensor| max_abs(&(cpu(a) - want).expect("diff")) / max_abs(want).max(1.0);
    let tol = dev.tolerance.text;
    for (i, prompt) in prompts.iter().enumerate() {
        let (plain, _) = sd3.encode_prompt(prompt, seq, 1).expect("clip skip 1");
        for &n in &skips {
            let key = format!("prompt_embeds_clipskip{n}_{i}");
            let (context, pooled) =
                sd3.encode_prompt(prompt, seq, n).unwrap_or_else(|e| panic!("{key}: {e}"));
            let d = rel(&context, &g[&key]);
            let p = rel(&pooled, &g[&format!("pooled_{i}")]);
            let apart = rel(&plain, &g[&key]);
            eprintln!("{key}: context {d:.3e}, pooled {p:.3e}, clip skip 1 is {apart:.3e} away");
            assert!(d <= tol && p <= tol, "{key}: context off by {d}, pooled by {p} (tolerance {tol})");
            assert!(apart > 5.0 * tol, "{key}: clip skip {n} is only {apart} from clip skip 1");
        }
    }
    for n in [0, 4] {
        match sd3.encode_prompt("x", seq, n) {
            Err(crate::sd3::Sd3Error::Invalid { field, message }) => {
                assert_eq!(field, "clip_skip", "{message}");
                assert!(message.contains("between 1 and 3"), "{message}");
            }
            other => panic!("clip skip {n} on 3-layer CLIPs: {:?}", other.map(|_| ())),
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
        mask: None,
        sampler: FlowSampler::Euler,
        skip_layer_guidance: None,
        clip_skip: 1,
    };
    let mut reported = Vec::new();
    let out = sd3.generate_with(&req, &mut |step, steps, _| {
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

fn sd3_json() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("golden/sd3.json")).expect("sd3.json"))
        .expect("sd3.json is JSON")
}

fn load_golden(file: &str) -> HashMap<String, Tensor> {
    let path = fixtures().join("golden").join(file);
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e} (run xtask/fixtures/gen_sd3.py)", path.display()))
}

/// A fixture image a golden names (`images/…`).
fn fixture_bytes(json: &serde_json::Value) -> Option<Vec<u8>> {
    let name = json.as_str()?;
    Some(std::fs::read(fixtures().join(name)).unwrap_or_else(|e| panic!("{name}: {e}")))
}

/// The request of a golden recorded with its `args` (the pipeline call's keyword arguments) and the fixture
/// images it names (`image`, `mask_image`).
fn golden_request(file: &str) -> Sd3Request {
    let json = sd3_json();
    let case = &json["goldens"][file];
    let a = &case["args"];
    let number = |key: &str| a[key].as_f64().unwrap_or_else(|| panic!("{file}: args.{key}"));
    let slg = a["skip_guidance_layers"].as_array().map(|layers| SkipLayerGuidance {
        layers: layers.iter().map(|l| l.as_u64().expect("layer") as usize).collect(),
        scale: number("skip_layer_guidance_scale"),
        start: number("skip_layer_guidance_start"),
        stop: number("skip_layer_guidance_stop"),
    });
    Sd3Request {
        prompt: case["prompt"].as_str().expect("prompt").into(),
        negative_prompt: a["negative_prompt"].as_str().expect("negative_prompt").into(),
        width: number("width") as usize,
        height: number("height") as usize,
        steps: number("num_inference_steps") as usize,
        guidance_scale: number("guidance_scale"),
        seed: number("seed") as u64,
        max_sequence_length: number("max_sequence_length") as usize,
        init_image: fixture_bytes(&case["image"])
            .map(|png| sdhive_engine::decode_image(&png, 1 << 20).expect("init image decodes")),
        strength: a["strength"].as_f64().unwrap_or(0.75),
        mask: fixture_bytes(&case["mask_image"])
            .map(|png| sdhive_engine::decode_mask(&png, 1 << 20).expect("mask decodes")),
        sampler: match case["sampler"].as_str() {
            Some("DPM++ 2M") => FlowSampler::DpmPp2M,
            _ => FlowSampler::Euler,
        },
        skip_layer_guidance: slg,
        // The pipeline's `clip_skip` is A1111's less one.
        clip_skip: a["clip_skip"].as_u64().map_or(1, |c| c as u32 + 1),
    }
}

/// The engine's request for a golden's pipeline call (prompts, steps, CFG, size, seed, skip-layer guidance).
fn engine_request(r: &Sd3Request) -> GenerateRequest {
    GenerateRequest {
        prompt: r.prompt.clone(),
        negative_prompt: r.negative_prompt.clone(),
        steps: r.steps as u32,
        cfg_scale: r.guidance_scale as f32,
        width: Some(r.width as u32),
        height: Some(r.height as u32),
        seed: Some(r.seed),
        skip_layer_guidance: r.skip_layer_guidance.clone(),
        clip_skip: r.clip_skip,
        ..Default::default()
    }
}

/// Final latents and 8-bit image against a golden, within the test device's tolerances.
fn assert_matches(label: &str, out: &Sd3Output, g: &HashMap<String, Tensor>) {
    let dev = test_device();
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).and_then(|t| t.to_dtype(DType::F32)).expect("to cpu");
    let want = &g["latents"];
    let abs = max_abs(&(cpu(&out.latents) - want).expect("latent diff"));
    let rel = abs / max_abs(want).max(1.0);
    let want_u8: Vec<u8> = g["image_u8"].flatten_all().and_then(|t| t.to_vec1()).expect("image_u8");
    assert_eq!(out.image.data.len(), want_u8.len(), "{label}: image size");
    let off = out.image.data.iter().zip(&want_u8).filter(|(a, b)| a.abs_diff(**b) > 1).count();
    let worst = out.image.data.iter().zip(&want_u8).map(|(a, b)| a.abs_diff(*b)).max().unwrap_or(0);
    eprintln!(
        "{label} on {}: final latents max abs {abs:.3e} (rel {rel:.3e}), {off} values off by > 1 level, worst {worst}",
        dev.label
    );
    let tol = dev.tolerance;
    assert!(rel <= tol.latent_rel, "{label}: final latents differ by {rel} (tolerance {})", tol.latent_rel);
    assert!(
        off as f32 <= tol.pixels_off * want_u8.len() as f32,
        "{label}: {off} of {} image values off by more than one level",
        want_u8.len()
    );
}

fn variant(model: &str, file: &str) -> (Sd3Model, Sd3Request, Sd3Output) {
    let dev = test_device();
    let sd3 = Sd3Model::from_dir(&fixtures().join("models").join(model), dev.dtype, &dev.device, true)
        .unwrap_or_else(|e| panic!("{model}: {e}"));
    let req = golden_request(file);
    let out = sd3.generate(&req).unwrap_or_else(|e| panic!("{file}: {e}"));
    assert_matches(file, &out, &load_golden(file));
    (sd3, req, out)
}

/// A standalone VAE file in place of the model's own (A1111's `sd_vae`) as diffusers' pipeline with
/// `vae=AutoencoderKL.from_single_file(file, config=<folder>, subfolder="vae")`, through the diffusers folder and
/// the SAI single file. An SD1 VAE (4 latent channels) is refused naming the file, and the model keeps its own.
#[test]
fn a_standalone_vae_replaces_the_models_own() {
    let dev = test_device();
    let file = "sd3_pipe_altvae_sd3.safetensors";
    let json = sd3_json();
    let entry = &json["goldens"][file];
    let vae = fixtures().join("models").join(entry["vae"].as_str().expect("vae"));
    let req = pipeline_request(&json["pipeline"], entry["prompt"].as_str().expect("prompt"));
    let target = crate::ModuleTarget {
        device: dev.device.clone(),
        dtype: dev.dtype,
        offload: false,
        host_copy: false,
    };
    let models = fixtures().join("models");
    let single = Sd3Model::from_single_file(
        &models.join("sd3.safetensors"),
        Some(&models.join("sd3")),
        dev.dtype,
        &dev.device,
        true,
    )
    .expect("sd3.safetensors");
    for (label, mut sd3) in [("folder", load_model("sd3")), ("single file", single)] {
        sd3.replace_vae(&vae, &target).unwrap_or_else(|e| panic!("{label}: {e}"));
        let out = sd3.generate(&req).unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_matches(&format!("{file} ({label})"), &out, &load_golden(file));
    }

    let mut sd3 = load_model("sd3");
    let sd1_vae = models.join("VAE/sd1-alt.safetensors");
    let err = sd3.replace_vae(&sd1_vae, &target).expect_err("an SD1 VAE").to_string();
    assert!(err.contains("sd1-alt.safetensors") && err.contains("4 latent channels"), "{err}");
    let out = sd3.generate(&req).expect("the model's own VAE");
    assert_matches("after the refusal", &out, &load_golden("sd3_pipe_sd3.safetensors"));
}

/// DPM++ 2M as `DPMSolverMultistepScheduler.from_config(pipe.scheduler.config, use_flow_sigmas=True,
/// prediction_type="flow_prediction", flow_shift=3.0)` swapped into the pipeline: 4 steps, so two of them are
/// second-order multistep updates.
#[test]
fn sd3_dpm_pp_2m() {
    let (_, req, _) = variant("sd3", "sd3_pipe_dpm_sd3.safetensors");
    assert_eq!((req.sampler, req.steps), (FlowSampler::DpmPp2M, 4));
}

/// Skip-layer guidance on SD3.5-medium as the pipeline's `skip_guidance_layers=[1]`, scale 2.8, window 0.01–0.5:
/// the extra pass runs at step 1 of 3 only, and it matters (without it the image is another).
#[test]
fn sd35_medium_skip_layer_guidance() {
    let (sd3, req, out) = variant("sd35m", "sd3_pipe_slg_sd35m.safetensors");
    let json = sd3_json();
    let steps: Vec<u64> = json["goldens"]["sd3_pipe_slg_sd35m.safetensors"]["slg_steps"]
        .as_array()
        .expect("slg_steps")
        .iter()
        .map(|v| v.as_u64().expect("step"))
        .collect();
    let g = req.skip_layer_guidance.clone().expect("slg");
    let ours: Vec<u64> = (0..req.steps).filter(|&i| g.active_at(i, req.steps)).map(|i| i as u64).collect();
    assert_eq!(ours, steps, "the steps that run the extra pass");
    let plain = sd3.generate(&Sd3Request { skip_layer_guidance: None, ..req }).expect("plain");
    let moved = max_abs(&(&plain.latents - &out.latents).expect("diff"));
    assert!(moved > 1e-2, "skip-layer guidance changed the latents by only {moved}");
}

/// `pipe(..., clip_skip=1)`, A1111's clip skip 2: the prompt's CLIP states one layer earlier, the negative
/// prompt's still the penultimate (the golden tells that apart from skipping both: `sd3.json` records how far);
/// through the engine too, whose infotext says `Clip skip: 2`.
#[test]
fn sd3_clip_skip_as_the_pipeline() {
    let file = "sd3_pipe_clipskip_sd3.safetensors";
    let (sd3, req, out) = variant("sd3", file);
    assert_eq!(req.clip_skip, 2);
    let plain = sd3.generate(&Sd3Request { clip_skip: 1, ..req.clone() }).expect("clip skip 1");
    let moved = max_abs(&(&plain.latents - &out.latents).expect("diff"));
    assert!(moved > 1e-2, "clip skip 2 changed the latents by only {moved}");
    drop(sd3);
    let mut engine = engine("sd3");
    let got = run(&mut engine, &GenerateRequest { sampler: Sampler::Euler, ..engine_request(&req) })
        .expect("engine with clip skip 2");
    let want: Vec<u8> = load_golden(file)["image_u8"].flatten_all().and_then(|t| t.to_vec1()).expect("u8");
    let image = &got.images[0].image.data;
    let off = image.iter().zip(&want).filter(|(a, b)| a.abs_diff(**b) > 1).count();
    let tol = test_device().tolerance;
    assert!(off as f32 <= tol.pixels_off * want.len() as f32, "engine: {off} values off by > 1 level");
    assert!(got.images[0].infotext.contains("Clip skip: 2"), "{}", got.images[0].infotext);
}

/// SD3.5-large-turbo's setting: guidance 0 and 4 steps runs one transformer call per step, without the negative
/// prompt; guidance 1 is the same run (CFG needs a scale above 1).
#[test]
fn sd35_large_turbo_without_cfg() {
    let (sd3, req, out) = variant("sd35l", "sd3_pipe_turbo_sd35l.safetensors");
    assert_eq!(req.guidance_scale, 0.0);
    let one = sd3
        .generate(&Sd3Request { guidance_scale: 1.0, negative_prompt: "anything".into(), ..req })
        .expect("guidance 1");
    assert_eq!(max_abs(&(&one.latents - &out.latents).expect("diff")), 0.0);
}

/// `StableDiffusion3InpaintPipeline` on the 16-channel SD3 fixture with the init image and the hard-rectangle
/// mask: strength 0.8 of 5 steps runs the last 4, and after each step the latents outside the mask are the init
/// latents re-noised to the next sigma (the clean init latents after the last). The image is decoded with the
/// VAE's `shift_factor`, as the other SD3 pipelines decode; that pipeline leaves it out (diffusers issue #13611),
/// and decoding our latents without it gives that pipeline's own image.
#[test]
fn sd3_inpaint() {
    let file = "sd3_pipe_inpaint_sd3.safetensors";
    let dev = test_device();
    let sd3 = Sd3Model::from_dir(&fixtures().join("models/sd3"), dev.dtype, &dev.device, true).expect("sd3");
    let req = golden_request(file);
    assert!(req.init_image.is_some() && req.mask.is_some(), "{file} names its image and mask");
    let mut reported = Vec::new();
    let out = sd3
        .generate_with(&req, &mut |step, steps, _| {
            reported.push((step, steps));
            true
        })
        .expect("inpaint");
    assert_eq!(reported, [(1, 4), (2, 4), (3, 4), (4, 4)], "strength 0.8 of 5 steps runs the last 4");
    let g = load_golden(file);
    assert_matches(file, &out, &g);
    let vae = sd3.vae_config();
    let unshifted = out
        .latents
        .affine(1.0 / vae.scaling_factor, 0.0)
        .and_then(|z| z.to_dtype(sd3.vae.dtype()))
        .and_then(|z| sd3.vae.get().expect("resident vae").decode(&z).map_err(candle_core::Error::wrap))
        .and_then(|x| crate::tensor_image::tensor_to_image(&x))
        .expect("decode without the shift");
    let own: Vec<u8> = g["image_u8_pipeline"].flatten_all().and_then(|t| t.to_vec1()).expect("u8");
    let off = unshifted.data.iter().zip(&own).filter(|(a, b)| a.abs_diff(**b) > 1).count();
    let tol = dev.tolerance;
    assert!(off as f32 <= tol.pixels_off * own.len() as f32, "{off} values off the pipeline's own image");
    assert_ne!(own, out.image.data, "the shift changes the image");
    // The same request without the mask is img2img: the blend is what the golden checks.
    let img2img = sd3.generate(&Sd3Request { mask: None, ..req }).expect("img2img");
    let moved = max_abs(&(&img2img.latents - &out.latents).expect("diff"));
    assert!(moved > 1e-2, "the mask changed the latents by only {moved}");
}

/// What diffusers' SD3 pipelines cannot run is refused before any work, naming the field.
#[test]
fn unsupported_combinations_are_refused_naming_the_field() {
    let sd3 =
        Sd3Model::from_dir(&fixtures().join("models/sd35m"), DType::F32, &Device::Cpu, false).expect("sd35m");
    let init = sdhive_engine::RgbImage { width: 64, height: 64, data: vec![128; 64 * 64 * 3] };
    let base = Sd3Request {
        width: 64,
        height: 64,
        steps: 2,
        guidance_scale: 5.0,
        max_sequence_length: 32,
        ..Sd3Request::new("x", 1)
    };
    let slg = Some(SkipLayerGuidance::with_layers(vec![1]));
    let mask = Some(sdhive_engine::GrayImage { width: 64, height: 64, data: vec![255; 64 * 64] });
    let inpaint = Sd3Request { init_image: Some(init.clone()), mask: mask.clone(), ..base.clone() };
    let cases = [
        ("`mask`", Sd3Request { mask, ..base.clone() }),
        ("`sampler`", Sd3Request { sampler: FlowSampler::DpmPp2M, ..inpaint.clone() }),
        ("`skip_layer_guidance`", Sd3Request { skip_layer_guidance: slg.clone(), ..inpaint }),
        (
            "`sampler`",
            Sd3Request { sampler: FlowSampler::DpmPp2M, init_image: Some(init.clone()), ..base.clone() },
        ),
        (
            "`skip_layer_guidance`",
            Sd3Request { skip_layer_guidance: slg.clone(), init_image: Some(init), ..base.clone() },
        ),
        (
            "`skip_layer_guidance`",
            Sd3Request { skip_layer_guidance: slg.clone(), guidance_scale: 1.0, ..base.clone() },
        ),
        (
            "`skip_layer_guidance.layers`",
            Sd3Request {
                skip_layer_guidance: Some(SkipLayerGuidance::with_layers(vec![0, 2])),
                ..base.clone()
            },
        ),
        (
            "`skip_layer_guidance.scale`",
            Sd3Request {
                skip_layer_guidance: Some(SkipLayerGuidance {
                    scale: -1.0,
                    ..SkipLayerGuidance::with_layers(vec![1])
                }),
                ..base.clone()
            },
        ),
    ];
    for (field, req) in cases {
        let e = sd3.generate(&req).err().unwrap_or_else(|| panic!("{field}: ran")).to_string();
        assert!(e.contains(field), "{field}: {e}");
    }
}

fn engine(model: &str) -> Sd3Engine {
    let dev = test_device();
    Sd3Engine::load(
        &fixtures().join("models").join(model),
        model,
        &dev.device,
        dev.dtype,
        true,
        ("test", &dev.label),
    )
    .unwrap_or_else(|e| panic!("{model}: {e}"))
}

fn run(engine: &mut Sd3Engine, req: &GenerateRequest) -> Result<sdhive_engine::GenerateOutput, EngineError> {
    engine.generate(req, &mut |_| Control::Continue)
}

/// Jobs are planned against the device's memory as on SD1/SDXL, here under an operator's budget
/// (`--memory-budget`): with 600 MiB beside the weights, a 64² job runs as is and a 128² one (16² latents, past
/// the tiny VAE's 8-latent tiles) decodes in tiles — the image of the model decoding its final latents tiled, which
/// `sdhive-models`' tests hold against diffusers' `enable_tiling()`; with 520 MiB (less than the planner's margin
/// and a tile) the job is refused with the size and what it needs. The engine's info reports the plan.
#[test]
fn the_memory_plan_tiles_the_vae_or_refuses_the_job() {
    let mib = 1u64 << 20;
    let weights = engine("sd3").info().memory.expect("a memory report").weights_bytes;
    assert!(weights > 0);
    let mut roomy = engine("sd3").with_memory(None, Some(weights + 600 * mib));
    let native = roomy.info().memory.and_then(|m| m.native_job).expect("the native job's plan");
    assert!(!native.vae_tiling, "{native:?}");

    let golden = golden_request("sd3_pipe_dpm_sd3.safetensors");
    let small = GenerateRequest { sampler: Sampler::Euler, steps: 2, ..engine_request(&golden) };
    let big = GenerateRequest { width: Some(128), height: Some(128), ..small.clone() };
    let plain_small = run(&mut engine("sd3"), &small).expect("64²");
    assert_eq!(
        run(&mut roomy, &small).expect("64² within the budget").images[0].image,
        plain_small.images[0].image
    );

    let tiled = run(&mut roomy, &big).expect("128² within the budget").images.remove(0).image;
    let plain = run(&mut engine("sd3"), &big).expect("128²").images.remove(0).image;
    assert_eq!((tiled.width, tiled.height), (128, 128));
    assert_ne!(tiled, plain, "a tiled decode blends its seams: the budget did not change the plan");
    let mut sd3 = load_model("sd3");
    sd3.vae_tiling = true;
    let req = Sd3Request {
        width: 128,
        height: 128,
        steps: 2,
        sampler: FlowSampler::Euler,
        max_sequence_length: sdhive_tokenizer::T5_DEFAULT_MAX_LEN,
        ..golden
    };
    assert_eq!(sd3.generate(&req).expect("tiled by hand").image, tiled);

    let mut tight = engine("sd3").with_memory(None, Some(weights + 520 * mib));
    match run(&mut tight, &big) {
        Err(EngineError::InsufficientMemory(e)) => {
            assert!(e.to_string().contains("128×128 job needs about"), "{e}")
        }
        other => panic!("a job past the budget must be refused, got {:?}", other.map(|_| "images")),
    }
}

/// The engine's request as the golden's: the A1111 names map onto the flow samplers, skip-layer guidance reaches
/// the pipeline, and the infotext records what ran.
#[test]
fn the_engine_runs_dpm_and_skip_layer_guidance_as_the_goldens() {
    let request = |file: &str| engine_request(&golden_request(file));
    let tol = test_device().tolerance;
    let check = |label: &str, out: &sdhive_engine::GenerateOutput, file: &str| {
        let want: Vec<u8> =
            load_golden(file)["image_u8"].flatten_all().and_then(|t| t.to_vec1()).expect("u8");
        let got = &out.images[0].image.data;
        let off = got.iter().zip(&want).filter(|(a, b)| a.abs_diff(**b) > 1).count();
        assert!(off as f32 <= tol.pixels_off * want.len() as f32, "{label}: {off} values off by > 1 level");
    };

    let mut sd3 = engine("sd3");
    let info = sd3.info();
    assert_eq!(info.samplers, ["Euler", "DPM++ 2M"]);
    let file = "sd3_pipe_dpm_sd3.safetensors";
    let out = run(&mut sd3, &GenerateRequest { sampler: Sampler::DpmPp2M, ..request(file) }).expect("dpm");
    check("DPM++ 2M", &out, file);
    assert!(out.images[0].infotext.contains("Sampler: DPM++ 2M,"), "{}", out.images[0].infotext);

    let mut sd35m = engine("sd35m");
    let file = "sd3_pipe_slg_sd35m.safetensors";
    // A1111's default `Euler a` runs (and is recorded) as Euler.
    let out = run(&mut sd35m, &GenerateRequest { sampler: Sampler::EulerA, ..request(file) }).expect("slg");
    check("skip-layer guidance", &out, file);
    let text = &out.images[0].infotext;
    assert!(text.contains("Sampler: Euler,"), "{text}");
    assert!(text.contains("SLG layers: 1, SLG scale: 2.8, SLG start: 0.01, SLG stop: 0.5,"), "{text}");
}

/// Inpainting through the engine: `mask` reaches the inpaint path (the image is the golden's), the f32 strength
/// 0.8 skips the first of 5 steps as diffusers' 0.8 does, and the engine says it inpaints.
#[test]
fn the_engine_inpaints_as_the_golden() {
    let file = "sd3_pipe_inpaint_sd3.safetensors";
    let r = golden_request(file);
    let mut sd3 = engine("sd3");
    assert!(sd3.info().supports_inpaint);
    let req = GenerateRequest {
        sampler: Sampler::Euler,
        init_image: r.init_image.clone(),
        strength: r.strength as f32,
        mask: r.mask.clone(),
        ..engine_request(&r)
    };
    let mut steps = Vec::new();
    let out = sd3
        .generate(&req, &mut |p| {
            steps.push((p.step, p.steps));
            Control::Continue
        })
        .expect("inpaint");
    assert_eq!(steps, [(1, 4), (2, 4), (3, 4), (4, 4)]);
    let want: Vec<u8> = load_golden(file)["image_u8"].flatten_all().and_then(|t| t.to_vec1()).expect("u8");
    let got = &out.images[0].image.data;
    assert_eq!(got.len(), want.len());
    let off = got.iter().zip(&want).filter(|(a, b)| a.abs_diff(**b) > 1).count();
    let tol = test_device().tolerance;
    assert!(off as f32 <= tol.pixels_off * want.len() as f32, "{off} values off by > 1 level");
}

#[test]
fn the_engine_refuses_what_sd3_does_not_run_naming_the_field() {
    let mut sd3 = engine("sd35m");
    let base = GenerateRequest {
        prompt: "x".into(),
        steps: 2,
        width: Some(64),
        height: Some(64),
        seed: Some(1),
        sampler: Sampler::Euler,
        ..Default::default()
    };
    let init = sdhive_engine::RgbImage { width: 64, height: 64, data: vec![128; 64 * 64 * 3] };
    let slg = |layers: Vec<usize>| Some(SkipLayerGuidance::with_layers(layers));
    let cases = [
        ("sampler", GenerateRequest { sampler: Sampler::Ddim, ..base.clone() }),
        (
            "scheduler",
            GenerateRequest { sampler: Sampler::DpmPp2M, schedule: Schedule::Karras, ..base.clone() },
        ),
        (
            "sampler",
            GenerateRequest { sampler: Sampler::DpmPp2M, init_image: Some(init.clone()), ..base.clone() },
        ),
        (
            "sampler",
            GenerateRequest {
                sampler: Sampler::DpmPp2M,
                init_image: Some(init.clone()),
                mask: Some(sdhive_engine::GrayImage { width: 64, height: 64, data: vec![255; 64 * 64] }),
                ..base.clone()
            },
        ),
        ("skip_layer_guidance.layers", GenerateRequest { skip_layer_guidance: slg(vec![2]), ..base.clone() }),
        ("skip_layer_guidance.layers", GenerateRequest { skip_layer_guidance: slg(vec![]), ..base.clone() }),
        (
            "skip_layer_guidance",
            GenerateRequest { skip_layer_guidance: slg(vec![1]), cfg_scale: 1.0, ..base.clone() },
        ),
    ];
    for (field, req) in cases {
        match run(&mut sd3, &req) {
            Err(EngineError::Invalid(e)) => assert_eq!(e.field, field, "{e}"),
            other => panic!("{field}: expected a field error, got {:?}", other.map(|o| o.images.len())),
        }
    }
}

/// The SD1/SDXL engine has no MMDiT blocks to skip: it refuses the option, alone and in a batch.
#[test]
fn the_unet_engine_refuses_skip_layer_guidance() {
    use crate::engine::{CandleEngine, LoadOptions};
    let dev = test_device();
    let model = crate::model::SdModel::from_diffusers_dir(
        "sd1",
        &fixtures().join("models/sd1"),
        &dev.device,
        dev.dtype,
    )
    .expect("sd1");
    let mut engine = CandleEngine::from_model(
        model,
        LoadOptions::single_device(&dev.device, dev.dtype, "test", &dev.label),
    );
    let req = GenerateRequest {
        prompt: "x".into(),
        steps: 2,
        width: Some(64),
        height: Some(64),
        seed: Some(1),
        skip_layer_guidance: Some(SkipLayerGuidance::with_layers(vec![0])),
        ..Default::default()
    };
    match engine.generate(&req, &mut |_| Control::Continue) {
        Err(EngineError::Invalid(e)) => assert_eq!(e.field, "skip_layer_guidance", "{e}"),
        other => panic!("expected a field error, got {:?}", other.map(|o| o.images.len())),
    }
    let results = engine.generate_batch(&[&req], 8, &mut |_, _| Control::Continue);
    assert!(matches!(&results[0], Err(EngineError::Invalid(e)) if e.field == "skip_layer_guidance"));
}

/// Previews every `preview_every` steps show the step's estimate of the clean latents through the SD3
/// latent-to-RGB factors; at the last Euler step that estimate is the final latents, so the last preview is the
/// map of diffusers' final latents.
#[test]
fn previews_show_the_steps_estimate() {
    let file = "sd3_pipe_turbo_sd35l.safetensors";
    let r = golden_request(file);
    let mut sd35l = engine("sd35l");
    assert_eq!(sd35l.info().preview, sdhive_engine::PreviewDecoder::Latent);
    let req = GenerateRequest { preview_every: 2, ..engine_request(&r) };
    let mut previews = Vec::new();
    sd35l
        .generate(&req, &mut |p| {
            if let Some(image) = &p.preview {
                previews.push((p.step, image.clone()));
            }
            Control::Continue
        })
        .expect("turbo run");
    assert_eq!(previews.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [2, 4], "every 2nd of 4 steps");
    let want = crate::preview::sd3_latent_preview(&load_golden(file)["latents"]).expect("16 channels");
    let (_, last) = &previews[1];
    assert_eq!((last.width, last.height), (r.width as u32 / 8, r.height as u32 / 8));
    let off = last.data.iter().zip(&want.data).filter(|(a, b)| a.abs_diff(**b) > 1).count();
    let tol = test_device().tolerance;
    assert!(off as f32 <= tol.pixels_off * want.data.len() as f32, "{off} preview values off by > 1 level");
    assert_ne!(previews[0].1.data, last.data, "the step-2 estimate is not the final one");
}

/// The sd3 fixture with each network's target changed by `change` from the test device's resident default.
fn targets(change: impl FnOnce(&mut crate::Targets)) -> crate::Targets {
    let dev = test_device();
    let mut t = crate::Targets::all(&dev.device, dev.dtype);
    change(&mut t);
    t
}

/// Text-to-image and img2img (the VAE's encode too), small enough for CI.
fn offload_requests() -> [Sd3Request; 2] {
    let txt = Sd3Request {
        negative_prompt: "blurry".into(),
        width: 64,
        height: 64,
        steps: 2,
        guidance_scale: 5.0,
        max_sequence_length: 32,
        ..Sd3Request::new("a red fox in the snow", 7)
    };
    let init = sdhive_engine::RgbImage {
        width: 64,
        height: 64,
        data: (0..64 * 64 * 3).map(|i| (i * 7 % 251) as u8).collect(),
    };
    let img = Sd3Request { init_image: Some(init), strength: 0.6, ..txt.clone() };
    [txt, img]
}

fn assert_same_outputs(label: &str, a: &Sd3Model, b: &Sd3Model) {
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).and_then(|t| t.to_dtype(DType::F32)).expect("to cpu");
    for req in offload_requests() {
        let (x, y) = (a.generate(&req).expect("resident"), b.generate(&req).expect(label));
        let diff = max_abs(&(cpu(&x.latents) - cpu(&y.latents)).expect("diff"));
        assert_eq!(diff, 0.0, "{label}: latents (img2img: {})", req.init_image.is_some());
        assert!(x.image.data == y.image.data, "{label}: image (img2img: {})", req.init_image.is_some());
    }
}

/// [`assert_same_outputs`] within the test device's tolerance: latents relative to their largest magnitude, and the
/// share of channel values more than one level apart.
fn assert_close_outputs(label: &str, a: &Sd3Model, b: &Sd3Model) {
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).and_then(|t| t.to_dtype(DType::F32)).expect("to cpu");
    let tol = test_device().tolerance;
    for req in offload_requests() {
        let (x, y) = (a.generate(&req).expect("resident"), b.generate(&req).expect(label));
        let scale = max_abs(&cpu(&x.latents)).max(1.0);
        let diff = max_abs(&(cpu(&x.latents) - cpu(&y.latents)).expect("diff")) / scale;
        assert!(diff <= tol.latent_rel, "{label}: latents {diff} (img2img: {})", req.init_image.is_some());
        let off = x.image.data.iter().zip(&y.image.data).filter(|(p, q)| p.abs_diff(**q) > 1).count();
        let share = off as f32 / x.image.data.len() as f32;
        assert!(
            share <= tol.pixels_off,
            "{label}: {share} of channel values off (img2img: {})",
            req.init_image.is_some()
        );
    }
}

/// `--offload te` and `--offload te,unet,vae` (host copies built for each use) compute bit for bit as the
/// resident model, from the folder and from the single file (whose converted tensors become the host copies).
#[test]
fn offloaded_sd3_networks_give_the_resident_models_images() {
    let dir = fixtures().join("models/sd3");
    let file = fixtures().join("models/sd3.safetensors");
    let resident = Sd3Model::from_dir_on(&dir, &targets(|_| ()), true).expect("resident");
    assert!(resident.transformer.get().is_some() && !resident.clip_l.offloaded());
    let te = Sd3Model::from_dir_on(&dir, &targets(|t| t.text.offload = true), true).expect("te offloaded");
    let t5 = te.t5.as_ref().map(|(e, _)| e.offloaded());
    assert!(te.clip_l.offloaded() && te.clip_g.offloaded() && t5 == Some(true), "te is all three encoders");
    assert!(!te.transformer.offloaded() && !te.vae.offloaded());
    assert_same_outputs("te offloaded", &resident, &te);
    let everything = |t: &mut crate::Targets| {
        t.text.offload = true;
        t.unet.offload = true;
        t.vae.offload = true;
    };
    let all = Sd3Model::from_dir_on(&dir, &targets(everything), true).expect("all offloaded");
    assert!(all.transformer.get().is_none() && all.vae.offloaded() && all.transformer.resident_bytes() == 0);
    assert_same_outputs("all offloaded", &resident, &all);
    let single = Sd3Model::from_single_file_on(&file, Some(&dir), &targets(everything), true).expect("file");
    assert!(single.transformer.offloaded() && single.transformer.host_bytes() > 0);
    assert_same_outputs("single file, all offloaded", &resident, &single);
}

/// A LoRA on offloaded networks goes into their host copies, so every rebuild has it: the same images as the
/// LoRA merged into the resident model, and the plain model's again once taken out.
#[test]
fn loras_apply_to_offloaded_sd3_networks() {
    let dir = fixtures().join("models/sd3");
    let lora = |stem: &str, te: f32, unet: f32| sdhive_engine::LoraUse {
        name: stem.to_string(),
        path: fixtures().join("models/Lora").join(format!("{stem}.safetensors")),
        te,
        unet,
        hash: None,
    };
    let loras = [lora("sd3_kohya", 0.7, 0.9), lora("sd3_peft", 1.0, 1.0)];
    let everything = |t: &mut crate::Targets| {
        t.text.offload = true;
        t.unet.offload = true;
        t.vae.offload = true;
    };
    let plain = Sd3Model::from_dir_on(&dir, &targets(|_| ()), true).expect("plain");
    let mut resident = Sd3Model::from_dir_on(&dir, &targets(|_| ()), true).expect("resident");
    let mut offloaded = Sd3Model::from_dir_on(&dir, &targets(everything), true).expect("offloaded");
    let (mut a, mut b) = (crate::AppliedLoras::default(), crate::AppliedLoras::default());
    a.set(&mut resident, &loras).expect("resident merge");
    b.set(&mut offloaded, &loras).expect("offloaded merge");
    let req = &offload_requests()[0];
    let with = offloaded.generate(req).expect("offloaded with LoRAs");
    let without = plain.generate(req).expect("plain");
    assert!(with.image.data != without.image.data, "the LoRAs did nothing to the offloaded model");
    if test_device().device.is_cpu() {
        assert_same_outputs("offloaded with LoRAs", &resident, &offloaded);
    } else {
        // On a GPU the resident weights take their LoRA products there, the host copies on the CPU: the merged
        // weights may differ in their last bit, so the images agree within the device's tolerance.
        assert_close_outputs("offloaded with LoRAs", &resident, &offloaded);
    }
    b.set(&mut offloaded, &[]).expect("take out");
    assert_same_outputs("offloaded, LoRAs taken out", &plain, &offloaded);
}

/// The engine's request for a case of `golden/sd3_hires.json`.
fn hires_request(case: &serde_json::Value) -> GenerateRequest {
    let n = |k: &str| case[k].as_f64().unwrap_or_else(|| panic!("sd3_hires.json: {k}"));
    let s = |k: &str| case[k].as_str().unwrap_or_else(|| panic!("sd3_hires.json: {k}")).to_string();
    let upscaler = sdhive_engine::HiresUpscaler::builtin(&s("hr_upscaler")).expect("a built-in upscaler");
    GenerateRequest {
        prompt: s("prompt"),
        negative_prompt: s("negative_prompt"),
        steps: n("steps") as u32,
        cfg_scale: n("cfg_scale") as f32,
        width: Some(n("width") as u32),
        height: Some(n("height") as u32),
        seed: Some(n("seed") as u64),
        sampler: Sampler::Euler,
        hires: Some(sdhive_engine::HiresFix {
            upscaler,
            scale: n("hr_scale") as f32,
            resize_x: n("hr_resize_x") as u32,
            resize_y: n("hr_resize_y") as u32,
            steps: n("hr_second_pass_steps") as u32,
            denoising_strength: n("denoising_strength") as f32,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Hires fix through the engine against diffusers' SD3 pipelines composed as `gen_sd3.hires_goldens` documents:
/// a Latent mode (the 16-channel latents interpolated, img2img from them) and Lanczos (decode, enlarge, img2img
/// from the image), 64² → 128²; progress counts both passes as one run; the infotext records the hires settings.
#[test]
fn the_engine_runs_hires_fix_as_diffusers_composed() {
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden/sd3_hires.json")).expect("sd3_hires.json"),
    )
    .expect("sd3_hires.json is JSON");
    let cases = json["cases"].as_array().expect("cases");
    // Latent: 3 first-pass steps + 4 hires steps at 0.6 (int(4 − 2.4) = 1 skipped); Lanczos: 3 + 3 at 0.7.
    let expected = [("latent", "Latent", 6), ("lanczos", "Lanczos", 6)];
    assert_eq!(cases.len(), expected.len());
    let mut sd3 = engine("sd3");
    let tol = test_device().tolerance;
    for (case, (name, upscaler, total)) in cases.iter().zip(expected) {
        assert_eq!(case["case"], name);
        let mut steps = Vec::new();
        let out = sd3
            .generate(&hires_request(case), &mut |p| {
                steps.push((p.step, p.steps));
                Control::Continue
            })
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let want: Vec<u8> = load_golden(case["file"].as_str().expect("file"))["image_u8"]
            .flatten_all()
            .and_then(|t| t.to_vec1())
            .expect("image_u8");
        let image = &out.images[0].image;
        assert_eq!((image.width, image.height), (128, 128), "{name}: size");
        assert_eq!(image.data.len(), want.len(), "{name}: size");
        let off = image.data.iter().zip(&want).filter(|(a, b)| a.abs_diff(**b) > 1).count();
        let worst = image.data.iter().zip(&want).map(|(a, b)| a.abs_diff(*b)).max().unwrap_or(0);
        eprintln!("hires {name} on {}: {off} values off by > 1 level, worst {worst}", test_device().label);
        assert!(off as f32 <= tol.pixels_off * want.len() as f32, "{name}: {off} values off by > 1 level");
        let want_steps: Vec<(u32, u32)> = (1..=total).map(|s| (s, total)).collect();
        assert_eq!(steps, want_steps, "{name}: progress");
        let text = &out.images[0].infotext;
        assert!(text.contains("Size: 64x64,"), "{text}");
        assert!(text.contains("Hires upscale: 2, "), "{text}");
        assert!(text.contains(&format!("Hires upscaler: {upscaler}")), "{text}");
        assert!(!text.contains("Hires sampler"), "{name}: the second pass ran the request's sampler: {text}");
    }
}

/// What SD3's hires fix refuses before anything runs, naming the field: a hires size that is not a multiple of 16
/// (the MMDiT's patch grid) and a second-pass sampler or schedule SD3 img2img cannot run. A first pass on DPM++ 2M
/// continues on Euler, and the infotext says so.
#[test]
fn the_engine_refuses_sd3_hires_settings_naming_the_field() {
    let mut sd3 = engine("sd3");
    let hires = |h: sdhive_engine::HiresFix| GenerateRequest {
        prompt: "x".into(),
        steps: 2,
        cfg_scale: 2.0,
        width: Some(64),
        height: Some(64),
        seed: Some(1),
        sampler: Sampler::Euler,
        hires: Some(sdhive_engine::HiresFix { steps: 2, denoising_strength: 0.5, ..h }),
        ..Default::default()
    };
    let fix = sdhive_engine::HiresFix::default;
    let cases = [
        // 64 · 1.125 = 72: a multiple of 8, not of 16.
        ("hr_scale", hires(sdhive_engine::HiresFix { scale: 1.125, ..fix() })),
        ("hr_resize_x", hires(sdhive_engine::HiresFix { resize_x: 72, ..fix() })),
        ("hr_resize_y", hires(sdhive_engine::HiresFix { resize_x: 96, resize_y: 72, ..fix() })),
        ("hr_sampler_name", hires(sdhive_engine::HiresFix { sampler: Some(Sampler::DpmPp2M), ..fix() })),
        ("hr_sampler_name", hires(sdhive_engine::HiresFix { sampler: Some(Sampler::Ddim), ..fix() })),
        ("hr_scheduler", hires(sdhive_engine::HiresFix { schedule: Some(Schedule::Karras), ..fix() })),
    ];
    for (field, req) in cases {
        let mut calls = 0;
        match sd3.generate(&req, &mut |_| {
            calls += 1;
            Control::Continue
        }) {
            Err(EngineError::Invalid(e)) => assert_eq!(e.field, field, "{e}"),
            other => panic!("{field}: expected a field error, got {:?}", other.map(|o| o.images.len())),
        }
        assert_eq!(calls, 0, "{field}: refused after steps ran");
    }
    let req = GenerateRequest { sampler: Sampler::DpmPp2M, ..hires(fix()) };
    let out = run(&mut sd3, &req).expect("DPM++ 2M first pass with hires");
    let image = &out.images[0];
    assert_eq!((image.image.width, image.image.height), (128, 128));
    assert!(image.infotext.contains("Sampler: DPM++ 2M,"), "{}", image.infotext);
    assert!(image.infotext.contains("Hires sampler: Euler"), "{}", image.infotext);
}
