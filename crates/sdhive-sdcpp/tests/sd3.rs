//! SD3.5-medium through stable-diffusion.cpp against diffusers: its architecture (the MMDiT-X a quarter wide, the
//! text encoders and VAE full-size) with deterministic random weights (`cargo xtask random-model --manifest
//! tests/fixtures/sd35m-random/manifest.json`, its folder in `SDHIVE_SD35M_RANDOM`), without T5, handed to sd.cpp
//! part by part from its diffusers folder, generates diffusers' images of the goldens of
//! xtask/fixtures/gen_sd35m_random.py (64², CFG 5): `sd35m_random_euler` (2 flow-Euler steps), `sd35m_random_slg` (3
//! steps, skip-layer guidance on blocks 7-9 at steps 1 and 2), `sd35m_random_lora` (a kohya/SAI-named LoRA at 0.8),
//! `sd35m_random_peft` (a diffusers/PEFT-named one at 0.8), `sd35m_random_peft_te` (one with CLIP-L and CLIP-G
//! modules too), `sd35m_random_hires` (hires fix: Latent 2×, 2 of 4 second-pass steps), `sd35m_random_hires_lanczos`
//! (the same with the Lanczos image upscaler; an ESRGAN ×4 runs too) and `sd35m_random_vae` (a
//! standalone VAE in the original names, the model folder's `VAE/`), within the bounds of the engine's SD1.5 image
//! check (`cargo xtask vulkan`). Ignored by default because it needs that 2 GB model; `cargo xtask vulkan` writes
//! the model and runs it on ggml's CPU backend. Measured there (2 cores): mean |diff| 0.10-0.15 levels, max 1, PSNR
//! 56.4-58.3 dB (the Lanczos hires image 0.28, max 3, 53.5 dB: its resize and re-encode add rounding); load (the
//! MMDiT's conversion to SAI's layout and a warm-up image included) 8 s, each image 11-12 s, the whole test ~80 s.
//!
//! `sd35_medium_full_size_with_t5_generates_diffusers_image` holds the engine to diffusers at SD3.5-medium's real
//! widths with T5-XXL on (15 GB of random weights, so on a GPU machine; its doc says how).

mod common;

use sdhive_engine::{
    Control, Engine, GenerateRequest, HiresFix, HiresUpscaler, LatentMode, LoraUse, RgbImage, Sampler,
    SkipLayerGuidance,
};
use sdhive_modelsource::{ModelLocation, ResolvedModel};
use sdhive_sdcpp::{LoadOptions, SdCppEngine};
use std::path::{Path, PathBuf};

/// The bounds of `cargo xtask vulkan`'s SD1.5 check (xtask/src/vulkan.rs), in 8-bit levels.
const MAX_MEAN_ABS_DIFF: f64 = 1.0;
const MIN_PSNR_DB: f64 = 45.0;

/// The bounds of the full-size check with ggml's f16 arithmetic: the SD1.5 image's figures through NVIDIA's Vulkan
/// driver (docs/gpu.md: mean 1.45 levels, 42.2 dB against diffusers), where f16 rounding over the real widths costs
/// more than over the quarter-wide MMDiT. T5's context moves these images by about 5 levels, so a T5 left out or
/// computed wrongly still fails them. With ggml's f32 arithmetic (`GGML_VK_DISABLE_F16` set, as `cargo xtask
/// vulkan` runs the SD1.5 check) the check takes that check's own bounds.
const FULL_F16_BOUNDS: (f64, f64) = (1.5, 42.0);

/// Our image of golden case `name` within the bounds of diffusers'; kept in the temporary folder for a look.
fn assert_close(name: &str, ours: &RgbImage, theirs: &RgbImage) {
    assert_within(name, ours, theirs, (MAX_MEAN_ABS_DIFF, MIN_PSNR_DB));
}

fn assert_within(name: &str, ours: &RgbImage, theirs: &RgbImage, (max_mean, min_psnr): (f64, f64)) {
    let cmp = common::compare(ours, theirs);
    eprintln!("{name}: stable-diffusion.cpp vs diffusers: {cmp:?}");
    let kept = std::env::temp_dir().join(format!("{name}.sdcpp.png"));
    std::fs::write(&kept, sdhive_engine::encode_png(ours, None).expect("PNG")).expect("write the image");
    assert!(
        cmp.psnr_db >= min_psnr && cmp.mean_abs <= max_mean,
        "{name}: sd.cpp's image ({}) is too far from diffusers' ({cmp:?}; bounds: PSNR ≥ {min_psnr} dB, mean \
         |diff| ≤ {max_mean})",
        kept.display()
    );
}

