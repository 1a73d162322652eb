//! Single-file Stable Diffusion checkpoints: a `.safetensors` in the original layout (CompVis
//! LDM for SD1.x/SD2.x, Stability's SGM for SDXL) as shared on model sites, turned into what
//! the rest of the engine loads — diffusers-named tensors per component plus diffusers-schema
//! configs.
//!
//! * The family (SD1.x / SD2.x / SDXL base) is recognised from tensor names, the variant
//!   (standard, inpainting, …) from the UNet's input width; see [`Family`], [`Variant`].
//! * Configs are inferred from shapes where shapes can tell (channels, layers, depths, widths),
//!   filled from the family's published configs where they cannot (attention heads, CLIP
//!   activation, VAE scaling), and can be overridden by a diffusers folder ([`ConfigDir`]),
//!   like diffusers' `from_single_file(config=…)`.
//! * v-prediction is not visible in weights. [`Converted::prediction`] reports a hint from
//!   outside the weights when there is one (override config, `model.yaml` beside the file,
//!   ModelSpec metadata, a `v_pred` marker tensor) and [`Prediction::Unknown`] otherwise; the
//!   caller then decides (CLI flag / request) and calls [`Converted::set_prediction_type`].
//! * The file is memory-mapped and each tensor is copied out once, straight into its
//!   converted form; the checkpoint is never held twice.
//! * Tensors keep the dtype they are stored in (float32, float16, bfloat16, or a mix, as in
//!   files with an fp16 UNet beside an fp32 VAE): casting here would only add a second copy
//!   or a second rounding. The caller casts to the model's dtype, e.g. through
//!   `VarBuilder::from_tensors`, which converts each tensor as the model asks for it.
//!
//! SD3 / SD3.5 files (an MMDiT under `model.diffusion_model.joint_blocks.*`) convert through
//! [`load_sd3_single_file_on`] into [`Sd3Converted`]; [`is_sd3_file`] tells them apart from the header.
//!
//! EMA copies (`model_ema.*`), LDM schedule buffers and other non-network tensors are skipped
//! and listed in [`Converted::skipped`]. A name inside a component that the layout does not
//! explain is an error rather than a silently dropped weight.

mod clip;
mod config;
mod error;
mod file;
mod layout;
mod plan;
mod prediction;
mod sd3;
mod sd3_sai;
mod unet;
mod vae;

pub use config::{Component, ConfigDir, Configs};
pub use error::{CheckpointError, ConfigMismatch, Result};
pub use layout::{Family, Variant};
pub use prediction::{Prediction, PredictionSource, PredictionType};
pub use sd3::{
    is_sd3_file, is_sd3_folder, load_sd3_single_file_on, sd3_file_parts, Sd3Configs, Sd3Converted,
    Sd3FileParts,
};
pub use sd3_sai::write_sd3_transformer_as_sai;

use candle_core::{Device, Tensor};
use clip::ClipStructure;
use config::{Check, TowerRole, UnetContext};
use file::CheckpointFile;
use layout::{Layout, Tower, TowerKind};
use plan::Plan;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Diffusers-named tensors of one component.
pub type Weights = HashMap<String, Tensor>;

/// A converted checkpoint.
#[derive(Debug)]
pub struct Converted {
    pub family: Family,
    pub variant: Variant,
    pub prediction: Prediction,
    /// `UNet2DConditionModel` names (`down_blocks.0.resnets.0.conv1.weight`, …).
    pub unet: Weights,
    /// `AutoencoderKL` names (`decoder.up_blocks.0.resnets.0.conv1.weight`, …).
    pub vae: Weights,
    /// transformers `CLIPTextModel` names (`text_model.encoder.layers.0.…`).
    pub text_encoder: Weights,
    /// SDXL only: `CLIPTextModelWithProjection` names, including `text_projection.weight`.
    pub text_encoder_2: Option<Weights>,
    pub configs: Configs,
    /// Components whose config came (at least partly) from the overrides.
    pub overridden: Vec<Component>,
    /// Checkpoint tensors deliberately not converted, sorted.
    pub skipped: Vec<String>,
}

