//! A loaded Stable Diffusion model: its family, networks, tokenizers and scheduler config, read either from a
//! diffusers folder (honouring every component's config as diffusers does) or from a single-file checkpoint
//! converted at load time.

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use sdhive_checkpoint::{ConfigDir, Converted};
use sdhive_models::{
    AutoencoderKL, AutoencoderKLConfig, ClipTextConfig, ClipTextModel, UNet2DConditionConfig,
    UNet2DConditionModel,
};
use sdhive_modelsource::{ModelLocation, ResolvedModel};
use sdhive_schedulers::SchedulerConfig;
use sdhive_tokenizer::{ClipTokenizer, PadToken};
use serde_json::Value;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Which pipeline shape the model needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// One CLIP text encoder (SD 1.x / 2.x and their turbo / inpainting variants).
    Sd,
    /// Two text encoders, pooled text embedding and `time_ids` (SDXL, SDXL-Turbo).
    Sdxl,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Sd => "sd",
            Family::Sdxl => "sdxl",
        }
    }
}

#[derive(Debug, Error)]
pub enum LoadError {
    #[error("{path}: {message}")]
    Layout { path: PathBuf, message: String },
    #[error("{path}: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Model(Box<sdhive_models::ModelError>),
    #[error(transparent)]
    Tokenizer(#[from] sdhive_tokenizer::TokenizerError),
    #[error(transparent)]
    Scheduler(#[from] sdhive_schedulers::SchedulerError),
    #[error(transparent)]
    Checkpoint(Box<sdhive_checkpoint::CheckpointError>),
}

// Boxed: model and checkpoint errors carry paths and shapes, and a load error should not bloat every Result.
impl From<sdhive_models::ModelError> for LoadError {
    fn from(e: sdhive_models::ModelError) -> Self {
        LoadError::Model(Box::new(e))
    }
}

impl From<sdhive_checkpoint::CheckpointError> for LoadError {
    fn from(e: sdhive_checkpoint::CheckpointError) -> Self {
        LoadError::Checkpoint(Box::new(e))
    }
}

/// One text encoder with the tokenizer that feeds it.
pub struct TextEncoder {
    pub tokenizer: ClipTokenizer,
    pub model: ClipTextModel,
}

pub struct SdModel {
    pub name: String,
    pub family: Family,
    pub unet: UNet2DConditionModel,
    pub vae: AutoencoderKL,
    /// SD: one encoder. SDXL: `[text_encoder, text_encoder_2]`.
    pub encoders: Vec<TextEncoder>,
    pub scheduler_config: SchedulerConfig,
    /// SDXL: an empty negative prompt means zero embeddings (diffusers' `force_zeros_for_empty_prompt`).
    pub force_zeros_for_empty_prompt: bool,
    /// 2^(number of VAE blocks − 1): 8 for every released model.
    pub vae_scale_factor: usize,
    pub native_size: (u32, u32),
}

fn read_json(path: &Path) -> Result<Value, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Io { path: path.into(), source })?;
    serde_json::from_str(&text).map_err(|source| LoadError::Json { path: path.into(), source })
}

fn from_json_value<T: serde::de::DeserializeOwned>(origin: &Path, value: &Value) -> Result<T, LoadError> {
    serde_json::from_value(value.clone()).map_err(|source| LoadError::Json { path: origin.into(), source })
}

fn layout_err(path: &Path, message: impl Into<String>) -> LoadError {
    LoadError::Layout { path: path.into(), message: message.into() }
}

impl SdModel {
    pub fn load(model: &ResolvedModel, device: &Device, dtype: DType) -> Result<Self, LoadError> {
        match &model.location {
            ModelLocation::DiffusersDir(dir) => Self::from_diffusers_dir(&model.name, dir, device, dtype),
            ModelLocation::SingleFile(file) => Self::from_single_file(&model.name, file, None, device, dtype),
        }
    }

