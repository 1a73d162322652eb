//! "PLMS": diffusers' `PNDMScheduler`, a linear multistep method on the
//! DDIM update.
//!
//! With `skip_prk_steps` (every SD checkpoint's config) the schedule visits
//! the second timestep twice: the first visit is an Euler step whose model
//! output is averaged with the second visit's to redo the same step (a Heun
//! start). Without it, diffusers warms up with 12 Runge-Kutta (PRK) model
//! calls. Both layouts are reproduced, including img2img, where diffusers
//! never calls `set_begin_index` on this class and the warm-up simply begins
//! at the sliced schedule's first entry.

use candle_core::Tensor;

use crate::config::{check_steps, ClassDefaults, CommonConfig, PredictionType, SchedulerConfig};
use crate::ddim::{add_noise_alpha, alpha_at, timestep_at};
use crate::error::{Result, SchedulerError};
use crate::ops::{self, check_f32, check_same_shape};
use crate::schedule;
use crate::{DiffusionScheduler, NoiseSource, SamplerKind};

const CLASS: &str = "PNDMScheduler";

pub(crate) const DEFAULTS: ClassDefaults = ClassDefaults {
    class: CLASS,
    beta_start: 0.0001,
    beta_end: 0.02,
    beta_schedule: "linear",
    timestep_spacing: "leading",
    accepts_rescale: false,
};

const PNDM_ORDER: usize = 4;

pub(crate) struct Pndm {
    prediction: PredictionType,
    alphas_cumprod: Vec<f32>,
    final_alpha_cumprod: f32,
    num_train: usize,
    steps: usize,
    skip_prk: bool,
    prk_timesteps: Vec<i64>,
    timesteps: Vec<i64>,
    counter: usize,
    ets: Vec<Tensor>,
    cur_sample: Option<Tensor>,
    cur_model_output: Option<Tensor>,
}

impl Pndm {
    pub fn new(cfg: &SchedulerConfig, steps: usize) -> Result<Self> {
        let common = CommonConfig::resolve(cfg, &DEFAULTS)?;
        check_steps(CLASS, steps, common.num_train_timesteps)?;
        if common.prediction_type == PredictionType::Sample {
            return Err(SchedulerError::InvalidValue {
                class: CLASS,
                field: "prediction_type",
                value: "\"sample\"".into(),
                expected: "epsilon or v_prediction",
            });
        }
        let num_train = common.num_train_timesteps;
        let skip_prk = cfg.skip_prk_steps.unwrap_or(false);
        // Ascending, as diffusers' `_timesteps`.
        let mut base =
            schedule::int_timesteps(common.timestep_spacing, num_train, steps, common.steps_offset);
        base.reverse();
        let n = base.len();
        let (prk, plms): (Vec<i64>, Vec<i64>) = if skip_prk {
            // [t0 .. t(n-2), t(n-2), t(n-1)] reversed.
            let mut v: Vec<i64> = base[..n.saturating_sub(1)].to_vec();
            if n >= 2 {
                v.push(base[n - 2]);
            }
            if let Some(&last) = base.last() {
                v.push(last);
            }
            v.reverse();
            (Vec::new(), v)
        } else {
            if n < PNDM_ORDER {
                return Err(SchedulerError::InvalidSteps {
                    class: CLASS,
                    steps,
                    reason: format!(
                        "the Runge-Kutta warm-up needs at least {PNDM_ORDER} steps (or skip_prk_steps=true)"
                    ),
                });
            }
            let half = (num_train / steps / 2) as i64;
            // last 4 timesteps, each twice, offset alternately by 0 / half ...
            let doubled: Vec<i64> = base[n - PNDM_ORDER..].iter().flat_map(|&t| [t, t + half]).collect();
            // ... drop the last, repeat each twice, drop both ends, reverse.
            let mut prk: Vec<i64> = doubled[..doubled.len() - 1].iter().flat_map(|&t| [t, t]).collect();
            prk.remove(0);
            prk.pop();
            prk.reverse();
            let mut plms: Vec<i64> = base[..n - 3].to_vec();
            plms.reverse();
            (prk, plms)
        };
        let ac = schedule::alphas_cumprod(&schedule::betas(&common));
        let final_alpha_cumprod = if cfg.set_alpha_to_one.unwrap_or(false) { 1.0 } else { ac[0] };
        let mut timesteps = prk.clone();
        timesteps.extend_from_slice(&plms);
        for &t in &timesteps {
            alpha_at(CLASS, &ac, t)?;
        }
        Ok(Self {
            prediction: common.prediction_type,
            alphas_cumprod: ac,
            final_alpha_cumprod,
            num_train,
            steps,
            skip_prk,
            prk_timesteps: prk,
            timesteps,
            counter: 0,
            ets: Vec::new(),
            cur_sample: None,
            cur_model_output: None,
        })
    }

    /// diffusers' `_get_prev_sample`: the DDIM-form update from `t` to
    /// `prev_t` (formula (9) of the PNDM paper).
    fn prev_sample(&self, sample: &Tensor, t: i64, prev_t: i64, model_output: &Tensor) -> Result<Tensor> {
        let a_t = alpha_at(CLASS, &self.alphas_cumprod, t)?;
        let a_prev = if prev_t >= 0 {
            alpha_at(CLASS, &self.alphas_cumprod, prev_t)?
        } else {
            self.final_alpha_cumprod
        };
        let b_t = 1.0 - a_t;
        let b_prev = 1.0 - a_prev;
        let model_output = match self.prediction {
            PredictionType::VPrediction => ops::lin2(CLASS, model_output, a_t.sqrt(), sample, b_t.sqrt())?,
            _ => model_output.clone(),
        };
        let sample_coeff = (a_prev / a_t).sqrt();
        let denom = a_t * b_prev.sqrt() + (a_t * b_t * a_prev).sqrt();
        let correction = ops::div(CLASS, &ops::mul(CLASS, &model_output, a_prev - a_t)?, denom)?;
        ops::sub(CLASS, &ops::mul(CLASS, sample, sample_coeff)?, &correction)
    }

