//! `CandleEngine`: the [`Engine`] implementation over candle. It validates a request against the loaded model,
//! plans the job's memory against the device's free memory (attention slicing, VAE tiling, or a refusal that
//! says how much it needs), encodes the prompts once per request and runs one denoising loop per image
//! (seed, seed+1, …), or — through [`Engine::generate_joined`] (`joined`) — one loop for a batch of images of
//! several requests that others join between steps.

pub(crate) mod batch;
mod joined;
mod ledger;

use crate::conditioning::{encode_pair, encode_positive, Conditioning};
use crate::hires::{hires_image, SecondPass};
use crate::lora::LoraApplyError;
use crate::model::{LoadError, SdModel};
use crate::pipeline::{generate_image, ImageJob, PipelineError, StepReport, UnetConditioning};
use crate::preview::{Preview, Previews, Reports};
use crate::residency::Targets;
use crate::upscalers::Upscalers;
use candle_core::DType;
use sdhive_engine::extra_networks::strip_networks;
use sdhive_engine::memory::ATTENTION_SLICES;
use sdhive_engine::{
    budgeted_free, infotext, random_seed, Control, Engine, EngineError, EngineInfo, GenerateOutput,
    GenerateRequest, GeneratedImage, InfotextContext, JobPlan, Limits, MemoryReport, ModelShape, Progress,
    RgbImage, Sampler, UpscaleRequest, ValidationError,
};
use sdhive_models::ops::{attention_is_fused, limit_attention_scores, ScoreLimitGuard, MAX_SCORE_ELEMENTS};
use sdhive_modelsource::ResolvedModel;
use std::sync::Arc;

/// `(total, free)` bytes of the worker's device now; `None`s where it cannot say.
pub type MemoryQuery = Arc<dyn Fn() -> (Option<u64>, Option<u64>) + Send + Sync>;

/// Where and how to load the model.
pub struct LoadOptions {
    /// Each network's device, dtype and residency; the UNet's device is the worker's device, whose memory
    /// plans every job.
    pub targets: Targets,
    /// Shown in `info()`: the backend compiled into the binary and the device's name.
    pub backend_name: String,
    pub device_name: String,
    /// The worker device's memory, asked before every job.
    pub memory: Option<MemoryQuery>,
    /// The most device memory the worker may use, weights included (a share of a GPU used by others too).
    pub memory_budget: Option<u64>,
}

impl LoadOptions {
    /// Every network resident on `device` in `dtype`, planned without a memory query.
    pub fn single_device(
        device: &candle_core::Device,
        dtype: DType,
        backend_name: &str,
        device_name: &str,
    ) -> Self {
        LoadOptions {
            targets: Targets::all(device, dtype),
            backend_name: backend_name.into(),
            device_name: device_name.into(),
            memory: None,
            memory_budget: None,
        }
    }
}

pub struct CandleEngine {
    model: SdModel,
    dtype: DType,
    backend_name: String,
    device_name: String,
    limits: Limits,
    memory: MemoryPlanner,
    upscalers: Upscalers,
    preview: Preview,
}

/// A candle engine's memory planning, the same for SD1/SDXL and SD3: the model's shape, the device's memory
/// (asked before every job), the operator's budget, and what `/v1/info` reports.
pub(crate) struct MemoryPlanner {
    pub(crate) shape: ModelShape,
    query: Option<MemoryQuery>,
    budget: Option<u64>,
    pub(crate) report: MemoryReport,
}

impl MemoryPlanner {
    /// The planner of a model of `shape` whose native job is `native`, and its report at load.
    pub(crate) fn new(
        shape: ModelShape,
        query: Option<MemoryQuery>,
        budget: Option<u64>,
        (w, h): (u32, u32),
    ) -> Self {
        let (total, free) = query.as_ref().map_or((None, None), |m| m());
        let free = budgeted_free(free, budget, shape.weights_bytes);
        let report = MemoryReport {
            weights_bytes: shape.weights_bytes,
            device_total_bytes: total,
            device_free_bytes: free,
            native_job: shape.plan(w, h, CFG_BATCH, free, true, true).ok(),
            vae_tiling_available: true,
            attention_slicing_available: true,
        };
        MemoryPlanner { shape, query, budget, report }
    }

    /// The device memory a job may use now, as the planner sees it, `kept` bytes (the originals of LoRA-merged
    /// weights) held on the device beside the weights, and `reusable` bytes the device counts as used that the job
    /// may use (recorded steps' graph memory); an operator's budget caps it either way.
    pub(crate) fn free_for_jobs(&self, kept: u64, reusable: u64) -> Option<u64> {
        let free = self.query.as_ref().and_then(|m| m().1).map(|f| f + reusable);
        budgeted_free(free, self.budget, self.shape.weights_bytes + kept)
    }