impl Converted {
    /// Records the caller's decision on what the UNet predicts and updates the scheduler
    /// config to match.
    pub fn set_prediction_type(&mut self, kind: PredictionType) {
        if let Some(obj) = self.configs.scheduler.as_object_mut() {
            obj.insert("prediction_type".into(), json!(kind.as_diffusers()));
        }
        self.prediction = Prediction::Known { kind, source: PredictionSource::Caller };
    }
}

/// Everything [`Converted`] says about a checkpoint except the tensors, computed from the
/// header alone.
#[derive(Debug, Clone)]
pub struct Inspection {
    pub family: Family,
    pub variant: Variant,
    pub prediction: Prediction,
    pub configs: Configs,
    pub overridden: Vec<Component>,
    pub skipped: Vec<String>,
}

/// An opened single-file checkpoint whose family has been recognised.
pub struct SingleFile {
    file: CheckpointFile,
    layout: Layout,
}

impl std::fmt::Debug for SingleFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SingleFile")
            .field("path", &self.file.path)
            .field("family", &self.layout.family)
            .field("tensors", &self.file.tensors.len())
            .finish()
    }
}

/// Loads `path` onto the CPU, converting every component; `overrides` win over inference.
pub fn load_single_file(path: impl AsRef<Path>, overrides: Option<&ConfigDir>) -> Result<Converted> {
    load_single_file_on(path, overrides, &Device::Cpu)
}

/// As [`load_single_file`], placing the tensors on `device`.
pub fn load_single_file_on(
    path: impl AsRef<Path>,
    overrides: Option<&ConfigDir>,
    device: &Device,
) -> Result<Converted> {
    SingleFile::open(path)?.convert(overrides, device)
}

/// A standalone VAE file in the original (LDM) layout, as A1111's `sd_vae` files are (`vae-ft-mse-840000…`,
/// `sdxl_vae.safetensors`): its tensors under diffusers' `AutoencoderKL` names, on `device`. Tensors may carry the
/// checkpoint's `first_stage_model.` prefix or none. The scaling factor is not in the file: the model the VAE is
/// used with keeps its own, as in A1111.
pub fn load_vae_file_on(path: impl AsRef<Path>, device: &Device) -> Result<Weights> {
    let file = CheckpointFile::open(path.as_ref())?;
    let prefix = if file.has_prefix(layout::VAE) { layout::VAE } else { "" };
    let mut skipped = Vec::new();
    let (plan, _) = vae::plan(&file, prefix, &mut skipped)?;
    plan.materialize(&file, device)
}

/// What a standalone VAE file's header says about the autoencoder in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VaeFileInfo {
    /// 4 for Stable Diffusion 1.x, 2.x and XL.
    pub latent_channels: usize,
    /// The encoder's widths, top level first (`[128, 256, 512, 512]` for those models).
    pub block_out_channels: Vec<usize>,
}

/// Checks a standalone VAE file as [`load_vae_file_on`] reads it (layout, every tensor explained, shapes
/// consistent) from its header alone, for an engine that hands the file to another loader.
/// Elements of every tensor of the safetensors file at `path`; reads the header only.
pub fn tensor_elements(path: impl AsRef<Path>) -> Result<u64> {
    let file = CheckpointFile::open(path.as_ref())?;
    Ok(file.tensors.values().map(|t| t.shape.iter().product::<usize>() as u64).sum())
}

pub fn inspect_vae_file(path: impl AsRef<Path>) -> Result<VaeFileInfo> {
    let file = CheckpointFile::open(path.as_ref())?;
    let prefix = if file.has_prefix(layout::VAE) { layout::VAE } else { "" };
    let (_, structure) = vae::plan(&file, prefix, &mut Vec::new())?;
    Ok(VaeFileInfo {
        latent_channels: structure.latent_channels,
        block_out_channels: structure.block_out_channels,
    })
}

