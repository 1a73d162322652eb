//! Live previews of the denoising loop (`preview_every`): the linear latent-to-RGB thumbnail, TAESD's decode of
//! the step's estimate at the output size (as diffusers decodes with `AutoencoderTiny` as the pipeline's VAE), and
//! which of them an engine makes for its model's family (`serve --preview`). On a GPU a preview's pixels are
//! copied into page-locked memory behind the step that made them ([`Reports`] holds the step's report until the
//! next step is queued), so the device never waits for the host's read.

use crate::model::{Family, SdModel};
use crate::pace::Pace;
use crate::tensor_image::{rgb8_tensor, tensor_to_image};
use candle_core::{DType, Tensor};
use sdhive_cuda_kernels::{start_readback, Readback};
use sdhive_engine::{Control, PreviewDecoder, Progress, RgbImage};
use sdhive_models::TaesdDecoder;
use std::sync::Arc;

/// The TAESD decoders a worker has, one per latent space.
#[derive(Debug, Clone, Default)]
pub struct TaesdDecoders {
    /// `taesd`, for SD1.x / SD2.x latents.
    pub sd: Option<Arc<TaesdDecoder>>,
    /// `taesdxl`, for SDXL latents.
    pub sdxl: Option<Arc<TaesdDecoder>>,
    /// A preview at every step asked for, whatever it costs (tests that check every one); otherwise previews are
    /// paced to [`crate::pace::SHARE`] of the steps' device time.
    pub unpaced: bool,
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
    /// With the model's pace, unless unpaced.
    Taesd(Arc<TaesdDecoder>, Option<Arc<Pace>>),
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
                    Some(d) => Preview::Taesd(d.clone(), (!decoders.unpaced).then(Arc::default)),
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

    /// One denoising step has been queued (what paces TAESD previews).
    pub(crate) fn step(&self) {
        if let Preview::Taesd(_, Some(pace)) = self {
            pace.step();
        }
    }

    /// A job (or a batch) at `width`×`height` starts (see [`Pace::new_job`]).
    pub(crate) fn new_job(&self, (width, height): (usize, usize)) {
        if let Preview::Taesd(_, Some(pace)) = self {
            pace.new_job((width, height));
        }
    }

    pub(crate) fn decoder(&self) -> PreviewDecoder {
        match self {
            Preview::Off => PreviewDecoder::Off,
            Preview::Latent => PreviewDecoder::Latent,
            Preview::Taesd(..) => PreviewDecoder::Taesd,
        }
    }

    /// The preview of one image's `[1, C, h, w]` estimate, its pixels left on their way to the host (a CUDA
    /// device's copy is queued after the work that makes them, and [`PendingPreview::finish`] waits for it);
    /// `None` when previews are off (or the latents have no known RGB map). `full_size_fits`: whether the job's
    /// memory plan leaves room for a full-size decode (not when it tiles the VAE); otherwise, when the request
    /// asks for the approximation (`preview_approx`), or when TAESD fails, the latent preview.
    pub(crate) fn start(
        &self,
        model: &SdModel,
        estimate: &Tensor,
        full_size_fits: bool,
        approx: bool,
    ) -> Option<PendingPreview> {
        let latent = || {
            let (factors, bias) = latent_rgb_factors(model.family);
            start_latent_rgb(estimate, factors, bias)
        };
        match self {
            Preview::Off => None,
            Preview::Latent => latent(),
            Preview::Taesd(..) if !full_size_fits || approx => latent(),
            Preview::Taesd(decoder, pace) => {
                let allowed = match pace {
                    Some(pace) => Some(pace.allow(estimate.device())?),
                    None => None,
                };
                let pending = match start_taesd(decoder, estimate) {
                    Ok(pending) => Some(pending),
                    Err(e) => {
                        tracing::warn!("TAESD preview failed, sending the latent preview: {e}");
                        latent()
                    }
                };
                if let (Some(pace), Some(allowed)) = (pace, allowed) {
                    pace.decoded(allowed, estimate.device());
                }
                pending
            }
        }
    }
}

