//! `cargo xtask random-model`: writes the full-size SD1.5 with deterministic random weights that
//! `xtask/fixtures/gen_sd15_random.py` fed to diffusers for the committed golden image. Only the tensor list
//! (`tests/fixtures/sd15-random/manifest.json`) is committed; the 2 GB of f16 weights are regenerated from it,
//! bit for bit, with the generator described in that script.

use anyhow::{bail, ensure, Context, Result};
use half::f16;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The component folders and file names of the diffusers layout, which stable-diffusion.cpp also reads.
const FILES: [(&str, &str); 3] = [
    ("unet", "unet/diffusion_pytorch_model.safetensors"),
    ("vae", "vae/diffusion_pytorch_model.safetensors"),
    ("text_encoder", "text_encoder/model.safetensors"),
];

struct Entry {
    component: String,
    name: String,
    shape: Vec<usize>,
}

/// Writes the model into `out` (unless it already holds a complete copy made from the same manifest).
pub fn write(manifest: &Path, out: &Path) -> Result<()> {
    let text =
        std::fs::read_to_string(manifest).with_context(|| format!("cannot read {}", manifest.display()))?;
    let stamp = out.join("manifest.json");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(text.as_str()) {
        eprintln!("xtask: {} is up to date", out.display());
        return Ok(());
    }
    let entries = parse(&text).with_context(|| format!("bad manifest {}", manifest.display()))?;
    for (component, file) in FILES {
        let path = out.join(file);
        let parent = path.parent().context("component file has a folder")?;
        std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        let mut data: BTreeMap<String, (Vec<usize>, Vec<u8>)> = BTreeMap::new();
        for (k, e) in entries.iter().enumerate().filter(|(_, e)| e.component == component) {
            data.insert(e.name.clone(), (e.shape.clone(), fill(k as u64, &e.name, &e.shape)));
        }
        ensure!(!data.is_empty(), "manifest has no tensors for {component}");
        let views = data
            .iter()
            .map(|(name, (shape, bytes))| {
                Ok((name.clone(), TensorView::new(Dtype::F16, shape.clone(), bytes)?))
            })
            .collect::<Result<Vec<_>>>()?;
        safetensors::serialize_to_file(views, None, &path)
            .with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("xtask: wrote {} ({} tensors)", path.display(), data.len());
    }
    copy_small_files(manifest.parent().context("manifest has a folder")?, out)?;
    std::fs::write(&stamp, text).with_context(|| format!("cannot write {}", stamp.display()))?;
    Ok(())
}

/// `model_index.json` and the components' configs, committed next to the manifest.
fn copy_small_files(from: &Path, to: &Path) -> Result<()> {
    for rel in [
        "model_index.json",
        "unet/config.json",
        "vae/config.json",
        "text_encoder/config.json",
        "scheduler/scheduler_config.json",
    ] {
        let (src, dst) = (from.join(rel), to.join(rel));
        if let Some(parent) = dst.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        }
        std::fs::copy(&src, &dst)
            .with_context(|| format!("cannot copy {} to {}", src.display(), dst.display()))?;
    }
    Ok(())
}

/// The default place: outside the clone, reused between runs on one machine.
pub fn default_out() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    cache.join("sdhive").join("sd15-random")
}

fn parse(text: &str) -> Result<Vec<Entry>> {
    let v: Value = serde_json::from_str(text)?;
    ensure!(v["generator"] == "splitmix64-v1", "unknown generator {}", v["generator"]);
    let Some(tensors) = v["tensors"].as_array() else { bail!("no `tensors` list") };
    tensors
        .iter()
        .map(|t| {
            let field =
                |k: &str| t[k].as_str().map(str::to_string).with_context(|| format!("tensor without {k}"));
            let shape = t["shape"]
                .as_array()
                .context("tensor without shape")?
                .iter()
                .map(|d| d.as_u64().map(|d| d as usize).context("shape entries are integers"))
                .collect::<Result<Vec<_>>>()?;
            Ok(Entry { component: field("component")?, name: field("name")?, shape })
        })
        .collect()
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Tensor `k`'s values as little-endian f16 bytes; the same arithmetic, in f32, as the Python generator.
fn fill(k: u64, name: &str, shape: &[usize]) -> Vec<u8> {
    let n: usize = shape.iter().product();
    let (scale, offset) = if shape.len() >= 2 {
        let fan_in: usize = shape[1..].iter().product();
        ((3.0f64 / fan_in as f64).sqrt() as f32, 0.0f32)
    } else if name.ends_with(".weight") {
        (0.1, 1.0)
    } else {
        (0.02, 0.0)
    };
    let mut out = Vec::with_capacity(2 * n);
    for i in 0..n as u64 {
        let z = splitmix64((k << 40) + i);
        let v = (z >> 40) as f32 * f32::powi(2.0, -23) - 1.0;
        // Rounded multiply, then add, as numpy does it (Rust never fuses them either); 0 + x is exact.
        out.extend_from_slice(&f16::from_f32(offset + v * scale).to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_values() {
        // First outputs of splitmix64 seeded with 0 (the reference sequence of Vigna's splitmix64.c).
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(0x9E37_79B9_7F4A_7C15), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn fill_follows_the_documented_rules() {
        let w = fill(3, "down.weight", &[4, 3]);
        let b = fill(3, "norm.bias", &[12]);
        let g = fill(3, "norm.weight", &[12]);
        let val = |bytes: &[u8], i: usize| f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32();
        let bound = (3.0f32 / 3.0).sqrt();
        for i in 0..12 {
            assert!(val(&w, i).abs() <= bound);
            assert!(val(&b, i).abs() <= 0.02);
            assert!((val(&g, i) - 1.0).abs() <= 0.1);
            // Same counter, different rule: the underlying v is shared.
            assert!((val(&w, i) / bound - val(&b, i) / 0.02).abs() < 2e-3);
        }
    }
}
