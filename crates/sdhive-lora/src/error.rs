//! The crate's one error type. Every message names the file, and the tensor key or metadata field involved, because
//! the engine shows these to someone who has a prompt with five LoRAs in it and needs to know which one to drop.

use std::path::PathBuf;

/// Why a LoRA or embedding file could not be read, or does not fit the model it is applied to. candle errors are
/// boxed: they are large, and every `Result` of the crate would carry their size.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    #[error("{}: cannot read: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "{}: pickle files (.pt/.ckpt/.pth/.bin) are not loaded because unpickling runs code from the file; \
         convert it to .safetensors first",
        path.display()
    )]
    Pickle { path: PathBuf },

    #[error("{}: not a valid safetensors file: {reason}", path.display())]
    Header { path: PathBuf, reason: String },

    #[error("{}: cannot load tensor {key}: {source}", path.display())]
    Tensor {
        path: PathBuf,
        key: String,
        #[source]
        source: Box<candle_core::Error>,
    },

    #[error("{}: {key}: DoRA (weight-decomposed LoRA) is not supported", path.display())]
    Dora { path: PathBuf, key: String },

    #[error("{}: {key}: unknown LoRA tensor (not LoRA, LoCon, LoHa or LoKr); refusing rather than ignoring it", path.display())]
    UnknownKey { path: PathBuf, key: String },

    #[error("{}: {key}: {reason}", path.display())]
    Malformed { path: PathBuf, key: String, reason: String },

    #[error("{}: metadata field {field}: {reason}", path.display())]
    Metadata { path: PathBuf, field: String, reason: String },

    #[error("{}: contains no LoRA weights", path.display())]
    Empty { path: PathBuf },

    #[error("{}: LoRA module {key} does not fit this model: the model has no such layer", path.display())]
    UnknownModule { path: PathBuf, key: String },

    #[error(
        "{}: a LoRA for {lora} models (module {key}), and this model is {model}: it cannot be applied",
        path.display()
    )]
    Family { path: PathBuf, key: String, lora: &'static str, model: &'static str },

    #[error(
        "{}: LoRA module {key} does not fit this model: {target} is {expected:?} but the LoRA's update is {got:?}",
        path.display()
    )]
    Shape { path: PathBuf, key: String, target: String, expected: Vec<usize>, got: Vec<usize> },

    #[error("{}: {key}: computing the weight update failed: {source}", path.display())]
    Compute {
        path: PathBuf,
        key: String,
        #[source]
        source: Box<candle_core::Error>,
    },

    #[error("{}: not a textual-inversion embedding: {reason}", path.display())]
    Embedding { path: PathBuf, reason: String },
}