/// A preview whose pixels may still be on their way from the device ([`Preview::start`]).
pub(crate) enum PendingPreview {
    /// The estimate's latents of one image, mapped to RGB on the host once here.
    Latent {
        values: Readback<f32>,
        dims: (usize, usize, usize),
        factors: &'static [[f32; 3]],
        bias: &'static [f32; 3],
    },
    /// A decoded image's bytes, `h × w × 3`.
    Rgb { bytes: Readback<u8>, width: u32, height: u32 },
    /// Made on the host already.
    Done(RgbImage),
}

impl PendingPreview {
    /// Whether the pixels may still be on their way (a CUDA device's copy).
    pub(crate) fn is_queued(&self) -> bool {
        match self {
            PendingPreview::Latent { values, .. } => values.is_queued(),
            PendingPreview::Rgb { bytes, .. } => bytes.is_queued(),
            PendingPreview::Done(_) => false,
        }
    }

    /// The preview, once its pixels have landed; `None` (logged) if the copy failed.
    pub(crate) fn finish(self) -> Option<RgbImage> {
        let landed = match self {
            PendingPreview::Latent { values, dims, factors, bias } => {
                values.values().map(|v| latent_rgb_values(&v, dims, factors, bias))
            }
            PendingPreview::Rgb { bytes, width, height } => {
                bytes.values().map(|data| RgbImage { width, height, data })
            }
            PendingPreview::Done(image) => Ok(image),
        };
        landed.map_err(|e| tracing::warn!("preview read-back failed: {e}")).ok()
    }
}

/// What a held report needs of its preview: whether it is still on its way, and the image once it has landed.
pub(crate) trait Landing {
    fn is_queued(&self) -> bool;
    fn finish(self) -> Option<RgbImage>;
}

impl Landing for PendingPreview {
    fn is_queued(&self) -> bool {
        PendingPreview::is_queued(self)
    }

    fn finish(self) -> Option<RgbImage> {
        PendingPreview::finish(self)
    }
}

/// A denoising loop's progress reports with previews read back off the GPU's path: a step whose preview is still
/// on its way is reported at the next step's report, after the loop has queued that step's work, so the device
/// never waits for the host's read between two steps. The last step of a pass is reported at once, as is every
/// report without a pending preview. A cancel in a held report stops the loop one step later than the report.
pub(crate) struct Reports<P: Landing = PendingPreview> {
    held: Option<(Progress, P)>,
}

impl<P: Landing> Default for Reports<P> {
    fn default() -> Self {
        Reports { held: None }
    }
}

impl<P: Landing> Reports<P> {
    /// Reports `p` with `preview` through `send` (holding it, as above, when `last` is false); whether to go on.
    pub(crate) fn report(
        &mut self,
        p: Progress,
        preview: Option<P>,
        last: bool,
        send: &mut dyn FnMut(&Progress) -> Control,
    ) -> bool {
        if !self.flush(send) {
            return false;
        }
        match preview {
            Some(pending) if pending.is_queued() && !last => {
                self.held = Some((p, pending));
                true
            }
            preview => send(&Progress { preview: preview.and_then(P::finish), ..p }) == Control::Continue,
        }
    }

    /// Sends the held report, if any; whether to go on.
    pub(crate) fn flush(&mut self, send: &mut dyn FnMut(&Progress) -> Control) -> bool {
        match self.held.take() {
            Some((p, pending)) => send(&Progress { preview: pending.finish(), ..p }) == Control::Continue,
            None => true,
        }
    }
}

/// TAESD's decode of `latents` on their device, its bytes queued for the host.
fn start_taesd(
    decoder: &TaesdDecoder,
    latents: &Tensor,
) -> Result<PendingPreview, sdhive_models::ModelError> {
    let tensor_err = |source| sdhive_models::ModelError::Tensor { model: "taesd", source };
    let decoded = taesd_decode(decoder, latents)?;
    if decoded.device().is_cpu() {
        return tensor_to_image(&decoded).map(PendingPreview::Done).map_err(tensor_err);
    }
    let (_, _, h, w) = decoded.dims4().map_err(tensor_err)?;
    let bytes = rgb8_tensor(&decoded).and_then(|t| start_readback::<u8>(&t)).map_err(tensor_err)?;
    Ok(PendingPreview::Rgb { bytes, width: w as u32, height: h as u32 })
}

