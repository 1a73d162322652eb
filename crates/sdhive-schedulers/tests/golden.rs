//! Golden comparison against diffusers: replays every case written by
//! `xtask/fixtures/gen_schedulers.py` (full denoising loops with a fake
//! model) and checks schedules, intermediate and final latents.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};
use sdhive_rng::TorchGenerator;
use sdhive_schedulers::{
    alphas_cumprod, build, img2img_start, DiffusionScheduler, NoiseSource, SamplerKind, SchedulerConfig,
    SigmaSchedule,
};

/// Latents must match diffusers to this absolute tolerance.
const LATENT_TOL: f32 = 1e-5;

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden")
}

struct Golden {
    meta: serde_json::Value,
    tensors: HashMap<String, Tensor>,
}

fn load() -> Golden {
    let dir = golden_dir();
    let meta_text = std::fs::read_to_string(dir.join("schedulers.json"))
        .expect("tests/fixtures/golden/schedulers.json (run xtask/fixtures/gen_schedulers.py)");
    let meta = serde_json::from_str(&meta_text).expect("golden json");
    let tensors = candle_core::safetensors::load(dir.join("schedulers.safetensors"), &Device::Cpu)
        .expect("golden safetensors");
    Golden { meta, tensors }
}

impl Golden {
    fn cases(&self) -> &[serde_json::Value] {
        self.meta["cases"].as_array().expect("cases array")
    }

    fn f32s(&self, key: &str) -> Option<Vec<f32>> {
        self.tensors.get(key).map(|t| {
            t.flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("f32 tensor")
        })
    }

    fn f64s(&self, key: &str) -> Option<Vec<f64>> {
        self.tensors.get(key).map(|t| t.to_vec1::<f64>().expect("f64 tensor"))
    }

    fn tensor(&self, key: &str) -> Tensor {
        self.tensors
            .get(key)
            .unwrap_or_else(|| panic!("golden tensor {key} missing"))
            .clone()
    }
}

/// Replays the draws diffusers made, in order.
struct Replay {
    data: Vec<f32>,
    pos: usize,
}

impl NoiseSource for Replay {
    fn randn(&mut self, numel: usize) -> Vec<f32> {
        let out = self.data[self.pos..self.pos + numel].to_vec();
        self.pos += numel;
        out
    }
}

fn kind_of(name: &str) -> SamplerKind {
    match name {
        "euler" => SamplerKind::Euler,
        "euler_a" => SamplerKind::EulerAncestral,
        "ddim" => SamplerKind::Ddim,
        "dpmpp_2m" => SamplerKind::DpmPp2M,
        "lcm" => SamplerKind::Lcm,
        "pndm" => SamplerKind::Pndm,
        other => panic!("unknown kind {other}"),
    }
}

/// The fake UNet of the generator script.
fn fake_model(x: &Tensor, t: f64) -> Tensor {
    let c = (0.05 * (t / 100.0).sin()) as f32;
    x.affine(0.1, 0.0)
        .and_then(|y| y.affine(1.0, c as f64))
        .expect("fake model")
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) })
}

struct CaseResult {
    name: String,
    step1: f32,
    final_: f32,
    pred: Option<f32>,
    timesteps: f64,
    sigmas: f32,
}

