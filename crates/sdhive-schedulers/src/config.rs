//! `scheduler_config.json` as written by diffusers, and the per-class
//! resolution of it.
//!
//! diffusers' `Target.from_config(config)` hands the target class only the
//! keys its `__init__` accepts and lets every other parameter take the
//! *target class's* default. Defaults differ between classes (Euler spaces
//! timesteps `linspace`, DDIM `leading`; DDIM clips by default, LCM does not;
//! LCM's betas are SD's, everybody else's are DDPM's ...). So the raw config
//! keeps every field optional, and each scheduler resolves the fields it
//! accepts against its own default table ([`ClassDefaults`]).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Result, SchedulerError};

/// The raw contents of a diffusers `scheduler_config.json`.
///
/// Every field is optional: `None` means "absent from the JSON" (or `null`),
/// in which case the scheduler that is built uses its diffusers class
/// default. Unknown keys (`_class_name`, `_diffusers_version`,
/// `sample_max_value`, ...) are ignored. Callers may set fields to override
/// the file, like keyword arguments to diffusers' `from_config`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    /// `_class_name`: informational only; the target sampler decides.
    #[serde(rename = "_class_name", skip_serializing_if = "Option::is_none")]
    pub class_name: Option<String>,
    pub num_train_timesteps: Option<usize>,
    pub beta_start: Option<f64>,
    pub beta_end: Option<f64>,
    /// `linear` | `scaled_linear` | `squaredcos_cap_v2`.
    pub beta_schedule: Option<String>,
    pub trained_betas: Option<Vec<f64>>,
    /// `epsilon` | `v_prediction` | `sample`.
    pub prediction_type: Option<String>,
    /// `leading` | `trailing` | `linspace`.
    pub timestep_spacing: Option<String>,
    pub steps_offset: Option<i64>,
    pub set_alpha_to_one: Option<bool>,
    pub clip_sample: Option<bool>,
    pub clip_sample_range: Option<f64>,
    pub thresholding: Option<bool>,
    pub skip_prk_steps: Option<bool>,
    pub use_karras_sigmas: Option<bool>,
    pub use_exponential_sigmas: Option<bool>,
    pub use_beta_sigmas: Option<bool>,
    pub use_lu_lambdas: Option<bool>,
    pub use_flow_sigmas: Option<bool>,
    pub sigma_min: Option<f64>,
    pub sigma_max: Option<f64>,
    /// Euler: `linear` | `log_linear`.
    pub interpolation_type: Option<String>,
    /// Euler: `discrete` | `continuous`.
    pub timestep_type: Option<String>,
    pub rescale_betas_zero_snr: Option<bool>,
    /// `zero` | `sigma_min`.
    pub final_sigmas_type: Option<String>,
    pub lower_order_final: Option<bool>,
    pub euler_at_final: Option<bool>,
    pub solver_order: Option<usize>,
    pub algorithm_type: Option<String>,
    /// DPM-Solver: `midpoint` | `heun`.
    pub solver_type: Option<String>,
    pub lambda_min_clipped: Option<f64>,
    pub variance_type: Option<String>,
    /// LCM: number of steps of the distillation schedule.
    pub original_inference_steps: Option<usize>,
    /// LCM: factor applied to the timestep in the boundary condition.
    pub timestep_scaling: Option<f64>,
}

impl SchedulerConfig {
    /// Parses the text of a `scheduler_config.json`.
    ///
    /// Keys listed in `_use_default_values` are dropped first, as diffusers
    /// does: they record defaults of the class that saved the file, which must
    /// not leak into another class.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(SchedulerError::ConfigParse)?;
        Self::from_json_value(value)
    }

    /// Like [`SchedulerConfig::from_json_str`] for an already parsed value.
    pub fn from_json_value(mut value: serde_json::Value) -> Result<Self> {
        let Some(obj) = value.as_object_mut() else {
            return Err(SchedulerError::InvalidConfig {
                class: "SchedulerConfig",
                reason: "scheduler config must be a JSON object".into(),
            });
        };
        if let Some(defaults) = obj.remove("_use_default_values") {
            if let Some(keys) = defaults.as_array() {
                for key in keys.iter().filter_map(|k| k.as_str()) {
                    obj.remove(key);
                }
            }
        }
        serde_json::from_value(value).map_err(SchedulerError::ConfigParse)
    }

    /// Reads and parses a `scheduler_config.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|source| SchedulerError::ConfigIo { path: path.to_path_buf(), source })?;
        Self::from_json_str(&text)
    }
}

