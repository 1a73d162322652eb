//! Hires fix on the candle engine, composed as diffusers would compose it: the first pass returns latents
//! (`output_type="latent"`); a latent upscaler interpolates them (PyTorch's `interpolate`), an image upscaler
//! enlarges the decoded image; then img2img at the new size with a generator seeded again with the image's seed.
//! So the second pass's noise is that seed's first draw at the new latent shape, after (for image upscalers) the
//! draw of the VAE encoder's sample. SD3 models compose their pipelines the same way (`sd3_hires_image`), the
//! latent modes on their 16-channel latents.

use crate::model::SdModel;
use crate::pipeline::{decode, denoise, ImageJob, PipelineError, StepReport, UnetConditioning};
use crate::sd3::{Sd3Error, Sd3Model, Sd3Request, StepEstimate};
use candle_core::{DType, Tensor};
use sdhive_engine::{HiresTarget, HiresUpscaler, LatentMode, RgbImage};
use sdhive_schedulers::FlowMatchEulerDiscrete;

/// Enlarges an image to exactly the given size (an image upscaler's part of a hires fix).
pub type Enlarge<'a> = dyn FnMut(&RgbImage, (u32, u32)) -> Result<RgbImage, PipelineError> + 'a;

/// The second pass: its job (size, steps, sampler, …; no init set), its conditioning at the output size, and how
/// images are enlarged for image upscalers (`(image, (width, height))` → the image at exactly that size).
pub struct SecondPass<'a> {
    pub upscaler: &'a HiresUpscaler,
    pub target: HiresTarget,
    pub job: ImageJob<'a>,
    pub cond: &'a UnetConditioning,
    pub enlarge: &'a mut Enlarge<'a>,
}

fn failed<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> PipelineError {
    move |e| PipelineError::Failed { what, message: e.to_string() }
}

/// Both passes of one image. `progress` sees the steps of both passes as one count (`steps` = both totals).
pub fn hires_image(
    model: &SdModel,
    first_cond: &UnetConditioning,
    first: &ImageJob<'_>,
    second: SecondPass<'_>,
    progress: &mut dyn FnMut(StepReport<'_>) -> bool,
) -> Result<RgbImage, PipelineError> {
    let first_steps = crate::pipeline::planned_steps(model, first, false)?;
    let second_steps = crate::pipeline::planned_steps(model, &second.job, true)?;
    let total = first_steps + second_steps;
    let latents = denoise(model, first_cond, first, &mut |r| {
        progress(StepReport { step: r.step, steps: total, estimate: r.estimate })
    })?;
    let f = model.vae_scale_factor as u32;
    let mut job = second.job;
    let upscaled_latents;
    let upscaled_image;
    match second.upscaler {
        HiresUpscaler::Latent(mode) => {
            upscaled_latents = upscale_latents(&latents, *mode, &second.target, f)?;
            job.init_latents = Some(&upscaled_latents);
        }
        _ => {
            let image = decode(model, &latents, first.vae_tiling)?;
            let image = (second.enlarge)(&image, second.target.upscaled)?;
            upscaled_image = crop_to_output(image, &second.target);
            job.init_image = Some(&upscaled_image);
        }
    }
    let latents = denoise(model, second.cond, &job, &mut |r| {
        progress(StepReport { step: first_steps + r.step, steps: total, estimate: r.estimate })
    })?;
    decode(model, &latents, job.vae_tiling)
}

/// A latent upscaler's part: `latents` `(1, C, h, w)` (any channel count) interpolated to the upscaled size as
/// A1111's `F.interpolate` does, on the host in f32, then cropped to the output window; `f` is the VAE's scale
/// factor. Returned in f32 on the latents' device.
pub fn upscale_latents(
    latents: &Tensor,
    mode: LatentMode,
    target: &HiresTarget,
    f: u32,
) -> Result<Tensor, PipelineError> {
    let (_, c, h, w) = latents.dims4().map_err(failed("hires latents"))?;
    let ((up_w, up_h), (out_w, out_h), (x0, y0)) = (target.upscaled, target.output, target.crop_origin);
    let size = ((up_h / f) as usize, (up_w / f) as usize);
    let host = latents
        .to_dtype(DType::F32)
        .and_then(|l| l.flatten_all())
        .and_then(|l| l.to_vec1::<f32>())
        .map_err(failed("hires latents"))?;
    let up = sdhive_upscale::latent::interpolate(&host, (c, h, w), size, mode);
    Tensor::from_vec(up, (1, c, size.0, size.1), latents.device())
        .and_then(|t| t.narrow(2, (y0 / f) as usize, (out_h / f) as usize))
        .and_then(|t| t.narrow(3, (x0 / f) as usize, (out_w / f) as usize))
        .and_then(|t| t.contiguous())
        .map_err(failed("hires latents"))
}

/// An image upscaler's result (at the upscaled size) cut to the second pass's output window.
pub fn crop_to_output(image: RgbImage, target: &HiresTarget) -> RgbImage {
    let ((x0, y0), (out_w, out_h)) = (target.crop_origin, target.output);
    if (x0, y0) == (0, 0) && (image.width, image.height) == (out_w, out_h) {
        image
    } else {
        crop(&image, (x0, y0), (out_w, out_h))
    }
}

/// The `size` window of `img` from `origin`.
fn crop(img: &RgbImage, (x0, y0): (u32, u32), (w, h): (u32, u32)) -> RgbImage {
    let (x0, y0, w, h, stride) = (x0 as usize, y0 as usize, w as usize, h as usize, img.width as usize * 3);
    let mut data = Vec::with_capacity(w * h * 3);
    for y in y0..y0 + h {
        data.extend_from_slice(&img.data[y * stride + x0 * 3..y * stride + (x0 + w) * 3]);
    }
    RgbImage { width: w as u32, height: h as u32, data }
}

/// SD3's second pass: its request (the output size, the second pass's steps, strength, prompts, CFG and sampler;
/// no init image) and how the first pass's result is enlarged for it.
pub struct Sd3SecondPass<'a> {
    pub upscaler: &'a HiresUpscaler,
    pub target: HiresTarget,
    pub req: Sd3Request,
    pub enlarge: &'a mut Enlarge<'a>,
}

