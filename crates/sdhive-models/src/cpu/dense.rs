//! Linear layers as one matrix product whose destination already holds bias and residual, and
//! the transformer's projections between the NCHW image and `(B, H·W, C)` tokens, which read the
//! other layout through strides instead of permuting copies.

use super::gemm::{matmul, Mat};
use rayon::prelude::*;

/// Fills each `width`-long row of `dst` with `bias` (+ the matching row of `residual`).
fn prefill_rows(dst: &mut [f32], width: usize, bias: Option<&[f32]>, residual: Option<&[f32]>) {
    let rows_per_task = (16_384 / width.max(1)).max(1);
    dst.par_chunks_mut(rows_per_task * width).enumerate().for_each(|(t, block)| {
        for (i, row) in block.chunks_exact_mut(width).enumerate() {
            let r = t * rows_per_task + i;
            match (bias, residual) {
                (Some(b), Some(res)) => {
                    for ((o, &b), &x) in row.iter_mut().zip(b).zip(&res[r * width..][..width]) {
                        *o = b + x;
                    }
                }
                (Some(b), None) => row.copy_from_slice(&b[..width]),
                (None, Some(res)) => row.copy_from_slice(&res[r * width..][..width]),
                (None, None) => {}
            }
        }
    });
}

/// `x (rows, in) · wᵀ + bias + residual` with `w` `(out, in)`; returns `(rows, out)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear(
    x: &[f32],
    rows: usize,
    in_dim: usize,
    w: &[f32],
    out_dim: usize,
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    threads: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; rows * out_dim];
    if rows <= TRANSPOSED_MAX_ROWS && rows * in_dim < out_dim * in_dim {
        // Few tokens, many weights: compute outᵀ = W · xᵀ so the matrix kernel streams each
        // weight row contiguously (the other orientation reads 64 weight rows at once, which
        // the prefetchers cannot follow), then transpose while adding bias and residual.
        let mut tmp = vec![0f32; out_dim * rows];
        let d = Mat::rows(0, out_dim, rows, rows);
        let xt = Mat::rows(0, rows, in_dim, in_dim).t();
        matmul(&mut tmp, d, false, w, Mat::rows(0, out_dim, in_dim, in_dim), x, xt, 1.0, threads);
        transpose_add(&tmp, out_dim, rows, &mut out, bias, residual);
        return out;
    }
    let accumulate = bias.is_some() || residual.is_some();
    if accumulate {
        prefill_rows(&mut out, out_dim, bias, residual);
    }
    let d = Mat::rows(0, rows, out_dim, out_dim);
    let wt = Mat::rows(0, out_dim, in_dim, in_dim).t();
    matmul(&mut out, d, accumulate, x, Mat::rows(0, rows, in_dim, in_dim), w, wt, 1.0, threads);
    out
}

/// Up to this many rows (tokens) a linear layer runs transposed.
const TRANSPOSED_MAX_ROWS: usize = 256;

/// `out[r][c] = src[c][r] + bias[c] + residual[r][c]` for `src` `(cols × rows)`, in 16×16
/// blocks so both sides stay in cache lines.
fn transpose_add(
    src: &[f32],
    cols: usize,
    rows: usize,
    out: &mut [f32],
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
) {
    const B: usize = 16;
    out.par_chunks_mut(B * cols).enumerate().for_each(|(rb, block)| {
        let r0 = rb * B;
        let nr = block.len() / cols;
        for c0 in (0..cols).step_by(B) {
            let nc = B.min(cols - c0);
            for i in 0..nr {
                let row = &mut block[i * cols + c0..][..nc];
                for (j, o) in row.iter_mut().enumerate() {
                    *o = src[(c0 + j) * rows + r0 + i] + bias.map_or(0.0, |b| b[c0 + j]);
                }
                if let Some(res) = residual {
                    for (o, &q) in row.iter_mut().zip(&res[(r0 + i) * cols + c0..][..nc]) {
                        *o += q;
                    }
                }
            }
        }
    });
}

/// `x` `(B, Cin, P)` → tokens `(B, P, Cout)` = `x[b]ᵀ · wᵀ + bias` (`w` `(Cout, Cin)`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn image_to_tokens(
    x: &[f32],
    batch: usize,
    c_in: usize,
    pixels: usize,
    w: &[f32],
    c_out: usize,
    bias: Option<&[f32]>,
    threads: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; batch * pixels * c_out];
    let accumulate = bias.is_some();
    if accumulate {
        prefill_rows(&mut out, c_out, bias, None);
    }
    let wt = Mat::rows(0, c_out, c_in, c_in).t();
    for b in 0..batch {
        let d = Mat::rows(b * pixels * c_out, pixels, c_out, c_out);
        let xt = Mat::rows(b * c_in * pixels, c_in, pixels, pixels).t();
        matmul(&mut out, d, accumulate, x, xt, w, wt, 1.0, threads);
    }
    out
}

/// Tokens `(B, P, Cin)` → image `(B, Cout, P)` = `w · tokens[b]ᵀ + bias + residual`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn tokens_to_image(
    tokens: &[f32],
    batch: usize,
    c_in: usize,
    pixels: usize,
    w: &[f32],
    c_out: usize,
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    threads: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; batch * c_out * pixels];
    let accumulate = bias.is_some() || residual.is_some();
    if accumulate {
        out.par_chunks_mut(pixels).enumerate().for_each(|(i, row)| {
            let v = bias.map_or(0.0, |b| b[i % c_out]);
            match residual {
                Some(res) => {
                    for (o, &r) in row.iter_mut().zip(&res[i * pixels..][..pixels]) {
                        *o = r + v;
                    }
                }
                None => row.fill(v),
            }
        });
    }
    let w_mat = Mat::rows(0, c_out, c_in, c_in);
    for b in 0..batch {
        let d = Mat::rows(b * c_out * pixels, c_out, pixels, pixels);
        let tt = Mat::rows(b * pixels * c_in, pixels, c_in, c_in).t();
        matmul(&mut out, d, accumulate, w, w_mat, tokens, tt, 1.0, threads);
    }
    out
}
