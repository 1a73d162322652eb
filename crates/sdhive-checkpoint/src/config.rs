//! diffusers-schema configs for a converted checkpoint: inferred from the structures the
//! component modules read off the tensors, completed with each family's published values for
//! what shapes cannot tell (attention heads, activations, scaling factor, scheduler), and
//! optionally overridden by a diffusers folder's own configs ([`ConfigDir`]), which win.

use crate::clip::ClipStructure;
use crate::error::{CheckpointError, ConfigMismatch, Result};
use crate::layout::Family;
use crate::prediction::PredictionType;
use crate::unet::UnetStructure;
use crate::vae::VaeStructure;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A pipeline component that has a config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Component {
    Unet,
    Vae,
    TextEncoder,
    TextEncoder2,
    Scheduler,
}

impl Component {
    pub const ALL: [Component; 5] = [
        Component::Unet,
        Component::Vae,
        Component::TextEncoder,
        Component::TextEncoder2,
        Component::Scheduler,
    ];

    /// The component's sub-folder in a diffusers pipeline folder.
    pub fn subfolder(self) -> &'static str {
        match self {
            Component::Unet => "unet",
            Component::Vae => "vae",
            Component::TextEncoder => "text_encoder",
            Component::TextEncoder2 => "text_encoder_2",
            Component::Scheduler => "scheduler",
        }
    }

    /// The config file name inside the sub-folder.
    pub fn config_file(self) -> &'static str {
        match self {
            Component::Scheduler => "scheduler_config.json",
            _ => "config.json",
        }
    }
}

/// Configs that win over inference, like diffusers' `from_single_file(config=<folder>)`.
///
/// Each present config is laid over the inferred one key by key (the override's value wins;
/// keys it lacks keep the inferred value). Structural keys that contradict the checkpoint
/// (channels, layers, widths) are rejected rather than producing a model that cannot load,
/// with one deliberate exception: a text encoder config may ask for fewer layers than the
/// checkpoint holds (SD2 publishes 23 of OpenCLIP-H's 24), and the surplus layers are dropped.
#[derive(Debug, Clone, Default)]
pub struct ConfigDir {
    root: Option<PathBuf>,
    configs: BTreeMap<Component, (Value, String)>,
}

impl ConfigDir {
    /// No overrides yet; add some with [`ConfigDir::with`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads `<dir>/{unet,vae,text_encoder,text_encoder_2}/config.json` and
    /// `<dir>/scheduler/scheduler_config.json`, whichever exist. At least one must.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(CheckpointError::ConfigDir {
                path: dir.to_path_buf(),
                reason: "not a directory".into(),
            });
        }
        let mut configs = BTreeMap::new();
        for c in Component::ALL {
            let path = dir.join(c.subfolder()).join(c.config_file());
            if !path.is_file() {
                continue;
            }
            let text = std::fs::read_to_string(&path)
                .map_err(|source| CheckpointError::ConfigIo { path: path.clone(), source })?;
            let value: Value = serde_json::from_str(&text)
                .map_err(|source| CheckpointError::ConfigParse { path: path.clone(), source })?;
            if !value.is_object() {
                return Err(CheckpointError::ConfigDir {
                    path,
                    reason: "config is not a JSON object".into(),
                });
            }
            configs.insert(c, (value, path.display().to_string()));
        }
        if configs.is_empty() {
            return Err(CheckpointError::ConfigDir {
                path: dir.to_path_buf(),
                reason: "no unet/vae/text_encoder/text_encoder_2/scheduler config found".into(),
            });
        }
        Ok(Self { root: Some(dir.to_path_buf()), configs })
    }

    /// Adds (or replaces) one component's override config.
    pub fn with(mut self, component: Component, config: Value) -> Self {
        let origin = format!("{} override config", component.subfolder());
        self.configs.insert(component, (config, origin));
        self
    }

    pub fn get(&self, component: Component) -> Option<&Value> {
        self.configs.get(&component).map(|(v, _)| v)
    }

    /// The folder this was read from, if any.
    pub fn root(&self) -> Option<&Path> {
        self.root.as_deref()
    }

    pub(crate) fn entry(&self, component: Component) -> Option<(&Value, &str)> {
        self.configs.get(&component).map(|(v, o)| (v, o.as_str()))
    }
}

