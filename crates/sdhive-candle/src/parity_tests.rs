//! Parity with diffusers: every pipeline case recorded by `xtask/fixtures/gen_models.py` (txt2img for each
//! sampler, v-prediction, SDXL, clip skip, img2img, inpaint on 9- and 4-channel UNets) is replayed on the same
//! tiny weights and seed, and the final latents and 8-bit images are compared with diffusers' own.
//!
//! By default on the CPU in f32; `SDHIVE_TEST_DEVICE` / `SDHIVE_TEST_DTYPE` move them to a GPU or half precision
//! (see `test_device`), against the same f32 goldens with that dtype's tolerances.

use crate::conditioning::{encode_pair, encode_positive};
use crate::model::SdModel;
use crate::pipeline::{denoise, ImageJob, UnetConditioning};
use crate::residency::{ModuleTarget, Targets};
use crate::tensor_image::tensor_to_image;
use crate::test_device::test_device;
use candle_core::{DType, Device, Tensor};
use sdhive_engine::{decode_image, decode_mask, Sampler, Schedule};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// `SDHIVE_FIXTURES`, else the workspace's `tests/fixtures` (the override lets a test binary carried to another
/// machine find the fixtures there).
pub(crate) fn fixtures() -> PathBuf {
    match std::env::var_os("SDHIVE_FIXTURES") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

/// A case's LoRAs (`"loras": [{"file", "name", "te", "unet"}]`, files under `tests/fixtures/models`).
fn lora_uses(case: &Value) -> Vec<sdhive_engine::LoraUse> {
    let list = case["loras"].as_array().cloned().unwrap_or_default();
    list.iter()
        .map(|l| sdhive_engine::LoraUse {
            name: l["name"].as_str().expect("lora name").to_string(),
            path: fixtures().join("models").join(l["file"].as_str().expect("lora file")),
            te: l["te"].as_f64().expect("te multiplier") as f32,
            unet: l["unet"].as_f64().expect("unet multiplier") as f32,
            hash: None,
        })
        .collect()
}

/// A case's embeddings (`"embeddings": [{"file", "name"}]`).
fn embedding_uses(case: &Value) -> Vec<sdhive_engine::EmbeddingUse> {
    let list = case["embeddings"].as_array().cloned().unwrap_or_default();
    list.iter()
        .map(|e| sdhive_engine::EmbeddingUse {
            name: e["name"].as_str().expect("embedding name").to_string(),
            path: fixtures().join("models").join(e["file"].as_str().expect("embedding file")),
            hash: None,
        })
        .collect()
}

pub(crate) struct CaseResult {
    pub latent_rel: f32,
    pub pixels_off: usize,
    pub max_level_diff: u8,
}

pub(crate) fn cases() -> Vec<Value> {
    let index: Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("golden/pipelines.json"))
            .expect("tests/fixtures/golden/pipelines.json"),
    )
    .unwrap();
    index.as_array().expect("a list of cases").clone()
}

