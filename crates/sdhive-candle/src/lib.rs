//! The candle engine: loads a Stable Diffusion model (diffusers folder or single-file checkpoint) onto a candle
//! device and runs txt2img / img2img / inpaint requests with diffusers' arithmetic and RNG order, so a seed gives
//! the image diffusers gives.

mod conditioning;
mod engine;
mod model;
mod pipeline;
mod tensor_image;

pub use engine::{CandleEngine, LoadOptions};
pub use model::{Family, LoadError, SdModel};

#[cfg(test)]
mod parity_tests;
#[cfg(test)]
mod test_device;
