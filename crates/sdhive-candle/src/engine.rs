//! `CandleEngine`: the [`Engine`] implementation over candle. It validates a request against the loaded model,
//! encodes the prompts once per request and runs one denoising loop per image (seed, seed+1, …).

use crate::conditioning::{encode_pair, encode_positive};
use crate::model::{LoadError, SdModel};
use crate::pipeline::{
    generate_image, latent_preview, ImageJob, PipelineError, StepReport, UnetConditioning,
};
use candle_core::{DType, Device};
use sdhive_engine::{
    infotext, random_seed, Control, Engine, EngineError, EngineInfo, GenerateOutput, GenerateRequest,
    GeneratedImage, InfotextContext, Limits, Progress, Sampler, ValidationError,
};
use sdhive_modelsource::ResolvedModel;

/// Where and how to load the model.
pub struct LoadOptions {
    pub device: Device,
    pub dtype: DType,
    /// Shown in `info()`: the backend compiled into the binary and the device's name.
    pub backend_name: String,
    pub device_name: String,
}

pub struct CandleEngine {
    model: SdModel,
    device: Device,
    dtype: DType,
    backend_name: String,
    device_name: String,
    limits: Limits,
}

fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

impl CandleEngine {
    pub fn load(model: &ResolvedModel, opts: LoadOptions) -> Result<Self, LoadError> {
        let loaded = SdModel::load(model, &opts.device, opts.dtype)?;
        Ok(Self::from_model(loaded, opts))
    }

    pub fn from_model(model: SdModel, opts: LoadOptions) -> Self {
        CandleEngine {
            model,
            device: opts.device,
            dtype: opts.dtype,
            backend_name: opts.backend_name,
            device_name: opts.device_name,
            limits: Limits::default(),
        }
    }

    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    pub fn model(&self) -> &SdModel {
        &self.model
    }

    fn check_model_fit(&self, req: &GenerateRequest, width: u32, height: u32) -> Result<(), ValidationError> {
        let f = self.model.vae_scale_factor as u32;
        for (field, v) in [("width", width), ("height", height)] {
            if v % f != 0 {
                return Err(ValidationError {
                    field,
                    message: format!("must be a multiple of {f} for this model, got {v}"),
                });
            }
        }
        if self.model.unet_in_channels() == 9 && req.mask.is_none() {
            return Err(ValidationError {
                field: "mask",
                message: "this is an inpainting model: send an init image and a mask".into(),
            });
        }
        Ok(())
    }
}

impl Engine for CandleEngine {
    fn info(&self) -> EngineInfo {
        EngineInfo {
            engine: "candle".into(),
            backend: self.backend_name.clone(),
            device: self.device_name.clone(),
            dtype: dtype_name(self.dtype).into(),
            model: self.model.name.clone(),
            family: self.model.family.name().into(),
            native_width: self.model.native_size.0,
            native_height: self.model.native_size.1,
            samplers: Sampler::ALL.iter().map(|s| s.name().to_string()).collect(),
            supports_img2img: true,
            supports_inpaint: true,
            memory: None,
        }
    }

    fn generate(
        &mut self,
        req: &GenerateRequest,
        progress: &mut dyn FnMut(&Progress) -> Control,
    ) -> Result<GenerateOutput, EngineError> {
        req.validate(&self.limits)?;
        let (width, height) = req.output_size(self.model.native_size);
        self.check_model_fit(req, width, height)?;
        let base_seed = req.seed.unwrap_or_else(random_seed);
        let size = (width as usize, height as usize);
        let text_failed = |e: candle_core::Error| EngineError::Failed(format!("text encoder: {e}"));
        let guided = f64::from(req.cfg_scale) > 1.0;
        let cond = if guided {
            let pair =
                encode_pair(&self.model, &req.prompt, &req.negative_prompt, req.clip_skip, &self.device)
                    .map_err(text_failed)?;
            UnetConditioning::new(&self.model, &pair.positive, Some(&pair.negative), size)
        } else {
            let positive = encode_positive(&self.model, &req.prompt, req.clip_skip, &self.device)
                .map_err(text_failed)?;
            UnetConditioning::new(&self.model, &positive, None, size)
        }
        .map_err(text_failed)?;

        let mut images = Vec::with_capacity(req.n as usize);
        for index in 0..req.n {
            let seed = base_seed.wrapping_add(u64::from(index));
            let job = ImageJob {
                width: size.0,
                height: size.1,
                steps: req.steps as usize,
                cfg_scale: f64::from(req.cfg_scale),
                sampler: req.sampler,
                schedule: req.schedule,
                seed,
                init_image: req.init_image.as_ref(),
                mask: req.mask.as_ref(),
                strength: f64::from(req.strength),
            };
            let model = &self.model;
            let mut on_step = |r: StepReport<'_>| {
                let wants_preview =
                    req.preview_every > 0 && r.step.is_multiple_of(req.preview_every as usize);
                let preview = if wants_preview { latent_preview(model, r.estimate) } else { None };
                let p = Progress {
                    image: index,
                    images: req.n,
                    step: r.step as u32,
                    steps: r.steps as u32,
                    preview,
                };
                progress(&p) == Control::Continue
            };
            let image = generate_image(&self.model, &cond, &job, &self.device, &mut on_step).map_err(
                |e| match e {
                    PipelineError::Cancelled => EngineError::Cancelled,
                    PipelineError::Invalid { field, message } => {
                        EngineError::Invalid(ValidationError { field, message })
                    }
                    other => EngineError::Failed(other.to_string()),
                },
            )?;
            let ctx = InfotextContext {
                seed,
                width,
                height,
                model: &self.model.name,
                version: concat!("sdhive ", env!("CARGO_PKG_VERSION")),
            };
            images.push(GeneratedImage { image, seed, infotext: infotext(req, &ctx) });
        }
        Ok(GenerateOutput { images })
    }
}