pub(crate) fn run_case(models: &mut HashMap<String, SdModel>, case: &Value) -> CaseResult {
    let (dev, dtype) = (&test_device().device, test_device().dtype);
    let s = |k: &str| case[k].as_str().unwrap_or_default().to_string();
    let name = s("model");
    let model = models.entry(name.clone()).or_insert_with(|| {
        SdModel::from_diffusers_dir(&name, &fixtures().join("models").join(&name), dev, dtype)
            .unwrap_or_else(|e| panic!("loading fixture model {name}: {e}"))
    });
    let (sampler, combined) = Sampler::parse(&s("sampler")).expect("fixture sampler name");
    let schedule = combined.or_else(|| Schedule::parse(&s("scheduler"))).expect("fixture scheduler");
    let width = case["width"].as_u64().unwrap() as usize;
    let height = case["height"].as_u64().unwrap() as usize;
    let cfg = case["cfg_scale"].as_f64().unwrap();
    let clip_skip = case["clip_skip"].as_u64().unwrap_or(1) as u32;
    let read =
        |key: &str| case[key].as_str().map(|p| std::fs::read(fixtures().join(p)).expect("fixture image"));
    let init = read("init_image").map(|b| decode_image(&b, 1 << 24).unwrap());
    let mask = read("mask").map(|b| decode_mask(&b, 1 << 24).unwrap());
    // Every case sets the model's LoRAs and embeddings: a plain case after a LoRA case runs on restored weights.
    model.set_loras(&lora_uses(case)).unwrap_or_else(|e| panic!("{}: {e}", s("case")));
    model.set_embeddings(&embedding_uses(case)).unwrap_or_else(|e| panic!("{}: {e}", s("case")));
    let prompt = sdhive_engine::extra_networks::strip_networks(&s("prompt"));
    let cond = if cfg > 1.0 {
        let pair = encode_pair(model, &prompt, &s("negative_prompt"), clip_skip).unwrap();
        UnetConditioning::new(model, &pair.positive, Some(&pair.negative), (width, height)).unwrap()
    } else {
        let pos = encode_positive(model, &prompt, clip_skip).unwrap();
        UnetConditioning::new(model, &pos, None, (width, height)).unwrap()
    };
    let job = ImageJob {
        width,
        height,
        steps: case["steps"].as_u64().unwrap() as usize,
        cfg_scale: cfg,
        sampler,
        schedule,
        seed: case["seed"].as_u64().unwrap(),
        init_image: init.as_ref(),
        init_latents: None,
        mask: mask.as_ref(),
        strength: case["strength"].as_f64().unwrap_or(1.0),
        vae_tiling: false,
    };
    let latents = denoise(model, &cond, &job, &mut |_| true).unwrap();
    let golden = candle_core::safetensors::load(fixtures().join("golden").join(s("file")), dev).unwrap();
    let want_latents = &golden["latents"];
    let host = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (ours_l, want_l) = (host(&latents), host(want_latents));
    // On the host, so a NaN anywhere makes the difference NaN (and the case fail).
    let diff = ours_l.iter().zip(&want_l).fold(0f32, |m, (x, y)| {
        if (x - y).is_nan() || m.is_nan() {
            f32::NAN
        } else {
            m.max((x - y).abs())
        }
    });
    let scale = want_l.iter().fold(1f32, |m, v| m.max(v.abs()));

    let z = latents.affine(1.0 / model.vae_config.scaling_factor, 0.0).unwrap();
    let ours = tensor_to_image(&model.vae.with(|v| v.decode(&z)).unwrap().unwrap()).unwrap();
    let want: Vec<u8> = golden["image"]
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| (v * 255.0).round_ties_even() as u8)
        .collect();
    assert_eq!(ours.data.len(), want.len(), "image size");
    let level = |(a, b): (&u8, &u8)| a.abs_diff(*b);
    let pixels_off = ours.data.iter().zip(&want).filter(|p| level(*p) > 1).count();
    let max_level_diff = ours.data.iter().zip(&want).map(level).max().unwrap_or(0);
    CaseResult { latent_rel: diff / scale, pixels_off, max_level_diff }
}

/// Final latents within 1e-4 relative to their magnitude (random weights make latents large), and the 8-bit image
/// within one level on at least 99% of the channel values (f32; half precision: `test_device`'s tolerances).
#[test]
fn every_pipeline_case_matches_diffusers() {
    let cases = cases();
    assert!(cases.len() >= 20, "expected the full case list, found {}", cases.len());
    let failures = failing_cases(&mut HashMap::new(), &cases);
    assert!(failures.is_empty(), "cases off diffusers on {}: {failures:?}", test_device().label);
}

/// Runs `cases` on `models` (loaded as they are first needed), printing each one's distance to its golden; the
/// names of those off the device's tolerances.
pub(crate) fn failing_cases(models: &mut HashMap<String, SdModel>, cases: &[Value]) -> Vec<String> {
    let tol = test_device().tolerance;
    let mut failures = Vec::new();
    for case in cases {
        let name = case["case"].as_str().unwrap_or("?");
        let r = run_case(models, case);
        let total = 64 * 64 * 3;
        let reference = case["reference"].as_str().map(|r| format!(" ({r})")).unwrap_or_default();
        eprintln!(
            "{name:28}{reference} latent rel diff {:.2e}  pixels off by >1: {}/{total}  max level diff {}",
            r.latent_rel, r.pixels_off, r.max_level_diff
        );
        let latents_off = r.latent_rel.is_nan() || r.latent_rel > tol.latent_rel;
        if latents_off || r.pixels_off as f32 > tol.pixels_off * total as f32 {
            failures.push(name.to_string());
        }
    }
    failures
}

