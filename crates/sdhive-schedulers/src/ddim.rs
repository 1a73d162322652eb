//! "DDIM": diffusers' `DDIMScheduler` with `eta = 0` (what the pipelines
//! pass by default), so it is deterministic.
//!
//! Like diffusers, the previous timestep is always `t - T // steps`, even for
//! `trailing` / `linspace` spacing where that is not the next timestep in the
//! schedule.

use candle_core::Tensor;

use crate::config::{check_steps, reject_flag, ClassDefaults, CommonConfig, PredictionType, SchedulerConfig};
use crate::error::{Result, SchedulerError, TensorCtx};
use crate::ops::{self, check_f32, check_same_shape};
use crate::schedule;
use crate::{DiffusionScheduler, NoiseSource, SamplerKind};

const CLASS: &str = "DDIMScheduler";

pub(crate) const DEFAULTS: ClassDefaults = ClassDefaults {
    class: CLASS,
    beta_start: 0.0001,
    beta_end: 0.02,
    beta_schedule: "linear",
    timestep_spacing: "leading",
    accepts_rescale: true,
};

pub(crate) struct Ddim {
    prediction: PredictionType,
    alphas_cumprod: Vec<f32>,
    final_alpha_cumprod: f32,
    clip: Option<f32>,
    num_train: usize,
    steps: usize,
    timesteps: Vec<i64>,
    pred_original: Option<Tensor>,
}

/// `alphas_cumprod[t]` for a schedule timestep, or a clear error when the
/// spacing / offset pushed it outside the training range.
pub(crate) fn alpha_at(class: &'static str, ac: &[f32], t: i64) -> Result<f32> {
    usize::try_from(t).ok().and_then(|i| ac.get(i).copied()).ok_or_else(|| SchedulerError::InvalidConfig {
        class,
        reason: format!(
            "timestep {t} is outside the training range 0..{} (check steps_offset / timestep_spacing)",
            ac.len()
        ),
    })
}

/// diffusers' `add_noise` of the alphas_cumprod schedulers:
/// `sqrt(a) * x + sqrt(1 - a) * noise`.
pub(crate) fn add_noise_alpha(
    class: &'static str,
    ac: &[f32],
    t: i64,
    original: &Tensor,
    noise: &Tensor,
) -> Result<Tensor> {
    check_same_shape(class, noise, original)?;
    let a = alpha_at(class, ac, t)?;
    ops::add(class, &ops::mul(class, original, a.sqrt())?, &ops::mul(class, noise, (1.0 - a).sqrt())?)
}

/// Looks up `timesteps[i]` with a clear error for a bad index.
pub(crate) fn timestep_at(class: &'static str, timesteps: &[i64], i: usize) -> Result<i64> {
    timesteps.get(i).copied().ok_or(SchedulerError::IndexOutOfRange { class, index: i, len: timesteps.len() })
}

impl Ddim {
    pub fn new(cfg: &SchedulerConfig, steps: usize) -> Result<Self> {
        let common = CommonConfig::resolve(cfg, &DEFAULTS)?;
        check_steps(CLASS, steps, common.num_train_timesteps)?;
        reject_flag(
            CLASS,
            "thresholding",
            cfg.thresholding,
            "dynamic thresholding needs a per-sample quantile; not implemented",
        )?;
        let ac = schedule::alphas_cumprod(&schedule::betas(&common));
        let final_alpha_cumprod = if cfg.set_alpha_to_one.unwrap_or(true) { 1.0 } else { ac[0] };
        let clip = cfg.clip_sample.unwrap_or(true).then(|| cfg.clip_sample_range.unwrap_or(1.0) as f32);
        let timesteps = schedule::int_timesteps(
            common.timestep_spacing,
            common.num_train_timesteps,
            steps,
            common.steps_offset,
        );
        for &t in &timesteps {
            alpha_at(CLASS, &ac, t)?;
        }
        Ok(Self {
            prediction: common.prediction_type,
            alphas_cumprod: ac,
            final_alpha_cumprod,
            clip,
            num_train: common.num_train_timesteps,
            steps,
            timesteps,
            pred_original: None,
        })
    }
}

impl DiffusionScheduler for Ddim {
    fn kind(&self) -> SamplerKind {
        SamplerKind::Ddim
    }

    fn timesteps(&self) -> Vec<f64> {
        self.timesteps.iter().map(|&t| t as f64).collect()
    }

    fn sigmas(&self) -> Option<Vec<f32>> {
        None
    }

    fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    fn set_begin_index(&mut self, _begin: usize) {
        // DDIM is stateless per step: the timestep value alone decides.
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
        let t = timestep_at(CLASS, &self.timesteps, i)?;
        let prev_t = t - (self.num_train / self.steps) as i64;
        let a_t = alpha_at(CLASS, &self.alphas_cumprod, t)?;
        let a_prev = if prev_t >= 0 {
            alpha_at(CLASS, &self.alphas_cumprod, prev_t)?
        } else {
            self.final_alpha_cumprod
        };
        let b_t = 1.0 - a_t;

        let (x0, eps) = match self.prediction {
            PredictionType::Epsilon => {
                let x0 = ops::div(
                    CLASS,
                    &ops::sub(CLASS, sample, &ops::mul(CLASS, model_output, b_t.sqrt())?)?,
                    a_t.sqrt(),
                )?;
                (x0, model_output.clone())
            }
            PredictionType::Sample => {
                let eps = ops::div(
                    CLASS,
                    &ops::sub(CLASS, sample, &ops::mul(CLASS, model_output, a_t.sqrt())?)?,
                    b_t.sqrt(),
                )?;
                (model_output.clone(), eps)
            }
            PredictionType::VPrediction => {
                let x0 = ops::sub(
                    CLASS,
                    &ops::mul(CLASS, sample, a_t.sqrt())?,
                    &ops::mul(CLASS, model_output, b_t.sqrt())?,
                )?;
                let eps = ops::add(
                    CLASS,
                    &ops::mul(CLASS, model_output, a_t.sqrt())?,
                    &ops::mul(CLASS, sample, b_t.sqrt())?,
                )?;
                (x0, eps)
            }
        };
        let x0 = match self.clip {
            Some(r) => x0.clamp(-r, r).ctx(CLASS, "clip_sample")?,
            None => x0,
        };
        // eta = 0: std_dev_t is exactly 0, so the direction keeps all of
        // 1 - alpha_prev.
        let std_dev_t = 0.0f32;
        let dir_coeff = (1.0 - a_prev - std_dev_t * std_dev_t).sqrt();
        let direction = ops::mul(CLASS, &eps, dir_coeff)?;
        let prev = ops::add(CLASS, &ops::mul(CLASS, &x0, a_prev.sqrt())?, &direction)?;
        self.pred_original = Some(x0);
        Ok(prev)
    }

    fn add_noise(&self, original: &Tensor, noise: &Tensor, i: usize) -> Result<Tensor> {
        let t = timestep_at(CLASS, &self.timesteps, i)?;
        add_noise_alpha(CLASS, &self.alphas_cumprod, t, original, noise)
    }

    fn pred_original_sample(&self) -> Option<&Tensor> {
        self.pred_original.as_ref()
    }
}
