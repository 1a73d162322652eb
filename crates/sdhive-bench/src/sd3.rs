//! SD3 / SD3.5 timing (`--sd3 DIR`): a diffusers folder loaded into the candle engine's SD3 pipeline, then the
//! transformer step (one CFG call: batch 2, the joint context of 77 CLIP + 256 T5 tokens) at `--size`², and whole
//! images (`--steps` flow-Euler steps, CFG 7, text encoding and VAE decode included) — the work
//! `xtask/bench/bench_sd3_diffusers.py` times on diffusers' `StableDiffusion3Pipeline`. With `--batch N` also N
//! images (different prompts, seeds and CFG scales) denoised as one batch and decoded, against the images one by
//! one: what the worker's `--max-batch` does for SD3.

use crate::time_calls;
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use sdhive_candle::{Sd3Model, Sd3Request, Sd3Row};
use std::path::Path;
use std::time::Instant;

pub struct Settings<'a> {
    pub dir: &'a Path,
    pub dtype: DType,
    pub size: u32,
    pub steps: u32,
    pub with_t5: bool,
    pub warmup: usize,
    pub iters: usize,
    /// Images denoised together (1: none).
    pub batch: u32,
}

pub fn run(s: &Settings, dev: &Device) -> Result<serde_json::Value> {
    let t = Instant::now();
    let model = Sd3Model::from_dir(s.dir, s.dtype, dev, s.with_t5)
        .with_context(|| format!("--sd3 {}", s.dir.display()))?;
    crate::sync(dev)?;
    let load_ms = t.elapsed().as_secs_f64() * 1e3;
    eprintln!("loaded {} in {load_ms:.0} ms", s.dir.display());
    let cfg = model.transformer.config();
    let side = s.size as usize / 8;
    // 77 CLIP tokens and T5's 256 (diffusers' default `max_sequence_length`).
    let tokens = 77 + 256;
    let x = Tensor::randn(0f32, 1.0, (2, cfg.in_channels, side, side), dev)?.to_dtype(s.dtype)?;
    let context = Tensor::randn(0f32, 1.0, (2, tokens, cfg.joint_attention_dim), dev)?.to_dtype(s.dtype)?;
    let pooled = Tensor::randn(0f32, 1.0, (2, cfg.pooled_projection_dim), dev)?.to_dtype(s.dtype)?;
    let timesteps: Vec<Tensor> = (0..s.steps.max(1))
        .map(|i| Tensor::full(1000.0f32 - 30.0 * i as f32, 2, dev)?.to_dtype(s.dtype))
        .collect::<candle_core::Result<_>>()?;
    let mut i = 0;
    let mut call = || -> Result<()> {
        i += 1;
        model.transformer.forward(&x, &timesteps[i % timesteps.len()], &context, &pooled)?;
        Ok(())
    };
    for _ in 0..s.warmup.max(2) {
        call()?;
    }
    // The timed calls inside the CUDA profiler range, so a profile (`nsys --capture-range=cudaProfilerApi`) holds
    // those steps only.
    let step = crate::profiled(|| time_calls(dev, "transformer step", 0, s.iters.max(5), &mut call))?;
    if let Some(network) = model.transformer.get() {
        let (recorded, refused) = network.graph_status();
        eprintln!("MMDiT steps replayed from a CUDA graph: {}", if recorded > 0 { "yes" } else { "no" });
        for why in refused {
            eprintln!("CUDA graph refused: {why}");
        }
    }
    let mut request = Sd3Request::new("a photo of a cat sitting on a wooden table", 42);
    request.negative_prompt = "blurry".into();
    (request.width, request.height) = (s.size as usize, s.size as usize);
    request.steps = s.steps as usize;
    let image = time_calls(dev, "image", s.warmup, s.iters, || {
        model.generate(&request).map(|_| ()).context("generate")
    })?;
    let batch = if s.batch > 1 {
        let rows: Vec<Sd3Row> = (0..s.batch)
            .map(|i| Sd3Row {
                prompt: format!("{} number {i}", request.prompt),
                negative_prompt: request.negative_prompt.clone(),
                seed: 42 + u64::from(i),
                guidance_scale: 7.0 - f64::from(i) * 0.5,
                clip_skip: 1,
            })
            .collect();
        let timed = time_calls(dev, &format!("batch of {}", s.batch), s.warmup, s.iters, || {
            let latents =
                model.denoise_batch(&request, &rows, &mut |_, _, _| true).context("denoise_batch")?;
            for i in 0..rows.len() {
                model.decode(&latents.narrow(0, i, 1)?).context("decode")?;
            }
            Ok(())
        })?;
        let (batched, alone) = (timed.median_ms() / f64::from(s.batch), image.median_ms());
        eprintln!("batch of {}: {batched:.0} ms per image against {alone:.0} ms alone", s.batch);
        serde_json::json!({ "images": s.batch, "timed": timed, "ms_per_image": batched, "alone_ms": alone })
    } else {
        serde_json::Value::Null
    };
    Ok(serde_json::json!({
        "model": s.dir.file_name().map(|n| n.to_string_lossy().into_owned()),
        "size": s.size, "steps": s.steps, "t5": s.with_t5, "load_ms": load_ms,
        "step": step, "e2e": image, "batch": batch,
    }))
}
