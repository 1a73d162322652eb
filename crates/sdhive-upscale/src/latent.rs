//! A1111's latent upscalers: PyTorch's `F.interpolate(x, size, mode, antialias, align_corners=False)` on
//! `[C, H, W]` f32 latents, with PyTorch's CPU index and weight rules (source indices, clamping, the cubic
//! coefficients −0.75 and −0.5 of the antialiased filter, width before height), so results agree to float
//! rounding.

use sdhive_engine::LatentMode;

/// One output index's taps along one axis: source indices and their weights.
struct Taps {
    index: Vec<usize>,
    weight: Vec<f32>,
}

/// `input / output`, as PyTorch computes a scale when given an output size.
fn scale(input: usize, output: usize) -> f32 {
    input as f32 / output as f32
}

fn cubic1(x: f64, a: f64) -> f64 {
    ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
}

fn cubic2(x: f64, a: f64) -> f64 {
    ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
}

/// `guard_index_and_lambda`: the floor index (at most the last) and the fraction past it, within [0, 1].
fn guard(real: f32, input: usize) -> (i64, f32) {
    let index = (real.floor() as i64).min(input as i64 - 1);
    (index, (real - index as f32).clamp(0.0, 1.0))
}

fn clamp_index(i: i64, input: usize) -> usize {
    i.clamp(0, input as i64 - 1) as usize
}

fn taps_for(mode: LatentMode, input: usize, output: usize) -> Vec<Taps> {
    let s = scale(input, output);
    (0..output)
        .map(|o| match mode {
            LatentMode::Nearest => {
                let i = if output == input {
                    o
                } else if output == 2 * input {
                    o >> 1
                } else {
                    ((o as f32 * s).floor() as usize).min(input - 1)
                };
                Taps { index: vec![i], weight: vec![1.0] }
            }
            LatentMode::NearestExact => {
                let i = (((o as f32 + 0.5) * s).floor() as usize).min(input - 1);
                Taps { index: vec![i], weight: vec![1.0] }
            }
            LatentMode::Bilinear => {
                let real = (s * (o as f32 + 0.5) - 0.5).max(0.0);
                let (i, l) = guard(real, input);
                let i = i as usize;
                let next = if i + 1 < input { i + 1 } else { i };
                Taps { index: vec![i, next], weight: vec![1.0 - l, l] }
            }
            LatentMode::Bicubic => {
                let real = s * (o as f32 + 0.5) - 0.5;
                let (i, t) = guard(real, input);
                let (t, a) = (f64::from(t), -0.75);
                let weight = [cubic2(t + 1.0, a), cubic1(t, a), cubic1(1.0 - t, a), cubic2(2.0 - t, a)]
                    .map(|w| w as f32);
                let index = (0..4).map(|k| clamp_index(i - 1 + k, input)).collect();
                Taps { index, weight: weight.to_vec() }
            }
            LatentMode::BilinearAntialiased | LatentMode::BicubicAntialiased => {
                let bicubic = mode == LatentMode::BicubicAntialiased;
                let filter = |x: f64| {
                    let x = x.abs();
                    if bicubic {
                        if x < 1.0 {
                            cubic1(x, -0.5)
                        } else if x < 2.0 {
                            cubic2(x, -0.5)
                        } else {
                            0.0
                        }
                    } else if x < 1.0 {
                        1.0 - x
                    } else {
                        0.0
                    }
                };
                let s = f64::from(s);
                let interp = if bicubic { 4.0 } else { 2.0 };
                let (support, invscale) =
                    if s >= 1.0 { (interp * 0.5 * s, 1.0 / s) } else { (interp * 0.5, 1.0) };
                let center = s * (o as f64 + 0.5);
                // C++ casts truncate toward zero.
                let xmin = ((center - support + 0.5) as i64).max(0) as usize;
                let xmax = ((center + support + 0.5) as i64).min(input as i64) as usize;
                let raw: Vec<f64> =
                    (xmin..xmax).map(|j| filter((j as f64 - center + 0.5) * invscale)).collect();
                let total: f64 = raw.iter().sum();
                let weight =
                    raw.iter().map(|w| if total != 0.0 { (w / total) as f32 } else { *w as f32 }).collect();
                Taps { index: (xmin..xmax).collect(), weight }
            }
        })
        .collect()
}

