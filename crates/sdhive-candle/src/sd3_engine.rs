//! `Sd3Engine`: the [`Engine`] over [`Sd3Model`], so a worker serves SD3 / SD3.5 diffusers folders through the
//! same routes as SD1/SDXL. What it runs today: text-to-image, image-to-image and inpainting (as diffusers'
//! `StableDiffusion3InpaintPipeline` with a 16-channel transformer; the mask as the SD1/SDXL engine takes it) with
//! the flow-matching Euler sampler, text-to-image also with DPM++ 2M on flow sigmas and with skip-layer guidance,
//! n images from seed, seed+1, … (with queued text-to-image jobs of one batch key, denoised as one batch: `batch.rs`),
//! progress after every step (with the latent preview of the step's estimate every
//! `preview_every` steps) and cancellation between steps, A1111 infotext, and each job's LoRAs merged into the
//! MMDiT and both CLIPs (`lora.rs`; put back exactly for the next job), A1111's clip skip (diffusers'
//! `clip_skip = n − 1`, both passes), and A1111's hires fix (`hires.rs`: any upscaler SD1/SDXL take, the second
//! pass as SD3 img2img with Euler). Each job is planned against the device's free memory as on SD1/SDXL (the
//! MMDiT's activations over patch and text tokens, the VAE decode): attention in slices, the VAE in tiles, or a
//! refusal with what the job needs. What it refuses, naming the field:
//! embeddings, samplers other than Euler and DPM++ 2M (A1111's default `Euler a` runs as Euler, and the infotext
//! says so), the Karras schedule, DPM++ 2M and skip-layer guidance with an init image, a hires `hr_sampler_name`
//! other than Euler and a hires size that is not a multiple of 16 (skip-layer guidance guides the first pass only).

mod batch;
#[cfg(test)]
mod batch_tests;

use crate::engine::{finished_image, follow_plan, lora_error, MemoryPlanner, MemoryQuery, MAX_BATCH};
use crate::hires::{sd3_hires_image, sd3_second_pass_steps, Sd3SecondPass};
use crate::lora::AppliedLoras;
use crate::preview::{start_sd3_latent_preview, Reports};
use crate::sd3::{Sd3Error, Sd3Model, Sd3Request, StepEstimate};
use crate::upscalers::Upscalers;
use candle_core::{DType, Device};
use sdhive_engine::extra_networks::strip_networks;
use sdhive_engine::memory::{MmditShape, ModelShape, SD3_CONTEXT_TOKENS};
use sdhive_engine::{
    random_seed, Control, Engine, EngineError, EngineInfo, GenerateOutput, GenerateRequest, GeneratedImage,
    HiresFix, HiresTarget, Limits, PreviewDecoder, Progress, RgbImage, Sampler, Schedule, ValidationError,
};
use sdhive_models::ops::{attention_is_fused, MAX_SCORE_ELEMENTS};
use sdhive_schedulers::FlowSampler;
use sdhive_tokenizer::T5_DEFAULT_MAX_LEN;
use std::path::Path;

pub struct Sd3Engine {
    model: Sd3Model,
    name: String,
    dtype: DType,
    backend_name: String,
    device_name: String,
    limits: Limits,
    /// The LoRAs merged into the model now.
    loras: AppliedLoras,
    /// Hires fix's image upscalers (models loaded on first use), shared with the SD1/SDXL engine's code.
    upscalers: Upscalers,
    memory: MemoryPlanner,
}

