//! End-to-end timing: a model folder loaded into the candle engine exactly as the workers load it, then whole
//! requests (text encoding, every denoising step with CFG, VAE decode, PNG-ready pixels; optionally a hires fix)
//! timed one by one.

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use sdhive_candle::{CandleEngine, LoadOptions};
use sdhive_engine::{Control, Engine, GenerateRequest, HiresFix};
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
