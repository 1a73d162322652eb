//! Reading a LoRA/LyCORIS file: tensor keys split into a module and a part (`lora_up`, `hada_w1_a`, `alpha`, …),
//! grouped into modules, classified as LoRA, LoHa or LoKr, and given their alpha from an `.alpha` tensor or from
//! diffusers/PEFT adapter metadata. Anything not understood is refused by name rather than dropped, because a
//! LoRA applied in part gives a subtly wrong image that nobody can diagnose.

use crate::delta::{Factor, ModuleKind, Weights};
use crate::header::read_header;
use crate::{LoraError, Network};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// How a module names the layer it changes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ModuleName {
    /// kohya/A1111: the module path with `.` written `_`, after the `lora_unet_` / `lora_te*_` prefix, in either
    /// diffusers or LDM/SGM spelling (`down_blocks_0_attentions_0_proj_in`, `input_blocks_1_1_proj_in`).
    Kohya { network: Network, name: String },
    /// diffusers/PEFT: the dotted module path after the `unet.` / `text_encoder.` / `text_encoder_2.` prefix.
    Diffusers { network: Network, path: String },
}

impl ModuleName {
    pub fn network(&self) -> Network {
        match self {
            ModuleName::Kohya { network, .. } | ModuleName::Diffusers { network, .. } => *network,
        }
    }
}

/// One module of a LoRA file: the update of one model weight.
#[derive(Debug, Clone)]
pub struct LoraModule {
    /// The module as the file spells it, without the part suffix (`lora_unet_..._to_q`, `unet.….to_q`).
    pub key: String,
    pub name: ModuleName,
    /// The `.alpha` tensor, or for diffusers/PEFT files the adapter metadata's `lora_alpha` / `alpha_pattern`.
    pub alpha: Option<f32>,
    /// LyCORIS' `.scale` tensor (or PEFT's rsLoRA scale); when present it replaces alpha/rank.
    pub scale: Option<f32>,
    /// Whether alpha or scale came from the adapter metadata rather than from tensors (loaders that read only
    /// tensors, as stable-diffusion.cpp does, would apply such a module at another strength).
    pub scale_from_metadata: bool,
    pub(crate) weights: Weights,
}

impl LoraModule {
    pub fn kind(&self) -> ModuleKind {
        self.weights.kind()
    }

    /// The rank alpha is divided by (A1111's `dim`), where the module has one.
    pub fn rank(&self) -> Option<usize> {
        self.weights.rank()
    }

    /// A plain LoRA of a linear layer as its two factors in f32, the module's scale folded into `up`:
    /// `(scale · up [out, rank], down [rank, in])`, whose product is ΔW. `None` for LoHa, LoKr, a tucker core or a
    /// convolution.
    pub fn linear_factors(&self) -> Option<candle_core::Result<(Tensor, Tensor)>> {
        let Weights::Lora { up, down, mid: None } = &self.weights else { return None };
        if up.rank() != 2 || down.rank() != 2 {
            return None;
        }
        let scale = f64::from(self.scale());
        Some((|| Ok((up.to_dtype(DType::F32)?.affine(scale, 0.0)?, down.to_dtype(DType::F32)?)))())
    }

    /// The factor ΔW is multiplied by before the user's weight: `scale`, else alpha/rank, else 1 (A1111's
    /// `calc_scale`).
    pub fn scale(&self) -> f32 {
        if let Some(scale) = self.scale {
            return scale;
        }
        match (self.alpha, self.rank()) {
            (Some(alpha), Some(rank)) => alpha / rank as f32,
            _ => 1.0,
        }
    }
}

/// A LoRA or LyCORIS file, read into CPU tensors of the file's float dtype.
#[derive(Debug, Clone)]
pub struct LoraFile {
    pub path: PathBuf,
    /// The safetensors `__metadata__` (kohya's `ss_*` keys, diffusers' `lora_adapter_metadata`).
    pub metadata: BTreeMap<String, String>,
    pub modules: Vec<LoraModule>,
    /// Names of textual-inversion embeddings bundled in the file (`bundle_emb.<name>.*`, an A1111 feature); they
    /// are listed, not loaded.
    pub bundled_embeddings: Vec<String>,
}

/// One part of a module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Part {
    Up,
    Down,
    Mid,
    Alpha,
    Scale,
    HadaW1A,
    HadaW1B,
    HadaW2A,
    HadaW2B,
    HadaT1,
    HadaT2,
    LokrW1,
    LokrW1A,
    LokrW1B,
    LokrW2,
    LokrW2A,
    LokrW2B,
    LokrT2,
    Dora,
}

