//! SD3 / SD3.5 single files in Stability's layout (`model.diffusion_model.joint_blocks.*`, `first_stage_model.*`,
//! `text_encoders.{clip_l,clip_g,t5xxl}.transformer.*`) as diffusers-named tensors per component, converted as
//! diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`, `convert_ldm_vae_checkpoint`,
//! `convert_ldm_clip_checkpoint` and `convert_sd3_t5_checkpoint_to_diffusers` do, and their configs.
//!
//! Configs come from a diffusers folder when one is given (diffusers' `from_single_file(config=…)`), checked
//! against the shapes; otherwise they are inferred. Read off the shapes: the MMDiT's width, patch size, channels,
//! layer count, joint/pooled widths, `pos_embed_max_size`, the MMDiT-X blocks (`attn2`) and qk RMSNorm (`ln_q`),
//! whose width is the head size; the VAE's structure; the CLIP and T5 widths, layers and heads (T5's from its
//! relative attention table). Fixed at the published SD3 values: 64-wide MMDiT heads when the file has no qk norm,
//! 64-wide CLIP heads, `sample_size` 128, the VAE's scale 1.5305 and shift 0.0609, the flow-match shift 3.0.
//!
//! SD3.5 files ship without text encoders; the caller then takes them from the diffusers folder.

use crate::clip::{self, ClipStructure};
use crate::config::{self, Check, TowerRole};
use crate::error::{CheckpointError, ConfigMismatch, Result};
use crate::file::CheckpointFile;
use crate::layout::{Tower, TowerKind, VAE};
use crate::plan::{Op, Plan, Shapes};
use crate::{vae, Weights};
use candle_core::{Device, Tensor};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

pub(crate) const MMDIT: &str = "model.diffusion_model.";
const JOINT_BLOCKS: &str = "model.diffusion_model.joint_blocks.";
pub(crate) const CLIP_L: &str = "text_encoders.clip_l.transformer.";
pub(crate) const CLIP_G: &str = "text_encoders.clip_g.transformer.";
pub(crate) const T5: &str = "text_encoders.t5xxl.transformer.";

/// The published SD3 head size (all SAI MMDiTs, CLIP-L and CLIP-G use 64).
const HEAD_DIM: usize = 64;

/// Whether the tensor names are an SD3-family MMDiT's.
pub(crate) fn is_sd3(file: &CheckpointFile) -> bool {
    file.has_prefix(JOINT_BLOCKS)
}

/// Whether `dir` holds a diffusers SD3-family pipeline (`model_index.json` names `StableDiffusion3…`).
pub fn is_sd3_folder(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("model_index.json"))
        .ok()
        .and_then(|text| serde_json::from_str::<Value>(&text).ok())
        .and_then(|v| v["_class_name"].as_str().map(|c| c.starts_with("StableDiffusion3")))
        .unwrap_or(false)
}

/// Whether `path` is an SD3 / SD3.5 single file; reads the header only.
pub fn is_sd3_file(path: impl AsRef<Path>) -> Result<bool> {
    Ok(is_sd3(&CheckpointFile::open(path.as_ref())?))
}

/// What an SD3 single file carries besides its MMDiT, and how many values (read from the header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sd3FileParts {
    pub vae: bool,
    pub clip_l: bool,
    pub clip_g: bool,
    pub t5: bool,
    /// MMDiT blocks (SAI's MMDiTs have as many 64-wide attention heads).
    pub depth: usize,
    /// The MMDiT's hidden width (`x_embedder.proj`'s output channels).
    pub hidden: usize,
    /// Elements of the MMDiT, VAE and CLIP tensors (the weights a worker without T5 holds).
    pub elements_without_t5: u64,
    /// Elements of the T5 tensors.
    pub t5_elements: u64,
}

