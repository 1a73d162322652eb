//! 3×3 stride-1 convolution by Winograd's minimal filtering (Lavin & Gray, 2015), F(2×2, 3×3)
//! and F(4×4, 3×3): each (m+2)² input tile and each 3×3 filter are transformed so that an m×m
//! output tile costs (m+2)² multiplications per channel pair instead of 9m² (16 instead of 36
//! for m = 2, 36 instead of 144 for m = 4). The products become (m+2)² independent matrix
//! products `M[ξ] = U[ξ] · V[ξ]` (Cout × Cin by Cin × tiles), one per transformed position ξ.
//!
//! The filter transform runs on every call (the transformed weights are 16/9 or 36/9 times the
//! originals, too much to keep next to a whole UNet), so [`choose`] weighs it against the
//! multiplications saved; tiles are processed in blocks so the transformed input and the
//! products stay a few megabytes. The transforms work on 16 tiles (or filters) at once, one per
//! SIMD lane.

use super::conv::{ConvShape, Epilogue, PreActivation};
use super::gemm::{matmul_raw, Mat};
use super::math::{self, multiversion, LANES};
use super::Scratch;
use rayon::prelude::*;

/// Largest number of transformed positions per tile (6×6, F(4×4, 3×3)).
const MAX_XI: usize = 36;

/// Elements of the transformed-input and product blocks each.
const BLOCK_BUDGET: usize = 1 << 22;

pub(crate) static U_SCRATCH: Scratch = Scratch::new();
pub(crate) static V_SCRATCH: Scratch = Scratch::new();
pub(crate) static M_SCRATCH: Scratch = Scratch::new();

/// The output tile size of a Winograd convolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tile {
    /// F(2×2, 3×3): 4×4 input tiles, 16 products per tile.
    F2,
    /// F(4×4, 3×3): 6×6 input tiles, 36 products per tile.
    F4,
}

/// Output tiles of one sample: `(rows, cols)` of m×m tiles.
fn tile_grid(s: &ConvShape, m: usize) -> (usize, usize) {
    (s.h_out().div_ceil(m), s.w_out().div_ceil(m))
}

