//! Sinusoidal timestep features and the MLP that turns them into the UNet's time embedding
//! (also reused for SDXL's `time_ids`).

use crate::layers::linear;
use crate::ops;
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{Linear, VarBuilder};

/// diffusers' `get_timestep_embedding` (scale 1, max period 10000) in f32.
///
/// The frequencies follow torch's f32 arithmetic step for step (the exponent is formed in f32,
/// `exp` is correctly rounded), because at t≈1000 one ulp of frequency already moves the phase
/// by ~1e-4.
#[derive(Debug, Clone)]
pub struct Timesteps {
    dim: usize,
    flip_sin_to_cos: bool,
    freqs: Vec<f32>,
}

impl Timesteps {
    pub fn new(dim: usize, flip_sin_to_cos: bool, freq_shift: f64) -> Self {
        let half = dim / 2;
        let log_max = -(10000f64.ln()) as f32;
        let denom = half as f32 - freq_shift as f32;
        let freqs = (0..half)
            .map(|i| {
                let exponent = (log_max * i as f32) / denom;
                (exponent as f64).exp() as f32
            })
            .collect();
        Self { dim, flip_sin_to_cos, freqs }
    }

    /// `timesteps` `(N,)` of any float dtype → `(N, dim)` f32.
    pub fn forward(&self, timesteps: &Tensor) -> Result<Tensor> {
        let dev = timesteps.device();
        let half = self.freqs.len();
        let t = timesteps.to_dtype(DType::F32)?.unsqueeze(1)?;
        let freqs = Tensor::from_slice(&self.freqs, (1, half), dev)?;
        let args = t.broadcast_mul(&freqs)?;
        let (sin, cos) = (args.sin()?, args.cos()?);
        let emb =
            if self.flip_sin_to_cos { Tensor::cat(&[cos, sin], 1)? } else { Tensor::cat(&[sin, cos], 1)? };
        if self.dim % 2 == 1 {
            emb.pad_with_zeros(1, 0, 1)
        } else {
            Ok(emb)
        }
    }

    /// The features of one scalar timestep repeated for a batch, in `dtype` on `device`.
    pub fn forward_scalar(&self, t: f64, batch: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        self.forward_scalars(&vec![t; batch], dtype, device)
    }

    /// The features of host timesteps `(N,)` → `(N, dim)` in `dtype` on `device`. Made on the host and uploaded
    /// in one copy: on a GPU the same arithmetic is six kernel launches.
    pub fn forward_scalars(&self, ts: &[f64], dtype: DType, device: &Device) -> Result<Tensor> {
        // diffusers turns a Python float timestep into float64 then `.float()`: round once.
        let ts = Tensor::from_vec(ts.iter().map(|&t| t as f32).collect(), ts.len(), &Device::Cpu)?;
        self.forward(&ts)?.to_dtype(dtype)?.to_device(device)
    }
}

/// diffusers' `TimestepEmbedding`: `linear_2(silu(linear_1(x)))`.
#[derive(Debug, Clone)]
pub struct TimestepEmbedding {
    linear_1: Linear,
    linear_2: Linear,
}

impl TimestepEmbedding {
    pub fn new(vb: VarBuilder, in_dim: usize, out_dim: usize) -> Result<Self> {
        Ok(Self {
            linear_1: linear(vb.pp("linear_1"), in_dim, out_dim, true)?,
            linear_2: linear(vb.pp("linear_2"), out_dim, out_dim, true)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::linear(&self.linear_2, &ops::silu(&ops::linear(&self.linear_1, x, None)?)?, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_hand_computed_embedding() -> Result<()> {
        let ts = Timesteps::new(4, true, 0.0);
        let e = ts.forward_scalar(2.0, 1, DType::F32, &Device::Cpu)?.to_vec2::<f32>()?;
        // half = 2, freqs = [1, 10000^(-1/2)]; flip puts cos first.
        let f1 = (-(10000f64.ln()) / 2.0).exp();
        let expect = [2f64.cos(), (2.0 * f1).cos(), 2f64.sin(), (2.0 * f1).sin()];
        for (a, b) in e[0].iter().zip(expect) {
            assert!((*a as f64 - b).abs() < 1e-6, "{a} vs {b}");
        }
        Ok(())
    }
}