fn model_dir() -> PathBuf {
    std::env::var_os("SDHIVE_SD35M_RANDOM").map(PathBuf::from).expect(
        "SDHIVE_SD35M_RANDOM must name the folder `cargo xtask random-model` writes from sd35m-random",
    )
}

/// The diffusers folder `dir` as a model named `name`, and the temporary cache sd.cpp converts its MMDiT into
/// (`XDG_CACHE_HOME`), so the converted copy goes with the test when the returned folder is dropped.
fn diffusers_folder(name: &str, dir: &Path) -> (ResolvedModel, tempfile::TempDir) {
    let cache = tempfile::tempdir().expect("temp dir");
    std::env::set_var("XDG_CACHE_HOME", cache.path());
    let model = ResolvedModel {
        name: name.into(),
        location: ModelLocation::DiffusersDir(dir.to_path_buf()),
        vae: None,
    };
    (model, cache)
}

#[test]
#[ignore = "needs the random SD3.5-medium named by SDHIVE_SD35M_RANDOM; cargo xtask vulkan runs it"]
fn sd35_medium_without_t5_generates_diffusers_image() {
    let dir = model_dir();
    let (model, _cache) = diffusers_folder("sd35m-random", &dir);
    let opts = LoadOptions { no_t5: true, ..common::load_options() };
    let started = std::time::Instant::now();
    let mut engine =
        SdCppEngine::load(&model, opts).unwrap_or_else(|e| panic!("cannot load {}: {e}", dir.display()));
    eprintln!("loaded in {:.1} s", started.elapsed().as_secs_f64());
    let info = engine.info();
    assert_eq!(
        (info.family.as_str(), info.native_width, info.samplers.as_slice()),
        ("sd3", 1024, &["Euler".to_string()][..])
    );
    // MMDiT-X (a quarter wide), VAE, CLIP-L and CLIP-G at f16: 1.05 G values.
    assert_eq!(info.memory.expect("memory report").weights_bytes, 2 * 1_047_981_571);

    let (req, theirs) = common::golden_case("sd35m_random_euler");
    let started = std::time::Instant::now();
    let ours = common::image(&mut engine, &req);
    eprintln!("generated in {:.1} s", started.elapsed().as_secs_f64());
    assert_close("sd35m_random_euler", &ours, &theirs);

    // SD3.5-medium's skip-layer guidance (blocks 7-9, scale 2.8) at diffusers' steps 1 and 2 of 3.
    let (slg_req, slg_theirs) = common::golden_case("sd35m_random_slg");
    let g = &common::golden_json("sd35m_random_slg")["skip_layer_guidance"];
    let layers = g["layers"].as_array().expect("layers").iter().map(|l| l.as_u64().expect("layer") as usize);
    let slg = SkipLayerGuidance {
        layers: layers.collect(),
        scale: g["scale"].as_f64().expect("scale"),
        start: g["start"].as_f64().expect("start"),
        stop: g["stop"].as_f64().expect("stop"),
    };
    let slg_req = GenerateRequest { skip_layer_guidance: Some(slg.clone()), ..slg_req };
    let started = std::time::Instant::now();
    let ours = common::image(&mut engine, &slg_req);
    eprintln!("generated with skip-layer guidance in {:.1} s", started.elapsed().as_secs_f64());
    assert_close("sd35m_random_slg", &ours, &slg_theirs);

    // A kohya/SAI-named LoRA (tests/fixtures/sd35m-random/Lora/) at 0.8, against diffusers' image with it fused;
    // two in diffusers' (PEFT) names with their alpha in the adapter metadata (the second on both CLIPs too),
    // rewritten into SAI's layers for sd.cpp, against diffusers' own `load_lora_weights` at 0.8.
    for name in ["sd35m_random_lora", "sd35m_random_peft", "sd35m_random_peft_te"] {
        let (req, theirs) = common::golden_case(name);
        let spec = &common::golden_json(name)["lora"];
        let weight = spec["weight"].as_f64().expect("weight") as f32;
        let file = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/sd35m-random")
            .join(spec["file"].as_str().expect("file"));
        let lora = LoraUse { name: name.into(), path: file, te: weight, unet: weight, hash: None };
        let ours = common::image(&mut engine, &GenerateRequest { loras: vec![lora], ..req.clone() });
        assert_close(name, &ours, &theirs);
        // The same updates in kohya's names (CLIP modules `lora_te1_`/`lora_te2_`, alpha as tensors).
        if let Some(kohya) = spec["same_updates_in_kohya_names"].as_str() {
            let path =
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/sd35m-random").join(kohya);
            let lora = LoraUse { name: "kohya_te".into(), path, te: weight, unet: weight, hash: None };
            let ours = common::image(&mut engine, &GenerateRequest { loras: vec![lora], ..req });
            assert_close(&format!("{name} in kohya's names"), &ours, &theirs);
        }
    }

    // Hires fix, composed as the candle engine composes it from diffusers: the Latent upscale to 128², then SD3
    // img2img with strength 0.5 over 4 steps (the last 2 run), diffusers' sigmas handed to sd.cpp's second pass.
    let (hires_req, hires_theirs) = common::golden_case("sd35m_random_hires");
    let h = &common::golden_json("sd35m_random_hires")["hires"];
    assert_eq!(h["upscaler"], "Latent");
    let fix = HiresFix {
        upscaler: HiresUpscaler::Latent(LatentMode::Bilinear),
        scale: h["scale"].as_f64().expect("scale") as f32,
        steps: h["steps"].as_u64().expect("steps") as u32,
        denoising_strength: h["denoising_strength"].as_f64().expect("strength") as f32,
        ..Default::default()
    };
    let hires_req = GenerateRequest { hires: Some(fix.clone()), ..hires_req };
    let mut steps = Vec::new();
    let out = engine
        .generate(&hires_req, &mut |p| {
            steps.push((p.step, p.steps));
            Control::Continue
        })
        .unwrap_or_else(|e| panic!("hires: {e}"));
    assert_eq!(steps.last(), Some(&(4, 4)), "2 first-pass steps and 2 of the second pass, told as one run");
    let ours = &out.images[0].image;
    assert_eq!((ours.width, ours.height), (128, 128));
    assert_close("sd35m_random_hires", ours, &hires_theirs);

    // Image upscalers in the hires fix: the first pass decoded, enlarged and encoded again inside sd.cpp, against
    // diffusers' composition (`sd35m_random_hires_lanczos`, the candle engine's: PIL's LANCZOS on the 8-bit image,
    // the img2img pass encoding it). An ESRGAN ×4 (brought down to the hires size) runs too, to another image.
    let (lanczos_req, lanczos_theirs) = common::golden_case("sd35m_random_hires_lanczos");
    assert_eq!(common::golden_json("sd35m_random_hires_lanczos")["hires"]["upscaler"], "Lanczos");
    let hires_image = |engine: &mut SdCppEngine, upscaler: HiresUpscaler| {
        let req =
            GenerateRequest { hires: Some(HiresFix { upscaler, ..fix.clone() }), ..lanczos_req.clone() };
        let out = engine.generate(&req, &mut |_| Control::Continue).unwrap_or_else(|e| panic!("hires: {e}"));
        let image = out.images.into_iter().next().expect("one image");
        assert_eq!((image.image.width, image.image.height), (128, 128));
        image
    };
    let lanczos = hires_image(&mut engine, HiresUpscaler::Lanczos);
    assert!(lanczos.infotext.contains("Hires upscaler: Lanczos"), "{}", lanczos.infotext);
    assert_close("sd35m_random_hires_lanczos", &lanczos.image, &lanczos_theirs);
    let esrgan_dir = tempfile::tempdir().expect("temp dir");
    let esrgan = esrgan_dir.path().join("4x_test.safetensors");
    common::write_esrgan(&esrgan);
    let by_model = hires_image(&mut engine, HiresUpscaler::Model { name: "4x_test".into(), path: esrgan });
    assert!(by_model.infotext.contains("Hires upscaler: 4x_test"), "{}", by_model.infotext);
    let apart = common::compare(&by_model.image, &lanczos.image);
    assert!(apart.mean_abs > 1.0, "the ESRGAN's hires image is the Lanczos one ({apart:?})");

    // What the engine does not run on SD3 is refused naming the field, before anything runs.
    let mut refused =
        |req: GenerateRequest| match engine.generate(&req, &mut |_| unreachable!("nothing runs")) {
            Err(sdhive_engine::EngineError::Invalid(v)) => v.field,
            other => panic!("expected a validation error, got {:?}", other.map(|o| o.images.len())),
        };
    assert_eq!(refused(GenerateRequest { sampler: Sampler::DpmPp2M, ..req.clone() }), "sampler");
    assert_eq!(refused(GenerateRequest { sampler: Sampler::Pndm, ..req.clone() }), "sampler");
    assert_eq!(refused(GenerateRequest { width: Some(72), ..req.clone() }), "width");
    let past_the_end = SkipLayerGuidance { layers: vec![24], ..slg.clone() };
    let field = refused(GenerateRequest { skip_layer_guidance: Some(past_the_end), ..req.clone() });
    assert_eq!(field, "skip_layer_guidance.layers");
    let without_cfg =
        GenerateRequest { cfg_scale: 1.0, skip_layer_guidance: Some(slg.clone()), ..req.clone() };
    assert_eq!(refused(without_cfg), "skip_layer_guidance");
    let guided = GenerateRequest { hires: Some(fix.clone()), skip_layer_guidance: Some(slg), ..req.clone() };
    assert_eq!(refused(guided), "skip_layer_guidance");
    let nothing_left = HiresFix { denoising_strength: 0.0, steps: 4, ..fix };
    assert_eq!(refused(GenerateRequest { hires: Some(nothing_left), ..req.clone() }), "denoising_strength");
    let sd1 =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/Lora/sd1_kohya.safetensors");
    let lora = LoraUse { name: "sd1_kohya".into(), path: sd1, te: 1.0, unet: 1.0, hash: None };
    assert_eq!(refused(GenerateRequest { loras: vec![lora], ..req.clone() }), "loras");
    drop(engine);

    // A standalone VAE (A1111's `sd_vae`: SD3's VAE in the original names, other weights) in place of the
    // folder's, against diffusers' image decoded by `AutoencoderKL.from_single_file` of the same file.
    let (vae_req, vae_theirs) = common::golden_case("sd35m_random_vae");
    let vae = dir.join(common::golden_json("sd35m_random_vae")["vae"].as_str().expect("vae"));
    let with_vae = ResolvedModel { vae: Some(vae), ..model.clone() };
    let mut engine = SdCppEngine::load(&with_vae, LoadOptions { no_t5: true, ..common::load_options() })
        .unwrap_or_else(|e| panic!("cannot load {} with a standalone VAE: {e}", dir.display()));
    assert_close("sd35m_random_vae", &common::image(&mut engine, &vae_req), &vae_theirs);
    drop(engine);

    // A VAE of 4 latent channels (SD1's, in the original names) is refused naming the file and what SD3 takes,
    // before stable-diffusion.cpp reads it.
    let sd1_vae =
        std::env::temp_dir().join(format!("sdhive-sd3-test-sd1-vae-{}.safetensors", std::process::id()));
    write_four_channel_vae(&dir.join("VAE/sd35m_random_vae.safetensors"), &sd1_vae);
    let wrong = ResolvedModel { vae: Some(sd1_vae.clone()), ..model };
    let refused = SdCppEngine::load(&wrong, LoadOptions { no_t5: true, ..common::load_options() });
    let _ = std::fs::remove_file(&sd1_vae);
    match refused {
        Ok(_) => panic!("a 4-channel VAE was taken for SD3"),
        Err(e) => {
            let message = e.to_string();
            assert!(
                message.contains(&sd1_vae.display().to_string()) && message.contains("take 16"),
                "{message}"
            );
        }
    }
}