/// Part suffixes after the module name (and its separating dot), valid in kohya and dotted keys alike.
const PARTS: &[(&str, Part)] = &[
    ("lora_up.weight", Part::Up),
    ("lora_down.weight", Part::Down),
    ("lora_mid.weight", Part::Mid),
    ("lora_B.weight", Part::Up),
    ("lora_A.weight", Part::Down),
    ("lora.up.weight", Part::Up),
    ("lora.down.weight", Part::Down),
    ("lora_linear_layer.up.weight", Part::Up),
    ("lora_linear_layer.down.weight", Part::Down),
    ("alpha", Part::Alpha),
    ("scale", Part::Scale),
    ("hada_w1_a", Part::HadaW1A),
    ("hada_w1_b", Part::HadaW1B),
    ("hada_w2_a", Part::HadaW2A),
    ("hada_w2_b", Part::HadaW2B),
    ("hada_t1", Part::HadaT1),
    ("hada_t2", Part::HadaT2),
    ("lokr_w1", Part::LokrW1),
    ("lokr_w1_a", Part::LokrW1A),
    ("lokr_w1_b", Part::LokrW1B),
    ("lokr_w2", Part::LokrW2),
    ("lokr_w2_a", Part::LokrW2A),
    ("lokr_w2_b", Part::LokrW2B),
    ("lokr_t2", Part::LokrT2),
    ("dora_scale", Part::Dora),
    ("lora_magnitude_vector", Part::Dora),
    ("lora_magnitude_vector.weight", Part::Dora),
];

fn part_of(suffix: &str) -> Option<Part> {
    PARTS.iter().find(|(s, _)| *s == suffix).map(|(_, p)| *p)
}

/// A key split into its module (as spelled, and as a name to resolve) and part.
struct Parsed {
    module_key: String,
    name: ModuleName,
    part: Part,
}

/// Kohya prefixes and the network each names. SD1's single encoder is `lora_te_`; SDXL's are `lora_te1_`/`lora_te2_`,
/// SD3's `lora_te1_` (CLIP-L), `lora_te2_` (CLIP-G), `lora_te3_` (T5). OneTrainer's and SimpleTuner's SD3 files
/// spell the transformer's diffusers names underscored after `lora_transformer_` / `lycoris_`.
const KOHYA: &[(&str, Network)] = &[
    ("lora_unet_", Network::Unet),
    ("lora_transformer_", Network::Unet),
    ("lycoris_", Network::Unet),
    ("lora_te1_", Network::TextEncoder(0)),
    ("lora_te2_", Network::TextEncoder(1)),
    ("lora_te3_", Network::TextEncoder(2)),
    ("lora_te_", Network::TextEncoder(0)),
];

fn parse_kohya(key: &str) -> Option<Result<Parsed, ()>> {
    let (prefix, network) = KOHYA.iter().find(|(p, _)| key.starts_with(p))?;
    let Some((module, suffix)) = key.split_once('.') else { return Some(Err(())) };
    let Some(part) = part_of(suffix) else { return Some(Err(())) };
    let name = ModuleName::Kohya { network: *network, name: module[prefix.len()..].to_string() };
    Some(Ok(Parsed { module_key: module.to_string(), name, part }))
}

/// The network and module path of a dotted key's module part.
fn dotted_network(module: &str) -> (Network, &str) {
    for (prefix, network) in [
        ("text_encoder_2.", Network::TextEncoder(1)),
        ("text_encoder.", Network::TextEncoder(0)),
        ("unet.", Network::Unet),
        ("transformer.", Network::Unet),
        ("model.diffusion_model.", Network::Unet),
        ("diffusion_model.", Network::Unet),
        ("base_model.model.", Network::Unet),
    ] {
        if let Some(rest) = module.strip_prefix(prefix) {
            return (network, rest);
        }
    }
    // No prefix means UNet (diffusers' `save_lora_adapter` of a bare UNet), except that a bare text-encoder
    // path can only mean the first encoder.
    if module.starts_with("text_model.") {
        (Network::TextEncoder(0), module)
    } else {
        (Network::Unet, module)
    }
}

/// diffusers' attention-processor LoRA (`attn1.processor.to_q_lora`, text encoder `self_attn.to_q_lora`) as the
/// linear layer it wraps.
fn processor_module(network: Network, path: &str) -> Option<String> {
    let (parent, last) = path.rsplit_once('.')?;
    let parent = parent.strip_suffix(".processor").unwrap_or(parent);
    let layer = match (network, last) {
        (Network::Unet, "to_q_lora") => "to_q",
        (Network::Unet, "to_k_lora") => "to_k",
        (Network::Unet, "to_v_lora") => "to_v",
        (Network::Unet, "to_out_lora") => "to_out.0",
        (Network::TextEncoder(_), "to_q_lora") => "q_proj",
        (Network::TextEncoder(_), "to_k_lora") => "k_proj",
        (Network::TextEncoder(_), "to_v_lora") => "v_proj",
        (Network::TextEncoder(_), "to_out_lora") => "out_proj",
        _ => return None,
    };
    Some(format!("{parent}.{layer}"))
}

