//! End-to-end timing: a model folder loaded into the candle engine exactly as the workers load it, then whole
//! requests (text encoding, every denoising step with CFG, VAE decode, PNG-ready pixels; optionally a hires fix)
//! timed one by one — or, with `--batch N`, N requests of different prompts, seeds and CFG scales denoised as one
//! batch, with how far each batched image is from the image its request gets alone.

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use sdhive_candle::{CandleEngine, LoadOptions};
use sdhive_engine::{Control, Engine, GenerateRequest, HiresFix, RgbImage};
use std::path::Path;

pub struct EndToEnd {
    engine: CandleEngine,
    request: GenerateRequest,
}

impl EndToEnd {
    /// With `hires`, each request is a hires fix to twice `size`: "Latent", a second pass of `steps` steps at
    /// denoising strength 0.5.
    pub fn load(dir: &Path, dev: &Device, dtype: DType, size: u32, steps: u32, hires: bool) -> Result<Self> {
        let resolved = sdhive_modelsource::resolve(
            &dir.display().to_string(),
            &sdhive_modelsource::ResolveOptions {
                offline: true,
                ..sdhive_modelsource::ResolveOptions::from_env()
            },
        )
        .with_context(|| format!("--e2e {}", dir.display()))?;
        let opts = LoadOptions::single_device(dev, dtype, "bench", "bench");
        let engine =
            CandleEngine::load(&resolved, opts).with_context(|| format!("loading {}", dir.display()))?;
        let request = GenerateRequest {
            prompt: "a photo of a cat sitting on a wooden table".into(),
            negative_prompt: "blurry".into(),
            width: Some(size),
            height: Some(size),
            steps,
            cfg_scale: 7.0,
            seed: Some(42),
            hires: hires.then(|| HiresFix { steps, denoising_strength: 0.5, ..HiresFix::default() }),
            ..GenerateRequest::default()
        };
        Ok(Self { engine, request })
    }

    /// One image; the output is read back to the host (the pixels), so the device has finished.
    pub fn generate(&mut self) -> Result<()> {
        let out = self.engine.generate(&self.request, &mut |_| Control::Continue).context("generate")?;
        anyhow::ensure!(out.images.len() == 1, "expected one image");
        Ok(())
    }
}

impl EndToEnd {
    /// `n` requests of one batch: the bench request with its own prompt, seed and CFG scale each.
    fn batch_requests(&self, n: u32) -> Vec<GenerateRequest> {
        (0..n)
            .map(|i| GenerateRequest {
                prompt: format!("{} number {i}", self.request.prompt),
                seed: Some(1000 + u64::from(i)),
                cfg_scale: 5.0 + i as f32 % 4.0,
                ..self.request.clone()
            })
            .collect()
    }

    /// Generates the batch's requests one by one: their images, and checks the output came back.
    pub fn alone(&mut self, n: u32) -> Result<Vec<RgbImage>> {
        let mut images = Vec::new();
        for req in self.batch_requests(n) {
            let out = self.engine.generate(&req, &mut |_| Control::Continue).context("generate")?;
            images.extend(out.images.into_iter().map(|i| i.image));
        }
        Ok(images)
    }

    /// The same requests as one batch.
    pub fn batched(&mut self, n: u32) -> Result<Vec<RgbImage>> {
        let reqs = self.batch_requests(n);
        let refs: Vec<&GenerateRequest> = reqs.iter().collect();
        let mut images = Vec::new();
        for result in self.engine.generate_batch(&refs, n, &mut |_, _| Control::Continue) {
            images.extend(result.context("batched generate")?.images.into_iter().map(|i| i.image));
        }
        anyhow::ensure!(images.len() == n as usize, "expected {n} images, got {}", images.len());
        Ok(images)
    }
}

/// Per image: the largest channel difference and the share of channel values more than one level apart.
pub fn drift(batched: &[RgbImage], alone: &[RgbImage]) -> Vec<serde_json::Value> {
    batched
        .iter()
        .zip(alone)
        .map(|(b, a)| {
            let max = b.data.iter().zip(&a.data).map(|(x, y)| x.abs_diff(*y)).max().unwrap_or(0);
            let off = b.data.iter().zip(&a.data).filter(|(x, y)| x.abs_diff(**y) > 1).count();
            serde_json::json!({"max_diff": max, "share_off_by_more_than_1": off as f64 / b.data.len().max(1) as f64})
        })
        .collect()
}
