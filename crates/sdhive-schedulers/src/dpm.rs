//! "DPM++ 2M" / "DPM++ 2M Karras": diffusers' `DPMSolverMultistepScheduler`
//! with `algorithm_type="dpmsolver++"` and `solver_order=2`.
//!
//! The model output is first converted to a data (x0) prediction; the update
//! then works in log-SNR (`lambda`) space, with the first step and (by
//! default) the last step taken at first order.

use candle_core::Tensor;

use crate::config::{
    check_steps, parse_final_sigmas, reject_flag, ClassDefaults, CommonConfig, FinalSigmas, PredictionType,
    SchedulerConfig, TimestepSpacing,
};
use crate::cursor::{Cursor, Missing};
use crate::error::{Result, SchedulerError};
use crate::euler::{empty_schedule, sigma_alphas_cumprod, sigma_pair};
use crate::ops::{self, check_f32, check_same_shape};
use crate::schedule;
use crate::{DiffusionScheduler, NoiseSource, SamplerKind};

const CLASS: &str = "DPMSolverMultistepScheduler";

pub(crate) const DEFAULTS: ClassDefaults = ClassDefaults {
    class: CLASS,
    beta_start: 0.0001,
    beta_end: 0.02,
    beta_schedule: "linear",
    timestep_spacing: "linspace",
    accepts_rescale: true,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SolverType {
    Midpoint,
    Heun,
}

pub(crate) struct DpmPp2M {
    prediction: PredictionType,
    solver_type: SolverType,
    lower_order_final: bool,
    euler_at_final: bool,
    final_sigmas: FinalSigmas,
    timesteps: Vec<f64>,
    sigmas: Vec<f32>,
    cursor: Cursor,
    /// Data predictions of the previous and current step.
    model_outputs: [Option<Tensor>; 2],
    lower_order_nums: usize,
}

/// `alpha_t, sigma_t` of the variance-preserving process at Karras sigma
/// `sigma` (float32, as `_sigma_to_alpha_sigma_t`).
fn alpha_sigma(sigma: f32) -> (f32, f32) {
    let alpha = 1.0 / (sigma * sigma + 1.0).sqrt();
    (alpha, sigma * alpha)
}

/// `log(alpha) - log(sigma)`, float32.
fn lambda(alpha: f32, sigma: f32) -> f32 {
    alpha.ln() - sigma.ln()
}

impl DpmPp2M {
    pub fn new(cfg: &SchedulerConfig, steps: usize) -> Result<Self> {
        let common = CommonConfig::resolve(cfg, &DEFAULTS)?;
        check_steps(CLASS, steps, common.num_train_timesteps)?;
        // build() pins these; anything else means a caller bypassed it.
        if cfg.algorithm_type.as_deref().unwrap_or("dpmsolver++") != "dpmsolver++"
            || cfg.solver_order.unwrap_or(2) != 2
        {
            return Err(SchedulerError::InvalidConfig {
                class: CLASS,
                reason: "only algorithm_type=dpmsolver++ with solver_order=2 is implemented".into(),
            });
        }
        reject_flag(
            CLASS,
            "thresholding",
            cfg.thresholding,
            "dynamic thresholding needs a per-sample quantile; not implemented",
        )?;
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
        reject_flag(CLASS, "use_lu_lambdas", cfg.use_lu_lambdas, "not implemented")?;
        reject_flag(CLASS, "use_flow_sigmas", cfg.use_flow_sigmas, "flow-matching models are not supported")?;
        if let Some(v) = &cfg.variance_type {
            return Err(SchedulerError::Unsupported {
                class: CLASS,
                field: "variance_type",
                value: format!("{v:?}"),
                why: "learned-variance model outputs are not supported",
            });
        }
        let solver_type = match cfg.solver_type.as_deref().unwrap_or("midpoint") {
            "midpoint" => SolverType::Midpoint,
            "heun" => SolverType::Heun,
            // diffusers silently maps UniPC / DEIS solver names to midpoint.
            "logrho" | "bh1" | "bh2" => SolverType::Midpoint,
            other => {
                return Err(SchedulerError::InvalidValue {
                    class: CLASS,
                    field: "solver_type",
                    value: format!("{other:?}"),
                    expected: "midpoint or heun",
                })
            }
        };
        let final_sigmas = parse_final_sigmas(CLASS, cfg.final_sigmas_type.as_deref())?;

        let ac = sigma_alphas_cumprod(&common);
        let num_train = common.num_train_timesteps;

        let lambda_min_clipped = cfg.lambda_min_clipped.unwrap_or(f64::NEG_INFINITY);
        // torch.searchsorted(flip(lambda_t), lambda_min_clipped): lambda_t is
        // float32 and decreasing in t, so count the clipped tail from the end.
        let clipped_idx = ac
            .iter()
            .rev()
            .map(|&a| lambda(a.sqrt(), (1.0 - a).sqrt()))
            .position(|l| l as f64 >= lambda_min_clipped)
            .unwrap_or(num_train);
        let last_timestep = num_train - clipped_idx;

        let int_ts: Vec<i64> = match common.timestep_spacing {
            TimestepSpacing::Linspace => {
                let mut v: Vec<i64> = schedule::np_linspace(0.0, last_timestep as f64 - 1.0, steps + 1, true)
                    .into_iter()
                    .rev()
                    .map(|x| x.round_ties_even() as i64)
                    .collect();
                v.pop();
                v
            }
            TimestepSpacing::Leading => {
                let ratio = (last_timestep / (steps + 1)) as i64;
                (1..=steps as i64).rev().map(|i| i * ratio + common.steps_offset).collect()
            }
            TimestepSpacing::Trailing => {
                let ratio = num_train as f64 / steps as f64;
                schedule::np_arange(last_timestep as f64, 0.0, -ratio)
                    .into_iter()
                    .map(|x| x.round_ties_even() as i64 - 1)
                    .collect()
            }
        };
        if int_ts.is_empty() {
            return Err(empty_schedule());
        }

        let train_sigmas = schedule::train_sigmas(&ac);
        let (sigmas, timesteps): (Vec<f64>, Vec<i64>) = if karras {
            let log_sigmas = schedule::log_sigmas(&train_sigmas);
            let (Some(&s_min), Some(&s_max)) = (train_sigmas.first(), train_sigmas.last()) else {
                return Err(empty_schedule());
            };
            // `hasattr(self.config, "sigma_min")` is true whenever the JSON
            // carried the key, even though this class has no such parameter.
            let sigma_min = cfg.sigma_min.unwrap_or(s_min as f64);
            let sigma_max = cfg.sigma_max.unwrap_or(s_max as f64);
            let sigmas = schedule::karras_sigmas(sigma_min, sigma_max, steps);
            let round = cfg.beta_schedule.as_deref().unwrap_or(DEFAULTS.beta_schedule) != "squaredcos_cap_v2";
            let ts = sigmas
                .iter()
                .map(|&s| {
                    let t = schedule::sigma_to_t(s, &log_sigmas);
                    // Unrounded timesteps are truncated by the int64 cast.
                    if round {
                        t.round_ties_even() as i64
                    } else {
                        t as i64
                    }
                })
                .collect();
            (sigmas, ts)
        } else {
            let sigmas = int_ts.iter().map(|&t| schedule::np_interp_index(t as f64, &train_sigmas)).collect();
            (sigmas, int_ts)
        };
        let sigma_last = match final_sigmas {
            FinalSigmas::Zero => 0.0,
            FinalSigmas::SigmaMin => ((1.0 - ac[0]) / ac[0]).sqrt(),
        };
        let mut sigmas: Vec<f32> = sigmas.into_iter().map(|s| s as f32).collect();
        sigmas.push(sigma_last);

        Ok(Self {
            prediction: common.prediction_type,
            solver_type,
            lower_order_final: cfg.lower_order_final.unwrap_or(true),
            euler_at_final: cfg.euler_at_final.unwrap_or(false),
            final_sigmas,
            timesteps: timesteps.into_iter().map(|t| t as f64).collect(),
            sigmas,
            cursor: Cursor::default(),
            model_outputs: [None, None],
            lower_order_nums: 0,
        })
    }

    /// `convert_model_output` for dpmsolver++: the data prediction x0.
    fn data_prediction(&self, model_output: &Tensor, sample: &Tensor, sigma: f32) -> Result<Tensor> {
        let (alpha_t, sigma_t) = alpha_sigma(sigma);
        match self.prediction {
            PredictionType::Epsilon => {
                ops::div(CLASS, &ops::sub(CLASS, sample, &ops::mul(CLASS, model_output, sigma_t)?)?, alpha_t)
            }
            PredictionType::Sample => Ok(model_output.clone()),
            PredictionType::VPrediction => {
                ops::sub(CLASS, &ops::mul(CLASS, sample, alpha_t)?, &ops::mul(CLASS, model_output, sigma_t)?)
            }
        }
    }
}

impl DiffusionScheduler for DpmPp2M {
    fn kind(&self) -> SamplerKind {
        SamplerKind::DpmPp2M
    }

    fn timesteps(&self) -> Vec<f64> {
        self.timesteps.clone()
    }

    fn sigmas(&self) -> Option<Vec<f32>> {
        Some(self.sigmas.clone())
    }

    fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    fn set_begin_index(&mut self, begin: usize) {
        self.cursor.begin = Some(begin);
    }

    fn scale_model_input(&mut self, sample: &Tensor, _i: usize) -> Result<Tensor> {
        Ok(sample.clone())
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
        let idx = self.cursor.current(CLASS, &self.timesteps, i, Missing::Last)?;
        let n = self.timesteps.len();
        let lower_order_final = idx + 1 == n
            && (self.euler_at_final
                || (self.lower_order_final && n < 15)
                || self.final_sigmas == FinalSigmas::Zero);

        let (sigma_s0, sigma_next) = sigma_pair(CLASS, &self.sigmas, idx)?;
        let x0 = self.data_prediction(model_output, sample, sigma_s0)?;
        self.model_outputs[0] = self.model_outputs[1].take();
        self.model_outputs[1] = Some(x0.clone());

        let (alpha_t, sigma_t) = alpha_sigma(sigma_next);
        let (alpha_s0, sigma_s0a) = alpha_sigma(sigma_s0);
        let lambda_t = lambda(alpha_t, sigma_t);
        let lambda_s0 = lambda(alpha_s0, sigma_s0a);
        let h = lambda_t - lambda_s0;
        let coeff_sample = sigma_t / sigma_s0a;
        let coeff_d0 = alpha_t * ((-h).exp() - 1.0);
        let first =
            ops::sub(CLASS, &ops::mul(CLASS, sample, coeff_sample)?, &ops::mul(CLASS, &x0, coeff_d0)?)?;

        let prev = match (&self.model_outputs[0], idx.checked_sub(1)) {
            (Some(m1), Some(prev_idx)) if self.lower_order_nums >= 1 && !lower_order_final => {
                let sigma_s1 = self.sigmas[prev_idx];
                let (alpha_s1, sigma_s1a) = alpha_sigma(sigma_s1);
                let lambda_s1 = lambda(alpha_s1, sigma_s1a);
                let h_0 = lambda_s0 - lambda_s1;
                let r0 = h_0 / h;
                let d1 = ops::mul(CLASS, &ops::sub(CLASS, &x0, m1)?, 1.0 / r0)?;
                match self.solver_type {
                    SolverType::Midpoint => ops::sub(CLASS, &first, &ops::mul(CLASS, &d1, 0.5 * coeff_d0)?)?,
                    SolverType::Heun => {
                        let k = alpha_t * (((-h).exp() - 1.0) / h + 1.0);
                        ops::add(CLASS, &first, &ops::mul(CLASS, &d1, k)?)?
                    }
                }
            }
            _ => first,
        };
        if self.lower_order_nums < 2 {
            self.lower_order_nums += 1;
        }
        self.cursor.advance();
        Ok(prev)
    }

    fn add_noise(&self, original: &Tensor, noise: &Tensor, i: usize) -> Result<Tensor> {
        check_same_shape(CLASS, noise, original)?;
        let idx = self.cursor.noise_index(CLASS, &self.timesteps, i, Missing::Last)?;
        let (sigma, _) = sigma_pair(CLASS, &self.sigmas, idx)?;
        let (alpha_t, sigma_t) = alpha_sigma(sigma);
        ops::add(CLASS, &ops::mul(CLASS, original, alpha_t)?, &ops::mul(CLASS, noise, sigma_t)?)
    }

    fn pred_original_sample(&self) -> Option<&Tensor> {
        self.model_outputs[1].as_ref()
    }
}