fn parse_dotted(key: &str) -> Option<Parsed> {
    // Longest suffix first: `lora.up.weight` must not be read as a module ending in `.lora`.
    let mut best: Option<(&str, Part)> = None;
    for (suffix, part) in PARTS {
        if key.len() > suffix.len() + 1
            && key.ends_with(suffix)
            && key[..key.len() - suffix.len()].ends_with('.')
            && best.is_none_or(|(b, _)| suffix.len() > b.len())
        {
            best = Some((suffix, *part));
        }
    }
    if let Some((suffix, part)) = best {
        let module = &key[..key.len() - suffix.len() - 1];
        let (network, path) = dotted_network(module);
        return Some(Parsed {
            module_key: module.to_string(),
            name: ModuleName::Diffusers { network, path: path.to_string() },
            part,
        });
    }
    for (suffix, part) in [(".up.weight", Part::Up), (".down.weight", Part::Down)] {
        if let Some(module) = key.strip_suffix(suffix) {
            let (network, path) = dotted_network(module);
            let path = processor_module(network, path)?;
            return Some(Parsed {
                module_key: module.to_string(),
                name: ModuleName::Diffusers { network, path },
                part,
            });
        }
    }
    None
}

/// A module's parts as found, with the keys they came from.
struct Group {
    module_key: String,
    name: ModuleName,
    parts: BTreeMap<Part, (String, Tensor)>,
}

impl LoraFile {
    /// Reads a `.safetensors` LoRA/LyCORIS file (kohya, A1111, LyCORIS, diffusers or PEFT layout). Pickle files are
    /// refused by extension.
    pub fn read(path: &Path) -> Result<LoraFile, LoraError> {
        let header = read_header(path)?;
        // SAFETY: LoRA files are read-only inputs; we rely on nobody truncating them while mapped, the same contract
        // as every mmap-based model loader. Every tensor is copied out before the map is dropped.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(path) }
            .map_err(|e| LoraError::Header { path: path.to_path_buf(), reason: e.to_string() })?;
        // Every tensor copied out on all cores (an SDXL LoRA holds a few hundred MB), in the file's float dtype:
        // half the bytes of f32 to keep and to upload; the deltas are computed in f32 on the device.
        let loaded: HashMap<&String, Tensor> = {
            use rayon::prelude::*;
            header
                .tensors
                .keys()
                .filter(|key| !key.starts_with("bundle_emb."))
                .collect::<Vec<_>>()
                .into_par_iter()
                .map(|key| {
                    st.load(key, &Device::Cpu)
                        .and_then(|t| if t.dtype().is_float() { Ok(t) } else { t.to_dtype(DType::F32) })
                        .map(|t| (key, t))
                        .map_err(|source| LoraError::Tensor {
                            path: path.to_path_buf(),
                            key: key.to_string(),
                            source: Box::new(source),
                        })
                })
                .collect::<Result<_, _>>()?
        };
        let load = |key: &String| -> Result<Tensor, LoraError> {
            loaded
                .get(key)
                .cloned()
                .ok_or_else(|| LoraError::UnknownKey { path: path.to_path_buf(), key: key.clone() })
        };

        let mut groups: Vec<Group> = Vec::new();
        let mut index: HashMap<ModuleName, usize> = HashMap::new();
        let mut bundled = Vec::new();
        for key in header.tensors.keys() {
            if let Some(rest) = key.strip_prefix("bundle_emb.") {
                let name = rest.split('.').next().unwrap_or(rest).to_string();
                if !bundled.contains(&name) {
                    bundled.push(name);
                }
                continue;
            }
            let parsed = match parse_kohya(key) {
                Some(Ok(p)) => Some(p),
                Some(Err(())) => None,
                None => parse_dotted(key),
            };
            let Some(parsed) = parsed else {
                return Err(LoraError::UnknownKey { path: path.to_path_buf(), key: key.clone() });
            };
            if parsed.part == Part::Dora {
                return Err(LoraError::Dora { path: path.to_path_buf(), key: key.clone() });
            }
            let slot = *index.entry(parsed.name.clone()).or_insert_with(|| {
                groups.push(Group {
                    module_key: parsed.module_key.clone(),
                    name: parsed.name.clone(),
                    parts: BTreeMap::new(),
                });
                groups.len() - 1
            });
            let tensor = load(key)?;
            if let Some((other, _)) = groups[slot].parts.insert(parsed.part, (key.clone(), tensor)) {
                return Err(LoraError::Malformed {
                    path: path.to_path_buf(),
                    key: key.clone(),
                    reason: format!("says the same thing as {other}"),
                });
            }
        }

        let adapter = AdapterMetadata::parse(path, &header.metadata)?;
        let mut modules = Vec::with_capacity(groups.len());
        for group in groups {
            modules.push(build_module(path, group, adapter.as_ref())?);
        }
        if modules.is_empty() {
            return Err(LoraError::Empty { path: path.to_path_buf() });
        }
        Ok(LoraFile {
            path: path.to_path_buf(),
            metadata: header.metadata,
            modules,
            bundled_embeddings: bundled,
        })
    }