/// The configs of a converted checkpoint, in diffusers' `config.json` schema.
#[derive(Debug, Clone, PartialEq)]
pub struct Configs {
    pub unet: Value,
    pub vae: Value,
    pub text_encoder: Value,
    pub text_encoder_2: Option<Value>,
    pub scheduler: Value,
}

impl Configs {
    pub fn get(&self, component: Component) -> Option<&Value> {
        match component {
            Component::Unet => Some(&self.unet),
            Component::Vae => Some(&self.vae),
            Component::TextEncoder => Some(&self.text_encoder),
            Component::TextEncoder2 => self.text_encoder_2.as_ref(),
            Component::Scheduler => Some(&self.scheduler),
        }
    }
}

/// Heads for a width when the family fixes the head size (SD2, SDXL, OpenCLIP and CLIP all
/// use 64). Narrower-than-published test models get the largest head count that divides.
pub(crate) fn heads_for_head_dim(width: usize, head_dim: usize) -> usize {
    let mut heads = (width / head_dim).max(1);
    while heads > 1 && width % heads != 0 {
        heads -= 1;
    }
    heads
}

/// GroupNorm group count: the published 32, or for narrow test models the largest count
/// below it that divides every normalised width (a model with 32 groups could not exist).
pub(crate) fn norm_groups(channels: &[usize]) -> usize {
    (1..=32).rev().find(|g| channels.iter().all(|c| c % g == 0)).unwrap_or(1)
}

/// Inputs to the UNet config that come from other components or the caller.
pub(crate) struct UnetContext {
    pub family: Family,
    /// SDXL: width of the pooled text embedding fed to `add_embedding`.
    pub pooled_dim: Option<usize>,
    pub v_prediction: bool,
}

