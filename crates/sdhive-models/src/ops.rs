//! The hot tensor operations of all three networks (attention, normalisation, gated
//! activations), each behind one small function so a fused kernel can replace it later without
//! touching the model code.

use candle_core::{DType, Result, Tensor, D};

/// Above this many attention-score elements per call we split the queries into chunks, so a
/// large VAE attention (one head over every pixel) does not need gigabytes of scores at once.
const MAX_SCORE_ELEMENTS: usize = 1 << 27;

/// `softmax(q kᵀ · scale + mask) v` over already-split heads.
///
/// `q` is `(N, Sq, D)`, `k` is `(N, Sk, D)`, `v` is `(N, Sk, Dv)` with `N = batch * heads`;
/// `mask` is additive and broadcastable to `(N, Sq, Sk)`. With `upcast` the scores and softmax
/// run in f32 whatever the input dtype (diffusers' `upcast_attention` for SD2.x in f16).
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
    upcast: bool,
) -> Result<Tensor> {
    let (n, sq, _) = q.dims3()?;
    let sk = k.dim(1)?;
    let per_query = n * sk;
    if per_query * sq <= MAX_SCORE_ELEMENTS || sq <= 1 {
        return attention_block(q, k, v, scale, mask, upcast);
    }
    let chunk = (MAX_SCORE_ELEMENTS / per_query).max(1);
    let mut outs = Vec::with_capacity(sq.div_ceil(chunk));
    let mut start = 0;
    while start < sq {
        let len = chunk.min(sq - start);
        let qc = q.narrow(1, start, len)?;
        let mc = match mask {
            Some(m) if m.rank() >= 2 && m.dim(D::Minus2)? == sq => {
                Some(m.narrow(m.rank() - 2, start, len)?)
            }
            Some(m) => Some(m.clone()),
            None => None,
        };
        outs.push(attention_block(&qc, k, v, scale, mc.as_ref(), upcast)?);
        start += len;
    }
    Tensor::cat(&outs, 1)
}

fn attention_block(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
    upcast: bool,
) -> Result<Tensor> {
    let in_dtype = q.dtype();
    let work_dtype = if upcast { DType::F32 } else { in_dtype };
    let q = q.to_dtype(work_dtype)?;
    let k = k.to_dtype(work_dtype)?;
    let scores = (q.matmul(&k.t()?)? * scale)?;
    let scores = match mask {
        Some(m) => scores.broadcast_add(&m.to_dtype(work_dtype)?)?,
        None => scores,
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
    probs.matmul(v)
}

/// `(B, S, H·D)` → `(B·H, S, D)`, contiguous so the batched matmuls need no copies.
pub fn split_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, s, hd) = x.dims3()?;
    x.reshape((b, s, heads, hd / heads))?.transpose(1, 2)?.contiguous()?.reshape((b * heads, s, hd / heads))
}

/// `(B·H, S, D)` → `(B, S, H·D)`.
pub fn merge_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (bh, s, d) = x.dims3()?;
    x.reshape((bh / heads, heads, s, d))?.transpose(1, 2)?.contiguous()?.reshape((bh / heads, s, heads * d))
}

/// GroupNorm over `(B, C, …)` with per-channel affine; statistics in f32 for half inputs.
pub fn group_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, groups: usize, eps: f64) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    if dims.len() < 3 {
        candle_core::bail!("group_norm expects a (B, C, ...) tensor, got {:?}", dims);
    }
    let (b, c) = (dims[0], dims[1]);
    let group_size = dims[2..].iter().product::<usize>() * c / groups;
    let in_dtype = x.dtype();
    let work = match in_dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    };
    let xg = x.to_dtype(work)?.reshape((b, groups, group_size))?;
    let mean = (xg.sum_keepdim(2)? / group_size as f64)?;
    let centered = xg.broadcast_sub(&mean)?;
    let var = (centered.sqr()?.sum_keepdim(2)? / group_size as f64)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    let mut wshape = vec![1usize; dims.len()];
    wshape[1] = c;
    normed
        .to_dtype(in_dtype)?
        .reshape(dims)?
        .broadcast_mul(&weight.reshape(wshape.clone())?)?
        .broadcast_add(&bias.reshape(wshape)?)
}

/// LayerNorm over the last dimension, two-pass in f32: candle's fused kernel uses
/// `E[x²] − E[x]²`, which cancels badly on CLIP's large-magnitude outlier channels.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let in_dtype = x.dtype();
    let n = x.dim(D::Minus1)? as f64;
    let xf = x.to_dtype(DType::F32)?;
    let mean = (xf.sum_keepdim(D::Minus1)? / n)?;
    let centered = xf.broadcast_sub(&mean)?;
    let var = (centered.sqr()?.sum_keepdim(D::Minus1)? / n)?;
    centered
        .broadcast_div(&(var + eps)?.sqrt()?)?
        .to_dtype(in_dtype)?
        .broadcast_mul(weight)?
        .broadcast_add(bias)
}

pub fn silu(x: &Tensor) -> Result<Tensor> {
    x.silu()
}

/// diffusers' GEGLU: the projection's first half gated by the exact (erf) GELU of its second.
pub fn geglu(x: &Tensor) -> Result<Tensor> {
    let last = x.dim(D::Minus1)?;
    let half = last / 2;
    let hidden = x.narrow(D::Minus1, 0, half)?;
    let gate = x.narrow(D::Minus1, half, half)?;
    hidden.mul(&gate.gelu_erf()?)
}

/// OpenAI CLIP's `x · sigmoid(1.702 x)`.
pub fn quick_gelu(x: &Tensor) -> Result<Tensor> {
    x.mul(&candle_nn::ops::sigmoid(&(x * 1.702)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn chunked_attention_matches_single_block() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1., (2, 9, 4), &dev)?;
        let k = Tensor::randn(0f32, 1., (2, 7, 4), &dev)?;
        let v = Tensor::randn(0f32, 1., (2, 7, 3), &dev)?;
        let full = attention_block(&q, &k, &v, 0.5, None, false)?;
        let mut parts = Vec::new();
        for (s, l) in [(0, 4), (4, 4), (8, 1)] {
            parts.push(attention_block(&q.narrow(1, s, l)?, &k, &v, 0.5, None, false)?);
        }
        let chunked = Tensor::cat(&parts, 1)?;
        let diff = (full - chunked)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "diff {diff}");
        Ok(())
    }

    #[test]
    fn heads_round_trip() -> Result<()> {
        let x = Tensor::randn(0f32, 1., (2, 5, 12), &Device::Cpu)?;
        let y = merge_heads(&split_heads(&x, 3)?, 3)?;
        let diff = (x - y)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        Ok(())
    }
}
