//! `Sd3Engine`: the [`Engine`] over [`Sd3Model`], so a worker serves SD3 / SD3.5 diffusers folders through the
//! same routes as SD1/SDXL. What it runs today: text-to-image and image-to-image with the flow-matching Euler
//! sampler, n images from seed, seed+1, …, progress after every step and cancellation between steps, A1111
//! infotext. What it refuses, naming the field: inpainting, hires fix, LoRAs and embeddings, and samplers other than
//! Euler (A1111's default `Euler a` runs as Euler: flow models have one sampler here, and the infotext says so).

use crate::engine::finished_image;
use crate::sd3::{Sd3Error, Sd3Model, Sd3Request};
use candle_core::{DType, Device};
use sdhive_engine::extra_networks::strip_networks;
use sdhive_engine::{
    random_seed, Control, Engine, EngineError, EngineInfo, GenerateOutput, GenerateRequest, GeneratedImage,
    Limits, PreviewDecoder, Progress, Sampler, ValidationError,
};
use sdhive_tokenizer::T5_DEFAULT_MAX_LEN;
use std::path::Path;

pub struct Sd3Engine {
    model: Sd3Model,
    name: String,
    dtype: DType,
    backend_name: String,
    device_name: String,
    limits: Limits,
}

/// Whether `dir` holds a diffusers SD3-family pipeline (`model_index.json` names `StableDiffusion3…`).
pub fn is_sd3_folder(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("model_index.json"))
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|v| v["_class_name"].as_str().map(|c| c.starts_with("StableDiffusion3")))
        .unwrap_or(false)
}

fn invalid(field: &'static str, message: impl Into<String>) -> EngineError {
    EngineError::Invalid(ValidationError { field, message: message.into() })
}

impl Sd3Engine {
    /// Loads every network on `device` in `dtype`; `with_t5: false` leaves T5 out (its context part is zeros).
    pub fn load(
        dir: &Path,
        name: &str,
        device: &Device,
        dtype: DType,
        with_t5: bool,
        (backend_name, device_name): (&str, &str),
    ) -> Result<Sd3Engine, Sd3Error> {
        Ok(Sd3Engine {
            model: Sd3Model::from_dir(dir, dtype, device, with_t5)?,
            name: name.into(),
            dtype,
            backend_name: backend_name.into(),
            device_name: device_name.into(),
            limits: Limits::default(),
        })
    }

    /// Serves an already loaded model (e.g. [`Sd3Model::from_single_file`]) in `dtype`.
    pub fn from_model(
        model: Sd3Model,
        name: &str,
        dtype: DType,
        (backend_name, device_name): (&str, &str),
    ) -> Sd3Engine {
        Sd3Engine {
            model,
            name: name.into(),
            dtype,
            backend_name: backend_name.into(),
            device_name: device_name.into(),
            limits: Limits::default(),
        }
    }

    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    fn native_size(&self) -> u32 {
        (self.model.transformer.config().sample_size * 8) as u32
    }

    /// What this engine cannot do yet, refused before anything runs.
    fn check(&self, req: &GenerateRequest) -> Result<(), EngineError> {
        if req.mask.is_some() {
            return Err(invalid("mask", "inpainting is not available for SD3 models yet"));
        }
        if req.hires.is_some() {
            return Err(invalid("enable_hr", "hires fix is not available for SD3 models yet"));
        }
        if !req.loras.is_empty() {
            return Err(invalid("prompt", "LoRAs (<lora:…>) are not available for SD3 models yet"));
        }
        if !req.embeddings.is_empty() {
            return Err(invalid("prompt", "textual-inversion embeddings do not apply to SD3 models"));
        }
        if !matches!(req.sampler, Sampler::Euler | Sampler::EulerA) {
            return Err(invalid(
                "sampler",
                format!(
                    "SD3 models run the flow-matching Euler sampler (`Euler`), not `{}`",
                    req.sampler.name()
                ),
            ));
        }
        Ok(())
    }
}

impl Engine for Sd3Engine {
    fn info(&self) -> EngineInfo {
        let size = self.native_size();
        EngineInfo {
            engine: "candle".into(),
            backend: self.backend_name.clone(),
            device: self.device_name.clone(),
            dtype: match self.dtype {
                DType::F16 => "f16",
                DType::BF16 => "bf16",
                _ => "f32",
            }
            .into(),
            model: self.name.clone(),
            family: "sd3".into(),
            native_width: size,
            native_height: size,
            samplers: vec![Sampler::Euler.name().to_string()],
            supports_img2img: true,
            supports_inpaint: false,
            memory: None,
            text_widths: Vec::new(),
            preview: PreviewDecoder::Off,
        }
    }

    fn generate(
        &mut self,
        req: &GenerateRequest,
        progress: &mut dyn FnMut(&Progress) -> Control,
    ) -> Result<GenerateOutput, EngineError> {
        req.validate(&self.limits)?;
        self.check(req)?;
        let native = self.native_size();
        let (width, height) = req.output_size((native, native));
        let factor = (8 * self.model.transformer.config().patch_size) as u32;
        for (field, v) in [("width", width), ("height", height)] {
            if v % factor != 0 {
                return Err(invalid(
                    field,
                    format!("must be a multiple of {factor} for this model, got {v}"),
                ));
            }
        }
        // The infotext tells what ran.
        let ran = GenerateRequest { sampler: Sampler::Euler, ..req.clone() };
        let base_seed = req.seed.unwrap_or_else(random_seed);
        let mut images: Vec<GeneratedImage> = Vec::with_capacity(req.n as usize);
        for index in 0..req.n {
            let seed = base_seed.wrapping_add(u64::from(index));
            let job = Sd3Request {
                prompt: strip_networks(&req.prompt),
                negative_prompt: req.negative_prompt.clone(),
                width: width as usize,
                height: height as usize,
                steps: req.steps as usize,
                guidance_scale: f64::from(req.cfg_scale),
                seed,
                max_sequence_length: T5_DEFAULT_MAX_LEN,
                init_image: req.init_image.clone(),
                strength: f64::from(req.strength),
            };
            let mut on_step = |step: usize, steps: usize| {
                let p = Progress {
                    image: index,
                    images: req.n,
                    step: step as u32,
                    steps: steps as u32,
                    preview: None,
                };
                progress(&p) == Control::Continue
            };
            let out = match self.model.generate_with(&job, &mut on_step) {
                Ok(out) => out,
                Err(Sd3Error::Cancelled) => return Err(EngineError::Cancelled { done: images }),
                Err(Sd3Error::Invalid { field, message }) => return Err(invalid(field, message)),
                Err(e) => return Err(EngineError::Failed(e.to_string())),
            };
            images.push(finished_image(&ran, out.image, seed, (width, height), &self.name));
        }
        Ok(GenerateOutput { images })
    }
}
