//! The two Box-Muller block transforms torch's CPU `normal_` can run.
//!
//! Torch picks the transform when its kernels are compiled, per CPU
//! capability: x86-64 builds running on an AVX2 (or AVX-512) CPU use a
//! vectorised Cephes-style `log`/`sincos` polynomial evaluated in float with
//! fused multiply-adds (the compiler contracts the intrinsics' mul+add pairs);
//! every other build (no AVX2, `ATEN_CPU_CAPABILITY=default`, aarch64) calls
//! the C library's `logf`/`cosf`/`sinf`. The two disagree by a few ulp on
//! roughly a third of the samples, so the caller must say which torch it
//! wants to agree with.
//!
//! The polynomial path is pure IEEE arithmetic (mul, add, fma, sqrt are all
//! correctly rounded), hence reproducible on any host. The libm path is
//! exact only where the host libm is the one torch used (glibc on Linux).

use std::f64::consts::PI;

/// Which of torch's CPU normal-sampling kernels to reproduce for tensors of
/// 16 or more elements (smaller ones always take the double-precision path).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum NormalKernel {
    /// Torch on an x86-64 CPU with AVX2 or AVX-512: what nearly every
    /// desktop/server PyTorch produces. Host-independent.
    #[default]
    X86Simd,
    /// Torch's portable scalar kernel (non-AVX2 x86, aarch64, or
    /// `ATEN_CPU_CAPABILITY=default`), computed with this host's libm.
    Scalar,
}

impl NormalKernel {
    /// Transforms 16 uniforms in `[0, 1)` into 16 standard normals in place.
    pub(crate) fn box_muller_16(self, data: &mut [f32]) {
        debug_assert_eq!(data.len(), 16);
        match self {
            NormalKernel::X86Simd => simd_block(data),
            NormalKernel::Scalar => scalar_block(data),
        }
    }
}

fn scalar_block(data: &mut [f32]) {
    for j in 0..8 {
        let u1 = 1.0f32 - data[j];
        let u2 = data[j + 8];
        let radius = (-2.0f32 * u1.ln()).sqrt();
        // Torch multiplies in double (2.0 * pi is a double constant) and only
        // then narrows the angle to float.
        let theta = (2.0f64 * PI * u2 as f64) as f32;
        // Torch finishes with fma(x, std = 1, mean = 0): the value unchanged
        // except that -0 becomes +0, which `+ 0.0` reproduces.
        data[j] = radius * theta.cos() + 0.0;
        data[j + 8] = radius * theta.sin() + 0.0;
    }
}

/// `2 * pi` rounded to float, as torch broadcasts it into the vector kernel.
const TWO_PI_F32: f32 = (2.0 * PI) as f32;

fn simd_block(data: &mut [f32]) {
    for j in 0..8 {
        let u1 = 1.0f32 - data[j];
        let u2 = data[j + 8];
        let radius = (-2.0f32 * cephes_log(u1)).sqrt();
        let (sin, cos) = cephes_sincos(TWO_PI_F32 * u2);
        data[j] = radius * cos + 0.0;
        data[j + 8] = radius * sin + 0.0;
    }
}

// Cephes single-precision coefficients (public-domain Cephes library).
const SQRT_HALF: f32 = 0.707_106_77;
const LOG_P: [f32; 9] = [
    7.037_683_6e-2,
    -1.151_461e-1,
    1.167_699_84e-1,
    -1.242_014_1e-1,
    1.424_932_3e-1,
    -1.666_805_7e-1,
    2.000_071_4e-1,
    -2.499_999_4e-1,
    3.333_333e-1,
];
const LN2_LO: f32 = -2.121_944_4e-4;
// Written out in full to show it is exact (9 significant bits).
#[allow(clippy::excessive_precision)]
const LN2_HI: f32 = 0.693_359_375;
const FOUR_OVER_PI: f32 = 1.273_239_5;
const PI4_A: f32 = -0.785_156_25;
const PI4_B: f32 = -2.418_756_5e-4;
const PI4_C: f32 = -3.774_895e-8;
const SIN_P: [f32; 3] = [-1.951_529_6e-4, 8.332_161e-3, -1.666_665_5e-1];
const COS_P: [f32; 3] = [2.443_315_7e-5, -1.388_731_6e-3, 4.166_664_6e-2];

