//! The SD3 / SD3.5 MMDiT against diffusers' `SD3Transformer2DModel` on the tiny random fixture models (f32, CPU):
//! SD3-medium-like (`sd3`), SD3.5-medium-like with a dual-attention block (`sd35m`) and SD3.5-large-like with
//! q/k RMSNorm (`sd35l`); plus loading errors and input checks.
//!
//! Fixtures: `<workspace>/tests/fixtures/{models,golden}` (override the root with `SDHIVE_FIXTURES`), written by
//! `xtask/fixtures/gen_sd3.py`. A missing fixture fails the test.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{fixtures, get, golden, max_diff};
use sdhive_models::{ModelError, SD3Transformer2DModel};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Allowed max |ours − diffusers| per unit of the output's largest magnitude (at least 1): random weights give
/// attention logits large enough for a near one-hot softmax, which scales f32 rounding with the outputs.
const TOL: f32 = 1e-4;

fn tolerance(want: &Tensor) -> f32 {
    let peak = want.abs().and_then(|t| t.flatten_all()?.max(0)?.to_scalar::<f32>()).expect("peak");
    TOL * peak.max(1.0)
}

fn transformer_dir(model: &str) -> PathBuf {
    let dir = fixtures().join("models").join(model).join("transformer");
    assert!(dir.is_dir(), "fixture model folder {} is missing", dir.display());
    dir
}

/// The golden call's output, and what the model makes of the same inputs.
fn run(model: &SD3Transformer2DModel, g: &HashMap<String, Tensor>) -> Tensor {
    model
        .forward(get(g, "latents"), get(g, "timestep"), get(g, "context"), get(g, "pooled"))
        .unwrap_or_else(|e| panic!("forward: {e}"))
}