    /// The shape of `module`'s update as A1111 builds it, from the file's tensor shapes alone: `[out, in]` for a
    /// linear layer, `[out, in, kh, kw]` for a convolution. Lets a caller that has no model weights to
    /// [`resolve`](LoraFile::resolve) against (stable-diffusion.cpp's engine) still tell the model family a LoRA
    /// was made for, e.g. from the text width its cross-attention `to_k` takes.
    pub fn natural_shape(&self, module: &LoraModule) -> Result<Vec<usize>, LoraError> {
        module.weights.natural_shape().map_err(|reason| LoraError::Malformed {
            path: self.path.clone(),
            key: module.key.clone(),
            reason,
        })
    }
}

fn scalar(path: &Path, key: &str, t: &Tensor) -> Result<f32, LoraError> {
    let bad =
        |reason: String| LoraError::Malformed { path: path.to_path_buf(), key: key.to_string(), reason };
    if t.elem_count() != 1 {
        return Err(bad(format!("a scalar is needed, found shape {:?}", t.dims())));
    }
    let v = t
        .flatten_all()
        .and_then(|t| t.to_dtype(DType::F32)?.to_vec1::<f32>())
        .map_err(|e| bad(e.to_string()))?;
    v.first().copied().filter(|v| v.is_finite()).ok_or_else(|| bad("not a finite number".into()))
}

fn build_module(
    path: &Path,
    group: Group,
    adapter: Option<&AdapterMetadata>,
) -> Result<LoraModule, LoraError> {
    let Group { module_key, name, mut parts } = group;
    let alpha = match parts.remove(&Part::Alpha) {
        Some((key, t)) => Some(scalar(path, &key, &t)?),
        None => None,
    };
    let scale = match parts.remove(&Part::Scale) {
        Some((key, t)) => Some(scalar(path, &key, &t)?),
        None => None,
    };
    let found: Vec<String> = parts.values().map(|(k, _)| k.clone()).collect();
    use Part::*;
    let has = |ps: &[Part]| ps.iter().any(|p| parts.contains_key(p));
    let (lora, hada, lokr) = (
        has(&[Up, Down, Mid]),
        has(&[HadaW1A, HadaW1B, HadaW2A, HadaW2B, HadaT1, HadaT2]),
        has(&[LokrW1, LokrW1A, LokrW1B, LokrW2, LokrW2A, LokrW2B, LokrT2]),
    );
    let mut take = |p: Part| parts.remove(&p).map(|(_, t)| t);
    let weights = if lora {
        match (take(Up), take(Down), take(Mid)) {
            (Some(up), Some(down), mid) => Some(Weights::Lora { up, down, mid }),
            _ => None,
        }
    } else if hada {
        match (take(HadaW1A), take(HadaW1B), take(HadaW2A), take(HadaW2B)) {
            (Some(w1a), Some(w1b), Some(w2a), Some(w2b)) => {
                Some(Weights::LoHa { w1a, w1b, w2a, w2b, t1: take(HadaT1), t2: take(HadaT2) })
            }
            _ => None,
        }
    } else if lokr {
        let factor = |whole: Option<Tensor>, a: Option<Tensor>, b: Option<Tensor>| match (whole, a, b) {
            (Some(w), None, None) => Some(Factor::Full(w)),
            (None, Some(a), Some(b)) => Some(Factor::Product(a, b)),
            _ => None,
        };
        let w1 = factor(take(LokrW1), take(LokrW1A), take(LokrW1B));
        let w2 = factor(take(LokrW2), take(LokrW2A), take(LokrW2B));
        match (w1, w2) {
            (Some(w1), Some(w2)) => Some(Weights::LoKr { w1, w2, t2: take(LokrT2) }),
            _ => None,
        }
    } else {
        None
    };
    // Parts left over mean a mix of kinds (say, `lora_up` beside `hada_w1_a`), which no A1111 module type accepts.
    let (Some(weights), true) = (weights, parts.is_empty()) else {
        let reason = if found.is_empty() {
            "has alpha/scale but no weights".to_string()
        } else {
            format!("incomplete or mixed module; found {}", found.join(", "))
        };
        return Err(LoraError::Malformed { path: path.to_path_buf(), key: module_key, reason });
    };

    // Validated before anything reads a dimension (the rank below) of tensors that came from the file.
    weights.natural_shape().map_err(|reason| LoraError::Malformed {
        path: path.to_path_buf(),
        key: module_key.clone(),
        reason,
    })?;
    let (alpha, scale, from_metadata) = match (&name, alpha, scale, adapter) {
        (ModuleName::Diffusers { network, path: module_path }, None, None, Some(adapter)) => {
            let (alpha, scale) = adapter.alpha_scale(*network, module_path, weights.rank());
            (alpha, scale, alpha.is_some() || scale.is_some())
        }
        _ => (alpha, scale, false),
    };
    Ok(LoraModule { key: module_key, name, alpha, scale, scale_from_metadata: from_metadata, weights })
}