    /// The plan for a job at `width`×`height` (CFG batch), against the device's free memory now.
    pub(crate) fn plan(&self, width: u32, height: u32, kept: u64) -> Result<JobPlan, EngineError> {
        Ok(self.shape.plan(width, height, CFG_BATCH, self.free_for_jobs(kept, 0), true, true)?)
    }

    /// The largest batch (in images, at most `max_images`) whose denoiser call fits the device's free memory
    /// without slicing attention, with the plan it runs under; a single image may slice and tile as any job does.
    /// `recorded` bytes of graph memory count as free ([`sdhive_models::batch_graph_memory`]).
    pub(crate) fn batch_plan(
        &self,
        (width, height): (u32, u32),
        guided: bool,
        max_images: u32,
        (kept, recorded): (u64, u64),
    ) -> Result<(u32, JobPlan), EngineError> {
        let per_image = if guided { CFG_BATCH } else { 1 };
        let mut images = max_images.max(1);
        while images > 1 {
            let free = self.free_for_jobs(kept, recorded);
            if let Ok(plan) = self.shape.plan(width, height, per_image * u64::from(images), free, false, true)
            {
                return Ok((images, plan));
            }
            images /= 2;
        }
        Ok((1, self.plan(width, height, kept)?))
    }
}

/// An image of `req` made with `model` from `seed`, with its A1111 infotext (`size`: the first pass's).
pub(crate) fn finished_image(
    req: &GenerateRequest,
    image: RgbImage,
    seed: u64,
    size: (u32, u32),
    model: &str,
) -> GeneratedImage {
    let ctx = InfotextContext {
        seed,
        width: size.0,
        height: size.1,
        model,
        version: concat!("sdhive ", env!("CARGO_PKG_VERSION")),
    };
    GeneratedImage { image, seed, infotext: infotext(req, &ctx) }
}

/// A job's memory plan put in force on the engine thread: said in the log when it departs from the plain run, and
/// attention sliced while the returned guard lives (VAE tiling is the caller's to pass on).
pub(crate) fn follow_plan(plan: &JobPlan, (width, height): (u32, u32)) -> Option<ScoreLimitGuard> {
    if plan.attention_slicing || plan.vae_tiling {
        tracing::info!(
            width,
            height,
            attention_slicing = plan.attention_slicing,
            vae_tiling = plan.vae_tiling,
            "memory plan for this job"
        );
    }
    plan.attention_slicing.then(|| limit_attention_scores(MAX_SCORE_ELEMENTS / ATTENTION_SLICES as usize))
}

/// Images per UNet call with classifier-free guidance (the negative and positive halves of one batch).
pub(crate) const CFG_BATCH: u64 = 2;

/// The most images denoised together; the memory plan may allow fewer.
pub(crate) const MAX_BATCH: u32 = 64;

/// A failed job's error: `OutOfMemory` when the device ran out of memory mid-job (the plan let it start, but
/// something else took the memory), which the server reports as `out_of_memory`, else a plain failure.
fn failed(message: String) -> EngineError {
    if is_out_of_memory(&message) {
        EngineError::OutOfMemory(message)
    } else {
        EngineError::Failed(message)
    }
}

/// A pipeline's error as the engine reports it: a request's invalid field, else a failure.
pub(crate) fn pipeline_error(e: PipelineError) -> EngineError {
    match e {
        PipelineError::Invalid { field, message } => EngineError::Invalid(ValidationError { field, message }),
        other => failed(other.to_string()),
    }
}

/// A LoRA the request names that cannot be applied: the request's `loras` when the file is at fault.
pub(crate) fn lora_error(e: &LoraApplyError) -> EngineError {
    match e {
        LoraApplyError::Invalid { .. } => {
            EngineError::Invalid(ValidationError { field: "loras", message: e.to_string() })
        }
        LoraApplyError::Failed { .. } => failed(e.to_string()),
    }
}