/// The cheapest way to run a convolution: `Some(tile)` for Winograd, `None` for the patch
/// matrix. Costs are in multiply-adds per (input, output) channel pair: the patch-matrix
/// product does 9 per output pixel (plus about a fifth for building the patches); Winograd
/// does (m+2)² per tile plus the filter transform, whose memory traffic (9 floats read, (m+2)²
/// written and read back) was measured at about 28 flops' worth per byte.
pub(crate) fn choose(s: &ConvShape) -> Option<Tile> {
    if s.kh != 3 || s.kw != 3 || s.stride != 1 {
        return None;
    }
    let pixels = (s.batch * s.h_out() * s.w_out()) as f64;
    let im2col = 2.0 * 9.0 * pixels * 1.2;
    let cost = |m: usize| {
        let (th, tw) = tile_grid(s, m);
        let (tiles, xi) = ((s.batch * th * tw) as f64, ((m + 2) * (m + 2)) as f64);
        2.0 * xi * tiles + 28.0 * 4.0 * (9.0 + 2.0 * xi)
    };
    let (f2, f4) = (cost(2), cost(4));
    if f4 <= f2 && f4 < im2col {
        Some(Tile::F4)
    } else if f2 < im2col {
        Some(Tile::F2)
    } else {
        None
    }
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

/// One tile variant's transforms, on columns of at most six values (only the first `A` are
/// used).
trait Variant {
    /// Output tile side m.
    const M: usize;
    /// Input tile side m + 2.
    const A: usize;
    /// `Bᵀ x` for one column of `A` values.
    fn bt(x: [f32; 6]) -> [f32; 6];
    /// `Aᵀ x`: `M` values from a column of `A`.
    fn at(x: [f32; 6]) -> [f32; 4];
    /// `G x`: `A` values from a filter column of three.
    fn g(x: [f32; 3]) -> [f32; 6];
}

struct F2;
struct F4;

impl Variant for F2 {
    const M: usize = 2;
    const A: usize = 4;

    #[inline(always)]
    fn bt(x: [f32; 6]) -> [f32; 6] {
        [x[0] - x[2], x[1] + x[2], x[2] - x[1], x[1] - x[3], 0.0, 0.0]
    }

    #[inline(always)]
    fn at(x: [f32; 6]) -> [f32; 4] {
        [x[0] + x[1] + x[2], x[1] - x[2] - x[3], 0.0, 0.0]
    }

    #[inline(always)]
    fn g(x: [f32; 3]) -> [f32; 6] {
        let s = 0.5 * (x[0] + x[2]);
        [x[0], s + 0.5 * x[1], s - 0.5 * x[1], x[2], 0.0, 0.0]
    }
}

impl Variant for F4 {
    const M: usize = 4;
    const A: usize = 6;

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

    #[inline(always)]
    fn at(x: [f32; 6]) -> [f32; 4] {
        let (s12, d12, s34, d34) = (x[1] + x[2], x[1] - x[2], x[3] + x[4], x[3] - x[4]);
        [x[0] + s12 + s34, d12 + 2.0 * d34, s12 + 4.0 * s34, d12 + 8.0 * d34 + x[5]]
    }

    #[inline(always)]
    fn g(x: [f32; 3]) -> [f32; 6] {
        let (s02, s) = (x[0] + x[2], x[0] / 24.0 + x[2] / 6.0);
        [x[0] / 4.0, -(s02 + x[1]) / 6.0, -(s02 - x[1]) / 6.0, s + x[1] / 12.0, s - x[1] / 12.0, x[2]]
    }
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

/// `G g Gᵀ` of `n` consecutive 3×3 filters in `w` (9 apart): filter `i`'s position ξ goes to
/// `u[ξ·u_rs + i]`.
#[inline(always)]
fn filters_impl<V: Variant>(w: &[f32], n: usize, u: &mut [f32], u_rs: usize) {
    let a = V::A;
    let mut i0 = 0;
    while i0 < n {
        let cnt = LANES.min(n - i0);
        let mut g = [[0f32; LANES]; 9];
        for l in 0..cnt {
            for k in 0..9 {
                g[k][l] = w[(i0 + l) * 9 + k];
            }
        }
        // G g: A×3, then (G g) Gᵀ: A×A.
        let mut gg = [[0f32; LANES]; 18];
        for c in 0..3 {
            for l in 0..LANES {
                let col = V::g([g[c][l], g[3 + c][l], g[6 + c][l]]);
                for r in 0..a {
                    gg[r * 3 + c][l] = col[r];
                }
            }
        }
        let mut out = [[0f32; LANES]; MAX_XI];
        for r in 0..a {
            for l in 0..LANES {
                let row = V::g([gg[r * 3][l], gg[r * 3 + 1][l], gg[r * 3 + 2][l]]);
                for c in 0..a {
                    out[r * a + c][l] = row[c];
                }
            }
        }
        for (xi, o) in out[..a * a].iter().enumerate() {
            store(&mut u[xi * u_rs + i0..], o, cnt);
        }
        i0 += LANES;
    }
}

/// `Bᵀ d B` of `n` consecutive tiles of one tile row of one channel. `strip` holds the `A`
/// input rows (`stride` apart), zero-padded so tile `i` starts at column `M·i` and whole chunks
/// of 16 tiles can be read; tile `i`'s position ξ goes to `v[ξ·v_rs + i]`.
#[inline(always)]
// Index loops mirror the transform's matrix notation (rows, columns, SIMD lanes).
#[allow(clippy::needless_range_loop)]
fn input_impl<V: Variant>(strip: &[f32], stride: usize, n: usize, v: &mut [f32], v_rs: usize) {
    let (a, m) = (V::A, V::M);
    let mut i0 = 0;
    while i0 < n {
        let mut d = [[0f32; LANES]; MAX_XI];
        for r in 0..a {
            for c in 0..a {
                let src = &strip[r * stride + m * i0 + c..][..m * LANES];
                for l in 0..LANES {
                    d[r * a + c][l] = src[m * l];
                }
            }
        }
        for c in 0..a {
            for l in 0..LANES {
                let mut col = [0f32; 6];
                for r in 0..a {
                    col[r] = d[r * a + c][l];
                }
                let t = V::bt(col);
                for r in 0..a {
                    d[r * a + c][l] = t[r];
                }
            }
        }
        for r in 0..a {
            for l in 0..LANES {
                let mut row = [0f32; 6];
                for c in 0..a {
                    row[c] = d[r * a + c][l];
                }
                let t = V::bt(row);
                for c in 0..a {
                    d[r * a + c][l] = t[c];
                }
            }
        }
        let cnt = LANES.min(n - i0);
        for (xi, row) in d[..a * a].iter().enumerate() {
            store(&mut v[xi * v_rs + i0..], row, cnt);
        }
        i0 += LANES;
    }
}

/// `Aᵀ m A` of `n` consecutive tiles of one tile row of one output channel, reading tile `i`'s
/// position ξ from `m[ξ·m_rs + i]` and writing its M×M outputs to rows `0..M` of `rows`
/// (`stride` apart) at columns `M·i..M·i + M`; `rows` is padded to whole chunks of 16 tiles.
#[inline(always)]
fn output_impl<V: Variant>(mt: &[f32], m_rs: usize, n: usize, rows: &mut [f32], stride: usize) {
    let (a, m) = (V::A, V::M);
    let mut i0 = 0;
    while i0 < n {
        let cnt = LANES.min(n - i0);
        let mut t = [[0f32; LANES]; MAX_XI];
        for (xi, row) in t[..a * a].iter_mut().enumerate() {
            let src = &mt[xi * m_rs + i0..];
            if cnt == LANES {
                row.copy_from_slice(&src[..LANES]);
            } else {
                row[..cnt].copy_from_slice(&src[..cnt]);
            }
        }
        // Rows first: h[r][c] for c < M.
        let mut h = [[0f32; LANES]; 24];
        for r in 0..a {
            for l in 0..LANES {
                let mut x = [0f32; 6];
                for c in 0..a {
                    x[c] = t[r * a + c][l];
                }
                let o = V::at(x);
                for c in 0..m {
                    h[r * 4 + c][l] = o[c];
                }
            }
        }
        for c in 0..m {
            let mut y = [[0f32; LANES]; 4];
            for l in 0..LANES {
                let mut x = [0f32; 6];
                for r in 0..a {
                    x[r] = h[r * 4 + c][l];
                }
                let o = V::at(x);
                for r in 0..m {
                    y[r][l] = o[r];
                }
            }
            for (r, yr) in y[..m].iter().enumerate() {
                let dst = &mut rows[r * stride + m * i0..][..m * LANES];
                for l in 0..LANES {
                    dst[m * l + c] = yr[l];
                }
            }
        }
        i0 += LANES;
    }
}

multiversion! {
    fn filters_f2(w: &[f32], n: usize, u: &mut [f32], u_rs: usize) {
        filters_impl::<F2>(w, n, u, u_rs)
    }
}
multiversion! {
    fn filters_f4(w: &[f32], n: usize, u: &mut [f32], u_rs: usize) {
        filters_impl::<F4>(w, n, u, u_rs)
    }
}
multiversion! {
    fn input_f2(strip: &[f32], stride: usize, n: usize, v: &mut [f32], v_rs: usize) {
        input_impl::<F2>(strip, stride, n, v, v_rs)
    }
}
multiversion! {
    fn input_f4(strip: &[f32], stride: usize, n: usize, v: &mut [f32], v_rs: usize) {
        input_impl::<F4>(strip, stride, n, v, v_rs)
    }
}
multiversion! {
    fn output_f2(mt: &[f32], m_rs: usize, n: usize, rows: &mut [f32], stride: usize) {
        output_impl::<F2>(mt, m_rs, n, rows, stride)
    }
}
multiversion! {
    fn output_f4(mt: &[f32], m_rs: usize, n: usize, rows: &mut [f32], stride: usize) {
        output_impl::<F4>(mt, m_rs, n, rows, stride)
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
/// `(Cout, Cin, 3, 3)` by the given tile variant; same contract as [`super::conv::conv2d`].
pub(crate) fn conv3x3(
    x: &[f32],
    pre: PreActivation,
    weight: &[f32],
    s: &ConvShape,
    epi: &Epilogue,
    tile: Tile,
) -> Vec<f32> {
    match tile {
        Tile::F2 => conv3x3_with::<F2>(x, pre, weight, s, epi, filters_f2, input_f2, output_f2),
        Tile::F4 => conv3x3_with::<F4>(x, pre, weight, s, epi, filters_f4, input_f4, output_f4),
    }
}

type FilterFn = fn(&[f32], usize, &mut [f32], usize);
type TileFn = fn(&[f32], usize, usize, &mut [f32], usize);

#[allow(clippy::too_many_arguments)]
fn conv3x3_with<V: Variant>(
    x: &[f32],
    pre: PreActivation,
    weight: &[f32],
    s: &ConvShape,
    epi: &Epilogue,
    filters: FilterFn,
    input_tiles: TileFn,
    output_tiles: TileFn,
) -> Vec<f32> {
    let (m_side, a_side) = (V::M, V::A);
    let xi_n = a_side * a_side;
    let (ho, wo) = (s.h_out(), s.w_out());
    let (c_in, c_out) = (s.c_in, s.c_out);
    let mut out = vec![0f32; s.batch * c_out * ho * wo];
    if out.is_empty() {
        return out;
    }
    let (th, tw) = tile_grid(s, m_side);
    let per_sample = th * tw;
    let total = s.batch * per_sample;
    let (sh, sw) = if s.upsample { (s.h / 2, s.w / 2) } else { (s.h, s.w) };
    let in_len = c_in * sh * sw;
    // Strips cover a whole tile row plus one spare chunk of 16 tiles, so chunked reads and
    // writes never need bounds special cases.
    let strip_stride = m_side * (tw + LANES) + (a_side - m_side);

    // U laid out [co][ξ][ci]: U[ξ] is a (Cout × Cin) matrix with rows ξn·Cin apart.
    let mut u = U_SCRATCH.take(c_out * xi_n * c_in);
    u[..c_out * xi_n * c_in].par_chunks_mut(xi_n * c_in).enumerate().for_each(|(co, dst)| {
        filters(&weight[co * c_in * 9..][..c_in * 9], c_in, dst, c_in);
    });

    let block = (BLOCK_BUDGET / (xi_n * c_in.max(c_out))).clamp(16, 1024).min(total);
    // V laid out [ci][ξ][t], M laid out [co][ξ][t].
    let mut v = V_SCRATCH.take(c_in * xi_n * block);
    let mut m = M_SCRATCH.take(c_out * xi_n * block);
    let out_ptr = SharedMut(out.as_mut_ptr());
    let (pad, h, w) = (s.pad as isize, s.h as isize, s.w as isize);

    let mut start = 0;
    while start < total {
        let n = block.min(total - start);
        let segs = segments(start, n, per_sample, tw);
        v[..c_in * xi_n * block].par_chunks_mut(xi_n * block).enumerate().for_each(|(ci, vc)| {
            let mut strip = vec![0f32; a_side * strip_stride];
            for seg in &segs {
                let plane = &x[seg.b * in_len + ci * sh * sw..][..sh * sw];
                let x0 = (m_side * seg.tx0) as isize - pad;
                let cols = m_side * seg.len + (a_side - m_side);
                for r in 0..a_side {
                    let iy = (m_side * seg.ty + r) as isize - pad;
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
        (0..xi_n).into_par_iter().for_each(|xi| {
            let d = Mat { offset: xi * block, rows: c_out, cols: n, rs: xi_n * block, cs: 1 };
            let l = Mat { offset: xi * c_in, rows: c_out, cols: c_in, rs: xi_n * c_in, cs: 1 };
            let r = Mat { offset: xi * block, rows: c_in, cols: n, rs: xi_n * block, cs: 1 };
            // SAFETY: `d` lies inside `m` (Cout·ξn·block elements) and each ξ writes only its
            // own columns ξ·block..ξ·block+n of every row.
            unsafe { matmul_raw(m_ptr.get(), d, false, u_ref, l, v_ref, r, 1.0, 1) };
        });

        let m_ref = &m[..];
        (0..c_out).into_par_iter().for_each(|co| {
            let mut rows = vec![0f32; m_side * strip_stride];
            for seg in &segs {
                output_tiles(&m_ref[co * xi_n * block + seg.t0..], block, seg.len, &mut rows, strip_stride);
                let add = epi.channel_value(seg.b, c_out, co);
                let plane = (seg.b * c_out + co) * ho * wo;
                let (x0, x1) = (m_side * seg.tx0, (m_side * (seg.tx0 + seg.len)).min(wo));
                for r in 0..m_side.min(ho - m_side * seg.ty) {
                    let base = plane + (m_side * seg.ty + r) * wo;
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
