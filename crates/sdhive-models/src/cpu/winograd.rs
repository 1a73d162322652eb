//! 3×3 stride-1 convolution by Winograd's minimal filtering F(4×4, 3×3) (Lavin & Gray, 2015):
//! each 6×6 input tile and each 3×3 filter are transformed so that a 4×4 output tile costs 36
//! multiplications per channel pair instead of 144. The products become 36 independent matrix
//! products `M[ξ] = U[ξ] · V[ξ]` (Cout × Cin by Cin × tiles), one per transformed position ξ.
//!
//! The filter transform runs on every call (the transformed weights are four times larger than
//! the originals, too much to keep next to a whole UNet), so the caller only picks this path
//! when there are enough tiles to pay for it; tiles are processed in blocks so the transformed
//! input and the products stay a few megabytes. The transforms work on 16 tiles (or filters) at
//! once, one per SIMD lane.

use super::conv::{ConvShape, Epilogue, PreActivation};
use super::gemm::{matmul_raw, Mat};
use super::math::{self, multiversion, LANES};
use super::Scratch;
use rayon::prelude::*;

/// Transformed positions per tile (6×6).
const XI: usize = 36;

/// Elements of the transformed-input and product blocks each.
const BLOCK_BUDGET: usize = 1 << 22;

pub(crate) static U_SCRATCH: Scratch = Scratch::new();
pub(crate) static V_SCRATCH: Scratch = Scratch::new();
pub(crate) static M_SCRATCH: Scratch = Scratch::new();

/// Output tiles of one sample: `(rows, cols)` of 4×4 tiles.
fn tile_grid(s: &ConvShape) -> (usize, usize) {
    (s.h_out().div_ceil(4), s.w_out().div_ceil(4))
}

/// Whether Winograd beats the patch-matrix product for this convolution: a 3×3 stride-1 kernel
/// with enough tiles that the per-call filter transform (a few hundred bytes of memory traffic
/// per channel pair) is small next to the multiplications saved (27 per output pixel and
/// channel pair).
pub(crate) fn worth_it(s: &ConvShape) -> bool {
    if s.kh != 3 || s.kw != 3 || s.stride != 1 {
        return false;
    }
    let (th, tw) = tile_grid(s);
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let min =
        *MIN.get_or_init(|| std::env::var("SDHIVE_WINO_MIN").ok().and_then(|v| v.parse().ok()).unwrap_or(64));
    s.batch * th * tw >= min
}

/// A buffer shared by tasks that write pairwise disjoint elements of it.
struct SharedMut(*mut f32);
// SAFETY: every use below writes pairwise disjoint elements from different tasks, and the
// buffer outlives the parallel loop that uses it.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    fn get(&self) -> *mut f32 {
        self.0
    }
}

/// `Bᵀ x` for one column of six (per lane).
#[inline(always)]
fn bt(x: [f32; 6]) -> [f32; 6] {
    [
        4.0 * x[0] - 5.0 * x[2] + x[4],
        -4.0 * (x[1] + x[2]) + x[3] + x[4],
        4.0 * (x[1] - x[2]) - x[3] + x[4],
        2.0 * (x[3] - x[1]) - x[2] + x[4],
        2.0 * (x[1] - x[3]) - x[2] + x[4],
        4.0 * x[1] - 5.0 * x[3] + x[5],
    ]
}

/// `Aᵀ x` for one column of six.
#[inline(always)]
fn at(x: [f32; 6]) -> [f32; 4] {
    let (s12, d12, s34, d34) = (x[1] + x[2], x[1] - x[2], x[3] + x[4], x[3] - x[4]);
    [x[0] + s12 + s34, d12 + 2.0 * d34, s12 + 4.0 * s34, d12 + 8.0 * d34 + x[5]]
}

/// `G x` for one column of three.
#[inline(always)]
fn g3(x: [f32; 3]) -> [f32; 6] {
    let (s02, s) = (x[0] + x[2], x[0] / 24.0 + x[2] / 6.0);
    [x[0] / 4.0, -(s02 + x[1]) / 6.0, -(s02 - x[1]) / 6.0, s + x[1] / 12.0, s - x[1] / 12.0, x[2]]
}

