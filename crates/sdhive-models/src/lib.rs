//! The Stable Diffusion networks in candle: the CLIP text encoders, the denoising UNet, the
//! KL autoencoder and the tiny TAESD decoder of live previews, each configured from its
//! diffusers/transformers `config.json` and loaded through a `candle_nn::VarBuilder` holding
//! diffusers-named tensors (a diffusers folder, or a renamed single-file checkpoint).

pub mod clip;
pub mod config;
mod cpu;
pub mod error;
mod graphed;
mod layers;
pub mod loading;
pub mod mmdit;
pub mod ops;
pub mod params;
pub mod t5;
pub mod taesd;
pub mod unet;
pub mod vae;

pub use clip::{ClipActivation, ClipTextConfig, ClipTextModel, ClipTextOutput};
pub use config::IntOrList;
pub use error::{ModelError, Result};
pub use graphed::{batch_graph_memory, record_batches};
pub use loading::{
    find_weight_files, load_component, open_safetensors, random_var_builder, recording_random_var_builder,
    RecordedWeights,
};
pub use mmdit::{SD3Transformer2DModel, SD3TransformerConfig};
pub use t5::{T5Activation, T5Config, T5EncoderModel};
pub use taesd::{AutoencoderTinyConfig, TaesdDecoder, TaesdLayout};
pub use unet::{
    sd15_inpaint_unet_config, sd15_unet_config, sd21_unet_config, sdxl_unet_config, SdxlConditioning,
    UNet2DConditionConfig, UNet2DConditionModel,
};
pub use vae::{sd15_vae_config, sdxl_vae_config, AutoencoderKL, AutoencoderKLConfig, DiagonalGaussian};
