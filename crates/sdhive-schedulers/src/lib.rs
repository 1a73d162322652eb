//! Diffusers' noise schedulers behind the A1111 sampler names, reproduced
//! closely enough (same float32/float64 arithmetic, same evaluation order)
//! that a denoising loop matches diffusers to ~1e-6.
//!
//! This crate owns: parsing a diffusers `scheduler_config.json`
//! ([`SchedulerConfig`]), resolving it per target class the way
//! `XScheduler.from_config(pipe.scheduler.config, **overrides)` does, the
//! timestep / sigma tables, and the per-step update of each sampler. It does
//! not own the model call or the random stream: noise comes from any
//! [`NoiseSource`] (normally `sdhive_rng::TorchGenerator`, which replays
//! `torch.randn(generator=...)`).
//!
//! The loop mirrors diffusers' pipelines:
//!
//! ```no_run
//! # use sdhive_schedulers::*;
//! # fn unet(x: &candle_core::Tensor, t: f64) -> candle_core::Tensor { x.clone() }
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cfg = SchedulerConfig::from_json_str(r#"{"beta_schedule":"scaled_linear"}"#)?;
//! let mut s = build(SamplerKind::Euler, SigmaSchedule::Default, &cfg, 20)?;
//! let mut rng = sdhive_rng::TorchGenerator::new(42);
//! let dev = candle_core::Device::Cpu;
//! let noise = rng.randn(4 * 64 * 64);
//! let mut latents = candle_core::Tensor::from_vec(noise, (1, 4, 64, 64), &dev)?;
//! latents = (latents * s.init_noise_sigma())?;
//! for (i, t) in s.timesteps().into_iter().enumerate() {
//!     let x = s.scale_model_input(&latents, i)?;
//!     let eps = unet(&x, t);
//!     latents = s.step(&eps, i, &latents, &mut rng)?;
//! }
//! # Ok(()) }
//! ```
//!
//! For img2img / inpainting use [`img2img_start`], [`DiffusionScheduler::set_begin_index`]
//! and [`DiffusionScheduler::add_noise`] as diffusers' `get_timesteps` +
//! `prepare_latents` do.

mod config;
mod cursor;
mod ddim;
mod dpm;
mod error;
mod euler;
mod euler_ancestral;
mod flow;
mod flow_dpm;
mod flow_match;
mod lcm;
mod ops;
mod pndm;
mod schedule;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

pub use config::SchedulerConfig;
pub use error::{Result, SchedulerError};
pub use flow::{FlowSampler, FlowScheduler};
pub use flow_dpm::FlowDpmSolverMultistep;
pub use flow_match::{FlowMatchConfig, FlowMatchEulerDiscrete, TimeShift};

/// A stream of standard-normal float32 samples.
///
/// Consecutive calls must continue one stream, like consecutive
/// `torch.randn(..., generator=g)` calls do; the schedulers draw exactly where
/// diffusers' schedulers call `randn_tensor`.
pub trait NoiseSource {
    /// The next `numel` samples.
    fn randn(&mut self, numel: usize) -> Vec<f32>;
}

impl NoiseSource for sdhive_rng::TorchGenerator {
    fn randn(&mut self, numel: usize) -> Vec<f32> {
        sdhive_rng::TorchGenerator::randn(self, numel)
    }
}

impl<N: NoiseSource + ?Sized> NoiseSource for &mut N {
    fn randn(&mut self, numel: usize) -> Vec<f32> {
        (**self).randn(numel)
    }
}

impl<N: NoiseSource + ?Sized> NoiseSource for Box<N> {
    fn randn(&mut self, numel: usize) -> Vec<f32> {
        (**self).randn(numel)
    }
}

/// The samplers, by the diffusers class that implements them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SamplerKind {
    /// "Euler": `EulerDiscreteScheduler`.
    Euler,
    /// "Euler a": `EulerAncestralDiscreteScheduler`.
    EulerAncestral,
    /// "DDIM": `DDIMScheduler` (eta = 0).
    Ddim,
    /// "DPM++ 2M": `DPMSolverMultistepScheduler` with
    /// `algorithm_type="dpmsolver++"`, `solver_order=2`.
    DpmPp2M,
    /// "LCM": `LCMScheduler`.
    Lcm,
    /// "PLMS": `PNDMScheduler`.
    Pndm,
}

