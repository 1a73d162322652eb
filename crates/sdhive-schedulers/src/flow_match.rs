//! diffusers' `FlowMatchEulerDiscreteScheduler` as the SD3 / SD3.5 pipelines use it: the shifted sigma schedule
//! (static `shift`, or resolution-dependent shifting with `mu` where `use_dynamic_shifting` is set; optional
//! `shift_terminal`), the Euler step on the predicted velocity, and `scale_noise` for img2img, configured from
//! `scheduler/scheduler_config.json`.
//!
//! It is not one of the [`crate::SamplerKind`] samplers: the model predicts a velocity, timesteps are `σ·1000`,
//! and a flow-matching pipeline never swaps it for a noise-prediction scheduler.
//!
//! Arithmetic follows diffusers: the training table in f32 (torch), the inference sigmas in f64 (numpy) rounded
//! once to f32, timesteps `σ·1000` in f32, the step `x + (σ_next − σ)·v` in f32.

use std::path::Path;

use candle_core::{DType, Tensor};
use serde::Deserialize;

use crate::error::{Result, SchedulerError, TensorCtx};

const CLASS: &str = "FlowMatchEulerDiscreteScheduler";

/// How `use_dynamic_shifting` bends the sigmas with `mu` (`time_shift_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeShift {
    /// `e^mu / (e^mu + (1/σ − 1))`.
    Exponential,
    /// `mu / (mu + (1/σ − 1))`.
    Linear,
}

/// The fields of `scheduler_config.json` this scheduler reads, every one optional (absent: the class default).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawConfig {
    num_train_timesteps: Option<usize>,
    shift: Option<f64>,
    use_dynamic_shifting: Option<bool>,
    base_shift: Option<f64>,
    max_shift: Option<f64>,
    base_image_seq_len: Option<usize>,
    max_image_seq_len: Option<usize>,
    invert_sigmas: Option<bool>,
    shift_terminal: Option<f64>,
    use_karras_sigmas: Option<bool>,
    use_exponential_sigmas: Option<bool>,
    use_beta_sigmas: Option<bool>,
    time_shift_type: Option<String>,
    stochastic_sampling: Option<bool>,
}

/// A resolved `FlowMatchEulerDiscreteScheduler` config (diffusers 0.42.1's defaults for absent keys).
#[derive(Debug, Clone, PartialEq)]
pub struct FlowMatchConfig {
    pub num_train_timesteps: usize,
    pub shift: f64,
    pub use_dynamic_shifting: bool,
    pub base_shift: f64,
    pub max_shift: f64,
    pub base_image_seq_len: usize,
    pub max_image_seq_len: usize,
    pub shift_terminal: Option<f64>,
    pub time_shift_type: TimeShift,
}

impl Default for FlowMatchConfig {
    fn default() -> Self {
        Self {
            num_train_timesteps: 1000,
            shift: 1.0,
            use_dynamic_shifting: false,
            base_shift: 0.5,
            max_shift: 1.15,
            base_image_seq_len: 256,
            max_image_seq_len: 4096,
            shift_terminal: None,
            time_shift_type: TimeShift::Exponential,
        }
    }
}