/// On CUDA the UNet's third and later calls with one shape replay a recorded graph: a replay must compute from
/// the inputs it is given (not the recorded call's) and match what the first, kernel-by-kernel call gave
/// ([`widened_unet`]).
#[test]
fn replayed_unet_steps_match_the_kernel_by_kernel_step() {
    let (dev, dtype) = (&test_device().device, test_device().dtype);
    let unet = widened_unet();
    let wave = |shape: &[usize], k: f64| wave(shape, k, dtype, dev);
    let input = |k: f64| (wave(&[2, 4, 16, 16], k), wave(&[2, 7, 32], 1.7 * k));
    let ((x1, c1), (x2, c2)) = (input(0.37), input(0.91));
    let step = |x: &Tensor, t: f64, c: &Tensor| unet.forward(x, t, c, None).unwrap();
    let first = step(&x1, 999.0, &c1);
    let second = step(&x2, 500.0, &c2);
    let first_again = step(&x1, 999.0, &c1);
    let second_again = step(&x2, 500.0, &c2);
    let (recorded, refused) = unet.graph_status();
    eprintln!("recorded graphs: {recorded}, refused: {refused:?}");
    // The configuration the GPU workers serve (f16/bf16 channels-last) must replay; elsewhere a refusal is fine.
    if sdhive_cuda_kernels::graphs_on(dev) && sdhive_cuda_kernels::channels_last_on(dev, dtype) {
        assert_eq!(
            (recorded, refused.len()),
            (1, 0),
            "the second call of the shape records a graph: {refused:?}"
        );
    }
    let scale = max_abs(&first).max(1.0);
    let tol = if dtype == DType::F32 { 1e-5 } else { 2e-3 };
    let d1 = max_diff(&first, &first_again) / scale;
    let d2 = max_diff(&second, &second_again) / scale;
    let apart = max_diff(&first, &second) / scale;
    eprintln!("replay vs first run: {d1:.2e}, {d2:.2e} (the two inputs' outputs differ by {apart:.2e})");
    assert!(d1 <= tol && d2 <= tol, "replayed step differs: {d1:.2e}, {d2:.2e} > {tol:.0e}");
    assert!(apart > 100.0 * tol, "the two inputs gave nearly the same output ({apart:.2e})");
    // Two more shapes push the first recording out (two are kept); the first shape then starts over and still
    // computes the same.
    for (b, side) in [(1, 16), (1, 16), (1, 16), (2, 8)] {
        step(&wave(&[b, 4, side, side], 0.5), 700.0, &wave(&[b, 7, 32], 0.8));
    }
    let after = step(&x1, 999.0, &c1);
    let d3 = max_diff(&first, &after) / scale;
    eprintln!("after evicting its recording: {d3:.2e}; graphs now {:?}", unet.graph_status());
    assert!(d3 <= tol, "the first shape after eviction differs: {d3:.2e}");
}

/// A thread that records batches ([`sdhive_models::record_batches`], as a batching engine's does) replays every
/// batch size up to its limit from a recording of its own, each computing from its inputs what the
/// kernel-by-kernel call gives, and keeps them all with the single image's; larger batches, and every batch on
/// another thread, run kernel by kernel.
#[test]
fn batched_steps_replay_on_a_thread_that_records_batches() {
    let (dev, dtype) = (test_device().device.clone(), test_device().dtype);
    let unet = widened_unet();
    let records = sdhive_cuda_kernels::graphs_on(&dev) && sdhive_cuda_kernels::channels_last_on(&dev, dtype);
    let input =
        |b: usize, k: f64| (wave(&[b, 4, 16, 16], k, dtype, &dev), wave(&[b, 7, 32], 1.7 * k, dtype, &dev));
    let step = |(x, c): &(Tensor, Tensor), t: f64| unet.forward(x, t, c, None).unwrap();
    let tol = if dtype == DType::F32 { 1e-5 } else { 2e-3 };
    std::thread::scope(|s| {
        s.spawn(|| {
            sdhive_models::record_batches(3);
            // Batches of 1, 4 and 6 rows (guided images count two), then 7 rows: past the limit.
            for b in [1, 4, 6, 7] {
                let (a, other) = (input(b, 0.37), input(b, 0.91));
                let first = step(&a, 999.0);
                let second = step(&other, 500.0);
                let (first_again, second_again) = (step(&a, 999.0), step(&other, 500.0));
                let scale = max_abs(&first).max(1.0);
                let (d1, d2) =
                    (max_diff(&first, &first_again) / scale, max_diff(&second, &second_again) / scale);
                let apart = max_diff(&first, &second) / scale;
                eprintln!("batch {b}: replay vs first run {d1:.2e}, {d2:.2e} (inputs apart {apart:.2e})");
                assert!(d1 <= tol && d2 <= tol, "batch {b}: replayed step differs: {d1:.2e}, {d2:.2e}");
                assert!(apart > 100.0 * tol, "batch {b}: the two inputs gave nearly the same output");
            }
            let (recorded, refused) = unet.graph_status();
            eprintln!("recorded graphs: {recorded}, refused: {refused:?}");
            if records {
                assert_eq!((recorded, refused.len()), (3, 0), "batches of 1, 4 and 6 rows recorded and kept");
            }
        })
        .join()
        .unwrap();
    });
    // This thread does not record batches: a batch of 4 rows runs kernel by kernel (its first call would have
    // left a slot warming); the same batch's recording stays the other thread's.
    let before = unet.graph_status();
    let x = input(4, 0.5);
    let (a, b) = (step(&x, 300.0), step(&x, 300.0));
    assert!(max_diff(&a, &b) / max_abs(&a).max(1.0) <= tol);
    assert_eq!(
        unet.graph_status(),
        before,
        "a thread that does not record batches leaves the recordings alone"
    );
}

