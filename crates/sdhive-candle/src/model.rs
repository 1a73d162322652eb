//! A loaded Stable Diffusion model: its family, networks, tokenizers and scheduler config, read either from a
//! diffusers folder (honouring every component's config as diffusers does) or from a single-file checkpoint
//! converted at load time, each network on the device and in the dtype its [`Targets`] entry says.

use crate::residency::{ModuleTarget, Resident, Targets};
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use sdhive_checkpoint::{ConfigDir, Converted};
use sdhive_models::loading::{count_component_values, describe_weights, read_component};
use sdhive_models::params;
use sdhive_models::{
    find_weight_files, open_safetensors, AutoencoderKL, AutoencoderKLConfig, ClipTextConfig, ClipTextModel,
    UNet2DConditionConfig, UNet2DConditionModel,
};
use sdhive_modelsource::{ModelLocation, ResolvedModel};
use sdhive_schedulers::SchedulerConfig;
use sdhive_tokenizer::{ClipTokenizer, PadToken};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
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
    /// Shared with the host copy the RAM cache keeps.
    pub tokenizer: Arc<ClipTokenizer>,
    pub model: Resident<ClipTextModel>,
}

pub struct SdModel {
    pub name: String,
    pub family: Family,
    pub unet: Resident<UNet2DConditionModel>,
    pub unet_config: UNet2DConditionConfig,
    pub vae: Resident<AutoencoderKL>,
    pub vae_config: AutoencoderKLConfig,
    /// SD: one encoder. SDXL: `[text_encoder, text_encoder_2]`.
    pub encoders: Vec<TextEncoder>,
    pub scheduler_config: SchedulerConfig,
    /// SDXL: an empty negative prompt means zero embeddings (diffusers' `force_zeros_for_empty_prompt`).
    pub force_zeros_for_empty_prompt: bool,
    /// 2^(number of VAE blocks − 1): 8 for every released model.
    pub vae_scale_factor: usize,
    pub native_size: (u32, u32),
    /// The LoRAs merged into the weights now.
    pub loras: crate::lora::AppliedLoras,
    /// The textual-inversion embeddings prompts are encoded with now.
    pub embeddings: crate::embeddings::ActiveEmbeddings,
    /// Recent prompts' encodings.
    pub(crate) text_cache: crate::conditioning::TextCache,
}

impl Drop for SdModel {
    /// Weights on the CPU share memory with the RAM cache's host copy: a LoRA merged into them is taken out
    /// before the model goes, or the cache would keep it.
    fn drop(&mut self) {
        if !self.loras.is_empty() {
            if let Err(e) = self.restore_loras() {
                tracing::error!(
                    "putting LoRA-merged weights back as the model `{}` is dropped: {e}",
                    self.name
                );
            }
        }
    }
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
    /// The model on `targets`, with the standalone VAE `model.vae` in place of its own when given.
    pub fn load(model: &ResolvedModel, targets: &Targets) -> Result<Self, LoadError> {
        let mut loaded = match &model.location {
            ModelLocation::DiffusersDir(dir) => Self::from_diffusers_dir_on(&model.name, dir, targets)?,
            ModelLocation::SingleFile(file) => {
                let config = config_beside(file);
                Self::from_single_file_on(&model.name, file, config.as_deref(), targets)?
            }
        };
        if let Some(vae) = &model.vae {
            loaded.replace_vae(vae, &targets.vae)?;
        }
        Ok(loaded)
    }

    /// Swaps in a standalone VAE file (A1111's `sd_vae`), read in the original layout and built with this model's
    /// VAE config: the scaling factor stays the model's, as in A1111 and diffusers' `from_single_file(vae=…)`.
    pub fn replace_vae(&mut self, file: &Path, target: &ModuleTarget) -> Result<(), LoadError> {
        let weights = sdhive_checkpoint::load_vae_file_on(file, &Device::Cpu)?;
        let cfg = self.vae_config.clone();
        let target = ModuleTarget { dtype: vae_dtype(self.family, target.dtype, &cfg), ..target.clone() };
        self.vae = Resident::from_host(weights, target, move |vb| AutoencoderKL::new(vb, &cfg))
            .map_err(|e| layout_err(file, format!("this VAE does not fit the model `{}`: {e}", self.name)))?;
        Ok(())
    }

