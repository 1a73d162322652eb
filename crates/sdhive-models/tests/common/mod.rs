//! What the golden tests of this crate share: where the fixtures are (`<workspace>/tests/fixtures`, or
//! `SDHIVE_FIXTURES`), reading a golden file and its tensors (a missing one fails the test: silence would hide a
//! broken setup), the SD3 prompts, and the max |ours − reference| of two tensors.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::PathBuf;

pub fn fixtures() -> PathBuf {
    match std::env::var_os("SDHIVE_FIXTURES") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

pub fn golden(name: &str) -> HashMap<String, Tensor> {
    let path = fixtures().join("golden").join(name);
    assert!(path.is_file(), "golden file {} is missing: generate the fixtures first", path.display());
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

pub fn get<'a>(g: &'a HashMap<String, Tensor>, key: &str) -> &'a Tensor {
    g.get(key).unwrap_or_else(|| panic!("golden tensor `{key}` missing"))
}

/// `golden/sd3.json`'s prompts, in the order of the SD3 goldens' `_i` suffixes.
pub fn sd3_prompts() -> Vec<String> {
    let path = fixtures().join("golden/sd3.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let json: serde_json::Value = serde_json::from_str(&text).expect("sd3.json is JSON");
    let prompts = json["prompts"].as_array().expect("prompts");
    prompts.iter().map(|p| p.as_str().expect("prompt").to_string()).collect()
}

/// Max |a − b| (in f32) after checking the shapes agree; printed with `what`.
pub fn max_diff(what: &str, ours: &Tensor, want: &Tensor) -> f32 {
    assert_eq!(ours.dims(), want.dims(), "{what}: shape");
    let d = (ours.to_dtype(DType::F32).expect("f32") - want.to_dtype(DType::F32).expect("f32"))
        .and_then(|t| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
        .expect("diff");
    eprintln!("{what}: max abs diff {d:.3e}");
    d
}
