//! "Euler a": diffusers' `EulerAncestralDiscreteScheduler`, which steps
//! down to `sigma_down` and re-injects `sigma_up` of fresh noise every step.

use candle_core::Tensor;

use crate::config::{
    check_steps, ClassDefaults, CommonConfig, PredictionType, SchedulerConfig, TimestepSpacing,
};
use crate::cursor::{Cursor, Missing};
use crate::error::{Result, SchedulerError};
use crate::euler::{euler_x0, scale_by_sigma, sigma_alphas_cumprod, sigma_pair};
use crate::ops::{self, check_f32, check_same_shape};
use crate::schedule;
use crate::{DiffusionScheduler, NoiseSource, SamplerKind};

const CLASS: &str = "EulerAncestralDiscreteScheduler";

pub(crate) const DEFAULTS: ClassDefaults = ClassDefaults {
    class: CLASS,
    beta_start: 0.0001,
    beta_end: 0.02,
    beta_schedule: "linear",
    timestep_spacing: "linspace",
    accepts_rescale: true,
};

pub(crate) struct EulerAncestral {
    prediction: PredictionType,
    timesteps: Vec<f64>,
    sigmas: Vec<f32>,
    init_noise_sigma: f32,
    cursor: Cursor,
    pred_original: Option<Tensor>,
}

impl EulerAncestral {
    pub fn new(cfg: &SchedulerConfig, steps: usize) -> Result<Self> {
        let common = CommonConfig::resolve(cfg, &DEFAULTS)?;
        check_steps(CLASS, steps, common.num_train_timesteps)?;
        if common.prediction_type == PredictionType::Sample {
            return Err(SchedulerError::Unsupported {
                class: CLASS,
                field: "prediction_type",
                value: "\"sample\"".into(),
                why: "diffusers does not implement it for Euler ancestral either",
            });
        }
        let ac = sigma_alphas_cumprod(&common);
        let train_sigmas = schedule::train_sigmas(&ac);
        let ts32 = schedule::float_timesteps(
            common.timestep_spacing,
            common.num_train_timesteps,
            steps,
            common.steps_offset,
        );
        let mut sigmas: Vec<f32> =
            ts32.iter().map(|&t| schedule::np_interp_index(t as f64, &train_sigmas) as f32).collect();
        sigmas.push(0.0);
        let max_sigma = sigmas.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let init_noise_sigma = match common.timestep_spacing {
            TimestepSpacing::Linspace | TimestepSpacing::Trailing => max_sigma,
            TimestepSpacing::Leading => (max_sigma * max_sigma + 1.0).sqrt(),
        };
        Ok(Self {
            prediction: common.prediction_type,
            timesteps: ts32.into_iter().map(f64::from).collect(),
            sigmas,
            init_noise_sigma,
            cursor: Cursor::default(),
            pred_original: None,
        })
    }
}

impl DiffusionScheduler for EulerAncestral {
    fn kind(&self) -> SamplerKind {
        SamplerKind::EulerAncestral
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
        rng: &mut dyn NoiseSource,
    ) -> Result<Tensor> {
        check_f32(CLASS, "sample", sample)?;
        check_f32(CLASS, "model output", model_output)?;
        check_same_shape(CLASS, model_output, sample)?;
        let idx = self.cursor.current(CLASS, &self.timesteps, i, Missing::Error)?;
        let (sigma_from, sigma_to) = sigma_pair(CLASS, &self.sigmas, idx)?;
        let sigma = sigma_from;
        let x0 = euler_x0(CLASS, self.prediction, model_output, sample, sigma)?;

        let from2 = sigma_from * sigma_from;
        let to2 = sigma_to * sigma_to;
        let sigma_up = (to2 * (from2 - to2) / from2).sqrt();
        let sigma_down = (to2 - sigma_up * sigma_up).sqrt();

        let derivative = ops::div(CLASS, &ops::sub(CLASS, sample, &x0)?, sigma)?;
        let dt = sigma_down - sigma;
        let prev = ops::add(CLASS, sample, &ops::mul(CLASS, &derivative, dt)?)?;
        let noise = ops::noise_like(CLASS, model_output, rng)?;
        let prev = ops::add(CLASS, &prev, &ops::mul(CLASS, &noise, sigma_up)?)?;
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