/// The fixture's two-level UNet widened to what the fused GPU path takes (GroupNorm groups of 4 and 8 channels,
/// head dimensions 16 and 32), with deterministic random weights, on the test device.
fn widened_unet() -> sdhive_models::unet::UNet2DConditionModel {
    use sdhive_models::unet::{UNet2DConditionConfig, UNet2DConditionModel};
    let (dev, dtype) = (&test_device().device, test_device().dtype);
    let mut cfg = UNet2DConditionConfig::from_file(&fixtures().join("models/sd1/unet/config.json")).unwrap();
    cfg.block_out_channels = vec![128, 256];
    UNet2DConditionModel::new(sdhive_models::random_var_builder(dtype, dev), &cfg).unwrap()
}

/// Deterministic, input-dependent values on `dev`: sin of a scaled index.
fn wave(shape: &[usize], k: f64, dtype: DType, dev: &Device) -> Tensor {
    let n: usize = shape.iter().product();
    let i = Tensor::arange(0u32, n as u32, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    (i * k).unwrap().sin().unwrap().reshape(shape).unwrap().to_dtype(dtype).unwrap().to_device(dev).unwrap()
}

/// On CUDA the text encoder's layers replay a recorded graph from the second call of a token shape on, which must
/// encode the ids it is given and give what the kernel-by-kernel encoder gives, bit for bit, in every hidden state
/// clip skip reads, the final norm's output and the pooled embedding: SD1.5's encoder with deterministic random
/// weights (off CUDA a narrow one, where nothing records and the two instances must still agree).
#[test]
fn replayed_text_encodes_match_the_kernel_by_kernel_encode() {
    use sdhive_models::{ClipTextConfig, ClipTextModel};
    let (dev, dtype) = (&test_device().device, test_device().dtype);
    let mut cfg = ClipTextConfig::sd15();
    if !dev.is_cuda() {
        (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads) =
            (64, 128, 3, 4);
    }
    let build = |graphs: bool| {
        let mut m = ClipTextModel::new(sdhive_models::random_var_builder(dtype, dev), &cfg, false).unwrap();
        m.set_cuda_graphs(graphs);
        m
    };
    let (graphed, plain) = (build(true), build(false));
    let ids = |first: u32| {
        let ids: Vec<u32> = (0..77u32).map(|i| if i < 12 { first + i * 31 } else { 49407 }).collect();
        Tensor::from_vec(ids, (1, 77), dev).unwrap()
    };
    let (a, b) = (ids(400), ids(9000));
    let same = |what: &str, x: &sdhive_models::ClipTextOutput, y: &sdhive_models::ClipTextOutput| {
        for (i, (p, q)) in x.hidden_states.iter().zip(&y.hidden_states).enumerate() {
            let d = max_diff(p, q);
            assert!(d == 0.0, "{what}: hidden state {i} differs from the kernel-by-kernel one by {d:.2e}");
        }
        assert_eq!(x.hidden_states.len(), y.hidden_states.len());
        let d = max_diff(&x.last_hidden_state, &y.last_hidden_state);
        assert!(d == 0.0, "{what}: the final norm's output differs by {d:.2e}");
        let d = max_diff(&x.pooled, &y.pooled);
        assert!(d == 0.0, "{what}: the pooled embedding differs by {d:.2e}");
    };
    // The first call of a shape runs kernel by kernel, the second records and replays, the third replays.
    let first = graphed.forward(&a).unwrap();
    let second = graphed.forward(&b).unwrap();
    let again = graphed.forward(&a).unwrap();
    let (plain_a, plain_b) = (plain.forward(&a).unwrap(), plain.forward(&b).unwrap());
    eprintln!("text encoder graphs {:?}", graphed.graph_status());
    same("first encode", &first, &plain_a);
    same("recording encode", &second, &plain_b);
    same("replayed encode", &again, &plain_a);
    assert!(
        max_diff(&plain_a.last_hidden_state, &plain_b.last_hidden_state) > 0.0,
        "two prompts gave one encoding"
    );
    let (recorded, refused) = graphed.graph_status();
    // The layers record where their self-attention runs on the fused causal kernel (f16/bf16).
    if sdhive_cuda_kernels::graphs_on(dev) && dtype != DType::F32 {
        assert_eq!((recorded, refused.len()), (1, 0), "the second encode of a shape records: {refused:?}");
    } else {
        assert_eq!(recorded, 0, "nothing records off CUDA");
    }
    assert_eq!(plain.graph_status().0, 0, "an encoder with graphs off records nothing");
}

/// On CUDA the VAE decoder's second and later decodes of a latent shape replay a recorded graph (where it keeps
/// its maps channels-last: f16/bf16 with cuDNN), which must compute from the latents it is given and give what the
/// kernel-by-kernel decode gives, bit for bit: SD1.5's 512², a 384×640 image, SDXL's 1024² (the same network), a
/// tiled decode whose tiles replay, and the upcast f32 decoder with TF32 convolutions, which never records. The
/// networks have the released architecture and deterministic random weights; off CUDA a narrow one, where nothing
/// records and the two instances must still agree.
#[test]
fn replayed_vae_decodes_match_the_kernel_by_kernel_decode() {
    use sdhive_models::vae::{sd15_vae_config, AutoencoderKL, AutoencoderKLConfig};
    let (dev, dtype) = (&test_device().device, test_device().dtype);
    let gpu = dev.is_cuda();
    let mut cfg = sd15_vae_config();
    if !gpu {
        cfg.block_out_channels = vec![32, 64];
        cfg.down_block_types.truncate(2);
        cfg.up_block_types.truncate(2);
        cfg.sample_size = sdhive_models::IntOrList::Int(64);
    }
    let build = |cfg: &AutoencoderKLConfig, dtype: DType, graphs: bool| {
        let mut vae = AutoencoderKL::new(sdhive_models::random_var_builder(dtype, dev), cfg).unwrap();
        vae.set_cuda_graphs(graphs);
        vae
    };
    let (graphed, plain) = (build(&cfg, dtype, true), build(&cfg, dtype, false));
    let records = sdhive_cuda_kernels::graphs_on(dev) && sdhive_cuda_kernels::channels_last_on(dev, dtype);
    let same = |what: &str, a: &Tensor, b: &Tensor| {
        let d = max_diff(a, b);
        assert!(d == 0.0, "{what}: the graphed decode differs from the kernel-by-kernel one by {d:.2e}");
    };
    let sizes: &[(usize, usize)] = if gpu { &[(64, 64), (48, 80), (128, 128)] } else { &[(8, 8), (6, 10)] };
    for &(h, w) in sizes {
        let (a, b) = (wave(&[1, 4, h, w], 0.37, dtype, dev), wave(&[1, 4, h, w], 0.91, dtype, dev));
        // The first decode of a shape runs kernel by kernel, the second records and replays, the third replays.
        let first = graphed.decode(&a).unwrap();
        let second = graphed.decode(&b).unwrap();
        let again = graphed.decode(&a).unwrap();
        let (plain_a, plain_b) = (plain.decode(&a).unwrap(), plain.decode(&b).unwrap());
        let apart = max_diff(&plain_a, &plain_b);
        eprintln!(
            "latent {h}×{w}: the two latents' images differ by {apart:.2e}; graphs {:?}",
            graphed.graph_status()
        );
        same("first decode", &first, &plain_a);
        same("recording decode", &second, &plain_b);
        same("replayed decode", &again, &plain_a);
        assert!(apart > 0.0, "two latents gave the same image");
    }
    let (recorded, refused) = graphed.graph_status();
    if records {
        // Two shapes are kept: 512² went when 1024² came.
        assert_eq!((recorded, refused.len()), (2, 0), "the second decode of a shape records: {refused:?}");
    } else {
        assert_eq!(recorded, 0, "nothing records off the channels-last CUDA path");
    }
    assert_eq!(plain.graph_status().0, 0, "a VAE with graphs off records nothing");

    // Tiles of 64 latents every 48 (cfg.tile_latent_size()): a 112² latent is three rows of 64, 64 and 16 latents
    // high, each of three tiles 64, 64 and 16 wide, so within one decode the 64² and 64×16 tiles record and replay.
    let side = 7 * cfg.tile_latent_size() / 4;
    let z = wave(&[1, 4, side, side], 0.53, dtype, dev);
    let tiled = graphed.decode_tiled(&z).unwrap();
    same("tiled decode", &tiled, &plain.decode_tiled(&z).unwrap());
    eprintln!("tiled {side}² decode: graphs {:?}", graphed.graph_status());
    if records {
        assert_eq!(graphed.graph_status().0, 1, "the last row's 16×64 tiles replay");
    }

    // The upcast SDXL decoder: f32 with TF32 convolutions, NCHW, so run kernel by kernel however often it is called.
    if gpu && dtype != DType::F32 {
        let _tf32 = sdhive_models::ops::tf32_convolutions();
        let upcast = build(&cfg, DType::F32, true);
        let z = wave(&[1, 4, 64, 64], 0.37, DType::F32, dev);
        let runs: Vec<Tensor> = (0..3).map(|_| upcast.decode(&z).unwrap()).collect();
        assert_eq!(upcast.graph_status(), (0, vec![]), "the NCHW decoder is not recorded");
        let d = max_diff(&runs[0], &runs[2]);
        assert!(d == 0.0, "the f32 decoder's repeated decodes differ by {d:.2e}");
    }
}

fn max_abs(t: &Tensor) -> f32 {
    t.to_dtype(DType::F32).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}

#[test]
fn the_golden_latents_are_not_trivially_equal() {
    // Guards the comparison itself: two different cases must differ well beyond the tolerance above.
    let dev = Device::Cpu;
    let g = |f: &str| candle_core::safetensors::load(fixtures().join("golden").join(f), &dev).unwrap();
    let a: Tensor = g("pipe_sd1_euler.safetensors")["latents"].clone();
    let b: Tensor = g("pipe_sd1_euler_a.safetensors")["latents"].clone();
    let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(d > 1e-2, "distinct cases should have distinct latents, max diff {d}");
}

/// Max |a − b| in f32; in half precision relative to b's magnitude (at least 1), as rounding error scales with it.
/// Computed on the host, where a NaN makes the result NaN (a GPU max reduction may skip it).
fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let host = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (a, b) = (host(a), host(b));
    assert_eq!(a.len(), b.len(), "compared tensors differ in size");
    let d = a.iter().zip(&b).fold(0f32, |m, (x, y)| {
        if (x - y).is_nan() || m.is_nan() {
            f32::NAN
        } else {
            m.max((x - y).abs())
        }
    });
    if test_device().dtype == DType::F32 {
        return d;
    }
    d / b.iter().fold(1f32, |m, v| m.max(v.abs()))
}