/// `dst[..cnt] = lanes[..cnt]`, as fixed-size vector moves for whole chunks (a variable-length
/// copy of 16 floats would be a `memmove` call).
#[inline(always)]
fn store(dst: &mut [f32], lanes: &[f32; LANES], cnt: usize) {
    if cnt == LANES {
        dst[..LANES].copy_from_slice(lanes);
    } else {
        dst[..cnt].copy_from_slice(&lanes[..cnt]);
    }
}

multiversion! {
    /// `G g Gᵀ` of `n` consecutive 3×3 filters in `w` (9 apart): filter `i`'s position ξ goes to
    /// `u[ξ·u_rs + i]`.
    fn filters(w: &[f32], n: usize, u: &mut [f32], u_rs: usize) {
        let mut i0 = 0;
        while i0 < n {
            let cnt = LANES.min(n - i0);
            let mut g = [[0f32; LANES]; 9];
            for l in 0..cnt {
                for k in 0..9 {
                    g[k][l] = w[(i0 + l) * 9 + k];
                }
            }
            // G g: 6×3, then (G g) Gᵀ: 6×6.
            let mut gg = [[0f32; LANES]; 18];
            for c in 0..3 {
                for l in 0..LANES {
                    let col = g3([g[c][l], g[3 + c][l], g[6 + c][l]]);
                    for r in 0..6 {
                        gg[r * 3 + c][l] = col[r];
                    }
                }
            }
            let mut out = [[0f32; LANES]; XI];
            for r in 0..6 {
                for l in 0..LANES {
                    let row = g3([gg[r * 3][l], gg[r * 3 + 1][l], gg[r * 3 + 2][l]]);
                    for c in 0..6 {
                        out[r * 6 + c][l] = row[c];
                    }
                }
            }
            for (xi, o) in out.iter().enumerate() {
                store(&mut u[xi * u_rs + i0..], o, cnt);
            }
            i0 += LANES;
        }
    }
}

multiversion! {
    /// `Bᵀ d B` of `n` consecutive tiles of one tile row of one channel. `strip` holds the six
    /// input rows (`stride` apart), zero-padded so tile `i` starts at column `4·i` and whole
    /// chunks of 16 tiles can be read; tile `i`'s position ξ goes to `v[ξ·v_rs + i]`.
    fn input_tiles(strip: &[f32], stride: usize, n: usize, v: &mut [f32], v_rs: usize) {
        let mut i0 = 0;
        while i0 < n {
            let mut d = [[0f32; LANES]; XI];
            for r in 0..6 {
                for c in 0..6 {
                    let src = &strip[r * stride + 4 * i0 + c..][..4 * LANES];
                    for l in 0..LANES {
                        d[r * 6 + c][l] = src[4 * l];
                    }
                }
            }
            for c in 0..6 {
                for l in 0..LANES {
                    let t = bt([d[c][l], d[6 + c][l], d[12 + c][l], d[18 + c][l], d[24 + c][l], d[30 + c][l]]);
                    for r in 0..6 {
                        d[r * 6 + c][l] = t[r];
                    }
                }
            }
            for r in 0..6 {
                for l in 0..LANES {
                    let x = r * 6;
                    let t = bt([d[x][l], d[x + 1][l], d[x + 2][l], d[x + 3][l], d[x + 4][l], d[x + 5][l]]);
                    for c in 0..6 {
                        d[x + c][l] = t[c];
                    }
                }
            }
            let cnt = LANES.min(n - i0);
            for (xi, row) in d.iter().enumerate() {
                store(&mut v[xi * v_rs + i0..], row, cnt);
            }
            i0 += LANES;
        }
    }
}