/// The parts of the SD3 / SD3.5 single file at `path`; reads the header only.
pub fn sd3_file_parts(path: impl AsRef<Path>) -> Result<Sd3FileParts> {
    let file = CheckpointFile::open(path.as_ref())?;
    if !is_sd3(&file) {
        return Err(CheckpointError::UnknownLayout {
            path: file.path.clone(),
            reason: format!("not an SD3/SD3.5 checkpoint: no `{JOINT_BLOCKS}*` tensors"),
        });
    }
    let elements = |prefix: &str| -> u64 {
        file.names_with_prefix(prefix)
            .filter_map(|n| file.shape(n))
            .map(|s| s.iter().product::<usize>() as u64)
            .sum()
    };
    Ok(Sd3FileParts {
        vae: file.has_prefix(VAE),
        clip_l: file.has_prefix(CLIP_L),
        clip_g: file.has_prefix(CLIP_G),
        t5: file.has_prefix(T5),
        depth: file
            .names_with_prefix(JOINT_BLOCKS)
            .filter_map(|n| n[JOINT_BLOCKS.len()..].split('.').next()?.parse::<usize>().ok())
            .max()
            .map_or(0, |last| last + 1),
        hidden: file
            .shape(&format!("{MMDIT}x_embedder.proj.weight"))
            .and_then(|s| s.first().copied())
            .unwrap_or(0),
        elements_without_t5: elements(MMDIT) + elements(VAE) + elements(CLIP_L) + elements(CLIP_G),
        t5_elements: elements(T5),
    })
}

/// Diffusers-schema configs of a converted SD3 file; a text encoder's is `None` when the file has none.
#[derive(Debug, Clone)]
pub struct Sd3Configs {
    pub transformer: Value,
    pub vae: Value,
    pub text_encoder: Option<Value>,
    pub text_encoder_2: Option<Value>,
    pub text_encoder_3: Option<Value>,
    pub scheduler: Value,
}

/// A converted SD3 / SD3.5 single file.
#[derive(Debug)]
pub struct Sd3Converted {
    /// `SD3Transformer2DModel` names (`transformer_blocks.0.attn.to_q.weight`, …).
    pub transformer: Weights,
    /// `AutoencoderKL` names.
    pub vae: Weights,
    /// CLIP-L as `CLIPTextModelWithProjection`; its `text_projection.weight` is the identity when the file has
    /// none, as diffusers makes it. `None`: not in the file.
    pub text_encoder: Option<Weights>,
    /// CLIP-G as `CLIPTextModelWithProjection`.
    pub text_encoder_2: Option<Weights>,
    /// T5 as `T5EncoderModel`.
    pub text_encoder_3: Option<Weights>,
    pub configs: Sd3Configs,
    /// Subfolders of the config folder whose config was used.
    pub overridden: Vec<&'static str>,
    /// Checkpoint tensors deliberately not converted, sorted.
    pub skipped: Vec<String>,
}

