//! The denoising loop for one image: txt2img, img2img and inpaint (9-channel inpainting UNets and ordinary UNets
//! with latent blending), with classifier-free guidance. Every random draw happens in the order diffusers'
//! pipelines make it, from one `torch.Generator`-compatible stream per image.

use crate::conditioning::Conditioning;
use crate::model::SdModel;
use crate::tensor_image::{image_to_tensor, mask_to_tensor, nearest_downsample, start_image, PendingImage};
use candle_core::{DType, Device, Tensor};
use sdhive_engine::{GrayImage, RgbImage, Sampler, Schedule};
use sdhive_models::SdxlConditioning;
use sdhive_rng::TorchGenerator;
use sdhive_schedulers::{img2img_start, SamplerKind, SigmaSchedule};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum PipelineError {
    #[error("cancelled")]
    Cancelled,
    #[error("invalid `{field}`: {message}")]
    Invalid { field: &'static str, message: String },
    #[error("{what}: {message}")]
    Failed { what: &'static str, message: String },
}

fn failed<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> PipelineError {
    move |e| PipelineError::Failed { what, message: e.to_string() }
}

/// What the loop reports after each step: the step count and the current estimate of the clean latents (the
/// scheduler's x0 prediction where it forms one, else the current latents) for previews.
pub struct StepReport<'a> {
    pub step: usize,
    pub steps: usize,
    pub estimate: &'a Tensor,
}

/// Everything one image needs beyond the model.
pub struct ImageJob<'a> {
    pub width: usize,
    pub height: usize,
    pub steps: usize,
    pub cfg_scale: f64,
    pub sampler: Sampler,
    pub schedule: Schedule,
    pub seed: u64,
    pub init_image: Option<&'a RgbImage>,
    /// Start from these (already scaled) latents instead of an encoded image, as diffusers' img2img does when its
    /// `image` has the latent channel count: no VAE encode, so no draw for its sample.
    pub init_latents: Option<&'a Tensor>,
    pub mask: Option<&'a GrayImage>,
    pub strength: f64,
    /// Decode in tiles (the memory plan's choice for this job).
    pub vae_tiling: bool,
}

/// The conditioning tensors fed to every UNet call, already stacked `[negative, positive]` when guiding.
pub struct UnetConditioning {
    pub context: Tensor,
    pub added: Option<SdxlConditioning>,
    pub guided: bool,
}

impl UnetConditioning {
    /// diffusers guides only when `guidance_scale > 1`; below that the negative prompt is never used.
    pub fn new(
        model: &SdModel,
        positive: &Conditioning,
        negative: Option<&Conditioning>,
        size: (usize, usize),
    ) -> candle_core::Result<Self> {
        // The text encoders may run elsewhere (`--placement te=cpu`): the UNet gets its inputs on its device.
        let (dtype, device) = (model.unet.dtype(), model.unet.device());
        let stack = |neg: Option<&Tensor>, pos: &Tensor| -> candle_core::Result<Tensor> {
            match neg {
                Some(n) => Tensor::cat(&[n, pos], 0)?.to_device(device)?.to_dtype(dtype),
                None => pos.to_device(device)?.to_dtype(dtype),
            }
        };
        let context = stack(negative.map(|n| &n.context), &positive.context)?;
        let added = match &positive.pooled {
            Some(pooled) => {
                let (h, w) = (size.1 as f32, size.0 as f32);
                // SDXL micro-conditioning: original size, crop top-left (0, 0), target size — all the output size.
                let ids = Tensor::new(&[[h, w, 0.0, 0.0, h, w]], device)?;
                let neg_pooled = negative.and_then(|n| n.pooled.as_ref());
                let time_ids = match negative {
                    Some(_) => Tensor::cat(&[&ids, &ids], 0)?,
                    None => ids,
                };
                Some(SdxlConditioning {
                    text_embeds: stack(neg_pooled, pooled)?,
                    time_ids: time_ids.to_dtype(dtype)?,
                })
            }
            None => None,
        };
        Ok(UnetConditioning { context, added, guided: negative.is_some() })
    }
}