multiversion! {
    /// `Aᵀ m A` of `n` consecutive tiles of one tile row of one output channel, reading tile `i`'s
    /// position ξ from `m[ξ·m_rs + i]` and writing its 4×4 outputs to rows `0..4` of `rows`
    /// (`stride` apart) at columns `4·i..4·i + 4`; `rows` is padded to whole chunks of 16 tiles.
    fn output_tiles(m: &[f32], m_rs: usize, n: usize, rows: &mut [f32], stride: usize) {
        let mut i0 = 0;
        while i0 < n {
            let cnt = LANES.min(n - i0);
            let mut t = [[0f32; LANES]; XI];
            for (xi, row) in t.iter_mut().enumerate() {
                let src = &m[xi * m_rs + i0..];
                if cnt == LANES {
                    row.copy_from_slice(&src[..LANES]);
                } else {
                    row[..cnt].copy_from_slice(&src[..cnt]);
                }
            }
            let mut h = [[0f32; LANES]; 24];
            for r in 0..6 {
                for l in 0..LANES {
                    let x = r * 6;
                    let o = at([t[x][l], t[x + 1][l], t[x + 2][l], t[x + 3][l], t[x + 4][l], t[x + 5][l]]);
                    for c in 0..4 {
                        h[r * 4 + c][l] = o[c];
                    }
                }
            }
            for c in 0..4 {
                let mut y = [[0f32; LANES]; 4];
                for l in 0..LANES {
                    let o = at([h[c][l], h[4 + c][l], h[8 + c][l], h[12 + c][l], h[16 + c][l], h[20 + c][l]]);
                    for r in 0..4 {
                        y[r][l] = o[r];
                    }
                }
                for (r, yr) in y.iter().enumerate() {
                    let dst = &mut rows[r * stride + 4 * i0..][..4 * LANES];
                    for l in 0..LANES {
                        dst[4 * l + c] = yr[l];
                    }
                }
            }
            i0 += LANES;
        }
    }
}

/// A run of consecutive tiles in one tile row of one sample, and where it starts in the block.
#[derive(Clone, Copy)]
struct Segment {
    b: usize,
    ty: usize,
    tx0: usize,
    len: usize,
    t0: usize,
}

fn segments(start: usize, n: usize, per_sample: usize, tw: usize) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut t = 0;
    while t < n {
        let g = start + t;
        let (b, local) = (g / per_sample, g % per_sample);
        let (ty, tx0) = (local / tw, local % tw);
        let len = (tw - tx0).min(n - t);
        out.push(Segment { b, ty, tx0, len, t0: t });
        t += len;
    }
    out
}

