//! Group norm (optionally followed by SiLU, as every ResNet block and the decoder's output use it)
//! and layer norm over contiguous f32 data: two passes per group/row for the statistics, one
//! fused pass for normalise · affine · activation, parallel over groups/rows.

use super::math;
use rayon::prelude::*;

/// Group norm as a per-(sample, channel) affine map: `(a, shift)` with `norm(x) = x·a + shift`,
/// for `x` laid out `(B, C, S)` (S = spatial size) and per-channel affine `w`, `b`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn group_norm_coefficients(
    x: &[f32],
    channels: usize,
    spatial: usize,
    groups: usize,
    eps: f64,
    w: &[f32],
    b: &[f32],
) -> Vec<(f32, f32)> {
    let per_group = channels / groups;
    let group_len = per_group * spatial;
    let mut coef = vec![(1f32, 0f32); x.len() / spatial.max(1)];
    if group_len == 0 {
        return coef;
    }
    coef.par_chunks_mut(per_group).zip(x.par_chunks(group_len)).enumerate().for_each(|(i, (cg, xg))| {
        let g = i % groups;
        let n = group_len as f64;
        let mean = math::sum(xg) / n;
        let var = math::centered_sq_sum(xg, mean as f32) / n;
        let rstd = 1.0 / (var + eps).sqrt();
        for (j, c) in cg.iter_mut().enumerate() {
            let ch = g * per_group + j;
            let a = rstd * w[ch] as f64;
            *c = (a as f32, (b[ch] as f64 - mean * a) as f32);
        }
    });
    coef
}

/// Group norm of `x` laid out `(B, C, S)`, then SiLU when `silu`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn group_norm(
    x: &[f32],
    channels: usize,
    spatial: usize,
    groups: usize,
    eps: f64,
    w: &[f32],
    b: &[f32],
    silu: bool,
) -> Vec<f32> {
    let coef = group_norm_coefficients(x, channels, spatial, groups, eps, w, b);
    let mut out = vec![0f32; x.len()];
    if spatial == 0 {
        return out;
    }
    out.par_chunks_mut(spatial).zip(x.par_chunks(spatial)).zip(&coef).for_each(|((o, xc), &(a, shift))| {
        math::scale_shift(xc, o, a, shift, silu);
    });
    out
}

/// Layer norm over the last dimension (`dim`) of `x`, affine `w`, `b`.
pub(crate) fn layer_norm(x: &[f32], dim: usize, eps: f64, w: &[f32], b: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    if dim == 0 {
        return out;
    }
    // Rows are short (320–1280): hand rayon blocks of rows, not single ones.
    let rows_per_task = (16_384 / dim).max(1);
    out.par_chunks_mut(rows_per_task * dim).zip(x.par_chunks(rows_per_task * dim)).for_each(|(o, xs)| {
        for (orow, xrow) in o.chunks_exact_mut(dim).zip(xs.chunks_exact(dim)) {
            let mean = math::sum(xrow) / dim as f64;
            let var = math::centered_sq_sum(xrow, mean as f32) / dim as f64;
            let rstd = (1.0 / (var + eps).sqrt()) as f32;
            math::normalize_affine(xrow, orow, mean as f32, rstd, w, b);
        }
    });
    out
}
