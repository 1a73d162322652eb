//! Host-side noise-schedule arithmetic: training betas / alphas_cumprod and
//! the numpy building blocks (`linspace`, `arange`, `interp`, Karras sigmas,
//! sigma→timestep) that diffusers' `set_timesteps` is written in.
//!
//! Each helper reproduces the precision and evaluation order of the torch or
//! numpy call it stands for, because a one-ulp difference in a sigma table
//! shows up in the latents at the 1e-6 level and compounds over steps:
//! torch tables are float32 (with torch's own quirks, e.g. `cumprod`
//! accumulating in double and `linspace` fusing multiply-adds), numpy tables
//! are float64.

use crate::config::{BetaSchedule, CommonConfig, TimestepSpacing};

/// `torch.linspace(start, end, n, dtype=torch.float32)` on CPU.
///
/// torch evaluates `start + step * i` for the first half and
/// `end - step * (n - 1 - i)` for the second half in float32, and its CPU
/// kernel is compiled with contraction into fused multiply-adds, so each
/// element is rounded once.
pub(crate) fn torch_linspace_f32(start: f32, end: f32, n: usize) -> Vec<f32> {
    if n == 0 {
        return Vec::new();
    }
    if n == 1 {
        return vec![start];
    }
    let step = (end - start) / (n - 1) as f32;
    let half = n / 2;
    (0..n)
        .map(
            |i| {
                if i < half {
                    step.mul_add(i as f32, start)
                } else {
                    (-step).mul_add((n - 1 - i) as f32, end)
                }
            },
        )
        .collect()
}

/// `torch.cumprod(x, 0)` for float32 on CPU, which accumulates in double.
pub(crate) fn torch_cumprod_f32(x: &[f32]) -> Vec<f32> {
    let mut acc = 1.0f64;
    x.iter()
        .map(|&v| {
            acc *= v as f64;
            acc as f32
        })
        .collect()
}

/// diffusers' `betas_for_alpha_bar` with the cosine transform.
fn betas_for_alpha_bar_cosine(n: usize) -> Vec<f32> {
    let alpha_bar = |t: f64| {
        let c = ((t + 0.008) / 1.008 * std::f64::consts::PI / 2.0).cos();
        c * c
    };
    (0..n)
        .map(|i| {
            let t1 = i as f64 / n as f64;
            let t2 = (i + 1) as f64 / n as f64;
            (1.0 - alpha_bar(t2) / alpha_bar(t1)).min(0.999) as f32
        })
        .collect()
}

/// diffusers' `rescale_zero_terminal_snr` (float32 torch arithmetic).
fn rescale_zero_terminal_snr(betas: &[f32]) -> Vec<f32> {
    let alphas: Vec<f32> = betas.iter().map(|b| 1.0 - b).collect();
    let cumprod = torch_cumprod_f32(&alphas);
    let mut sqrt: Vec<f32> = cumprod.iter().map(|a| a.sqrt()).collect();
    let (Some(&first), Some(&last)) = (sqrt.first(), sqrt.last()) else {
        return betas.to_vec();
    };
    for v in sqrt.iter_mut() {
        *v -= last;
    }
    let scale = first / (first - last);
    for v in sqrt.iter_mut() {
        *v *= scale;
    }
    let bar: Vec<f32> = sqrt.iter().map(|v| v * v).collect();
    let mut out = Vec::with_capacity(bar.len());
    out.push(1.0 - bar[0]);
    for w in bar.windows(2) {
        out.push(1.0 - w[1] / w[0]);
    }
    out
}

/// Training betas, float32 like diffusers' `self.betas`.
pub(crate) fn betas(c: &CommonConfig) -> Vec<f32> {
    let n = c.num_train_timesteps;
    let betas = if let Some(tb) = &c.trained_betas {
        tb.iter().map(|&b| b as f32).collect()
    } else {
        match c.beta_schedule {
            BetaSchedule::Linear => torch_linspace_f32(c.beta_start as f32, c.beta_end as f32, n),
            BetaSchedule::ScaledLinear => {
                torch_linspace_f32(c.beta_start.sqrt() as f32, c.beta_end.sqrt() as f32, n)
                    .into_iter()
                    .map(|b| b * b)
                    .collect()
            }
            BetaSchedule::SquaredcosCapV2 => betas_for_alpha_bar_cosine(n),
        }
    };
    if c.rescale_betas_zero_snr {
        rescale_zero_terminal_snr(&betas)
    } else {
        betas
    }
}