/// 3×3, stride-1 convolution of `x` (stored `(B, Cin, src_h, src_w)`) with `weight`
/// `(Cout, Cin, 3, 3)`; same contract as [`super::conv::conv2d`].
pub(crate) fn conv3x3(
    x: &[f32],
    pre: PreActivation,
    weight: &[f32],
    s: &ConvShape,
    epi: &Epilogue,
) -> Vec<f32> {
    let (ho, wo) = (s.h_out(), s.w_out());
    let (c_in, c_out) = (s.c_in, s.c_out);
    let mut out = vec![0f32; s.batch * c_out * ho * wo];
    if out.is_empty() {
        return out;
    }
    let (th, tw) = tile_grid(s);
    let per_sample = th * tw;
    let total = s.batch * per_sample;
    let (sh, sw) = if s.upsample { (s.h / 2, s.w / 2) } else { (s.h, s.w) };
    let in_len = c_in * sh * sw;
    // Strips cover a whole tile row plus one spare chunk of 16 tiles, so chunked reads and
    // writes never need bounds special cases.
    let strip_stride = 4 * (tw + LANES) + 2;

    // U laid out [co][ξ][ci]: U[ξ] is a (Cout × Cin) matrix with rows 36·Cin apart.
    let mut u = U_SCRATCH.take(c_out * XI * c_in);
    u[..c_out * XI * c_in].par_chunks_mut(XI * c_in).enumerate().for_each(|(co, dst)| {
        filters(&weight[co * c_in * 9..][..c_in * 9], c_in, dst, c_in);
    });

    let block = (BLOCK_BUDGET / (XI * c_in.max(c_out))).clamp(16, 1024).min(total);
    // V laid out [ci][ξ][t], M laid out [co][ξ][t].
    let mut v = V_SCRATCH.take(c_in * XI * block);
    let mut m = M_SCRATCH.take(c_out * XI * block);
    let out_ptr = SharedMut(out.as_mut_ptr());
    let (pad, h, w) = (s.pad as isize, s.h as isize, s.w as isize);

    let mut start = 0;
    while start < total {
        let n = block.min(total - start);
        let segs = segments(start, n, per_sample, tw);
        v[..c_in * XI * block].par_chunks_mut(XI * block).enumerate().for_each(|(ci, vc)| {
            let mut strip = vec![0f32; 6 * strip_stride];
            for seg in &segs {
                let plane = &x[seg.b * in_len + ci * sh * sw..][..sh * sw];
                let x0 = (4 * seg.tx0) as isize - pad;
                let cols = 4 * seg.len + 2;
                for r in 0..6 {
                    let iy = (4 * seg.ty + r) as isize - pad;
                    let row = &mut strip[r * strip_stride..][..cols];
                    if iy < 0 || iy >= h {
                        row.fill(0.0);
                        continue;
                    }
                    let line = &plane[(if s.upsample { iy as usize / 2 } else { iy as usize }) * sw..][..sw];
                    // Columns j with 0 ≤ x0 + j < w come from the image, the rest is padding.
                    let lo = (-x0).clamp(0, cols as isize) as usize;
                    let hi = (w - x0).clamp(lo as isize, cols as isize) as usize;
                    row[..lo].fill(0.0);
                    row[hi..].fill(0.0);
                    let first = (x0 + lo as isize) as usize;
                    if s.upsample {
                        for (j, val) in row[lo..hi].iter_mut().enumerate() {
                            *val = line[(first + j) / 2];
                        }
                    } else {
                        row[lo..hi].copy_from_slice(&line[first..first + hi - lo]);
                    }
                    if let Some(p) = pre {
                        let (a, b) = p[seg.b * c_in + ci];
                        math::affine_silu_inplace(&mut row[lo..hi], a, b);
                    }
                }
                input_tiles(&strip, strip_stride, seg.len, &mut vc[seg.t0..], block);
            }
        });

        let m_ptr = SharedMut(m.as_mut_ptr());
        let (u_ref, v_ref) = (&u[..], &v[..]);
        (0..XI).into_par_iter().for_each(|xi| {
            let d = Mat { offset: xi * block, rows: c_out, cols: n, rs: XI * block, cs: 1 };
            let l = Mat { offset: xi * c_in, rows: c_out, cols: c_in, rs: XI * c_in, cs: 1 };
            let r = Mat { offset: xi * block, rows: c_in, cols: n, rs: XI * block, cs: 1 };
            // SAFETY: `d` lies inside `m` (Cout·36·block elements) and each ξ writes only its
            // own columns ξ·block..ξ·block+n of every row.
            unsafe { matmul_raw(m_ptr.get(), d, false, u_ref, l, v_ref, r, 1.0, 1) };
        });

        let m_ref = &m[..];
        (0..c_out).into_par_iter().for_each(|co| {
            let mut rows = vec![0f32; 4 * strip_stride];
            for seg in &segs {
                output_tiles(&m_ref[co * XI * block + seg.t0..], block, seg.len, &mut rows, strip_stride);
                let add = epi.channel_value(seg.b, c_out, co);
                let plane = (seg.b * c_out + co) * ho * wo;
                let (x0, x1) = (4 * seg.tx0, (4 * (seg.tx0 + seg.len)).min(wo));
                for r in 0..4.min(ho - 4 * seg.ty) {
                    let base = plane + (4 * seg.ty + r) * wo;
                    let src = &rows[r * strip_stride..][..x1 - x0];
                    // SAFETY: `base + x0..base + x1` lies inside `out` (x1 ≤ Wo, row < Ho) and
                    // only the task for channel `co` writes channel `co`'s planes.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(base + x0), x1 - x0) };
                    match epi.residual {
                        Some(res) => {
                            for ((o, &y), &q) in dst.iter_mut().zip(src).zip(&res[base + x0..base + x1]) {
                                *o = y + add + q;
                            }
                        }
                        None => {
                            for (o, &y) in dst.iter_mut().zip(src) {
                                *o = y + add;
                            }
                        }
                    }
                }
            }
        });
        start += n;
    }
    U_SCRATCH.put(u);
    V_SCRATCH.put(v);
    M_SCRATCH.put(m);
    out
}