/// The image side the model was trained at: its transformer's latent sample size, in pixels.
fn native_size(model: &Sd3Model) -> u32 {
    (model.transformer_config().sample_size * 8) as u32
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
        let model = Sd3Model::from_dir(dir, dtype, device, with_t5)?;
        Ok(Self::from_model(model, name, dtype, (backend_name, device_name)))
    }

    /// Serves an already loaded model (e.g. [`Sd3Model::from_single_file`]) in `dtype`.
    pub fn from_model(
        model: Sd3Model,
        name: &str,
        dtype: DType,
        (backend_name, device_name): (&str, &str),
    ) -> Sd3Engine {
        let device = model.transformer.device().clone();
        let cfg = model.transformer_config();
        let shape = ModelShape {
            weights_bytes: model.resident_bytes_on(&device),
            activation_bytes: dtype.size_in_bytes() as u64,
            vae_factor: 8,
            first_attention_level: 0,
            heads_at_first_attention: 0,
            fused_attention: attention_is_fused(&device, dtype),
            score_chunk_elements: Some(MAX_SCORE_ELEMENTS as u64),
            vae_tile_latent: model.vae_config().tile_latent_size() as u64,
            mmdit: Some(MmditShape {
                hidden: cfg.inner_dim() as u32,
                heads: cfg.num_attention_heads as u32,
                patch: cfg.patch_size as u32,
                context_tokens: SD3_CONTEXT_TOKENS,
            }),
        };
        let size = native_size(&model);
        Sd3Engine {
            model,
            name: name.into(),
            dtype,
            backend_name: backend_name.into(),
            device_name: device_name.into(),
            limits: Limits::default(),
            loras: AppliedLoras::default(),
            upscalers: Upscalers::default(),
            memory: MemoryPlanner::new(shape, None, None, (size, size)),
        }
    }

    /// Plans every job against `memory` (the device's total and free bytes, asked before each job) and `budget`
    /// (the most the worker may use, weights included): attention in slices, the VAE in tiles, or a refusal
    /// naming what the job needs, as on SD1/SDXL.
    pub fn with_memory(mut self, memory: Option<MemoryQuery>, budget: Option<u64>) -> Self {
        let size = self.native_size();
        self.memory = MemoryPlanner::new(self.memory.shape, memory, budget, (size, size));
        self
    }

    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    fn native_size(&self) -> u32 {
        native_size(&self.model)
    }

    /// What this engine cannot do yet, refused before anything runs.
    /// `req` validated and checked against what this engine runs, with its output size (a multiple of the
    /// transformer's patch in pixels).
    fn checked(&self, req: &GenerateRequest) -> Result<(u32, u32), EngineError> {
        req.validate(&self.limits)?;
        self.check(req)?;
        let native = self.native_size();
        let (width, height) = req.output_size((native, native));
        let factor = (8 * self.model.transformer_config().patch_size) as u32;
        for (field, v) in [("width", width), ("height", height)] {
            if v % factor != 0 {
                return Err(invalid(
                    field,
                    format!("must be a multiple of {factor} for this model, got {v}"),
                ));
            }
        }
        Ok((width, height))
    }

    fn check(&self, req: &GenerateRequest) -> Result<(), EngineError> {
        if !req.embeddings.is_empty() {
            return Err(invalid("prompt", "textual-inversion embeddings do not apply to SD3 models"));
        }
        if flow_sampler(req.sampler).is_none() {
            return Err(invalid(
                "sampler",
                format!(
                    "SD3 models run the flow-matching samplers `Euler` and `DPM++ 2M`, not `{}`",
                    req.sampler.name()
                ),
            ));
        }
        if req.schedule != Schedule::Automatic {
            return Err(invalid(
                "scheduler",
                format!(
                    "SD3 models take the schedule of their scheduler config (`Automatic`), not `{}`",
                    req.schedule
                ),
            ));
        }
        Ok(())
    }
}

/// Where a hires fix's second pass runs and whether it ran another sampler than asked (for the infotext): the
/// target size (a multiple of the model's `factor`), the second pass's schedule refused where SD3 img2img cannot
/// run it. It is img2img, so Euler: a first pass on DPM++ 2M continues on Euler, an explicit `hr_sampler_name`
/// must be Euler (or `Euler a`, run as Euler).
fn hires_plan(
    h: &HiresFix,
    (width, height): (u32, u32),
    factor: u32,
    limits: &Limits,
) -> Result<HiresTarget, EngineError> {
    let target = h.validate(width, height, limits)?;
    let (w, h_out) = target.output;
    if w % factor != 0 || h_out % factor != 0 {
        let field = match (h.resize_x, h.resize_y) {
            (0, 0) => "hr_scale",
            _ if w % factor != 0 => "hr_resize_x",
            _ => "hr_resize_y",
        };
        return Err(invalid(
            field,
            format!("the hires size {w}x{h_out} must be a multiple of {factor} on each side for this model"),
        ));
    }
    if let Some(s) = h.sampler {
        if flow_sampler(s) != Some(FlowSampler::Euler) {
            return Err(invalid(
                "hr_sampler_name",
                format!(
                    "the SD3 hires pass is img2img, which runs `Euler` (diffusers' SD3 img2img pipeline has no \
                     DPM++ 2M), not `{}`",
                    s.name()
                ),
            ));
        }
    }
    if let Some(s) = h.schedule.filter(|s| *s != Schedule::Automatic) {
        return Err(invalid(
            "hr_scheduler",
            format!("SD3 models take the schedule of their scheduler config (`Automatic`), not `{s}`"),
        ));
    }
    Ok(target)
}