    fn step_prk(&mut self, model_output: &Tensor, t: i64, sample: &Tensor) -> Result<Tensor> {
        let half = (self.num_train / self.steps / 2) as i64;
        let diff_to_prev = if self.counter % 2 == 1 { 0 } else { half };
        let prev_t = t - diff_to_prev;
        let t = self.prk_timesteps[self.counter / 4 * 4];
        let model_output = match self.counter % 4 {
            0 => {
                self.accumulate(model_output, 1.0 / 6.0)?;
                self.ets.push(model_output.clone());
                self.cur_sample = Some(sample.clone());
                model_output.clone()
            }
            1 | 2 => {
                self.accumulate(model_output, 1.0 / 3.0)?;
                model_output.clone()
            }
            _ => {
                let scaled = ops::mul(CLASS, model_output, (1.0f64 / 6.0) as f32)?;
                match self.cur_model_output.take() {
                    Some(acc) => ops::add(CLASS, &acc, &scaled)?,
                    None => scaled,
                }
            }
        };
        let cur = self.cur_sample.clone().unwrap_or_else(|| sample.clone());
        let prev = self.prev_sample(&cur, t, prev_t, &model_output)?;
        self.counter += 1;
        Ok(prev)
    }

    /// `cur_model_output += k * model_output`, where the accumulator starts
    /// as Python's integer 0.
    fn accumulate(&mut self, model_output: &Tensor, k: f64) -> Result<()> {
        let scaled = ops::mul(CLASS, model_output, k as f32)?;
        self.cur_model_output = Some(match self.cur_model_output.take() {
            Some(acc) => ops::add(CLASS, &acc, &scaled)?,
            None => scaled,
        });
        Ok(())
    }

    fn step_plms(&mut self, model_output: &Tensor, t: i64, sample: &Tensor) -> Result<Tensor> {
        if !self.skip_prk && self.ets.len() < 3 {
            return Err(SchedulerError::InvalidConfig {
                class: CLASS,
                reason: "PLMS steps need the Runge-Kutta warm-up first".into(),
            });
        }
        let ratio = (self.num_train / self.steps) as i64;
        let (mut t, mut prev_t) = (t, t - ratio);
        if self.counter != 1 {
            let keep = self.ets.len().saturating_sub(3);
            self.ets.drain(..keep);
            self.ets.push(model_output.clone());
        } else {
            prev_t = t;
            t += ratio;
        }
        let mut sample = sample.clone();
        let e = &self.ets;
        let model_output = match e.len() {
            1 if self.counter == 0 => {
                self.cur_sample = Some(sample.clone());
                model_output.clone()
            }
            1 if self.counter == 1 => {
                let avg = ops::mul(CLASS, &ops::add(CLASS, model_output, &e[0])?, 0.5)?;
                if let Some(cur) = self.cur_sample.take() {
                    sample = cur;
                }
                avg
            }
            2 => {
                let num = ops::sub(CLASS, &ops::mul(CLASS, &e[1], 3.0)?, &e[0])?;
                ops::div(CLASS, &num, 2.0)?
            }
            3 => {
                let num = ops::sub(CLASS, &ops::mul(CLASS, &e[2], 23.0)?, &ops::mul(CLASS, &e[1], 16.0)?)?;
                let num = ops::add(CLASS, &num, &ops::mul(CLASS, &e[0], 5.0)?)?;
                ops::div(CLASS, &num, 12.0)?
            }
            n if n >= 4 => {
                let num =
                    ops::sub(CLASS, &ops::mul(CLASS, &e[n - 1], 55.0)?, &ops::mul(CLASS, &e[n - 2], 59.0)?)?;
                let num = ops::add(CLASS, &num, &ops::mul(CLASS, &e[n - 3], 37.0)?)?;
                let num = ops::sub(CLASS, &num, &ops::mul(CLASS, &e[n - 4], 9.0)?)?;
                ops::mul(CLASS, &num, (1.0f64 / 24.0) as f32)?
            }
            _ => {
                return Err(SchedulerError::InvalidConfig {
                    class: CLASS,
                    reason: format!(
                        "PLMS state out of order ({} stored outputs at step {})",
                        e.len(),
                        self.counter
                    ),
                })
            }
        };
        let prev = self.prev_sample(&sample, t, prev_t, &model_output)?;
        self.counter += 1;
        Ok(prev)
    }
}

impl DiffusionScheduler for Pndm {
    fn kind(&self) -> SamplerKind {
        SamplerKind::Pndm
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
        // diffusers' PNDMScheduler has no set_begin_index: the pipeline skips
        // the call and the warm-up starts wherever the loop starts.
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
        if self.counter < self.prk_timesteps.len() && !self.skip_prk {
            self.step_prk(model_output, t, sample)
        } else {
            self.step_plms(model_output, t, sample)
        }
    }

    fn add_noise(&self, original: &Tensor, noise: &Tensor, i: usize) -> Result<Tensor> {
        let t = timestep_at(CLASS, &self.timesteps, i)?;
        add_noise_alpha(CLASS, &self.alphas_cumprod, t, original, noise)
    }

    fn pred_original_sample(&self) -> Option<&Tensor> {
        None
    }
}
