//! The crate's error type: everything a bad `scheduler_config.json`, an
//! impossible step count or a misused denoising loop can produce.

use std::path::PathBuf;

use crate::SamplerKind;

/// Result alias used throughout the crate.
pub type Result<T, E = SchedulerError> = std::result::Result<T, E>;

/// Errors raised while reading a scheduler config, building a scheduler or
/// stepping it.
#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    /// The config file could not be read.
    #[error("reading scheduler config {path}: {source}")]
    ConfigIo {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The config is not valid JSON or a field has the wrong JSON type.
    #[error("parsing scheduler config: {0}")]
    ConfigParse(#[source] serde_json::Error),

    /// A config field the target scheduler reads holds a value diffusers
    /// rejects as well.
    #[error("{class}: invalid `{field}` = {value} (expected {expected})")]
    InvalidValue { class: &'static str, field: &'static str, value: String, expected: &'static str },

    /// A config option diffusers supports but sdhive does not implement.
    #[error("{class}: `{field}` = {value} is not supported by sdhive ({why})")]
    Unsupported { class: &'static str, field: &'static str, value: String, why: &'static str },

    /// Karras sigmas were requested for a sampler that has no such option in
    /// diffusers.
    #[error("{kind:?} has no Karras sigma schedule (diffusers only offers it for Euler and DPM++ 2M)")]
    KarrasUnsupported { kind: SamplerKind },

    /// The number of inference steps does not fit the config.
    #[error("{class}: cannot run {steps} inference steps: {reason}")]
    InvalidSteps { class: &'static str, steps: usize, reason: String },

    /// A config combination that leaves no valid schedule.
    #[error("{class}: {reason}")]
    InvalidConfig { class: &'static str, reason: String },

    /// The loop asked for a timestep index outside the schedule.
    #[error("{class}: timestep index {index} is outside the schedule of {len} timesteps")]
    IndexOutOfRange { class: &'static str, index: usize, len: usize },

    /// The scheduler was stepped more often than its schedule allows.
    #[error("{class}: step {step} needs sigma index {needed} but the schedule has {len} sigmas")]
    PastEnd { class: &'static str, step: usize, needed: usize, len: usize },

    /// The latents or model output are not what the scheduler can work on.
    #[error("{class}: {what}")]
    BadTensor { class: &'static str, what: String },

    /// A tensor operation failed (device error, shape mismatch, ...).
    #[error("{class}: {op}: {source}")]
    Tensor {
        class: &'static str,
        op: &'static str,
        #[source]
        source: candle_core::Error,
    },
}

/// Attaches the scheduler class and operation to candle errors.
pub(crate) trait TensorCtx<T> {
    fn ctx(self, class: &'static str, op: &'static str) -> Result<T>;
}

impl<T> TensorCtx<T> for candle_core::Result<T> {
    fn ctx(self, class: &'static str, op: &'static str) -> Result<T> {
        self.map_err(|source| SchedulerError::Tensor { class, op, source })
    }
}
