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
    let (sdcpp_path, scales_folded) = match mmdit {
        Some(m) => crate::sd3::cache_root()
            .and_then(|cache| sd3_lora_for_sdcpp(&file, m, &cache))
            .map_err(|msg| invalid(lora, msg))?,
        None => {
            fits_family(&file, family).map_err(|m| invalid(lora, m))?;
            (lora.path.clone(), false)
        }
    };
    // sd.cpp reads a module's alpha from `.alpha` tensors only: a diffusers/PEFT file whose alpha is in its adapter
    // metadata would be applied at another strength, silently (unless rewritten with its scales folded in).
    if let Some(m) = file.modules.iter().find(|m| m.scale_from_metadata && m.scale() != 1.0 && !scales_folded)
    {
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

/// An SD3 LoRA for this MMDiT as sd.cpp reads it, and whether the modules' scales were folded into the copy.
/// sd.cpp's kohya loader turns every `_` of a name into `.`, which SAI's names (`joint_blocks`, `x_block`,
/// `adaLN_modulation`) do not survive, so the file is checked, then written once into the cache with the dotted
/// SAI names sd.cpp maps (`diffusion_model.joint_blocks.0.x_block.attn.qkv.…`; the same tensors) and that copy is
/// what sd.cpp loads. A file in diffusers' (PEFT) names is rewritten into SAI's layers instead, its CLIP-L and
/// CLIP-G modules included ([`sd3_peft_for_sdcpp`]). Checked: every block named exists and every layer takes the
/// model's width (its MLP's second layer four times it); kohya's CLIP-L and CLIP-G modules (`lora_te1_`,
/// `lora_te2_`) go under SAI's `text_encoders.clip_{l,g}.transformer.` in transformers' names, as sd.cpp's SD3
/// conditioner names its weights. Refused naming the module: T5 modules (diffusers applies no T5 LoRA), a file
/// mixing diffusers' names with SAI's, and names SAI's MMDiT or CLIP has no layer for.
fn sd3_lora_for_sdcpp(
    file: &LoraFile,
    m: Mmdit,
    cache: &std::path::Path,
) -> Result<(std::path::PathBuf, bool), String> {
    let path = file.path.display();
    if let Some(t5) =
        file.modules.iter().find(|module| matches!(module.name.network(), Network::TextEncoder(2..)))
    {
        let why = "it changes T5, which no SD3 LoRA loader applies (diffusers has none)";
        return Err(misfit(file, t5, m, why.into()));
    }
    if let Some(first) = file.modules.iter().find(|module| is_peft(module)) {
        if let Some(other) = file.modules.iter().find(|module| !is_peft(module)) {
            return Err(format!(
                "{path}: module {} is in diffusers' (PEFT) names and module {} in SAI's; a file in one of them is \
                 taken",
                first.key, other.key
            ));
        }
        return sd3_peft_for_sdcpp(file, m, cache).map(|p| (p, true));
    }
    let mut renamed: Vec<(String, String)> = Vec::new();
    for module in &file.modules {
        let shape = file.natural_shape(module).map_err(|e| e.to_string())?;
        let (out, inp) = match shape.as_slice() {
            [out, inp, ..] => (*out, *inp),
            _ => (0, 0),
        };
        let to = match (&module.name, module.name.network()) {
            (sdhive_lora::ModuleName::Kohya { name, .. }, Network::TextEncoder(i)) => {
                let dotted = kohya_clip_path(name)
                    .ok_or_else(|| misfit(file, module, m, "CLIP has no such layer".into()))?;
                fits_clip(file, module, i, out, inp)?;
                clip_key(i, &dotted)
            }
            (sdhive_lora::ModuleName::Kohya { name, .. }, _) => {
                let sai = kohya_sai_path(name)
                    .ok_or_else(|| misfit(file, module, m, "SAI's MMDiT has no such layer".into()))?;
                fits_mmdit(file, module, m, &sai, out, inp)?;
                format!("diffusion_model.{sai}")
            }
            (sdhive_lora::ModuleName::Diffusers { path: p, .. }, _) => {
                fits_mmdit(file, module, m, p, out, inp)?;
                format!("diffusion_model.{p}")
            }
        };
        renamed.push((module.key.clone(), to));
    }
    write_renamed(&file.path, &renamed, cache).map(|p| (p, false))
}

fn misfit(file: &LoraFile, module: &LoraModule, m: Mmdit, why: String) -> String {
    format!(
        "{}: module {} does not fit this model (SD3, {} wide, {} blocks): {why}",
        file.path.display(),
        module.key,
        m.hidden,
        m.blocks
    )
}

/// A module in diffusers' names (`transformer.transformer_blocks.…`, `text_encoder.text_model.…`), not SAI's
/// dotted ones.
fn is_peft(module: &LoraModule) -> bool {
    matches!(module.name, sdhive_lora::ModuleName::Diffusers { .. })
        && !module.key.starts_with("diffusion_model.")
        && !module.key.starts_with("model.diffusion_model.")
}

/// The SAI layer `sai` can take an `out`×`in` update: its block exists, a block's layer takes the model's width
/// (the MLP's second layer four times it), a layer outside the blocks gives or takes it.
fn fits_mmdit(
    file: &LoraFile,
    module: &LoraModule,
    m: Mmdit,
    sai: &str,
    out: usize,
    inp: usize,
) -> Result<(), String> {
    let block = sai.strip_prefix("joint_blocks.").and_then(|r| r.split('.').next()?.parse::<usize>().ok());
    match block {
        Some(b) if b >= m.blocks => {
            Err(misfit(file, module, m, format!("block {b} does not exist (0 to {})", m.blocks - 1)))
        }
        Some(_) if inp != m.hidden && inp != 4 * m.hidden => {
            Err(misfit(file, module, m, format!("it takes {inp} features, the model's blocks {}", m.hidden)))
        }
        None if out != m.hidden && inp != m.hidden => Err(misfit(
            file,
            module,
            m,
            format!("it is a {out}×{inp} update, the model is {} wide", m.hidden),
        )),
        _ => Ok(()),
    }
}

/// The name sd.cpp reads a CLIP-L (`encoder` 0) or CLIP-G layer by in an SD3 model: transformers' path under
/// SAI's prefix, as its SD3 conditioner names the encoders' weights.
fn clip_key(encoder: usize, path: &str) -> String {
    format!("text_encoders.{}.transformer.{path}", if encoder == 0 { "clip_l" } else { "clip_g" })
}

/// A text-encoder layer's update fits SD3's CLIP-L (768 wide, MLP 3072) or CLIP-G (1280, 5120).
fn fits_clip(
    file: &LoraFile,
    module: &LoraModule,
    encoder: usize,
    out: usize,
    inp: usize,
) -> Result<(), String> {
    let (name, width) = if encoder == 0 { ("CLIP-L", 768) } else { ("CLIP-G", 1280) };
    if [out, inp].iter().all(|&d| d == width || d == 4 * width) {
        return Ok(());
    }
    Err(format!(
        "{}: module {} does not fit SD3's {name} ({width} wide): it is a {out}×{inp} update",
        file.path.display(),
        module.key
    ))
}

/// A diffusers/PEFT-named SD3 LoRA (`transformer.transformer_blocks.0.attn.to_q.lora_A.weight`: diffusers' own
/// format and most trainers') rewritten into SAI's layers, which sd.cpp reads: each module goes to the SAI layer
/// holding its weight (`to_q`, `to_k`, `to_v` are the thirds of one fused `qkv`; the last block's context adaLN
/// and `norm_out` have their halves swapped back), and the modules of one layer become one LoRA of their summed
/// rank — the `down`s stacked, each scaled `up` on its rows and its own columns — whose ΔW is theirs side by side,
/// exactly. The scales are folded into `up` (sd.cpp reads no adapter metadata). CLIP-L's and CLIP-G's modules keep
/// their transformers names under SAI's `text_encoders.clip_{l,g}.transformer.`, as sd.cpp's SD3 conditioner
/// names its weights. Plain LoRA modules of linear layers only; written once into the cache like the renamed
/// copies.
fn sd3_peft_for_sdcpp(
    file: &LoraFile,
    m: Mmdit,
    cache: &std::path::Path,
) -> Result<std::path::PathBuf, String> {
    use sdhive_lora::Slot;
    struct Part {
        slot: Slot,
        key: String,
        up: Vec<Vec<f32>>,
        down: Vec<Vec<f32>>,
    }
    let path = file.path.display();
    let mut layers: std::collections::BTreeMap<String, Vec<Part>> = std::collections::BTreeMap::new();
    for module in &file.modules {
        let sdhive_lora::ModuleName::Diffusers { path: p, network } = &module.name else { continue };
        let factors = module.linear_factors().ok_or_else(|| {
            format!(
                "{path}: module {} is a {:?} module, and SD3 LoRAs in diffusers' names are rewritten for the \
                 stable-diffusion.cpp engine from plain LoRA modules (lora_A/lora_B) of linear layers only",
                module.key,
                module.kind()
            )
        })?;
        let (up, down) = factors
            .and_then(|(u, d)| Ok((u.to_vec2::<f32>()?, d.to_vec2::<f32>()?)))
            .map_err(|e| format!("{path}: module {}: {e}", module.key))?;
        let (out, inp) = (up.len(), down.first().map_or(0, Vec::len));
        // Keyed by the name sd.cpp reads.
        let (key, slot) = match network {
            Network::TextEncoder(i) => {
                fits_clip(file, module, *i, out, inp)?;
                (clip_key(*i, p), Slot::Whole)
            }
            Network::Unet => {
                let (sai, slot) = sdhive_lora::sd3_sai_module(p, m.blocks)
                    .ok_or_else(|| misfit(file, module, m, "SAI's MMDiT has no such layer".into()))?;
                fits_mmdit(file, module, m, &sai, out, inp)?;
                (format!("diffusion_model.{sai}"), slot)
            }
        };
        let parts = layers.entry(key).or_default();
        if let Some(twin) = parts.iter().find(|q| q.slot == slot) {
            return Err(format!("{path}: modules {} and {} change the same weight", twin.key, module.key));
        }
        parts.push(Part { slot, key: module.key.clone(), up, down });
    }
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for (key, parts) in &layers {
        let rank: usize = parts.iter().map(|q| q.down.len()).sum();
        let inp = parts[0].down.first().map_or(0, Vec::len);
        let out = parts[0].up.len();
        if let Some(q) = parts.iter().find(|q| q.up.len() != out || q.down.first().map_or(0, Vec::len) != inp)
        {
            return Err(format!(
                "{path}: modules {} and {} are parts of {key} but differ in shape",
                parts[0].key, q.key
            ));
        }
        let rows = if parts.iter().any(|q| matches!(q.slot, Slot::Third(_))) { 3 * out } else { out };
        let mut up = vec![0f32; rows * rank];
        let mut down = Vec::with_capacity(rank * inp);
        let mut col = 0;
        for q in parts {
            let r = q.down.len();
            for (i, row) in q.up.iter().enumerate() {
                let to = match q.slot {
                    Slot::Whole => i,
                    Slot::Third(t) => t * out + i,
                    Slot::Swapped => (i + out / 2) % out,
                };
                up[to * rank + col..to * rank + col + r].copy_from_slice(row);
            }
            down.extend(q.down.iter().flatten());
            col += r;
        }
        tensors.push((format!("{key}.lora_up.weight"), vec![rows, rank], up));
        tensors.push((format!("{key}.lora_down.weight"), vec![rank, inp], down));
    }
    write_tensors(&file.path, &tensors, cache)
}

/// `tensors` (f32) written once into the cache as the copy of the LoRA at `src` (see [`write_renamed`]).
fn write_tensors(
    src: &std::path::Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    cache: &std::path::Path,
) -> Result<std::path::PathBuf, String> {
    let out = cached_lora(src, cache)?;
    if out.is_file() {
        return Ok(out);
    }
    let bytes: Vec<Vec<u8>> =
        tensors.iter().map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                .map(|v| (name.clone(), v))
                .map_err(|e| format!("{}: {name}: {e}", src.display()))
        })
        .collect::<Result<Vec<_>, String>>()?;
    write_views(&out, views)
}