/// How the training betas are produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BetaSchedule {
    Linear,
    ScaledLinear,
    SquaredcosCapV2,
}

/// What the model predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PredictionType {
    Epsilon,
    VPrediction,
    Sample,
}

/// How inference timesteps are spread over the training range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimestepSpacing {
    Leading,
    Trailing,
    Linspace,
}

/// The sigma appended after the last inference step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalSigmas {
    Zero,
    SigmaMin,
}

fn parse_enum<T: Copy>(
    class: &'static str,
    field: &'static str,
    value: &str,
    table: &[(&str, T)],
    expected: &'static str,
) -> Result<T> {
    table
        .iter()
        .find(|(name, _)| *name == value)
        .map(|(_, v)| *v)
        .ok_or_else(|| SchedulerError::InvalidValue { class, field, value: format!("{value:?}"), expected })
}

/// The diffusers `__init__` defaults of one scheduler class, for the fields
/// the shared code reads.
pub(crate) struct ClassDefaults {
    pub class: &'static str,
    pub beta_start: f64,
    pub beta_end: f64,
    pub beta_schedule: &'static str,
    pub timestep_spacing: &'static str,
    /// Whether the class accepts `rescale_betas_zero_snr` (PNDM does not).
    pub accepts_rescale: bool,
}

/// Fields every scheduler class accepts, resolved against its defaults.
#[derive(Debug, Clone)]
pub(crate) struct CommonConfig {
    pub num_train_timesteps: usize,
    pub beta_start: f64,
    pub beta_end: f64,
    pub beta_schedule: BetaSchedule,
    pub trained_betas: Option<Vec<f64>>,
    pub prediction_type: PredictionType,
    pub timestep_spacing: TimestepSpacing,
    pub steps_offset: i64,
    pub rescale_betas_zero_snr: bool,
}

impl CommonConfig {
    pub fn resolve(cfg: &SchedulerConfig, d: &ClassDefaults) -> Result<Self> {
        let class = d.class;
        let num_train_timesteps = cfg.num_train_timesteps.unwrap_or(1000);
        let beta_schedule = parse_enum(
            class,
            "beta_schedule",
            cfg.beta_schedule.as_deref().unwrap_or(d.beta_schedule),
            &[
                ("linear", BetaSchedule::Linear),
                ("scaled_linear", BetaSchedule::ScaledLinear),
                ("squaredcos_cap_v2", BetaSchedule::SquaredcosCapV2),
            ],
            "linear, scaled_linear or squaredcos_cap_v2",
        );
        // diffusers only looks at beta_schedule when no trained betas are given.
        let beta_schedule = match (&cfg.trained_betas, beta_schedule) {
            (Some(_), Err(_)) => BetaSchedule::Linear,
            (_, r) => r?,
        };
        if let Some(tb) = &cfg.trained_betas {
            if tb.len() != num_train_timesteps {
                return Err(SchedulerError::InvalidConfig {
                    class,
                    reason: format!(
                        "trained_betas has {} entries but num_train_timesteps is {}",
                        tb.len(),
                        num_train_timesteps
                    ),
                });
            }
        }
        if num_train_timesteps < 2 {
            return Err(SchedulerError::InvalidConfig {
                class,
                reason: format!("num_train_timesteps must be at least 2, got {num_train_timesteps}"),
            });
        }
        let prediction_type = parse_enum(
            class,
            "prediction_type",
            cfg.prediction_type.as_deref().unwrap_or("epsilon"),
            &[
                ("epsilon", PredictionType::Epsilon),
                ("v_prediction", PredictionType::VPrediction),
                ("sample", PredictionType::Sample),
            ],
            "epsilon, v_prediction or sample",
        )?;
        let timestep_spacing =
            parse_spacing(class, cfg.timestep_spacing.as_deref().unwrap_or(d.timestep_spacing))?;
        Ok(Self {
            num_train_timesteps,
            beta_start: cfg.beta_start.unwrap_or(d.beta_start),
            beta_end: cfg.beta_end.unwrap_or(d.beta_end),
            beta_schedule,
            trained_betas: cfg.trained_betas.clone(),
            prediction_type,
            timestep_spacing,
            steps_offset: cfg.steps_offset.unwrap_or(0),
            rescale_betas_zero_snr: d.accepts_rescale && cfg.rescale_betas_zero_snr.unwrap_or(false),
        })
    }
}

