//! A1111's extras "Upscale" step as an engine job (`/sdapi/v1/extra-single-image`, `extra-batch-images`): images
//! enlarged by an upscaler — resampling or a model run on the engine's device — by a factor or to a size, with an
//! optional second upscaler blended in.

use crate::hires::HiresUpscaler;

/// How large the result is: A1111's `resize_mode` 0 (`upscaling_resize`) or 1 (`upscaling_resize_w`/`_h`, with
/// `upscaling_crop` centring the result on exactly that size).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UpscaleSize {
    By(f64),
    To { width: u32, height: u32, crop: bool },
}

#[derive(Debug, Clone)]
pub struct UpscaleRequest {
    pub images: Vec<crate::RgbImage>,
    /// Not a latent upscaler: the extras work on images.
    pub upscaler: HiresUpscaler,
    pub size: UpscaleSize,
    /// A1111's `upscaler_2` and `extras_upscaler_2_visibility` (0–1): its result blended over the first's.
    pub second: Option<(HiresUpscaler, f32)>,
    /// What the server encodes the results in (A1111's `samples_format`).
    pub output: crate::OutputFormat,
}
