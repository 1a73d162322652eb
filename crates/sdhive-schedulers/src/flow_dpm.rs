//! "DPM++ 2M" for flow-matching models (SD3 / SD3.5): diffusers' `DPMSolverMultistepScheduler` as the SD3
//! pipelines get it from `DPMSolverMultistepScheduler.from_config(pipe.scheduler.config, use_flow_sigmas=True,
//! prediction_type="flow_prediction", flow_shift=<the config's shift>)`, configured from the model's
//! [`FlowMatchConfig`].
//!
//! Of the flow-match config only `num_train_timesteps`, `shift` (as `flow_shift`) and `use_dynamic_shifting`
//! reach this class; everything else takes the class defaults: `dpmsolver++`, `solver_order=2`, `midpoint`,
//! `lower_order_final`, `final_sigmas_type="zero"`. What that gives:
//!
//! - sigmas: `1 − linspace(1, 1/N, n + 1)` shifted by `k·σ / (1 + (k − 1)·σ)`, reversed, the last (0) dropped, then
//!   a final 0 appended; in f64, rounded once to f32. Unlike `FlowMatchEulerDiscreteScheduler` the shift is applied
//!   once, and the first sigma is just below 1.
//! - timesteps: `σ·N` of the f64 sigmas, truncated to integers (the class casts them to int64).
//! - the data prediction `x0 = sample − σ·v`, and the DPM-Solver++ update in `λ = log(1 − σ) − log(σ)`: first order
//!   on the first step and on the last one (the final sigma is 0), the second-order multistep midpoint update
//!   between.
//!
//! Scalars are f32 as diffusers' 0-d tensors are; the latents are stepped in f32 and returned in the model output's
//! dtype, as diffusers upcasts the sample.

use candle_core::{DType, Tensor};

use crate::cursor::{Cursor, Missing};
use crate::error::{Result, SchedulerError, TensorCtx};
use crate::flow_match::{FlowMatchConfig, TimeShift};
use crate::ops;
use crate::schedule::np_linspace;

const CLASS: &str = "DPMSolverMultistepScheduler";

/// `DPMSolverMultistepScheduler` on flow sigmas after `set_timesteps(n)`, with its step counter and the last two
/// data predictions.
#[derive(Debug, Clone)]
pub struct FlowDpmSolverMultistep {
    /// Integer-valued, as the class's int64 timesteps.
    timesteps: Vec<f64>,
    /// One longer than `timesteps`: the final 0.
    sigmas: Vec<f32>,
    cursor: Cursor,
    /// Data predictions (f32) of the previous and the current step.
    model_outputs: [Option<Tensor>; 2],
    lower_order_nums: usize,
}

/// `_sigma_to_alpha_sigma_t` with `use_flow_sigmas`: `(1 − σ, σ)`, f32.
fn alpha_sigma(sigma: f32) -> (f32, f32) {
    (1.0 - sigma, sigma)
}

/// `log(α) − log(σ)`, f32 (+∞ at the final σ = 0).
fn lambda(sigma: f32) -> f32 {
    let (alpha, sigma) = alpha_sigma(sigma);
    alpha.ln() - sigma.ln()
}

impl FlowDpmSolverMultistep {
    /// `set_timesteps(num_inference_steps)` with `flow_shift` = the config's `shift`. A config with
    /// `use_dynamic_shifting` needs `mu`: use [`Self::with_mu`].
    pub fn new(config: &FlowMatchConfig, num_inference_steps: usize) -> Result<Self> {
        config.require_static_shift(CLASS)?;
        Self::build(config, num_inference_steps, config.shift)
    }

    /// `set_timesteps(num_inference_steps, mu=mu)`: the class asserts `use_dynamic_shifting` with the exponential
    /// time shift, and sets `flow_shift = e^mu`.
    pub fn with_mu(config: &FlowMatchConfig, num_inference_steps: usize, mu: f64) -> Result<Self> {
        if !config.use_dynamic_shifting || config.time_shift_type != TimeShift::Exponential {
            return Err(SchedulerError::InvalidConfig {
                class: CLASS,
                reason: "`mu` needs use_dynamic_shifting with time_shift_type \"exponential\"".into(),
            });
        }
        Self::build(config, num_inference_steps, mu.exp())
    }

