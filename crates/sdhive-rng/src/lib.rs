//! Bit-exact reproduction of PyTorch's CPU random normal stream.
//!
//! This crate owns the one source of initial latents / ancestral noise that
//! must agree with `torch.randn(shape, generator=torch.Generator("cpu")
//! .manual_seed(seed), dtype=torch.float32)`, so that a seed typed into a
//! diffusers (or A1111 "CPU" RNG) workflow gives the same picture here.
//!
//! What torch does, and therefore what [`TorchGenerator::randn`] does:
//!
//! * The engine is a standard MT19937 seeded with the *low 32 bits* of the
//!   64-bit seed (`manual_seed(2**32 + 5)` draws exactly like `manual_seed(5)`),
//!   while `seed()` still reports the full value.
//! * For `numel >= 16` (contiguous float32) every element first receives a
//!   24-bit uniform `(u32 & 0xFF_FFFF) * 2^-24`, then each block of 16 is
//!   transformed by Box-Muller pairing element `j` with `j + 8`. A ragged tail
//!   is handled by drawing 16 *fresh* uniforms over the last 16 slots and
//!   transforming those, which overwrites part of the last full block.
//!   The arithmetic is single precision except the angle, which torch
//!   computes as `2.0 * pi` in double times the uniform and rounds to float.
//! * For `numel < 16` torch switches to a per-element double-precision
//!   Box-Muller on 53-bit uniforms built from two draws, and keeps the unused
//!   sine half in the generator. That cached value survives later calls (the
//!   bulk path neither reads nor clears it), so the stream state is
//!   `(engine, Option<f64>)`.
//!
//! * Which Box-Muller arithmetic torch used depends on the CPU it ran on;
//!   [`NormalKernel`] selects it (default: x86-64 with AVX2/AVX-512, the
//!   common case, reproduced with plain IEEE arithmetic so it is
//!   host-independent).
//!
//! The small-tensor path calls the host libm's double `log1p`/`sin`/`cos`
//! like torch does; on glibc hosts that is the very same code.

mod kernel;

pub use kernel::NormalKernel;

const MT_N: usize = 624;
const MT_M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UPPER_MASK: u32 = 0x8000_0000;
const LOWER_MASK: u32 = 0x7fff_ffff;

/// The classic 32-bit Mersenne Twister (identical output to `std::mt19937`).
#[derive(Clone)]
struct Mt19937 {
    state: Box<[u32; MT_N]>,
    index: usize,
}

impl Mt19937 {
    fn new(seed: u32) -> Self {
        let mut state = Box::new([0u32; MT_N]);
        state[0] = seed;
        for j in 1..MT_N {
            let prev = state[j - 1];
            state[j] = 1_812_433_253u32.wrapping_mul(prev ^ (prev >> 30)).wrapping_add(j as u32);
        }
        Self { state, index: MT_N }
    }

    fn twist(&mut self) {
        let s = &mut *self.state;
        for i in 0..MT_N {
            let y = (s[i] & UPPER_MASK) | (s[(i + 1) % MT_N] & LOWER_MASK);
            let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
            s[i] = s[(i + MT_M) % MT_N] ^ (y >> 1) ^ mag;
        }
        self.index = 0;
    }

    fn next_u32(&mut self) -> u32 {
        if self.index >= MT_N {
            self.twist();
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^= y >> 18;
        y
    }
}

/// A stream of normal samples equal to successive `torch.randn` calls on one
/// CPU `torch.Generator` seeded with [`TorchGenerator::new`]'s seed.
#[derive(Clone)]
pub struct TorchGenerator {
    seed: u64,
    kernel: NormalKernel,
    engine: Mt19937,
    /// Torch's `next_double_normal_sample`: the spare sine half of the
    /// small-tensor sampler, consumed by the next small-tensor draw.
    cached_normal: Option<f64>,
}

impl std::fmt::Debug for TorchGenerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchGenerator")
            .field("seed", &self.seed)
            .field("kernel", &self.kernel)
            .field("cached_normal", &self.cached_normal)
            .finish_non_exhaustive()
    }
}

