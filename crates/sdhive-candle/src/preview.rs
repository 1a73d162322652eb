//! Live previews of the denoising loop (`preview_every`): the linear latent-to-RGB thumbnail, TAESD's decode of
//! the step's estimate at the output size (as diffusers decodes with `AutoencoderTiny` as the pipeline's VAE), and
//! which of them an engine makes for its model's family (`serve --preview`).

use crate::model::{Family, SdModel};
use crate::tensor_image::tensor_to_image;
use candle_core::{DType, Tensor};
use sdhive_engine::{PreviewDecoder, RgbImage};
use sdhive_models::TaesdDecoder;
use std::sync::Arc;

/// The TAESD decoders a worker has, one per latent space.
#[derive(Debug, Clone, Default)]
pub struct TaesdDecoders {
    /// `taesd`, for SD1.x / SD2.x latents.
    pub sd: Option<Arc<TaesdDecoder>>,
    /// `taesdxl`, for SDXL latents.
    pub sdxl: Option<Arc<TaesdDecoder>>,
}

/// How an engine makes previews, whatever model it loads.
#[derive(Debug, Clone, Default)]
pub enum Previews {
    Off,
    #[default]
    Latent,
    /// TAESD for the model's family; the latent preview for a family without its decoder.
    Taesd(TaesdDecoders),
}

/// The previews of one loaded model.
#[derive(Debug, Clone)]
pub(crate) enum Preview {
    Off,
    Latent,
    Taesd(Arc<TaesdDecoder>),
}

impl Preview {
    pub(crate) fn for_family(previews: &Previews, family: Family) -> Preview {
        match previews {
            Previews::Off => Preview::Off,
            Previews::Latent => Preview::Latent,
            Previews::Taesd(decoders) => {
                let decoder = match family {
                    Family::Sd => &decoders.sd,
                    Family::Sdxl => &decoders.sdxl,
                };
                match decoder {
                    Some(d) => Preview::Taesd(d.clone()),
                    None => {
                        tracing::info!(
                            family = family.name(),
                            "no TAESD decoder for this family: latent previews"
                        );
                        Preview::Latent
                    }
                }
            }
        }
    }

    pub(crate) fn decoder(&self) -> PreviewDecoder {
        match self {
            Preview::Off => PreviewDecoder::Off,
            Preview::Latent => PreviewDecoder::Latent,
            Preview::Taesd(_) => PreviewDecoder::Taesd,
        }
    }

    /// The preview of one image's `[1, C, h, w]` estimate; `None` when previews are off (or the latents have no
    /// known RGB map). `full_size_fits`: whether the job's memory plan leaves room for a full-size decode (not
    /// when it tiles the VAE); otherwise, when the request asks for the approximation (`preview_approx`), or
    /// when TAESD fails, the latent preview.
    pub(crate) fn render(
        &self,
        model: &SdModel,
        estimate: &Tensor,
        full_size_fits: bool,
        approx: bool,
    ) -> Option<RgbImage> {
        match self {
            Preview::Off => None,
            Preview::Latent => latent_preview(model, estimate),
            Preview::Taesd(_) if !full_size_fits || approx => latent_preview(model, estimate),
            Preview::Taesd(decoder) => match taesd_preview(decoder, estimate) {
                Ok(image) => Some(image),
                Err(e) => {
                    tracing::warn!("TAESD preview failed, sending the latent preview: {e}");
                    latent_preview(model, estimate)
                }
            },
        }
    }
}

/// TAESD's image of `[1, C, h, w]` latents as the UNet sees them: a diffusers pipeline with `AutoencoderTiny` as
/// its VAE decodes `latents / scaling_factor` (1.0: TAESD reads them unscaled) and maps the sample to bytes as
/// for any VAE.
pub fn taesd_preview(
    decoder: &TaesdDecoder,
    latents: &Tensor,
) -> Result<RgbImage, sdhive_models::ModelError> {
    let cfg = decoder.config();
    let tensor_err = |source| sdhive_models::ModelError::Tensor { model: "taesd", source };
    let z = latents
        .to_dtype(DType::F32)
        .and_then(|z| z.affine(1.0 / cfg.scaling_factor, cfg.shift_factor.unwrap_or(0.0)))
        .map_err(tensor_err)?;
    let decoded = decoder.decode(&z)?;
    if decoded.device().is_cpu() {
        return tensor_to_image(&decoded).map_err(tensor_err);
    }
    rgb8_on_device(&decoded).map_err(tensor_err)
}

