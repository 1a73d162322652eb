//! AVX-512 versions of the exp-based element-wise kernels (SiLU, exact GELU, softmax rows). The
//! portable versions in `math` vectorise too, but without fast-math the compiler keeps every
//! multiply and add separate and divides with `vdivps`; here the polynomials use FMA, the power
//! of two comes from `vscalefps` and reciprocals from `vrcp14ps` plus one Newton step (relative
//! error below 1e-7, like the division). Callers check [`super::math::has_avx512`] first.

use std::arch::x86_64::*;

const LANES: usize = 16;

/// `eˣ`, same algorithm and range as `math::exp`: x = n·ln2 + r, e^r by its degree-7 Taylor
/// polynomial, scaled by 2ⁿ.
#[inline]
#[target_feature(enable = "avx512f")]
fn exp(x: __m512) -> __m512 {
    let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0)), _mm512_set1_ps(88.0));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.0 / 5040.0);
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, n)
}

/// `1 / d` from the 14-bit estimate and one Newton step.
#[inline]
#[target_feature(enable = "avx512f")]
fn recip(d: __m512) -> __m512 {
    let y = _mm512_rcp14_ps(d);
    _mm512_mul_ps(y, _mm512_fnmadd_ps(d, y, _mm512_set1_ps(2.0)))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn silu(x: __m512) -> __m512 {
    let e = exp(_mm512_sub_ps(_mm512_setzero_ps(), x));
    _mm512_mul_ps(x, recip(_mm512_add_ps(_mm512_set1_ps(1.0), e)))
}

/// `0.5·x·(1 + erf(x/√2))` through the complementary error function, as `math::gelu_erf`.
#[inline]
#[target_feature(enable = "avx512f")]
fn gelu(x: __m512) -> __m512 {
    let z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(std::f32::consts::FRAC_1_SQRT_2));
    let t = recip(_mm512_fmadd_ps(z, _mm512_set1_ps(0.5), _mm512_set1_ps(1.0)));
    let mut p = _mm512_set1_ps(0.170_872_77);
    for c in [
        -0.822_152_23,
        1.488_515_9,
        -1.135_204,
        0.278_868_07,
        -0.186_288_06,
        0.096_784_18,
        0.374_091_96,
        1.000_023_7,
        -1.265_512_2,
    ] {
        p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(c));
    }
    let erfc = _mm512_mul_ps(t, exp(_mm512_fnmadd_ps(z, z, p)));
    // 1 + erf(x/√2) is 2 − erfc for x ≥ 0 and erfc for x < 0.
    let neg = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_setzero_ps());
    let one_plus_erf = _mm512_mask_blend_ps(neg, _mm512_sub_ps(_mm512_set1_ps(2.0), erfc), erfc);
    _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5), x), one_plus_erf)
}

/// Mask of the first `n` (< 16) lanes.
#[inline]
fn tail_mask(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

/// Applies `f` to every element of `src`, writing `dst` (same length).
#[inline]
#[target_feature(enable = "avx512f")]
fn map(src: &[f32], dst: &mut [f32], f: impl Fn(__m512) -> __m512) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + LANES <= n {
        // SAFETY: i + 16 ≤ n ≤ both lengths.
        unsafe { _mm512_storeu_ps(dst.as_mut_ptr().add(i), f(_mm512_loadu_ps(src.as_ptr().add(i)))) };
        i += LANES;
    }
    if i < n {
        let m = tail_mask(n - i);
        // SAFETY: the masked lanes (the first n − i) lie inside both slices; masked-off lanes are
        // neither read nor written.
        unsafe {
            let v = _mm512_maskz_loadu_ps(m, src.as_ptr().add(i));
            _mm512_mask_storeu_ps(dst.as_mut_ptr().add(i), m, f(v));
        }
    }
}

/// Same as [`map`] in place.
#[inline]
#[target_feature(enable = "avx512f")]
fn map_inplace(x: &mut [f32], f: impl Fn(__m512) -> __m512) {
    let n = x.len();
    let p = x.as_mut_ptr();
    let mut i = 0;
    while i + LANES <= n {
        // SAFETY: i + 16 ≤ n.
        unsafe { _mm512_storeu_ps(p.add(i), f(_mm512_loadu_ps(p.add(i)))) };
        i += LANES;
    }
    if i < n {
        let m = tail_mask(n - i);
        // SAFETY: only the first n − i lanes, all inside `x`, are touched.
        unsafe { _mm512_mask_storeu_ps(p.add(i), m, f(_mm512_maskz_loadu_ps(m, p.add(i)))) };
    }
}

