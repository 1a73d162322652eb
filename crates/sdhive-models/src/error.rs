//! The crate's error type: every failure says which file, field, tensor or input it is about.

use std::path::PathBuf;

/// Errors from configuring, loading and running the networks.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read config {path}: {source}")]
    ConfigIo { path: PathBuf, source: std::io::Error },

    /// serde's message names the offending field (and line/column).
    #[error("cannot parse config {path}: {source}")]
    ConfigParse { path: PathBuf, source: serde_json::Error },

    /// `origin` is the config file when known, else the model kind.
    #[error("{origin}: field `{field}`: {reason}")]
    InvalidConfig { origin: String, field: String, reason: String },

    #[error("no weights found in {dir} (looked for {looked_for})")]
    WeightsNotFound { dir: PathBuf, looked_for: String },

    #[error("cannot open weights {path}: {source}")]
    WeightsOpen { path: PathBuf, source: candle_core::Error },

    #[error("cannot read weight index {path}: {reason}")]
    WeightIndex { path: PathBuf, reason: String },

    /// Missing tensors and shape mismatches land here; candle's message names the tensor.
    /// `origin` is the weight file(s) when the model was loaded from a folder.
    #[error("loading {model} weights{}: {source}", fmt_origin(.origin))]
    Weights { model: &'static str, origin: Option<String>, source: candle_core::Error },

    #[error("{model}: invalid input: {reason}")]
    Input { model: &'static str, reason: String },

    #[error("{model}: tensor operation failed: {source}")]
    Tensor { model: &'static str, source: candle_core::Error },
}

fn fmt_origin(origin: &Option<String>) -> String {
    origin.as_ref().map(|o| format!(" from {o}")).unwrap_or_default()
}

impl ModelError {
    /// Names the weight files in a loading error once the caller knows them.
    pub fn with_weight_origin(self, files: &str) -> Self {
        match self {
            ModelError::Weights { model, origin: None, source } => {
                ModelError::Weights { model, origin: Some(files.to_string()), source }
            }
            other => other,
        }
    }
}

pub(crate) fn weights_err(model: &'static str) -> impl FnOnce(candle_core::Error) -> ModelError {
    move |source| ModelError::Weights { model, origin: None, source: strip_backtrace(source) }
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// Attaches the model name to candle errors raised while running a forward pass.
pub(crate) trait TensorContext<T> {
    fn ctx(self, model: &'static str) -> Result<T>;
}

impl<T> TensorContext<T> for candle_core::Result<T> {
    fn ctx(self, model: &'static str) -> Result<T> {
        self.map_err(|source| ModelError::Tensor { model, source: strip_backtrace(source) })
    }
}

/// candle attaches a backtrace whenever `RUST_BACKTRACE` is set; inside a message meant for
/// users ("cannot find tensor X") it is only noise, so it is dropped.
pub(crate) fn strip_backtrace(e: candle_core::Error) -> candle_core::Error {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => strip_backtrace(*inner),
        candle_core::Error::Context { inner, context } => {
            candle_core::Error::Context { inner: Box::new(strip_backtrace(*inner)), context }
        }
        candle_core::Error::WithPath { inner, path } => {
            candle_core::Error::WithPath { inner: Box::new(strip_backtrace(*inner)), path }
        }
        other => other,
    }
}

pub(crate) fn invalid(origin: &str, field: &str, reason: impl Into<String>) -> ModelError {
    ModelError::InvalidConfig { origin: origin.to_string(), field: field.to_string(), reason: reason.into() }
}

pub(crate) fn input_err(model: &'static str, reason: impl Into<String>) -> ModelError {
    ModelError::Input { model, reason: reason.into() }
}

/// Refuses latents that are not `(B, channels, h, w)`, before a decoder runs on them.
pub(crate) fn check_latent(model: &'static str, z: &candle_core::Tensor, channels: usize) -> Result<()> {
    let (_, c, _, _) =
        z.dims4().map_err(|e| input_err(model, format!("latent must be (B, C, h, w): {e}")))?;
    if c != channels {
        return Err(input_err(model, format!("latent has {c} channels, expected {channels}")));
    }
    Ok(())
}