    /// A diffusers pipeline folder: `model_index.json` names the components, each with its own config.
    pub fn from_diffusers_dir(
        name: &str,
        dir: &Path,
        device: &Device,
        dtype: DType,
    ) -> Result<Self, LoadError> {
        let index_path = dir.join("model_index.json");
        let index = read_json(&index_path)?;
        let has = |component: &str| index.get(component).map(|v| !v.is_null()).unwrap_or(false);
        for required in ["unet", "vae", "scheduler"] {
            if !has(required) {
                return Err(layout_err(&index_path, format!("no `{required}` component")));
            }
        }
        let family = match (has("text_encoder"), has("text_encoder_2")) {
            (true, true) => Family::Sdxl,
            (true, false) => Family::Sd,
            (false, true) => {
                return Err(layout_err(
                    &index_path,
                    "SDXL refiner models (text_encoder_2 only) are not supported",
                ))
            }
            (false, false) => return Err(layout_err(&index_path, "no `text_encoder` component")),
        };
        let unet = UNet2DConditionModel::from_dir(&dir.join("unet"), dtype, device)?;
        let vae_dtype =
            vae_dtype(family, dtype, &AutoencoderKLConfig::from_file(&dir.join("vae").join("config.json"))?);
        let vae = AutoencoderKL::from_dir(&dir.join("vae"), vae_dtype, device)?;
        let mut encoders = vec![TextEncoder {
            tokenizer: ClipTokenizer::from_dir(&dir.join("tokenizer"))?,
            model: ClipTextModel::from_dir(&dir.join("text_encoder"), false, dtype, device)?,
        }];
        if family == Family::Sdxl {
            encoders.push(TextEncoder {
                tokenizer: ClipTokenizer::from_dir(&dir.join("tokenizer_2"))?,
                model: ClipTextModel::from_dir(&dir.join("text_encoder_2"), true, dtype, device)?,
            });
        }
        let scheduler_config =
            SchedulerConfig::from_file(dir.join("scheduler").join("scheduler_config.json"))?;
        let force_zeros_for_empty_prompt = index
            .get("force_zeros_for_empty_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(family == Family::Sdxl);
        let sample_size = sample_size(&read_json(&dir.join("unet").join("config.json"))?);
        let parts = Parts { unet, vae, encoders, scheduler_config, sample_size };
        Ok(Self::assemble(name, family, parts, force_zeros_for_empty_prompt))
    }

    /// A single-file checkpoint in the original layout. `config_dir` plays diffusers' `from_single_file(config=)`.
    pub fn from_single_file(
        name: &str,
        file: &Path,
        config_dir: Option<&Path>,
        device: &Device,
        dtype: DType,
    ) -> Result<Self, LoadError> {
        let overrides = config_dir.map(ConfigDir::open).transpose()?;
        let converted = sdhive_checkpoint::load_single_file_on(file, overrides.as_ref(), device)?;
        let Converted { unet, vae, text_encoder, text_encoder_2, configs, .. } = converted;
        let family = if text_encoder_2.is_some() { Family::Sdxl } else { Family::Sd };
        let unet_cfg: UNet2DConditionConfig = from_json_value(&file.join("unet/config.json"), &configs.unet)?;
        let vae_cfg: AutoencoderKLConfig = from_json_value(&file.join("vae/config.json"), &configs.vae)?;
        let te_cfg: ClipTextConfig =
            from_json_value(&file.join("text_encoder/config.json"), &configs.text_encoder)?;
        let vb = |weights, dt| VarBuilder::from_tensors(weights, dt, device);
        let unet_model = UNet2DConditionModel::new(vb(unet, dtype), &unet_cfg)?;
        let vae_model = AutoencoderKL::new(vb(vae, vae_dtype(family, dtype, &vae_cfg)), &vae_cfg)?;
        // Single files carry no tokenizer. A config folder's tokenizer wins (as in diffusers' `config=`); otherwise
        // the bundled CLIP vocabulary serves, padded as each encoder was trained (CLIP-L with its end token,
        // OpenCLIP with "!").
        let tokenizer = |sub: &str, pad: PadToken| -> Result<ClipTokenizer, LoadError> {
            match config_dir.map(|d| d.join(sub)).filter(|d| d.join("vocab.json").is_file()) {
                Some(dir) => Ok(ClipTokenizer::from_dir(&dir)?),
                None => Ok(ClipTokenizer::bundled(pad)?),
            }
        };
        let first_pad = if configs.text_encoder.get("hidden_act").and_then(Value::as_str) == Some("gelu") {
            PadToken::Exclamation
        } else {
            PadToken::EndOfText
        };
        let mut encoders = vec![TextEncoder {
            tokenizer: tokenizer("tokenizer", first_pad)?,
            model: ClipTextModel::new(vb(text_encoder, dtype), &te_cfg, false)?,
        }];
        if let (Some(weights), Some(cfg)) = (text_encoder_2, configs.text_encoder_2.as_ref()) {
            let cfg2: ClipTextConfig = from_json_value(&file.join("text_encoder_2/config.json"), cfg)?;
            encoders.push(TextEncoder {
                tokenizer: tokenizer("tokenizer_2", PadToken::Exclamation)?,
                model: ClipTextModel::new(vb(weights, dtype), &cfg2, true)?,
            });
        }
        let scheduler_config = SchedulerConfig::from_json_value(configs.scheduler.clone())?;
        let sample_size = sample_size(&configs.unet);
        let parts = Parts { unet: unet_model, vae: vae_model, encoders, scheduler_config, sample_size };
        Ok(Self::assemble(name, family, parts, family == Family::Sdxl))
    }

    fn assemble(name: &str, family: Family, parts: Parts, force_zeros_for_empty_prompt: bool) -> Self {
        let Parts { unet, vae, encoders, scheduler_config, sample_size } = parts;
        let vae_scale_factor = 1usize << (vae.config().block_out_channels.len().saturating_sub(1));
        let side = (sample_size * vae_scale_factor) as u32;
        SdModel {
            name: name.to_string(),
            family,
            unet,
            vae,
            encoders,
            scheduler_config,
            force_zeros_for_empty_prompt,
            vae_scale_factor,
            native_size: (side, side),
        }
    }

    /// In-channels of the UNet: 4 for ordinary models, 9 for inpainting models (latents + mask + masked image).
    pub fn unet_in_channels(&self) -> usize {
        self.unet.config().in_channels
    }
}

/// The loaded networks before the model-wide facts are derived from them.
struct Parts {
    unet: UNet2DConditionModel,
    vae: AutoencoderKL,
    encoders: Vec<TextEncoder>,
    scheduler_config: SchedulerConfig,
    sample_size: usize,
}

/// The UNet's native latent side (`sample_size`), which sets the default image size; diffusers' default is 64.
fn sample_size(unet_config: &Value) -> usize {
    unet_config.get("sample_size").and_then(Value::as_u64).map(|v| v as usize).unwrap_or(64)
}

/// The VAE runs in the pipeline's dtype, as in diffusers, except where diffusers upcasts it: the SDXL pipelines
/// decode (and encode) in f32 when the VAE is f16 and its config sets `force_upcast`, because the SDXL VAE
/// overflows in f16. The SD 1.x/2.x pipelines never upcast, and bf16 has the range to need no upcast.
fn vae_dtype(family: Family, dtype: DType, cfg: &AutoencoderKLConfig) -> DType {
    if family == Family::Sdxl && cfg.force_upcast && dtype == DType::F16 {
        DType::F32
    } else {
        dtype
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vae_precision_follows_the_diffusers_pipelines() {
        let upcast = AutoencoderKLConfig { force_upcast: true, ..sdhive_models::sdxl_vae_config() };
        let plain = AutoencoderKLConfig { force_upcast: false, ..upcast.clone() };
        assert_eq!(vae_dtype(Family::Sdxl, DType::F16, &upcast), DType::F32);
        assert_eq!(vae_dtype(Family::Sdxl, DType::F16, &plain), DType::F16);
        assert_eq!(vae_dtype(Family::Sdxl, DType::BF16, &upcast), DType::BF16);
        assert_eq!(vae_dtype(Family::Sd, DType::F16, &upcast), DType::F16);
        assert_eq!(vae_dtype(Family::Sd, DType::F32, &upcast), DType::F32);
    }
}
