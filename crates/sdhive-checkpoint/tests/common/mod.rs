//! What the single-file tests share: a tensor's values as bit patterns, to compare converted weights exactly, and
//! the check that an error's message names what it should.

use candle_core::{DType, Tensor};
use sdhive_checkpoint::CheckpointError;

/// Every dtype here (f16, bf16, f32) widens to f64 injectively, so equal bit patterns mean equal tensors.
pub fn bits(t: &Tensor) -> Vec<u64> {
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1::<f64>())
        .expect("tensor data")
        .into_iter()
        .map(f64::to_bits)
        .collect()
}

pub fn assert_msg(e: &CheckpointError, parts: &[&str]) {
    let msg = e.to_string();
    for p in parts {
        assert!(msg.contains(p), "error `{msg}` lacks `{p}`");
    }
}
