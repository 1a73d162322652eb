//! The image upscalers of this engine's jobs: A1111's built-in `None`, `Lanczos` and `Nearest` (Pillow-exact
//! resampling) and upscaler models (ESRGAN family) run on the UNet's device, loaded on first use and kept while
//! jobs name the same file. Used by hires fix and by the extras (`upscale`).

use crate::pipeline::PipelineError;
use candle_core::{DType, Device};
use sdhive_engine::{HiresUpscaler, RgbImage, UpscaleRequest};
use sdhive_upscale::{a1111, Filter, Tile, UpscaleModel};
use std::path::PathBuf;

#[derive(Default)]
pub struct Upscalers {
    /// The last model used, by path.
    loaded: Option<(PathBuf, UpscaleModel)>,
}

fn failed(what: &'static str) -> impl Fn(String) -> PipelineError {
    move |message| PipelineError::Failed { what, message }
}

fn invalid(field: &'static str) -> impl Fn(String) -> PipelineError {
    move |message| PipelineError::Invalid { field, message }
}

impl Upscalers {
    /// `upscaler`'s model on `device`, loading it when another (or none) is loaded. A file that cannot be read
    /// as an upscaler is the request's fault.
    fn model(
        &mut self,
        path: &PathBuf,
        device: &Device,
        dtype: DType,
    ) -> Result<&UpscaleModel, PipelineError> {
        if self.loaded.as_ref().is_none_or(|(p, _)| p != path) {
            self.loaded = None;
            let started = std::time::Instant::now();
            let model =
                UpscaleModel::load(path, device, dtype).map_err(|e| invalid("hr_upscaler")(e.to_string()))?;
            tracing::info!(
                path = %path.display(),
                arch = model.arch_name(),
                scale = model.scale(),
                seconds = started.elapsed().as_secs_f64(),
                "upscaler model loaded"
            );
            self.loaded = Some((path.clone(), model));
        }
        Ok(&self.loaded.as_ref().expect("set above").1)
    }

    /// One pass of `upscaler` (A1111's `do_upscale`) inside an upscale by `scale`.
    fn pass(
        &mut self,
        upscaler: &HiresUpscaler,
        scale: f64,
        device: &Device,
        dtype: DType,
        img: &RgbImage,
    ) -> Result<RgbImage, PipelineError> {
        match (upscaler, a1111::builtin_for(upscaler, scale)) {
            (HiresUpscaler::Model { path, .. }, _) => {
                let model = self.model(path, device, dtype)?;
                model.upscale(img, Tile::A1111).map_err(|e| failed("upscaler model")(e.to_string()))
            }
            (_, Some(mut builtin)) => builtin(img).map_err(|e| invalid("hr_upscaler")(e.to_string())),
            (_, None) => Err(failed("hires upscale")("a latent upscaler has no image to enlarge".into())),
        }
    }

    /// `img` enlarged to exactly `to` as A1111's hires fix does it (`images.resize_image` "just resize"): `None`
    /// is one Lanczos resize; the others upscale by `max(w / width, h / height)` (passes until the image covers
    /// the size), then a Lanczos resize to it.
    pub fn enlarge(
        &mut self,
        upscaler: &HiresUpscaler,
        img: &RgbImage,
        to: (u32, u32),
        device: &Device,
        dtype: DType,
    ) -> Result<RgbImage, PipelineError> {
        if let HiresUpscaler::Latent(_) = upscaler {
            return Err(failed("hires upscale")("a latent upscaler has no image to enlarge".into()));
        }
        if *upscaler == HiresUpscaler::None {
            return Ok(sdhive_upscale::resize(img, to.0, to.1, Filter::Lanczos));
        }
        let scale = (f64::from(to.0) / f64::from(img.width)).max(f64::from(to.1) / f64::from(img.height));
        let mut pass = |i: &RgbImage| self.pass(upscaler, scale, device, dtype, i);
        a1111::resize_image(a1111::ResizeMode::Just, img, to.0, to.1, Some(&mut pass))
    }

    /// A1111's extras "Upscale" step on each image of `req`.
    pub fn extras(
        &mut self,
        req: &UpscaleRequest,
        device: &Device,
        dtype: DType,
    ) -> Result<Vec<RgbImage>, PipelineError> {
        a1111::extras(req, |upscaler, scale, img| self.pass(upscaler, scale, device, dtype, img))
    }
}