impl SamplerKind {
    /// The diffusers class name.
    pub fn diffusers_class(self) -> &'static str {
        match self {
            SamplerKind::Euler => "EulerDiscreteScheduler",
            SamplerKind::EulerAncestral => "EulerAncestralDiscreteScheduler",
            SamplerKind::Ddim => "DDIMScheduler",
            SamplerKind::DpmPp2M => "DPMSolverMultistepScheduler",
            SamplerKind::Lcm => "LCMScheduler",
            SamplerKind::Pndm => "PNDMScheduler",
        }
    }

    /// Whether diffusers offers `use_karras_sigmas` for this class.
    pub fn supports_karras(self) -> bool {
        matches!(self, SamplerKind::Euler | SamplerKind::DpmPp2M)
    }
}

/// The sigma spacing requested on top of the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SigmaSchedule {
    /// Whatever the config says (diffusers' `from_config` without overrides).
    #[default]
    Default,
    /// `use_karras_sigmas=True` (Euler and DPM++ 2M only).
    Karras,
}

/// The index of the first timestep an img2img run with `strength` uses, as
/// diffusers' `get_timesteps` computes it (`t_start * order`): pass it to
/// [`DiffusionScheduler::set_begin_index`], add noise at that index and
/// denoise from it.
pub fn img2img_start(num_inference_steps: usize, strength: f64, order: usize) -> usize {
    // Python's int() truncates toward zero; negative strengths clamp to 0.
    let scaled = (num_inference_steps as f64 * strength).trunc();
    let init_timestep =
        if scaled.is_nan() || scaled <= 0.0 { 0 } else { (scaled as usize).min(num_inference_steps) };
    num_inference_steps.saturating_sub(init_timestep) * order
}

/// One scheduler instance, set up for a fixed number of inference steps.
///
/// `i` arguments are indices into [`DiffusionScheduler::timesteps`], the
/// position of the timestep the model was just evaluated at. Like diffusers,
/// the sigma-based samplers only use it to find their start on the first
/// call and then follow their own counter.
pub trait DiffusionScheduler: Send {
    /// Which sampler this is.
    fn kind(&self) -> SamplerKind;

    /// The timesteps to evaluate the model at, in order (the values passed to
    /// the UNet; fractional for Euler with Karras sigmas).
    fn timesteps(&self) -> Vec<f64>;

    /// The sigma table (one longer than the timesteps) for sigma-based
    /// samplers, `None` for DDIM / LCM / PNDM.
    fn sigmas(&self) -> Option<Vec<f32>>;

    /// Standard deviation of the initial noise: multiply fresh `randn`
    /// latents by it.
    fn init_noise_sigma(&self) -> f64;

    /// diffusers' `scheduler.order` (1 for every sampler here).
    fn order(&self) -> usize {
        1
    }

    /// Starts the schedule at `timesteps()[begin]` (img2img).
    fn set_begin_index(&mut self, begin: usize);

    /// The model input for the current step.
    fn scale_model_input(&mut self, sample: &Tensor, i: usize) -> Result<Tensor>;

    /// Advances `sample` given the model output at `timesteps()[i]`, drawing
    /// ancestral / LCM noise from `rng`; returns the next latents.
    fn step(
        &mut self,
        model_output: &Tensor,
        i: usize,
        sample: &Tensor,
        rng: &mut dyn NoiseSource,
    ) -> Result<Tensor>;

    /// Noises clean latents to the level of `timesteps()[i]`.
    fn add_noise(&self, original: &Tensor, noise: &Tensor, i: usize) -> Result<Tensor>;

