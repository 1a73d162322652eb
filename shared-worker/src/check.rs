//! The start-up check of the GPUs candle drives (CUDA, Metal): a small random f32 matmul on the device compared
//! with the CPU's, so a broken driver or a binary built for another architecture fails at start with a clear
//! message instead of producing garbage images.

use crate::Backend;
use candle_core::{Device, Tensor};

/// Not square and not multiples of 64, so transposed or tiled kernels with wrong edge handling would be caught,
/// and small enough to cost well under a millisecond.
const CHECK_SHAPE: (usize, usize, usize) = (192, 256, 160);
/// Relative to the largest CPU value. Plain f32 GEMMs differ from the CPU by rounding order only (~1e-6); TF32
/// tensor cores, if someone enables them, stay within ~1e-3.
const CHECK_TOLERANCE: f32 = 2e-3;

pub fn matmul_matches_cpu(backend: Backend, device: &Device) -> Result<(), String> {
    let (m, k, n) = CHECK_SHAPE;
    let run = || -> candle_core::Result<(f32, f32)> {
        let a = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
        let b = Tensor::randn(0f32, 1.0, (k, n), &Device::Cpu)?;
        let want = a.matmul(&b)?;
        let got = a.to_device(device)?.matmul(&b.to_device(device)?)?.to_device(&Device::Cpu)?;
        let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
        Ok((diff, scale))
    };
    let (diff, scale) = run().map_err(|e| format!("{m}x{k} · {k}x{n} f32 matmul failed: {e}"))?;
    let rel = diff / scale.max(f32::MIN_POSITIVE);
    // NaN compares false, so it has to be rejected explicitly.
    if !rel.is_finite() || rel > CHECK_TOLERANCE {
        return Err(format!(
            "{m}x{k} · {k}x{n} f32 matmul differs from the CPU by {rel:.2e} relative (limit {CHECK_TOLERANCE:.0e})"
        ));
    }
    tracing::info!(
        "{backend}: start-up check {m}x{k} · {k}x{n} f32 matmul matches the CPU (rel diff {rel:.1e})"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_passes_its_own_check() {
        assert_eq!(matmul_matches_cpu(Backend::Cpu, &Device::Cpu), Ok(()));
    }
}