/// The flow scheduler an A1111 sampler name runs on SD3 models: `Euler a` as Euler (a flow model has no ancestral
/// variant here), `DPM++ 2M` as DPM-Solver++ on flow sigmas.
fn flow_sampler(sampler: Sampler) -> Option<FlowSampler> {
    match sampler {
        Sampler::Euler | Sampler::EulerA => Some(FlowSampler::Euler),
        Sampler::DpmPp2M => Some(FlowSampler::DpmPp2M),
        Sampler::Ddim | Sampler::Lcm | Sampler::Pndm => None,
    }
}

/// The flow sampler `req` runs on, and `req` as it ran, for the infotext: the sampler that ran, and a hires pass on
/// Euler.
fn ran_request(req: &GenerateRequest) -> (FlowSampler, GenerateRequest) {
    let sampler = flow_sampler(req.sampler).unwrap_or_default();
    let ran_sampler = match sampler {
        FlowSampler::Euler => Sampler::Euler,
        FlowSampler::DpmPp2M => Sampler::DpmPp2M,
    };
    let ran = GenerateRequest {
        sampler: ran_sampler,
        hires: req.hires.clone().map(|h| HiresFix {
            sampler: (h.sampler.is_some() || ran_sampler != Sampler::Euler).then_some(Sampler::Euler),
            ..h
        }),
        ..req.clone()
    };
    (sampler, ran)
}