/// `alphas_cumprod` (float32) from the training betas.
pub(crate) fn alphas_cumprod(betas: &[f32]) -> Vec<f32> {
    let alphas: Vec<f32> = betas.iter().map(|b| 1.0 - b).collect();
    torch_cumprod_f32(&alphas)
}

/// `((1 - alphas_cumprod) / alphas_cumprod) ** 0.5` in float32.
pub(crate) fn train_sigmas(alphas_cumprod: &[f32]) -> Vec<f32> {
    alphas_cumprod.iter().map(|a| ((1.0 - a) / a).sqrt()).collect()
}

/// `np.linspace(start, stop, num, endpoint)` in float64.
pub(crate) fn np_linspace(start: f64, stop: f64, num: usize, endpoint: bool) -> Vec<f64> {
    let div = if endpoint { num.saturating_sub(1) } else { num };
    let delta = stop - start;
    let mut y: Vec<f64> = (0..num).map(|i| i as f64).collect();
    if div > 0 {
        let step = delta / div as f64;
        if step == 0.0 {
            for v in y.iter_mut() {
                *v = *v / div as f64 * delta;
            }
        } else {
            for v in y.iter_mut() {
                *v *= step;
            }
        }
    } else {
        for v in y.iter_mut() {
            *v *= delta;
        }
    }
    for v in y.iter_mut() {
        *v += start;
    }
    if endpoint && num > 1 {
        y[num - 1] = stop;
    }
    y
}

/// `np.arange(start, stop, step)` for float arguments: numpy stores `start`
/// and `start + step`, then fills `start + i * delta` with
/// `delta = (start + step) - start`.
pub(crate) fn np_arange(start: f64, stop: f64, step: f64) -> Vec<f64> {
    let len = ((stop - start) / step).ceil();
    if len.is_nan() || len <= 0.0 || len.is_infinite() {
        return Vec::new();
    }
    let len = len as usize;
    let delta = (start + step) - start;
    (0..len).map(|i| if i == 0 { start } else { start + i as f64 * delta }).collect()
}

/// `np.interp(x, np.arange(len(fp)), fp)` with float32 `fp`.
pub(crate) fn np_interp_index(x: f64, fp: &[f32]) -> f64 {
    let n = fp.len();
    if n == 0 {
        return f64::NAN;
    }
    let last = (n - 1) as f64;
    if x.is_nan() {
        return x;
    }
    if x <= 0.0 {
        return fp[0] as f64;
    }
    if x >= last {
        return fp[n - 1] as f64;
    }
    let j = x.floor() as usize;
    let xj = j as f64;
    if xj == x {
        return fp[j] as f64;
    }
    // xp steps are 1, so numpy's slope divides by exactly 1.0.
    let slope = (fp[j + 1] as f64 - fp[j] as f64) / 1.0;
    slope * (x - xj) + fp[j] as f64
}

/// k-diffusion's Karras schedule as diffusers' `_convert_to_karras`
/// computes it (float64 numpy).
pub(crate) fn karras_sigmas(sigma_min: f64, sigma_max: f64, n: usize) -> Vec<f64> {
    let rho = 7.0f64;
    let ramp = np_linspace(0.0, 1.0, n, true);
    let min_inv_rho = sigma_min.powf(1.0 / rho);
    let max_inv_rho = sigma_max.powf(1.0 / rho);
    let span = min_inv_rho - max_inv_rho;
    ramp.iter().map(|r| (max_inv_rho + r * span).powf(rho)).collect()
}

/// `np.log` of a float32 sigma table.
///
/// numpy's vectorised float32 log is not correctly rounded and its exact
/// output depends on the CPU's SIMD level; the correctly rounded value is
/// used here, which moves interpolated (unrounded) timesteps by < 1e-4.
pub(crate) fn log_sigmas(sigmas: &[f32]) -> Vec<f32> {
    sigmas.iter().map(|&s| (s as f64).ln() as f32).collect()
}

