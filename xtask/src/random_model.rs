//! `cargo xtask random-model`: writes a model of real architecture with deterministic random weights that a script of
//! `xtask/fixtures/` fed to diffusers for committed golden images: SD1.5 (`gen_sd15_random.py`,
//! `tests/fixtures/sd15-random/`) and SD3.5-medium without T5 (`gen_sd35m_random.py`, `tests/fixtures/sd35m-random/`).
//! Only the tensor list (`manifest.json`) and the small config files are committed; the f16 weights (2 GB each)
//! are regenerated from it, bit for bit, with the generator described in those scripts, in the diffusers layout.
//! Beside SD1.5 go the script's random kohya LoRA for that model ([`LORA_FILE`] in the model folder), made from
//! the manifest by the same generator, and its standalone VAE file in A1111's layout ([`VAE_FILE`], from
//! `vae_manifest.json` beside the manifest): the model's VAE under its original names, filled again with other
//! generator keys.

use anyhow::{bail, ensure, Context, Result};
use half::f16;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A component's weights file in the diffusers layout (transformers' models are `model.safetensors`).
fn component_file(component: &str) -> String {
    if component.starts_with("text_encoder") {
        format!("{component}/model.safetensors")
    } else {
        format!("{component}/diffusion_pytorch_model.safetensors")
    }
}

/// The random LoRA, inside the model folder (a `--lora-dir` of its own: `<lora:sd15_random_lora:…>`).
pub const LORA_FILE: &str = "Lora/sd15_random_lora.safetensors";
const LORA_RANK: usize = 4;
const LORA_ALPHA: f32 = 2.0;
/// Generator keys of the LoRA's tensors start here, far past the model's.
const LORA_BASE: u64 = 1 << 20;

/// The standalone VAE, inside the model folder (its tensors listed in `vae_manifest.json` beside the manifest),
/// unless that list names another file (`"file"`, as the SD3.5-medium's does).
pub const VAE_FILE: &str = "VAE/sd15_random_vae.safetensors";
/// Generator keys of the VAE file's tensors start here, past the LoRA's.
const VAE_BASE: u64 = 1 << 21;

struct Entry {
    component: String,
    name: String,
    shape: Vec<usize>,
    /// `"identity"`: a square identity matrix instead of generator values (the SD3.5 manifest's CLIP-L
    /// projection; see gen_sd35m_random.py).
    identity: bool,
}

