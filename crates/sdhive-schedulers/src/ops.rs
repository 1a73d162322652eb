//! Tensor-times-scalar helpers that round exactly like torch's
//! `tensor op 0-d float32 tensor`.
//!
//! candle's `Tensor / f64` multiplies by the reciprocal, which is not what
//! torch does; a true division goes through a one-element tensor instead.
//! Scalars are `f32` because diffusers' per-step scalars are 0-d float32
//! tensors, and candle's `affine` converts its `f64` factor to the tensor
//! dtype, so passing an `f32` widened to `f64` is exact.

use candle_core::{DType, Tensor};

use crate::error::{Result, SchedulerError, TensorCtx};

/// `t * k`.
pub(crate) fn mul(class: &'static str, t: &Tensor, k: f32) -> Result<Tensor> {
    t.affine(k as f64, 0.0).ctx(class, "scale")
}

/// `t / d`, a true division.
pub(crate) fn div(class: &'static str, t: &Tensor, d: f32) -> Result<Tensor> {
    let d = Tensor::new(d, t.device()).ctx(class, "scalar upload")?;
    t.broadcast_div(&d).ctx(class, "divide")
}

pub(crate) fn add(class: &'static str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.add(b).ctx(class, "add")
}

pub(crate) fn sub(class: &'static str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.sub(b).ctx(class, "subtract")
}

/// `a * ka + b * kb`, evaluated as two products and one sum like torch.
pub(crate) fn lin2(class: &'static str, a: &Tensor, ka: f32, b: &Tensor, kb: f32) -> Result<Tensor> {
    add(class, &mul(class, a, ka)?, &mul(class, b, kb)?)
}

/// Rejects latents / model outputs the schedulers are not written for.
pub(crate) fn check_f32(class: &'static str, what: &str, t: &Tensor) -> Result<()> {
    if t.dtype() != DType::F32 {
        return Err(SchedulerError::BadTensor {
            class,
            what: format!("{what} must be float32, got {:?}", t.dtype()),
        });
    }
    Ok(())
}

/// Checks that two tensors share a shape before they are combined.
pub(crate) fn check_same_shape(class: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(SchedulerError::BadTensor {
            class,
            what: format!("model output shape {:?} does not match sample shape {:?}", a.dims(), b.dims()),
        });
    }
    Ok(())
}

/// A tensor of standard-normal noise shaped like `like`, drawn on the host.
pub(crate) fn noise_like(
    class: &'static str,
    like: &Tensor,
    rng: &mut dyn crate::NoiseSource,
) -> Result<Tensor> {
    let numel = like.elem_count();
    let values = rng.randn(numel);
    if values.len() != numel {
        return Err(SchedulerError::BadTensor {
            class,
            what: format!("noise source returned {} values, {} requested", values.len(), numel),
        });
    }
    Tensor::from_vec(values, like.shape(), like.device()).ctx(class, "noise upload")
}