impl TorchGenerator {
    /// Equivalent of `torch.Generator("cpu").manual_seed(seed)` as run on an
    /// x86-64 machine with AVX2 ([`NormalKernel::X86Simd`]).
    pub fn new(seed: u64) -> Self {
        Self::with_kernel(seed, NormalKernel::default())
    }

    /// Like [`new`](Self::new), reproducing the given torch CPU kernel.
    pub fn with_kernel(seed: u64, kernel: NormalKernel) -> Self {
        Self {
            seed,
            kernel,
            // Truncation is torch's own behaviour, not a shortcut.
            engine: Mt19937::new(seed as u32),
            cached_normal: None,
        }
    }

    /// The seed as given (all 64 bits, like `Generator.initial_seed()`).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The torch kernel this generator reproduces.
    pub fn kernel(&self) -> NormalKernel {
        self.kernel
    }

    /// Torch's `random()`: one raw 32-bit engine output.
    pub fn next_u32(&mut self) -> u32 {
        self.engine.next_u32()
    }

    /// Torch's `random64()`: the first draw forms the high word.
    pub fn next_u64(&mut self) -> u64 {
        let hi = self.engine.next_u32() as u64;
        let lo = self.engine.next_u32() as u64;
        (hi << 32) | lo
    }

    /// Equivalent of `torch.rand` element: a float in `[0, 1)` with 24 bits.
    fn uniform_f32(&mut self) -> f32 {
        (self.engine.next_u32() & 0x00ff_ffff) as f32 * (1.0 / 16_777_216.0)
    }

    /// A double in `[0, 1)` with 53 bits, as torch's double uniform.
    fn uniform_f64(&mut self) -> f64 {
        (self.next_u64() & ((1u64 << 53) - 1)) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `numel` float32 standard normals, exactly `torch.randn(numel)` (or any
    /// shape with that many elements) on this generator; repeated calls
    /// continue the stream like repeated torch calls do.
    pub fn randn(&mut self, numel: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; numel];
        self.randn_into(&mut out);
        out
    }

    /// [`randn`](Self::randn) into a caller-provided buffer (its length is the
    /// element count).
    pub fn randn_into(&mut self, out: &mut [f32]) {
        if out.len() >= 16 {
            self.fill_bulk(out);
        } else {
            for v in out.iter_mut() {
                *v = self.normal_f64() as f32;
            }
        }
    }

    fn fill_bulk(&mut self, out: &mut [f32]) {
        let n = out.len();
        for v in out.iter_mut() {
            *v = self.uniform_f32();
        }
        let kernel = self.kernel;
        for block in out.chunks_exact_mut(16) {
            kernel.box_muller_16(block);
        }
        if n % 16 != 0 {
            let tail = &mut out[n - 16..];
            for v in tail.iter_mut() {
                *v = self.uniform_f32();
            }
            kernel.box_muller_16(tail);
        }
    }

    /// Torch's `normal_distribution<double>` with its one-sample cache.
    fn normal_f64(&mut self) -> f64 {
        if let Some(v) = self.cached_normal.take() {
            // `v * std + mean` with std 1, mean 0: the `+ 0.0` turns -0 into +0
            // exactly like torch's arithmetic does.
            return v + 0.0;
        }
        let u1 = self.uniform_f64();
        let u2 = self.uniform_f64();
        let r = (-2.0 * (-u2).ln_1p()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u1;
        self.cached_normal = Some(r * theta.sin());
        r * theta.cos() + 0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mt19937_matches_reference_10000th_output() {
        // The C++ standard requires the 10000th output of a
        // default-constructed std::mt19937 (seed 5489) to be 4123659995.
        let mut mt = Mt19937::new(5489);
        let mut v = 0;
        for _ in 0..10_000 {
            v = mt.next_u32();
        }
        assert_eq!(v, 4_123_659_995);
    }
}