/// Writes the model into `out` (unless it already holds a complete copy made from the same manifest), and for
/// SD1.5 (a `vae_manifest.json` beside the manifest) the LoRA (2 MB: always, so a folder written before the LoRA
/// existed gains it) and the standalone VAE.
pub fn write(manifest: &Path, out: &Path) -> Result<()> {
    let text =
        std::fs::read_to_string(manifest).with_context(|| format!("cannot read {}", manifest.display()))?;
    let entries = parse(&text).with_context(|| format!("bad manifest {}", manifest.display()))?;
    let vae_manifest = manifest.with_file_name("vae_manifest.json");
    if vae_manifest.is_file() {
        if entries.iter().any(|e| e.component == "unet") {
            write_lora(&entries, &out.join(LORA_FILE))?;
        }
        write_vae(&vae_manifest, out)?;
    }
    let stamp = out.join("manifest.json");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(text.as_str()) {
        eprintln!("xtask: {} is up to date", out.display());
        return Ok(());
    }
    let mut components: Vec<&str> = entries.iter().map(|e| e.component.as_str()).collect();
    components.dedup();
    for component in components {
        let path = out.join(component_file(component));
        let parent = path.parent().context("component file has a folder")?;
        std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        let mut data: BTreeMap<String, (Vec<usize>, Vec<u8>)> = BTreeMap::new();
        for (k, e) in entries.iter().enumerate().filter(|(_, e)| e.component == component) {
            let bytes = if e.identity { identity(&e.shape)? } else { fill(k as u64, &e.name, &e.shape) };
            data.insert(e.name.clone(), (e.shape.clone(), bytes));
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

/// The LoRA's modules: `(kohya module name, out, in)` per chosen manifest weight, in manifest order (the
/// script's `lora_tensors`).
fn lora_modules(entries: &[Entry]) -> Vec<(String, usize, usize)> {
    const UNET: [&str; 8] = [
        "attn1.to_q.weight",
        "attn1.to_k.weight",
        "attn1.to_v.weight",
        "attn1.to_out.0.weight",
        "attn2.to_q.weight",
        "attn2.to_k.weight",
        "attn2.to_v.weight",
        "attn2.to_out.0.weight",
    ];
    const TE: [&str; 6] = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.out_proj.weight",
        "mlp.fc1.weight",
        "mlp.fc2.weight",
    ];
    const TE_LAYERS: [&str; 3] =
        ["text_model.encoder.layers.0.", "text_model.encoder.layers.1.", "text_model.encoder.layers.2."];
    entries
        .iter()
        .filter_map(|e| {
            let prefix = if e.component == "unet" && UNET.iter().any(|s| e.name.ends_with(s)) {
                "lora_unet_"
            } else if e.component == "text_encoder"
                && TE_LAYERS.iter().any(|p| e.name.starts_with(p))
                && TE.iter().any(|s| e.name.ends_with(s))
            {
                "lora_te_"
            } else {
                return None;
            };
            let [out, inp] = e.shape[..] else { return None };
            let path = e.name.strip_suffix(".weight")?;
            Some((format!("{prefix}{}", path.replace('.', "_")), out, inp))
        })
        .collect()
}

fn write_lora(entries: &[Entry], path: &Path) -> Result<()> {
    let modules = lora_modules(entries);
    ensure!(!modules.is_empty(), "the manifest has none of the LoRA's layers");
    let alpha = f16::from_f32(LORA_ALPHA).to_le_bytes().to_vec();
    let mut data: BTreeMap<String, (Vec<usize>, Vec<u8>)> = BTreeMap::new();
    for (j, (module, out, inp)) in modules.iter().enumerate() {
        let (down, up) = (vec![LORA_RANK, *inp], vec![*out, LORA_RANK]);
        let k = LORA_BASE + 2 * j as u64;
        data.insert(format!("{module}.lora_down.weight"), (down.clone(), fill(k, "lora_down.weight", &down)));
        data.insert(format!("{module}.lora_up.weight"), (up.clone(), fill(k + 1, "lora_up.weight", &up)));
        data.insert(format!("{module}.alpha"), (Vec::new(), alpha.clone()));
    }
    let views = data
        .iter()
        .map(|(name, (shape, bytes))| Ok((name.clone(), TensorView::new(Dtype::F16, shape.clone(), bytes)?)))
        .collect::<Result<Vec<_>>>()?;
    let parent = path.parent().context("the LoRA has a folder")?;
    std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    safetensors::serialize_to_file(views, None, path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("xtask: wrote {} ({} modules)", path.display(), modules.len());
    Ok(())
}

/// The standalone VAE file (160 MB) into `out`, unless the one there was written from the same list (kept beside
/// it as a dot file, which no model library lists).
fn write_vae(manifest: &Path, out: &Path) -> Result<()> {
    let text =
        std::fs::read_to_string(manifest).with_context(|| format!("cannot read {}", manifest.display()))?;
    let v: Value = serde_json::from_str(&text)?;
    let path = out.join(v["file"].as_str().unwrap_or(VAE_FILE));
    let name = path.file_stem().context("the VAE file has a name")?.to_string_lossy();
    let stamp = path.with_file_name(format!(".{name}.manifest.json"));
    let path = path.as_path();
    if path.is_file() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(text.as_str()) {
        return Ok(());
    }
    ensure!(v["base"].as_u64() == Some(VAE_BASE), "{}: generator base is not {VAE_BASE}", manifest.display());
    let entries = parse(&text).with_context(|| format!("bad manifest {}", manifest.display()))?;
    ensure!(!entries.is_empty(), "{} lists no tensors", manifest.display());
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = entries
        .iter()
        .enumerate()
        .map(|(j, e)| (e.name.clone(), e.shape.clone(), fill(VAE_BASE + j as u64, &e.name, &e.shape)))
        .collect();
    let views = data
        .iter()
        .map(|(name, shape, bytes)| Ok((name.clone(), TensorView::new(Dtype::F16, shape.clone(), bytes)?)))
        .collect::<Result<Vec<_>>>()?;
    let parent = path.parent().context("the VAE has a folder")?;
    std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    safetensors::serialize_to_file(views, None, path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::write(&stamp, text).with_context(|| format!("cannot write {}", stamp.display()))?;
    eprintln!("xtask: wrote {} ({} tensors)", path.display(), entries.len());
    Ok(())
}

/// `model_index.json` and the components' configs (`*/*config.json`), committed next to the manifest.
fn copy_small_files(from: &Path, to: &Path) -> Result<()> {
    let mut files = vec![PathBuf::from("model_index.json")];
    for dir in std::fs::read_dir(from).with_context(|| format!("cannot list {}", from.display()))? {
        let dir = dir?.path();
        if !dir.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(&dir).with_context(|| format!("cannot list {}", dir.display()))? {
            let file = file?.path();
            if file.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.ends_with("config.json")) {
                files.push(file.strip_prefix(from)?.to_path_buf());
            }
        }
    }
    for rel in files {
        let (src, dst) = (from.join(&rel), to.join(&rel));
        if let Some(parent) = dst.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        }
        std::fs::copy(&src, &dst)
            .with_context(|| format!("cannot copy {} to {}", src.display(), dst.display()))?;
    }
    Ok(())
}

/// The default place for the model of `manifest` (its folder's name, e.g. `sd15-random`): outside the clone,
/// reused between runs on one machine.
pub fn default_out(manifest: &Path) -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    let name = manifest.parent().and_then(Path::file_name).unwrap_or("random-model".as_ref());
    cache.join("sdhive").join(name)
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
            let identity = match t["fill"].as_str() {
                None => false,
                Some("identity") => true,
                Some(other) => bail!("unknown fill rule {other}"),
            };
            Ok(Entry { component: field("component")?, name: field("name")?, shape, identity })
        })
        .collect()
}

