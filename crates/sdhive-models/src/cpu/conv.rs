//! 2-D convolution on NCHW f32 data as matrix products that write the NCHW output in place:
//! `out[b] (Cout × HoWo) = W (Cout × Cin·Kh·Kw) · col (Cin·Kh·Kw × HoWo)`. The weight is used as
//! stored (PyTorch's `(Cout, Cin, Kh, Kw)` is already that row-major matrix), 1×1 convolutions
//! read the input directly, and larger kernels build `col` (im2col) in bounded slices of output
//! rows so a 256² VAE layer does not need a 600 MB patch matrix.
//!
//! The output can start from a per-channel value (bias, plus a per-sample term such as the
//! ResNet time embedding) and a residual, so those adds cost no extra pass, and the input can be
//! read as if nearest-upsampled ×2 (the decoder's upsamplers) without materialising it.

use super::gemm::{matmul, Mat};
use super::math;
use super::winograd;
use super::Scratch;
use rayon::prelude::*;

/// Elements of patch matrix built at once. Bigger slices help the matrix product little and
/// cost resident memory.
const COL_BUDGET: usize = 1 << 23;

/// Below this many output pixels per sample, the samples share one product (better shaped for
/// the tiny 8² and 4² UNet levels) instead of one product each.
const MERGE_BELOW_PIXELS: usize = 512;

/// Patch-matrix storage.
pub(crate) static COL_SCRATCH: Scratch = Scratch::new();

/// Shape of one convolution. `h`, `w` are the input size the kernel sees; with `upsample` the
/// stored input is `(h/2, w/2)` and is read nearest-neighbour ×2.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConvShape {
    pub batch: usize,
    pub c_in: usize,
    pub h: usize,
    pub w: usize,
    pub c_out: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: usize,
    pub pad: usize,
    pub upsample: bool,
}

impl ConvShape {
    pub fn h_out(&self) -> usize {
        (self.h + 2 * self.pad).saturating_sub(self.kh) / self.stride + 1
    }

    pub fn w_out(&self) -> usize {
        (self.w + 2 * self.pad).saturating_sub(self.kw) / self.stride + 1
    }

    /// Stored input size `(h, w)`.
    fn src_hw(&self) -> (usize, usize) {
        if self.upsample {
            (self.h / 2, self.w / 2)
        } else {
            (self.h, self.w)
        }
    }
}

/// What the output starts from before the product is added: `bias[c] + per_sample[b·Cout + c]`
/// and, when given, `residual[b, c, y, x]`.
#[derive(Default, Clone, Copy)]
pub(crate) struct Epilogue<'a> {
    pub bias: Option<&'a [f32]>,
    pub per_sample: Option<&'a [f32]>,
    pub residual: Option<&'a [f32]>,
}

impl Epilogue<'_> {
    fn is_empty(&self) -> bool {
        self.bias.is_none() && self.per_sample.is_none() && self.residual.is_none()
    }

    pub(crate) fn channel_value(&self, b: usize, c_out: usize, c: usize) -> f32 {
        self.bias.map_or(0.0, |v| v[c]) + self.per_sample.map_or(0.0, |v| v[b * c_out + c])
    }

    /// Writes the starting value of sample `b` into `out_b` (`(Cout, pixels)`).
    fn fill(&self, out_b: &mut [f32], b: usize, c_out: usize, pixels: usize) {
        out_b.par_chunks_mut(pixels).enumerate().for_each(|(c, row)| {
            let v = self.channel_value(b, c_out, c);
            match self.residual {
                Some(res) => {
                    let src = &res[(b * c_out + c) * pixels..][..pixels];
                    for (o, &r) in row.iter_mut().zip(src) {
                        *o = r + v;
                    }
                }
                None => row.fill(v),
            }
        });
    }
}

/// Per (sample, input channel) `(a, shift)`: the convolution reads its input as
/// `silu(x·a + shift)` (a fused group norm + SiLU); padding stays zero.
pub(crate) type PreActivation<'a> = Option<&'a [(f32, f32)]>;