    /// The denoised estimate (x0) of the last step, for previews; `None`
    /// before the first step and for PNDM, which never forms one.
    fn pred_original_sample(&self) -> Option<&Tensor>;
}

/// Builds `kind` from `config` for `num_inference_steps` steps, as
/// `Class.from_config(config, **overrides).set_timesteps(steps)` would.
///
/// Overrides applied per kind: DPM++ 2M forces `algorithm_type="dpmsolver++"`
/// and `solver_order=2`; [`SigmaSchedule::Karras`] sets
/// `use_karras_sigmas=True` and is an error for samplers without it.
pub fn build(
    kind: SamplerKind,
    schedule: SigmaSchedule,
    config: &SchedulerConfig,
    num_inference_steps: usize,
) -> Result<Box<dyn DiffusionScheduler>> {
    let karras = match schedule {
        SigmaSchedule::Default => None,
        SigmaSchedule::Karras if kind.supports_karras() => Some(true),
        SigmaSchedule::Karras => return Err(SchedulerError::KarrasUnsupported { kind }),
    };
    let mut cfg = config.clone();
    if karras.is_some() {
        cfg.use_karras_sigmas = karras;
    }
    Ok(match kind {
        SamplerKind::Euler => Box::new(euler::Euler::new(&cfg, num_inference_steps)?),
        SamplerKind::EulerAncestral => {
            Box::new(euler_ancestral::EulerAncestral::new(&cfg, num_inference_steps)?)
        }
        SamplerKind::Ddim => Box::new(ddim::Ddim::new(&cfg, num_inference_steps)?),
        SamplerKind::DpmPp2M => {
            cfg.algorithm_type = Some("dpmsolver++".into());
            cfg.solver_order = Some(2);
            Box::new(dpm::DpmPp2M::new(&cfg, num_inference_steps)?)
        }
        SamplerKind::Lcm => Box::new(lcm::Lcm::new(&cfg, num_inference_steps)?),
        SamplerKind::Pndm => Box::new(pndm::Pndm::new(&cfg, num_inference_steps)?),
    })
}

/// The float32 `alphas_cumprod` table that diffusers' class for `kind` holds
/// when built from `config` (including the 2^-24 zero-terminal-SNR pin of
/// the sigma-based classes).
pub fn alphas_cumprod(kind: SamplerKind, config: &SchedulerConfig) -> Result<Vec<f32>> {
    let defaults = match kind {
        SamplerKind::Euler => &euler::DEFAULTS,
        SamplerKind::EulerAncestral => &euler_ancestral::DEFAULTS,
        SamplerKind::Ddim => &ddim::DEFAULTS,
        SamplerKind::DpmPp2M => &dpm::DEFAULTS,
        SamplerKind::Lcm => &lcm::DEFAULTS,
        SamplerKind::Pndm => &pndm::DEFAULTS,
    };
    let mut cfg = config.clone();
    if kind == SamplerKind::Lcm {
        cfg.timestep_spacing = None;
    }
    let common = config::CommonConfig::resolve(&cfg, defaults)?;
    Ok(match kind {
        SamplerKind::Euler | SamplerKind::EulerAncestral | SamplerKind::DpmPp2M => {
            euler::sigma_alphas_cumprod(&common)
        }
        _ => schedule::alphas_cumprod(&schedule::betas(&common)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn img2img_start_matches_get_timesteps() {
        assert_eq!(img2img_start(10, 0.6, 1), 4);
        assert_eq!(img2img_start(10, 1.0, 1), 0);
        assert_eq!(img2img_start(10, 1.5, 1), 0);
        assert_eq!(img2img_start(10, 0.0, 1), 10);
        assert_eq!(img2img_start(50, 0.75, 1), 13);
        // int(0.3 * 10) == 3 even though 0.3 * 10 == 3.0000000000000004.
        assert_eq!(img2img_start(10, 0.3, 1), 7);
    }
}