fn parity(variant: &str) {
    let g = golden(&format!("sd3_transformer_{variant}.safetensors"));
    let model = SD3Transformer2DModel::from_dir(&transformer_dir(variant), DType::F32, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{variant}: {e}"));
    let want = get(&g, "out");
    let tol = tolerance(want);
    let d = max_diff(&format!("{variant} out"), &run(&model, &g), want);
    assert!(d <= tol && d.is_finite(), "{variant}: max abs diff {d} > {tol}");
    // Each sample alone gives its row of the batch: nothing leaks between the samples of a batch.
    let one = |key: &str| get(&g, key).narrow(0, 1, 1).expect("second sample");
    let alone = model
        .forward(&one("latents"), &one("timestep"), &one("context"), &one("pooled"))
        .unwrap_or_else(|e| panic!("forward: {e}"));
    let d = max_diff(&format!("{variant} second sample alone"), &alone, &one("out"));
    assert!(d <= tol, "{variant}: second sample alone differs by {d}");
}

#[test]
fn sd3_medium_matches_diffusers() {
    parity("sd3");
}

#[test]
fn sd35_medium_dual_attention_matches_diffusers() {
    parity("sd35m");
}

#[test]
fn sd35_large_qk_norm_matches_diffusers() {
    parity("sd35l");
}

/// `skip_layers` as diffusers' forward takes it (skip-layer guidance): on SD3.5-medium-like `sd35m`, block 0 (the
/// dual-attention block; the context passes it unchanged), block 1 (the context-pre-only last block) and both.
#[test]
fn skipped_layers_match_diffusers() {
    let g = golden("sd3_transformer_skip_sd35m.safetensors");
    let model = load(&transformer_dir("sd35m"));
    let (lat, t, ctx, pooled) =
        (get(&g, "latents"), get(&g, "timestep"), get(&g, "context"), get(&g, "pooled"));
    let full = model.forward(lat, t, ctx, pooled).expect("forward");
    for skip in [&[0usize][..], &[1], &[0, 1]] {
        let key = format!("out_skip_{}", skip.iter().map(|l| l.to_string()).collect::<Vec<_>>().join("_"));
        let want = get(&g, &key);
        let got = model.forward_skipping(lat, t, ctx, pooled, skip).unwrap_or_else(|e| panic!("{key}: {e}"));
        let d = max_diff(&key, &got, want);
        assert!(d <= tolerance(want), "{key}: max abs diff {d}");
        let moved = max_diff(&format!("{key} vs no skip"), &got, &full);
        assert!(moved > 100.0 * tolerance(want), "{key}: skipping changed the output by only {moved}");
    }
    let none = model.forward_skipping(lat, t, ctx, pooled, &[]).expect("forward");
    assert_eq!(max_diff("no skip", &none, &full), 0.0);
    match model.forward_skipping(lat, t, ctx, pooled, &[2]) {
        Err(e @ ModelError::Input { .. }) => assert!(e.to_string().contains("skip layer 2"), "{e}"),
        other => panic!("layer 2 of 2: expected an input error, got {other:?}"),
    }
}

/// The fixture folder copied with `drop` left out of its weights.
fn folder_without(variant: &str, drop: &str) -> tempfile::TempDir {
    let src = transformer_dir(variant);
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::copy(src.join("config.json"), tmp.path().join("config.json")).expect("copy config");
    let weights = src.join("diffusion_pytorch_model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &Device::Cpu).expect("weights");
    assert!(tensors.remove(drop).is_some(), "{drop} is not in {}", weights.display());
    candle_core::safetensors::save(&tensors, tmp.path().join("diffusion_pytorch_model.safetensors"))
        .expect("save");
    tmp
}

fn load(dir: &Path) -> SD3Transformer2DModel {
    SD3Transformer2DModel::from_dir(dir, DType::F32, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// Without the saved positional buffer the table is computed, to diffusers' values.
#[test]
fn computed_positional_table_matches_the_saved_one() {
    let dir = folder_without("sd3", "pos_embed.pos_embed");
    let model = load(dir.path());
    let g = golden("sd3_transformer_sd3.safetensors");
    let want = get(&g, "out");
    let d = max_diff("sd3 out, computed positions", &run(&model, &g), want);
    assert!(d <= tolerance(want), "computed positional table: {d}");
}

#[test]
fn missing_weights_are_named() {
    for (variant, name) in [
        ("sd3", "transformer_blocks.0.ff_context.net.2.weight"),
        ("sd35m", "transformer_blocks.0.attn2.norm_k.weight"),
        ("sd35l", "transformer_blocks.1.attn.norm_added_q.weight"),
    ] {
        let dir = folder_without(variant, name);
        let e = SD3Transformer2DModel::from_dir(dir.path(), DType::F32, &Device::Cpu)
            .err()
            .unwrap_or_else(|| panic!("{variant} loaded without {name}"));
        assert!(matches!(e, ModelError::Weights { .. }), "{e:?}");
        assert!(e.to_string().contains(name), "{variant}: `{e}` does not name {name}");
    }
}

#[test]
fn bad_inputs_are_refused() {
    let g = golden("sd3_transformer_sd3.safetensors");
    let model = load(&transformer_dir("sd3"));
    let (lat, t, ctx, pooled) =
        (get(&g, "latents"), get(&g, "timestep"), get(&g, "context"), get(&g, "pooled"));
    let dev = Device::Cpu;
    let zeros = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &dev).expect("zeros");
    let cases = [
        ("channels", model.forward(&zeros(&[2, 4, 8, 8]), t, ctx, pooled)),
        ("multiple of patch_size", model.forward(&zeros(&[2, 16, 7, 8]), t, ctx, pooled)),
        ("pos_embed_max_size", model.forward(&zeros(&[2, 16, 64, 8]), t, ctx, pooled)),
        ("timestep", model.forward(lat, &zeros(&[3]), ctx, pooled)),
        ("context", model.forward(lat, t, &zeros(&[2, 5, 7]), pooled)),
        ("pooled", model.forward(lat, t, ctx, &zeros(&[2, 3]))),
    ];
    for (what, r) in cases {
        match r {
            Err(e @ ModelError::Input { .. }) => assert!(e.to_string().contains(what), "{what}: {e}"),
            other => panic!("{what}: expected an input error, got {other:?}"),
        }
    }
}