/// Natural log by the Cephes single-precision method, for `x` in `(0, 1]`
/// (all Box-Muller ever feeds it). Split `x = m * 2^e` with `m` in
/// `[sqrt(1/2), sqrt(2))`, approximate `log(1 + f)` by a degree-9 polynomial
/// and add `e * ln 2` in two parts (0.693359375 is exact in 9 bits, so
/// `e * q2` never rounds).
fn cephes_log(x: f32) -> f32 {
    // Subnormals are clamped to the smallest normal, as torch's kernel does.
    let x = x.max(f32::MIN_POSITIVE);
    let bits = x.to_bits();
    // Mantissa re-biased into [0.5, 1) and the matching exponent.
    let mant = f32::from_bits((bits & !0x7f80_0000) | 0.5f32.to_bits());
    let mut e = ((bits >> 23) as i32 - 127) as f32 + 1.0;
    let mut f = mant - 1.0;
    if mant < SQRT_HALF {
        e -= 1.0;
        f += mant;
    }
    let z = f * f;
    let mut y = LOG_P[0];
    for &p in &LOG_P[1..] {
        y = y.mul_add(f, p);
    }
    y = (y * f).mul_add(z, e * LN2_LO);
    y -= z * 0.5;
    (f + y) + e * LN2_HI
}

/// `(sin x, cos x)` by the Cephes single-precision method: reduce by
/// multiples of pi/4 with a three-part pi/4 (Cody-Waite), evaluate the sine
/// and cosine polynomials on the remainder and route/sign them by octant.
/// Accurate for the `[0, 2pi)` angles Box-Muller produces.
fn cephes_sincos(x: f32) -> (f32, f32) {
    let sin_sign = x.to_bits() & 0x8000_0000;
    let ax = x.abs();
    // Octant rounded up to even, so the remainder lies in [-pi/4, pi/4].
    let oct = ((ax * FOUR_OVER_PI) as i32 + 1) & !1;
    let k = oct as f32;
    let r = k.mul_add(PI4_C, k.mul_add(PI4_B, k.mul_add(PI4_A, ax)));
    let z = r * r;

    let cos_poly = {
        let y = COS_P[0].mul_add(z, COS_P[1]).mul_add(z, COS_P[2]) * z;
        y.mul_add(z, -(z * 0.5)) + 1.0
    };
    let sin_poly = {
        let y = SIN_P[0].mul_add(z, SIN_P[1]).mul_add(z, SIN_P[2]) * z;
        y.mul_add(r, r)
    };

    let swap = oct & 2 != 0;
    let (s, c) = if swap { (cos_poly, sin_poly) } else { (sin_poly, cos_poly) };
    let s_sign = sin_sign ^ (((oct & 4) as u32) << 29);
    let c_sign = ((!(oct - 2) & 4) as u32) << 29;
    (f32::from_bits(s.to_bits() ^ s_sign), f32::from_bits(c.to_bits() ^ c_sign))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_round_to_the_published_cephes_floats() {
        // Bit patterns of the Cephes decimal constants rounded to f32
        // (numpy: np.float32(float("7.0376836292E-2")).view(np.uint32), ...);
        // the short literals above must land on exactly these.
        let log_p: [u32; 9] = [
            0x3d9021bb, 0xbdebd1b8, 0x3def251a, 0xbdfe5d4f, 0x3e11e9bf, 0xbe2aae50, 0x3e4cceac, 0xbe7ffffc,
            0x3eaaaaaa,
        ];
        for (c, b) in LOG_P.iter().zip(log_p) {
            assert_eq!(c.to_bits(), b, "{c}");
        }
        let rest: [(f32, u32); 14] = [
            (SQRT_HALF, 0x3f3504f3),
            (LN2_LO, 0xb95e8083),
            (LN2_HI, 0x3f318000),
            (PI4_A, 0xbf490000),
            (PI4_B, 0xb97da000),
            (PI4_C, 0xb3222169),
            (SIN_P[0], 0xb94ca1f9),
            (SIN_P[1], 0x3c08839e),
            (SIN_P[2], 0xbe2aaaa3),
            (COS_P[0], 0x37ccf5ce),
            (COS_P[1], 0xbab6061a),
            (COS_P[2], 0x3d2aaaa5),
            (FOUR_OVER_PI, 0x3fa2f983),
            (TWO_PI_F32, 0x40c90fdb),
        ];
        for (c, b) in rest {
            assert_eq!(c.to_bits(), b, "{c}");
        }
    }

    #[test]
    fn cephes_log_is_close_to_libm() {
        for i in 1..=1000u32 {
            let x = i as f32 / 1000.0;
            let (a, b) = (cephes_log(x), x.ln());
            assert!((a - b).abs() <= 2.0 * f32::EPSILON * b.abs().max(1e-6), "{x}");
        }
        assert_eq!(cephes_log(1.0), 0.0);
    }

    #[test]
    fn cephes_sincos_is_close_to_libm() {
        for i in 0..1000u32 {
            let x = i as f32 * TWO_PI_F32 / 1000.0;
            let (s, c) = cephes_sincos(x);
            assert!((s - x.sin()).abs() < 1e-6, "sin {x}");
            assert!((c - x.cos()).abs() < 1e-6, "cos {x}");
        }
    }
}
