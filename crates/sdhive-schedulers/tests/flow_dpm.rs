//! DPM++ 2M on flow sigmas against diffusers: `DPMSolverMultistepScheduler.from_config(<the SD3 fixture's
//! FlowMatchEulerDiscreteScheduler config>, use_flow_sigmas=True, prediction_type="flow_prediction",
//! flow_shift=3.0)` as recorded in `tests/fixtures/golden/sd3_dpm_scheduler.json` (written by
//! `xtask/fixtures/gen_sd3.py`): the sigma and timestep tables bit for bit, a five-step loop on random model
//! outputs (first-order start, second-order multistep, first-order end) to f32 rounding, and dynamic shifting.

mod common;

use candle_core::{Device, Tensor};
use common::*;
use sdhive_schedulers::{FlowDpmSolverMultistep, FlowMatchConfig};

fn golden() -> serde_json::Value {
    common::golden("sd3_dpm_scheduler.json")
}

#[test]
fn schedules_match_diffusers_exactly() {
    let g = golden();
    let cfg = config();
    // The class diffusers built reads the flow config's shift as its flow_shift.
    assert_eq!(g["config"]["flow_shift"].as_f64(), Some(cfg.shift));
    assert_eq!(g["config"]["use_flow_sigmas"].as_bool(), Some(true));
    assert_eq!(g["config"]["final_sigmas_type"].as_str(), Some("zero"));
    let tables = g["set_timesteps"].as_object().expect("set_timesteps");
    assert!(tables.len() >= 4, "expected several step counts");
    for (n, want) in tables {
        let steps: usize = n.parse().expect("step count");
        let s = FlowDpmSolverMultistep::new(&cfg, steps).expect("schedule");
        assert_eq!(s.sigmas(), f32s(&want["sigmas"]).as_slice(), "sigmas, {steps} steps");
        assert_eq!(s.timesteps(), f64s(&want["timesteps"]), "timesteps, {steps} steps");
    }
}

#[test]
fn a_loop_of_steps_matches_diffusers() {
    let g = golden();
    let case = &g["loop"];
    let dev = Device::Cpu;
    let n = case["n"].as_u64().expect("n") as usize;
    let mut s = FlowDpmSolverMultistep::new(&config(), n).expect("schedule");
    let steps = case["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), n);
    let mut sample = matrix(&steps[0]["sample"], &dev);
    let mut worst = 0f32;
    for (i, step) in steps.iter().enumerate() {
        assert_eq!(s.timesteps()[i], step["timestep"].as_f64().expect("timestep"));
        // Each step continues from our own previous result, as the loop in diffusers did from its own.
        let want_in = matrix(&step["sample"], &dev);
        let drift = max_abs(&(&sample - &want_in).expect("diff"));
        assert!(drift <= 1e-6, "step {i}: input drifted by {drift}");
        sample = s.step(&matrix(&step["model_output"], &dev), i, &sample).expect("step");
        let d = max_abs(&(&sample - matrix(&step["prev_sample"], &dev)).expect("diff"));
        assert!(d <= 1e-6, "step {i}: prev_sample off by {d}");
        worst = worst.max(d);
        assert_eq!(s.step_index(), Some(i + 1));
    }
    eprintln!("flow DPM++ 2M loop of {n} steps: worst |ours − diffusers| {worst:.2e}");
    // The last step is first order onto σ = 0: the data prediction itself.
    let x0 = s.pred_original_sample().expect("x0");
    assert_eq!(max_abs(&(x0 - &sample).expect("diff")), 0.0);
}

#[test]
fn dynamic_shifting_matches_diffusers() {
    let g = golden();
    let case = &g["dynamic"];
    let cfg = FlowMatchConfig { use_dynamic_shifting: true, ..config() };
    let n = case["n"].as_u64().expect("n") as usize;
    let mu = case["mu"].as_f64().expect("mu");
    let s = FlowDpmSolverMultistep::with_mu(&cfg, n, mu).expect("schedule");
    assert_eq!(s.sigmas(), f32s(&case["sigmas"]).as_slice());
    assert_eq!(s.timesteps(), f64s(&case["timesteps"]));
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs().and_then(|t| t.flatten_all()?.max(0)?.to_scalar::<f32>()).expect("max")
}