/// The conditioning tensors equal diffusers' `encode_prompt` for every fixture model (positive, empty negative,
/// SDXL pooled embeddings and zeroed negatives, clip skip) within 1e-4.
#[test]
fn prompt_conditioning_matches_diffusers_encode_prompt() {
    let (dev, dtype) = (&test_device().device, test_device().dtype);
    let tol = test_device().tolerance.text;
    let prompt = "a photo of an astronaut riding a horse";
    for name in ["sd1", "sd2v", "sdxl", "sd1-inpaint"] {
        let model = SdModel::from_diffusers_dir(name, &fixtures().join("models").join(name), dev, dtype)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let golden =
            candle_core::safetensors::load(fixtures().join(format!("golden/text_{name}.safetensors")), dev)
                .unwrap();
        let pair = encode_pair(&model, prompt, "", 1).unwrap();
        let mut checks = vec![("prompt_embeds", max_diff(&pair.positive.context, &golden["prompt_embeds"]))];
        if name == "sdxl" {
            // The golden encodes the literal "" negative; an empty SDXL negative means zeros here, as in diffusers'
            // pipeline call without a negative prompt (`force_zeros_for_empty_prompt`).
            let pooled = pair.positive.pooled.as_ref().expect("sdxl pooled");
            let neg_pooled = pair.negative.pooled.as_ref().expect("sdxl negative pooled");
            checks.push(("pooled_prompt_embeds", max_diff(pooled, &golden["pooled_prompt_embeds"])));
            checks.push((
                "zeroed negative_prompt_embeds",
                max_diff(&pair.negative.context, &pair.negative.context.zeros_like().unwrap()),
            ));
            checks.push(("zeroed negative_pooled", max_diff(neg_pooled, &neg_pooled.zeros_like().unwrap())));
            assert_eq!(pair.negative.context.dims(), pair.positive.context.dims());
        } else {
            checks.push((
                "negative_prompt_embeds",
                max_diff(&pair.negative.context, &golden["negative_prompt_embeds"]),
            ));
        }
        if let Some(want) = golden.get("prompt_embeds_clipskip1") {
            // diffusers' clip_skip=1 is A1111's "Clip skip: 2".
            let skipped = encode_positive(&model, prompt, 2).unwrap();
            checks.push(("prompt_embeds_clipskip1", max_diff(&skipped.context, want)));
        }
        for (what, d) in checks {
            eprintln!("{name:12} {what:32} max diff {d:.2e}");
            assert!(d < tol, "{name}: {what} differs from diffusers by {d} on {}", test_device().label);
        }
    }
}

