//! The contract between the serving layers and an image-generation engine: what a request is, how it is
//! validated, what an engine reports while it works, and how a finished image is written out. Both engines
//! (candle, stable-diffusion.cpp) implement [`Engine`]; the CLI and HTTP layers only ever see this crate.

pub mod batch;
pub mod engine;
pub mod extra_networks;
pub mod hires;
pub mod host;
pub mod image_io;
pub mod infotext;
pub mod memory;
pub mod placement;
mod png_strips;
pub mod preview;
pub mod request;
pub mod sampler;
pub mod upscale;

pub use batch::{run_batch, BatchFeed, BatchKey};
pub use engine::{Control, Engine, EngineError, EngineInfo, GenerateOutput, GeneratedImage, Progress};
pub use extra_networks::{parse_networks, strip_networks, NetworkKind, NetworkTag, TagError};
pub use hires::{HiresFix, HiresTarget, HiresUpscaler, LatentMode};
pub use host::{error_chain, BoxError, EngineFactory, ModelHost, ModelSpec, SwitchError};
pub use image_io::{
    base64_into, decode_image, decode_mask, encode_image, encode_png, GrayImage, ImageError, ImageFormat,
    OutputFormat, RgbImage,
};
pub use infotext::{infotext, InfotextContext};
pub use memory::{budgeted_free, InsufficientMemory, JobPlan, MemoryReport, MmditShape, ModelShape};
pub use placement::{DeviceRef, Module, Placement, PlacementError};
pub use preview::{PreviewDecoder, PreviewMode};
pub use request::{
    decimal_f64, random_seed, EmbeddingUse, GenerateRequest, Limits, LoraUse, SkipLayerGuidance,
    ValidationError,
};
pub use sampler::{Sampler, Schedule};
pub use upscale::{UpscaleRequest, UpscaleSize};