impl FlowMatchConfig {
    /// Reads and resolves a `scheduler_config.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|source| SchedulerError::ConfigIo { path: path.to_path_buf(), source })?;
        Self::from_json_str(&text)
    }

    /// Resolves the text of a `scheduler_config.json`; keys listed in `_use_default_values` take this class's
    /// defaults, as diffusers' `from_config` gives them.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let mut value: serde_json::Value = serde_json::from_str(text).map_err(SchedulerError::ConfigParse)?;
        let Some(obj) = value.as_object_mut() else {
            return Err(SchedulerError::InvalidConfig {
                class: CLASS,
                reason: "config must be a JSON object".into(),
            });
        };
        if let Some(keys) = obj.remove("_use_default_values") {
            for key in keys.as_array().into_iter().flatten().filter_map(|k| k.as_str()) {
                obj.remove(key);
            }
        }
        let raw: RawConfig = serde_json::from_value(value).map_err(SchedulerError::ConfigParse)?;
        Self::resolve(raw)
    }

    fn resolve(raw: RawConfig) -> Result<Self> {
        let unsupported = [
            ("invert_sigmas", raw.invert_sigmas),
            ("use_karras_sigmas", raw.use_karras_sigmas),
            ("use_exponential_sigmas", raw.use_exponential_sigmas),
            ("use_beta_sigmas", raw.use_beta_sigmas),
            ("stochastic_sampling", raw.stochastic_sampling),
        ];
        if let Some((field, _)) = unsupported.iter().find(|(_, v)| *v == Some(true)) {
            return Err(SchedulerError::Unsupported {
                class: CLASS,
                field,
                value: "true".into(),
                why: "no SD3 / SD3.5 release configures it",
            });
        }
        let d = Self::default();
        let time_shift_type = match raw.time_shift_type.as_deref() {
            None | Some("exponential") => TimeShift::Exponential,
            Some("linear") => TimeShift::Linear,
            Some(other) => {
                return Err(SchedulerError::InvalidValue {
                    class: CLASS,
                    field: "time_shift_type",
                    value: format!("{other:?}"),
                    expected: "exponential or linear",
                })
            }
        };
        let cfg = Self {
            num_train_timesteps: raw.num_train_timesteps.unwrap_or(d.num_train_timesteps),
            shift: raw.shift.unwrap_or(d.shift),
            use_dynamic_shifting: raw.use_dynamic_shifting.unwrap_or(d.use_dynamic_shifting),
            base_shift: raw.base_shift.unwrap_or(d.base_shift),
            max_shift: raw.max_shift.unwrap_or(d.max_shift),
            base_image_seq_len: raw.base_image_seq_len.unwrap_or(d.base_image_seq_len),
            max_image_seq_len: raw.max_image_seq_len.unwrap_or(d.max_image_seq_len),
            // diffusers tests `if self.config.shift_terminal:`, so 0 means none.
            shift_terminal: raw.shift_terminal.filter(|&t| t != 0.0),
            time_shift_type,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(SchedulerError::InvalidConfig { class: CLASS, reason });
        if self.num_train_timesteps < 1 {
            return bad("num_train_timesteps must be at least 1".into());
        }
        if !(self.shift.is_finite() && self.shift > 0.0) {
            return bad(format!("shift must be a positive number, got {}", self.shift));
        }
        if self.use_dynamic_shifting && self.base_image_seq_len == self.max_image_seq_len {
            return bad("base_image_seq_len equals max_image_seq_len: no shift can be interpolated".into());
        }
        if self.shift_terminal.is_some_and(|t| !(t.is_finite() && t < 1.0)) {
            return bad(format!("shift_terminal must be below 1, got {:?}", self.shift_terminal));
        }
        Ok(())
    }

    /// A schedule without `mu` needs a static shift: `use_dynamic_shifting` refused for `class`.
    pub(crate) fn require_static_shift(&self, class: &'static str) -> Result<()> {
        if self.use_dynamic_shifting {
            return Err(SchedulerError::InvalidConfig {
                class,
                reason: "use_dynamic_shifting is set: the schedule needs `mu` (FlowMatchConfig::mu_for)"
                    .into(),
            });
        }
        Ok(())
    }

    /// The pipelines' `calculate_shift`: `mu` for an image of `image_seq_len` patches, interpolated linearly
    /// between `base_shift` at `base_image_seq_len` and `max_shift` at `max_image_seq_len`.
    pub fn mu_for(&self, image_seq_len: usize) -> f64 {
        let m = (self.max_shift - self.base_shift)
            / (self.max_image_seq_len as f64 - self.base_image_seq_len as f64);
        let b = self.base_shift - m * self.base_image_seq_len as f64;
        image_seq_len as f64 * m + b
    }

    /// The training sigmas' ends `(σ_max, σ_min)` as `__init__` leaves them: f32, shifted unless shifting is dynamic.
    fn training_range(&self) -> (f32, f32) {
        let n = self.num_train_timesteps as f32;
        let shift = |s: f32| -> f32 {
            if self.use_dynamic_shifting {
                s
            } else {
                let k = self.shift as f32;
                k * s / (1.0 + (self.shift - 1.0) as f32 * s)
            }
        };
        // The table runs from N/N = 1 down to 1/N.
        (shift(1.0), shift(1.0 / n))
    }
}

/// `FlowMatchEulerDiscreteScheduler` after `set_timesteps(n)`, with its step counter.
#[derive(Debug, Clone)]
pub struct FlowMatchEulerDiscrete {
    config: FlowMatchConfig,
    timesteps: Vec<f32>,
    /// One longer than `timesteps`: the final 0.
    sigmas: Vec<f32>,
    begin_index: Option<usize>,
    step_index: Option<usize>,
}