/// Converts the SD3 file at `path` onto `device`. `config_dir` is a diffusers SD3 folder whose configs win over
/// inference (each is checked against the shapes). A file without text encoders needs them in `config_dir`
/// (`text_encoder/`, `text_encoder_2/`); the error says so.
pub fn load_sd3_single_file_on(
    path: impl AsRef<Path>,
    config_dir: Option<&Path>,
    device: &Device,
) -> Result<Sd3Converted> {
    let file = CheckpointFile::open(path.as_ref())?;
    if !is_sd3(&file) {
        return Err(CheckpointError::UnknownLayout {
            path: file.path.clone(),
            reason: format!("not an SD3/SD3.5 checkpoint: no `{JOINT_BLOCKS}*` tensors"),
        });
    }
    let overrides = Overrides::open(config_dir)?;
    let mut skipped = Vec::new();
    let mut overridden = Vec::new();

    let (tr_plan, tr_inferred) = transformer_plan(&file)?;
    let transformer_cfg =
        apply(&file, &overrides, "transformer", tr_inferred, &TRANSFORMER_CHECKS, &mut overridden)?;
    check_heads(&file, &overrides, &transformer_cfg, overridden.contains(&"transformer"))?;

    if !file.has_prefix(VAE) {
        return Err(CheckpointError::MissingComponent {
            path: file.path.clone(),
            component: "VAE",
            prefix: VAE.into(),
        });
    }
    let (vae_plan, vae_structure) = vae::plan(&file, VAE, &mut skipped)?;
    let mut vae_inferred = config::vae_config(&vae_structure, crate::Family::Sdxl, false);
    config::overlay(
        &mut vae_inferred,
        &json!({"sample_size": 1024, "scaling_factor": 1.5305, "shift_factor": 0.0609}),
    );
    // SD3's VAE has no quant convs: an override that adds them would not fit the weights.
    let flags = [("use_quant_conv", Check::Flag), ("use_post_quant_conv", Check::Flag)];
    let vae_checks: Vec<(&str, Check)> = config::VAE_STRUCTURE.into_iter().chain(flags).collect();
    let vae_cfg = apply(&file, &overrides, "vae", vae_inferred, &vae_checks, &mut overridden)?;

    let (has_l, has_g) = (file.has_prefix(CLIP_L), file.has_prefix(CLIP_G));
    let clips = match (has_l, has_g) {
        (true, true) => {
            let l = clip_tower(&file, &overrides, CLIP_L, false, &mut skipped, &mut overridden)?;
            let g = clip_tower(&file, &overrides, CLIP_G, true, &mut skipped, &mut overridden)?;
            Some((l, g))
        }
        (false, false) => {
            overrides.require_text_encoders(&file)?;
            None
        }
        (true, false) | (false, true) => {
            let (component, prefix) =
                if has_l { ("CLIP-G text encoder", CLIP_G) } else { ("CLIP-L text encoder", CLIP_L) };
            return Err(CheckpointError::MissingComponent {
                path: file.path.clone(),
                component,
                prefix: prefix.into(),
            });
        }
    };
    let t5 = if file.has_prefix(T5) {
        let (plan, inferred) = t5_plan(&file)?;
        let t5_checks = [
            ("vocab_size", Check::Exact),
            ("d_model", Check::Exact),
            ("d_kv", Check::Exact),
            ("d_ff", Check::Exact),
            ("num_layers", Check::Exact),
            ("num_heads", Check::Exact),
            ("relative_attention_num_buckets", Check::Exact),
        ];
        Some((plan, apply(&file, &overrides, "text_encoder_3", inferred, &t5_checks, &mut overridden)?))
    } else {
        None
    };
    let scheduler_inferred = json!({
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "num_train_timesteps": 1000,
        "shift": 3.0,
    });
    let scheduler = apply(&file, &overrides, "scheduler", scheduler_inferred, &[], &mut overridden)?;

    skipped.extend(
        file.tensors
            .keys()
            .filter(|k| ![MMDIT, VAE, CLIP_L, CLIP_G, T5].iter().any(|p| k.starts_with(p)))
            .cloned(),
    );
    skipped.sort();
    skipped.dedup();

    let (text_encoder, text_encoder_2, te_cfg, te2_cfg) = match clips {
        Some(((l_plan, l_cfg, l_hidden, l_identity), (g_plan, g_cfg, _, _))) => {
            let mut l = l_plan.materialize(&file, device)?;
            if l_identity {
                // SAI files carry no CLIP-L projection; diffusers puts `torch.eye` in its place.
                let like = l.get("text_model.embeddings.token_embedding.weight").map(Tensor::dtype);
                let dtype = like.unwrap_or(candle_core::DType::F32);
                let eye = Tensor::eye(l_hidden, dtype, device).map_err(|e| CheckpointError::Tensor {
                    path: file.path.clone(),
                    tensor: format!("{CLIP_L}text_projection.weight"),
                    reason: format!("identity projection: {e}"),
                })?;
                l.insert("text_projection.weight".into(), eye);
            }
            (Some(l), Some(g_plan.materialize(&file, device)?), Some(l_cfg), Some(g_cfg))
        }
        None => (None, None, None, None),
    };
    let (te3, te3_cfg) = match t5 {
        Some((plan, cfg)) => (Some(plan.materialize(&file, device)?), Some(cfg)),
        None => (None, None),
    };
    Ok(Sd3Converted {
        transformer: tr_plan.materialize(&file, device)?,
        vae: vae_plan.materialize(&file, device)?,
        text_encoder,
        text_encoder_2,
        text_encoder_3: te3,
        configs: Sd3Configs {
            transformer: transformer_cfg,
            vae: vae_cfg,
            text_encoder: te_cfg,
            text_encoder_2: te2_cfg,
            text_encoder_3: te3_cfg,
            scheduler,
        },
        overridden,
        skipped,
    })
}