/// `x` is the stored input `(B, Cin, src_h, src_w)`, `weight` `(Cout, Cin, Kh, Kw)`; returns
/// `(B, Cout, Ho, Wo)`.
pub(crate) fn conv2d(
    x: &[f32],
    pre: PreActivation,
    weight: &[f32],
    s: &ConvShape,
    epi: &Epilogue,
    threads: usize,
) -> Vec<f32> {
    if let Some(tile) = winograd::choose(s) {
        return winograd::conv3x3(x, pre, weight, s, epi, tile);
    }
    conv2d_with_budget(x, pre, weight, s, epi, threads, COL_BUDGET)
}

/// `silu(x·a + shift)` of the whole input, for the paths that read it in place.
fn activated(x: &[f32], pre: &[(f32, f32)], plane: usize) -> Vec<f32> {
    let mut out = x.to_vec();
    if plane > 0 {
        out.par_chunks_mut(plane).zip(pre).for_each(|(p, &(a, b))| math::affine_silu_inplace(p, a, b));
    }
    out
}

/// [`conv2d`] with the patch-matrix budget as a parameter, so tests reach every path.
pub(crate) fn conv2d_with_budget(
    x: &[f32],
    pre: PreActivation,
    weight: &[f32],
    s: &ConvShape,
    epi: &Epilogue,
    threads: usize,
    budget: usize,
) -> Vec<f32> {
    let (ho, wo) = (s.h_out(), s.w_out());
    let pixels = ho * wo;
    let (sh, sw) = s.src_hw();
    let in_len = s.c_in * sh * sw;
    let k = s.c_in * s.kh * s.kw;
    let mut out = vec![0f32; s.batch * s.c_out * pixels];
    if out.is_empty() {
        return out;
    }
    let w_mat = Mat::rows(0, s.c_out, k, k);
    let direct = s.kh == 1 && s.kw == 1 && s.stride == 1 && s.pad == 0 && !s.upsample;
    if let (true, Some(p)) = (direct, pre) {
        // A 1×1 product reads the input directly: activate a copy first.
        let act = activated(x, p, sh * sw);
        return conv2d_with_budget(&act, None, weight, s, epi, threads, budget);
    }

    if s.batch > 1 && pixels < MERGE_BELOW_PIXELS && k * s.batch * pixels <= budget {
        // One product for all samples into a (Cout × B·pixels) scratch, then scattered.
        let cols = s.batch * pixels;
        let mut col = COL_SCRATCH.take(k * cols);
        for b in 0..s.batch {
            let src = &x[b * in_len..][..in_len];
            if direct {
                // A 1×1 input already is (Cin × pixels) per sample: place samples side by side.
                for ci in 0..s.c_in {
                    col[ci * cols + b * pixels..][..pixels].copy_from_slice(&src[ci * pixels..][..pixels]);
                }
            } else {
                im2col(src, pre.map(|p| &p[b * s.c_in..][..s.c_in]), s, 0, ho, &mut col, cols, b * pixels);
            }
        }
        let mut tmp = vec![0f32; s.c_out * cols];
        let r = Mat::rows(0, k, cols, cols);
        matmul(&mut tmp, Mat::rows(0, s.c_out, cols, cols), false, weight, w_mat, &col, r, 1.0, threads);
        COL_SCRATCH.put(col);
        out.par_chunks_mut(pixels).enumerate().for_each(|(i, o)| {
            let (b, c) = (i / s.c_out, i % s.c_out);
            let v = epi.channel_value(b, s.c_out, c);
            let src = &tmp[c * cols + b * pixels..][..pixels];
            match epi.residual {
                Some(res) => {
                    for ((o, &t), &r) in o.iter_mut().zip(src).zip(&res[i * pixels..][..pixels]) {
                        *o = t + v + r;
                    }
                }
                None => {
                    for (o, &t) in o.iter_mut().zip(src) {
                        *o = t + v;
                    }
                }
            }
        });
        return out;
    }

    let accumulate = !epi.is_empty();
    let out_len = s.c_out * pixels;
    if direct {
        for (b, out_b) in out.chunks_exact_mut(out_len).enumerate() {
            if accumulate {
                epi.fill(out_b, b, s.c_out, pixels);
            }
            let src = &x[b * in_len..][..in_len];
            let d = Mat::rows(0, s.c_out, pixels, pixels);
            matmul(out_b, d, accumulate, weight, w_mat, src, Mat::rows(0, k, pixels, pixels), 1.0, threads);
        }
        return out;
    }

    let rows_per_slice = (budget / (k * wo).max(1)).clamp(1, ho);
    let mut col = COL_SCRATCH.take(k * rows_per_slice * wo);
    for (b, out_b) in out.chunks_exact_mut(out_len).enumerate() {
        if accumulate {
            epi.fill(out_b, b, s.c_out, pixels);
        }
        let src = &x[b * in_len..][..in_len];
        let mut r0 = 0;
        while r0 < ho {
            let r1 = (r0 + rows_per_slice).min(ho);
            let cols = (r1 - r0) * wo;
            im2col(src, pre.map(|p| &p[b * s.c_in..][..s.c_in]), s, r0, r1, &mut col[..k * cols], cols, 0);
            let d = Mat::rows(r0 * wo, s.c_out, cols, pixels);
            matmul(out_b, d, accumulate, weight, w_mat, &col, Mat::rows(0, k, cols, cols), 1.0, threads);
            r0 = r1;
        }
    }
    COL_SCRATCH.put(col);
    out
}

