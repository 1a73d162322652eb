//! The candle engine: loads a Stable Diffusion model (diffusers folder or single-file checkpoint) onto a candle
//! device and runs txt2img / img2img / inpaint requests with diffusers' arithmetic and RNG order, so a seed gives
//! the image diffusers gives.

// The networks' errors (sdhive_models::ModelError) carry paths and candle's error by value and pass through
// closures here unchanged; they are made at most once per load or job, so their size costs nothing.
#![allow(clippy::result_large_err)]

mod cache;
mod conditioning;
mod embeddings;
mod engine;
mod hires;
mod lora;
mod model;
mod pace;
mod pipeline;
mod preview;
mod residency;
pub mod sd3;
mod sd3_engine;
mod tensor_image;
mod upscalers;

pub use cache::HostCache;
pub use embeddings::{ActiveEmbeddings, EmbeddingError};
pub use engine::{CandleEngine, LoadOptions, MemoryQuery};
pub use lora::{AppliedLoras, ChangeTimes, LoraApplyError};
pub use model::{Family, LoadError, SdModel};
pub use preview::{latent_preview, taesd_preview, Previews, TaesdDecoders};
pub use residency::{InUse, ModuleTarget, Resident, Targets};
pub use sd3::{Sd3Error, Sd3Model, Sd3Output, Sd3Request, Sd3Row, Sd3Transformer, StepEstimate};
pub use sd3_engine::Sd3Engine;
pub use sdhive_checkpoint::is_sd3_folder;

#[cfg(test)]
mod hires_tests;
#[cfg(test)]
mod lora_tests;
#[cfg(test)]
mod parity_tests;
#[cfg(test)]
mod preview_tests;
#[cfg(test)]
mod sd3_lora_tests;
#[cfg(test)]
mod sd3_tests;
#[cfg(test)]
mod test_device;