/// The steps a flow img2img pass of `req` runs (`steps − int(steps − steps·strength)`), refused naming
/// `denoising_strength` when none would.
pub fn sd3_second_pass_steps(req: &Sd3Request) -> Result<usize, Sd3Error> {
    let start = FlowMatchEulerDiscrete::img2img_start(req.steps, req.strength);
    if start >= req.steps {
        return Err(Sd3Error::Invalid {
            field: "denoising_strength",
            message: format!("{} leaves no step of the {} hires steps to run", req.strength, req.steps),
        });
    }
    Ok(req.steps - start)
}

/// Both passes of one SD3 image, composed as `hires_image` composes SD1/SDXL's: `first` (text-to-image) to
/// latents; a latent upscaler interpolates the 16-channel latents and `StableDiffusion3Img2ImgPipeline` starts
/// from them (`image=` latents), an image upscaler enlarges the decoded image, which the img2img pass encodes.
/// `on_step` sees the steps of both passes as one count.
pub fn sd3_hires_image(
    model: &Sd3Model,
    first: &Sd3Request,
    second: Sd3SecondPass<'_>,
    on_step: &mut dyn FnMut(usize, usize, &StepEstimate<'_>) -> bool,
) -> Result<RgbImage, Sd3Error> {
    let second_steps = sd3_second_pass_steps(&second.req)?;
    let total = first.steps + second_steps;
    let (_, latents) = model.denoise(first, None, &mut |step, _, estimate| on_step(step, total, estimate))?;
    let upscale_failed = |e: PipelineError| match e {
        PipelineError::Cancelled => Sd3Error::Cancelled,
        PipelineError::Invalid { field, message } => Sd3Error::Invalid { field, message },
        PipelineError::Failed { what, message } => Sd3Error::Failed { stage: what, message },
    };
    let mut job = second.req;
    let mut on_second = |step, _, estimate: &StepEstimate<'_>| on_step(first.steps + step, total, estimate);
    let latents = match second.upscaler {
        HiresUpscaler::Latent(mode) => {
            let up = upscale_latents(&latents, *mode, &second.target, 8).map_err(upscale_failed)?;
            model.denoise(&job, Some(&up), &mut on_second)?.1
        }
        _ => {
            let image = model.decode(&latents)?;
            let image = (second.enlarge)(&image, second.target.upscaled).map_err(upscale_failed)?;
            job.init_image = Some(crop_to_output(image, &second.target));
            model.denoise(&job, None, &mut on_second)?.1
        }
    };
    model.decode(&latents)
}
