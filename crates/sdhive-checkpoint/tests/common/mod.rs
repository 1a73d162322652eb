//! What the single-file tests share: a tensor's values as bit patterns, to compare converted weights exactly.

use candle_core::{DType, Tensor};

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