/// Whether an error message is an allocation failure of the device: the CUDA driver's, cuBLAS', cuBLASLt's or
/// cuDNN's wording, or Metal's.
fn is_out_of_memory(message: &str) -> bool {
    const MARKS: [&str; 4] = [
        "CUDA_ERROR_OUT_OF_MEMORY",
        "CUBLAS_STATUS_ALLOC_FAILED",
        "CUDNN_STATUS_ALLOC_FAILED",
        "out of memory",
    ];
    let lower = message.to_ascii_lowercase();
    MARKS.iter().any(|m| lower.contains(&m.to_ascii_lowercase()))
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
        let loaded = SdModel::load(model, &opts.targets)?;
        Ok(Self::from_model(loaded, opts))
    }

    /// As [`CandleEngine::load`], through the RAM cache of recently used checkpoints.
    pub fn load_cached(
        model: &ResolvedModel,
        opts: LoadOptions,
        cache: &mut crate::HostCache,
    ) -> Result<Self, LoadError> {
        let loaded = cache.load(model, &opts.targets)?;
        Ok(Self::from_model(loaded, opts))
    }

    pub fn from_model(model: SdModel, opts: LoadOptions) -> Self {
        let dtype = model.unet.dtype();
        let (first_attention_level, heads) = model.unet_config.first_attention().unwrap_or((0, 0));
        let shape = ModelShape {
            weights_bytes: model.resident_bytes_on(model.unet.device()),
            activation_bytes: dtype.size_in_bytes() as u64,
            vae_factor: model.vae_scale_factor as u32,
            first_attention_level: first_attention_level as u32,
            heads_at_first_attention: heads as u32,
            fused_attention: attention_is_fused(model.unet.device(), dtype),
            score_chunk_elements: Some(MAX_SCORE_ELEMENTS as u64),
            vae_tile_latent: model.vae_config.tile_latent_size() as u64,
            mmdit: None,
        };
        let memory = MemoryPlanner::new(shape, opts.memory, opts.memory_budget, model.native_size);
        CandleEngine {
            model,
            dtype,
            backend_name: opts.backend_name,
            device_name: opts.device_name,
            limits: Limits::default(),
            memory,
            upscalers: Upscalers::default(),
            preview: Preview::Latent,
        }
    }

    /// Makes the previews of `preview_every` as `previews` says for this model's family.
    pub fn with_previews(mut self, previews: &Previews) -> Self {
        self.preview = Preview::for_family(previews, self.model.family);
        self
    }

    /// The memory plan for a job at `width`×`height` (CFG batch), against the device's free memory now.
    fn plan(&self, width: u32, height: u32) -> Result<JobPlan, EngineError> {
        self.memory.plan(width, height, self.model.loras.kept_bytes())
    }

    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Makes `req`'s textual-inversion embeddings the text encoders' (before its prompts are encoded).
    fn set_embeddings(&mut self, req: &GenerateRequest) -> Result<(), EngineError> {
        self.model.set_embeddings(&req.embeddings).map_err(|e| {
            EngineError::Invalid(ValidationError { field: "embeddings", message: e.to_string() })
        })
    }

    /// An image of `req` with its infotext. A1111's `Size` is the first pass's (`size`); a hires size follows from
    /// the `Hires` fields.
    fn finished(
        &self,
        req: &GenerateRequest,
        image: RgbImage,
        seed: u64,
        size: (u32, u32),
    ) -> GeneratedImage {
        finished_image(req, image, seed, size, &self.model.name)
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
        if req.skip_layer_guidance.is_some() {
            return Err(ValidationError {
                field: "skip_layer_guidance",
                message: format!(
                    "skip-layer guidance is for SD3-family (MMDiT) models; {} is a {} UNet model",
                    self.model.name,
                    self.model.family.name()
                ),
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
            memory: Some(self.memory.report.clone()),
            text_widths: self.model.text_widths(),
            preview: self.preview.decoder(),
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
        self.model.set_loras(&req.loras).map_err(|e| lora_error(&e))?;
        self.set_embeddings(req)?;
        // Hires fix: the UNet's largest call is the second pass's, at the output size.
        let hires = match &req.hires {
            Some(h) => Some((h, h.validate(width, height, &self.limits)?)),
            None => None,
        };
        let (plan_w, plan_h) = hires.map_or((width, height), |(_, t)| t.output);
        let plan = self.plan(plan_w, plan_h)?;
        // Dropped at the end of the job, restoring the engine thread's default.
        let _slicing = follow_plan(&plan, (plan_w, plan_h));
        let base_seed = req.seed.unwrap_or_else(random_seed);
        self.preview.new_job((width as usize, height as usize));
        let size = (width as usize, height as usize);
        let text_failed = |e: candle_core::Error| failed(format!("text encoder: {e}"));
        let guided = f64::from(req.cfg_scale) > 1.0;
        // The `<lora:…>` tags are the job's LoRAs (in `req.loras` now), not words of the prompt.
        let prompt = strip_networks(&req.prompt);
        let texts =
            encode(&self.model, &prompt, &req.negative_prompt, req.clip_skip, guided).map_err(text_failed)?;
        let cond =
            UnetConditioning::new(&self.model, &texts.0, texts.1.as_ref(), size).map_err(text_failed)?;
        // The second pass's prompts (an empty `hr_prompt` is the first pass's, as in A1111) at the output size.
        let second_cond = match hires {
            Some((h, target)) => {
                let hr_guided = f64::from(h.cfg_scale.unwrap_or(req.cfg_scale)) > 1.0;
                let hr_prompt = h.prompt.as_deref().filter(|p| !p.is_empty()).map(strip_networks);
                let hr_negative = h.negative_prompt.as_deref().filter(|p| !p.is_empty());
                let same = hr_guided == guided && hr_prompt.is_none() && hr_negative.is_none();
                let owned;
                let hr_texts = if same {
                    &texts
                } else {
                    let p = hr_prompt.as_deref().unwrap_or(&prompt);
                    let n = hr_negative.unwrap_or(&req.negative_prompt);
                    owned = encode(&self.model, p, n, req.clip_skip, hr_guided).map_err(text_failed)?;
                    &owned
                };
                let out = (target.output.0 as usize, target.output.1 as usize);
                Some(
                    UnetConditioning::new(&self.model, &hr_texts.0, hr_texts.1.as_ref(), out)
                        .map_err(text_failed)?,
                )
            }
            None => None,
        };

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
                init_latents: None,
                mask: req.mask.as_ref(),
                strength: sdhive_engine::decimal_f64(req.strength),
                vae_tiling: plan.vae_tiling,
            };
            let model = &self.model;
            let previews = &self.preview;
            let mut reports = Reports::default();
            let mut on_step = |r: StepReport<'_>| {
                previews.step();
                let wants_preview =
                    req.preview_every > 0 && r.step.is_multiple_of(req.preview_every as usize);
                let preview = match wants_preview {
                    true => previews.start(model, r.estimate, !plan.vae_tiling, req.preview_approx),
                    false => None,
                };
                let p = Progress {
                    image: index,
                    images: req.n,
                    step: r.step as u32,
                    steps: r.steps as u32,
                    preview: None,
                };
                reports.report(p, preview, r.step == r.steps, &mut *progress)
            };
            let image = match (hires, &second_cond) {
                (Some((h, target)), Some(second_cond)) => {
                    let second_job = ImageJob {
                        width: target.output.0 as usize,
                        height: target.output.1 as usize,
                        steps: if h.steps == 0 { req.steps } else { h.steps } as usize,
                        cfg_scale: f64::from(h.cfg_scale.unwrap_or(req.cfg_scale)),
                        sampler: h.sampler.unwrap_or(req.sampler),
                        schedule: h.schedule.unwrap_or(req.schedule),
                        seed,
                        init_image: None,
                        init_latents: None,
                        mask: None,
                        strength: sdhive_engine::decimal_f64(h.denoising_strength),
                        vae_tiling: plan.vae_tiling,
                    };
                    let upscalers = &mut self.upscalers;
                    let (device, dtype) = (model.unet.device(), model.unet.dtype());
                    let mut enlarge = |img: &RgbImage, to: (u32, u32)| {
                        upscalers.enlarge(&h.upscaler, img, to, device, dtype)
                    };
                    let second = SecondPass {
                        upscaler: &h.upscaler,
                        target,
                        job: second_job,
                        cond: second_cond,
                        enlarge: &mut enlarge,
                    };
                    hires_image(model, &cond, &job, second, &mut on_step)
                }
                _ => generate_image(model, &cond, &job, &mut on_step),
            };
            // A report still held (a pass that ended off its step count) goes out before the image.
            reports.flush(&mut *progress);
            let image = image.map_err(|e| match e {
                PipelineError::Cancelled => EngineError::Cancelled { done: std::mem::take(&mut images) },
                PipelineError::Invalid { field, message } => EngineError::Invalid(ValidationError {
                    field: hires_field(hires.is_some(), field),
                    message,
                }),
                other => failed(other.to_string()),
            })?;
            images.push(self.finished(req, image, seed, (width, height)));
        }
        Ok(GenerateOutput { images })
    }

    fn max_batch(&self) -> u32 {
        MAX_BATCH
    }

    /// On a CUDA device only: there each new batch size's first UNet step plans and times its products (0.82 s
    /// against 27 ms warm for SD1.5 at seven images on an H200); the CPU kernels have nothing to plan.
    /// Every batch size's UNet step is recorded as a CUDA graph too (the warm-up's second step records it), so
    /// batched steps replay as the single image's do.
    fn warm_up(&mut self, max_images: u32) {
        let device = self.model.unet.device().clone();
        if device.is_cuda() {
            sdhive_models::record_batches(max_images.min(MAX_BATCH) as usize);
            sdhive_engine::batch::warm_batches(self, max_images);
            if let Ok((reserved, _, _)) = sdhive_cuda_kernels::graph_memory(&device) {
                tracing::info!(mib = reserved >> 20, "recorded steps' graph memory");
            }
        }
    }

    fn generate_batch(
        &mut self,
        reqs: &[&GenerateRequest],
        max_images: u32,
        progress: &mut dyn FnMut(usize, &Progress) -> Control,
    ) -> Vec<Result<GenerateOutput, EngineError>> {
        sdhive_engine::run_batch(self, reqs, max_images, progress)
    }

    fn generate_joined(
        &mut self,
        first: Vec<(usize, GenerateRequest)>,
        max_images: u32,
        feed: &mut dyn sdhive_engine::BatchFeed,
    ) {
        self.run_joined(first, max_images.min(MAX_BATCH), feed)
    }

    fn upscale(&mut self, req: &UpscaleRequest) -> Result<Vec<RgbImage>, EngineError> {
        let (device, dtype) = (self.model.unet.device(), self.model.unet.dtype());
        self.upscalers.extras(req, device, dtype).map_err(pipeline_error)
    }
}