pub(crate) fn unet_config(s: &UnetStructure, cx: &UnetContext) -> Result<Value, String> {
    let n = s.block_out_channels.len();
    let heads: Value = match cx.family {
        // SD1.x publishes `attention_head_dim: 8`, which diffusers reads as 8 heads per block.
        Family::Sd1 => json!(8),
        Family::Sd2 | Family::Sdxl => {
            json!(s.block_out_channels.iter().map(|c| heads_for_head_dim(*c, 64)).collect::<Vec<_>>())
        }
    };
    // diffusers gives the mid block the last entry of transformer_layers_per_block; a down
    // block without attention ignores its entry, so that slot can carry the mid depth.
    let mut depth: Vec<usize> = s.down_depth.iter().map(|d| d.unwrap_or(1)).collect();
    if let (Some(mid), Some(last)) = (s.mid_depth, s.down_depth.last()) {
        match last {
            None => depth[n - 1] = mid,
            Some(d) if *d != mid => {
                return Err(format!(
                    "the mid block has {mid} transformer layers but the last down block {d}; \
                     diffusers' UNet2DConditionModel cannot express that"
                ))
            }
            Some(_) => {}
        }
    }
    let reversed: Vec<usize> = depth.iter().rev().copied().collect();
    let asymmetric = s.up_depth.iter().zip(&reversed).any(|(layers, want)| layers.iter().any(|d| d != want));
    let reverse_depth: Value = if asymmetric {
        json!(s
            .up_depth
            .iter()
            .zip(&reversed)
            .zip(&s.layers_per_block.iter().rev().collect::<Vec<_>>())
            .map(|((layers, want), lpb)| if layers.is_empty() {
                vec![*want; **lpb + 1]
            } else {
                layers.clone()
            })
            .collect::<Vec<_>>())
    } else {
        Value::Null
    };
    let types = |attn: &[bool], cross: &str, plain: &str| -> Vec<String> {
        attn.iter().map(|a| if *a { cross } else { plain }.to_string()).collect()
    };
    let (addition_embed_type, addition_time_embed_dim) = match (s.adm_in_channels, cx.pooled_dim) {
        (Some(adm), Some(pooled)) if adm > pooled && (adm - pooled) % 6 == 0 => {
            // text_time: pooled text embedding, then six sinusoidal micro-conditioning values
            // (original size, crop offset, target size), each `addition_time_embed_dim` wide.
            (json!("text_time"), json!((adm - pooled) / 6))
        }
        (Some(adm), pooled) => {
            return Err(format!(
                "label_emb takes {adm} inputs, which is not the pooled text width {pooled:?} plus six equal \
                 time-embedding slots"
            ))
        }
        (None, _) => (Value::Null, Value::Null),
    };
    let sample_size = match cx.family {
        Family::Sd1 => 64,
        Family::Sd2 if cx.v_prediction => 96,
        Family::Sd2 => 64,
        Family::Sdxl => 128,
    };
    let c0 = s.block_out_channels.first().copied().unwrap_or(0);
    // Two literals: one would exceed serde_json's macro recursion limit.
    let mut config = json!({
        "_class_name": "UNet2DConditionModel",
        "act_fn": "silu",
        "addition_embed_type": addition_embed_type,
        "addition_embed_type_num_heads": 64,
        "addition_time_embed_dim": addition_time_embed_dim,
        "attention_head_dim": heads,
        "attention_type": "default",
        "block_out_channels": s.block_out_channels,
        "center_input_sample": false,
        "class_embed_type": null,
        "class_embeddings_concat": false,
        "conv_in_kernel": s.conv_in_kernel,
        "conv_out_kernel": s.conv_out_kernel,
        "cross_attention_dim": s.cross_attention_dim,
        "cross_attention_norm": null,
        "down_block_types": types(&s.down_attention, "CrossAttnDownBlock2D", "DownBlock2D"),
        "downsample_padding": 1,
        "dropout": 0.0,
        "dual_cross_attention": false,
        "encoder_hid_dim": null,
        "encoder_hid_dim_type": null,
        "flip_sin_to_cos": true,
        "freq_shift": 0,
    });
    let rest = json!({
        "in_channels": s.in_channels,
        "layers_per_block": int_or_list(&s.layers_per_block),
        "mid_block_only_cross_attention": null,
        "mid_block_scale_factor": 1,
        "mid_block_type": if s.mid_depth.is_some() { "UNetMidBlock2DCrossAttn" } else { "UNetMidBlock2D" },
        "norm_eps": 1e-5,
        "norm_num_groups": norm_groups(&s.norm_channels),
        "num_attention_heads": null,
        "num_class_embeds": null,
        "only_cross_attention": false,
        "out_channels": s.out_channels,
        "projection_class_embeddings_input_dim": s.adm_in_channels,
        "resnet_out_scale_factor": 1.0,
        "resnet_skip_time_act": false,
        "resnet_time_scale_shift": "default",
        "reverse_transformer_layers_per_block": reverse_depth,
        "sample_size": sample_size,
        "time_cond_proj_dim": null,
        "time_embedding_act_fn": null,
        "time_embedding_dim": if s.time_embed_dim == 4 * c0 { Value::Null } else { json!(s.time_embed_dim) },
        "time_embedding_type": "positional",
        "timestep_post_act": null,
        "transformer_layers_per_block": int_or_list(&depth),
        "up_block_types": types(&s.up_attention, "CrossAttnUpBlock2D", "UpBlock2D"),
        // SD2.1-768-v is published with upcast attention: its fp16 softmax overflows otherwise.
        "upcast_attention": cx.family == Family::Sd2 && cx.v_prediction,
        "use_linear_projection": s.linear_projection.unwrap_or(false),
    });
    overlay(&mut config, &rest);
    Ok(config)
}

