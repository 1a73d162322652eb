//! Hires fix on the candle engine, composed as diffusers would compose it: the first pass returns latents
//! (`output_type="latent"`); a latent upscaler interpolates them (PyTorch's `interpolate`), an image upscaler
//! enlarges the decoded image; then img2img at the new size with a generator seeded again with the image's seed.
//! So the second pass's noise is that seed's first draw at the new latent shape, after (for image upscalers) the
//! draw of the VAE encoder's sample.

use crate::model::SdModel;
use crate::pipeline::{decode, denoise, ImageJob, PipelineError, StepReport, UnetConditioning};
use candle_core::{DType, Tensor};
use sdhive_engine::{HiresTarget, HiresUpscaler, RgbImage};

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
    let (out_w, out_h) = second.target.output;
    let (x0, y0) = second.target.crop_origin;
    let f = model.vae_scale_factor as u32;
    let mut job = second.job;
    let upscaled_latents;
    let upscaled_image;
    match second.upscaler {
        HiresUpscaler::Latent(mode) => {
            let (_, c, h, w) = latents.dims4().map_err(failed("hires latents"))?;
            let (up_w, up_h) = second.target.upscaled;
            let size = ((up_h / f) as usize, (up_w / f) as usize);
            let host = latents
                .to_dtype(DType::F32)
                .and_then(|l| l.flatten_all())
                .and_then(|l| l.to_vec1::<f32>())
                .map_err(failed("hires latents"))?;
            let up = sdhive_upscale::latent::interpolate(&host, (c, h, w), size, *mode);
            upscaled_latents = Tensor::from_vec(up, (1, c, size.0, size.1), latents.device())
                .and_then(|t| t.narrow(2, (y0 / f) as usize, (out_h / f) as usize))
                .and_then(|t| t.narrow(3, (x0 / f) as usize, (out_w / f) as usize))
                .and_then(|t| t.contiguous())
                .map_err(failed("hires latents"))?;
            job.init_latents = Some(&upscaled_latents);
        }
        _ => {
            let image = decode(model, &latents, first.vae_tiling)?;
            let image = (second.enlarge)(&image, second.target.upscaled)?;
            upscaled_image = if (x0, y0) == (0, 0) && (image.width, image.height) == (out_w, out_h) {
                image
            } else {
                crop(&image, (x0, y0), (out_w, out_h))
            };
            job.init_image = Some(&upscaled_image);
        }
    }
    let latents = denoise(model, second.cond, &job, &mut |r| {
        progress(StepReport { step: first_steps + r.step, steps: total, estimate: r.estimate })
    })?;
    decode(model, &latents, job.vae_tiling)
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
