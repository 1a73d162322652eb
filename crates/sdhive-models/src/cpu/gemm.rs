//! The one door to the `gemm` crate: strided f32 matrix products with bounds checked against the
//! slices they live in, so the kernels above can use arbitrary strides (transposed operands, one
//! head's columns inside a `(S, H·D)` buffer) without copying and without scattering `unsafe`.

use gemm::Parallelism;
use rayon::prelude::*;

/// Where a `rows × cols` matrix sits in a slice: element `(i, j)` is at `offset + i·rs + j·cs`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mat {
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl Mat {
    /// A row-major matrix starting at `offset` whose rows are `rs` apart.
    pub fn rows(offset: usize, rows: usize, cols: usize, rs: usize) -> Self {
        Self { offset, rows, cols, rs, cs: 1 }
    }

    /// One past the last element it touches (0 for an empty matrix).
    fn end(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            self.offset + (self.rows - 1) * self.rs + (self.cols - 1) * self.cs + 1
        }
    }

    /// No two elements share an address: required of a destination.
    fn is_injective(&self) -> bool {
        self.rows <= 1
            || self.cols <= 1
            || (self.cs >= 1 && self.rs >= self.cols * self.cs)
            || (self.rs >= 1 && self.cs >= self.rows * self.rs)
    }

    /// The transpose, same storage.
    pub fn t(self) -> Self {
        Self { offset: self.offset, rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs }
    }
}

/// The destination pointer shared by the parts of one split product.
struct SharedDst(*mut f32);
// SAFETY: the parts write disjoint elements and the destination outlives the parallel loop.
unsafe impl Send for SharedDst {}
unsafe impl Sync for SharedDst {}

impl SharedDst {
    fn get(&self) -> *mut f32 {
        self.0
    }
}

fn parallelism(threads: usize) -> Parallelism {
    if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    }
}

/// `dst = scale · lhs · rhs`, or `dst += scale · lhs · rhs` with `accumulate`.
///
/// Panics when a matrix does not fit its slice or the shapes disagree: those are bugs in the
/// calling kernel, whose shapes were validated before.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    dst: &mut [f32],
    d: Mat,
    accumulate: bool,
    lhs: &[f32],
    l: Mat,
    rhs: &[f32],
    r: Mat,
    scale: f32,
    threads: usize,
) {
    assert!(d.end() <= dst.len(), "gemm: destination {d:?} exceeds {} elements", dst.len());
    // SAFETY: `dst` is borrowed mutably for the call and the destination fits in it.
    unsafe { matmul_raw(dst.as_mut_ptr(), d, accumulate, lhs, l, rhs, r, scale, threads) }
}