impl FlowMatchEulerDiscrete {
    /// `set_timesteps(num_inference_steps)` with the config's static shift. A config with
    /// `use_dynamic_shifting` needs `mu`: use [`Self::with_mu`].
    pub fn new(config: &FlowMatchConfig, num_inference_steps: usize) -> Result<Self> {
        config.require_static_shift(CLASS)?;
        Self::build(config, num_inference_steps, None)
    }

    /// `set_timesteps(num_inference_steps, mu=mu)`; `mu` is used only with `use_dynamic_shifting`, as in diffusers.
    pub fn with_mu(config: &FlowMatchConfig, num_inference_steps: usize, mu: f64) -> Result<Self> {
        Self::build(config, num_inference_steps, Some(mu))
    }

    fn build(config: &FlowMatchConfig, steps: usize, mu: Option<f64>) -> Result<Self> {
        config.validate()?;
        if steps == 0 {
            return Err(SchedulerError::InvalidSteps {
                class: CLASS,
                steps,
                reason: "at least one step is required".into(),
            });
        }
        let n = config.num_train_timesteps as f64;
        let (sigma_max, sigma_min) = config.training_range();
        let sigmas: Vec<f64> = linspace(f64::from(sigma_max) * n, f64::from(sigma_min) * n, steps)
            .into_iter()
            .map(|t| t / n)
            .collect();
        let mut sigmas: Vec<f64> = match (config.use_dynamic_shifting, mu) {
            (true, Some(mu)) => sigmas.iter().map(|&s| time_shift(config.time_shift_type, mu, s)).collect(),
            (true, None) => {
                return Err(SchedulerError::InvalidConfig {
                    class: CLASS,
                    reason: "use_dynamic_shifting is set but no `mu` was given".into(),
                })
            }
            (false, _) => {
                sigmas.iter().map(|&s| config.shift * s / (1.0 + (config.shift - 1.0) * s)).collect()
            }
        };
        if let Some(terminal) = config.shift_terminal {
            let last = 1.0 - sigmas[sigmas.len() - 1];
            let scale = last / (1.0 - terminal);
            for s in &mut sigmas {
                *s = 1.0 - (1.0 - *s) / scale;
            }
        }
        let mut sigmas: Vec<f32> = sigmas.into_iter().map(|s| s as f32).collect();
        let scale = config.num_train_timesteps as f32;
        let timesteps: Vec<f32> = sigmas.iter().map(|&s| s * scale).collect();
        if let Some(bad) = sigmas.iter().find(|s| !s.is_finite()) {
            return Err(SchedulerError::InvalidConfig {
                class: CLASS,
                reason: format!("the schedule has a non-finite sigma ({bad}); check shift / mu"),
            });
        }
        sigmas.push(0.0);
        Ok(Self { config: config.clone(), timesteps, sigmas, begin_index: None, step_index: None })
    }

    pub fn config(&self) -> &FlowMatchConfig {
        &self.config
    }

    /// The timesteps to call the transformer at (`σ·1000`, f32 values).
    pub fn timesteps(&self) -> Vec<f64> {
        self.timesteps.iter().map(|&t| f64::from(t)).collect()
    }