impl SingleFile {
    /// Maps the file, parses its header and recognises the layout; reads no tensor data.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let file = CheckpointFile::open(path.as_ref())?;
        let layout = layout::detect(&file)?;
        Ok(Self { file, layout })
    }

    pub fn path(&self) -> &Path {
        &self.file.path
    }

    pub fn family(&self) -> Family {
        self.layout.family
    }

    /// The safetensors `__metadata__` map.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.file.metadata
    }

    /// Family, variant, prediction hint and configs, without loading tensors.
    pub fn inspect(&self, overrides: Option<&ConfigDir>) -> Result<Inspection> {
        Ok(self.prepare(overrides)?.inspection)
    }

    pub fn convert(&self, overrides: Option<&ConfigDir>, device: &Device) -> Result<Converted> {
        let Prepared { inspection, unet, vae, text_encoder, text_encoder_2 } = self.prepare(overrides)?;
        let f = &self.file;
        Ok(Converted {
            family: inspection.family,
            variant: inspection.variant,
            prediction: inspection.prediction,
            unet: unet.materialize(f, device)?,
            vae: vae.materialize(f, device)?,
            text_encoder: text_encoder.materialize(f, device)?,
            text_encoder_2: text_encoder_2.map(|p| p.materialize(f, device)).transpose()?,
            configs: inspection.configs,
            overridden: inspection.overridden,
            skipped: inspection.skipped,
        })
    }

    fn prepare(&self, overrides: Option<&ConfigDir>) -> Result<Prepared> {
        let f = &self.file;
        let family = self.layout.family;
        let mut skipped = Vec::new();
        let (vae_plan, vae) = vae::plan(f, layout::VAE, &mut skipped)?;
        let (mut te_plan, te) = clip::plan(f, self.layout.text_encoder, "text encoder", &mut skipped)?;
        let te2 = self
            .layout
            .text_encoder_2
            .map(|t| clip::plan(f, t, "second text encoder", &mut skipped))
            .transpose()?;
        let text_width = te.hidden_size + te2.as_ref().map_or(0, |(_, s)| s.hidden_size);
        let (unet_plan, unet) = unet::plan(f, text_width)?;

        let prediction = match overrides
            .and_then(|o| o.get(Component::Scheduler))
            .and_then(|s| s.get("prediction_type"))
            .and_then(Value::as_str)
        {
            Some("v_prediction") => Prediction::Known {
                kind: PredictionType::VPrediction,
                source: PredictionSource::OverrideConfig,
            },
            Some("epsilon") => {
                Prediction::Known { kind: PredictionType::Epsilon, source: PredictionSource::OverrideConfig }
            }
            _ => prediction::from_file(f),
        };
        let v_pred = prediction.kind() == Some(PredictionType::VPrediction);
        let over = |c: Component| overrides.and_then(|o| o.entry(c));
        let mut overridden = Vec::new();

        let cx = UnetContext {
            family,
            pooled_dim: te2.as_ref().and_then(|(_, s)| s.projection_dim),
            v_prediction: v_pred,
        };
        let unet_inferred = config::unet_config(&unet, &cx)
            .map_err(|reason| CheckpointError::Unsupported { path: f.path.clone(), reason })?;
        let n = unet.block_out_channels.len();
        let mask = unet
            .down_attention
            .iter()
            .enumerate()
            .filter(|(i, a)| **a || *i + 1 == n)
            .fold(0u64, |m, (i, _)| m | (1 << i.min(63)));
        let unet_checks = [
            ("in_channels", Check::Exact),
            ("out_channels", Check::Exact),
            ("block_out_channels", Check::Exact),
            ("layers_per_block", Check::PerBlock { n }),
            ("down_block_types", Check::Exact),
            ("up_block_types", Check::Exact),
            ("cross_attention_dim", Check::PerBlock { n }),
            ("transformer_layers_per_block", Check::PerBlockAt { n, mask }),
            ("use_linear_projection", Check::Flag),
            ("projection_class_embeddings_input_dim", Check::Exact),
        ];
        let unet_config =
            self.apply(Component::Unet, unet_inferred, over(Component::Unet), &unet_checks, &mut overridden)?;

        let vae_checks = config::VAE_STRUCTURE;
        let vae_config = self.apply(
            Component::Vae,
            config::vae_config(&vae, family, v_pred),
            over(Component::Vae),
            &vae_checks,
            &mut overridden,
        )?;

        let te_role = match self.layout.text_encoder.kind {
            TowerKind::HfClip => TowerRole::ClipL,
            TowerKind::OpenClip { .. } => TowerRole::OpenClipH,
        };
        let te_config = self.apply_text(
            Component::TextEncoder,
            self.layout.text_encoder,
            &te,
            te_role,
            &mut te_plan,
            &mut skipped,
            over(Component::TextEncoder),
            &mut overridden,
        )?;
        let (te2_plan, te2_config) = match (te2, self.layout.text_encoder_2) {
            (Some((mut plan, s)), Some(tower)) => {
                let cfg = self.apply_text(
                    Component::TextEncoder2,
                    tower,
                    &s,
                    TowerRole::OpenClipBigG,
                    &mut plan,
                    &mut skipped,
                    over(Component::TextEncoder2),
                    &mut overridden,
                )?;
                (Some(plan), Some(cfg))
            }
            _ => (None, None),
        };

        let timesteps = match f.shape("alphas_cumprod") {
            Some([n]) if *n > 0 => *n,
            _ => 1000,
        };
        let scheduler =
            config::scheduler_config(family, prediction.kind().unwrap_or(PredictionType::Epsilon), timesteps);
        let scheduler_config =
            self.apply(Component::Scheduler, scheduler, over(Component::Scheduler), &[], &mut overridden)?;

        let known = [layout::UNET, layout::VAE, self.layout.text_encoder.prefix];
        let te2_prefix = self.layout.text_encoder_2.map(|t| t.prefix);
        skipped.extend(
            f.tensors
                .keys()
                .filter(|k| !known.iter().chain(te2_prefix.iter()).any(|p| k.starts_with(p)))
                .cloned(),
        );
        skipped.sort();
        skipped.dedup();

        Ok(Prepared {
            inspection: Inspection {
                family,
                variant: Variant::from_in_channels(unet.in_channels),
                prediction,
                configs: Configs {
                    unet: unet_config,
                    vae: vae_config,
                    text_encoder: te_config,
                    text_encoder_2: te2_config,
                    scheduler: scheduler_config,
                },
                overridden,
                skipped,
            },
            unet: unet_plan,
            vae: vae_plan,
            text_encoder: te_plan,
            text_encoder_2: te2_plan,
        })
    }

    /// Validates and lays an override over an inferred config.
    fn apply(
        &self,
        component: Component,
        inferred: Value,
        over: Option<(&Value, &str)>,
        checks: &[(&str, Check)],
        overridden: &mut Vec<Component>,
    ) -> Result<Value> {
        if let Some((value, origin)) = over {
            config::validate(origin, &self.file.path, &inferred, value, checks)?;
            overridden.push(component);
        }
        Ok(config::resolve(inferred, over.map(|(v, _)| v)))
    }

    /// Text encoder config, and the encoder layers it keeps (the published SD2 config, or an
    /// override, may use fewer than the checkpoint holds).
    #[allow(clippy::too_many_arguments)]
    fn apply_text(
        &self,
        component: Component,
        tower: Tower,
        s: &ClipStructure,
        role: TowerRole,
        plan: &mut Plan,
        skipped: &mut Vec<String>,
        over: Option<(&Value, &str)>,
        overridden: &mut Vec<Component>,
    ) -> Result<Value> {
        let mut checks = vec![
            ("hidden_size", Check::Exact),
            ("intermediate_size", Check::Exact),
            ("vocab_size", Check::Exact),
            ("max_position_embeddings", Check::Exact),
        ];
        if matches!(tower.kind, TowerKind::OpenClip { with_projection: true }) {
            checks.push(("projection_dim", Check::Exact));
        }
        let cfg = self.apply(component, config::clip_config(s, role), over, &checks, overridden)?;
        let keep = cfg.get("num_hidden_layers").and_then(Value::as_u64).map_or(s.layers, |n| n as usize);
        if keep == 0 || keep > s.layers {
            return Err(CheckpointError::ConfigMismatch(Box::new(ConfigMismatch {
                origin: over.map_or_else(|| component.subfolder().to_string(), |(_, o)| o.to_string()),
                key: "num_hidden_layers".into(),
                config_value: keep.to_string(),
                checkpoint: self.file.path.clone(),
                checkpoint_value: format!("{} layers under `{}`", s.layers, tower.prefix),
            })));
        }
        skipped.extend(clip::keep_layers(plan, keep));
        Ok(cfg)
    }
}

struct Prepared {
    inspection: Inspection,
    unet: Plan,
    vae: Plan,
    text_encoder: Plan,
    text_encoder_2: Option<Plan>,
}
