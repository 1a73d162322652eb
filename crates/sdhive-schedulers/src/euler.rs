//! "Euler" / "Euler Karras": diffusers' `EulerDiscreteScheduler` without
//! churn (`s_churn = 0`, as the pipelines call it), so it draws no noise.

use candle_core::Tensor;

use crate::config::{
    check_steps, parse_final_sigmas, reject_flag, ClassDefaults, CommonConfig, FinalSigmas, PredictionType,
    SchedulerConfig, TimestepSpacing,
};
use crate::cursor::{Cursor, Missing};
use crate::error::{Result, SchedulerError};
use crate::ops::{self, check_f32, check_same_shape};
use crate::schedule;
use crate::{DiffusionScheduler, NoiseSource, SamplerKind};

const CLASS: &str = "EulerDiscreteScheduler";

pub(crate) const DEFAULTS: ClassDefaults = ClassDefaults {
    class: CLASS,
    beta_start: 0.0001,
    beta_end: 0.02,
    beta_schedule: "linear",
    timestep_spacing: "linspace",
    accepts_rescale: true,
};

/// Float32 alphas_cumprod of a sigma-based scheduler, with diffusers'
/// zero-terminal-SNR tweak (the last entry is pinned to 2^-24 so the
/// largest sigma stays finite).
pub(crate) fn sigma_alphas_cumprod(common: &CommonConfig) -> Vec<f32> {
    let mut ac = schedule::alphas_cumprod(&schedule::betas(common));
    if common.rescale_betas_zero_snr {
        if let Some(last) = ac.last_mut() {
            *last = 2f32.powi(-24);
        }
    }
    ac
}

pub(crate) struct Euler {
    prediction: PredictionType,
    timesteps: Vec<f64>,
    sigmas: Vec<f32>,
    init_noise_sigma: f32,
    cursor: Cursor,
    pred_original: Option<Tensor>,
}

impl Euler {
    pub fn new(cfg: &SchedulerConfig, steps: usize) -> Result<Self> {
        let common = CommonConfig::resolve(cfg, &DEFAULTS)?;
        check_steps(CLASS, steps, common.num_train_timesteps)?;
        let karras = cfg.use_karras_sigmas.unwrap_or(false);
        let exponential = cfg.use_exponential_sigmas.unwrap_or(false);
        let beta = cfg.use_beta_sigmas.unwrap_or(false);
        if [karras, exponential, beta].iter().filter(|&&b| b).count() > 1 {
            return Err(SchedulerError::InvalidConfig {
                class: CLASS,
                reason: "only one of use_karras_sigmas, use_exponential_sigmas, use_beta_sigmas can be set"
                    .into(),
            });
        }
        reject_flag(CLASS, "use_exponential_sigmas", cfg.use_exponential_sigmas, "not implemented")?;
        reject_flag(CLASS, "use_beta_sigmas", cfg.use_beta_sigmas, "not implemented")?;
        match cfg.interpolation_type.as_deref().unwrap_or("linear") {
            "linear" => {}
            "log_linear" => {
                return Err(SchedulerError::Unsupported {
                    class: CLASS,
                    field: "interpolation_type",
                    value: "\"log_linear\"".into(),
                    why: "not implemented",
                })
            }
            other => {
                return Err(SchedulerError::InvalidValue {
                    class: CLASS,
                    field: "interpolation_type",
                    value: format!("{other:?}"),
                    expected: "linear or log_linear",
                })
            }
        }
        match cfg.timestep_type.as_deref().unwrap_or("discrete") {
            "discrete" => {}
            "continuous" if common.prediction_type != PredictionType::VPrediction => {}
            "continuous" => {
                return Err(SchedulerError::Unsupported {
                    class: CLASS,
                    field: "timestep_type",
                    value: "\"continuous\"".into(),
                    why: "continuous v-prediction timesteps are not implemented",
                })
            }
            other => {
                return Err(SchedulerError::InvalidValue {
                    class: CLASS,
                    field: "timestep_type",
                    value: format!("{other:?}"),
                    expected: "discrete or continuous",
                })
            }
        }
        let final_sigmas = parse_final_sigmas(CLASS, cfg.final_sigmas_type.as_deref())?;

        let ac = sigma_alphas_cumprod(&common);
        let train_sigmas = schedule::train_sigmas(&ac);
        let ts32 = schedule::float_timesteps(
            common.timestep_spacing,
            common.num_train_timesteps,
            steps,
            common.steps_offset,
        );
        let mut sigmas: Vec<f64> =
            ts32.iter().map(|&t| schedule::np_interp_index(t as f64, &train_sigmas)).collect();
        let timesteps: Vec<f32> = if karras {
            let log_sigmas = schedule::log_sigmas(&train_sigmas);
            let (Some(&first), Some(&last)) = (sigmas.first(), sigmas.last()) else {
                return Err(empty_schedule());
            };
            let sigma_min = cfg.sigma_min.unwrap_or(last);
            let sigma_max = cfg.sigma_max.unwrap_or(first);
            sigmas = schedule::karras_sigmas(sigma_min, sigma_max, steps);
            sigmas.iter().map(|&s| schedule::sigma_to_t(s, &log_sigmas) as f32).collect()
        } else {
            ts32
        };
        let sigma_last = match final_sigmas {
            FinalSigmas::Zero => 0.0,
            FinalSigmas::SigmaMin => ((1.0 - ac[0]) / ac[0]).sqrt(),
        };
        let mut sigmas: Vec<f32> = sigmas.into_iter().map(|s| s as f32).collect();
        sigmas.push(sigma_last);

        let max_sigma = sigmas.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let init_noise_sigma = match common.timestep_spacing {
            TimestepSpacing::Linspace | TimestepSpacing::Trailing => max_sigma,
            TimestepSpacing::Leading => (max_sigma * max_sigma + 1.0).sqrt(),
        };
        Ok(Self {
            prediction: common.prediction_type,
            timesteps: timesteps.into_iter().map(f64::from).collect(),
            sigmas,
            init_noise_sigma,
            cursor: Cursor::default(),
            pred_original: None,
        })
    }
}