    /// The sigmas, one longer than the timesteps (a final 0).
    pub fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }

    /// Fresh latents are unit noise (`init_noise_sigma` is 1).
    pub fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    /// The first step index an img2img run with `strength` uses, as the SD3 img2img pipeline's `get_timesteps`
    /// computes it: `int(max(n − min(n·strength, n), 0))`.
    pub fn img2img_start(num_inference_steps: usize, strength: f64) -> usize {
        let n = num_inference_steps as f64;
        let init = (n * strength).min(n);
        let start = (n - init).max(0.0);
        if start.is_nan() {
            return 0;
        }
        (start.trunc() as usize).min(num_inference_steps)
    }

    /// Starts the schedule at `timesteps()[begin]` (img2img).
    pub fn set_begin_index(&mut self, begin: usize) {
        self.begin_index = Some(begin);
    }

    /// The index of the next step, once the first step has run.
    pub fn step_index(&self) -> Option<usize> {
        self.step_index
    }

    fn sigma_at(&self, index: usize) -> Result<f32> {
        self.sigmas.get(index).copied().ok_or(SchedulerError::IndexOutOfRange {
            class: CLASS,
            index,
            len: self.timesteps.len(),
        })
    }

    /// The forward process `σ·noise + (1 − σ)·sample` at the level of `timesteps()[i]` (img2img's start); once
    /// a begin index is set it is that level, as diffusers reads `begin_index` whatever timestep it is given.
    pub fn scale_noise(&self, sample: &Tensor, noise: &Tensor, i: usize) -> Result<Tensor> {
        let index = self.step_index.or(self.begin_index).unwrap_or(i);
        if index >= self.timesteps.len() {
            return Err(SchedulerError::IndexOutOfRange { class: CLASS, index, len: self.timesteps.len() });
        }
        let sigma = self.sigma_at(index)?;
        if sample.dims() != noise.dims() {
            return Err(SchedulerError::BadTensor {
                class: CLASS,
                what: format!("sample {:?} and noise {:?} differ in shape", sample.dims(), noise.dims()),
            });
        }
        let noise = noise.to_dtype(sample.dtype()).ctx(CLASS, "scale_noise")?;
        let noised = noise.affine(f64::from(sigma), 0.0).ctx(CLASS, "scale_noise")?;
        let kept = sample.affine(f64::from(1.0 - sigma), 0.0).ctx(CLASS, "scale_noise")?;
        (noised + kept).ctx(CLASS, "scale_noise")
    }

    /// The Euler step from `timesteps()[i]` to the next level: `sample + (σ_next − σ)·model_output`, in f32,
    /// returned in the model output's dtype. `i` only places the first step (unless a begin index is set); later
    /// steps follow the scheduler's own counter, as diffusers does.
    pub fn step(&mut self, model_output: &Tensor, i: usize, sample: &Tensor) -> Result<Tensor> {
        let index = match self.step_index {
            Some(s) => s,
            None => self.begin_index.unwrap_or(i),
        };
        if index + 1 >= self.sigmas.len() {
            return Err(SchedulerError::PastEnd {
                class: CLASS,
                step: index,
                needed: index + 1,
                len: self.sigmas.len(),
            });
        }
        if model_output.dims() != sample.dims() {
            return Err(SchedulerError::BadTensor {
                class: CLASS,
                what: format!(
                    "model output {:?} and sample {:?} differ in shape",
                    model_output.dims(),
                    sample.dims()
                ),
            });
        }
        let dt = self.sigmas[index + 1] - self.sigmas[index];
        let delta = model_output.affine(f64::from(dt), 0.0).ctx(CLASS, "step")?;
        let prev = (sample.to_dtype(DType::F32).ctx(CLASS, "step")?
            + delta.to_dtype(DType::F32).ctx(CLASS, "step")?)
        .and_then(|t| t.to_dtype(model_output.dtype()))
        .ctx(CLASS, "step")?;
        self.step_index = Some(index + 1);
        Ok(prev)
    }
}

/// numpy's `linspace(start, stop, num)` (endpoint included): `i·step + start`, the last value `stop` exactly.
fn linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    if num == 1 {
        return vec![start];
    }
    let step = (stop - start) / (num - 1) as f64;
    let mut v: Vec<f64> = (0..num).map(|i| i as f64 * step + start).collect();
    v[num - 1] = stop;
    v
}