/// diffusers/PEFT adapter configs from the `lora_adapter_metadata` metadata field: PEFT `LoraConfig` dicts, either
/// one for the whole file (a model's `save_lora_adapter`), per component under `unet.` / `text_encoder.` key
/// prefixes (a pipeline's `save_lora_weights`), or nested per component.
struct AdapterMetadata {
    root: serde_json::Map<String, serde_json::Value>,
}

const ADAPTER_FIELD: &str = "lora_adapter_metadata";

impl AdapterMetadata {
    fn parse(path: &Path, metadata: &BTreeMap<String, String>) -> Result<Option<Self>, LoraError> {
        let Some(raw) = metadata.get(ADAPTER_FIELD) else { return Ok(None) };
        let bad = |reason: String| LoraError::Metadata {
            path: path.to_path_buf(),
            field: ADAPTER_FIELD.into(),
            reason,
        };
        match serde_json::from_str(raw).map_err(|e| bad(format!("not JSON: {e}")))? {
            serde_json::Value::Object(root) => Ok(Some(AdapterMetadata { root })),
            _ => Err(bad("not a JSON object".into())),
        }
    }

    /// The adapter config that applies to `network` (the denoiser is `unet`, or SD3's `transformer`).
    fn config(&self, network: Network) -> Option<serde_json::Map<String, serde_json::Value>> {
        let components: &[&str] = match network {
            Network::Unet => &["unet", "transformer"],
            Network::TextEncoder(0) => &["text_encoder"],
            Network::TextEncoder(1) => &["text_encoder_2"],
            Network::TextEncoder(_) => return None,
        };
        for component in components {
            if let Some(serde_json::Value::Object(nested)) = self.root.get(*component) {
                return Some(nested.clone());
            }
            let prefix = format!("{component}.");
            let prefixed: serde_json::Map<_, _> = self
                .root
                .iter()
                .filter_map(|(k, v)| Some((k.strip_prefix(&prefix)?.to_string(), v.clone())))
                .collect();
            if !prefixed.is_empty() {
                return Some(prefixed);
            }
        }
        (self.root.contains_key("lora_alpha") || self.root.contains_key("r")).then(|| self.root.clone())
    }