pub(crate) fn vae_config(s: &VaeStructure, family: Family, v_prediction: bool) -> Value {
    let n = s.block_out_channels.len();
    let (sample_size, scaling_factor) = match family {
        Family::Sd1 => (512, 0.18215),
        Family::Sd2 if v_prediction => (768, 0.18215),
        Family::Sd2 => (512, 0.18215),
        // SDXL retrained its VAE; the latent scale changed with it.
        Family::Sdxl => (1024, 0.13025),
    };
    json!({
        "_class_name": "AutoencoderKL",
        "act_fn": "silu",
        "block_out_channels": s.block_out_channels,
        "down_block_types": vec!["DownEncoderBlock2D"; n],
        "force_upcast": true,
        "in_channels": s.in_channels,
        "latent_channels": s.latent_channels,
        "latents_mean": null,
        "latents_std": null,
        "layers_per_block": s.layers_per_block,
        "mid_block_add_attention": s.mid_attention,
        "norm_num_groups": norm_groups(&s.norm_channels),
        "out_channels": s.out_channels,
        "sample_size": sample_size,
        "scaling_factor": scaling_factor,
        "shift_factor": null,
        "up_block_types": vec!["UpDecoderBlock2D"; n],
        "use_post_quant_conv": s.post_quant_conv,
        "use_quant_conv": s.quant_conv,
    })
}

/// Which published text tower a checkpoint tower stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TowerRole {
    /// OpenAI CLIP ViT-L/14 (SD1.x, SDXL's first encoder).
    ClipL,
    /// SD2's OpenCLIP ViT-H/14, published without its final block.
    OpenClipH,
    /// SDXL's OpenCLIP ViT-bigG/14, with projection.
    OpenClipBigG,
}

impl TowerRole {
    /// Layers the published config keeps out of those in the checkpoint.
    pub fn published_layers(self, in_checkpoint: usize) -> usize {
        match self {
            // SD2 conditions on the penultimate block, so the diffusers port drops the last.
            TowerRole::OpenClipH => in_checkpoint.saturating_sub(1).max(1),
            _ => in_checkpoint,
        }
    }
}

pub(crate) fn clip_config(s: &ClipStructure, role: TowerRole) -> Value {
    let (architecture, act) = match role {
        TowerRole::ClipL => ("CLIPTextModel", "quick_gelu"),
        TowerRole::OpenClipH => ("CLIPTextModel", "gelu"),
        TowerRole::OpenClipBigG => ("CLIPTextModelWithProjection", "gelu"),
    };
    json!({
        "architectures": [architecture],
        "attention_dropout": 0.0,
        // The published SD configs keep CLIP's original ids 0/2/1; with eos_token_id 2
        // transformers pools at the highest token id (the end-of-text token), as SD did.
        "bos_token_id": 0,
        "dropout": 0.0,
        "eos_token_id": 2,
        "hidden_act": act,
        "hidden_size": s.hidden_size,
        "initializer_factor": 1.0,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate_size,
        "layer_norm_eps": 1e-5,
        "max_position_embeddings": s.max_position_embeddings,
        "model_type": "clip_text_model",
        "num_attention_heads": heads_for_head_dim(s.hidden_size, 64),
        "num_hidden_layers": role.published_layers(s.layers),
        "pad_token_id": 1,
        "projection_dim": s.projection_dim.unwrap_or(s.hidden_size),
        "vocab_size": s.vocab_size,
    })
}

