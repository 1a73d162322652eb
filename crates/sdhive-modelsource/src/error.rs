//! Everything that can go wrong while resolving `--model`, worded so the user learns which path, file or repo
//! was at fault and what to pass instead.

use std::path::PathBuf;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum SourceError {
    #[error(
        "no model given: pass a diffusers folder, a .safetensors file or a Hugging Face repo id (org/name)"
    )]
    Empty,

    #[error("model path not found: {}", path.display())]
    NotFound { path: PathBuf },

    #[error(
        "model `{arg}` not found: it is neither an existing path nor a Hugging Face repo id (org/name[@revision])"
    )]
    NeitherPathNorRepo { arg: String },

    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("model path {} is outside the allowed model roots ({roots})", path.display())]
    OutsideRoots { path: PathBuf, roots: String },

    #[error(
        "{} is a pickle checkpoint, which can run arbitrary code when loaded; only .safetensors is supported \
         (convert it to .safetensors first)",
        path.display()
    )]
    PickleUnsupported { path: PathBuf },

    #[error("{} is not a valid .safetensors file: {reason}", path.display())]
    InvalidSafetensors { path: PathBuf, reason: String },

    #[error("{} is not a usable GGUF checkpoint: {reason}", path.display())]
    InvalidGguf { path: PathBuf, reason: String },

    #[error("{}: unknown model format: {reason}", path.display())]
    UnknownFormat { path: PathBuf, reason: String },

    #[error("{}: invalid model_index.json: {reason}", path.display())]
    InvalidModelIndex { path: PathBuf, reason: String },

    #[error("diffusers folder {} is incomplete: {}", dir.display(), missing.join("; "))]
    IncompleteDiffusers { dir: PathBuf, missing: Vec<String> },

    #[error("`{id}` is not a valid Hugging Face repo id (org/name[@revision]): {reason}")]
    InvalidRepoId { id: String, reason: String },

    #[error(
        "model `{repo}` (revision {revision}) is not complete in the Hugging Face cache {}: {missing}; offline mode \
         is on (HF_HUB_OFFLINE or --offline), so nothing was downloaded. Download it where the hub is reachable \
         (e.g. `hf download {repo}`) or pass a local diffusers folder or .safetensors file as --model",
        cache.display()
    )]
    NotCachedOffline { repo: String, revision: String, cache: PathBuf, missing: String },

    #[error(
        "cannot download `{file}` of model `{repo}` (revision {revision}) into the Hugging Face cache {}: {reason}. \
         If the hub is unreachable, pass a local diffusers folder or .safetensors file as --model instead",
        cache.display()
    )]
    Download { repo: String, revision: String, file: String, cache: PathBuf, reason: String },

    #[error(
        "model `{repo}` (revision {revision}) cannot be used: {reason} (only diffusers repos with .safetensors \
         weights are supported)"
    )]
    UnsupportedRepo { repo: String, revision: String, reason: String },
}

impl SourceError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        SourceError::Io { path: path.into(), source }
    }
}