    /// `(alpha, scale)` for a module: `alpha_pattern` entry matching the module path, else `lora_alpha`; rsLoRA
    /// configs scale by alpha/√rank, given as an explicit scale.
    fn alpha_scale(&self, network: Network, module: &str, rank: Option<usize>) -> (Option<f32>, Option<f32>) {
        let Some(config) = self.config(network) else { return (None, None) };
        // PEFT matches pattern keys against the end of the module path at a `.` boundary; patterns here are module
        // names, so exact and suffix matches cover them.
        let pattern = config.get("alpha_pattern").and_then(|p| p.as_object()).and_then(|patterns| {
            patterns
                .iter()
                .find(|(pat, _)| module == *pat || module.ends_with(&format!(".{pat}")))
                .map(|(_, v)| v)
        });
        let alpha = pattern.or_else(|| config.get("lora_alpha")).and_then(|a| a.as_f64()).map(|a| a as f32);
        let rslora = config.get("use_rslora").and_then(|v| v.as_bool()).unwrap_or(false);
        match (alpha, rank, rslora) {
            (Some(alpha), Some(rank), true) => (Some(alpha), Some(alpha / (rank as f32).sqrt())),
            _ => (alpha, None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::write_safetensors;

    type T = (&'static str, Vec<usize>, Vec<f32>);

    fn t(key: &'static str, shape: &[usize]) -> T {
        (key, shape.to_vec(), vec![0.5; shape.iter().product()])
    }

    fn write(tensors: &[T], metadata: &[(&str, &str)]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("my_lora.safetensors");
        write_safetensors(&path, tensors, metadata);
        (dir, path)
    }

    fn module<'a>(f: &'a LoraFile, key: &str) -> &'a LoraModule {
        f.modules.iter().find(|m| m.key == key).unwrap_or_else(|| panic!("no module {key}"))
    }

    #[test]
    fn every_kind_is_recognised() {
        let (_d, path) = write(
            &[
                t("lora_unet_a.lora_up.weight", &[4, 2]),
                t("lora_unet_a.lora_down.weight", &[2, 4]),
                ("lora_unet_a.alpha", vec![], vec![1.0]),
                t("lora_unet_b.lora_up.weight", &[4, 2, 1, 1]),
                t("lora_unet_b.lora_down.weight", &[2, 4, 1, 1]),
                t("lora_unet_b.lora_mid.weight", &[2, 2, 3, 3]),
                t("lora_unet_c.hada_w1_a", &[4, 2]),
                t("lora_unet_c.hada_w1_b", &[2, 4]),
                t("lora_unet_c.hada_w2_a", &[4, 2]),
                t("lora_unet_c.hada_w2_b", &[2, 4]),
                t("lora_unet_d.hada_w1_a", &[2, 4]),
                t("lora_unet_d.hada_w1_b", &[2, 4]),
                t("lora_unet_d.hada_t1", &[2, 2, 3, 3]),
                t("lora_unet_d.hada_w2_a", &[2, 4]),
                t("lora_unet_d.hada_w2_b", &[2, 4]),
                t("lora_unet_d.hada_t2", &[2, 2, 3, 3]),
                t("lora_unet_e.lokr_w1", &[2, 2]),
                t("lora_unet_e.lokr_w2_a", &[2, 1]),
                t("lora_unet_e.lokr_w2_b", &[1, 2]),
                t("lora_unet_f.lokr_w1_a", &[2, 1]),
                t("lora_unet_f.lokr_w1_b", &[1, 2]),
                // Tucker: w2_a and w2_b are (rank, out) and (rank, in).
                t("lora_unet_f.lokr_w2_a", &[1, 2]),
                t("lora_unet_f.lokr_w2_b", &[1, 2]),
                t("lora_unet_f.lokr_t2", &[1, 1, 3, 3]),
            ],
            &[("ss_network_module", "lycoris.kohya")],
        );
        let f = LoraFile::read(&path).unwrap();
        assert_eq!(f.modules.len(), 6);
        assert_eq!(f.metadata["ss_network_module"], "lycoris.kohya");
        let kinds: Vec<(&str, ModuleKind)> = f.modules.iter().map(|m| (m.key.as_str(), m.kind())).collect();
        assert_eq!(
            kinds,
            vec![
                ("lora_unet_a", ModuleKind::Lora { tucker: false }),
                ("lora_unet_b", ModuleKind::Lora { tucker: true }),
                ("lora_unet_c", ModuleKind::LoHa { tucker: false }),
                ("lora_unet_d", ModuleKind::LoHa { tucker: true }),
                ("lora_unet_e", ModuleKind::LoKr),
                ("lora_unet_f", ModuleKind::LoKr),
            ]
        );
        let a = module(&f, "lora_unet_a");
        assert_eq!((a.alpha, a.rank(), a.scale()), (Some(1.0), Some(2), 0.5));
        assert_eq!(a.name, ModuleName::Kohya { network: Network::Unet, name: "a".into() });
        assert_eq!(module(&f, "lora_unet_b").scale(), 1.0);
        assert_eq!(module(&f, "lora_unet_e").rank(), Some(1));
    }

    #[test]
    fn natural_shapes_come_from_the_file_alone() {
        let (_d, path) = write(
            &[
                t("lora_unet_a.lora_up.weight", &[5, 2]),
                t("lora_unet_a.lora_down.weight", &[2, 3]),
                t("lora_unet_b.lora_up.weight", &[4, 2, 1, 1]),
                t("lora_unet_b.lora_down.weight", &[2, 6, 3, 3]),
            ],
            &[],
        );
        let f = LoraFile::read(&path).unwrap();
        assert_eq!(f.natural_shape(module(&f, "lora_unet_a")).unwrap(), [5, 3]);
        assert_eq!(f.natural_shape(module(&f, "lora_unet_b")).unwrap(), [4, 6, 3, 3]);
    }

    #[test]
    fn network_prefixes() {
        let (_d, path) = write(
            &[
                t("lora_te_x.lora_up.weight", &[2, 1]),
                t("lora_te_x.lora_down.weight", &[1, 2]),
                t("lora_te1_y.lora_up.weight", &[2, 1]),
                t("lora_te1_y.lora_down.weight", &[1, 2]),
                t("lora_te2_z.lora_up.weight", &[2, 1]),
                t("lora_te2_z.lora_down.weight", &[1, 2]),
                t("text_encoder_2.m.lora_B.weight", &[2, 1]),
                t("text_encoder_2.m.lora_A.weight", &[1, 2]),
                t("text_encoder.n.lora_B.weight", &[2, 1]),
                t("text_encoder.n.lora_A.weight", &[1, 2]),
                t("down_blocks.0.o.lora_B.weight", &[2, 1]),
                t("down_blocks.0.o.lora_A.weight", &[1, 2]),
            ],
            &[],
        );
        let f = LoraFile::read(&path).unwrap();
        let names: Vec<&ModuleName> = f.modules.iter().map(|m| &m.name).collect();
        let k = |network, name: &str| ModuleName::Kohya { network, name: name.into() };
        let d = |network, path: &str| ModuleName::Diffusers { network, path: path.into() };
        assert_eq!(
            names,
            vec![
                &d(Network::Unet, "down_blocks.0.o"),
                &k(Network::TextEncoder(0), "y"),
                &k(Network::TextEncoder(1), "z"),
                &k(Network::TextEncoder(0), "x"),
                &d(Network::TextEncoder(0), "n"),
                &d(Network::TextEncoder(1), "m"),
            ]
        );
    }

    #[test]
    fn dora_is_refused() {
        for key in ["lora_unet_a.dora_scale", "unet.a.lora_magnitude_vector"] {
            let (_d, path) = write(
                &[
                    t("lora_unet_a.lora_up.weight", &[2, 1]),
                    t("lora_unet_a.lora_down.weight", &[1, 2]),
                    t(key, &[2]),
                ],
                &[],
            );
            let err = LoraFile::read(&path).unwrap_err();
            assert!(matches!(&err, LoraError::Dora { key: k, .. } if k == key), "{err}");
            let msg = err.to_string();
            assert!(msg.contains("DoRA") && msg.contains("my_lora.safetensors"), "{msg}");
        }
    }

    #[test]
    fn unknown_tensors_are_refused_by_name() {
        for key in [
            "lora_unet_a.diff",
            "lora_unet_a.w_norm",
            "lora_unet_a.b_norm",
            "lora_unet_a.bias_indices",
            "unet.a.lora_B.bias",
            "lora_unet_a",
            "something_else",
        ] {
            let (_d, path) = write(
                &[
                    t("lora_unet_a.lora_up.weight", &[2, 1]),
                    t("lora_unet_a.lora_down.weight", &[1, 2]),
                    t(key, &[2]),
                ],
                &[],
            );
            let err = LoraFile::read(&path).unwrap_err();
            assert!(matches!(&err, LoraError::UnknownKey { key: k, .. } if k == key), "{key}: {err}");
            assert!(err.to_string().contains(key), "{err}");
        }
    }

    #[test]
    fn incomplete_or_mixed_modules_are_refused() {
        let cases: Vec<Vec<T>> = vec![
            vec![t("lora_unet_a.lora_up.weight", &[2, 1])],
            vec![("lora_unet_a.alpha", vec![], vec![1.0])],
            vec![t("lora_unet_a.hada_w1_a", &[2, 1]), t("lora_unet_a.hada_w1_b", &[1, 2])],
            vec![t("lora_unet_a.lokr_w1", &[2, 2])],
            vec![
                t("lora_unet_a.lora_up.weight", &[2, 1]),
                t("lora_unet_a.lora_down.weight", &[1, 2]),
                t("lora_unet_a.hada_w1_a", &[2, 1]),
            ],
            // Inner dimensions that do not multiply.
            vec![t("lora_unet_a.lora_up.weight", &[2, 3]), t("lora_unet_a.lora_down.weight", &[1, 2])],
            // Scalars where matrices belong.
            vec![
                ("lora_unet_a.lora_up.weight", vec![], vec![1.0]),
                ("lora_unet_a.lora_down.weight", vec![], vec![1.0]),
            ],
            vec![("unet.a.lora_B.weight", vec![], vec![1.0]), ("unet.a.lora_A.weight", vec![], vec![1.0])],
            // Two spellings of one part.
            vec![
                t("unet.a.lora_B.weight", &[2, 1]),
                t("unet.a.lora.up.weight", &[2, 1]),
                t("unet.a.lora_A.weight", &[1, 2]),
            ],
        ];
        for tensors in cases {
            let (_d, path) = write(&tensors, &[]);
            let err = LoraFile::read(&path).unwrap_err();
            assert!(matches!(err, LoraError::Malformed { .. }), "{tensors:?}: {err}");
        }
    }

    #[test]
    fn empty_file_and_bundled_embeddings() {
        let (_d, path) = write(&[], &[]);
        assert!(matches!(LoraFile::read(&path), Err(LoraError::Empty { .. })));
        let (_d, path) = write(
            &[
                t("lora_unet_a.lora_up.weight", &[2, 1]),
                t("lora_unet_a.lora_down.weight", &[1, 2]),
                t("bundle_emb.mytoken.string_to_param.*", &[1, 768]),
            ],
            &[],
        );
        let f = LoraFile::read(&path).unwrap();
        assert_eq!((f.modules.len(), f.bundled_embeddings.clone()), (1, vec!["mytoken".to_string()]));
    }

    fn peft(metadata: &[(&str, &str)], extra: &[T]) -> LoraFile {
        let mut tensors = vec![
            t("unet.down_blocks.0.attn.to_q.lora_A.weight", &[4, 8]),
            t("unet.down_blocks.0.attn.to_q.lora_B.weight", &[8, 4]),
            t("unet.down_blocks.0.attn.to_k.lora_A.weight", &[4, 8]),
            t("unet.down_blocks.0.attn.to_k.lora_B.weight", &[8, 4]),
            t("text_encoder.text_model.q_proj.lora_A.weight", &[4, 8]),
            t("text_encoder.text_model.q_proj.lora_B.weight", &[8, 4]),
        ];
        tensors.extend_from_slice(extra);
        let (d, path) = write(&tensors, metadata);
        let f = LoraFile::read(&path).unwrap();
        drop(d);
        f
    }

    fn scales(f: &LoraFile) -> Vec<(String, f32)> {
        f.modules.iter().map(|m| (m.key.clone(), m.scale())).collect()
    }

    #[test]
    fn peft_alpha_from_metadata() {
        // diffusers pipeline save: per-component prefixed config keys.
        let f = peft(
            &[(
                "lora_adapter_metadata",
                r#"{"unet.r": 4, "unet.lora_alpha": 8, "unet.alpha_pattern": {"down_blocks.0.attn.to_k": 2},
                    "text_encoder.r": 4, "text_encoder.lora_alpha": 1}"#,
            )],
            &[],
        );
        assert_eq!(
            scales(&f),
            vec![
                ("text_encoder.text_model.q_proj".to_string(), 0.25),
                ("unet.down_blocks.0.attn.to_k".to_string(), 0.5),
                ("unet.down_blocks.0.attn.to_q".to_string(), 2.0),
            ]
        );

        // Nested per component; a suffix pattern.
        let f = peft(
            &[(
                "lora_adapter_metadata",
                r#"{"unet": {"r": 4, "lora_alpha": 4, "alpha_pattern": {"to_q": 16}}}"#,
            )],
            &[],
        );
        assert_eq!(
            scales(&f)[1..],
            [("unet.down_blocks.0.attn.to_k".into(), 1.0), ("unet.down_blocks.0.attn.to_q".into(), 4.0)]
        );
        // No config for the text encoder: alpha = rank.
        assert_eq!(scales(&f)[0].1, 1.0);

        // A model's own save: one unprefixed config; rsLoRA scales by alpha/√r.
        let f = peft(&[("lora_adapter_metadata", r#"{"r": 4, "lora_alpha": 8, "use_rslora": true}"#)], &[]);
        assert!(scales(&f).iter().all(|(_, s)| (s - 4.0).abs() < 1e-6), "{:?}", scales(&f));

        // An `.alpha` tensor wins over metadata; no alpha anywhere is scale 1.
        let f = peft(
            &[("lora_adapter_metadata", r#"{"r": 4, "lora_alpha": 8}"#)],
            &[("unet.down_blocks.0.attn.to_q.alpha", vec![], vec![1.0])],
        );
        assert_eq!(scales(&f)[2].1, 0.25);
        assert!(scales(&peft(&[], &[])).iter().all(|(_, s)| *s == 1.0));
    }

    /// SD3 pipelines save the denoiser's config under `transformer.`, not `unet.`.
    #[test]
    fn peft_alpha_of_an_sd3_transformer() {
        let (_d, path) = write(
            &[
                t("transformer.transformer_blocks.1.attn.to_q.lora_A.weight", &[4, 8]),
                t("transformer.transformer_blocks.1.attn.to_q.lora_B.weight", &[8, 4]),
                t("transformer.proj_out.lora_A.weight", &[4, 8]),
                t("transformer.proj_out.lora_B.weight", &[8, 4]),
                t("text_encoder_2.text_model.fc1.lora_A.weight", &[4, 8]),
                t("text_encoder_2.text_model.fc1.lora_B.weight", &[8, 4]),
            ],
            &[(
                "lora_adapter_metadata",
                r#"{"transformer.r": 4, "transformer.lora_alpha": 8,
                    "transformer.alpha_pattern": {"transformer_blocks.1.attn.to_q": 2},
                    "text_encoder_2.r": 4, "text_encoder_2.lora_alpha": 6}"#,
            )],
        );
        let f = LoraFile::read(&path).unwrap();
        assert_eq!(
            scales(&f),
            vec![
                ("text_encoder_2.text_model.fc1".to_string(), 1.5),
                ("transformer.proj_out".to_string(), 2.0),
                ("transformer.transformer_blocks.1.attn.to_q".to_string(), 0.5),
            ]
        );
        assert_eq!(
            module(&f, "transformer.proj_out").name,
            ModuleName::Diffusers { network: Network::Unet, path: "proj_out".into() }
        );
    }

    #[test]
    fn bad_adapter_metadata_names_the_field() {
        let (_d, path) = write(
            &[t("unet.a.lora_A.weight", &[1, 2]), t("unet.a.lora_B.weight", &[2, 1])],
            &[("lora_adapter_metadata", "{not json")],
        );
        let err = LoraFile::read(&path).unwrap_err();
        assert!(
            matches!(&err, LoraError::Metadata { field, .. } if field == "lora_adapter_metadata"),
            "{err}"
        );
    }

    #[test]
    fn half_precision_tensors_are_read_as_f32() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.safetensors");
        let up = Tensor::new(&[[1.5f32], [-2.0]], &Device::Cpu).unwrap().to_dtype(DType::F16).unwrap();
        let down = Tensor::new(&[[0.25f32, 4.0]], &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        let map = HashMap::from([("lora_unet_a.lora_up.weight", up), ("lora_unet_a.lora_down.weight", down)]);
        candle_core::safetensors::save(&map, &path).unwrap();
        let f = LoraFile::read(&path).unwrap();
        let patch = crate::Patch {
            network: Network::Unet,
            target: "a.weight".into(),
            module: 0,
            rows: crate::Rows::All,
        };
        let d = f.delta(&patch, &[2, 2], &Device::Cpu).unwrap();
        assert_eq!(d.dtype(), DType::F32);
        assert_eq!(d.to_vec2::<f32>().unwrap(), vec![vec![0.375, 6.0], vec![-0.5, -8.0]]);
    }
}