/// A single-file checkpoint in the original LDM layout, loaded with the fixture folder as its config (diffusers'
/// `from_single_file(config=…)`), makes the same images as the diffusers folder it was converted from.
#[test]
fn single_file_checkpoint_generates_the_diffusers_images() {
    let (dev, dtype) = (&test_device().device, test_device().dtype);
    let folder = fixtures().join("models/sd1");
    let model = SdModel::from_single_file(
        "sd1",
        &fixtures().join("models/sd1.safetensors"),
        Some(&folder),
        dev,
        dtype,
    )
    .expect("loading tests/fixtures/models/sd1.safetensors");
    let mut models = HashMap::from([("sd1".to_string(), model)]);
    check_cases(&mut models, &["sd1_euler", "sd1_euler_a", "sd1_img2img_ddim"], "single-file");
}

/// Runs the named pipeline cases on `models` and holds each to the device's tolerances; every name must exist.
pub(crate) fn check_cases(models: &mut HashMap<String, SdModel>, picked: &[&str], label: &str) {
    let tol = test_device().tolerance;
    let mut ran = 0;
    for case in cases().iter().filter(|c| picked.contains(&c["case"].as_str().unwrap_or(""))) {
        let r = run_case(models, case);
        eprintln!(
            "{label} {}: latent rel diff {:.2e}, pixels off {}",
            case["case"], r.latent_rel, r.pixels_off
        );
        assert!(
            r.latent_rel <= tol.latent_rel && r.pixels_off as f32 <= tol.pixels_off * (64 * 64 * 3) as f32,
            "{label} {} off diffusers",
            case["case"]
        );
        ran += 1;
    }
    assert_eq!(ran, picked.len());
}