const TRANSFORMER_CHECKS: [(&str, Check); 10] = [
    ("in_channels", Check::Exact),
    ("out_channels", Check::Exact),
    ("patch_size", Check::Exact),
    ("num_layers", Check::Exact),
    ("joint_attention_dim", Check::Exact),
    ("caption_projection_dim", Check::Exact),
    ("pooled_projection_dim", Check::Exact),
    ("pos_embed_max_size", Check::Exact),
    ("dual_attention_layers", Check::Exact),
    ("qk_norm", Check::Exact),
];

/// The configs of a diffusers SD3 folder, read per subfolder as asked for.
struct Overrides {
    root: Option<PathBuf>,
}

impl Overrides {
    fn open(dir: Option<&Path>) -> Result<Self> {
        if let Some(dir) = dir {
            if !dir.is_dir() {
                return Err(CheckpointError::ConfigDir {
                    path: dir.to_path_buf(),
                    reason: "not a directory".into(),
                });
            }
        }
        Ok(Self { root: dir.map(Path::to_path_buf) })
    }

    /// `<root>/<sub>/config.json` (`scheduler_config.json` for the scheduler), when there is one.
    fn get(&self, sub: &str) -> Result<Option<(Value, String)>> {
        let Some(root) = &self.root else { return Ok(None) };
        let name = if sub == "scheduler" { "scheduler_config.json" } else { "config.json" };
        let path = root.join(sub).join(name);
        if !path.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path)
            .map_err(|source| CheckpointError::ConfigIo { path: path.clone(), source })?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|source| CheckpointError::ConfigParse { path: path.clone(), source })?;
        if !value.is_object() {
            return Err(CheckpointError::ConfigDir { path, reason: "config is not a JSON object".into() });
        }
        Ok(Some((value, path.display().to_string())))
    }

    /// A file without CLIP towers (SD3.5 files ship so) takes them from the config folder.
    fn require_text_encoders(&self, file: &CheckpointFile) -> Result<()> {
        let missing: Vec<&str> = match &self.root {
            None => vec![],
            Some(root) => ["text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"]
                .into_iter()
                .filter(|sub| !root.join(sub).is_dir())
                .collect(),
        };
        let hint = match &self.root {
            None => {
                let beside = file.path.with_extension("");
                format!(
                    "no config folder was given: put the model's diffusers folder beside it as `{}` (with \
                     `text_encoder`, `text_encoder_2`, `tokenizer`, `tokenizer_2`, optionally `text_encoder_3` and \
                     `tokenizer_3`) or give it as the config",
                    beside.display()
                )
            }
            Some(_) if missing.is_empty() => return Ok(()),
            Some(root) => format!("the config folder {} has no `{}`", root.display(), missing.join("`, `")),
        };
        Err(CheckpointError::MissingTextEncoders { path: file.path.clone(), hint })
    }
}

/// Validates the folder's config (if any) against `inferred` and lays it on top.
fn apply(
    file: &CheckpointFile,
    overrides: &Overrides,
    sub: &'static str,
    inferred: Value,
    checks: &[(&str, Check)],
    overridden: &mut Vec<&'static str>,
) -> Result<Value> {
    let over = overrides.get(sub)?;
    if let Some((value, origin)) = &over {
        config::validate(origin, &file.path, &inferred, value, checks)?;
        overridden.push(sub);
    }
    Ok(config::resolve(inferred, over.as_ref().map(|(v, _)| v)))
}