pub(crate) fn scheduler_config(
    family: Family,
    prediction: PredictionType,
    num_train_timesteps: usize,
) -> Value {
    let mut v = json!({
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "beta_start": 0.00085,
        "clip_sample": false,
        "num_train_timesteps": num_train_timesteps,
        "prediction_type": prediction.as_diffusers(),
        "set_alpha_to_one": false,
        "steps_offset": 1,
        "timestep_spacing": "leading",
        "trained_betas": null,
    });
    let extra = match family {
        Family::Sd1 => json!({"_class_name": "PNDMScheduler", "skip_prk_steps": true}),
        Family::Sd2 => json!({"_class_name": "DDIMScheduler"}),
        Family::Sdxl => json!({
            "_class_name": "EulerDiscreteScheduler",
            "interpolation_type": "linear",
            "sample_max_value": 1.0,
            "skip_prk_steps": true,
            "use_karras_sigmas": false,
        }),
    };
    overlay(&mut v, &extra);
    v
}

fn int_or_list(v: &[usize]) -> Value {
    match v.first() {
        Some(first) if v.iter().all(|x| x == first) => json!(first),
        _ => json!(v),
    }
}

/// Lays `over`'s keys onto `base` (objects only; `over` wins).
pub(crate) fn overlay(base: &mut Value, over: &Value) {
    if let (Some(b), Some(o)) = (base.as_object_mut(), over.as_object()) {
        for (k, v) in o {
            b.insert(k.clone(), v.clone());
        }
    }
}

/// The VAE config keys an override must agree with the checkpoint on (its shapes decide them).
pub(crate) const VAE_STRUCTURE: [(&str, Check); 5] = [
    ("in_channels", Check::Exact),
    ("out_channels", Check::Exact),
    ("latent_channels", Check::Exact),
    ("block_out_channels", Check::Exact),
    ("layers_per_block", Check::Exact),
];

/// How to compare one structural key between an override and the checkpoint.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Check {
    /// Values must be equal as JSON.
    Exact,
    /// An int means "this value for each of `n` blocks"; compared expanded.
    PerBlock { n: usize },
    /// As `PerBlock`, at the block positions set in `mask` only (the others are unused).
    PerBlockAt { n: usize, mask: u64 },
    /// A boolean that a missing key means `false`.
    Flag,
}

/// Rejects an override whose `keys` contradict what the checkpoint holds.
pub(crate) fn validate(
    origin: &str,
    checkpoint: &Path,
    inferred: &Value,
    over: &Value,
    keys: &[(&str, Check)],
) -> Result<()> {
    for (key, check) in keys {
        let Some(ov) = over.get(*key) else { continue };
        let inf = inferred.get(*key).unwrap_or(&Value::Null);
        if inf.is_null() {
            continue;
        }
        let same = match check {
            Check::Exact => ov == inf,
            Check::Flag => ov.as_bool().unwrap_or(false) == inf.as_bool().unwrap_or(false),
            Check::PerBlock { n } => expand(ov, *n).zip(expand(inf, *n)).is_none_or(|(a, b)| a == b),
            Check::PerBlockAt { n, mask } => expand(ov, *n).zip(expand(inf, *n)).is_none_or(|(a, b)| {
                a.iter().zip(&b).enumerate().all(|(i, (x, y))| mask & (1 << i) == 0 || x == y)
            }),
        };
        if !same {
            return Err(CheckpointError::ConfigMismatch(Box::new(ConfigMismatch {
                origin: origin.to_string(),
                key: key.to_string(),
                config_value: ov.to_string(),
                checkpoint: checkpoint.to_path_buf(),
                checkpoint_value: inf.to_string(),
            })));
        }
    }
    Ok(())
}

/// Per-block view of an int-or-list value; `None` for shapes we do not compare (nested lists).
fn expand(v: &Value, n: usize) -> Option<Vec<u64>> {
    match v {
        Value::Number(x) => x.as_u64().map(|x| vec![x; n]),
        Value::Array(a) => a.iter().map(Value::as_u64).collect(),
        _ => None,
    }
}