/// The prompt's (and, when guiding, the negative prompt's) text-encoder outputs.
fn encode(
    model: &SdModel,
    prompt: &str,
    negative: &str,
    clip_skip: u32,
    guided: bool,
) -> candle_core::Result<(Conditioning, Option<Conditioning>)> {
    if guided {
        let pair = encode_pair(model, prompt, negative, clip_skip)?;
        Ok((pair.positive, Some(pair.negative)))
    } else {
        Ok((encode_positive(model, prompt, clip_skip)?, None))
    }
}

/// A hires job's pipeline errors about the strength are about its `denoising_strength`.
fn hires_field(hires: bool, field: &'static str) -> &'static str {
    if hires && field == "strength" {
        "denoising_strength"
    } else {
        field
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_allocation_failures_are_out_of_memory() {
        // The wordings as candle passes them on from cudarc (driver, cuBLAS, cuDNN).
        for m in [
            "unet: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")",
            "text encoder: CublasError(CUBLAS_STATUS_ALLOC_FAILED)",
            "cuDNN convolution: CudnnError(CUDNN_STATUS_ALLOC_FAILED)",
        ] {
            assert!(matches!(failed(m.into()), EngineError::OutOfMemory(ref s) if s == m), "{m}");
        }
        for m in ["shape mismatch in matmul", "cuDNN plan: CudnnError(CUDNN_STATUS_NOT_SUPPORTED)"] {
            assert!(matches!(failed(m.into()), EngineError::Failed(_)), "{m}");
        }
    }

    /// A batching worker's recorded steps keep their graph memory reserved, which the device reports as used: the
    /// batch plan counts it as free again, or a device that held 8 images before the recordings would plan 4 after.
    #[test]
    fn recorded_graph_memory_counts_as_free_for_a_batch() {
        // Attention scores materialised, so that the estimate grows with the batch (at 512² the VAE's dominates
        // a fused UNet's).
        let shape = ModelShape {
            weights_bytes: 2 << 30,
            activation_bytes: 2,
            vae_factor: 8,
            first_attention_level: 0,
            heads_at_first_attention: 8,
            fused_attention: false,
            score_chunk_elements: None,
            vae_tile_latent: 32,
            mmdit: None,
        };
        let need =
            |images: u64| shape.plan(512, 512, 2 * images, None, false, true).unwrap().activation_bytes;
        assert!(need(8) > need(4) + (1 << 20), "the estimate grows with the batch");
        // The planner's margin and room for 4 guided images; the recordings hold what 8 need beyond.
        let margin = (512 << 20) + (1 << 20);
        let recorded = need(8) - need(4);
        let free = need(4) + margin;
        let query: MemoryQuery = Arc::new(move || (Some(80 << 30), Some(free)));
        let planner = MemoryPlanner::new(shape, Some(query), None, (512, 512));
        let lanes = |recorded| planner.batch_plan((512, 512), true, 8, (0, recorded)).unwrap().0;
        assert_eq!(lanes(0), 4, "without the recordings' memory");
        assert_eq!(lanes(recorded), 8, "with it");
        // An operator's budget still caps the batch: it counts the worker's use, recordings included.
        let budgeted = MemoryPlanner::new(
            shape,
            Some(planner.query.clone().unwrap()),
            Some((2 << 30) + need(4) + margin),
            (512, 512),
        );
        assert_eq!(budgeted.batch_plan((512, 512), true, 8, (0, recorded)).unwrap().0, 4);
    }
}
