//! `FlowMatchEulerDiscreteScheduler` against diffusers: the SD3 fixture's `scheduler_config.json` (shift 3.0)
//! gives the sigma and timestep tables of `tests/fixtures/golden/sd3_scheduler.json` (written by
//! `xtask/fixtures/gen_sd3.py`) bit for bit, and its Euler step the recorded `prev_sample`.

mod common;

use candle_core::Device;
use common::*;
use sdhive_schedulers::{FlowMatchConfig, FlowMatchEulerDiscrete};

fn golden() -> serde_json::Value {
    common::golden("sd3_scheduler.json")
}

#[test]
fn schedules_match_diffusers_exactly() {
    let g = golden();
    let cfg = config();
    assert_eq!(cfg.shift, 3.0);
    // The config diffusers recorded resolves to the same scheduler.
    let recorded = FlowMatchConfig::from_json_str(&g["config"].to_string()).expect("golden config");
    assert_eq!(recorded, cfg);
    let tables = g["set_timesteps"].as_object().expect("set_timesteps");
    assert!(tables.len() >= 4, "expected several step counts");
    for (n, want) in tables {
        let steps: usize = n.parse().expect("step count");
        let s = FlowMatchEulerDiscrete::new(&cfg, steps).expect("schedule");
        assert_eq!(s.sigmas(), f32s(&want["sigmas"]).as_slice(), "sigmas, {steps} steps");
        let timesteps: Vec<f32> = s.timesteps().iter().map(|&t| t as f32).collect();
        assert_eq!(timesteps, f32s(&want["timesteps"]), "timesteps, {steps} steps");
    }
}

#[test]
fn step_matches_diffusers() {
    let g = golden();
    let case = &g["step"];
    let dev = Device::Cpu;
    let n = case["n"].as_u64().expect("n") as usize;
    let mut s = FlowMatchEulerDiscrete::new(&config(), n).expect("schedule");
    let t = case["timestep"].as_f64().expect("timestep");
    let i = s.timesteps().iter().position(|&x| x == t).expect("the step's timestep is on the schedule");
    assert_eq!(s.sigmas()[i], case["sigma"].as_f64().expect("sigma") as f32);
    assert_eq!(s.sigmas()[i + 1], case["sigma_next"].as_f64().expect("sigma_next") as f32);
    let prev = s
        .step(&matrix(&case["model_output"], &dev), i, &matrix(&case["sample"], &dev))
        .expect("step")
        .to_vec2::<f32>()
        .expect("values");
    let want: Vec<Vec<f32>> = case["prev_sample"].as_array().expect("rows").iter().map(f32s).collect();
    assert_eq!(prev, want);
    assert_eq!(s.step_index(), Some(i + 1));
}