/// Patch rows of output rows `r0..r1` of one sample into `col`: patch row `(ci, ky, kx)` is row
/// `(ci·Kh + ky)·Kw + kx` of `col` (rows `col_rs` apart), output pixel `(oy, ox)` its column
/// `col_off + (oy − r0)·Wo + ox`. Out-of-image taps are zero; `pre` holds this sample's
/// per-channel pre-activation.
#[allow(clippy::too_many_arguments)]
fn im2col(
    src: &[f32],
    pre: PreActivation,
    s: &ConvShape,
    r0: usize,
    r1: usize,
    col: &mut [f32],
    col_rs: usize,
    col_off: usize,
) {
    let wo = s.w_out();
    let (sh, sw) = s.src_hw();
    let taps = s.kh * s.kw;
    let plain = s.stride == 1 && !s.upsample;
    col.par_chunks_mut(taps * col_rs).take(s.c_in).enumerate().for_each(|(ci, rows)| {
        let plane = &src[ci * sh * sw..][..sh * sw];
        let act = pre.map(|p| p[ci]);
        for ky in 0..s.kh {
            for kx in 0..s.kw {
                let row = &mut rows[(ky * s.kw + kx) * col_rs + col_off..];
                for oy in r0..r1 {
                    let seg = &mut row[(oy - r0) * wo..][..wo];
                    let iy = (oy * s.stride + ky) as isize - s.pad as isize;
                    if iy < 0 || iy >= s.h as isize {
                        seg.fill(0.0);
                        continue;
                    }
                    let sy = if s.upsample { iy as usize / 2 } else { iy as usize };
                    let line = &plane[sy * sw..][..sw];
                    if plain {
                        // ix = ox + kx − pad must lie in [0, w).
                        let lo = s.pad.saturating_sub(kx).min(wo);
                        let hi = (s.w + s.pad).saturating_sub(kx).clamp(lo, wo);
                        if lo == hi {
                            seg.fill(0.0);
                            continue;
                        }
                        seg[..lo].fill(0.0);
                        seg[lo..hi].copy_from_slice(&line[lo + kx - s.pad..hi + kx - s.pad]);
                        if let Some((a, b)) = act {
                            math::affine_silu_inplace(&mut seg[lo..hi], a, b);
                        }
                        seg[hi..].fill(0.0);
                    } else {
                        for (ox, v) in seg.iter_mut().enumerate() {
                            let ix = (ox * s.stride + kx) as isize - s.pad as isize;
                            *v = if ix < 0 || ix >= s.w as isize {
                                0.0
                            } else {
                                let v = if s.upsample { line[ix as usize / 2] } else { line[ix as usize] };
                                act.map_or(v, |(a, b)| math::silu(v * a + b))
                            };
                        }
                    }
                }
            }
        }
    });
}