    /// The model with every network kept as host tensors (on the CPU, each in the dtype its target asks for):
    /// what the RAM cache of recently used checkpoints holds. [`SdModel::place`] builds it on a device.
    pub fn load_host(model: &ResolvedModel, targets: &Targets) -> Result<Self, LoadError> {
        Self::load(model, &targets.host_copies())
    }

    /// Bytes of host memory held by a model from [`SdModel::load_host`].
    pub fn host_bytes(&self) -> u64 {
        self.unet.host_bytes()
            + self.vae.host_bytes()
            + self.encoders.iter().map(|e| e.model.host_bytes()).sum::<u64>()
    }

    /// A model from [`SdModel::load_host`] built on `targets`' devices, sharing its host tensors (nothing is read
    /// from disk; on a GPU only the upload remains).
    pub fn place(&self, name: &str, targets: &Targets) -> Result<Self, LoadError> {
        fn put<T>(r: &Resident<T>, t: &ModuleTarget) -> Result<Resident<T>, LoadError> {
            match r.place(&t.device, t.offload) {
                Some(placed) => Ok(placed?),
                None => Err(LoadError::Layout {
                    path: PathBuf::from("<host cache>"),
                    message: "the cached model holds no host copy".into(),
                }),
            }
        }
        let encoders = self
            .encoders
            .iter()
            .map(|e| {
                Ok(TextEncoder { tokenizer: Arc::clone(&e.tokenizer), model: put(&e.model, &targets.text)? })
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        Ok(SdModel {
            name: name.to_string(),
            family: self.family,
            unet: put(&self.unet, &targets.unet)?,
            unet_config: self.unet_config.clone(),
            vae: put(&self.vae, &targets.vae)?,
            vae_config: self.vae_config.clone(),
            encoders,
            scheduler_config: self.scheduler_config.clone(),
            force_zeros_for_empty_prompt: self.force_zeros_for_empty_prompt,
            vae_scale_factor: self.vae_scale_factor,
            native_size: self.native_size,
            loras: Default::default(),
            embeddings: Default::default(),
            text_cache: Default::default(),
        })
    }

    /// A diffusers pipeline folder with every network on `device` in `dtype`.
    pub fn from_diffusers_dir(
        name: &str,
        dir: &Path,
        device: &Device,
        dtype: DType,
    ) -> Result<Self, LoadError> {
        Self::from_diffusers_dir_on(name, dir, &Targets::all(device, dtype))
    }

    /// A diffusers pipeline folder: `model_index.json` names the components, each with its own config.
    pub fn from_diffusers_dir_on(name: &str, dir: &Path, targets: &Targets) -> Result<Self, LoadError> {
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
        let unet_config = UNet2DConditionConfig::from_file(&dir.join("unet").join("config.json"))?;
        let cfg = unet_config.clone();
        let unet = component(&dir.join("unet"), targets.unet.clone(), move |vb| {
            UNet2DConditionModel::new(vb, &cfg)
        })?;
        let vae_config = AutoencoderKLConfig::from_file(&dir.join("vae").join("config.json"))?;
        let vae_target =
            ModuleTarget { dtype: vae_dtype(family, targets.vae.dtype, &vae_config), ..targets.vae.clone() };
        let cfg = vae_config.clone();
        let vae = component(&dir.join("vae"), vae_target, move |vb| AutoencoderKL::new(vb, &cfg))?;
        let encoder = |sub: &str, tok: &str, projection: bool| -> Result<TextEncoder, LoadError> {
            let cfg = ClipTextConfig::from_file(&dir.join(sub).join("config.json"))?;
            Ok(TextEncoder {
                tokenizer: Arc::new(ClipTokenizer::from_dir(&dir.join(tok))?),
                model: component(&dir.join(sub), targets.text.clone(), move |vb| {
                    ClipTextModel::new(vb, &cfg, projection)
                })?,
            })
        };
        let mut encoders = vec![encoder("text_encoder", "tokenizer", false)?];
        if family == Family::Sdxl {
            encoders.push(encoder("text_encoder_2", "tokenizer_2", true)?);
        }
        let scheduler_config =
            SchedulerConfig::from_file(dir.join("scheduler").join("scheduler_config.json"))?;
        let force_zeros_for_empty_prompt = index
            .get("force_zeros_for_empty_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(family == Family::Sdxl);
        let sample_size = sample_size(&read_json(&dir.join("unet").join("config.json"))?);
        let parts = Parts { unet, unet_config, vae, vae_config, encoders, scheduler_config, sample_size };
        Ok(Self::assemble(name, family, parts, force_zeros_for_empty_prompt))
    }

    /// A single-file checkpoint in the original layout with every network on `device` in `dtype`.
    /// `config_dir` plays diffusers' `from_single_file(config=)`.
    pub fn from_single_file(
        name: &str,
        file: &Path,
        config_dir: Option<&Path>,
        device: &Device,
        dtype: DType,
    ) -> Result<Self, LoadError> {
        Self::from_single_file_on(name, file, config_dir, &Targets::all(device, dtype))
    }

    /// A single-file checkpoint in the original layout, each network where `targets` says.
    pub fn from_single_file_on(
        name: &str,
        file: &Path,
        config_dir: Option<&Path>,
        targets: &Targets,
    ) -> Result<Self, LoadError> {
        let overrides = config_dir.map(ConfigDir::open).transpose()?;
        // Converted straight onto the device when everything lives there; through host memory otherwise.
        let same_device =
            [&targets.text, &targets.vae].iter().all(|t| t.device.same_device(&targets.unet.device));
        let read_on =
            if same_device && !targets.any_offloaded() { targets.unet.device.clone() } else { Device::Cpu };
        let converted = sdhive_checkpoint::load_single_file_on(file, overrides.as_ref(), &read_on)?;
        let Converted { unet, vae, text_encoder, text_encoder_2, configs, .. } = converted;
        let family = if text_encoder_2.is_some() { Family::Sdxl } else { Family::Sd };
        let unet_config: UNet2DConditionConfig =
            from_json_value(&file.join("unet/config.json"), &configs.unet)?;
        let vae_config: AutoencoderKLConfig = from_json_value(&file.join("vae/config.json"), &configs.vae)?;
        let te_cfg: ClipTextConfig =
            from_json_value(&file.join("text_encoder/config.json"), &configs.text_encoder)?;
        let cfg = unet_config.clone();
        let unet_model =
            Resident::from_host(unet, targets.unet.clone(), move |vb| UNet2DConditionModel::new(vb, &cfg))?;
        let vae_target =
            ModuleTarget { dtype: vae_dtype(family, targets.vae.dtype, &vae_config), ..targets.vae.clone() };
        let cfg = vae_config.clone();
        let vae_model = Resident::from_host(vae, vae_target, move |vb| AutoencoderKL::new(vb, &cfg))?;
        // Single files carry no tokenizer. A config folder's tokenizer wins (as in diffusers' `config=`); otherwise
        // the bundled CLIP vocabulary serves, padded as each encoder was trained (CLIP-L with its end token,
        // OpenCLIP with "!").
        let tokenizer = |sub: &str, pad: PadToken| -> Result<Arc<ClipTokenizer>, LoadError> {
            match config_dir.map(|d| d.join(sub)).filter(|d| d.join("vocab.json").is_file()) {
                Some(dir) => Ok(Arc::new(ClipTokenizer::from_dir(&dir)?)),
                None => Ok(Arc::new(ClipTokenizer::bundled(pad)?)),
            }
        };
        let first_pad = if configs.text_encoder.get("hidden_act").and_then(Value::as_str) == Some("gelu") {
            PadToken::Exclamation
        } else {
            PadToken::EndOfText
        };
        let mut encoders = vec![TextEncoder {
            tokenizer: tokenizer("tokenizer", first_pad)?,
            model: Resident::from_host(text_encoder, targets.text.clone(), move |vb| {
                ClipTextModel::new(vb, &te_cfg, false)
            })?,
        }];
        if let (Some(weights), Some(cfg)) = (text_encoder_2, configs.text_encoder_2.as_ref()) {
            let cfg2: ClipTextConfig = from_json_value(&file.join("text_encoder_2/config.json"), cfg)?;
            encoders.push(TextEncoder {
                tokenizer: tokenizer("tokenizer_2", PadToken::Exclamation)?,
                model: Resident::from_host(weights, targets.text.clone(), move |vb| {
                    ClipTextModel::new(vb, &cfg2, true)
                })?,
            });
        }
        let scheduler_config = SchedulerConfig::from_json_value(configs.scheduler.clone())?;
        let sample_size = sample_size(&configs.unet);
        let parts = Parts {
            unet: unet_model,
            unet_config,
            vae: vae_model,
            vae_config,
            encoders,
            scheduler_config,
            sample_size,
        };
        Ok(Self::assemble(name, family, parts, family == Family::Sdxl))
    }

    fn assemble(name: &str, family: Family, parts: Parts, force_zeros_for_empty_prompt: bool) -> Self {
        let Parts { unet, unet_config, vae, vae_config, encoders, scheduler_config, sample_size } = parts;
        let vae_scale_factor = 1usize << (vae_config.block_out_channels.len().saturating_sub(1));
        let side = (sample_size * vae_scale_factor) as u32;
        SdModel {
            name: name.to_string(),
            family,
            unet,
            unet_config,
            vae,
            vae_config,
            encoders,
            scheduler_config,
            force_zeros_for_empty_prompt,
            vae_scale_factor,
            native_size: (side, side),
            loras: Default::default(),
            embeddings: Default::default(),
            text_cache: Default::default(),
        }
    }

    /// In-channels of the UNet: 4 for ordinary models, 9 for inpainting models (latents + mask + masked image).
    pub fn unet_in_channels(&self) -> usize {
        self.unet_config.in_channels
    }

    /// Device bytes held by the weights of the networks on `device` between jobs (offloaded ones hold none).
    pub fn resident_bytes_on(&self, device: &Device) -> u64 {
        let on = |d: &Device| d.same_device(device);
        let mut n = 0;
        if on(self.unet.device()) {
            n += self.unet.resident_bytes();
        }
        if on(self.vae.device()) {
            n += self.vae.resident_bytes();
        }
        n + self
            .encoders
            .iter()
            .filter(|e| on(e.model.device()))
            .map(|e| e.model.resident_bytes())
            .sum::<u64>()
    }
}

/// A diffusers folder of the same name beside a single-file checkpoint (`sd15/` next to `sd15.safetensors`): the
/// file's config, as diffusers' `from_single_file(config=…)` takes one. Its tokenizers and component configs win
/// over what the weights' shapes imply (a checkpoint with a vocabulary of its own needs this).
pub fn config_beside(file: &Path) -> Option<PathBuf> {
    let dir = file.with_extension("");
    (dir != file && dir.join("model_index.json").is_file()).then_some(dir)
}

/// A diffusers component folder as a network on `target`: memory-mapped straight onto the device, or read into
/// host memory when it is offloaded.
pub(crate) fn component<T>(
    dir: &Path,
    target: ModuleTarget,
    build: impl Fn(VarBuilder<'static>) -> sdhive_models::Result<T> + Send + Sync + 'static,
) -> Result<Resident<T>, LoadError> {
    let origin = |e: sdhive_models::ModelError| e.with_weight_origin(&describe_weights(dir));
    if target.offload {
        let weights = read_component(dir)?;
        return Ok(Resident::from_host(weights, target, build).map_err(origin)?);
    }
    let bytes = count_component_values(dir)? * target.dtype.size_in_bytes() as u64;
    let files = find_weight_files(dir)?;
    // Opened first on its own so that a broken file's error names it.
    open_safetensors(&files, target.dtype, &target.device)?;
    // SAFETY: weights are read-only inputs mapped for the build, as in `open_safetensors`.
    let mapped = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files) }
        .map_err(|source| LoadError::Layout { path: dir.to_path_buf(), message: source.to_string() })?;
    let vb = params::recording_builder(mapped, target.dtype, &target.device);
    let (model, params) = params::record(|| build(vb));
    Ok(Resident::loaded(model.map_err(origin)?, params, target, bytes))
}

/// The loaded networks before the model-wide facts are derived from them.
struct Parts {
    unet: Resident<UNet2DConditionModel>,
    unet_config: UNet2DConditionConfig,
    vae: Resident<AutoencoderKL>,
    vae_config: AutoencoderKLConfig,
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