fn sampler_kind(s: Sampler) -> SamplerKind {
    match s {
        Sampler::Euler => SamplerKind::Euler,
        Sampler::EulerA => SamplerKind::EulerAncestral,
        Sampler::Ddim => SamplerKind::Ddim,
        Sampler::DpmPp2M => SamplerKind::DpmPp2M,
        Sampler::Lcm => SamplerKind::Lcm,
        Sampler::Pndm => SamplerKind::Pndm,
    }
}

fn sigma_schedule(s: Schedule) -> SigmaSchedule {
    match s {
        Schedule::Automatic => SigmaSchedule::Default,
        Schedule::Karras => SigmaSchedule::Karras,
    }
}

fn randn(rng: &mut TorchGenerator, shape: &[usize], device: &Device) -> candle_core::Result<Tensor> {
    let numel = shape.iter().product();
    Tensor::from_vec(rng.randn(numel), shape, device)
}

/// `vae.encode(x).latent_dist.sample(generator) * scaling_factor`, drawing the sample noise from `rng`; on the
/// UNet's device.
fn encode_sample(model: &SdModel, image: &Tensor, rng: &mut TorchGenerator) -> Result<Tensor, PipelineError> {
    let image = image.to_dtype(model.vae.dtype()).map_err(failed("vae input"))?;
    let _precision = upcast_vae_precision(model);
    let dist =
        model.vae.with(|vae| vae.encode(&image)).map_err(failed("vae"))?.map_err(failed("vae encode"))?;
    let mean = dist.mean.to_dtype(DType::F32).map_err(failed("vae encode"))?;
    let noise = randn(rng, mean.dims(), mean.device()).map_err(failed("noise"))?;
    let sample = dist
        .sample_with(&noise.to_dtype(dist.mean.dtype()).map_err(failed("noise"))?)
        .map_err(failed("vae sample"))?;
    sample
        .to_dtype(DType::F32)
        .and_then(|s| s.affine(model.vae_config.scaling_factor, 0.0))
        .and_then(|s| s.to_device(model.unet.device()))
        .map_err(failed("vae sample"))
}

/// diffusers upcasts the SDXL VAE to f32 and PyTorch runs its convolutions on TF32 tensor cores by default; an
/// upcast VAE here gets the same (a VAE the user asked to run in f32 stays exact f32).
fn upcast_vae_precision(model: &SdModel) -> Option<sdhive_models::ops::Tf32Guard> {
    (model.vae.dtype() == DType::F32 && model.unet.dtype() != DType::F32)
        .then(sdhive_models::ops::tf32_convolutions)
}

pub fn decode(model: &SdModel, latents: &Tensor, tiled: bool) -> Result<RgbImage, PipelineError> {
    start_decode(model, latents, tiled)?.finish().map_err(failed("vae decode"))
}

/// [`decode`] with the image's bytes left on their way to the host (see [`start_image`]).
pub fn start_decode(model: &SdModel, latents: &Tensor, tiled: bool) -> Result<PendingImage, PipelineError> {
    let _precision = upcast_vae_precision(model);
    let cfg = &model.vae_config;
    let mut z = latents.affine(1.0 / cfg.scaling_factor, 0.0).map_err(failed("vae decode"))?;
    if let Some(shift) = cfg.shift_factor {
        z = z.affine(1.0, shift).map_err(failed("vae decode"))?;
    }
    let z = z.to_dtype(model.vae.dtype()).map_err(failed("vae decode"))?;
    let decoded = model
        .vae
        .with(|vae| if tiled { vae.decode_tiled(&z) } else { vae.decode(&z) })
        .map_err(failed("vae"))?
        .map_err(failed("vae decode"))?;
    start_image(&decoded).map_err(failed("vae decode"))
}