/// The folder's heads × head size must give the file's width.
fn check_heads(file: &CheckpointFile, overrides: &Overrides, cfg: &Value, from_folder: bool) -> Result<()> {
    let get = |k: &str| cfg.get(k).and_then(Value::as_u64).unwrap_or(0) as usize;
    let width = Shapes { file }.rank(&format!("{MMDIT}x_embedder.proj.weight"), 4, "patch embedding")?[0];
    let (heads, head_dim) = (get("num_attention_heads"), get("attention_head_dim"));
    if heads * head_dim == width {
        return Ok(());
    }
    if !from_folder {
        return Err(CheckpointError::Unsupported {
            path: file.path.clone(),
            reason: format!(
                "the MMDiT's width {width} is not a multiple of SD3's 64-wide attention heads and the file has no \
                 qk norm that tells the head size: give the model's diffusers folder as config"
            ),
        });
    }
    Err(CheckpointError::ConfigMismatch(Box::new(ConfigMismatch {
        origin: overrides.root.as_ref().map_or_else(
            || "inferred transformer config".into(),
            |r| r.join("transformer/config.json").display().to_string(),
        ),
        key: "num_attention_heads".into(),
        config_value: format!("{heads} (× attention_head_dim {head_dim})"),
        checkpoint: file.path.clone(),
        checkpoint_value: format!("a width of {width}"),
    })))
}