impl Drop for Sd3Engine {
    /// Weights on the CPU share memory with the RAM cache's host copy: a LoRA merged into them is taken out
    /// before the engine goes, or the cache would keep it.
    fn drop(&mut self) {
        if !self.loras.is_empty() {
            if let Err(e) = self.loras.restore(&mut self.model) {
                tracing::error!(
                    "putting LoRA-merged weights back as the SD3 model `{}` is dropped: {e}",
                    self.name
                );
            }
        }
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
            samplers: [Sampler::Euler, Sampler::DpmPp2M].iter().map(|s| s.name().to_string()).collect(),
            supports_img2img: true,
            supports_inpaint: true,
            memory: Some(self.memory.report.clone()),
            text_widths: Vec::new(),
            preview: PreviewDecoder::Latent,
        }
    }

    fn generate(
        &mut self,
        req: &GenerateRequest,
        progress: &mut dyn FnMut(&Progress) -> Control,
    ) -> Result<GenerateOutput, EngineError> {
        let (width, height) = self.checked(req)?;
        let factor = (8 * self.model.transformer_config().patch_size) as u32;
        let hires = match &req.hires {
            Some(h) => Some((h, hires_plan(h, (width, height), factor, &self.limits)?)),
            None => None,
        };
        let (sampler, ran) = ran_request(req);
        // The second pass (its seed set per image): `hr_prompt` and `hr_negative_prompt` follow the first pass's
        // when empty, as in A1111.
        let second_pass = hires.map(|(h, target)| Sd3Request {
            prompt: strip_networks(h.prompt.as_deref().filter(|p| !p.is_empty()).unwrap_or(&req.prompt)),
            negative_prompt: h
                .negative_prompt
                .clone()
                .filter(|p| !p.is_empty())
                .unwrap_or_else(|| req.negative_prompt.clone()),
            width: target.output.0 as usize,
            height: target.output.1 as usize,
            steps: if h.steps == 0 { req.steps } else { h.steps } as usize,
            guidance_scale: f64::from(h.cfg_scale.unwrap_or(req.cfg_scale)),
            seed: 0,
            max_sequence_length: T5_DEFAULT_MAX_LEN,
            init_image: None,
            strength: sdhive_engine::decimal_f64(h.denoising_strength),
            mask: None,
            sampler: FlowSampler::Euler,
            skip_layer_guidance: None,
            clip_skip: req.clip_skip,
        });
        if let Some(second) = &second_pass {
            sd3_second_pass_steps(second).map_err(|e| match e {
                Sd3Error::Invalid { field, message } => invalid(field, message),
                other => EngineError::Failed(other.to_string()),
            })?;
        }
        self.loras.set(&mut self.model, &req.loras).map_err(|e| lora_error(&e))?;
        // Hires fix: the largest MMDiT call and decode are the second pass's, at the output size.
        let (plan_w, plan_h) = hires.map_or((width, height), |(_, t)| t.output);
        let plan = self.memory.plan(plan_w, plan_h, self.loras.kept_bytes())?;
        // Dropped at the end of the job, restoring the engine thread's default.
        let _slicing = follow_plan(&plan, (plan_w, plan_h));
        self.model.vae_tiling = plan.vae_tiling;
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
                strength: sdhive_engine::decimal_f64(req.strength),
                mask: req.mask.clone(),
                sampler,
                skip_layer_guidance: req.skip_layer_guidance.clone(),
                clip_skip: req.clip_skip,
            };
            let mut reports = Reports::default();
            let mut on_step = |step: usize, steps: usize, estimate: &StepEstimate<'_>| {
                let wants_preview = req.preview_every > 0 && step.is_multiple_of(req.preview_every as usize);
                let p = Progress {
                    image: index,
                    images: req.n,
                    step: step as u32,
                    steps: steps as u32,
                    preview: None,
                };
                let preview = wants_preview
                    .then(|| estimate.latents().ok().and_then(|e| start_sd3_latent_preview(&e)))
                    .flatten();
                reports.report(p, preview, step == steps, &mut *progress)
            };
            let out = match (hires, &second_pass) {
                (Some((h, target)), Some(second)) => {
                    let upscalers = &mut self.upscalers;
                    let (device, dtype) = (self.model.transformer.device(), self.model.transformer.dtype());
                    let mut enlarge = |img: &RgbImage, to: (u32, u32)| {
                        upscalers.enlarge(&h.upscaler, img, to, device, dtype)
                    };
                    let second = Sd3SecondPass {
                        upscaler: &h.upscaler,
                        target,
                        req: Sd3Request { seed, ..second.clone() },
                        enlarge: &mut enlarge,
                    };
                    sd3_hires_image(&self.model, &job, second, &mut on_step)
                }
                _ => self.model.generate_with(&job, &mut on_step).map(|out| out.image),
            };
            // A report still held (a pass that ended off its step count) goes out before the image.
            reports.flush(&mut *progress);
            let image = match out {
                Ok(image) => image,
                Err(Sd3Error::Cancelled) => return Err(EngineError::Cancelled { done: images }),
                Err(Sd3Error::Invalid { field, message }) => return Err(invalid(field, message)),
                Err(e) => return Err(EngineError::Failed(e.to_string())),
            };
            images.push(finished_image(&ran, image, seed, (width, height), &self.name));
        }
        Ok(GenerateOutput { images })
    }

    fn max_batch(&self) -> u32 {
        MAX_BATCH
    }

    /// On a CUDA device only, as the SD1/SDXL engine.
    fn warm_up(&mut self, max_images: u32) {
        if self.model.vae.device().is_cuda() {
            sdhive_engine::batch::warm_batches(self, max_images);
        }
    }

    fn generate_batch(
        &mut self,
        reqs: &[&GenerateRequest],
        max_images: u32,
        progress: &mut dyn FnMut(usize, &Progress) -> Control,
    ) -> Vec<Result<GenerateOutput, EngineError>> {
        self.run_batch(reqs, max_images.min(MAX_BATCH), progress)
    }
}