fn run_case(g: &Golden, case: &serde_json::Value, rng: &mut dyn NoiseSource) -> CaseResult {
    let name = case["name"].as_str().unwrap().to_string();
    let kind = kind_of(case["kind"].as_str().unwrap());
    let schedule = if case["karras"].as_bool().unwrap() {
        SigmaSchedule::Karras
    } else {
        SigmaSchedule::Default
    };
    let steps = case["steps"].as_u64().unwrap() as usize;
    let cfg = SchedulerConfig::from_json_value(case["config"].clone()).unwrap();
    let mut s = build(kind, schedule, &cfg, steps).unwrap_or_else(|e| panic!("{name}: {e}"));

    let want_ts = g.f64s(&format!("{name}.timesteps")).unwrap();
    let ts = s.timesteps();
    assert_eq!(ts.len(), want_ts.len(), "{name}: timestep count");
    let ts_diff = ts
        .iter()
        .zip(&want_ts)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    let sig_diff = match (s.sigmas(), g.f32s(&format!("{name}.sigmas"))) {
        (Some(a), Some(b)) => {
            assert_eq!(a.len(), b.len(), "{name}: sigma count");
            a.iter()
                .zip(&b)
                .map(|(x, y)| ((x - y) / y.abs().max(1e-30)).abs())
                .fold(0.0f32, f32::max)
        }
        (None, None) => 0.0,
        (a, b) => panic!("{name}: sigmas presence differs ({} vs {})", a.is_some(), b.is_some()),
    };
    let want_ins = case["init_noise_sigma"].as_f64().unwrap();
    assert!(
        (s.init_noise_sigma() - want_ins).abs() <= want_ins * 1e-6,
        "{name}: init_noise_sigma {} vs {}",
        s.init_noise_sigma(),
        want_ins
    );

    let dev = Device::Cpu;
    let shape = (1usize, 4usize, 8usize, 8usize);
    let begin = match case["strength"].as_f64() {
        None => 0,
        Some(strength) => img2img_start(steps, strength, s.order()),
    };
    assert_eq!(begin as u64, case["begin_index"].as_u64().unwrap(), "{name}: begin");
    let mut latents = if case["strength"].is_null() {
        let noise = Tensor::from_vec(rng.randn(256), shape, &dev).unwrap();
        (noise * s.init_noise_sigma()).unwrap()
    } else {
        s.set_begin_index(begin);
        let noise = Tensor::from_vec(rng.randn(256), shape, &dev).unwrap();
        let noised = s.add_noise(&g.tensor("img2img.orig"), &noise, begin).unwrap();
        let d = max_abs_diff(&noised, &g.tensor(&format!("{name}.noised")));
        assert!(d <= LATENT_TOL, "{name}: add_noise differs by {d}");
        noised
    };
    let init_d = max_abs_diff(&latents, &g.tensor(&format!("{name}.init")));
    assert!(init_d <= LATENT_TOL, "{name}: initial latents differ by {init_d}");

    let mut step1 = f32::NAN;
    for (i, &t) in ts.iter().enumerate().skip(begin) {
        let x = s.scale_model_input(&latents, i).unwrap();
        let eps = fake_model(&x, t);
        latents = s
            .step(&eps, i, &latents, rng)
            .unwrap_or_else(|e| panic!("{name} step {i}: {e}"));
        if i == begin {
            step1 = max_abs_diff(&latents, &g.tensor(&format!("{name}.step1")));
        }
    }
    let final_ = max_abs_diff(&latents, &g.tensor(&format!("{name}.final")));
    let pred = g
        .tensors
        .get(&format!("{name}.pred_original_last"))
        .map(|want| max_abs_diff(s.pred_original_sample().expect("pred_original"), want));
    CaseResult {
        name,
        step1,
        final_,
        pred,
        timesteps: ts_diff,
        sigmas: sig_diff,
    }
}

fn report_and_check(results: &[CaseResult]) {
    println!(
        "{:<30} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "case", "step1", "final", "x0 last", "ts", "sig rel"
    );
    for r in results {
        println!(
            "{:<30} {:>10.2e} {:>10.2e} {:>10} {:>10.2e} {:>10.2e}",
            r.name,
            r.step1,
            r.final_,
            r.pred.map(|p| format!("{p:.2e}")).unwrap_or_else(|| "-".into()),
            r.timesteps,
            r.sigmas
        );
    }
    let mut bad = Vec::new();
    for r in results {
        let pred_ok = r.pred.is_none_or(|p| p <= LATENT_TOL);
        if !(r.step1 <= LATENT_TOL && r.final_ <= LATENT_TOL && pred_ok)
            || r.timesteps > 1e-3
            || r.sigmas > 1e-6
        {
            bad.push(r.name.as_str());
        }
    }
    assert!(bad.is_empty(), "cases off golden: {bad:?}");
}

#[test]
fn golden_loops_with_recorded_noise() {
    let g = load();
    let results: Vec<CaseResult> = g
        .cases()
        .iter()
        .map(|case| {
            let name = case["name"].as_str().unwrap();
            let mut rng = Replay {
                data: g.f32s(&format!("{name}.noise")).unwrap(),
                pos: 0,
            };
            let r = run_case(&g, case, &mut rng);
            assert_eq!(rng.pos, rng.data.len(), "{name}: noise draws consumed");
            r
        })
        .collect();
    report_and_check(&results);
}

#[test]
fn golden_loops_with_torch_generator() {
    let g = load();
    let results: Vec<CaseResult> = g
        .cases()
        .iter()
        .map(|case| {
            let name = case["name"].as_str().unwrap();
            let seed = case["seed"].as_u64().unwrap();
            // The generator must reproduce torch's draws before the loop can.
            let recorded = g.f32s(&format!("{name}.noise")).unwrap();
            let mut probe = TorchGenerator::new(seed);
            let mut drawn = Vec::new();
            while drawn.len() < recorded.len() {
                drawn.extend(probe.randn(256));
            }
            assert_eq!(drawn, recorded, "{name}: TorchGenerator draws differ from torch");
            let mut rng = TorchGenerator::new(seed);
            run_case(&g, case, &mut rng)
        })
        .collect();
    report_and_check(&results);
}

#[test]
fn golden_alphas_cumprod_bitwise() {
    // diffusers' tables are float32; the host-side reproduction must be
    // bit-identical, or every later step inherits the error.
    let g = load();
    for case in g.cases() {
        let name = case["name"].as_str().unwrap();
        let from = case["alphas_cumprod_from"].as_str().unwrap();
        let want = g.f32s(&format!("{from}.alphas_cumprod")).unwrap();
        let kind = kind_of(case["kind"].as_str().unwrap());
        let cfg = SchedulerConfig::from_json_value(case["config"].clone()).unwrap();
        let got = alphas_cumprod(kind, &cfg).unwrap();
        assert_eq!(got.len(), want.len(), "{name}");
        let mismatches = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(mismatches, 0, "{name}: alphas_cumprod differs in {mismatches} entries");
    }
}