pub(crate) fn empty_schedule() -> SchedulerError {
    SchedulerError::InvalidConfig {
        class: CLASS,
        reason: "the timestep spacing produced an empty schedule".into(),
    }
}

/// Sigma at `idx` and the one after it, or a clear error past the end.
pub(crate) fn sigma_pair(class: &'static str, sigmas: &[f32], idx: usize) -> Result<(f32, f32)> {
    match (sigmas.get(idx), sigmas.get(idx + 1)) {
        (Some(&a), Some(&b)) => Ok((a, b)),
        _ => Err(SchedulerError::PastEnd { class, step: idx, needed: idx + 1, len: sigmas.len() }),
    }
}

/// `sample / ((sigma**2 + 1) ** 0.5)`.
pub(crate) fn scale_by_sigma(class: &'static str, sample: &Tensor, sigma: f32) -> Result<Tensor> {
    ops::div(class, sample, (sigma * sigma + 1.0).sqrt())
}

/// `pred_original_sample` of the Euler family for epsilon / v-prediction.
pub(crate) fn euler_x0(
    class: &'static str,
    prediction: PredictionType,
    model_output: &Tensor,
    sample: &Tensor,
    sigma: f32,
) -> Result<Tensor> {
    match prediction {
        PredictionType::Epsilon => ops::sub(class, sample, &ops::mul(class, model_output, sigma)?),
        PredictionType::VPrediction => {
            let k = -sigma / (sigma * sigma + 1.0).sqrt();
            let a = ops::mul(class, model_output, k)?;
            let b = ops::div(class, sample, sigma * sigma + 1.0)?;
            ops::add(class, &a, &b)
        }
        PredictionType::Sample => Ok(model_output.clone()),
    }
}

impl DiffusionScheduler for Euler {
    fn kind(&self) -> SamplerKind {
        SamplerKind::Euler
    }

    fn timesteps(&self) -> Vec<f64> {
        self.timesteps.clone()
    }

    fn sigmas(&self) -> Option<Vec<f32>> {
        Some(self.sigmas.clone())
    }

    fn init_noise_sigma(&self) -> f64 {
        self.init_noise_sigma as f64
    }

    fn set_begin_index(&mut self, begin: usize) {
        self.cursor.begin = Some(begin);
    }

    fn scale_model_input(&mut self, sample: &Tensor, i: usize) -> Result<Tensor> {
        check_f32(CLASS, "sample", sample)?;
        let idx = self.cursor.current(CLASS, &self.timesteps, i, Missing::Error)?;
        let (sigma, _) = sigma_pair(CLASS, &self.sigmas, idx)?;
        scale_by_sigma(CLASS, sample, sigma)
    }

    fn step(
        &mut self,
        model_output: &Tensor,
        i: usize,
        sample: &Tensor,
        _rng: &mut dyn NoiseSource,
    ) -> Result<Tensor> {
        check_f32(CLASS, "sample", sample)?;
        check_f32(CLASS, "model output", model_output)?;
        check_same_shape(CLASS, model_output, sample)?;
        let idx = self.cursor.current(CLASS, &self.timesteps, i, Missing::Error)?;
        let (sigma, sigma_next) = sigma_pair(CLASS, &self.sigmas, idx)?;
        // gamma is 0 without churn, and sigma * (0 + 1) == sigma exactly.
        let sigma_hat = sigma;
        let x0 = euler_x0(CLASS, self.prediction, model_output, sample, sigma)?;
        let derivative = ops::div(CLASS, &ops::sub(CLASS, sample, &x0)?, sigma_hat)?;
        let dt = sigma_next - sigma_hat;
        let prev = ops::add(CLASS, sample, &ops::mul(CLASS, &derivative, dt)?)?;
        self.pred_original = Some(x0);
        self.cursor.advance();
        Ok(prev)
    }

    fn add_noise(&self, original: &Tensor, noise: &Tensor, i: usize) -> Result<Tensor> {
        check_same_shape(CLASS, noise, original)?;
        let idx = self.cursor.noise_index(CLASS, &self.timesteps, i, Missing::Error)?;
        let (sigma, _) = sigma_pair(CLASS, &self.sigmas, idx)?;
        ops::add(CLASS, original, &ops::mul(CLASS, noise, sigma)?)
    }

    fn pred_original_sample(&self) -> Option<&Tensor> {
        self.pred_original.as_ref()
    }
}
