//! Element-wise f32 math for the CPU kernels: a branch-free `exp`, SiLU, exact-erf GELU, softmax rows and
//! lane-parallel sums, written so LLVM vectorises them, and compiled several times over for the x86 SIMD
//! levels with a run-time pick (the workspace builds for baseline x86-64, which would otherwise leave AVX2
//! and AVX-512 unused).

/// Defines `pub(crate) fn $name` whose body is compiled three times on x86-64: for AVX-512, for
/// AVX2+FMA and for the baseline, picking the best one the running CPU supports. The body must be
/// plain loops over slices (no calls that are not inlined) for the wide versions to pay off.
macro_rules! multiversion {
    ($(#[$meta:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        pub(crate) fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn generic($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")]
                fn v4($($arg: $ty),*) $(-> $ret)? { generic($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                fn v3($($arg: $ty),*) $(-> $ret)? { generic($($arg),*) }
                if $crate::cpu::math::has_avx512() {
                    // SAFETY: the running CPU has every feature `v4` was compiled for.
                    return unsafe { v4($($arg),*) };
                }
                if $crate::cpu::math::has_avx2_fma() {
                    // SAFETY: as above, for `v3`.
                    return unsafe { v3($($arg),*) };
                }
            }
            generic($($arg),*)
        }
    };
}
pub(crate) use multiversion;

#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && has_avx2_fma()
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2_fma() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

/// Lanes of the explicit accumulators: one AVX-512 register of f32. Float adds are not reassociated
/// by the compiler, so reductions only vectorise when written over independent lanes.
pub(crate) const LANES: usize = 16;

/// Adding 1.5·2²³ rounds an f32 of magnitude < 2²² to the nearest integer, kept in the mantissa.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `eˣ` to about 2 ulp for x in [-87, 88] (clamped outside): 2ⁿ·e^r with r = x − n·ln2 in
/// [-ln2/2, ln2/2], e^r by its degree-7 Taylor polynomial (truncation < 6e-9).
#[inline(always)]
// max/min rather than clamp: a NaN input must not panic or propagate differently from the vector path.
#[allow(clippy::manual_clamp)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln2 split in two so n·LN2_HI is exact for the n in range.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.max(-87.0).min(88.0);
    let t = x * LOG2E + ROUND_MAGIC;
    let n = t - ROUND_MAGIC;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // The integer n sits in the low mantissa bits of t; move it into the exponent field.
    let n_int = (t.to_bits() as i32).wrapping_sub(ROUND_MAGIC.to_bits() as i32);
    p * f32::from_bits((n_int.wrapping_add(127) << 23) as u32)
}

#[inline(always)]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// `0.5·x·(1 + erf(x/√2))`. erf comes from the complementary function (Numerical Recipes'
/// `erfcc`, fractional error < 1.2e-7), which also keeps the negative tail free of cancellation.
#[inline(always)]
// The erfc coefficients are quoted as published; f32 rounds them.
#[allow(clippy::excessive_precision)]
pub(crate) fn gelu_erf(x: f32) -> f32 {
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.265_512_2
        + t * (1.000_023_7
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_204
                                + t * (1.488_515_9 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc = t * exp(poly - z * z);
    let one_plus_erf = if x >= 0.0 { 2.0 - erfc } else { erfc };
    0.5 * x * one_plus_erf
}

/// `x ← silu(x)`.
pub(crate) fn silu_inplace(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { super::avx512::silu_inplace(x) };
    }
    silu_inplace_portable(x)
}

/// diffusers' GEGLU over rows of `2·inner`: `out = a · gelu(g)` with `[a, g]` the two halves.
pub(crate) fn geglu_rows(src: &[f32], dst: &mut [f32], inner: usize) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { super::avx512::geglu_rows(src, dst, inner) };
    }
    geglu_rows_portable(src, dst, inner)
}

/// Softmax of each row of `x` (rows of `row_len`) in place.
pub(crate) fn softmax_rows(x: &mut [f32], row_len: usize) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { super::avx512::softmax_rows(x, row_len) };
    }
    softmax_rows_portable(x, row_len)
}

/// `dst = src · a + b`, then SiLU when `silu_after`.
pub(crate) fn scale_shift(src: &[f32], dst: &mut [f32], a: f32, b: f32, silu_after: bool) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { super::avx512::scale_shift(src, dst, a, b, silu_after) };
    }
    scale_shift_portable(src, dst, a, b, silu_after)
}

/// `x ← silu(x · a + b)`: a group-normed, activated convolution input, in place.
pub(crate) fn affine_silu_inplace(x: &mut [f32], a: f32, b: f32) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { super::avx512::affine_silu_inplace(x, a, b) };
    }
    affine_silu_inplace_portable(x, a, b)
}