    fn build(config: &FlowMatchConfig, steps: usize, flow_shift: f64) -> Result<Self> {
        if steps == 0 {
            return Err(SchedulerError::InvalidSteps {
                class: CLASS,
                steps,
                reason: "at least one step is required".into(),
            });
        }
        if !(flow_shift.is_finite() && flow_shift > 0.0) {
            return Err(SchedulerError::InvalidConfig {
                class: CLASS,
                reason: format!("flow_shift must be a positive number, got {flow_shift}"),
            });
        }
        let n = config.num_train_timesteps as f64;
        if n < 1.0 {
            return Err(SchedulerError::InvalidConfig {
                class: CLASS,
                reason: "num_train_timesteps must be at least 1".into(),
            });
        }
        let k = flow_shift;
        // Ascending from 0 to 1 − 1/N; reversed and without its 0 below.
        let shifted: Vec<f64> = np_linspace(1.0, 1.0 / n, steps + 1, true)
            .into_iter()
            .map(|alpha| {
                let s = 1.0 - alpha;
                k * s / (1.0 + (k - 1.0) * s)
            })
            .collect();
        let sigmas64: Vec<f64> = shifted.into_iter().rev().take(steps).collect();
        // int64 casts truncate toward zero.
        let timesteps: Vec<f64> = sigmas64.iter().map(|&s| (s * n).trunc()).collect();
        let mut sigmas: Vec<f32> = sigmas64.iter().map(|&s| s as f32).collect();
        if let Some(bad) = sigmas.iter().find(|s| !(s.is_finite() && **s > 0.0 && **s < 1.0)) {
            return Err(SchedulerError::InvalidConfig {
                class: CLASS,
                reason: format!("the schedule has sigma {bad} outside (0, 1); check shift / mu"),
            });
        }
        sigmas.push(0.0);
        Ok(Self {
            timesteps,
            sigmas,
            cursor: Cursor::default(),
            model_outputs: [None, None],
            lower_order_nums: 0,
        })
    }

    /// The timesteps to call the transformer at (integers, `trunc(σ·N)`).
    pub fn timesteps(&self) -> Vec<f64> {
        self.timesteps.clone()
    }