fn taesd_decode(decoder: &TaesdDecoder, latents: &Tensor) -> Result<Tensor, sdhive_models::ModelError> {
    let cfg = decoder.config();
    let tensor_err = |source| sdhive_models::ModelError::Tensor { model: "taesd", source };
    let z = latents
        .to_dtype(DType::F32)
        .and_then(|z| z.affine(1.0 / cfg.scaling_factor, cfg.shift_factor.unwrap_or(0.0)))
        .map_err(tensor_err)?;
    decoder.decode(&z)
}

/// TAESD's image of `[1, C, h, w]` latents as the UNet sees them: a diffusers pipeline with `AutoencoderTiny` as
/// its VAE decodes `latents / scaling_factor` (1.0: TAESD reads them unscaled) and maps the sample to bytes as
/// for any VAE.
pub fn taesd_preview(
    decoder: &TaesdDecoder,
    latents: &Tensor,
) -> Result<RgbImage, sdhive_models::ModelError> {
    let decoded = taesd_decode(decoder, latents)?;
    tensor_to_image(&decoded).map_err(|source| sdhive_models::ModelError::Tensor { model: "taesd", source })
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
    let (factors, bias) = latent_rgb_factors(model.family);
    start_latent_rgb(latents, factors, bias)?.finish()
}

fn latent_rgb_factors(family: Family) -> (&'static [[f32; 3]], &'static [f32; 3]) {
    match family {
        Family::Sd => (&SD_LATENT_RGB, &SD_LATENT_RGB_BIAS),
        Family::Sdxl => (&SDXL_LATENT_RGB, &SDXL_LATENT_RGB_BIAS),
    }
}

/// The latent preview of SD3-family latents `[1, 16, h, w]`.
pub fn sd3_latent_preview(latents: &Tensor) -> Option<RgbImage> {
    start_sd3_latent_preview(latents)?.finish()
}

/// [`sd3_latent_preview`] with its latents left on their way to the host.
pub(crate) fn start_sd3_latent_preview(latents: &Tensor) -> Option<PendingPreview> {
    start_latent_rgb(latents, &SD3_LATENT_RGB, &SD3_LATENT_RGB_BIAS)
}

/// The first image's latents of `[B, C, h, w]` queued for the host, to be mapped by `factors` and `bias`; `None`
/// when the channels do not match.
fn start_latent_rgb(
    latents: &Tensor,
    factors: &'static [[f32; 3]],
    bias: &'static [f32; 3],
) -> Option<PendingPreview> {
    let (_, c, h, w) = latents.dims4().ok()?;
    if c != factors.len() {
        return None;
    }
    let values = latents.get(0).and_then(|l| l.to_dtype(DType::F32)).and_then(|l| start_readback::<f32>(&l));
    let values = values.map_err(|e| tracing::warn!("latent preview failed: {e}")).ok()?;
    Some(PendingPreview::Latent { values, dims: (c, h, w), factors, bias })
}

/// `factors · latent + bias` per pixel of `(c, h, w)` values, mapped from [-1, 1] to 8 bits.
fn latent_rgb_values(
    values: &[f32],
    (c, h, w): (usize, usize, usize),
    factors: &[[f32; 3]],
    bias: &[f32; 3],
) -> RgbImage {
    let plane = h * w;
    let mut data = Vec::with_capacity(plane * 3);
    for p in 0..plane {
        for (rgb, b) in bias.iter().enumerate() {
            let v: f32 = (0..c).map(|ch| values[ch * plane + p] * factors[ch][rgb]).sum::<f32>() + b;
            data.push((((v + 1.0) / 2.0).clamp(0.0, 1.0) * 255.0).round() as u8);
        }
    }
    RgbImage { width: w as u32, height: h as u32, data }
}
