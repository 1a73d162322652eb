//! A request's LoRAs as stable-diffusion.cpp takes them, and what it cannot take refused before it is called.
//!
//! sd.cpp is handed file paths and one multiplier per LoRA. It does not refuse what it does not understand: a
//! tensor it cannot place is logged and skipped, a file it cannot read is logged and dropped, and a module whose
//! update has the wrong size for the layer of the same name (an SDXL LoRA on SD1.5) fails a `GGML_ASSERT`, which
//! aborts the worker. So every file is read here first with `sdhive-lora`, which refuses pickles, DoRA and unknown
//! tensors with the candle engine's messages, and is checked against the model's family. Without the model's
//! weights at hand (sd.cpp keeps them), the family shows in widths the file alone reveals: the text context the
//! UNet's cross-attention `to_k`/`to_v` take (768 SD1, 1024 SD2, 2048 SDXL) and each text encoder's width.

use diffusion_rs_sys as sys;
use sdhive_engine::{EmbeddingUse, LoraUse, ValidationError};
use sdhive_lora::{LoraFile, LoraModule, Network};
use std::ffi::CString;

/// The widths a LoRA for one family has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Widths {
    /// Text context of the UNet's cross-attention (the encoders' widths together).
    context: usize,
    /// Hidden width of each text encoder, in `Network::TextEncoder` order.
    encoders: &'static [usize],
}

fn widths(family: &str) -> Option<Widths> {
    match family {
        "sd1" => Some(Widths { context: 768, encoders: &[768] }),
        "sd2" => Some(Widths { context: 1024, encoders: &[1024] }),
        "sdxl" => Some(Widths { context: 2048, encoders: &[768, 1280] }),
        _ => None,
    }
}

/// An SD3-family model's MMDiT, as its LoRAs must fit it: the hidden width and the block count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mmdit {
    pub hidden: usize,
    pub blocks: usize,
}

/// One LoRA checked for the model, as sd.cpp will be given it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CheckedLora {
    pub path: CString,
    pub multiplier: f32,
}

/// The request's LoRAs, each checked once: a job repeats the previous job's set more often than not, and reading
/// a LoRA of a few hundred MB again per job would cost more than the image.
#[derive(Debug, Default)]
pub(crate) struct LoraChecks {
    last: Option<(String, Vec<LoraUse>, Vec<CheckedLora>)>,
}

impl LoraChecks {
    /// The LoRAs to hand sd.cpp for `loras` on a model of `family`, or why they cannot be used.
    /// `mmdit`: an SD3-family model's transformer (its LoRAs are checked against it instead of UNet widths).
    pub fn check(
        &mut self,
        loras: &[LoraUse],
        family: &str,
        mmdit: Option<Mmdit>,
    ) -> Result<Vec<CheckedLora>, ValidationError> {
        if let Some((checked_for, uses, checked)) = &self.last {
            if checked_for == family && uses.as_slice() == loras {
                return Ok(checked.clone());
            }
        }
        let mut checked = Vec::with_capacity(loras.len());
        for lora in loras {
            if let Some(c) = check_one(lora, family, mmdit)? {
                checked.push(c);
            }
        }
        self.last = Some((family.to_string(), loras.to_vec(), checked.clone()));
        Ok(checked)
    }
}

fn invalid(lora: &LoraUse, message: impl std::fmt::Display) -> ValidationError {
    ValidationError { field: "loras", message: format!("LoRA `{}`: {message}", lora.name) }
}