struct Inpaint {
    /// `[1, 1, h, w]` of 0/1 (1 = repaint).
    mask: Tensor,
    /// 9-channel UNets: the encoded masked image; 4-channel UNets: the encoded init image and the noise used
    /// to re-noise it at every step.
    masked_image_latents: Option<Tensor>,
    blend: Option<(Tensor, Tensor)>,
}

pub fn generate_image(
    model: &SdModel,
    cond: &UnetConditioning,
    job: &ImageJob<'_>,
    progress: &mut dyn FnMut(StepReport<'_>) -> bool,
) -> Result<RgbImage, PipelineError> {
    let latents = denoise(model, cond, job, progress)?;
    decode(model, &latents, job.vae_tiling)
}

/// The job's sampler set up for its steps, as diffusers' `from_config(...).set_timesteps(steps)`.
fn scheduler_for(
    model: &SdModel,
    job: &ImageJob<'_>,
) -> Result<Box<dyn sdhive_schedulers::DiffusionScheduler>, PipelineError> {
    sdhive_schedulers::build(
        sampler_kind(job.sampler),
        sigma_schedule(job.schedule),
        &model.scheduler_config,
        job.steps,
    )
    .map_err(|e| PipelineError::Invalid { field: "sampler", message: e.to_string() })
}

/// The timesteps `job`'s sampler evaluates the UNet at, in order.
pub fn schedule_timesteps(model: &SdModel, job: &ImageJob<'_>) -> Result<Vec<f64>, PipelineError> {
    Ok(scheduler_for(model, job)?.timesteps())
}

/// How many denoising steps `job` runs: all of them from noise, those the strength leaves when it starts from an
/// image or latents (`from_init`).
pub fn planned_steps(model: &SdModel, job: &ImageJob<'_>, from_init: bool) -> Result<usize, PipelineError> {
    let scheduler = scheduler_for(model, job)?;
    let total = scheduler.timesteps().len();
    if from_init {
        Ok(total.saturating_sub(img2img_start(job.steps, job.strength, scheduler.order())))
    } else {
        Ok(total)
    }
}

/// Runs the sampler and returns the final latents (what diffusers returns with `output_type="latent"`), on the
/// UNet's device.
pub fn denoise(
    model: &SdModel,
    cond: &UnetConditioning,
    job: &ImageJob<'_>,
    progress: &mut dyn FnMut(StepReport<'_>) -> bool,
) -> Result<Tensor, PipelineError> {
    let device = model.unet.device();
    let f = model.vae_scale_factor;
    let latent_channels = model.vae_config.latent_channels;
    let shape = [1, latent_channels, job.height / f, job.width / f];
    let mut scheduler = scheduler_for(model, job)?;
    let mut rng = TorchGenerator::new(job.seed);
    let timesteps = scheduler.timesteps();

    let init = match job.init_image {
        Some(img) => Some(
            image_to_tensor(&img.resized(job.width as u32, job.height as u32), device)
                .map_err(failed("init image"))?,
        ),
        None => None,
    };
    let from_init = init.is_some() || job.init_latents.is_some();
    let begin = if from_init { img2img_start(job.steps, job.strength, scheduler.order()) } else { 0 };
    if begin >= timesteps.len() {
        return Err(PipelineError::Invalid {
            field: "strength",
            message: format!(
                "denoising strength {} with {} steps leaves no step to run; raise `strength` or `steps`",
                job.strength, job.steps
            ),
        });
    }
    if from_init {
        scheduler.set_begin_index(begin);
    }
    let init_sigma = scheduler.init_noise_sigma();
    let inpaint_unet = model.unet_in_channels() == 9;
    if inpaint_unet && job.mask.is_none() {
        return Err(PipelineError::Invalid {
            field: "mask",
            message: "this is an inpainting model: it needs an init image and a mask".into(),
        });
    }

    let (latents, inpaint) = match (&init, job.mask) {
        (None, _) if job.init_latents.is_some() => {
            let init_latents = job.init_latents.expect("checked by the guard");
            let noise = randn(&mut rng, &shape, device).map_err(failed("noise"))?;
            (scheduler.add_noise(init_latents, &noise, begin).map_err(failed("add noise"))?, None)
        }
        (None, _) => {
            let noise = randn(&mut rng, &shape, device).map_err(failed("noise"))?;
            (noise.affine(init_sigma, 0.0).map_err(failed("noise"))?, None)
        }
        (Some(image), None) => {
            let init_latents = encode_sample(model, image, &mut rng)?;
            let noise = randn(&mut rng, &shape, device).map_err(failed("noise"))?;
            (scheduler.add_noise(&init_latents, &noise, begin).map_err(failed("add noise"))?, None)
        }
        (Some(image), Some(mask_img)) => {
            let full_strength = job.strength >= 1.0;
            let mask_full = mask_to_tensor(&mask_img.resized(job.width as u32, job.height as u32), device)
                .map_err(failed("mask"))?;
            let image_latents = if !inpaint_unet || !full_strength {
                Some(encode_sample(model, image, &mut rng)?)
            } else {
                None
            };
            let noise = randn(&mut rng, &shape, device).map_err(failed("noise"))?;
            let latents = match (&image_latents, full_strength) {
                (Some(il), false) => scheduler.add_noise(il, &noise, begin).map_err(failed("add noise"))?,
                _ => noise.affine(init_sigma, 0.0).map_err(failed("noise"))?,
            };
            // The masked image keeps what the mask protects; diffusers encodes it (and draws its sample noise)
            // whatever the UNet kind, so the stream stays aligned for ancestral samplers.
            let keep = mask_full.lt(0.5f32).and_then(|m| m.to_dtype(DType::F32)).map_err(failed("mask"))?;
            let masked = image.broadcast_mul(&keep).map_err(failed("mask"))?;
            let masked_latents = encode_sample(model, &masked, &mut rng)?;
            let mask = nearest_downsample(&mask_full, shape[2], shape[3]).map_err(failed("mask"))?;
            let inpaint = Inpaint {
                mask,
                masked_image_latents: inpaint_unet.then_some(masked_latents),
                blend: if inpaint_unet { None } else { image_latents.map(|il| (il, noise)) },
            };
            (latents, Some(inpaint))
        }
    };

    let extra = match &inpaint {
        Some(Inpaint { mask, masked_image_latents: Some(mil), .. }) => Some((mask.clone(), mil.clone())),
        _ => None,
    };
    let inputs = StepInputs {
        context: &cond.context,
        added: cond.added.as_ref(),
        guided: cond.guided,
        cfg_scale: job.cfg_scale,
        extra: extra.as_ref(),
    };
    let mut blend =
        |scheduler: &dyn sdhive_schedulers::DiffusionScheduler, i: usize, latents: Tensor| match &inpaint {
            Some(Inpaint { mask, blend: Some((image_latents, noise)), .. }) => {
                let proper = if i + 1 < timesteps.len() {
                    scheduler.add_noise(image_latents, noise, i + 1).map_err(failed("add noise"))?
                } else {
                    image_latents.clone()
                };
                let keep = mask.affine(-1.0, 1.0).map_err(failed("blend"))?;
                let a = proper.broadcast_mul(&keep).map_err(failed("blend"))?;
                let b = latents.broadcast_mul(mask).map_err(failed("blend"))?;
                (a + b).map_err(failed("blend"))
            }
            _ => Ok(latents),
        };
    sample(model, scheduler.as_mut(), begin, latents, &inputs, &mut rng, &mut blend, progress)
}

/// One image of a batch that other images join and leave between steps: its own scheduler, noise stream,
/// latents and place in its schedule, so it computes what [`denoise`] computes for it alone, whatever else shares
/// its UNet calls (see [`step_lanes`]).
pub struct Lane {
    scheduler: Box<dyn sdhive_schedulers::DiffusionScheduler>,
    rng: TorchGenerator,
    latents: Tensor,
    timesteps: Vec<f64>,
    /// The next step's index in `timesteps`.
    at: usize,
}

impl Lane {
    /// txt2img's first latents for `job` (its seed, size, steps, sampler and schedule), as [`denoise`] draws them.
    pub fn new(model: &SdModel, job: &ImageJob<'_>) -> Result<Self, PipelineError> {
        let scheduler = scheduler_for(model, job)?;
        let f = model.vae_scale_factor;
        let shape = [1, model.vae_config.latent_channels, job.height / f, job.width / f];
        let mut rng = TorchGenerator::new(job.seed);
        let latents = randn(&mut rng, &shape, model.unet.device())
            .and_then(|n| n.affine(scheduler.init_noise_sigma(), 0.0))
            .map_err(failed("noise"))?;
        let timesteps = scheduler.timesteps();
        Ok(Lane { scheduler, rng, latents, timesteps, at: 0 })
    }

    /// The schedule's timesteps (what [`UNet2DConditionModel::time_rows`] is made for).
    ///
    /// [`UNet2DConditionModel::time_rows`]: sdhive_models::UNet2DConditionModel::time_rows
    pub fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    /// Steps taken.
    pub fn steps_done(&self) -> usize {
        self.at
    }

    pub fn done(&self) -> bool {
        self.at >= self.timesteps.len()
    }

    /// The latents now: the final ones once [`Self::done`].
    pub fn latents(&self) -> &Tensor {
        &self.latents
    }

    /// The denoised estimate of the last step (the latents where the sampler forms none), for previews.
    pub fn estimate(&self) -> &Tensor {
        self.scheduler.pred_original_sample().unwrap_or(&self.latents)
    }
}

/// One UNet call for `lanes` (each at its own step): their scaled latents as one batch, each sample with its time
/// rows in `temb` (`[negatives…, positives…]` when `guided`) against `context` (laid out alike); then each lane's
/// guidance at its own scale (`scales`) and its sampler's step. Guided lanes share their latents between their
/// two prompts, as [`denoise`] does.
pub fn step_lanes(
    model: &SdModel,
    unet: &sdhive_models::UNet2DConditionModel,
    lanes: &mut [&mut Lane],
    scales: &[f64],
    (guided, temb, context): (bool, &Tensor, &Tensor),
) -> Result<(), PipelineError> {
    let k = lanes.len();
    let inputs = lanes
        .iter_mut()
        .map(|l| l.scheduler.scale_model_input(&l.latents, l.at).map_err(failed("scale input")))
        .collect::<Result<Vec<_>, _>>()?;
    // Guided, the UNet takes each lane's latents once for both prompts (see `UNet2DConditionModel::forward_rows`).
    let input =
        Tensor::cat(&inputs, 0).and_then(|i| i.to_dtype(model.unet.dtype())).map_err(failed("unet input"))?;
    let out = unet
        .forward_rows(&input, temb, context)
        .map_err(failed("unet"))?
        .to_dtype(DType::F32)
        .map_err(failed("unet"))?;
    for (j, (lane, scale)) in lanes.iter_mut().zip(scales).enumerate() {
        let noise_pred = if guided {
            let uncond = out.narrow(0, j, 1).map_err(failed("cfg"))?;
            let text = out.narrow(0, k + j, 1).map_err(failed("cfg"))?;
            guide(&uncond, &text, *scale)?
        } else {
            out.narrow(0, j, 1).map_err(failed("unet"))?
        };
        let Lane { scheduler, rng, latents, at, .. } = &mut **lane;
        *latents = scheduler.step(&noise_pred, *at, latents, rng).map_err(failed("scheduler step"))?;
        *at += 1;
    }
    Ok(())
}

/// Classifier-free guidance: `uncond + scale · (text − uncond)`.
fn guide(uncond: &Tensor, text: &Tensor, scale: f64) -> Result<Tensor, PipelineError> {
    let diff = (text - uncond).map_err(failed("cfg"))?;
    let scaled = diff.affine(scale, 0.0).map_err(failed("cfg"))?;
    (uncond + scaled).map_err(failed("cfg"))
}

/// What every UNet call of a sampling run takes besides the latents.
struct StepInputs<'a> {
    /// `[negatives…, positives…]` when guided, else the positives; `B` rows each.
    context: &'a Tensor,
    added: Option<&'a SdxlConditioning>,
    guided: bool,
    cfg_scale: f64,
    /// A 9-channel inpainting UNet's mask and masked-image latents, appended to its input.
    extra: Option<&'a (Tensor, Tensor)>,
}

type AfterStep<'a> = dyn FnMut(&dyn sdhive_schedulers::DiffusionScheduler, usize, Tensor) -> Result<Tensor, PipelineError>
    + 'a;

/// The sampling loop from timestep index `begin`: `latents` `[B, C, h, w]` through every remaining step, the
/// scheduler drawing ancestral noise from `rng` (one generator per row for a batch), `after_step` applied to each
/// step's latents (inpainting's blend). Returns the final latents on the UNet's device.
#[allow(clippy::too_many_arguments)]
fn sample(
    model: &SdModel,
    scheduler: &mut dyn sdhive_schedulers::DiffusionScheduler,
    begin: usize,
    mut latents: Tensor,
    inputs: &StepInputs<'_>,
    rng: &mut dyn sdhive_schedulers::NoiseSource,
    after_step: &mut AfterStep<'_>,
    progress: &mut dyn FnMut(StepReport<'_>) -> bool,
) -> Result<Tensor, PipelineError> {
    let timesteps = scheduler.timesteps().to_vec();
    let total = timesteps.len() - begin;
    let rows = latents.dim(0).map_err(failed("latents"))?;
    // With guidance the UNet takes a single image's latents once for both prompts (it shares them up to its first
    // attention to the text) and returns both predictions; a batch's latents go in twice, negatives first.
    let calls = if inputs.guided { 2 * rows } else { rows };
    model
        .unet
        .with(|unet| -> Result<Tensor, PipelineError> {
            unet.prepare_timesteps(&timesteps[begin..], calls, inputs.added)
                .map_err(failed("unet time embedding"))?;
            for (n, i) in (begin..timesteps.len()).enumerate() {
                let t = timesteps[i];
                let mut input = scheduler.scale_model_input(&latents, i).map_err(failed("scale input"))?;
                if let Some((m, l)) = inputs.extra {
                    input = Tensor::cat(&[&input, m, l], 1).map_err(failed("inpaint input"))?;
                }
                if inputs.guided && rows > 1 {
                    input = Tensor::cat(&[&input, &input], 0).map_err(failed("cfg input"))?;
                }
                let input = input.to_dtype(model.unet.dtype()).map_err(failed("unet input"))?;
                let out = unet
                    .forward(&input, t, inputs.context, inputs.added)
                    .map_err(failed("unet"))?
                    .to_dtype(DType::F32)
                    .map_err(failed("unet"))?;
                let noise_pred = if inputs.guided {
                    let uncond = out.narrow(0, 0, rows).map_err(failed("cfg"))?;
                    let text = out.narrow(0, rows, rows).map_err(failed("cfg"))?;
                    guide(&uncond, &text, inputs.cfg_scale)?
                } else {
                    out
                };
                latents = scheduler.step(&noise_pred, i, &latents, rng).map_err(failed("scheduler step"))?;
                latents = after_step(&*scheduler, i, latents)?;
                let estimate = scheduler.pred_original_sample().unwrap_or(&latents);
                if !progress(StepReport { step: n + 1, steps: total, estimate }) {
                    return Err(PipelineError::Cancelled);
                }
            }
            Ok(latents)
        })
        .map_err(failed("unet"))?
}