multiversion! {
    /// `x ← silu(x)`.
    fn silu_inplace_portable(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v = silu(*v);
        }
    }
}

multiversion! {
    /// diffusers' GEGLU over rows of `2·inner`: `out = a · gelu(g)` with `[a, g]` the two halves.
    fn geglu_rows_portable(src: &[f32], dst: &mut [f32], inner: usize) {
        for (s, d) in src.chunks_exact(2 * inner).zip(dst.chunks_exact_mut(inner)) {
            let (a, g) = s.split_at(inner);
            for ((o, &a), &g) in d.iter_mut().zip(a).zip(g) {
                *o = a * gelu_erf(g);
            }
        }
    }
}

multiversion! {
    /// Softmax of each row of `x` (rows of `row_len`) in place.
    fn softmax_rows_portable(x: &mut [f32], row_len: usize) {
        for row in x.chunks_exact_mut(row_len) {
            let mut m = [f32::NEG_INFINITY; LANES];
            let mut chunks = row.chunks_exact(LANES);
            for c in &mut chunks {
                for i in 0..LANES {
                    m[i] = m[i].max(c[i]);
                }
            }
            let mut max = chunks.remainder().iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            for v in m {
                max = max.max(v);
            }
            let mut s = [0f32; LANES];
            let mut chunks = row.chunks_exact_mut(LANES);
            for c in &mut chunks {
                for i in 0..LANES {
                    c[i] = exp(c[i] - max);
                    s[i] += c[i];
                }
            }
            let mut sum = 0f32;
            for v in chunks.into_remainder() {
                *v = exp(*v - max);
                sum += *v;
            }
            sum += s.iter().sum::<f32>();
            let inv = 1.0 / sum;
            for v in row.iter_mut() {
                *v *= inv;
            }
        }
    }
}

multiversion! {
    /// `Σ x`, lane-parallel in f32 within blocks and f64 across blocks so long groups (a VAE group
    /// at 256² holds 262 144 values) do not lose precision.
    fn sum(x: &[f32]) -> f64 {
        let mut total = 0f64;
        for block in x.chunks(4096) {
            let mut acc = [0f32; LANES];
            let mut chunks = block.chunks_exact(LANES);
            for c in &mut chunks {
                for i in 0..LANES {
                    acc[i] += c[i];
                }
            }
            let tail: f32 = chunks.remainder().iter().sum();
            total += acc.iter().map(|&v| v as f64).sum::<f64>() + tail as f64;
        }
        total
    }
}

multiversion! {
    /// `Σ (x − mean)²`, blocked like [`sum`].
    fn centered_sq_sum(x: &[f32], mean: f32) -> f64 {
        let mut total = 0f64;
        for block in x.chunks(4096) {
            let mut acc = [0f32; LANES];
            let mut chunks = block.chunks_exact(LANES);
            for c in &mut chunks {
                for i in 0..LANES {
                    let d = c[i] - mean;
                    acc[i] += d * d;
                }
            }
            let tail: f32 = chunks.remainder().iter().map(|&v| (v - mean) * (v - mean)).sum();
            total += acc.iter().map(|&v| v as f64).sum::<f64>() + tail as f64;
        }
        total
    }
}

multiversion! {
    /// `dst = src · a + b`, then SiLU when `silu` is set.
    fn scale_shift_portable(src: &[f32], dst: &mut [f32], a: f32, b: f32, silu_after: bool) {
        if silu_after {
            for (o, &v) in dst.iter_mut().zip(src) {
                *o = silu(v * a + b);
            }
        } else {
            for (o, &v) in dst.iter_mut().zip(src) {
                *o = v * a + b;
            }
        }
    }
}

multiversion! {
    /// `x ← silu(x · a + b)`: a group-normed, activated convolution input, in place.
    fn affine_silu_inplace_portable(x: &mut [f32], a: f32, b: f32) {
        for v in x.iter_mut() {
            *v = silu(*v * a + b);
        }
    }
}