    /// The sigmas, one longer than the timesteps (a final 0).
    pub fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }

    /// Fresh latents are unit noise.
    pub fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    /// Starts the schedule at `timesteps()[begin]`.
    pub fn set_begin_index(&mut self, begin: usize) {
        self.cursor.begin = Some(begin);
    }

    /// The index of the current step, once the first step has placed it.
    pub fn step_index(&self) -> Option<usize> {
        self.cursor.step
    }

    /// The data prediction (x0) of the last step, for previews.
    pub fn pred_original_sample(&self) -> Option<&Tensor> {
        self.model_outputs[1].as_ref()
    }

    /// One step from `timesteps()[i]` given the model's velocity. `i` only places the first step (diffusers looks
    /// the timestep up, taking its second occurrence when it repeats); later steps follow the counter.
    pub fn step(&mut self, model_output: &Tensor, i: usize, sample: &Tensor) -> Result<Tensor> {
        ops::check_same_shape(CLASS, model_output, sample)?;
        let idx = self.cursor.current(CLASS, &self.timesteps, i, Missing::Last)?;
        let n = self.timesteps.len();
        if idx >= n {
            return Err(SchedulerError::PastEnd {
                class: CLASS,
                step: idx,
                needed: idx + 1,
                len: self.sigmas.len(),
            });
        }
        // `lower_order_final` also holds whenever the final sigma is 0, so the last step is always first order.
        let lower_order_final = idx + 1 == n;
        let out_dtype = model_output.dtype();
        let v = model_output.to_dtype(DType::F32).ctx(CLASS, "upcast")?;
        let sample = sample.to_dtype(DType::F32).ctx(CLASS, "upcast")?;

        let (sigma_s0, sigma_t) = (self.sigmas[idx], self.sigmas[idx + 1]);
        let x0 = ops::sub(CLASS, &sample, &ops::mul(CLASS, &v, sigma_s0)?)?;
        self.model_outputs[0] = self.model_outputs[1].take();
        self.model_outputs[1] = Some(x0.clone());

        let (alpha_t, _) = alpha_sigma(sigma_t);
        let (lambda_t, lambda_s0) = (lambda(sigma_t), lambda(sigma_s0));
        let h = lambda_t - lambda_s0;
        let coeff_sample = sigma_t / sigma_s0;
        let coeff_d0 = alpha_t * ((-h).exp() - 1.0);
        let first =
            ops::sub(CLASS, &ops::mul(CLASS, &sample, coeff_sample)?, &ops::mul(CLASS, &x0, coeff_d0)?)?;
        let prev = match (&self.model_outputs[0], idx.checked_sub(1)) {
            (Some(m1), Some(prev_idx)) if self.lower_order_nums >= 1 && !lower_order_final => {
                let h_0 = lambda_s0 - lambda(self.sigmas[prev_idx]);
                let r0 = h_0 / h;
                let d1 = ops::mul(CLASS, &ops::sub(CLASS, &x0, m1)?, 1.0 / r0)?;
                ops::sub(CLASS, &first, &ops::mul(CLASS, &d1, 0.5 * coeff_d0)?)?
            }
            _ => first,
        };
        if self.lower_order_nums < 2 {
            self.lower_order_nums += 1;
        }
        self.cursor.advance();
        prev.to_dtype(out_dtype).ctx(CLASS, "downcast")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn sd3() -> FlowMatchConfig {
        FlowMatchConfig::from_json_str(r#"{"num_train_timesteps":1000,"shift":3.0}"#).expect("config")
    }

    /// One step by hand: σ₀ = shift(0.999), the first sigma; the step is the first-order DPM++ update, which on
    /// flow sigmas is `(σ_t/σ_s)·x + (1 − σ_t/σ_s)·x0` for the exact log-ratio.
    #[test]
    fn the_first_sigma_and_a_single_step() {
        let s = FlowDpmSolverMultistep::new(&sd3(), 1).expect("schedule");
        let want = 3.0 * 0.999 / (1.0 + 2.0 * 0.999);
        assert_eq!(s.sigmas(), &[want as f32, 0.0]);
        assert_eq!(s.timesteps(), vec![999.0]);

        let mut s = FlowDpmSolverMultistep::new(&sd3(), 2).expect("schedule");
        let dev = Device::Cpu;
        let x = Tensor::new(&[1.0f32, -2.0], &dev).expect("t");
        let v = Tensor::new(&[0.5f32, 4.0], &dev).expect("t");
        let (s0, s1) = (s.sigmas()[0], s.sigmas()[1]);
        let got: Vec<f32> = s.step(&v, 0, &x).expect("step").to_vec1().expect("values");
        for (k, (&xi, &vi)) in [1.0f32, -2.0].iter().zip(&[0.5f32, 4.0]).enumerate() {
            let x0 = xi - s0 * vi;
            let ratio = s1 / s0;
            let want = ratio * xi + (1.0 - ratio) * x0;
            assert!((got[k] - want).abs() < 1e-5, "{k}: {} vs {want}", got[k]);
        }
        assert_eq!(s.step_index(), Some(1));
        // The last step lands on x0 exactly: σ_t = 0.
        let last: Vec<f32> = s.step(&v, 1, &x).expect("step").to_vec1().expect("values");
        assert_eq!(last, vec![1.0 - s1 * 0.5, -2.0 - s1 * 4.0]);
        assert!(matches!(s.step(&v, 2, &x), Err(SchedulerError::PastEnd { .. })));
    }

    #[test]
    fn dynamic_shifting_and_bad_input() {
        let dynamic =
            FlowMatchConfig::from_json_str(r#"{"use_dynamic_shifting":true,"shift":3.0}"#).expect("config");
        assert!(FlowDpmSolverMultistep::new(&dynamic, 4).is_err());
        assert!(FlowDpmSolverMultistep::with_mu(&sd3(), 4, 0.5).is_err(), "mu without dynamic shifting");
        let s = FlowDpmSolverMultistep::with_mu(&dynamic, 4, 3f64.ln()).expect("schedule");
        let same = FlowDpmSolverMultistep::new(&sd3(), 4).expect("schedule");
        assert_eq!(s.timesteps(), same.timesteps(), "e^mu = 3 is shift 3");
        assert!(FlowDpmSolverMultistep::new(&sd3(), 0).is_err());

        let mut s = FlowDpmSolverMultistep::new(&sd3(), 2).expect("schedule");
        let dev = Device::Cpu;
        let a = Tensor::zeros(3, DType::F32, &dev).expect("t");
        let b = Tensor::zeros(2, DType::F32, &dev).expect("t");
        assert!(matches!(s.step(&a, 0, &b), Err(SchedulerError::BadTensor { .. })));
    }

    /// Half-precision model outputs come back in their dtype, stepped in f32.
    #[test]
    fn keeps_the_model_outputs_dtype() {
        let mut s = FlowDpmSolverMultistep::new(&sd3(), 3).expect("schedule");
        let dev = Device::Cpu;
        let x = Tensor::ones(4, DType::F16, &dev).expect("t");
        let out = s.step(&x, 0, &x).expect("step");
        assert_eq!(out.dtype(), DType::F16);
    }
}
