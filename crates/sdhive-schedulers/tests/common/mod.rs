//! What the flow-matching scheduler tests share: the SD3 fixture's scheduler config and the goldens
//! `xtask/fixtures/gen_sd3.py` writes, read as JSON.

#![allow(dead_code)]

use candle_core::{Device, Tensor};
use sdhive_schedulers::FlowMatchConfig;
use std::path::PathBuf;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// `tests/fixtures/golden/<file>`.
pub fn golden(file: &str) -> serde_json::Value {
    let path = fixtures().join("golden").join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run xtask/fixtures/gen_sd3.py)", path.display()));
    serde_json::from_str(&text).expect("golden json")
}

/// The SD3 fixture's `scheduler_config.json` (shift 3.0).
pub fn config() -> FlowMatchConfig {
    let path = fixtures().join("models/sd3/scheduler/scheduler_config.json");
    FlowMatchConfig::from_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn f32s(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number") as f32).collect()
}

pub fn f64s(v: &serde_json::Value) -> Vec<f64> {
    v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number")).collect()
}

pub fn matrix(v: &serde_json::Value, dev: &Device) -> Tensor {
    let rows: Vec<Vec<f32>> = v.as_array().expect("rows").iter().map(f32s).collect();
    Tensor::new(rows, dev).expect("tensor")
}