/// Builds the final config: inferred values, the override's keys on top.
pub(crate) fn resolve(inferred: Value, over: Option<&Value>) -> Value {
    let mut out = inferred;
    if let Some(o) = over {
        overlay(&mut out, o);
    }
    if let Value::Object(map) = &mut out {
        // Stable key order makes configs diffable when written out.
        let sorted: Map<String, Value> =
            std::mem::take(map).into_iter().collect::<BTreeMap<_, _>>().into_iter().collect();
        *map = sorted;
    }
    out
}

#[cfg(test)]
mod tests {
    //! The family rules must reproduce the published diffusers configs at full size; the
    //! fixtures only exercise them at toy widths.
    use super::*;

    fn structure(
        channels: &[usize],
        attn: &[bool],
        depth: &[usize],
        mid: usize,
        cross: usize,
        linear: bool,
    ) -> UnetStructure {
        let n = channels.len();
        UnetStructure {
            in_channels: 4,
            out_channels: 4,
            conv_in_kernel: 3,
            conv_out_kernel: 3,
            block_out_channels: channels.to_vec(),
            layers_per_block: vec![2; n],
            down_attention: attn.to_vec(),
            up_attention: attn.iter().rev().copied().collect(),
            down_depth: attn.iter().zip(depth).map(|(a, d)| a.then_some(*d)).collect(),
            up_depth: attn
                .iter()
                .zip(depth)
                .rev()
                .map(|(a, d)| if *a { vec![*d; 3] } else { vec![] })
                .collect(),
            mid_depth: Some(mid),
            cross_attention_dim: Some(cross),
            linear_projection: Some(linear),
            time_embed_dim: 4 * channels[0],
            adm_in_channels: None,
            norm_channels: channels.to_vec(),
        }
    }

    #[test]
    fn sd15_unet_matches_published() {
        let s = structure(&[320, 640, 1280, 1280], &[true, true, true, false], &[1, 1, 1, 1], 1, 768, false);
        let cx = UnetContext { family: Family::Sd1, pooled_dim: None, v_prediction: false };
        let c = unet_config(&s, &cx).expect("config");
        assert_eq!(c["attention_head_dim"], json!(8));
        assert_eq!(c["transformer_layers_per_block"], json!(1));
        assert_eq!(
            c["down_block_types"],
            json!(["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"])
        );
        assert_eq!(
            c["up_block_types"],
            json!(["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"])
        );
        assert_eq!(c["reverse_transformer_layers_per_block"], Value::Null);
        assert_eq!(c["time_embedding_dim"], Value::Null);
        assert_eq!(c["norm_num_groups"], json!(32));
        assert_eq!(c["sample_size"], json!(64));
        assert_eq!(c["use_linear_projection"], json!(false));
    }

    #[test]
    fn sd21_unet_matches_published() {
        let s = structure(&[320, 640, 1280, 1280], &[true, true, true, false], &[1, 1, 1, 1], 1, 1024, true);
        let cx = UnetContext { family: Family::Sd2, pooled_dim: None, v_prediction: true };
        let c = unet_config(&s, &cx).expect("config");
        assert_eq!(c["attention_head_dim"], json!([5, 10, 20, 20]));
        assert_eq!(c["use_linear_projection"], json!(true));
        assert_eq!(c["upcast_attention"], json!(true));
        assert_eq!(c["sample_size"], json!(96));
    }

    #[test]
    fn sdxl_unet_matches_published() {
        let mut s = structure(&[320, 640, 1280], &[false, true, true], &[1, 2, 10], 10, 2048, true);
        s.adm_in_channels = Some(2816);
        let cx = UnetContext { family: Family::Sdxl, pooled_dim: Some(1280), v_prediction: false };
        let c = unet_config(&s, &cx).expect("config");
        assert_eq!(c["attention_head_dim"], json!([5, 10, 20]));
        assert_eq!(c["transformer_layers_per_block"], json!([1, 2, 10]));
        assert_eq!(c["addition_embed_type"], json!("text_time"));
        assert_eq!(c["addition_time_embed_dim"], json!(256));
        assert_eq!(c["projection_class_embeddings_input_dim"], json!(2816));
        assert_eq!(c["sample_size"], json!(128));

        s.adm_in_channels = Some(2817);
        assert!(unet_config(&s, &cx).is_err(), "label_emb width must be pooled + 6 slots");
    }