/// A decoded `[1, 3, H, W]` sample as 8-bit RGB, mapped on its device so that only the bytes come back (a 1024²
/// preview read back as f32 and mapped on the host took 16 ms of its 21 on an H200): diffusers'
/// `(x / 2 + 0.5).clamp(0, 1) · 255` rounded half away from zero where numpy rounds half to even, which can put a
/// value exactly between two levels one level off.
pub(crate) fn rgb8_on_device(decoded: &Tensor) -> candle_core::Result<RgbImage> {
    let (_, _, h, w) = decoded.dims4()?;
    let bytes = decoded
        .squeeze(0)?
        .to_dtype(DType::F32)?
        .affine(127.5, 127.5)?
        .clamp(0f32, 255f32)?
        .round()?
        .to_dtype(DType::U8)?
        .permute((1, 2, 0))?
        .contiguous()?
        .flatten_all()?
        .to_vec1::<u8>()?;
    Ok(RgbImage { width: w as u32, height: h as u32, data: bytes })
}

/// Published linear approximations of the VAE decoder (latent channel → RGB in [-1, 1]), good enough for a
/// progress thumbnail at a tiny fraction of a decode's cost. Rows are latent channels.
const SD_LATENT_RGB: [[f32; 3]; 4] = [
    [0.3512, 0.2297, 0.3227],
    [0.3250, 0.4974, 0.2350],
    [-0.2829, 0.1762, 0.2721],
    [-0.2120, -0.2616, -0.7177],
];
const SD_LATENT_RGB_BIAS: [f32; 3] = [0.0, 0.0, 0.0];
const SDXL_LATENT_RGB: [[f32; 3]; 4] = [
    [0.3651, 0.4232, 0.4341],
    [-0.2533, -0.0042, 0.1068],
    [0.1076, 0.1111, -0.0362],
    [-0.3165, -0.2492, -0.2188],
];
const SDXL_LATENT_RGB_BIAS: [f32; 3] = [0.1084, -0.0175, -0.0011];

/// SD3 / SD3.5's 16-channel latents (scaled and shifted, as the transformer sees them), ComfyUI's `SD3` factors.
const SD3_LATENT_RGB: [[f32; 3]; 16] = [
    [-0.0922, -0.0175, 0.0749],
    [0.0311, 0.0633, 0.0954],
    [0.1994, 0.0927, 0.0458],
    [0.0856, 0.0339, 0.0902],
    [0.0587, 0.0272, -0.0496],
    [-0.0006, 0.1104, 0.0309],
    [0.0978, 0.0306, 0.0427],
    [-0.0042, 0.1038, 0.1358],
    [-0.0194, 0.0020, 0.0669],
    [-0.0488, 0.0130, -0.0268],
    [0.0922, 0.0988, 0.0951],
    [-0.0278, 0.0524, -0.0542],
    [0.0332, 0.0456, 0.0895],
    [-0.0069, -0.0030, -0.0810],
    [-0.0596, -0.0465, -0.0293],
    [-0.1448, -0.1463, -0.1189],
];
const SD3_LATENT_RGB_BIAS: [f32; 3] = [0.2394, 0.2135, 0.1925];

/// A latent-resolution RGB preview of `[1, 4, h, w]` latents; `None` for latent layouts without known factors.
pub fn latent_preview(model: &SdModel, latents: &Tensor) -> Option<RgbImage> {
    let (factors, bias) = match model.family {
        Family::Sd => (&SD_LATENT_RGB, &SD_LATENT_RGB_BIAS),
        Family::Sdxl => (&SDXL_LATENT_RGB, &SDXL_LATENT_RGB_BIAS),
    };
    latent_rgb(latents, factors, bias)
}

/// The latent preview of SD3-family latents `[1, 16, h, w]`.
pub fn sd3_latent_preview(latents: &Tensor) -> Option<RgbImage> {
    latent_rgb(latents, &SD3_LATENT_RGB, &SD3_LATENT_RGB_BIAS)
}

/// `factors · latent + bias` per pixel, mapped from [-1, 1] to 8 bits; `None` when the channels do not match.
fn latent_rgb(latents: &Tensor, factors: &[[f32; 3]], bias: &[f32; 3]) -> Option<RgbImage> {
    let (_, c, h, w) = latents.dims4().ok()?;
    if c != factors.len() {
        return None;
    }
    let values = latents.get(0).ok()?.to_dtype(DType::F32).ok()?.flatten_all().ok()?.to_vec1::<f32>().ok()?;
    let plane = h * w;
    let mut data = Vec::with_capacity(plane * 3);
    for p in 0..plane {
        for (rgb, b) in bias.iter().enumerate() {
            let v: f32 = (0..c).map(|ch| values[ch * plane + p] * factors[ch][rgb]).sum::<f32>() + b;
            data.push((((v + 1.0) / 2.0).clamp(0.0, 1.0) * 255.0).round() as u8);
        }
    }
    Some(RgbImage { width: w as u32, height: h as u32, data })
}