/// `--placement te=cpu --offload te,vae`: the text encoders run on the CPU in f32 and, like the VAE, are built
/// from host memory at each use; images still match diffusers (txt2img on both families, img2img and inpaint
/// through the offloaded VAE encoder), from a folder and from a single file.
#[test]
fn placed_and_offloaded_networks_generate_the_diffusers_images() {
    let (dev, dtype) = (&test_device().device, test_device().dtype);
    let tol = test_device().tolerance;
    let targets = Targets {
        unet: ModuleTarget { device: dev.clone(), dtype, offload: false, host_copy: false },
        text: ModuleTarget { device: Device::Cpu, dtype: DType::F32, offload: true, host_copy: false },
        vae: ModuleTarget { device: dev.clone(), dtype, offload: true, host_copy: false },
    };
    let load = |name: &str| {
        let model = SdModel::from_diffusers_dir_on(name, &fixtures().join("models").join(name), &targets)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(model.vae.offloaded() && model.encoders.iter().all(|e| e.model.offloaded()));
        assert!(!model.unet.offloaded() && model.encoders[0].model.device().is_cpu());
        model
    };
    let mut models: HashMap<String, SdModel> =
        ["sd1", "sdxl"].iter().map(|n| (n.to_string(), load(n))).collect();
    // Offloaded networks hold no device memory between jobs.
    assert_eq!(models["sd1"].resident_bytes_on(dev), models["sd1"].unet.resident_bytes());
    let picked = ["sd1_euler", "sd1_img2img_ddim", "sd1_inpaint_s075", "sdxl_euler"];
    check_cases(&mut models, &picked, "placed/offloaded");
    let single = SdModel::from_single_file_on(
        "sd1",
        &fixtures().join("models/sd1.safetensors"),
        Some(&fixtures().join("models/sd1")),
        &targets,
    )
    .expect("loading tests/fixtures/models/sd1.safetensors");
    assert!(single.vae.offloaded());
    let mut models = HashMap::from([("sd1".to_string(), single)]);
    let case = cases().into_iter().find(|c| c["case"] == "sd1_euler").expect("sd1_euler case");
    let r = run_case(&mut models, &case);
    assert!(
        r.latent_rel <= tol.latent_rel,
        "single file, placed/offloaded: latent rel diff {}",
        r.latent_rel
    );
}

