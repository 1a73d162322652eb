//! The samplers a flow-matching pipeline (SD3 / SD3.5) chooses between, behind one type: the model's own
//! `FlowMatchEulerDiscreteScheduler` ("Euler") and DPM++ 2M on flow sigmas ("DPM++ 2M"), both built from the
//! model's [`FlowMatchConfig`] as diffusers builds them from `pipe.scheduler.config`.

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::error::{Result, SchedulerError};
use crate::flow_dpm::FlowDpmSolverMultistep;
use crate::flow_match::{FlowMatchConfig, FlowMatchEulerDiscrete};

/// A flow-matching sampler, by the A1111 name it is offered under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlowSampler {
    /// "Euler": `FlowMatchEulerDiscreteScheduler`, the pipelines' default.
    #[default]
    Euler,
    /// "DPM++ 2M": `DPMSolverMultistepScheduler` with `use_flow_sigmas`, `prediction_type="flow_prediction"`.
    DpmPp2M,
}

impl FlowSampler {
    /// The diffusers class that runs it.
    pub fn diffusers_class(self) -> &'static str {
        match self {
            FlowSampler::Euler => "FlowMatchEulerDiscreteScheduler",
            FlowSampler::DpmPp2M => "DPMSolverMultistepScheduler",
        }
    }
}

/// A flow-matching scheduler set up for a number of steps.
#[derive(Debug, Clone)]
pub enum FlowScheduler {
    Euler(FlowMatchEulerDiscrete),
    DpmPp2M(FlowDpmSolverMultistep),
}

impl FlowScheduler {
    /// `set_timesteps(num_inference_steps)` of `sampler`'s class configured from `config` (static shift; a config
    /// with `use_dynamic_shifting` is refused, as by both classes without `mu`).
    pub fn new(sampler: FlowSampler, config: &FlowMatchConfig, num_inference_steps: usize) -> Result<Self> {
        Ok(match sampler {
            FlowSampler::Euler => {
                FlowScheduler::Euler(FlowMatchEulerDiscrete::new(config, num_inference_steps)?)
            }
            FlowSampler::DpmPp2M => {
                FlowScheduler::DpmPp2M(FlowDpmSolverMultistep::new(config, num_inference_steps)?)
            }
        })
    }

    pub fn sampler(&self) -> FlowSampler {
        match self {
            FlowScheduler::Euler(_) => FlowSampler::Euler,
            FlowScheduler::DpmPp2M(_) => FlowSampler::DpmPp2M,
        }
    }

    /// The timesteps to call the transformer at.
    pub fn timesteps(&self) -> Vec<f64> {
        match self {
            FlowScheduler::Euler(s) => s.timesteps(),
            FlowScheduler::DpmPp2M(s) => s.timesteps(),
        }
    }

    /// The sigmas, one longer than the timesteps (a final 0).
    pub fn sigmas(&self) -> &[f32] {
        match self {
            FlowScheduler::Euler(s) => s.sigmas(),
            FlowScheduler::DpmPp2M(s) => s.sigmas(),
        }
    }

    pub fn set_begin_index(&mut self, begin: usize) {
        match self {
            FlowScheduler::Euler(s) => s.set_begin_index(begin),
            FlowScheduler::DpmPp2M(s) => s.set_begin_index(begin),
        }
    }

    /// img2img's start, `σ·noise + (1 − σ)·sample`. Only the Euler class has `scale_noise`, which diffusers' SD3
    /// img2img pipeline calls; with DPM++ 2M that pipeline fails, so this does too.
    pub fn scale_noise(&self, sample: &Tensor, noise: &Tensor, i: usize) -> Result<Tensor> {
        match self {
            FlowScheduler::Euler(s) => s.scale_noise(sample, noise, i),
            FlowScheduler::DpmPp2M(_) => Err(SchedulerError::InvalidConfig {
                class: FlowSampler::DpmPp2M.diffusers_class(),
                reason: "has no scale_noise: diffusers' SD3 img2img pipeline cannot run it".into(),
            }),
        }
    }

    /// One step from `timesteps()[i]` given the model's velocity, in the model output's dtype.
    pub fn step(&mut self, model_output: &Tensor, i: usize, sample: &Tensor) -> Result<Tensor> {
        match self {
            FlowScheduler::Euler(s) => s.step(model_output, i, sample),
            FlowScheduler::DpmPp2M(s) => s.step(model_output, i, sample),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn builds_the_named_class() {
        let cfg = FlowMatchConfig::from_json_str(r#"{"shift":3.0}"#).expect("config");
        for sampler in [FlowSampler::Euler, FlowSampler::DpmPp2M] {
            let s = FlowScheduler::new(sampler, &cfg, 4).expect("schedule");
            assert_eq!(s.sampler(), sampler);
            assert_eq!(s.timesteps().len(), 4);
            assert_eq!(s.sigmas().len(), 5);
        }
        // Euler starts at σ = 1 (timestep 1000), DPM++ 2M just below (999).
        let euler = FlowScheduler::new(FlowSampler::Euler, &cfg, 4).expect("euler");
        let dpm = FlowScheduler::new(FlowSampler::DpmPp2M, &cfg, 4).expect("dpm");
        assert_eq!((euler.timesteps()[0], dpm.timesteps()[0]), (1000.0, 999.0));
        let x = Tensor::zeros(2, DType::F32, &Device::Cpu).expect("t");
        assert!(euler.scale_noise(&x, &x, 0).is_ok());
        let e = dpm.scale_noise(&x, &x, 0).expect_err("no scale_noise").to_string();
        assert!(e.contains("scale_noise"), "{e}");
    }
}
