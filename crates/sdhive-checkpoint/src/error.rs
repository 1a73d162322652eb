//! The one error type of this crate. Every variant names the checkpoint (or config) file, and
//! where a tensor is at fault, the tensor as it is spelled in the checkpoint.

use std::path::PathBuf;

pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{}: cannot read checkpoint: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{}: not a safetensors file: {reason}", path.display())]
    NotSafetensors { path: PathBuf, reason: String },

    #[error("{}: truncated safetensors file: {reason}", path.display())]
    Truncated { path: PathBuf, reason: String },

    #[error("{}: corrupt safetensors header: {reason}", path.display())]
    CorruptHeader { path: PathBuf, reason: String },

    /// The tensor names match none of the Stable Diffusion single-file layouts we know.
    #[error("{}: unrecognised checkpoint layout: {reason}", path.display())]
    UnknownLayout { path: PathBuf, reason: String },

    /// Recognised, but a model this crate does not convert (refiner, upscaler, ControlNet, …).
    #[error("{}: unsupported checkpoint: {reason}", path.display())]
    Unsupported { path: PathBuf, reason: String },

    #[error("{}: checkpoint has no {component} (expected tensors under `{prefix}`)", path.display())]
    MissingComponent { path: PathBuf, component: &'static str, prefix: String },

    /// An SD3 file without its CLIP towers (SD3.5 files ship so) and no config folder that has them.
    #[error(
        "{}: the checkpoint has no text encoders (`text_encoders.clip_l.*`, `text_encoders.clip_g.*`), as SD3.5 \
         files ship: {hint}",
        path.display()
    )]
    MissingTextEncoders { path: PathBuf, hint: String },

    #[error("{}: missing tensor `{tensor}` ({context})", path.display())]
    MissingTensor { path: PathBuf, tensor: String, context: String },

    #[error("{}: tensor `{tensor}` has shape {shape:?}, expected {expected}", path.display())]
    Shape { path: PathBuf, tensor: String, shape: Vec<usize>, expected: String },

    /// A name inside a recognised component that the layout does not explain; converting
    /// anyway would silently drop weights.
    #[error("{}: unexpected tensor `{tensor}` in the {component}", path.display())]
    UnexpectedTensor { path: PathBuf, tensor: String, component: &'static str },

    /// Reading a tensor's data failed; `reason` includes its dtype and shape.
    #[error("{}: tensor `{tensor}`: {reason}", path.display())]
    Tensor { path: PathBuf, tensor: String, reason: String },

    #[error("{}: cannot read config: {source}", path.display())]
    ConfigIo {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{}: invalid config JSON: {source}", path.display())]
    ConfigParse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    #[error("{}: {reason}", path.display())]
    ConfigDir { path: PathBuf, reason: String },

    /// An override config describes a different network than the checkpoint holds.
    #[error(transparent)]
    ConfigMismatch(Box<ConfigMismatch>),
}

#[derive(Debug, thiserror::Error)]
#[error(
    "{origin}: `{key}` is {config_value} but the checkpoint {} has {checkpoint_value}",
    checkpoint.display()
)]
pub struct ConfigMismatch {
    /// The override config file (or a description of an in-memory override).
    pub origin: String,
    pub key: String,
    pub config_value: String,
    pub checkpoint: PathBuf,
    pub checkpoint_value: String,
}