/// The MMDiT plan (diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`) and its inferred config.
fn transformer_plan(file: &CheckpointFile) -> Result<(Plan, Value)> {
    let unexpected = |key: &str| CheckpointError::UnexpectedTensor {
        path: file.path.clone(),
        tensor: key.to_string(),
        component: "SD3 transformer",
    };
    let blocks: BTreeSet<usize> = file
        .names_with_prefix(JOINT_BLOCKS)
        .filter_map(|k| k[JOINT_BLOCKS.len()..].split('.').next()?.parse().ok())
        .collect();
    let n = blocks.len();
    if blocks.iter().enumerate().any(|(i, b)| i != *b) {
        return Err(CheckpointError::MissingTensor {
            path: file.path.clone(),
            tensor: format!(
                "{JOINT_BLOCKS}{}.*",
                blocks.iter().enumerate().find(|(i, b)| i != *b).map_or(0, |(i, _)| i)
            ),
            context: "joint blocks are numbered from 0 without gaps".into(),
        });
    }
    let mut plan = Plan::default();
    let mut dual = BTreeSet::new();
    let mut qk_norm = false;
    for key in file.names_with_prefix(MMDIT) {
        let rest = &key[MMDIT.len()..];
        let s: Vec<&str> = rest.split('.').collect();
        let one = |t: String| vec![(t, Op::Copy)];
        let mapped: Option<Vec<(String, Op)>> = match s.as_slice() {
            ["pos_embed"] => Some(one("pos_embed.pos_embed".into())),
            ["x_embedder", "proj", p] => Some(one(format!("pos_embed.proj.{p}"))),
            ["context_embedder", p] => Some(one(format!("context_embedder.{p}"))),
            [e @ ("t_embedder" | "y_embedder"), "mlp", i @ ("0" | "2"), p] => {
                let which = if *e == "t_embedder" { "timestep_embedder" } else { "text_embedder" };
                let linear = if *i == "0" { 1 } else { 2 };
                Some(one(format!("time_text_embed.{which}.linear_{linear}.{p}")))
            }
            ["final_layer", "linear", p] => Some(one(format!("proj_out.{p}"))),
            ["final_layer", "adaLN_modulation", "1", p] => {
                Some(vec![(format!("norm_out.linear.{p}"), Op::SwapHalves)])
            }
            ["joint_blocks", i, stream @ ("x_block" | "context_block"), leaf @ ..] => {
                let idx: usize = i.parse().map_err(|_| unexpected(key))?;
                let b = format!("transformer_blocks.{idx}");
                let x = *stream == "x_block";
                let last = idx + 1 == n;
                match leaf {
                    [attn @ ("attn" | "attn2"), "qkv", p] if x || *attn == "attn" => {
                        if *attn == "attn2" {
                            dual.insert(idx);
                        }
                        let names: [String; 3] = if x {
                            ["q", "k", "v"].map(|c| format!("{b}.{attn}.to_{c}.{p}"))
                        } else {
                            ["q", "k", "v"].map(|c| format!("{b}.attn.add_{c}_proj.{p}"))
                        };
                        Some(
                            names
                                .into_iter()
                                .enumerate()
                                .map(|(index, t)| (t, Op::Chunk { index, parts: 3 }))
                                .collect(),
                        )
                    }
                    [attn @ ("attn" | "attn2"), ln @ ("ln_q" | "ln_k"), "weight"] if x || *attn == "attn" => {
                        qk_norm = true;
                        let c = &ln[3..];
                        Some(one(if x {
                            format!("{b}.{attn}.norm_{c}.weight")
                        } else {
                            format!("{b}.attn.norm_added_{c}.weight")
                        }))
                    }
                    [attn @ ("attn" | "attn2"), "proj", p] if x || *attn == "attn" => Some(one(if x {
                        format!("{b}.{attn}.to_out.0.{p}")
                    } else {
                        format!("{b}.attn.to_add_out.{p}")
                    })),
                    ["adaLN_modulation", "1", p] => {
                        if x {
                            Some(one(format!("{b}.norm1.linear.{p}")))
                        } else {
                            // The last block's context half is diffusers' AdaLayerNormContinuous: (scale, shift).
                            let op = if last { Op::SwapHalves } else { Op::Copy };
                            Some(vec![(format!("{b}.norm1_context.linear.{p}"), op)])
                        }
                    }
                    ["mlp", fc @ ("fc1" | "fc2"), p] => {
                        let ff = if x { "ff" } else { "ff_context" };
                        let net = if *fc == "fc1" { "net.0.proj" } else { "net.2" };
                        Some(one(format!("{b}.{ff}.{net}.{p}")))
                    }
                    _ => None,
                }
            }
            _ => None,
        };
        for (target, op) in mapped.ok_or_else(|| unexpected(key))? {
            plan.add(file, target, key, op)?;
        }
    }

    let sh = Shapes { file };
    let k = |s: &str| format!("{MMDIT}{s}");
    let patch = sh.rank(&k("x_embedder.proj.weight"), 4, "patch embedding [width, channels, p, p]")?;
    let (dim, in_channels, p) = (patch[0], patch[1], patch[2]);
    if patch[3] != p {
        return Err(sh.fail(&k("x_embedder.proj.weight"), "square patches [width, channels, p, p]"));
    }
    let joint =
        sh.expect(&k("context_embedder.weight"), &[Some(dim), None], "context embedder [width, joint]")?[1];
    let pooled =
        sh.expect(&k("y_embedder.mlp.0.weight"), &[Some(dim), None], "pooled embedder [width, pooled]")?[1];
    let out = sh.expect(&k("final_layer.linear.weight"), &[None, Some(dim)], "final projection")?[0];
    if out % (p * p) != 0 {
        return Err(sh.fail(
            &k("final_layer.linear.weight"),
            format!("a multiple of {} outputs (p² × channels)", p * p),
        ));
    }
    sh.expect(&k("final_layer.adaLN_modulation.1.weight"), &[Some(2 * dim), Some(dim)], "final modulation")?;
    let positions =
        sh.expect(&k("pos_embed"), &[Some(1), None, Some(dim)], "positional table [1, max², width]")?[1];
    let max = (positions as f64).sqrt().round() as usize;
    if max * max != positions {
        return Err(sh.fail(&k("pos_embed"), "a square number of positions"));
    }
    if n == 0 {
        return Err(CheckpointError::MissingTensor {
            path: file.path.clone(),
            tensor: format!("{JOINT_BLOCKS}0.*"),
            context: "the MMDiT's joint blocks".into(),
        });
    }
    for i in 0..n {
        let b = |s: &str| k(&format!("joint_blocks.{i}.{s}"));
        sh.expect(
            &b("x_block.attn.qkv.weight"),
            &[Some(3 * dim), Some(dim)],
            "fused q/k/v [3·width, width]",
        )?;
        sh.expect(
            &b("context_block.attn.qkv.weight"),
            &[Some(3 * dim), Some(dim)],
            "fused q/k/v [3·width, width]",
        )?;
        sh.expect_opt(
            &b("x_block.attn2.qkv.weight"),
            &[Some(3 * dim), Some(dim)],
            "fused q/k/v [3·width, width]",
        )?;
        let chunks = if dual.contains(&i) { 9 } else { 6 };
        sh.expect(&b("x_block.adaLN_modulation.1.weight"), &[Some(chunks * dim), Some(dim)], "modulation")?;
        let ctx = if i + 1 == n { 2 } else { 6 };
        sh.expect(
            &b("context_block.adaLN_modulation.1.weight"),
            &[Some(ctx * dim), Some(dim)],
            "modulation",
        )?;
    }
    let head_dim = match sh.file.shape(&k("joint_blocks.0.x_block.attn.ln_q.weight")) {
        Some([d]) if *d > 0 && dim % d == 0 => *d,
        Some(_) => {
            return Err(
                sh.fail(&k("joint_blocks.0.x_block.attn.ln_q.weight"), "[head size] dividing the width")
            )
        }
        None => HEAD_DIM,
    };
    let config = json!({
        "_class_name": "SD3Transformer2DModel",
        "attention_head_dim": head_dim,
        "caption_projection_dim": dim,
        "dual_attention_layers": dual.iter().collect::<Vec<_>>(),
        "in_channels": in_channels,
        "joint_attention_dim": joint,
        "num_attention_heads": dim / head_dim,
        "num_layers": n,
        "out_channels": out / (p * p),
        "patch_size": p,
        "pooled_projection_dim": pooled,
        "pos_embed_max_size": max,
        "qk_norm": if qk_norm { json!("rms_norm") } else { Value::Null },
        "sample_size": 128,
    });
    Ok((plan, config))
}