pub(crate) fn parse_spacing(class: &'static str, value: &str) -> Result<TimestepSpacing> {
    parse_enum(
        class,
        "timestep_spacing",
        value,
        &[
            ("leading", TimestepSpacing::Leading),
            ("trailing", TimestepSpacing::Trailing),
            ("linspace", TimestepSpacing::Linspace),
        ],
        "leading, trailing or linspace",
    )
}

pub(crate) fn parse_final_sigmas(class: &'static str, value: Option<&str>) -> Result<FinalSigmas> {
    parse_enum(
        class,
        "final_sigmas_type",
        value.unwrap_or("zero"),
        &[("zero", FinalSigmas::Zero), ("sigma_min", FinalSigmas::SigmaMin)],
        "zero or sigma_min",
    )
}

/// Errors out when a boolean option sdhive does not implement is switched on.
pub(crate) fn reject_flag(
    class: &'static str,
    field: &'static str,
    value: Option<bool>,
    why: &'static str,
) -> Result<()> {
    if value.unwrap_or(false) {
        return Err(SchedulerError::Unsupported { class, field, value: "true".into(), why });
    }
    Ok(())
}

/// Validates the inference step count against the training range.
pub(crate) fn check_steps(class: &'static str, steps: usize, num_train: usize) -> Result<()> {
    if steps == 0 {
        return Err(SchedulerError::InvalidSteps {
            class,
            steps,
            reason: "at least one step is required".into(),
        });
    }
    if steps > num_train {
        return Err(SchedulerError::InvalidSteps {
            class,
            steps,
            reason: format!("more than num_train_timesteps ({num_train})"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_and_nulls_are_ignored() {
        let cfg = SchedulerConfig::from_json_str(
            r#"{"_class_name":"PNDMScheduler","_diffusers_version":"0.6.0",
                "beta_start":0.00085,"trained_betas":null,"sample_max_value":1.0}"#,
        )
        .unwrap();
        assert_eq!(cfg.class_name.as_deref(), Some("PNDMScheduler"));
        assert_eq!(cfg.beta_start, Some(0.00085));
        assert_eq!(cfg.trained_betas, None);
        assert_eq!(cfg.beta_end, None);
    }

    #[test]
    fn use_default_values_are_dropped() {
        let cfg = SchedulerConfig::from_json_str(
            r#"{"timestep_spacing":"leading","steps_offset":1,
                "_use_default_values":["timestep_spacing"]}"#,
        )
        .unwrap();
        assert_eq!(cfg.timestep_spacing, None);
        assert_eq!(cfg.steps_offset, Some(1));
    }

    #[test]
    fn wrong_json_types_are_errors() {
        assert!(matches!(
            SchedulerConfig::from_json_str(r#"{"steps_offset":"one"}"#),
            Err(SchedulerError::ConfigParse(_))
        ));
        assert!(SchedulerConfig::from_json_str("[1,2]").is_err());
        assert!(SchedulerConfig::from_json_str("{").is_err());
    }
}