    #[test]
    fn mid_depth_rides_on_an_attention_free_last_block() {
        let s = structure(&[32, 64], &[true, false], &[1, 1], 3, 32, false);
        let cx = UnetContext { family: Family::Sd1, pooled_dim: None, v_prediction: false };
        assert_eq!(unet_config(&s, &cx).expect("config")["transformer_layers_per_block"], json!([1, 3]));
        let s = structure(&[32, 64], &[true, true], &[1, 2], 3, 32, false);
        assert!(unet_config(&s, &cx).is_err(), "diffusers cannot give the mid block its own depth");
    }

    #[test]
    fn text_towers_match_published() {
        let clip = |hidden, inter, layers, proj| ClipStructure {
            vocab_size: 49408,
            hidden_size: hidden,
            intermediate_size: inter,
            max_position_embeddings: 77,
            layers,
            projection_dim: proj,
        };
        let l = clip_config(&clip(768, 3072, 12, None), TowerRole::ClipL);
        assert_eq!(
            (l["num_attention_heads"].clone(), l["hidden_act"].clone()),
            (json!(12), json!("quick_gelu"))
        );
        let h = clip_config(&clip(1024, 4096, 24, Some(1024)), TowerRole::OpenClipH);
        assert_eq!(
            (h["num_attention_heads"].clone(), h["num_hidden_layers"].clone()),
            (json!(16), json!(23))
        );
        let g = clip_config(&clip(1280, 5120, 32, Some(1280)), TowerRole::OpenClipBigG);
        assert_eq!(g["num_attention_heads"], json!(20));
        assert_eq!(g["num_hidden_layers"], json!(32));
        assert_eq!(g["architectures"], json!(["CLIPTextModelWithProjection"]));
        assert_eq!(g["projection_dim"], json!(1280));
    }

    #[test]
    fn narrow_widths_get_valid_heads_and_groups() {
        assert_eq!(heads_for_head_dim(32, 64), 1);
        assert_eq!(heads_for_head_dim(96, 64), 1);
        assert_eq!(heads_for_head_dim(1280, 64), 20);
        assert_eq!(norm_groups(&[128, 256, 512]), 32);
        assert_eq!(norm_groups(&[16, 32]), 16);
        assert_eq!(norm_groups(&[24]), 24);
    }

    #[test]
    fn overrides_win_and_contradictions_are_caught() {
        let inferred = json!({"block_out_channels": [32, 64], "layers_per_block": 2, "norm_num_groups": 32});
        let over = json!({"layers_per_block": [2, 2], "norm_num_groups": 8});
        let checks = [("block_out_channels", Check::Exact), ("layers_per_block", Check::PerBlock { n: 2 })];
        validate("o", Path::new("c"), &inferred, &over, &checks).expect("int and list agree");
        let merged = resolve(inferred.clone(), Some(&over));
        assert_eq!(merged["norm_num_groups"], json!(8));
        assert_eq!(merged["block_out_channels"], json!([32, 64]));
        let bad = json!({"layers_per_block": 3});
        assert!(validate("o", Path::new("c"), &inferred, &bad, &checks).is_err());
        let masked = [("t", Check::PerBlockAt { n: 2, mask: 0b10 })];
        let inf = json!({"t": [1, 2]});
        validate("o", Path::new("c"), &inf, &json!({"t": [7, 2]}), &masked).expect("unused slot is free");
        assert!(validate("o", Path::new("c"), &inf, &json!({"t": 1}), &masked).is_err());
    }
}