/// `None` when the LoRA changes nothing at the weights asked (both 0), so sd.cpp need not merge it.
fn check_one(
    lora: &LoraUse,
    family: &str,
    mmdit: Option<Mmdit>,
) -> Result<Option<CheckedLora>, ValidationError> {
    let file = LoraFile::read(&lora.path).map_err(|e| invalid(lora, e))?;
    let sdcpp_path = match mmdit {
        Some(m) => crate::sd3::cache_root()
            .and_then(|cache| sd3_lora_for_sdcpp(&file, m, &cache))
            .map_err(|msg| invalid(lora, msg))?,
        None => {
            fits_family(&file, family).map_err(|m| invalid(lora, m))?;
            lora.path.clone()
        }
    };
    // sd.cpp reads a module's alpha from `.alpha` tensors only: a diffusers/PEFT file whose alpha is in its adapter
    // metadata would be applied at another strength, silently.
    if let Some(m) = file.modules.iter().find(|m| m.scale_from_metadata && m.scale() != 1.0) {
        return Err(invalid(
            lora,
            format!(
                "module {} takes its alpha from the file's adapter metadata (scale {}), which the \
                 stable-diffusion.cpp engine does not read: it would apply the LoRA at another strength",
                m.key,
                m.scale()
            ),
        ));
    }
    let has = |unet: bool| file.modules.iter().any(|m| (m.name.network() == Network::Unet) == unet);
    // sd.cpp scales every module of a LoRA by its one multiplier. A1111's separate te/unet weights can be
    // honoured only where the file has modules of one part, or both weights agree.
    let multiplier = match (has(false), has(true)) {
        (true, true) if lora.te != lora.unet => {
            return Err(invalid(
                lora,
                format!(
                    "it changes both the text encoder and the UNet, and the stable-diffusion.cpp engine takes one \
                     weight for both parts (asked: te {} and unet {}); give one weight, e.g. <lora:{}:{}>",
                    lora.te, lora.unet, lora.name, lora.unet
                ),
            ))
        }
        (true, false) => lora.te,
        _ => lora.unet,
    };
    if multiplier == 0.0 {
        return Ok(None);
    }
    let path = CString::new(sdcpp_path.to_string_lossy().into_owned())
        .map_err(|_| invalid(lora, "its path contains a NUL byte"))?;
    Ok(Some(CheckedLora { path, multiplier }))
}