/// SD3.5-medium at its real widths with T5-XXL on: a full-size random folder with diffusers' images in its
/// `golden/` (written on a GPU machine: `bench_sd3_diffusers.py write DIR --model sd35m`, then
/// xtask/fixtures/gen_sd35m_full.py DIR, which says how), named by `SDHIVE_SD35M_FULL`. 256² and 256×192, 4
/// flow-Euler steps, CFG 5, T5's context from prompts of 11 and 25 tokens, and the first request again with the
/// model loaded without T5, whose image must differ from the one with T5 as diffusers' do.
#[test]
#[ignore = "needs the 15 GB full-size random SD3.5-medium with T5 named by SDHIVE_SD35M_FULL (gen_sd35m_full.py)"]
fn sd35_medium_full_size_with_t5_generates_diffusers_image() {
    let dir = std::env::var_os("SDHIVE_SD35M_FULL").map(PathBuf::from).expect(
        "SDHIVE_SD35M_FULL must name a folder written by bench_sd3_diffusers.py write and gen_sd35m_full.py",
    );
    let (model, _cache) = diffusers_folder("sd35m-full", &dir);
    let golden = dir.join("golden");
    let mut images = Vec::new();
    for (no_t5, cases) in
        [(false, &["sd35m_full_t5", "sd35m_full_t5_negative"][..]), (true, &["sd35m_full_no_t5"])]
    {
        let started = std::time::Instant::now();
        let mut engine = SdCppEngine::load(&model, LoadOptions { no_t5, ..common::load_options() })
            .unwrap_or_else(|e| panic!("cannot load {}: {e}", dir.display()));
        eprintln!("loaded (T5 {}) in {:.1} s", !no_t5, started.elapsed().as_secs_f64());
        if !no_t5 {
            let t5 = sdhive_checkpoint::tensor_elements(dir.join("text_encoder_3/model.safetensors"))
                .expect("T5's file");
            let weights = engine.info().memory.expect("memory report").weights_bytes;
            assert!(weights > 2 * t5, "T5's {t5} values are not among the {weights} bytes of weights");
        }
        for name in cases {
            let (req, theirs) = common::golden_case_in(&golden, name);
            let started = std::time::Instant::now();
            let ours = common::image(&mut engine, &req);
            eprintln!("{name}: generated in {:.1} s", started.elapsed().as_secs_f64());
            eprintln!("{name}: stable-diffusion.cpp vs diffusers: {:?}", common::compare(&ours, &theirs));
            images.push((name, ours, theirs));
        }
    }
    let f32_arithmetic = std::env::var_os("GGML_VK_DISABLE_F16").is_some();
    let bounds = if f32_arithmetic { (MAX_MEAN_ABS_DIFF, MIN_PSNR_DB) } else { FULL_F16_BOUNDS };
    for (name, ours, theirs) in &images {
        assert_within(name, ours, theirs, bounds);
    }
    let (with_t5, without) = (&images[0], &images[2]);
    let (ours, theirs) = (common::compare(&with_t5.1, &without.1), common::compare(&with_t5.2, &without.2));
    eprintln!("T5 moves the image by {:.2} levels (diffusers: {:.2})", ours.mean_abs, theirs.mean_abs);
    assert!(
        (ours.mean_abs - theirs.mean_abs).abs() < 0.3 * theirs.mean_abs,
        "T5 moves sd.cpp's image by {ours:?}, diffusers' by {theirs:?}"
    );
}