/// One CLIP tower (transformers names already): its plan with `text_projection` kept, the config, the hidden
/// width, and whether the projection must be made the identity.
fn clip_tower(
    file: &CheckpointFile,
    overrides: &Overrides,
    prefix: &'static str,
    big_g: bool,
    skipped: &mut Vec<String>,
    overridden: &mut Vec<&'static str>,
) -> Result<(Plan, Value, usize, bool)> {
    let component = if big_g { "CLIP-G text encoder" } else { "CLIP-L text encoder" };
    let mut own_skipped = Vec::new();
    let (mut plan, s) =
        clip::plan(file, Tower { prefix, kind: TowerKind::HfClip }, component, &mut own_skipped)?;
    let proj_key = format!("{prefix}text_projection.weight");
    own_skipped.retain(|k| *k != proj_key);
    skipped.extend(own_skipped);
    let projection = match file.shape(&proj_key) {
        Some(_) => {
            let shape = Shapes { file }.expect(
                &proj_key,
                &[None, Some(s.hidden_size)],
                "text_projection [projection, hidden]",
            )?;
            plan.add(file, "text_projection.weight".into(), &proj_key, Op::Copy)?;
            Some(shape[0])
        }
        None if big_g => {
            return Err(CheckpointError::MissingTensor {
                path: file.path.clone(),
                tensor: proj_key,
                context: "CLIP-G's projection of the pooled embedding".into(),
            })
        }
        None => None,
    };
    let s = ClipStructure { projection_dim: Some(projection.unwrap_or(s.hidden_size)), ..s };
    let role = if big_g { TowerRole::OpenClipBigG } else { TowerRole::ClipL };
    let mut inferred = config::clip_config(&s, role);
    config::overlay(&mut inferred, &json!({"architectures": ["CLIPTextModelWithProjection"]}));
    let checks = [
        ("hidden_size", Check::Exact),
        ("intermediate_size", Check::Exact),
        ("vocab_size", Check::Exact),
        ("max_position_embeddings", Check::Exact),
        ("num_hidden_layers", Check::Exact),
        ("projection_dim", Check::Exact),
    ];
    let sub = if big_g { "text_encoder_2" } else { "text_encoder" };
    let cfg = apply(file, overrides, sub, inferred, &checks, overridden)?;
    let heads = cfg.get("num_attention_heads").and_then(Value::as_u64).unwrap_or(0) as usize;
    if heads == 0 || s.hidden_size % heads != 0 {
        return Err(CheckpointError::ConfigMismatch(Box::new(ConfigMismatch {
            origin: format!("{sub} config"),
            key: "num_attention_heads".into(),
            config_value: heads.to_string(),
            checkpoint: file.path.clone(),
            checkpoint_value: format!("a width of {} under `{prefix}`", s.hidden_size),
        })));
    }
    Ok((plan, cfg, s.hidden_size, projection.is_none()))
}

