//! The ESRGAN upscaler timed (`--upscale-bench`): a full-size RRDBNet ×4 (64 features, 23 blocks, 32 growth
//! channels, Real-ESRGAN's key names) with deterministic random f16 weights, written once to a `.safetensors` file
//! that `xtask/bench/bench_esrgan_spandrel.py` loads too, run on an `--upscale-size`² image (the same on both sides:
//! [`pixel`]) untiled. Timed: the network alone (`UpscaleModel::forward` on the device input, as spandrel's
//! `model(x)`), warm-up calls first, each call between two device synchronisations, the median reported; and the
//! whole image path (upload, network, clamp and rounding, download) for reference. Prints one JSON object.

use crate::{sync, timed, Call, Timing};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use sdhive_engine::RgbImage;
use sdhive_upscale::{Tile, UpscaleModel};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

const NF: usize = 64;
const NB: usize = 23;
const GC: usize = 32;

/// The benchmark image's byte at `(x, y)`, channel `c` (RGB): a pattern both benchmark scripts compute.
pub(crate) fn pixel(x: usize, y: usize, c: usize) -> u8 {
    ((x * 7 + y * 13 + c * 71 + (x * y) % 31 * 5) % 256) as u8
}

/// splitmix64: the weights' generator (any fixed sequence would do; both sides read the file).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn signed(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// The convolutions of the network: name, output and input channels.
fn convs() -> Vec<(String, usize, usize)> {
    let mut out = vec![("conv_first".to_string(), NF, 3)];
    for b in 0..NB {
        for k in 1..=3 {
            for j in 1..=5 {
                let o = if j == 5 { NF } else { GC };
                out.push((format!("body.{b}.rdb{k}.conv{j}"), o, NF + (j - 1) * GC));
            }
        }
    }
    for name in ["conv_body", "conv_up1", "conv_up2", "conv_hr"] {
        out.push((name.to_string(), NF, NF));
    }
    out.push(("conv_last".to_string(), 3, NF));
    out
}

/// Writes the random network to `path`: uniform weights of BasicSR's scale (Kaiming ·0.1 in the dense blocks, so
/// activations stay moderate through 23 blocks), small biases, the last convolution scaled down and its bias 0.5 so
/// the image lands mid-range.
fn write_model(path: &Path) -> Result<()> {
    let mut rng = SplitMix(0x5D_E5_A6);
    let mut header = serde_json::Map::new();
    let mut data: Vec<u8> = Vec::new();
    for (name, k, c) in convs() {
        let fan_in = (c * 9) as f32;
        // The last convolution's gain keeps the image mostly inside [0, 1] (out_std ≈ 0.2 on the bench image).
        let gain = match name.as_str() {
            n if n.starts_with("body.") => 0.1,
            "conv_last" => 0.003,
            _ => 1.0,
        };
        // Uniform on [-a, a] has std a/√3: a = √3·√(2/fan_in)·gain.
        let a = (6.0 / fan_in).sqrt() * gain;
        let weight: Vec<f32> = (0..k * c * 9).map(|_| rng.signed() * a).collect();
        let bias: Vec<f32> =
            (0..k).map(|_| if name == "conv_last" { 0.5 } else { rng.signed() * 0.01 }).collect();
        for (suffix, values, shape) in [("weight", weight, vec![k, c, 3, 3]), ("bias", bias, vec![k])] {
            let start = data.len();
            data.extend(values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()));
            header.insert(
                format!("{name}.{suffix}"),
                json!({"dtype": "F16", "shape": shape, "data_offsets": [start, data.len()]}),
            );
        }
    }
    let json = serde_json::to_vec(&header)?;
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend(json);
    bytes.extend(data);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

pub(crate) fn run(
    model_path: Option<&Path>,
    size: u32,
    dev: &Device,
    dtype: DType,
    warmup: usize,
    iters: usize,
) -> Result<Value> {
    let path = model_path.map(Path::to_path_buf).unwrap_or_else(|| {
        std::env::temp_dir().join(format!("sdhive_bench_esrgan_x4_{NF}nf_{NB}nb.safetensors"))
    });
    if !path.exists() {
        eprintln!("writing the random RRDBNet x4 to {}", path.display());
        write_model(&path)?;
    }
    let model =
        UpscaleModel::load(&path, dev, dtype).with_context(|| format!("loading {}", path.display()))?;
    eprintln!("{} on {dev:?} {dtype:?}", model.description());
    let side = size as usize;
    let data = (0..side * side * 3).map(|i| pixel(i / 3 % side, i / 3 / side, i % 3)).collect();
    let img = RgbImage { width: size, height: size, data };
    let x = model.input(&img)?;
    let network = || -> Result<Tensor> { Ok(model.forward(&x)?) };
    let out = network()?;
    sync(dev)?;
    for _ in 1..warmup.max(1) {
        network()?;
    }
    let mut calls = Vec::with_capacity(iters);
    for i in 0..iters {
        let c = timed(dev, || network().map(drop))?;
        eprintln!("network {i}: {:.2} ms", c.ms);
        calls.push(c);
    }
    let image_calls: Vec<Call> = (0..iters.min(3))
        .map(|_| timed(dev, || model.upscale(&img, Tile::NONE).map(drop).map_err(Into::into)))
        .collect::<Result<_>>()?;
    let stats = out.to_dtype(DType::F32)?.flatten_all()?;
    let mean = stats.mean_all()?.to_scalar::<f32>()?;
    let std = stats.broadcast_sub(&stats.mean_all()?)?.sqr()?.mean_all()?.sqrt()?.to_scalar::<f32>()?;
    let memory = match shared_worker::memory(&shared_worker::DeviceHandle::Candle(dev.clone())) {
        (Some(total), Some(free)) => Some(total.saturating_sub(free)),
        _ => None,
    };
    Ok(json!({
        "model": model.description(),
        "model_file": PathBuf::from(&path),
        "size": size,
        "output": out.dims(),
        "network": Timing::new(&calls),
        "image": Timing::new(&image_calls),
        "out_mean": mean,
        "out_std": std,
        "device_used_bytes": memory,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The written file is the architecture the upscaler crate recognises, full size.
    #[test]
    fn writes_a_full_size_rrdbnet() {
        let dir = std::env::temp_dir().join(format!("sdhive-bench-esrgan-{}", std::process::id()));
        let path = dir.join("x4.safetensors");
        write_model(&path).expect("write");
        let info = UpscaleModel::inspect(&path).expect("inspect");
        assert_eq!((info.arch, info.scale), (sdhive_upscale::Arch::Esrgan, 4));
        assert_eq!(std::fs::metadata(&path).expect("size").len() / 1_000_000, 33);
        std::fs::remove_dir_all(dir).expect("cleanup");
        assert_eq!(pixel(3, 5, 2), ((21 + 65 + 142 + 15 * 5) % 256) as u8);
    }
}