/// `x ← silu(x)`.
#[target_feature(enable = "avx512f")]
pub(crate) fn silu_inplace(x: &mut [f32]) {
    map_inplace(x, |v| silu(v));
}

/// `x ← silu(x·a + b)`.
#[target_feature(enable = "avx512f")]
pub(crate) fn affine_silu_inplace(x: &mut [f32], a: f32, b: f32) {
    let (va, vb) = (_mm512_set1_ps(a), _mm512_set1_ps(b));
    map_inplace(x, |v| silu(_mm512_fmadd_ps(v, va, vb)));
}

/// `dst = src·a + b`, then SiLU when `silu_after`.
#[target_feature(enable = "avx512f")]
pub(crate) fn scale_shift(src: &[f32], dst: &mut [f32], a: f32, b: f32, silu_after: bool) {
    let (va, vb) = (_mm512_set1_ps(a), _mm512_set1_ps(b));
    if silu_after {
        map(src, dst, |v| silu(_mm512_fmadd_ps(v, va, vb)));
    } else {
        map(src, dst, |v| _mm512_fmadd_ps(v, va, vb));
    }
}

/// GEGLU rows: `dst[r][j] = src[r][j] · gelu(src[r][inner + j])`.
#[target_feature(enable = "avx512f")]
pub(crate) fn geglu_rows(src: &[f32], dst: &mut [f32], inner: usize) {
    for (s, d) in src.chunks_exact(2 * inner).zip(dst.chunks_exact_mut(inner)) {
        let (a, g) = s.split_at(inner);
        d.copy_from_slice(g);
        map_inplace(d, |v| gelu(v));
        let n = inner;
        let mut i = 0;
        let (dp, ap) = (d.as_mut_ptr(), a.as_ptr());
        while i + LANES <= n {
            // SAFETY: i + 16 ≤ inner, the length of both `d` and `a`.
            unsafe {
                _mm512_storeu_ps(
                    dp.add(i),
                    _mm512_mul_ps(_mm512_loadu_ps(dp.add(i)), _mm512_loadu_ps(ap.add(i))),
                )
            };
            i += LANES;
        }
        for j in i..n {
            d[j] *= a[j];
        }
    }
}

/// Softmax of each `row_len`-long row of `x`, in place.
#[target_feature(enable = "avx512f")]
pub(crate) fn softmax_rows(x: &mut [f32], row_len: usize) {
    if row_len == 0 {
        return;
    }
    for row in x.chunks_exact_mut(row_len) {
        let n = row.len();
        let p = row.as_mut_ptr();
        let tail = n % LANES;
        let body = n - tail;
        let m = tail_mask(tail);
        let mut vmax = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i < body {
            // SAFETY: i + 16 ≤ body ≤ n.
            vmax = _mm512_max_ps(vmax, unsafe { _mm512_loadu_ps(p.add(i)) });
            i += LANES;
        }
        if tail > 0 {
            // SAFETY: the first `tail` lanes from `body` lie inside the row.
            let v = unsafe { _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), m, p.add(body)) };
            vmax = _mm512_max_ps(vmax, v);
        }
        let vmax = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
        let mut vsum = _mm512_setzero_ps();
        let mut i = 0;
        while i < body {
            // SAFETY: as above.
            unsafe {
                let e = exp(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), vmax));
                _mm512_storeu_ps(p.add(i), e);
                vsum = _mm512_add_ps(vsum, e);
            }
            i += LANES;
        }
        if tail > 0 {
            // SAFETY: as above; masked-off lanes contribute zero to the sum.
            unsafe {
                let e = exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p.add(body)), vmax));
                let e = _mm512_maskz_mov_ps(m, e);
                _mm512_mask_storeu_ps(p.add(body), m, e);
                vsum = _mm512_add_ps(vsum, e);
            }
        }
        let inv = _mm512_set1_ps(1.0 / _mm512_reduce_add_ps(vsum));
        map_inplace(row, |v| _mm512_mul_ps(v, inv));
    }
}