/// [`matmul`] writing through a raw pointer, for tasks that fill disjoint parts of one buffer in
/// parallel.
///
/// # Safety
/// `dst` must be valid for writes over `d` (every `offset + i·rs + j·cs`), and no other thread
/// may read or write those elements during the call.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul_raw(
    dst: *mut f32,
    d: Mat,
    accumulate: bool,
    lhs: &[f32],
    l: Mat,
    rhs: &[f32],
    r: Mat,
    scale: f32,
    threads: usize,
) {
    assert!(
        d.rows == l.rows && d.cols == r.cols && l.cols == r.rows,
        "gemm: shapes {d:?} = {l:?} · {r:?} disagree"
    );
    assert!(l.end() <= lhs.len(), "gemm: lhs {l:?} exceeds {} elements", lhs.len());
    assert!(r.end() <= rhs.len(), "gemm: rhs {r:?} exceeds {} elements", rhs.len());
    assert!(d.is_injective(), "gemm: destination {d:?} overlaps itself");
    if d.rows == 0 || d.cols == 0 {
        return;
    }
    if threads > 1 {
        let flops = 2 * d.rows * d.cols * l.cols;
        // Split the destination along the dimension that also splits the larger operand, so
        // each thread streams its own part of it (the weights, for most layers).
        let by_cols = r.rows * r.cols >= l.rows * l.cols;
        let dim = if by_cols { d.cols } else { d.rows };
        let parts = threads.min(dim / 64);
        if parts > 1 && flops >= 1 << 22 {
            let chunk = dim.div_ceil(parts).next_multiple_of(64);
            let shared = SharedDst(dst);
            let shared = &shared;
            (0..dim.div_ceil(chunk)).into_par_iter().for_each(|p| {
                let (a, b) = (p * chunk, ((p + 1) * chunk).min(dim));
                let (dp, lp, rp) = if by_cols {
                    (
                        Mat { offset: d.offset + a * d.cs, cols: b - a, ..d },
                        l,
                        Mat { offset: r.offset + a * r.cs, cols: b - a, ..r },
                    )
                } else {
                    (
                        Mat { offset: d.offset + a * d.rs, rows: b - a, ..d },
                        Mat { offset: l.offset + a * l.rs, rows: b - a, ..l },
                        r,
                    )
                };
                // SAFETY: the parts cover disjoint rows or columns of the destination, which the
                // caller guarantees is valid and exclusive for the whole call.
                unsafe { matmul_raw(shared.get(), dp, accumulate, lhs, lp, rhs, rp, scale, 1) };
            });
            return;
        }
    }
    if l.cols == 0 {
        if !accumulate {
            for i in 0..d.rows {
                for j in 0..d.cols {
                    // SAFETY: in bounds of `d` by the caller's contract.
                    unsafe { *dst.add(d.offset + i * d.rs + j * d.cs) = 0.0 };
                }
            }
        }
        return;
    }
    // SAFETY: all three matrices were checked to lie inside their buffers (the destination by
    // the caller), the destination does not alias itself, and `gemm` reads the sources only.
    unsafe {
        gemm::gemm(
            d.rows,
            d.cols,
            l.cols,
            dst.add(d.offset),
            d.cs as isize,
            d.rs as isize,
            accumulate,
            lhs.as_ptr().add(l.offset),
            l.cs as isize,
            l.rs as isize,
            rhs.as_ptr().add(r.offset),
            r.cs as isize,
            r.rs as isize,
            1.0,
            scale,
            false,
            false,
            false,
            parallelism(threads),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], l: Mat, b: &[f32], r: Mat) -> Vec<f32> {
        let mut out = vec![0f32; l.rows * r.cols];
        for i in 0..l.rows {
            for j in 0..r.cols {
                let mut s = 0f64;
                for k in 0..l.cols {
                    s += a[l.offset + i * l.rs + k * l.cs] as f64 * b[r.offset + k * r.rs + j * r.cs] as f64;
                }
                out[i * r.cols + j] = s as f32;
            }
        }
        out
    }

    #[test]
    fn strided_products_match_naive() {
        let a: Vec<f32> = (0..200).map(|i| (i % 7) as f32 - 3.0).collect();
        let b: Vec<f32> = (0..300).map(|i| (i % 5) as f32 * 0.5).collect();
        // lhs 5×6 transposed in storage, rhs 6×4 with a row stride of 9.
        let l = Mat::rows(3, 6, 5, 5).t();
        let r = Mat::rows(10, 6, 4, 9);
        let want = naive(&a, l, &b, r);
        for threads in [1, 2] {
            let mut dst = vec![1f32; 5 * 4];
            matmul(&mut dst, Mat::rows(0, 5, 4, 4), false, &a, l, &b, r, 1.0, threads);
            assert_eq!(dst, want);
            let mut acc = vec![1f32; 5 * 4];
            matmul(&mut acc, Mat::rows(0, 5, 4, 4), true, &a, l, &b, r, 2.0, threads);
            let expect: Vec<f32> = want.iter().map(|v| 1.0 + 2.0 * v).collect();
            assert_eq!(acc, expect);
        }
    }
}