/// Interpolates `[channels, height, width]` (row-major) to `[channels, out_h, out_w]`.
pub fn interpolate(
    data: &[f32],
    (channels, height, width): (usize, usize, usize),
    (out_h, out_w): (usize, usize),
    mode: LatentMode,
) -> Vec<f32> {
    assert_eq!(data.len(), channels * height * width, "latent data does not match its shape");
    if matches!(mode, LatentMode::Nearest | LatentMode::NearestExact) {
        let (rows, cols) = (taps_for(mode, height, out_h), taps_for(mode, width, out_w));
        let mut out = Vec::with_capacity(channels * out_h * out_w);
        for c in 0..channels {
            for r in &rows {
                for k in &cols {
                    out.push(data[(c * height + r.index[0]) * width + k.index[0]]);
                }
            }
        }
        return out;
    }
    if matches!(mode, LatentMode::BilinearAntialiased | LatentMode::BicubicAntialiased) {
        // PyTorch's separable kernel: the width pass, then the height pass, skipping an unchanged axis.
        let mut cur = data.to_vec();
        let mut w = width;
        if out_w != width {
            cur = pass_width(&cur, channels * height, w, &taps_for(mode, width, out_w));
            w = out_w;
        }
        if out_h != height {
            cur = pass_height(&cur, channels, height, w, &taps_for(mode, height, out_h));
        }
        return cur;
    }
    // Bilinear and bicubic: each output from its 2×2 / 4×4 neighbourhood, rows of taps combined first.
    let (rows, cols) = (taps_for(mode, height, out_h), taps_for(mode, width, out_w));
    let mut out = Vec::with_capacity(channels * out_h * out_w);
    for c in 0..channels {
        let plane = &data[c * height * width..(c + 1) * height * width];
        for r in &rows {
            for k in &cols {
                let mut acc = 0f32;
                for (&ri, &rw) in r.index.iter().zip(&r.weight) {
                    let row = &plane[ri * width..(ri + 1) * width];
                    let along: f32 = k.index.iter().zip(&k.weight).map(|(&ki, &kw)| row[ki] * kw).sum();
                    acc += along * rw;
                }
                out.push(acc);
            }
        }
    }
    out
}

fn pass_width(data: &[f32], rows: usize, width: usize, taps: &[Taps]) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * taps.len());
    for r in 0..rows {
        let row = &data[r * width..(r + 1) * width];
        for t in taps {
            out.push(t.index.iter().zip(&t.weight).map(|(&i, &w)| row[i] * w).sum());
        }
    }
    out
}

fn pass_height(data: &[f32], channels: usize, height: usize, width: usize, taps: &[Taps]) -> Vec<f32> {
    let mut out = Vec::with_capacity(channels * taps.len() * width);
    for c in 0..channels {
        let plane = &data[c * height * width..(c + 1) * height * width];
        for t in taps {
            for x in 0..width {
                out.push(t.index.iter().zip(&t.weight).map(|(&i, &w)| plane[i * width + x] * w).sum());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubling_with_nearest_repeats_each_value() {
        let data = [1.0, 2.0, 3.0, 4.0];
        let out = interpolate(&data, (1, 2, 2), (4, 4), LatentMode::Nearest);
        assert_eq!(&out[..8], &[1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0]);
    }

    #[test]
    fn every_mode_keeps_a_constant_and_the_output_shape() {
        let data = vec![0.5f32; 3 * 5 * 7];
        for (_, mode) in sdhive_engine::hires::LATENT_UPSCALERS {
            for out in [(10, 14), (11, 9), (3, 4)] {
                let r = interpolate(&data, (3, 5, 7), out, mode);
                assert_eq!(r.len(), 3 * out.0 * out.1, "{mode:?}");
                assert!(r.iter().all(|v| (v - 0.5).abs() < 1e-5), "{mode:?} {out:?}");
            }
        }
    }

    /// Every mode against PyTorch's `F.interpolate` on a random `[4, 7, 9]` at three sizes (up, odd, down), as
    /// `xtask/fixtures/gen_hires.py` recorded it.
    #[test]
    fn every_mode_matches_pytorch() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/golden/latent_upscale.safetensors");
        let golden =
            candle_core::safetensors::load(&path, &candle_core::Device::Cpu).expect("latent goldens");
        let host = |t: &candle_core::Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("f32");
        let input = host(&golden["input"]);
        let mut checked = 0;
        for (name, mode) in sdhive_engine::hires::LATENT_UPSCALERS {
            for (h, w) in [(14, 18), (11, 13), (5, 6)] {
                let want = host(&golden[&format!("{name}|{h}x{w}")]);
                let ours = interpolate(&input, (4, 7, 9), (h, w), mode);
                let diff = ours.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(diff < 1e-5, "{name} to {h}x{w}: max |diff| {diff}");
                checked += 1;
            }
        }
        assert_eq!(checked, 18);
    }

    #[test]
    fn bilinear_doubling_matches_hand_computed_values() {
        // torch.nn.functional.interpolate(torch.tensor([[[[0., 1.]]]]), size=(1, 4), mode="bilinear")
        let out = interpolate(&[0.0, 1.0], (1, 1, 2), (1, 4), LatentMode::Bilinear);
        assert_eq!(out, vec![0.0, 0.25, 0.75, 1.0]);
        // mode="bicubic" (PyTorch 2.15)
        let out = interpolate(&[0.0, 1.0], (1, 1, 2), (1, 4), LatentMode::Bicubic);
        let want = [-0.105_468_75_f32, 0.226_562_5, 0.773_437_5, 1.105_468_8];
        assert!(out.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6), "{out:?}");
    }
}
