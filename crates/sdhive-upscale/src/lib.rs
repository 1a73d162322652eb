//! Upscaling as A1111 does it: the latent interpolations of its `Latent …` hires upscalers (PyTorch's
//! `interpolate`, exactly), Pillow-exact resampling of RGB images, the ESRGAN / Real-ESRGAN model upscalers from
//! `.safetensors` files in candle (recognised as spandrel recognises them), A1111's tiling, its upscale loop and
//! the extras tab's resize modes.

pub mod a1111;
mod error;
mod grid;
pub mod latent;
mod model;
pub mod pillow;
pub mod resize;

pub use a1111::{
    builtin_pass, destination, extras_upscale, resize_image, upscale_by, upscale_to, ExtrasResize, Pass,
    ResizeMode,
};
pub use error::UpscaleError;
pub use grid::Tile;
pub use model::{Arch, ModelInfo, UpscaleModel};
pub use resize::{resize, resize_box, Filter};

#[cfg(test)]
mod fixtures;
