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
    pub fn check(&mut self, loras: &[LoraUse], family: &str) -> Result<Vec<CheckedLora>, ValidationError> {
        if let Some((checked_for, uses, checked)) = &self.last {
            if checked_for == family && uses.as_slice() == loras {
                return Ok(checked.clone());
            }
        }
        let mut checked = Vec::with_capacity(loras.len());
        for lora in loras {
            if let Some(c) = check_one(lora, family)? {
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
fn check_one(lora: &LoraUse, family: &str) -> Result<Option<CheckedLora>, ValidationError> {
    let file = LoraFile::read(&lora.path).map_err(|e| invalid(lora, e))?;
    fits_family(&file, family).map_err(|m| invalid(lora, m))?;
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
    let path = CString::new(lora.path.to_string_lossy().into_owned())
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
        let err = checks.check(&[lora("models/Lora/sd1_peft.safetensors", 1.0, 1.0)], "other").unwrap_err();
        assert_eq!(err.field, "loras");
        assert!(err.message.contains("adapter metadata") && err.message.contains("`my_lora`"), "{err:?}");
        // kohya files carry alpha as tensors, which sd.cpp reads.
        assert!(checks.check(&[lora("models/Lora/sd1_kohya.safetensors", 1.0, 1.0)], "other").is_ok());
    }

    #[test]
    fn a_lora_fits_its_own_family_only() {
        let mut checks = LoraChecks::default();
        let (_d, sd1) =
            made(&[(SD1_K, 320, 768), ("lora_te_text_model_encoder_layers_0_mlp_fc2", 768, 3072)], 1.0, 1.0);
        assert_eq!(checks.check(std::slice::from_ref(&sd1), "sd1").unwrap().len(), 1);
        for family in ["sd2", "sdxl"] {
            let err = checks.check(std::slice::from_ref(&sd1), family).unwrap_err();
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
        assert_eq!(checks.check(std::slice::from_ref(&xl), "sdxl").unwrap().len(), 1);
        let err = checks.check(std::slice::from_ref(&xl), "sd1").unwrap_err();
        assert!(err.message.contains("does not fit this model"), "{err:?}");
        let (_d, xl_unet) = made(&[(SDXL_K, 640, 2048)], 1.0, 1.0);
        let err = checks.check(std::slice::from_ref(&xl_unet), "sd1").unwrap_err();
        assert!(err.message.contains("text context 2048 wide, the model's is 768"), "{err:?}");
        // A second text encoder is SDXL's alone, whatever its width.
        let (_d, te2) =
            made(&[("lora_te2_text_model_encoder_layers_0_self_attn_q_proj", 768, 768)], 1.0, 1.0);
        let err = checks.check(std::slice::from_ref(&te2), "sd1").unwrap_err();
        assert!(err.message.contains("text encoder 2"), "{err:?}");
        // SD2's text encoder is 1024 wide; an SD1 encoder module (768) is not.
        let (_d, te) = made(&[("lora_te_text_model_encoder_layers_0_self_attn_q_proj", 768, 768)], 1.0, 1.0);
        let err = checks.check(std::slice::from_ref(&te), "sd2").unwrap_err();
        assert!(err.message.contains("1024 wide"), "{err:?}");
    }

    #[test]
    fn committed_fixture_loras_are_told_apart_by_family() {
        // Made for the tiny test models: their widths are the tiny ones (neither SD1's nor SDXL's), so each is
        // refused by both families, and they are still refused across families for the same reason a real one is.
        let mut checks = LoraChecks::default();
        for file in ["models/Lora/sd1_kohya.safetensors", "models/Lora/sdxl_kohya.safetensors"] {
            for family in ["sd1", "sdxl"] {
                let err = checks.check(&[lora(file, 1.0, 1.0)], family).unwrap_err();
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
        let err = checks.check(std::slice::from_ref(&l), "sd1").unwrap_err();
        assert_eq!(err.field, "loras");
        assert!(
            err.message.contains("`made`") && err.message.contains("one weight for both parts"),
            "{err:?}"
        );
        let (_d, l) = made(&both, 0.75, 0.75);
        let checked = checks.check(std::slice::from_ref(&l), "sd1").unwrap();
        assert_eq!(checked[0].multiplier, 0.75);
        assert_eq!(checked[0].path.to_str().unwrap(), l.path.to_str().unwrap());
        // With one part in the file, the other part's weight does not matter.
        let (_d, unet_only) = made(&[(SD1_K, 320, 768)], 0.0, 0.6);
        assert_eq!(checks.check(std::slice::from_ref(&unet_only), "sd1").unwrap()[0].multiplier, 0.6);
        let (_d, te_only) =
            made(&[("lora_te_text_model_encoder_layers_0_self_attn_q_proj", 768, 768)], 0.3, 1.0);
        assert_eq!(checks.check(std::slice::from_ref(&te_only), "sd1").unwrap()[0].multiplier, 0.3);
        // Both weights 0: nothing to merge.
        let (_d, off) = made(&both, 0.0, 0.0);
        assert!(checks.check(std::slice::from_ref(&off), "sd1").unwrap().is_empty());
    }

    #[test]
    fn unreadable_files_are_refused_with_sdhive_loras_messages() {
        let mut checks = LoraChecks::default();
        let dir = tempfile::tempdir().unwrap();
        let pickle = dir.path().join("old.pt");
        std::fs::write(&pickle, b"not read").unwrap();
        let use_ = |path: PathBuf| LoraUse { name: "old".into(), path, te: 1.0, unet: 1.0, hash: None };
        let err = checks.check(&[use_(pickle)], "sd1").unwrap_err();
        assert!(err.message.contains("`old`") && err.message.contains("pickle"), "{err:?}");
        let err = checks.check(&[use_(dir.path().join("missing.safetensors"))], "sd1").unwrap_err();
        assert!(err.message.contains("cannot read"), "{err:?}");
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