fn time_shift(kind: TimeShift, mu: f64, t: f64) -> f64 {
    match kind {
        TimeShift::Exponential => mu.exp() / (mu.exp() + (1.0 / t - 1.0)),
        TimeShift::Linear => mu / (mu + (1.0 / t - 1.0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn sd3() -> FlowMatchConfig {
        FlowMatchConfig::from_json_str(
            r#"{"_class_name":"FlowMatchEulerDiscreteScheduler","_diffusers_version":"0.29.0.dev0",
                "num_train_timesteps":1000,"shift":3.0}"#,
        )
        .expect("config")
    }

    /// The ends of SD3's schedule by hand: σ₀ = 1 (shift maps 1 to 1), a final 0, timesteps σ·1000.
    #[test]
    fn shifted_schedule_ends() {
        let s = FlowMatchEulerDiscrete::new(&sd3(), 28).expect("schedule");
        assert_eq!(s.sigmas().len(), 29);
        assert_eq!(s.sigmas()[0], 1.0);
        assert_eq!(s.sigmas()[28], 0.0);
        assert_eq!(s.timesteps()[0], 1000.0);
        // The last inference sigma: σ_min of the training table shifted once there and once more here.
        let once = 3.0 * 0.001 / (1.0 + 2.0 * 0.001);
        let twice = 3.0 * once / (1.0 + 2.0 * once);
        assert!((f64::from(s.sigmas()[27]) - twice).abs() < 1e-7, "{}", s.sigmas()[27]);
        assert!(s.sigmas().windows(2).all(|w| w[0] > w[1]), "decreasing");
    }

    #[test]
    fn img2img_start_follows_sd3_get_timesteps() {
        // int(max(10 − 3.5, 0)) = 6, where the other pipelines' n − int(n·s) gives 7.
        assert_eq!(FlowMatchEulerDiscrete::img2img_start(10, 0.35), 6);
        assert_eq!(FlowMatchEulerDiscrete::img2img_start(10, 1.0), 0);
        assert_eq!(FlowMatchEulerDiscrete::img2img_start(10, 1.5), 0);
        assert_eq!(FlowMatchEulerDiscrete::img2img_start(10, 0.0), 10);
        assert_eq!(FlowMatchEulerDiscrete::img2img_start(50, 0.6), 20);
    }

    #[test]
    fn step_and_scale_noise() -> Result<()> {
        let dev = Device::Cpu;
        let mut s = FlowMatchEulerDiscrete::new(&sd3(), 2)?;
        let x = Tensor::new(&[1.0f32, -2.0], &dev).ctx(CLASS, "t")?;
        let v = Tensor::new(&[0.5f32, 4.0], &dev).ctx(CLASS, "t")?;
        let (s0, s1) = (s.sigmas()[0], s.sigmas()[1]);
        let got: Vec<f32> = s.step(&v, 0, &x)?.to_vec1().ctx(CLASS, "t")?;
        assert_eq!(got, vec![1.0 + (s1 - s0) * 0.5, -2.0 + (s1 - s0) * 4.0]);
        assert_eq!(s.step_index(), Some(1));
        let last: Vec<f32> = s.step(&v, 1, &x)?.to_vec1().ctx(CLASS, "t")?;
        assert_eq!(last, vec![1.0 - s1 * 0.5, -2.0 - s1 * 4.0]);
        assert!(matches!(s.step(&v, 2, &x), Err(SchedulerError::PastEnd { .. })));

        let mut s = FlowMatchEulerDiscrete::new(&sd3(), 4)?;
        s.set_begin_index(2);
        let sigma = s.sigmas()[2];
        let noised: Vec<f32> = s.scale_noise(&x, &v, 0)?.to_vec1().ctx(CLASS, "t")?;
        assert_eq!(noised, vec![sigma * 0.5 + (1.0 - sigma) * 1.0, sigma * 4.0 + (1.0 - sigma) * -2.0]);
        Ok(())
    }

    #[test]
    fn dynamic_shifting_needs_mu() {
        let cfg =
            FlowMatchConfig::from_json_str(r#"{"use_dynamic_shifting":true,"shift":3.0}"#).expect("config");
        assert!(FlowMatchEulerDiscrete::new(&cfg, 4).is_err());
        let mu = cfg.mu_for(4096);
        assert!((mu - 1.15).abs() < 1e-12, "{mu}");
        let s = FlowMatchEulerDiscrete::with_mu(&cfg, 4, mu).expect("schedule");
        assert_eq!(s.sigmas()[0], 1.0);
    }

    #[test]
    fn bad_configs_are_refused() {
        for (json, field) in [
            (r#"{"use_karras_sigmas":true}"#, "use_karras_sigmas"),
            (r#"{"invert_sigmas":true}"#, "invert_sigmas"),
            (r#"{"time_shift_type":"cubic"}"#, "time_shift_type"),
            (r#"{"shift":-1}"#, "shift"),
        ] {
            let e = FlowMatchConfig::from_json_str(json).expect_err(json).to_string();
            assert!(e.contains(field), "{json}: {e}");
        }
        assert!(matches!(
            FlowMatchConfig::from_json_str(r#"{"shift":"three"}"#),
            Err(SchedulerError::ConfigParse(_))
        ));
        assert!(FlowMatchEulerDiscrete::new(&sd3(), 0).is_err());
        let ok =
            FlowMatchConfig::from_json_str(r#"{"shift":3.0,"_use_default_values":["shift"]}"#).expect("cfg");
        assert_eq!(ok.shift, 1.0);
    }
}