/// A standalone VAE file in place of the model's own (A1111's `sd_vae`): the images diffusers makes with
/// `vae=AutoencoderKL.from_single_file(<file>, config=<sd1>, subfolder="vae")` (`golden/external_vae.json`, whose
/// VAE changes the image by up to 245 levels), through a diffusers folder, and through a single file whose
/// config folder sits beside it, loaded by [`SdModel::load`] as a worker does.
#[test]
fn external_vae_generates_the_diffusers_images() {
    let (dev, dtype) = (&test_device().device, test_device().dtype);
    let tol = test_device().tolerance;
    let records: Vec<Value> = serde_json::from_slice(
        &std::fs::read(fixtures().join("golden/external_vae.json"))
            .expect("tests/fixtures/golden/external_vae.json"),
    )
    .expect("external_vae.json");
    assert_eq!(records.len(), 2);
    for source in ["sd1", "sd1.safetensors"] {
        for case in &records {
            let vae = fixtures().join("models").join(case["vae"].as_str().expect("vae"));
            let resolved = sdhive_modelsource::resolve(
                &fixtures().join("models").join(source).to_string_lossy(),
                &Default::default(),
            )
            .expect("fixture model");
            let resolved = sdhive_modelsource::ResolvedModel { vae: Some(vae), ..resolved };
            let model = SdModel::load(&resolved, &Targets::all(dev, dtype)).expect("sd1 with the other VAE");
            let mut models = HashMap::from([("sd1".to_string(), model)]);
            let r = run_case(&mut models, case);
            eprintln!(
                "{source} + sd1-alt VAE {}: latent rel diff {:.2e}, pixels off {}",
                case["case"], r.latent_rel, r.pixels_off
            );
            assert!(
                r.latent_rel <= tol.latent_rel
                    && r.pixels_off as f32 <= tol.pixels_off * (64 * 64 * 3) as f32,
                "{source} {} with the other VAE is off diffusers",
                case["case"]
            );
        }
    }
}

/// A file that is no VAE is refused at load, naming the file; the model keeps its own VAE.
#[test]
fn a_file_that_is_no_vae_is_refused() {
    let (dev, dtype) = (&test_device().device, test_device().dtype);
    let mut model =
        SdModel::from_diffusers_dir("sd1", &fixtures().join("models/sd1"), dev, dtype).expect("sd1");
    let target = ModuleTarget { device: dev.clone(), dtype, offload: false, host_copy: false };
    let junk = fixtures().join("models/sd1/text_encoder/model.safetensors");
    let err = model.replace_vae(&junk, &target).expect_err("a text encoder is no VAE").to_string();
    assert!(err.contains("model.safetensors"), "{err}");
    let mut models = HashMap::from([("sd1".to_string(), model)]);
    check_cases(&mut models, &["sd1_euler"], "after a refused VAE");
}