/// diffusers' `_sigma_to_t`: fractional training timestep of `sigma` by
/// linear interpolation in log-sigma.
pub(crate) fn sigma_to_t(sigma: f64, log_sigmas: &[f32]) -> f64 {
    let n = log_sigmas.len();
    if n < 2 {
        return 0.0;
    }
    let log_sigma = sigma.max(1e-10).ln();
    // numpy: cumsum(dists >= 0).argmax() -> index of the last non-negative
    // distance, 0 when there is none.
    let low_idx = log_sigmas.iter().rposition(|&ls| log_sigma - ls as f64 >= 0.0).unwrap_or(0).min(n - 2);
    let high_idx = low_idx + 1;
    let low = log_sigmas[low_idx];
    let high = log_sigmas[high_idx];
    let w = (low as f64 - log_sigma) / (low - high) as f64;
    let w = if w.is_nan() { w } else { w.clamp(0.0, 1.0) };
    (1.0 - w) * low_idx as f64 + w * high_idx as f64
}

/// Timestep layouts shared by DDIM-style (integer) schedulers, descending.
///
/// `linspace`: rounded `np.linspace(0, T-1, n)`; `leading`: multiples of
/// `T // n` plus `steps_offset`; `trailing`: rounded
/// `np.arange(T, 0, -T/n) - 1`.
pub(crate) fn int_timesteps(
    spacing: TimestepSpacing,
    num_train: usize,
    steps: usize,
    steps_offset: i64,
) -> Vec<i64> {
    match spacing {
        TimestepSpacing::Linspace => np_linspace(0.0, (num_train - 1) as f64, steps, true)
            .into_iter()
            .rev()
            .map(|v| v.round_ties_even() as i64)
            .collect(),
        TimestepSpacing::Leading => {
            let ratio = (num_train / steps) as i64;
            (0..steps as i64).rev().map(|i| i * ratio + steps_offset).collect()
        }
        TimestepSpacing::Trailing => {
            let ratio = num_train as f64 / steps as f64;
            np_arange(num_train as f64, 0.0, -ratio)
                .into_iter()
                .map(|v| v.round_ties_even() as i64 - 1)
                .collect()
        }
    }
}

/// The float32 timestep layouts of the Euler schedulers, descending.
pub(crate) fn float_timesteps(
    spacing: TimestepSpacing,
    num_train: usize,
    steps: usize,
    steps_offset: i64,
) -> Vec<f32> {
    match spacing {
        TimestepSpacing::Linspace => np_linspace(0.0, (num_train - 1) as f64, steps, true)
            .into_iter()
            .rev()
            .map(|v| v as f32)
            .collect(),
        TimestepSpacing::Leading => {
            let ratio = num_train / steps;
            (0..steps).rev().map(|i| (i * ratio) as f32 + steps_offset as f32).collect()
        }
        TimestepSpacing::Trailing => {
            let ratio = num_train as f64 / steps as f64;
            np_arange(num_train as f64, 0.0, -ratio)
                .into_iter()
                .map(|v| v.round_ties_even() as f32 - 1.0)
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linspace_matches_numpy_edge_cases() {
        assert_eq!(np_linspace(0.0, 999.0, 1, true), vec![0.0]);
        assert_eq!(np_linspace(0.0, 999.0, 3, true), vec![0.0, 499.5, 999.0]);
        assert_eq!(np_linspace(0.0, 10.0, 4, false), vec![0.0, 2.5, 5.0, 7.5]);
    }

    #[test]
    fn arange_lengths() {
        assert_eq!(np_arange(1000.0, 0.0, -250.0), vec![1000.0, 750.0, 500.0, 250.0]);
        assert_eq!(np_arange(1000.0, 0.0, -1000.0 / 7.0).len(), 7);
        assert!(np_arange(0.0, 10.0, -1.0).is_empty());
    }

    #[test]
    fn interp_hits_grid_points_exactly() {
        let fp = [1.0f32, 2.0, 4.0];
        assert_eq!(np_interp_index(1.0, &fp), 2.0);
        assert_eq!(np_interp_index(1.5, &fp), 3.0);
        assert_eq!(np_interp_index(2.0, &fp), 4.0);
        assert_eq!(np_interp_index(7.0, &fp), 4.0);
    }

    #[test]
    fn sigma_to_t_inverts_table() {
        let sig = [0.1f32, 0.2, 0.4, 0.8];
        let ls = log_sigmas(&sig);
        assert!((sigma_to_t(0.2, &ls) - 1.0).abs() < 1e-6);
        assert!((sigma_to_t(0.8, &ls) - 3.0).abs() < 1e-6);
        assert_eq!(sigma_to_t(0.01, &ls), 0.0);
        assert_eq!(sigma_to_t(10.0, &ls), 3.0);
    }
}
