//! Rejections: bad configs, impossible step counts and misuse of the loop
//! must come back as errors, never panics.

use candle_core::{DType, Device, Tensor};
use sdhive_rng::TorchGenerator;
use sdhive_schedulers::{build, SamplerKind, SchedulerConfig, SchedulerError, SigmaSchedule};

const ALL: [SamplerKind; 6] = [
    SamplerKind::Euler,
    SamplerKind::EulerAncestral,
    SamplerKind::Ddim,
    SamplerKind::DpmPp2M,
    SamplerKind::Lcm,
    SamplerKind::Pndm,
];

const SD15: &str = r#"{
  "_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0",
  "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
  "num_train_timesteps": 1000, "set_alpha_to_one": false, "skip_prk_steps": true,
  "steps_offset": 1, "trained_betas": null, "clip_sample": false
}"#;

fn cfg(json: &str) -> SchedulerConfig {
    SchedulerConfig::from_json_str(json).expect("config parses")
}

fn err(kind: SamplerKind, schedule: SigmaSchedule, json: &str, steps: usize) -> SchedulerError {
    match build(kind, schedule, &cfg(json), steps) {
        Ok(_) => panic!("{kind:?} with {json} / {steps} steps should fail"),
        Err(e) => e,
    }
}

#[test]
fn invalid_beta_schedule() {
    for kind in ALL {
        let e = err(kind, SigmaSchedule::Default, r#"{"beta_schedule":"quadratic"}"#, 10);
        assert!(matches!(e, SchedulerError::InvalidValue { field: "beta_schedule", .. }), "{kind:?}: {e}");
        assert!(e.to_string().contains("quadratic"), "{e}");
    }
}

#[test]
fn trained_betas_override_beta_schedule_and_must_fit() {
    let ok = r#"{"beta_schedule":"nonsense","num_train_timesteps":4,"trained_betas":[0.1,0.2,0.3,0.4]}"#;
    assert!(build(SamplerKind::Euler, SigmaSchedule::Default, &cfg(ok), 2).is_ok());
    let bad = r#"{"num_train_timesteps":5,"trained_betas":[0.1,0.2,0.3,0.4]}"#;
    let e = err(SamplerKind::Ddim, SigmaSchedule::Default, bad, 2);
    assert!(matches!(e, SchedulerError::InvalidConfig { .. }), "{e}");
}

#[test]
fn thresholding_rejected_where_diffusers_reads_it() {
    let json = r#"{"thresholding":true}"#;
    for kind in [SamplerKind::Ddim, SamplerKind::DpmPp2M, SamplerKind::Lcm] {
        let e = err(kind, SigmaSchedule::Default, json, 4);
        assert!(matches!(e, SchedulerError::Unsupported { field: "thresholding", .. }), "{kind:?}: {e}");
    }
    // Classes without the parameter ignore the key, as from_config does.
    for kind in [SamplerKind::Euler, SamplerKind::EulerAncestral, SamplerKind::Pndm] {
        assert!(build(kind, SigmaSchedule::Default, &cfg(json), 4).is_ok(), "{kind:?}");
    }
}

#[test]
fn zero_and_too_many_steps() {
    for kind in ALL {
        let e = err(kind, SigmaSchedule::Default, SD15, 0);
        assert!(matches!(e, SchedulerError::InvalidSteps { steps: 0, .. }), "{kind:?}: {e}");
        let e = err(kind, SigmaSchedule::Default, SD15, 1001);
        assert!(matches!(e, SchedulerError::InvalidSteps { .. }), "{kind:?}: {e}");
    }
    // LCM schedules are a subset of the 50-step distillation schedule.
    let e = err(SamplerKind::Lcm, SigmaSchedule::Default, SD15, 51);
    assert!(matches!(e, SchedulerError::InvalidSteps { .. }), "{e}");
    // PNDM's Runge-Kutta warm-up needs four steps.
    let e = err(SamplerKind::Pndm, SigmaSchedule::Default, "{}", 3);
    assert!(matches!(e, SchedulerError::InvalidSteps { .. }), "{e}");
}

#[test]
fn karras_only_where_diffusers_has_it() {
    for kind in ALL {
        let r = build(kind, SigmaSchedule::Karras, &cfg(SD15), 10);
        if kind.supports_karras() {
            assert!(r.is_ok(), "{kind:?}");
        } else {
            assert!(matches!(r, Err(SchedulerError::KarrasUnsupported { .. })), "{kind:?}");
        }
    }
    let e = err(SamplerKind::Euler, SigmaSchedule::Karras, r#"{"use_exponential_sigmas":true}"#, 10);
    assert!(matches!(e, SchedulerError::InvalidConfig { .. }), "{e}");
}

#[test]
fn bad_enum_values() {
    let e = err(SamplerKind::Euler, SigmaSchedule::Default, r#"{"prediction_type":"x0"}"#, 5);
    assert!(matches!(e, SchedulerError::InvalidValue { field: "prediction_type", .. }), "{e}");
    let e = err(SamplerKind::Ddim, SigmaSchedule::Default, r#"{"timestep_spacing":"even"}"#, 5);
    assert!(matches!(e, SchedulerError::InvalidValue { field: "timestep_spacing", .. }), "{e}");
    let e = err(SamplerKind::DpmPp2M, SigmaSchedule::Default, r#"{"final_sigmas_type":"one"}"#, 5);
    assert!(matches!(e, SchedulerError::InvalidValue { field: "final_sigmas_type", .. }), "{e}");
    let e = err(SamplerKind::EulerAncestral, SigmaSchedule::Default, r#"{"prediction_type":"sample"}"#, 5);
    assert!(matches!(e, SchedulerError::Unsupported { .. }), "{e}");
    let e = err(SamplerKind::Pndm, SigmaSchedule::Default, r#"{"prediction_type":"sample"}"#, 5);
    assert!(matches!(e, SchedulerError::InvalidValue { .. }), "{e}");
    let e = err(SamplerKind::DpmPp2M, SigmaSchedule::Default, r#"{"variance_type":"learned_range"}"#, 5);
    assert!(matches!(e, SchedulerError::Unsupported { .. }), "{e}");
    let e = err(SamplerKind::Euler, SigmaSchedule::Default, r#"{"interpolation_type":"log_linear"}"#, 5);
    assert!(matches!(e, SchedulerError::Unsupported { .. }), "{e}");
    // LCM never reads timestep_spacing.
    assert!(
        build(SamplerKind::Lcm, SigmaSchedule::Default, &cfg(r#"{"timestep_spacing":"even"}"#), 4).is_ok()
    );
}

#[test]
fn offsets_pushing_timesteps_out_of_range() {
    let e = err(SamplerKind::Ddim, SigmaSchedule::Default, r#"{"steps_offset":5}"#, 1000);
    assert!(matches!(e, SchedulerError::InvalidConfig { .. }), "{e}");
}

#[test]
fn config_defaults_follow_the_target_class() {
    // SD 1.5's PNDM config has no timestep_spacing: Euler falls back to its
    // own default (linspace, starts at 999), DDIM to leading + steps_offset.
    let c = cfg(SD15);
    let euler = build(SamplerKind::Euler, SigmaSchedule::Default, &c, 20).unwrap();
    assert_eq!(euler.timesteps()[0], 999.0);
    let ddim = build(SamplerKind::Ddim, SigmaSchedule::Default, &c, 20).unwrap();
    assert_eq!(ddim.timesteps()[0], 951.0);
    assert_eq!(ddim.timesteps()[19], 1.0);
    let pndm = build(SamplerKind::Pndm, SigmaSchedule::Default, &c, 20).unwrap();
    // skip_prk_steps repeats the second timestep.
    assert_eq!(&pndm.timesteps()[..4], &[951.0, 901.0, 901.0, 851.0]);
    assert_eq!(pndm.timesteps().len(), 21);
}

fn latents(dtype: DType) -> Tensor {
    Tensor::zeros((1, 4, 2, 2), dtype, &Device::Cpu).unwrap()
}

#[test]
fn loop_misuse_is_an_error() {
    let mut rng = TorchGenerator::new(0);
    for kind in ALL {
        let mut s = build(kind, SigmaSchedule::Default, &cfg(SD15), 4).unwrap();
        let n = s.timesteps().len();
        let x = latents(DType::F32);
        // Half-precision tensors and mismatched shapes are refused.
        let e = s.step(&latents(DType::F16), 0, &x, &mut rng).unwrap_err();
        assert!(matches!(e, SchedulerError::BadTensor { .. }), "{kind:?}: {e}");
        let other = Tensor::zeros((1, 4, 2, 3), DType::F32, &Device::Cpu).unwrap();
        let e = s.step(&other, 0, &x, &mut rng).unwrap_err();
        assert!(matches!(e, SchedulerError::BadTensor { .. }), "{kind:?}: {e}");
        let e = s.add_noise(&x, &x, n).unwrap_err();
        assert!(matches!(e, SchedulerError::IndexOutOfRange { .. }), "{kind:?}: {e}");

        let mut s = build(kind, SigmaSchedule::Default, &cfg(SD15), 4).unwrap();
        let mut x = latents(DType::F32);
        for i in 0..n {
            let inp = s.scale_model_input(&x, i).unwrap();
            x = s.step(&inp, i, &x, &mut rng).unwrap();
        }
        // One step too many: an error from the sigma-based samplers, an
        // index error from the timestep-based ones.
        assert!(s.step(&x, n, &x, &mut rng).is_err(), "{kind:?}");
        assert!(s.pred_original_sample().is_some() || kind == SamplerKind::Pndm);
    }
}
