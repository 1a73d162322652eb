//! "LCM": diffusers' `LCMScheduler` (latent consistency models).
//!
//! Each step jumps to a consistency-model estimate of the clean latents
//! (`denoised`, via the boundary-condition scalings `c_skip` / `c_out`) and,
//! except on the last step, re-noises it to the next timestep with fresh
//! noise. Timesteps are a subset of the distillation schedule
//! (`original_inference_steps`), so `timestep_spacing` plays no role.

use candle_core::Tensor;

use crate::config::{check_steps, reject_flag, ClassDefaults, CommonConfig, PredictionType, SchedulerConfig};
use crate::cursor::{Cursor, Missing};
use crate::ddim::{add_noise_alpha, alpha_at, timestep_at};
use crate::error::{Result, SchedulerError, TensorCtx};
use crate::ops::{self, check_f32, check_same_shape};
use crate::schedule;
use crate::{DiffusionScheduler, NoiseSource, SamplerKind};

const CLASS: &str = "LCMScheduler";

pub(crate) const DEFAULTS: ClassDefaults = ClassDefaults {
    class: CLASS,
    beta_start: 0.00085,
    beta_end: 0.012,
    beta_schedule: "scaled_linear",
    // Accepted by the class but never read by its set_timesteps.
    timestep_spacing: "leading",
    accepts_rescale: true,
};

/// consistency-model `sigma_data`.
const SIGMA_DATA: f32 = 0.5;

pub(crate) struct Lcm {
    prediction: PredictionType,
    alphas_cumprod: Vec<f32>,
    final_alpha_cumprod: f32,
    clip: Option<f32>,
    timestep_scaling: f32,
    steps: usize,
    timesteps: Vec<i64>,
    timesteps_f64: Vec<f64>,
    cursor: Cursor,
    denoised: Option<Tensor>,
}

impl Lcm {
    pub fn new(cfg: &SchedulerConfig, steps: usize) -> Result<Self> {
        // LCM never reads timestep_spacing, so an odd value must not fail.
        let mut cfg_spacing_free = cfg.clone();
        cfg_spacing_free.timestep_spacing = None;
        let common = CommonConfig::resolve(&cfg_spacing_free, &DEFAULTS)?;
        let num_train = common.num_train_timesteps;
        check_steps(CLASS, steps, num_train)?;
        reject_flag(
            CLASS,
            "thresholding",
            cfg.thresholding,
            "dynamic thresholding needs a per-sample quantile; not implemented",
        )?;
        let original_steps = cfg.original_inference_steps.unwrap_or(50);
        if original_steps == 0 || original_steps > num_train {
            return Err(SchedulerError::InvalidConfig {
                class: CLASS,
                reason: format!("original_inference_steps {original_steps} must be in 1..={num_train}"),
            });
        }
        if steps > original_steps {
            return Err(SchedulerError::InvalidSteps {
                class: CLASS,
                steps,
                reason: format!(
                    "more than original_inference_steps ({original_steps}); the schedule is a subset of it"
                ),
            });
        }
        let k = (num_train / original_steps) as i64;
        // Distillation schedule, descending: k*original_steps-1, ..., k-1.
        let origin: Vec<i64> = (1..=original_steps as i64).rev().map(|i| i * k - 1).collect();
        let timesteps: Vec<i64> = schedule::np_linspace(0.0, origin.len() as f64, steps, false)
            .into_iter()
            .map(|x| {
                let j = x.floor() as usize;
                origin[j.min(origin.len() - 1)]
            })
            .collect();

        let ac = schedule::alphas_cumprod(&schedule::betas(&common));
        for &t in &timesteps {
            alpha_at(CLASS, &ac, t)?;
        }
        let final_alpha_cumprod = if cfg.set_alpha_to_one.unwrap_or(true) { 1.0 } else { ac[0] };
        let clip = cfg.clip_sample.unwrap_or(false).then(|| cfg.clip_sample_range.unwrap_or(1.0) as f32);
        Ok(Self {
            prediction: common.prediction_type,
            alphas_cumprod: ac,
            final_alpha_cumprod,
            clip,
            timestep_scaling: cfg.timestep_scaling.unwrap_or(10.0) as f32,
            steps,
            timesteps_f64: timesteps.iter().map(|&t| t as f64).collect(),
            timesteps,
            cursor: Cursor::default(),
            denoised: None,
        })
    }

    /// `get_scalings_for_boundary_condition_discrete` in float32, with
    /// torch's `python_float / tensor` evaluated as `reciprocal * float`.
    fn boundary_scalings(&self, t: i64) -> (f32, f32) {
        let scaled = t as f32 * self.timestep_scaling;
        let denom = scaled * scaled + SIGMA_DATA * SIGMA_DATA;
        let c_skip = (1.0 / denom) * (SIGMA_DATA * SIGMA_DATA);
        let c_out = scaled / denom.sqrt();
        (c_skip, c_out)
    }
}

impl DiffusionScheduler for Lcm {
    fn kind(&self) -> SamplerKind {
        SamplerKind::Lcm
    }

    fn timesteps(&self) -> Vec<f64> {
        self.timesteps_f64.clone()
    }

    fn sigmas(&self) -> Option<Vec<f32>> {
        None
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
        rng: &mut dyn NoiseSource,
    ) -> Result<Tensor> {
        check_f32(CLASS, "sample", sample)?;
        check_f32(CLASS, "model output", model_output)?;
        check_same_shape(CLASS, model_output, sample)?;
        let t = timestep_at(CLASS, &self.timesteps, i)?;
        let idx = self.cursor.current(CLASS, &self.timesteps_f64, i, Missing::Error)?;
        let prev_t = self.timesteps.get(idx + 1).copied().unwrap_or(t);
        let a_t = alpha_at(CLASS, &self.alphas_cumprod, t)?;
        let a_prev = if prev_t >= 0 {
            alpha_at(CLASS, &self.alphas_cumprod, prev_t)?
        } else {
            self.final_alpha_cumprod
        };
        let b_t = 1.0 - a_t;
        let b_prev = 1.0 - a_prev;
        let (c_skip, c_out) = self.boundary_scalings(t);

        let x0 = match self.prediction {
            PredictionType::Epsilon => ops::div(
                CLASS,
                &ops::sub(CLASS, sample, &ops::mul(CLASS, model_output, b_t.sqrt())?)?,
                a_t.sqrt(),
            )?,
            PredictionType::Sample => model_output.clone(),
            PredictionType::VPrediction => ops::sub(
                CLASS,
                &ops::mul(CLASS, sample, a_t.sqrt())?,
                &ops::mul(CLASS, model_output, b_t.sqrt())?,
            )?,
        };
        let x0 = match self.clip {
            Some(r) => x0.clamp(-r, r).ctx(CLASS, "clip_sample")?,
            None => x0,
        };
        let denoised = ops::lin2(CLASS, &x0, c_out, sample, c_skip)?;
        let prev = if idx + 1 != self.steps {
            let noise = ops::noise_like(CLASS, model_output, rng)?;
            ops::lin2(CLASS, &denoised, a_prev.sqrt(), &noise, b_prev.sqrt())?
        } else {
            denoised.clone()
        };
        self.denoised = Some(denoised);
        self.cursor.advance();
        Ok(prev)
    }

    fn add_noise(&self, original: &Tensor, noise: &Tensor, i: usize) -> Result<Tensor> {
        let t = timestep_at(CLASS, &self.timesteps, i)?;
        add_noise_alpha(CLASS, &self.alphas_cumprod, t, original, noise)
    }

    fn pred_original_sample(&self) -> Option<&Tensor> {
        self.denoised.as_ref()
    }
}