/// `sd3_vae` (LDM names) cut to SD1's 4 latent channels where the latent meets the networks: the encoder's
/// output (2 × 4 moments) and the decoder's input.
fn write_four_channel_vae(sd3_vae: &Path, out: &Path) {
    let bytes = std::fs::read(sd3_vae).expect("the SD3 VAE file");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors VAE");
    let mut tensors = Vec::new();
    for (name, t) in st.tensors() {
        let mut shape = t.shape().to_vec();
        let row = t.data().len() / shape[0];
        let data = match name.as_str() {
            "encoder.conv_out.weight" | "encoder.conv_out.bias" => {
                shape[0] = 8;
                t.data()[..8 * row].to_vec()
            }
            "decoder.conv_in.weight" => {
                // [out, in, 3, 3]: keep the first 4 input channels of each output row.
                let per_in = t.data().len() / (shape[0] * shape[1]);
                let kept: Vec<u8> = t
                    .data()
                    .chunks(shape[1] * per_in)
                    .flat_map(|out_row| out_row[..4 * per_in].to_vec())
                    .collect();
                shape[1] = 4;
                kept
            }
            _ => t.data().to_vec(),
        };
        tensors.push((name, shape, t.dtype(), data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, s, d, data)| {
            (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), data).expect("view"))
        })
        .collect();
    safetensors::serialize_to_file(views, None, out).expect("write the 4-channel VAE");
}