/// Whether the file's widths are those of `family`'s networks; the message says which module shows otherwise.
fn fits_family(file: &LoraFile, family: &str) -> Result<(), String> {
    // A family this engine does not know has no widths to compare; sd.cpp's own loading decides.
    let Some(w) = widths(family) else { return Ok(()) };
    let misfit = |module: &LoraModule, why: String| {
        format!("{}: module {} does not fit this model ({family}): {why}", file.path.display(), module.key)
    };
    for module in &file.modules {
        let shape = file.natural_shape(module).map_err(|e| e.to_string())?;
        let (out, inp) = match shape.as_slice() {
            [out, inp, ..] => (*out, *inp),
            _ => continue,
        };
        match module.name.network() {
            Network::Unet => {
                if is_cross_attention_kv(module) && inp != w.context {
                    return Err(misfit(
                        module,
                        format!(
                            "it takes a text context {inp} wide, the model's is {} (768: SD1, 1024: SD2, 2048: \
                             SDXL)",
                            w.context
                        ),
                    ));
                }
            }
            Network::TextEncoder(i) => {
                let Some(&width) = w.encoders.get(i) else {
                    return Err(misfit(
                        module,
                        format!("it changes text encoder {}, and the model has {}", i + 1, w.encoders.len()),
                    ));
                };
                // Every linear layer of a CLIP block takes or gives the encoder's width (fc2 takes the MLP's).
                if out != width && inp != width {
                    return Err(misfit(
                        module,
                        format!(
                            "it is a {out}×{inp} update, and the model's text encoder {} is {width} wide",
                            i + 1
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// An SD3 LoRA for this MMDiT as sd.cpp reads it. Its kohya loader turns every `_` of a name into `.`, which
/// SAI's names (`joint_blocks`, `x_block`, `adaLN_modulation`) do not survive, so the file is checked, then written
/// once into the cache with the dotted SAI names sd.cpp maps (`diffusion_model.joint_blocks.0.x_block.attn.qkv.…`;
/// the same tensors) and that copy is what sd.cpp loads. Checked: every block named exists and every layer takes
/// the model's width (its MLP's second layer four times it). Refused naming the module: text-encoder and T5
/// modules (sd.cpp's SD3 mapping of them is unchecked; diffusers applies no T5 LoRA), diffusers/PEFT names
/// (`transformer.transformer_blocks.…`, unchecked on this engine), and names SAI's MMDiT has no layer for.
fn sd3_lora_for_sdcpp(
    file: &LoraFile,
    m: Mmdit,
    cache: &std::path::Path,
) -> Result<std::path::PathBuf, String> {
    let path = file.path.display();
    let misfit = |module: &LoraModule, why: String| {
        format!(
            "{path}: module {} does not fit this model (SD3, {} wide, {} blocks): {why}",
            module.key, m.hidden, m.blocks
        )
    };
    let mut renamed: Vec<(String, String)> = Vec::new();
    for module in &file.modules {
        let sai = match (&module.name, module.name.network()) {
            (_, Network::TextEncoder(i)) => {
                let what = if i >= 2 { "T5, which no SD3 LoRA loader applies (diffusers has none)" } else {
                    "a text encoder, which the stable-diffusion.cpp engine does not take from SD3 LoRAs (the candle \
                     engine does)"
                };
                return Err(misfit(module, format!("it changes {what}")));
            }
            (sdhive_lora::ModuleName::Kohya { name, .. }, Network::Unet) => kohya_sai_path(name)
                .ok_or_else(|| misfit(module, "SAI's MMDiT has no such layer".into()))?,
            (sdhive_lora::ModuleName::Diffusers { path: p, .. }, Network::Unet)
                if module.key.starts_with("diffusion_model.") || module.key.starts_with("model.diffusion_model.") =>
            {
                p.clone()
            }
            (sdhive_lora::ModuleName::Diffusers { .. }, Network::Unet) => {
                return Err(format!(
                    "{path}: module {} is in diffusers' (PEFT) names, which the stable-diffusion.cpp engine does not \
                     take for SD3 models; use a kohya/SAI-named file (`lora_unet_joint_blocks_…`) or a worker with \
                     the candle engine",
                    module.key
                ))
            }
        };
        let shape = file.natural_shape(module).map_err(|e| e.to_string())?;
        if let [out, inp, ..] = shape.as_slice() {
            let block =
                sai.strip_prefix("joint_blocks.").and_then(|r| r.split('.').next()?.parse::<usize>().ok());
            match block {
                Some(b) if b >= m.blocks => {
                    return Err(misfit(module, format!("block {b} does not exist (0 to {})", m.blocks - 1)))
                }
                Some(_) if *inp != m.hidden && *inp != 4 * m.hidden => {
                    return Err(misfit(
                        module,
                        format!("it takes {inp} features, the model's blocks {}", m.hidden),
                    ))
                }
                None if *out != m.hidden && *inp != m.hidden => {
                    return Err(misfit(
                        module,
                        format!("it is a {out}×{inp} update, the model is {} wide", m.hidden),
                    ))
                }
                _ => {}
            }
        }
        renamed.push((module.key.clone(), format!("diffusion_model.{sai}")));
    }
    write_renamed(&file.path, &renamed, cache)
}

/// SAI's dotted path of a kohya SD3 module name (`joint_blocks_0_x_block_attn_qkv` → `joint_blocks.0.x_block.attn.qkv`).
fn kohya_sai_path(name: &str) -> Option<String> {
    const LAYERS: [(&str, &str); 13] = [
        ("attn_qkv", "attn.qkv"),
        ("attn_proj", "attn.proj"),
        ("attn_ln_q", "attn.ln_q"),
        ("attn_ln_k", "attn.ln_k"),
        ("attn2_qkv", "attn2.qkv"),
        ("attn2_proj", "attn2.proj"),
        ("attn2_ln_q", "attn2.ln_q"),
        ("attn2_ln_k", "attn2.ln_k"),
        ("mlp_fc1", "mlp.fc1"),
        ("mlp_fc2", "mlp.fc2"),
        ("adaLN_modulation_1", "adaLN_modulation.1"),
        ("adaLN_modulation_0", "adaLN_modulation.0"),
        ("linear", "linear"),
    ];
    if let Some(rest) = name.strip_prefix("joint_blocks_") {
        let (block, rest) = rest.split_once('_')?;
        block.parse::<usize>().ok()?;
        let (stream, layer) = ["x_block_", "context_block_"]
            .iter()
            .find_map(|s| Some((&s[..s.len() - 1], rest.strip_prefix(s)?)))?;
        let (_, dotted) = LAYERS.iter().find(|(k, _)| *k == layer)?;
        return Some(format!("joint_blocks.{block}.{stream}.{dotted}"));
    }
    let outside = [
        ("context_embedder", "context_embedder"),
        ("x_embedder_proj", "x_embedder.proj"),
        ("t_embedder_mlp_0", "t_embedder.mlp.0"),
        ("t_embedder_mlp_2", "t_embedder.mlp.2"),
        ("y_embedder_mlp_0", "y_embedder.mlp.0"),
        ("y_embedder_mlp_2", "y_embedder.mlp.2"),
        ("final_layer_linear", "final_layer.linear"),
        ("final_layer_adaLN_modulation_1", "final_layer.adaLN_modulation.1"),
    ];
    outside.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
}

/// The LoRA at `src` with each module key renamed as `renamed` says (every tensor kept, bytes unchanged), written
/// once into the cache (`sdcpp/loras/<stem>-<key>.safetensors`, keyed by the file's path, size and modification
/// time).
fn write_renamed(
    src: &std::path::Path,
    renamed: &[(String, String)],
    cache: &std::path::Path,
) -> Result<std::path::PathBuf, String> {
    let fail = |e: String| format!("{}: {e}", src.display());
    let dir = cache.join("sdcpp").join("loras");
    let stem = src.file_stem().map_or_else(|| "lora".into(), |s| s.to_string_lossy().into_owned());
    let out = crate::sd3::cached_copy(src, &dir, &stem)?;
    if out.is_file() {
        return Ok(out);
    }
    let bytes = std::fs::read(src).map_err(|e| fail(e.to_string()))?;
    let tensors = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| fail(e.to_string()))?;
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let new = renamed
                .iter()
                .find_map(|(from, to)| {
                    name.strip_prefix(from.as_str())
                        .filter(|r| r.starts_with('.'))
                        .map(|r| format!("{to}{r}"))
                })
                .unwrap_or(name);
            (new, view)
        })
        .collect();
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let tmp = out.with_extension(format!("{}.tmp", std::process::id()));
    safetensors::serialize_to_file(views, None, &tmp)
        .map_err(|e| e.to_string())
        .and_then(|()| std::fs::rename(&tmp, &out).map_err(|e| e.to_string()))
        .map_err(|e| format!("cannot write {}: {e}", out.display()))?;
    Ok(out)
}

/// A UNet module on a cross-attention key or value projection, in kohya's or diffusers' spelling.
fn is_cross_attention_kv(module: &LoraModule) -> bool {
    let name = match &module.name {
        sdhive_lora::ModuleName::Kohya { name, .. } => name.clone(),
        sdhive_lora::ModuleName::Diffusers { path, .. } => path.replace('.', "_"),
    };
    name.ends_with("attn2_to_k") || name.ends_with("attn2_to_v")
}

/// sd.cpp's LoRA list for one call; borrows `checked`, which must outlive every use of the result.
pub(crate) fn sd_loras(checked: &[CheckedLora]) -> Vec<sys::sd_lora_t> {
    checked
        .iter()
        .map(|c| sys::sd_lora_t { is_high_noise: false, multiplier: c.multiplier, path: c.path.as_ptr() })
        .collect()
}

/// Textual inversion is refused: sd.cpp reads embeddings only when a model is loaded (`embedding_dir`), not per
/// request.
pub(crate) fn check_embeddings(embeddings: &[EmbeddingUse]) -> Result<(), ValidationError> {
    if embeddings.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = embeddings.iter().map(|e| e.name.as_str()).collect();
    Err(ValidationError {
        field: "embeddings",
        message: format!(
            "textual-inversion embeddings are not supported on the stable-diffusion.cpp engine (it takes them only \
             when a model is loaded); remove {} from the prompt, or use a worker with the candle engine",
            names.join(", ")
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    fn fixture(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(rel)
    }

    fn lora(file: &str, te: f32, unet: f32) -> LoraUse {
        LoraUse { name: "my_lora".into(), path: fixture(file), te, unet, hash: None }
    }

    /// Writes a kohya LoRA of rank 1 whose modules are `(name, out, in)`, all zeros.
    fn write_kohya(dir: &Path, modules: &[(&str, usize, usize)]) -> PathBuf {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        let mut put = |key: String, shape: Vec<usize>| {
            let start = data.len();
            data.resize(start + 4 * shape.iter().product::<usize>(), 0u8);
            header.insert(
                key,
                serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
            );
        };
        for (name, out, inp) in modules {
            put(format!("{name}.lora_up.weight"), vec![*out, 1]);
            put(format!("{name}.lora_down.weight"), vec![1, *inp]);
        }
        let mut json = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
        json.resize(json.len().next_multiple_of(8), b' ');
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&json);
        bytes.extend_from_slice(&data);
        let path = dir.join("made.safetensors");
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn made(modules: &[(&str, usize, usize)], te: f32, unet: f32) -> (tempfile::TempDir, LoraUse) {
        let dir = tempfile::tempdir().unwrap();
        let path = write_kohya(dir.path(), modules);
        (dir, LoraUse { name: "made".into(), path, te, unet, hash: None })
    }

    const SD1_K: &str = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k";
    const SDXL_K: &str = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_v";

    /// The PEFT fixture keeps alpha 8 for rank 4 in its adapter metadata, which sd.cpp would not apply.
    #[test]
    fn an_alpha_only_in_metadata_is_refused() {
        let mut checks = LoraChecks::default();
        let err =
            checks.check(&[lora("models/Lora/sd1_peft.safetensors", 1.0, 1.0)], "other", None).unwrap_err();
        assert_eq!(err.field, "loras");
        assert!(err.message.contains("adapter metadata") && err.message.contains("`my_lora`"), "{err:?}");
        // kohya files carry alpha as tensors, which sd.cpp reads.
        assert!(checks.check(&[lora("models/Lora/sd1_kohya.safetensors", 1.0, 1.0)], "other", None).is_ok());
    }

    #[test]
    fn a_lora_fits_its_own_family_only() {
        let mut checks = LoraChecks::default();
        let (_d, sd1) =
            made(&[(SD1_K, 320, 768), ("lora_te_text_model_encoder_layers_0_mlp_fc2", 768, 3072)], 1.0, 1.0);
        assert_eq!(checks.check(std::slice::from_ref(&sd1), "sd1", None).unwrap().len(), 1);
        for family in ["sd2", "sdxl"] {
            let err = checks.check(std::slice::from_ref(&sd1), family, None).unwrap_err();
            assert_eq!(err.field, "loras");
            assert!(
                err.message.contains("`made`") && err.message.contains("does not fit this model"),
                "{err:?}"
            );
            assert!(err.message.contains("768"), "{err:?}");
        }
        let (_d, xl) = made(
            &[(SDXL_K, 640, 2048), ("lora_te2_text_model_encoder_layers_0_self_attn_q_proj", 1280, 1280)],
            1.0,
            1.0,
        );
        assert_eq!(checks.check(std::slice::from_ref(&xl), "sdxl", None).unwrap().len(), 1);
        let err = checks.check(std::slice::from_ref(&xl), "sd1", None).unwrap_err();
        assert!(err.message.contains("does not fit this model"), "{err:?}");
        let (_d, xl_unet) = made(&[(SDXL_K, 640, 2048)], 1.0, 1.0);
        let err = checks.check(std::slice::from_ref(&xl_unet), "sd1", None).unwrap_err();
        assert!(err.message.contains("text context 2048 wide, the model's is 768"), "{err:?}");
        // A second text encoder is SDXL's alone, whatever its width.
        let (_d, te2) =
            made(&[("lora_te2_text_model_encoder_layers_0_self_attn_q_proj", 768, 768)], 1.0, 1.0);
        let err = checks.check(std::slice::from_ref(&te2), "sd1", None).unwrap_err();
        assert!(err.message.contains("text encoder 2"), "{err:?}");
        // SD2's text encoder is 1024 wide; an SD1 encoder module (768) is not.
        let (_d, te) = made(&[("lora_te_text_model_encoder_layers_0_self_attn_q_proj", 768, 768)], 1.0, 1.0);
        let err = checks.check(std::slice::from_ref(&te), "sd2", None).unwrap_err();
        assert!(err.message.contains("1024 wide"), "{err:?}");
    }

    #[test]
    fn committed_fixture_loras_are_told_apart_by_family() {
        // Made for the tiny test models: their widths are the tiny ones (neither SD1's nor SDXL's), so each is
        // refused by both families, and they are still refused across families for the same reason a real one is.
        let mut checks = LoraChecks::default();
        for file in ["models/Lora/sd1_kohya.safetensors", "models/Lora/sdxl_kohya.safetensors"] {
            for family in ["sd1", "sdxl"] {
                let err = checks.check(&[lora(file, 1.0, 1.0)], family, None).unwrap_err();
                assert_eq!(err.field, "loras");
                assert!(
                    err.message.contains("`my_lora`") && err.message.contains("does not fit this model"),
                    "{err:?}"
                );
            }
        }
    }

    #[test]
    fn one_weight_for_both_parts() {
        let mut checks = LoraChecks::default();
        let both = [(SD1_K, 320, 768), ("lora_te_text_model_encoder_layers_0_self_attn_q_proj", 768, 768)];
        let (_d, l) = made(&both, 0.5, 1.0);
        let err = checks.check(std::slice::from_ref(&l), "sd1", None).unwrap_err();
        assert_eq!(err.field, "loras");
        assert!(
            err.message.contains("`made`") && err.message.contains("one weight for both parts"),
            "{err:?}"
        );
        let (_d, l) = made(&both, 0.75, 0.75);
        let checked = checks.check(std::slice::from_ref(&l), "sd1", None).unwrap();
        assert_eq!(checked[0].multiplier, 0.75);
        assert_eq!(checked[0].path.to_str().unwrap(), l.path.to_str().unwrap());
        // With one part in the file, the other part's weight does not matter.
        let (_d, unet_only) = made(&[(SD1_K, 320, 768)], 0.0, 0.6);
        assert_eq!(checks.check(std::slice::from_ref(&unet_only), "sd1", None).unwrap()[0].multiplier, 0.6);
        let (_d, te_only) =
            made(&[("lora_te_text_model_encoder_layers_0_self_attn_q_proj", 768, 768)], 0.3, 1.0);
        assert_eq!(checks.check(std::slice::from_ref(&te_only), "sd1", None).unwrap()[0].multiplier, 0.3);
        // Both weights 0: nothing to merge.
        let (_d, off) = made(&both, 0.0, 0.0);
        assert!(checks.check(std::slice::from_ref(&off), "sd1", None).unwrap().is_empty());
    }

    #[test]
    fn unreadable_files_are_refused_with_sdhive_loras_messages() {
        let mut checks = LoraChecks::default();
        let dir = tempfile::tempdir().unwrap();
        let pickle = dir.path().join("old.pt");
        std::fs::write(&pickle, b"not read").unwrap();
        let use_ = |path: PathBuf| LoraUse { name: "old".into(), path, te: 1.0, unet: 1.0, hash: None };
        let err = checks.check(&[use_(pickle)], "sd1", None).unwrap_err();
        assert!(err.message.contains("`old`") && err.message.contains("pickle"), "{err:?}");
        let err = checks.check(&[use_(dir.path().join("missing.safetensors"))], "sd1", None).unwrap_err();
        assert!(err.message.contains("cannot read"), "{err:?}");
    }

    #[test]
    fn sd3_loras_fit_the_mmdit_they_are_for() {
        let cache = tempfile::tempdir().unwrap();
        let medium = Mmdit { hidden: 1536, blocks: 24 };
        let check = |l: &LoraUse| {
            let file = LoraFile::read(&l.path).map_err(|e| e.to_string())?;
            sd3_lora_for_sdcpp(&file, medium, cache.path())
        };
        let (_d1, fits) = made(
            &[
                ("lora_unet_joint_blocks_0_x_block_attn_qkv", 4608, 1536),
                ("lora_unet_joint_blocks_23_x_block_mlp_fc2", 1536, 6144),
                ("lora_unet_joint_blocks_2_context_block_adaLN_modulation_1", 9216, 1536),
                ("lora_unet_final_layer_linear", 64, 1536),
            ],
            1.0,
            1.0,
        );
        // The copy sd.cpp reads: the same tensors under SAI's dotted names, written once.
        let copy = check(&fits).unwrap();
        assert!(copy.starts_with(cache.path().join("sdcpp/loras")), "{}", copy.display());
        let (ours, theirs) = (std::fs::read(&copy).unwrap(), std::fs::read(&fits.path).unwrap());
        let (ours, theirs) = (
            safetensors::SafeTensors::deserialize(&ours).unwrap(),
            safetensors::SafeTensors::deserialize(&theirs).unwrap(),
        );
        let mut names: Vec<String> = ours.names().into_iter().map(str::to_string).collect();
        names.sort();
        assert!(
            names.contains(&"diffusion_model.joint_blocks.0.x_block.attn.qkv.lora_down.weight".to_string())
        );
        assert!(names.contains(
            &"diffusion_model.joint_blocks.2.context_block.adaLN_modulation.1.lora_up.weight".to_string()
        ));
        assert!(names.contains(&"diffusion_model.final_layer.linear.lora_up.weight".to_string()));
        assert_eq!(names.len(), theirs.len());
        let a = ours.tensor("diffusion_model.joint_blocks.23.x_block.mlp.fc2.lora_down.weight").unwrap();
        let b = theirs.tensor("lora_unet_joint_blocks_23_x_block_mlp_fc2.lora_down.weight").unwrap();
        assert_eq!((a.shape(), a.data()), (b.shape(), b.data()));
        assert_eq!(check(&fits).unwrap(), copy);
        // SD3.5-large's width, a block past the last, a text encoder, T5, an unknown layer: refused naming why.
        for (module, out, inp, why) in [
            ("lora_unet_joint_blocks_0_x_block_attn_qkv", 7296, 2432, "takes 2432 features"),
            ("lora_unet_joint_blocks_24_x_block_attn_proj", 1536, 1536, "block 24 does not exist"),
            ("lora_te1_text_model_encoder_layers_0_mlp_fc1", 3072, 768, "a text encoder"),
            ("lora_te3_encoder_block_0_layer_0_SelfAttention_q", 4096, 4096, "T5"),
            ("lora_unet_joint_blocks_0_x_block_attn_to_q", 1536, 1536, "no such layer"),
        ] {
            let (_d, l) = made(&[(module, out, inp)], 1.0, 1.0);
            let err = check(&l).unwrap_err();
            assert!(err.contains(why) && err.contains(module), "{module}: {err}");
        }
        // Unchecked on this engine: diffusers/PEFT names; and an SD1 LoRA does not fit.
        let (_d, peft) = made(&[("transformer.transformer_blocks.0.attn.to_q", 1536, 1536)], 1.0, 1.0);
        let err = check(&peft).unwrap_err();
        assert!(err.contains("diffusers' (PEFT) names"), "{err}");
        assert!(check(&lora("models/Lora/sd1_kohya.safetensors", 1.0, 1.0)).is_err());
        // Dotted SAI names are taken as they are.
        let (_d, dotted) = made(&[("lora_unet_joint_blocks_1_x_block_attn_proj", 1536, 1536)], 1.0, 1.0);
        let bytes = std::fs::read(&dotted.path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let renamed: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| {
                (
                    n.replace(
                        "lora_unet_joint_blocks_1_x_block_attn_proj",
                        "diffusion_model.joint_blocks.1.x_block.attn.proj",
                    ),
                    v,
                )
            })
            .collect();
        let dotted_path = cache.path().join("dotted.safetensors");
        safetensors::serialize_to_file(renamed, None, &dotted_path).unwrap();
        let l = LoraUse { path: dotted_path, ..dotted };
        assert!(check(&l).is_ok());
    }

    #[test]
    fn embeddings_are_refused_by_name() {
        assert!(check_embeddings(&[]).is_ok());
        let e = EmbeddingUse { name: "EasyNegative".into(), path: "x.safetensors".into(), hash: None };
        let err = check_embeddings(&[e]).unwrap_err();
        assert_eq!(err.field, "embeddings");
        assert!(err.message.contains("EasyNegative") && err.message.contains("not supported"), "{err:?}");
    }
}
