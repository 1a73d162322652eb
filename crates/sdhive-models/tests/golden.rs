//! Golden comparisons against diffusers/transformers outputs of tiny models (float32, CPU).
//!
//! Fixtures live in `<workspace>/tests/fixtures/{models,golden}` (override the root with
//! `SDHIVE_FIXTURES`). A missing fixture fails the test: silence would hide a broken setup.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{fixtures, get, golden, max_diff};
use sdhive_models::{AutoencoderKL, ClipTextModel, SdxlConditioning, UNet2DConditionModel};
use std::path::PathBuf;

const TOL: f32 = 1e-4;

fn model_dir(model: &str, component: &str) -> PathBuf {
    let dir = fixtures().join("models").join(model).join(component);
    assert!(dir.is_dir(), "fixture model folder {} is missing", dir.display());
    dir
}

fn check(results: &[(String, f32)]) {
    let worst = results.iter().cloned().fold(0f32, |a, (_, d)| a.max(d));
    eprintln!("worst max abs diff {worst:.3e}");
    for (what, d) in results {
        assert!(*d <= TOL && d.is_finite(), "{what}: max abs diff {d} > {TOL}");
    }
}

fn text_encoder_case(model: &str) {
    let g = golden(&format!("text_{model}.safetensors"));
    let dev = Device::Cpu;
    let mut encoders = vec![("te1", "text_encoder", false)];
    if g.contains_key("te2_last_p0") {
        encoders.push(("te2", "text_encoder_2", true));
    }
    let mut results = Vec::new();
    for (key, folder, proj) in encoders {
        let enc = ClipTextModel::from_dir(&model_dir(model, folder), proj, DType::F32, &dev)
            .unwrap_or_else(|e| panic!("{model}/{folder}: {e}"));
        for p in ["p0", "p1"] {
            // The second tokenizer pads differently, so SDXL goldens carry its own ids.
            let ids2 = format!("ids2_{p}");
            let ids = match g.get(&ids2) {
                Some(ids) if key == "te2" => ids,
                _ => get(&g, &format!("ids_{p}")),
            };
            let out = enc.forward(ids).unwrap_or_else(|e| panic!("{e}"));
            let tag = |n: &str| format!("{model} {key}_{n}_{p}");
            results.push((
                tag("last"),
                max_diff(&tag("last"), &out.last_hidden_state, get(&g, &format!("{key}_last_{p}"))),
            ));
            let hidden = Tensor::stack(&out.hidden_states, 0).expect("stack");
            results.push((
                tag("hidden"),
                max_diff(&tag("hidden"), &hidden, get(&g, &format!("{key}_hidden_{p}"))),
            ));
            results.push((
                tag("pooled"),
                max_diff(&tag("pooled"), &out.pooled, get(&g, &format!("{key}_pooled_{p}"))),
            ));
            if let Some(want) = g.get(&format!("{key}_text_embeds_{p}")) {
                let te = out.text_embeds.as_ref().expect("projection requested");
                results.push((tag("text_embeds"), max_diff(&tag("text_embeds"), te, want)));
            }
        }
    }
    check(&results);
}

fn unet_case(model: &str) {
    let g = golden(&format!("unet_{model}.safetensors"));
    let dev = Device::Cpu;
    let unet = UNet2DConditionModel::from_dir(&model_dir(model, "unet"), DType::F32, &dev)
        .unwrap_or_else(|e| panic!("{model}/unet: {e}"));
    let t = get(&g, "timestep")
        .to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .expect("timestep");
    let added = g
        .get("text_embeds")
        .map(|te| SdxlConditioning { text_embeds: te.clone(), time_ids: get(&g, "time_ids").clone() });
    let sample = get(&g, "sample");
    let ctx = get(&g, "encoder_hidden_states");
    let mut results = Vec::new();
    let steps = [(t[0], "out"), (1.0, "out_t1")];
    for (ts, key) in steps {
        let out = unet.forward(sample, ts, ctx, added.as_ref()).unwrap_or_else(|e| panic!("{e}"));
        let what = format!("{model} unet {key}");
        results.push((what.clone(), max_diff(&what, &out, get(&g, key))));
    }
    // The same steps reading their time rows from a schedule's table made in one pass.
    let batch = sample.dim(0).expect("batch");
    unet.prepare_timesteps(&[t[0], 500.0, 1.0], batch, added.as_ref()).unwrap_or_else(|e| panic!("{e}"));
    for (ts, key) in steps {
        assert!(
            unet.prepared_timestep(ts, batch, added.as_ref()),
            "{model}: t={ts} must come from the table"
        );
        let out = unet.forward(sample, ts, ctx, added.as_ref()).unwrap_or_else(|e| panic!("{e}"));
        let what = format!("{model} unet {key} (schedule table)");
        results.push((what.clone(), max_diff(&what, &out, get(&g, key))));
    }
    assert!(!unet.prepared_timestep(2.0, batch, added.as_ref()), "off the schedule");
    // One sample shared by every context (classifier-free guidance passes its latents once) against that sample
    // repeated to the batch, both from the table and not.
    let one = sample.narrow(0, 0, 1).expect("first sample");
    let repeated = Tensor::cat(&vec![&one; batch], 0).expect("repeat");
    for ts in [t[0], 2.0] {
        let want = unet.forward(&repeated, ts, ctx, added.as_ref()).unwrap_or_else(|e| panic!("{e}"));
        let got = unet.forward(&one, ts, ctx, added.as_ref()).unwrap_or_else(|e| panic!("{e}"));
        let what = format!("{model} unet t={ts}, one sample for {batch} contexts");
        results.push((what.clone(), max_diff(&what, &got, &want)));
    }
    check(&results);
}

