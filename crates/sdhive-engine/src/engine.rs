//! The engine trait every backend implements, and what an engine reports back: per-step progress with a
//! cancellation answer, finished images, a description of itself, and typed failures.

use crate::image_io::RgbImage;
use crate::memory::{InsufficientMemory, MemoryReport};
use crate::request::{GenerateRequest, ValidationError};
use serde::Serialize;
use thiserror::Error;

/// Reported after every denoising step of every image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Progress {
    /// 0-based index of the image being made.
    pub image: u32,
    pub images: u32,
    /// 1-based count of finished steps for this image.
    pub step: u32,
    pub steps: u32,
    /// Present on every `preview_every`-th step when the request asked for previews and the engine makes them:
    /// the current estimate of the final image, by the engine's [`PreviewDecoder`](crate::PreviewDecoder) (a
    /// linear map of the latents at latent resolution, or TAESD's decode at the output size).
    #[serde(skip)]
    pub preview: Option<RgbImage>,
}

/// The caller's answer to a progress report: cancelling stops the job before the next step starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    Continue,
    Cancel,
}

#[derive(Debug, Clone)]
pub struct GeneratedImage {
    pub image: RgbImage,
    pub seed: u64,
    /// A1111 parameters text for this image.
    pub infotext: String,
}

#[derive(Debug, Clone)]
pub struct GenerateOutput {
    pub images: Vec<GeneratedImage>,
}

/// What the serving layers show about a loaded engine (`/v1/info`, registration).
#[derive(Debug, Clone, Default, Serialize)]
pub struct EngineInfo {
    pub engine: String,
    pub backend: String,
    pub device: String,
    pub dtype: String,
    pub model: String,
    pub family: String,
    pub native_width: u32,
    pub native_height: u32,
    pub samplers: Vec<String>,
    pub supports_img2img: bool,
    pub supports_inpaint: bool,
    /// The memory plan (`/v1/info`), where the engine plans memory.
    pub memory: Option<MemoryReport>,
    /// Widths of the loaded model's text encoders (768 for SD1's, 768 and 1280 for SDXL's): which textual-inversion
    /// embeddings fit it. Empty where the engine cannot tell.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub text_widths: Vec<u32>,
    /// How this engine makes the previews of `preview_every` for the loaded model.
    pub preview: crate::PreviewDecoder,
}

#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    /// Cancelled before the next step; `done` holds the images finished before it (A1111 returns them).
    #[error("cancelled")]
    Cancelled { done: Vec<GeneratedImage> },
    #[error("out of device memory: {0}")]
    OutOfMemory(String),
    /// The memory plan refused the job before it started: it cannot fit on this device.
    #[error(transparent)]
    InsufficientMemory(#[from] InsufficientMemory),
    #[error("generation failed: {0}")]
    Failed(String),
}

/// A loaded model on a device, able to run one request at a time.
pub trait Engine: Send {
    fn info(&self) -> EngineInfo;

    /// Runs `req` to completion, calling `progress` after every step; `Control::Cancel` ends the job with
    /// `EngineError::Cancelled` (carrying the images already finished) before the next step.
    fn generate(
        &mut self,
        req: &GenerateRequest,
        progress: &mut dyn FnMut(&Progress) -> Control,
    ) -> Result<GenerateOutput, EngineError>;

    /// How many images this engine denoises together at most ([`Engine::generate_batch`]); 1 = one at a time.
    fn max_batch(&self) -> u32 {
        1
    }

    /// Runs requests of equal [`crate::BatchKey`] together, their images denoised as one batch of at most
    /// `max_images` (bounded by [`Engine::max_batch`] and the memory plan), and returns one result per request, in
    /// order. `progress` gets the request's index with each of its reports; cancelling one request stops only it.
    /// Each image equals the image its request gets from [`Engine::generate`]. The default runs them one by one.
    fn generate_batch(
        &mut self,
        reqs: &[&GenerateRequest],
        max_images: u32,
        progress: &mut dyn FnMut(usize, &Progress) -> Control,
    ) -> Vec<Result<GenerateOutput, EngineError>> {
        let _ = max_images;
        reqs.iter()
            .enumerate()
            .map(|(i, req)| self.generate(req, &mut |p: &Progress| progress(i, p)))
            .collect()
    }

    /// Runs a batch that queued requests may join while it runs: `first` (requests of one [`crate::BatchKey`],
    /// each with the caller's token) starts it, `feed` brings newcomers of the same key and takes each request's
    /// result when it is done; it returns when nothing is left to run and nobody joins. At most `max_images`
    /// images (bounded as for [`Engine::generate_batch`]) are denoised together; each image equals the image its
    /// request gets from [`Engine::generate`]. The default runs one [`Engine::generate_batch`] after another.
    fn generate_joined(
        &mut self,
        first: Vec<(usize, GenerateRequest)>,
        max_images: u32,
        feed: &mut dyn crate::BatchFeed,
    ) {
        crate::batch::joined_one_batch_at_a_time(self, first, max_images, feed)
    }

    /// Pays before the worker serves what the first generation at each batch size of up to `max_images` images
    /// would pay once (a GPU engine's kernel plans and product tuning for each new shape), at the model's native
    /// size. The default does nothing; GPU engines run [`crate::batch::warm_batches`].
    fn warm_up(&mut self, max_images: u32) {
        let _ = max_images;
    }

    /// Runs A1111's extras "Upscale" step on every image of `req`, in order.
    fn upscale(&mut self, req: &crate::UpscaleRequest) -> Result<Vec<RgbImage>, EngineError> {
        let _ = req;
        Err(EngineError::Failed("this engine has no upscalers".into()))
    }
}