/// transformers' dotted path of a kohya CLIP module name (`text_model_encoder_layers_0_self_attn_q_proj` →
/// `text_model.encoder.layers.0.self_attn.q_proj`).
fn kohya_clip_path(name: &str) -> Option<String> {
    let rest = name.strip_prefix("text_model_encoder_layers_")?;
    let (layer, rest) = rest.split_once('_')?;
    layer.parse::<usize>().ok()?;
    let leaf = match rest {
        "self_attn_q_proj" => "self_attn.q_proj",
        "self_attn_k_proj" => "self_attn.k_proj",
        "self_attn_v_proj" => "self_attn.v_proj",
        "self_attn_out_proj" => "self_attn.out_proj",
        "mlp_fc1" => "mlp.fc1",
        "mlp_fc2" => "mlp.fc2",
        _ => return None,
    };
    Some(format!("text_model.encoder.layers.{layer}.{leaf}"))
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
/// once into the cache.
fn write_renamed(
    src: &std::path::Path,
    renamed: &[(String, String)],
    cache: &std::path::Path,
) -> Result<std::path::PathBuf, String> {
    let out = cached_lora(src, cache)?;
    if out.is_file() {
        return Ok(out);
    }
    let fail = |e: String| format!("{}: {e}", src.display());
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
    write_views(&out, views)
}

/// Where the copy sd.cpp reads of the LoRA at `src` goes: `sdcpp/loras/<stem>-<key>.safetensors` in the cache,
/// keyed by the file's path, size and modification time.
fn cached_lora(src: &std::path::Path, cache: &std::path::Path) -> Result<std::path::PathBuf, String> {
    let stem = src.file_stem().map_or_else(|| "lora".into(), |s| s.to_string_lossy().into_owned());
    crate::sd3::cached_copy(src, &cache.join("sdcpp").join("loras"), &stem)
}

/// `views` written to `out` under a temporary name, then renamed, so a worker never reads half a file.
fn write_views(
    out: &std::path::Path,
    views: Vec<(String, safetensors::tensor::TensorView<'_>)>,
) -> Result<std::path::PathBuf, String> {
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let tmp = out.with_extension(format!("{}.tmp", std::process::id()));
    safetensors::serialize_to_file(views, None, &tmp)
        .map_err(|e| e.to_string())
        .and_then(|()| std::fs::rename(&tmp, out).map_err(|e| e.to_string()))
        .map_err(|e| format!("cannot write {}: {e}", out.display()))?;
    Ok(out.to_path_buf())
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
            sd3_lora_for_sdcpp(&file, medium, cache.path()).map(|(path, _)| path)
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
            ("lora_te1_text_model_encoder_layers_0_mlp_fc1", 4096, 1024, "CLIP-L (768 wide)"),
            ("lora_te3_encoder_block_0_layer_0_SelfAttention_q", 4096, 4096, "T5"),
            ("lora_unet_joint_blocks_0_x_block_attn_to_q", 1536, 1536, "no such layer"),
        ] {
            let (_d, l) = made(&[(module, out, inp)], 1.0, 1.0);
            let err = check(&l).unwrap_err();
            assert!(err.contains(why) && err.contains(module), "{module}: {err}");
        }
        // A file mixing diffusers' names with SAI's; an SD1 LoRA does not fit.
        let (_d, mixed) = made(
            &[
                ("transformer.transformer_blocks.0.attn.to_q", 1536, 1536),
                ("lora_unet_joint_blocks_0_x_block_attn_proj", 1536, 1536),
            ],
            1.0,
            1.0,
        );
        let err = check(&mixed).unwrap_err();
        assert!(err.contains("diffusers' (PEFT) names") && err.contains("in SAI's"), "{err}");
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

    /// A diffusers/PEFT-named SD3 LoRA rewritten into SAI's layers changes every weight of the MMDiT exactly as
    /// the file does: q, k and v (ranks 2, 3 and 1) become thirds of one `qkv` LoRA, the last block's context adaLN
    /// and `norm_out` get their halves swapped, the rest keep their rows; a module on no SAI layer is refused.
    #[test]
    fn diffusers_named_sd3_loras_become_sai_layers_with_the_same_updates() {
        use sdhive_lora::{Denoiser, ModelParams};
        let (d, blocks) = (8usize, 2usize);
        let mut params = ModelParams { denoiser: Denoiser::Mmdit, ..Default::default() };
        for b in 0..blocks {
            let p = format!("transformer_blocks.{b}.");
            for (name, shape) in [
                ("attn.to_q", [d, d]),
                ("attn.to_k", [d, d]),
                ("attn.to_v", [d, d]),
                ("attn.add_q_proj", [d, d]),
                ("attn.add_k_proj", [d, d]),
                ("attn.add_v_proj", [d, d]),
                ("attn.to_out.0", [d, d]),
                ("norm1.linear", [6 * d, d]),
                ("ff.net.0.proj", [4 * d, d]),
                ("ff.net.2", [d, 4 * d]),
            ] {
                params.unet.insert(format!("{p}{name}.weight"), shape.to_vec());
            }
            // The last block's context stream ends in it: no output projection, a (scale, shift) adaLN.
            let context_rows = if b + 1 == blocks { 2 } else { 6 };
            params.unet.insert(format!("{p}norm1_context.linear.weight"), vec![context_rows * d, d]);
            if b + 1 < blocks {
                params.unet.insert(format!("{p}attn.to_add_out.weight"), vec![d, d]);
            }
        }
        params.unet.insert("norm_out.linear.weight".into(), vec![2 * d, d]);
        let modules: [(&str, usize, usize, usize); 7] = [
            ("transformer.transformer_blocks.0.attn.to_q", d, d, 2),
            ("transformer.transformer_blocks.0.attn.to_k", d, d, 3),
            ("transformer.transformer_blocks.0.attn.to_v", d, d, 1),
            ("transformer.transformer_blocks.1.attn.add_k_proj", d, d, 2),
            ("transformer.transformer_blocks.1.norm1_context.linear", 2 * d, d, 2),
            ("transformer.transformer_blocks.0.ff.net.2", d, 4 * d, 2),
            ("transformer.norm_out.linear", 2 * d, d, 1),
        ];
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("peft.safetensors");
        let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
        let mut x = 0.37f32;
        let mut next = || {
            x = (x * 3.7 + 0.11).fract();
            x - 0.5
        };
        for (name, out, inp, rank) in modules {
            tensors.push((
                format!("{name}.lora_A.weight"),
                vec![rank, inp],
                (0..rank * inp).map(|_| next()).collect(),
            ));
            tensors.push((
                format!("{name}.lora_B.weight"),
                vec![out, rank],
                (0..out * rank).map(|_| next()).collect(),
            ));
        }
        let bytes: Vec<Vec<u8>> =
            tensors.iter().map(|(_, _, v)| v.iter().flat_map(|f| f.to_le_bytes()).collect()).collect();
        let views: Vec<_> = tensors
            .iter()
            .zip(&bytes)
            .map(|((n, shape, _), b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &src).unwrap();

        let cache = tempfile::tempdir().unwrap();
        let original = LoraFile::read(&src).unwrap();
        let (copy, folded) =
            sd3_lora_for_sdcpp(&original, Mmdit { hidden: d, blocks }, cache.path()).unwrap();
        assert!(folded);
        let converted = LoraFile::read(&copy).unwrap();
        assert_eq!(converted.modules.len(), 5, "q, k and v in one qkv module");
        let updates = |file: &LoraFile| {
            let mut by_weight: std::collections::BTreeMap<String, Vec<f32>> = Default::default();
            for patch in file.resolve(&params).unwrap() {
                let shape = &params.unet[&patch.target];
                let delta = file.delta(&patch, shape, &candle_core::Device::Cpu).unwrap();
                let values: Vec<f32> = delta.flatten_all().unwrap().to_vec1().unwrap();
                let sum = by_weight.entry(patch.target.clone()).or_insert_with(|| vec![0.0; values.len()]);
                sum.iter_mut().zip(values).for_each(|(s, v)| *s += v);
            }
            by_weight
        };
        let (want, got) = (updates(&original), updates(&converted));
        assert_eq!(want.len(), 7);
        for (weight, g) in &got {
            // The thirds of a fused layer the file left alone (block 1's add_q and add_v) get zeros.
            let zeros = vec![0.0; g.len()];
            let w = want.get(weight).unwrap_or(&zeros);
            let worst = w.iter().zip(g).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-6, "{weight}: off by {worst}");
        }
        assert!(want.keys().all(|k| got.contains_key(k)));

        // CLIP-L and CLIP-G modules keep transformers' names under SAI's prefixes; one of another width is refused.
        let (_d, te) = made(
            &[
                ("text_encoder.text_model.encoder.layers.0.self_attn.q_proj", 768, 768),
                ("text_encoder_2.text_model.encoder.layers.1.mlp.fc1", 5120, 1280),
            ],
            1.0,
            1.0,
        );
        let file = LoraFile::read(&te.path).unwrap();
        let (copy, _) = sd3_lora_for_sdcpp(&file, Mmdit { hidden: d, blocks }, cache.path()).unwrap();
        let copy = LoraFile::read(&copy).unwrap();
        let mut keys: Vec<&str> = copy.modules.iter().map(|m| m.key.as_str()).collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "text_encoders.clip_g.transformer.text_model.encoder.layers.1.mlp.fc1",
                "text_encoders.clip_l.transformer.text_model.encoder.layers.0.self_attn.q_proj"
            ]
        );
        let (_d, sd2_te) =
            made(&[("text_encoder.text_model.encoder.layers.0.self_attn.q_proj", 1024, 1024)], 1.0, 1.0);
        let file = LoraFile::read(&sd2_te.path).unwrap();
        let err = sd3_lora_for_sdcpp(&file, Mmdit { hidden: d, blocks }, cache.path()).unwrap_err();
        assert!(err.contains("CLIP-L (768 wide)") && err.contains("1024×1024"), "{err}");

        // A module on no SAI layer is refused naming it.
        let (_d, odd) = made(&[("transformer.transformer_blocks.0.attn.to_x", d, d)], 1.0, 1.0);
        let file = LoraFile::read(&odd.path).unwrap();
        let err = sd3_lora_for_sdcpp(&file, Mmdit { hidden: d, blocks }, cache.path()).unwrap_err();
        assert!(err.contains("attn.to_x") && err.contains("no such layer"), "{err}");
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