multiversion! {
    /// Row-wise `dst = (src − mean) · rstd · w + b` with per-column `w`, `b` (layer norm's affine step).
    fn normalize_affine(src: &[f32], dst: &mut [f32], mean: f32, rstd: f32, w: &[f32], b: &[f32]) {
        for (((o, &v), &w), &b) in dst.iter_mut().zip(src).zip(w).zip(b) {
            *o = (v - mean) * rstd * w + b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        // Clamped, never zero, infinite or NaN.
        assert!(exp(-1000.0) > 0.0 && exp(-1000.0) < 1e-37);
        assert!(exp(1000.0).is_finite());
    }

    #[test]
    fn gelu_and_silu_match_references() {
        let mut x = -12.0f64;
        while x < 12.0 {
            let gelu_want = 0.5 * x * (1.0 + erf_f64(x / std::f64::consts::SQRT_2));
            let gelu_got = gelu_erf(x as f32) as f64;
            assert!(
                (gelu_got - gelu_want).abs() <= 3e-7 * (1.0 + x.abs()),
                "gelu({x}) {gelu_got} vs {gelu_want}"
            );
            let silu_want = x / (1.0 + (-x).exp());
            let silu_got = silu(x as f32) as f64;
            assert!(
                (silu_got - silu_want).abs() <= 3e-7 * (1.0 + x.abs()),
                "silu({x}) {silu_got} vs {silu_want}"
            );
            x += 0.01;
        }
    }

    /// erf in f64 by its Taylor series (|x| < 3) or continued fraction; reference only.
    fn erf_f64(x: f64) -> f64 {
        if x.abs() < 3.0 {
            let mut term = x;
            let mut sum = x;
            let mut n = 0.0;
            while term.abs() > 1e-17 {
                n += 1.0;
                term *= -x * x / n;
                sum += term / (2.0 * n + 1.0);
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            // erfc(x) = exp(-x²)/√π · 1/(x + 1/2/(x + 1/(x + 3/2/(x + …))))
            let z = x.abs();
            let mut f = z;
            for k in (1..60).rev() {
                f = z + (k as f64 / 2.0) / f;
            }
            let erfc = (-z * z).exp() / std::f64::consts::PI.sqrt() / f;
            x.signum() * (1.0 - erfc)
        }
    }

    #[test]
    fn softmax_rows_sum_to_one() {
        let mut x: Vec<f32> = (0..3 * 37).map(|i| ((i * 7919) % 101) as f32 * 0.3 - 15.0).collect();
        let orig = x.clone();
        softmax_rows(&mut x, 37);
        for (row, o) in x.chunks(37).zip(orig.chunks(37)) {
            let m = o.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let s: f64 = o.iter().map(|&v| (v as f64 - m).exp()).sum();
            for (&got, &v) in row.iter().zip(o) {
                let want = (v as f64 - m).exp() / s;
                assert!((got as f64 - want).abs() < 1e-6 * want.max(1e-3), "{got} vs {want}");
            }
        }
    }

    #[test]
    fn sums_are_accurate() {
        let x: Vec<f32> = (0..100_003).map(|i| 1000.0 + (i % 13) as f32 * 0.25).collect();
        let want: f64 = x.iter().map(|&v| v as f64).sum();
        assert!((sum(&x) - want).abs() / want < 1e-9);
        let mean = (want / x.len() as f64) as f32;
        let want_sq: f64 = x.iter().map(|&v| (v as f64 - mean as f64).powi(2)).sum();
        assert!((centered_sq_sum(&x, mean) - want_sq).abs() / want_sq < 1e-5);
    }

    /// The AVX-512 kernels against the portable ones, on lengths with ragged tails and on
    /// values out to the clamping range.
    #[test]
    fn dispatched_kernels_match_portable() {
        let data: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 2003) as f32 * 0.05 - 50.0).collect();
        let close = |a: &[f32], b: &[f32], what: &str| {
            for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
                assert!((x - y).abs() <= 2e-6 * (1.0 + y.abs()), "{what}[{i}]: {x} vs {y}");
            }
        };
        for n in [1, 15, 16, 17, 250, 1000] {
            let src = &data[..n];
            let (mut a, mut b) = (src.to_vec(), src.to_vec());
            silu_inplace(&mut a);
            silu_inplace_portable(&mut b);
            close(&a, &b, "silu");
            let (mut a, mut b) = (src.to_vec(), src.to_vec());
            affine_silu_inplace(&mut a, 0.3, -0.7);
            affine_silu_inplace_portable(&mut b, 0.3, -0.7);
            close(&a, &b, "affine_silu");
            for act in [false, true] {
                let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
                scale_shift(src, &mut a, 1.5, 0.25, act);
                scale_shift_portable(src, &mut b, 1.5, 0.25, act);
                close(&a, &b, "scale_shift");
            }
        }
        for inner in [1, 16, 37] {
            let src = &data[..4 * inner];
            let (mut a, mut b) = (vec![0f32; 2 * inner], vec![0f32; 2 * inner]);
            geglu_rows(src, &mut a, inner);
            geglu_rows_portable(src, &mut b, inner);
            close(&a, &b, "geglu");
        }
        for row in [1, 7, 16, 33, 250] {
            let (mut a, mut b) = (data[..4 * row].to_vec(), data[..4 * row].to_vec());
            softmax_rows(&mut a, row);
            softmax_rows_portable(&mut b, row);
            close(&a, &b, "softmax");
        }
    }
}