fn vae_case(model: &str) {
    let g = golden(&format!("vae_{model}.safetensors"));
    let dev = Device::Cpu;
    let vae = AutoencoderKL::from_dir(&model_dir(model, "vae"), DType::F32, &dev)
        .unwrap_or_else(|e| panic!("{model}/vae: {e}"));
    let dist = vae.encode(get(&g, "image")).unwrap_or_else(|e| panic!("{e}"));
    let decoded = vae.decode(get(&g, "latent")).unwrap_or_else(|e| panic!("{e}"));
    let mut results = Vec::new();
    for (key, ours) in [("enc_mean", &dist.mean), ("enc_logvar", &dist.logvar), ("decoded", &decoded)] {
        let what = format!("{model} vae {key}");
        results.push((what.clone(), max_diff(&what, ours, get(&g, key))));
    }
    check(&results);
}

#[test]
fn text_sd1() {
    text_encoder_case("sd1");
}

#[test]
fn text_sd2v() {
    text_encoder_case("sd2v");
}

#[test]
fn text_sdxl() {
    text_encoder_case("sdxl");
}

#[test]
fn text_sd1_inpaint() {
    text_encoder_case("sd1-inpaint");
}

#[test]
fn unet_sd1() {
    unet_case("sd1");
}

#[test]
fn unet_sd2v() {
    unet_case("sd2v");
}

#[test]
fn unet_sdxl() {
    unet_case("sdxl");
}

#[test]
fn unet_sd1_inpaint() {
    unet_case("sd1-inpaint");
}

#[test]
fn vae_sd1() {
    vae_case("sd1");
}

#[test]
fn vae_sdxl() {
    vae_case("sdxl");
}

/// diffusers' `enable_tiling()` decode: same tiles, same blending, same crop (xtask/fixtures/gen_vae_tiled.py), on
/// SD1's VAE and SD3's (16 latent channels).
fn vae_tiled_case(model: &str) {
    let g = golden(&format!("vae_{model}_tiled.safetensors"));
    let vae = AutoencoderKL::from_dir(&model_dir(model, "vae"), DType::F32, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{model}/vae: {e}"));
    assert_eq!(vae.config().tile_latent_size(), 8);
    let latent = get(&g, "latent");
    let tiled = vae.decode_tiled(latent).unwrap_or_else(|e| panic!("{e}"));
    let plain = vae.decode(latent).unwrap_or_else(|e| panic!("{e}"));
    let (t, p) = (format!("{model} vae tiled decode"), format!("{model} vae plain decode"));
    check(&[
        (t.clone(), max_diff(&t, &tiled, get(&g, "decoded_tiled"))),
        (p.clone(), max_diff(&p, &plain, get(&g, "decoded_plain"))),
    ]);
    // Latents within one tile decode exactly as without tiling.
    let small = latent.narrow(2, 0, 8).and_then(|t| t.narrow(3, 0, 8)).expect("narrow");
    let (a, b) = (vae.decode_tiled(&small).expect("tiled"), vae.decode(&small).expect("plain"));
    assert_eq!(max_diff("one tile", &a, &b), 0.0);
}

#[test]
fn vae_sd1_tiled() {
    vae_tiled_case("sd1");
}

#[test]
fn vae_sd3_tiled() {
    vae_tiled_case("sd3");
}