/// A square identity matrix as little-endian f16 bytes.
fn identity(shape: &[usize]) -> Result<Vec<u8>> {
    let &[n, m] = shape else { bail!("an identity fill needs a matrix, not shape {shape:?}") };
    ensure!(n == m, "an identity fill needs a square matrix, not {n}×{m}");
    let mut out = vec![0u8; 2 * n * n];
    for i in 0..n {
        out[2 * (i * n + i)..2 * (i * n + i) + 2].copy_from_slice(&f16::ONE.to_le_bytes());
    }
    Ok(out)
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
    // SD3's position table: v itself, so positions differ at the scale of the patch embeddings.
    let (scale, offset) = if name.ends_with("pos_embed") {
        (1.0, 0.0)
    } else if shape.len() >= 2 {
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
    fn lora_modules_are_the_attention_projections_and_the_first_text_layers() {
        let e = |component: &str, name: &str, shape: &[usize]| Entry {
            component: component.into(),
            name: name.into(),
            shape: shape.to_vec(),
            identity: false,
        };
        let entries = [
            e("unet", "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight", &[320, 768]),
            e("unet", "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0.weight", &[320, 320]),
            e("unet", "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0.bias", &[320]),
            e("unet", "down_blocks.0.attentions.0.proj_in.weight", &[320, 320, 1, 1]),
            e("text_encoder", "text_model.encoder.layers.2.mlp.fc2.weight", &[768, 3072]),
            e("text_encoder", "text_model.encoder.layers.3.mlp.fc2.weight", &[768, 3072]),
            e("vae", "decoder.mid_block.attentions.0.to_q.weight", &[512, 512]),
        ];
        assert_eq!(
            lora_modules(&entries),
            [
                (
                    "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k".to_string(),
                    320,
                    768
                ),
                (
                    "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_out_0".to_string(),
                    320,
                    320
                ),
                ("lora_te_text_model_encoder_layers_2_mlp_fc2".to_string(), 768, 3072),
            ]
        );
    }

    #[test]
    fn identity_fills_are_square_identities() {
        let id = identity(&[3, 3]).unwrap();
        let val = |i: usize| f16::from_le_bytes([id[2 * i], id[2 * i + 1]]).to_f32();
        let values: Vec<f32> = (0..9).map(val).collect();
        assert_eq!(values, [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]);
        assert!(identity(&[2, 3]).is_err() && identity(&[4]).is_err());
        let parsed = parse(r#"{"generator":"splitmix64-v1","tensors":[{"component":"c","name":"p","shape":[2,2],"fill":"identity"}]}"#)
            .unwrap();
        assert!(parsed[0].identity);
        assert!(parse(r#"{"generator":"splitmix64-v1","tensors":[{"component":"c","name":"p","shape":[2,2],"fill":"zeros"}]}"#)
            .is_err());
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