/// T5 keeps transformers' names under its prefix; the config is read off the shapes.
fn t5_plan(file: &CheckpointFile) -> Result<(Plan, Value)> {
    let mut plan = Plan::default();
    for key in file.names_with_prefix(T5) {
        let rest = &key[T5.len()..];
        if rest == "shared.weight" || rest.starts_with("encoder.") {
            plan.add(file, rest.to_string(), key, Op::Copy)?;
        } else {
            return Err(CheckpointError::UnexpectedTensor {
                path: file.path.clone(),
                tensor: key.to_string(),
                component: "T5 text encoder",
            });
        }
    }
    let sh = Shapes { file };
    let k = |s: &str| format!("{T5}{s}");
    let table = if file.contains(&k("shared.weight")) {
        k("shared.weight")
    } else {
        k("encoder.embed_tokens.weight")
    };
    let emb = sh.rank(&table, 2, "token embedding [vocab, d_model]")?;
    let (vocab, d_model) = (emb[0], emb[1]);
    let block_prefix = k("encoder.block.");
    let layers: BTreeSet<usize> = file
        .names_with_prefix(&block_prefix)
        .filter_map(|n| n[block_prefix.len()..].split('.').next()?.parse().ok())
        .collect();
    if layers.is_empty() || layers.iter().enumerate().any(|(i, l)| i != *l) {
        return Err(CheckpointError::MissingTensor {
            path: file.path.clone(),
            tensor: format!("{block_prefix}0.*"),
            context: "T5 encoder blocks are numbered from 0 without gaps".into(),
        });
    }
    let a = |s: &str| k(&format!("encoder.block.0.layer.0.SelfAttention.{s}"));
    let rel =
        sh.rank(&a("relative_attention_bias.weight"), 2, "relative attention table [buckets, heads]")?;
    let (buckets, heads) = (rel[0], rel[1]);
    let inner = sh.expect(&a("q.weight"), &[None, Some(d_model)], "query [heads·d_kv, d_model]")?[0];
    if heads == 0 || inner % heads != 0 {
        return Err(sh.fail(&a("q.weight"), format!("a multiple of {heads} heads")));
    }
    let ff = |s: &str| k(&format!("encoder.block.0.layer.1.DenseReluDense.{s}"));
    let gated = file.contains(&ff("wi_0.weight"));
    let wi = if gated { ff("wi_0.weight") } else { ff("wi.weight") };
    let d_ff = sh.expect(&wi, &[None, Some(d_model)], "feed-forward input [d_ff, d_model]")?[0];
    let config = json!({
        "architectures": ["T5EncoderModel"],
        "d_ff": d_ff,
        "d_kv": inner / heads,
        "d_model": d_model,
        "feed_forward_proj": if gated { "gated-gelu" } else { "relu" },
        "layer_norm_epsilon": 1e-6,
        "model_type": "t5",
        "num_heads": heads,
        "num_layers": layers.len(),
        "relative_attention_max_distance": 128,
        "relative_attention_num_buckets": buckets,
        "vocab_size": vocab,
    });
    Ok((plan, config))
}
