//! SD3 / SD3.5 text-to-image on the candle engine, as diffusers' `StableDiffusion3Pipeline` computes it: a model
//! read from a diffusers folder (CLIP-L and CLIP-G with their projection heads, T5 — optional, zeros when left
//! out as diffusers makes them —, the MMDiT transformer, the 16-channel VAE, the flow-match scheduler), the joint
//! context built as `encode_prompt` builds it (each CLIP's penultimate hidden state — an earlier one with clip
//! skip, for the prompt only —, joined along the features, zero-padded to T5's width, then T5's states appended
//! along the sequence; the projected pooled outputs joined),
//! classifier-free guidance with the negative prompt first, flow-matching Euler steps (or DPM++ 2M on flow sigmas,
//! as diffusers runs it when the pipeline's scheduler is swapped for it), skip-layer guidance's extra pass on the
//! positive prompt where asked, and the decode of `latents / scaling_factor + shift_factor`. img2img as
//! `StableDiffusion3Img2ImgPipeline`, inpainting as `StableDiffusion3InpaintPipeline` runs a 16-channel transformer
//! (the latents outside the mask put back to the re-noised init latents after every step).
//!
//! Workers serve it through `Sd3Engine`. Each network is a [`Resident`] on its own target (`--placement`,
//! `--offload`, module `te` being all three text encoders); LoRAs are merged into the MMDiT's and both CLIPs'
//! weights in place, or into an offloaded network's host copy (`lora.rs`).

use crate::model::component;
use crate::residency::{InUse, ModuleTarget, Resident, Targets};
use crate::tensor_image::{image_to_tensor, mask_to_tensor, nearest_downsample, tensor_to_image};
use candle_core::{DType, Device, Tensor, D};
use sdhive_engine::memory::ATTENTION_SLICES;
use sdhive_engine::{GrayImage, RgbImage, SkipLayerGuidance};
use sdhive_models::ops::{limit_attention_scores, MAX_SCORE_ELEMENTS};
use sdhive_models::{
    AutoencoderKL, AutoencoderKLConfig, ClipTextConfig, ClipTextModel, SD3Transformer2DModel,
    SD3TransformerConfig, T5Config, T5EncoderModel,
};
use sdhive_modelsource::ResolvedModel;
use sdhive_rng::TorchGenerator;
use sdhive_schedulers::{FlowMatchConfig, FlowMatchEulerDiscrete, FlowSampler, FlowScheduler};
use sdhive_tokenizer::{ClipTokenizer, PadToken, T5Tokenizer, T5_DEFAULT_MAX_LEN};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum Sd3Error {
    #[error("{path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("invalid `{field}`: {message}")]
    Invalid { field: &'static str, message: String },
    #[error("SD3 generation failed at {stage}: {message}")]
    Failed { stage: &'static str, message: String },
    #[error("cancelled")]
    Cancelled,
}

fn load<T, E: std::fmt::Display>(path: &Path, r: std::result::Result<T, E>) -> Result<T, Sd3Error> {
    r.map_err(|e| Sd3Error::Load { path: path.to_path_buf(), message: e.to_string() })
}

fn failed<E: std::fmt::Display>(stage: &'static str) -> impl Fn(E) -> Sd3Error {
    move |e| Sd3Error::Failed { stage, message: e.to_string() }
}

/// A loaded SD3-family model. Each network lives where its [`Targets`] entry puts it: the three text encoders
/// (module `te`) on `targets.text`, the MMDiT on `targets.unet`, the VAE on `targets.vae`; an offloaded one is a
/// host copy built on its device for each use (the text encoders per prompt, the MMDiT per image, the VAE per
/// encode or decode) and dropped after.
pub struct Sd3Model {
    pub clip_l: Resident<ClipTextModel>,
    pub tokenizer_l: Arc<ClipTokenizer>,
    pub clip_g: Resident<ClipTextModel>,
    pub tokenizer_g: Arc<ClipTokenizer>,
    /// `None`: left out (diffusers' `text_encoder_3=None`), its part of the context is zeros.
    pub t5: Option<(Resident<T5EncoderModel>, Arc<T5Tokenizer>)>,
    pub transformer: Sd3Transformer,
    pub vae: Resident<AutoencoderKL>,
    vae_config: AutoencoderKLConfig,
    pub scheduler: FlowMatchConfig,
    /// Decode in overlapping tiles (diffusers' `enable_tiling()`), as a job's memory plan asks.
    pub vae_tiling: bool,
}

/// The MMDiT with its config, kept beside it because an offloaded MMDiT is not built between uses; derefs to its
/// [`Resident`] (device, dtype, `in_use`, LoRA merging).
pub struct Sd3Transformer {
    network: Resident<SD3Transformer2DModel>,
    config: SD3TransformerConfig,
}

impl Sd3Transformer {
    pub fn config(&self) -> &SD3TransformerConfig {
        &self.config
    }

    /// One pass, the MMDiT built for it when offloaded (a loop holds [`Resident::in_use`] instead).
    pub fn forward(
        &self,
        latents: &Tensor,
        timestep: &Tensor,
        context: &Tensor,
        pooled: &Tensor,
    ) -> sdhive_models::Result<Tensor> {
        self.network.in_use()?.forward(latents, timestep, context, pooled)
    }
}

impl std::ops::Deref for Sd3Transformer {
    type Target = Resident<SD3Transformer2DModel>;

    fn deref(&self) -> &Self::Target {
        &self.network
    }
}

impl std::ops::DerefMut for Sd3Transformer {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.network
    }
}

/// One text-to-image request.
#[derive(Debug, Clone, PartialEq)]
pub struct Sd3Request {
    pub prompt: String,
    pub negative_prompt: String,
    pub width: usize,
    pub height: usize,
    pub steps: usize,
    /// Classifier-free guidance runs when above 1, as diffusers decides.
    pub guidance_scale: f64,
    pub seed: u64,
    /// T5's tokens (diffusers' `max_sequence_length`, default 256, at most 512).
    pub max_sequence_length: usize,
    /// img2img: the starting image (resized to `width`×`height`) and how much of it is repainted (0–1).
    pub init_image: Option<RgbImage>,
    pub strength: f64,
    /// Inpainting (needs `init_image`): white repaints, black keeps; resized to `width`×`height` and binarised at
    /// 0.5 as diffusers' mask processor does (blur and the like are the caller's, as for SD1/SDXL).
    pub mask: Option<GrayImage>,
    /// The flow scheduler: Euler (the model's own) or DPM++ 2M (text-to-image only, as in diffusers).
    pub sampler: FlowSampler,
    /// Skip-layer guidance: text-to-image with CFG only, as diffusers' `StableDiffusion3Pipeline` has it.
    pub skip_layer_guidance: Option<SkipLayerGuidance>,
    /// A1111's clip skip n (1 = the default): diffusers' `clip_skip = n − 1`, each CLIP's prompt states read from
    /// `hidden_states[-(n + 1)]` (n = 1: the penultimate layer). As in diffusers' SD3 pipelines it applies to the
    /// prompt only: the negative prompt reads the penultimate layer, and the pooled outputs never change.
    pub clip_skip: u32,
}

impl Sd3Request {
    pub fn new(prompt: &str, seed: u64) -> Sd3Request {
        Sd3Request {
            prompt: prompt.into(),
            negative_prompt: String::new(),
            width: 1024,
            height: 1024,
            steps: 28,
            guidance_scale: 7.0,
            seed,
            max_sequence_length: T5_DEFAULT_MAX_LEN,
            init_image: None,
            strength: 0.75,
            mask: None,
            sampler: FlowSampler::Euler,
            skip_layer_guidance: None,
            clip_skip: 1,
        }
    }
}

/// One image of a batched text-to-image run ([`Sd3Model::denoise_batch`]): what it carries on its own.
#[derive(Debug, Clone)]
pub struct Sd3Row {
    pub prompt: String,
    pub negative_prompt: String,
    pub seed: u64,
    pub guidance_scale: f64,
    /// As [`Sd3Request::clip_skip`].
    pub clip_skip: u32,
}

/// The transformer's velocity for `latents` at timestep `t`: with `cfg` the latents twice over (the contexts'
/// negatives then positives), one call for every row.
fn velocity(
    transformer: &SD3Transformer2DModel,
    latents: &Tensor,
    t: f64,
    (context, pooled): (&Tensor, &Tensor),
    cfg: bool,
) -> Result<Tensor, Sd3Error> {
    let input = if cfg { Tensor::cat(&[latents, latents], 0) } else { Ok(latents.clone()) }
        .map_err(failed("denoise"))?;
    let timestep = Tensor::full(t as f32, input.dim(0).map_err(failed("denoise"))?, latents.device())
        .and_then(|t| t.to_dtype(latents.dtype()))
        .map_err(failed("denoise"))?;
    transformer.forward(&input, &timestep, context, pooled).map_err(failed("transformer"))
}

/// Classifier-free guidance of row `r` of a velocity over `rows` negatives then `rows` positives:
/// `uncond + scale · (text − uncond)`.
fn guided_row(v: &Tensor, rows: usize, r: usize, scale: f64) -> candle_core::Result<Tensor> {
    let uncond = v.narrow(0, r, 1)?;
    let delta = (v.narrow(0, rows + r, 1)? - &uncond)?;
    uncond + delta.affine(scale, 0.0)?
}

/// The text encoders built for use: see [`Sd3Model::text_encoders`].
struct TextEncoders<'a> {
    clip_l: InUse<'a, ClipTextModel>,
    clip_g: InUse<'a, ClipTextModel>,
    t5: Option<InUse<'a, T5EncoderModel>>,
}

/// Inpainting's per-step blend for a 16-channel transformer: the latent-size binary mask and the init latents.
struct Inpaint {
    mask: Tensor,
    /// `1 − mask`.
    keep: Tensor,
    init: Tensor,
}

impl Inpaint {
    /// `(1 − mask)·init' + mask·latents`, `init'` the init latents noised to the sigma of step `next` (the
    /// scheduler's step index after the step just taken), the clean init latents after the last step.
    fn blend(
        &self,
        scheduler: &FlowScheduler,
        next: usize,
        latents: &Tensor,
        noise: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let proper = if next < scheduler.timesteps().len() {
            scheduler.scale_noise(&self.init, noise, next).map_err(candle_core::Error::wrap)?
        } else {
            self.init.clone()
        };
        let dtype = latents.dtype();
        let kept = proper.broadcast_mul(&self.keep)?;
        let painted = latents.to_dtype(DType::F32)?.broadcast_mul(&self.mask)?;
        (kept + painted)?.to_dtype(dtype)
    }
}

/// A step's estimate of the clean latents, `x − σ·v`, made only when asked for (a preview), not on every step.
pub struct StepEstimate<'a> {
    x: &'a Tensor,
    v: &'a Tensor,
    sigma: f64,
}

impl StepEstimate<'_> {
    pub fn latents(&self) -> candle_core::Result<Tensor> {
        self.x - self.v.affine(self.sigma, 0.0)?
    }
}

/// What one generation made.
pub struct Sd3Output {
    /// The initial noise `(1, C, h, w)`.
    pub noise: Tensor,
    /// The last step's latents, before `/ scaling_factor + shift_factor`.
    pub latents: Tensor,
    pub image: RgbImage,
}

impl Sd3Model {
    /// Reads a diffusers folder (`model_index.json` beside `text_encoder`, `text_encoder_2`, `text_encoder_3`,
    /// `tokenizer*`, `transformer`, `vae`, `scheduler`) with every network on `device` in `dtype`; `with_t5: false`
    /// leaves T5 out (about 9 GB in f16 for T5-XXL), as does a folder without `text_encoder_3`.
    pub fn from_dir(dir: &Path, dtype: DType, device: &Device, with_t5: bool) -> Result<Sd3Model, Sd3Error> {
        Self::from_dir_on(dir, &Targets::all(device, dtype), with_t5)
    }

    /// [`Sd3Model::from_dir`] with each network on its own target (device, dtype, offload).
    pub fn from_dir_on(dir: &Path, targets: &Targets, with_t5: bool) -> Result<Sd3Model, Sd3Error> {
        let sub = |name: &str| dir.join(name);
        let config = |name: &str| sub(name).join("config.json");
        let clip = |name: &str| -> Result<Resident<ClipTextModel>, Sd3Error> {
            let cfg = load(&config(name), ClipTextConfig::from_file(&config(name)))?;
            let target = targets.text.clone();
            load(&sub(name), component(&sub(name), target, move |vb| ClipTextModel::new(vb, &cfg, true)))
        };
        let tokenizer = |name: &str| {
            let path = sub(name);
            load(&path, ClipTokenizer::from_dir(&path)).map(Arc::new)
        };
        let t5 = match (with_t5, sub("text_encoder_3").is_dir()) {
            (true, true) => {
                let path = sub("text_encoder_3");
                let cfg = load(&config("text_encoder_3"), T5Config::from_file(&config("text_encoder_3")))?;
                let encoder = load(
                    &path,
                    component(&path, targets.text.clone(), move |vb| T5EncoderModel::new(vb, &cfg)),
                )?;
                let tokenizer = load(&sub("tokenizer_3"), T5Tokenizer::from_dir(&sub("tokenizer_3")))?;
                Some((encoder, Arc::new(tokenizer)))
            }
            _ => None,
        };
        let scheduler_file = sub("scheduler").join("scheduler_config.json");
        let transformer_config =
            load(&config("transformer"), SD3TransformerConfig::from_file(&config("transformer")))?;
        let cfg = transformer_config.clone();
        let transformer = load(
            &sub("transformer"),
            component(&sub("transformer"), targets.unet.clone(), move |vb| {
                SD3Transformer2DModel::new(vb, &cfg)
            }),
        )?;
        let vae_config = load(&config("vae"), AutoencoderKLConfig::from_file(&config("vae")))?;
        let cfg = vae_config.clone();
        let vae = load(
            &sub("vae"),
            component(&sub("vae"), targets.vae.clone(), move |vb| AutoencoderKL::new(vb, &cfg)),
        )?;
        Ok(Sd3Model {
            clip_l: clip("text_encoder")?,
            tokenizer_l: tokenizer("tokenizer")?,
            clip_g: clip("text_encoder_2")?,
            tokenizer_g: tokenizer("tokenizer_2")?,
            t5,
            transformer: Sd3Transformer { network: transformer, config: transformer_config },
            vae,
            vae_config,
            scheduler: load(&scheduler_file, FlowMatchConfig::from_file(&scheduler_file))?,
            vae_tiling: false,
        })
    }

    /// Reads an SD3 / SD3.5 single file in SAI's layout, converted by `sdhive_checkpoint` into the networks
    /// `from_dir` builds, every network on `device` in `dtype`. `config_dir`, a diffusers folder of the model
    /// (diffusers' `from_single_file(config=…)`), gives the configs and the tokenizers; text encoders the file does
    /// not carry (SD3.5 files carry none) come from its `text_encoder*` folders. Without a folder the configs are
    /// inferred and CLIP uses the bundled vocabulary (a file with T5 then needs the folder's `tokenizer_3`).
    pub fn from_single_file(
        file: &Path,
        config_dir: Option<&Path>,
        dtype: DType,
        device: &Device,
        with_t5: bool,
    ) -> Result<Sd3Model, Sd3Error> {
        Self::from_single_file_on(file, config_dir, &Targets::all(device, dtype), with_t5)
    }

    /// [`Sd3Model::from_single_file`] with each network on its own target. The converted weights of an offloaded
    /// network are kept as its host copy.
    pub fn from_single_file_on(
        file: &Path,
        config_dir: Option<&Path>,
        targets: &Targets,
        with_t5: bool,
    ) -> Result<Sd3Model, Sd3Error> {
        // An offloaded network keeps the converted tensors as its host copy, so they are made in host memory.
        let convert_on = if targets.any_offloaded() { Device::Cpu } else { targets.unet.device.clone() };
        let c = load(file, sdhive_checkpoint::load_sd3_single_file_on(file, config_dir, &convert_on))?;
        fn parse<T: serde::de::DeserializeOwned>(
            file: &Path,
            sub: &str,
            v: &serde_json::Value,
        ) -> Result<T, Sd3Error> {
            serde_json::from_value(v.clone()).map_err(|e| Sd3Error::Load {
                path: file.to_path_buf(),
                message: format!("{sub} config: {e}"),
            })
        }
        let sub = |name: &str| config_dir.map(|d| d.join(name));
        let transformer_config: SD3TransformerConfig = parse(file, "transformer", &c.configs.transformer)?;
        let vae_config: AutoencoderKLConfig = parse(file, "vae", &c.configs.vae)?;
        let cfg = transformer_config.clone();
        let transformer = load(
            file,
            Resident::from_host(c.transformer, targets.unet.clone(), move |vb| {
                SD3Transformer2DModel::new(vb, &cfg)
            }),
        )?;
        let cfg = vae_config.clone();
        let vae = load(
            file,
            Resident::from_host(c.vae, targets.vae.clone(), move |vb| AutoencoderKL::new(vb, &cfg)),
        )?;
        let clip = |weights: Option<std::collections::HashMap<String, Tensor>>,
                    cfg: Option<&serde_json::Value>,
                    name: &str|
         -> Result<Resident<ClipTextModel>, Sd3Error> {
            let target = targets.text.clone();
            match (weights, cfg) {
                (Some(w), Some(cfg)) => {
                    let cfg: ClipTextConfig = parse(file, name, cfg)?;
                    load(file, Resident::from_host(w, target, move |vb| ClipTextModel::new(vb, &cfg, true)))
                }
                // The converter has checked that the config folder has this encoder.
                _ => match sub(name) {
                    Some(path) => {
                        let config = path.join("config.json");
                        let cfg = load(&config, ClipTextConfig::from_file(&config))?;
                        load(&path, component(&path, target, move |vb| ClipTextModel::new(vb, &cfg, true)))
                    }
                    None => Err(Sd3Error::Load {
                        path: file.to_path_buf(),
                        message: format!("no `{name}` in the file and no config folder to take it from"),
                    }),
                },
            }
        };
        let clip_l = clip(c.text_encoder, c.configs.text_encoder.as_ref(), "text_encoder")?;
        let clip_g = clip(c.text_encoder_2, c.configs.text_encoder_2.as_ref(), "text_encoder_2")?;
        let tokenizer = |name: &str, pad: PadToken| match sub(name).filter(|d| d.join("vocab.json").is_file())
        {
            Some(path) => load(&path, ClipTokenizer::from_dir(&path)).map(Arc::new),
            None => load(file, ClipTokenizer::bundled(pad)).map(Arc::new),
        };
        let t5_tokenizer = || {
            let path = sub("tokenizer_3").filter(|d| d.is_dir()).ok_or_else(|| Sd3Error::Load {
                path: file.to_path_buf(),
                message:
                    "T5 needs its tokenizer: give the model's diffusers folder (with `tokenizer_3`) as config"
                        .into(),
            })?;
            load(&path, T5Tokenizer::from_dir(&path)).map(Arc::new)
        };
        let t5 = match (with_t5, c.text_encoder_3, c.configs.text_encoder_3.as_ref()) {
            (false, _, _) => None,
            (true, Some(w), Some(cfg)) => {
                let cfg: T5Config = parse(file, "text_encoder_3", cfg)?;
                let encoder = load(
                    file,
                    Resident::from_host(w, targets.text.clone(), move |vb| T5EncoderModel::new(vb, &cfg)),
                )?;
                Some((encoder, t5_tokenizer()?))
            }
            (true, _, _) => match sub("text_encoder_3").filter(|d| d.is_dir()) {
                Some(path) => {
                    let config = path.join("config.json");
                    let cfg = load(&config, T5Config::from_file(&config))?;
                    let encoder = load(
                        &path,
                        component(&path, targets.text.clone(), move |vb| T5EncoderModel::new(vb, &cfg)),
                    )?;
                    Some((encoder, t5_tokenizer()?))
                }
                None => None,
            },
        };
        let scheduler = load(file, FlowMatchConfig::from_json_str(&c.configs.scheduler.to_string()))?;
        Ok(Sd3Model {
            clip_l,
            tokenizer_l: tokenizer("tokenizer", PadToken::EndOfText)?,
            clip_g,
            tokenizer_g: tokenizer("tokenizer_2", PadToken::Exclamation)?,
            t5,
            transformer: Sd3Transformer { network: transformer, config: transformer_config },
            vae,
            vae_config,
            scheduler,
            vae_tiling: false,
        })
    }

    /// A worker's model: a diffusers folder or an SAI single file (its configs and missing text encoders from the
    /// diffusers folder of its name beside it), each network on its target, with the standalone VAE `model.vae`
    /// in place of its own where one is chosen.
    pub fn load(model: &ResolvedModel, targets: &Targets, with_t5: bool) -> Result<Sd3Model, Sd3Error> {
        let path = model.location.path();
        let mut sd3 = if path.is_file() {
            let config = Some(path.with_extension("")).filter(|d| d.join("model_index.json").is_file());
            Self::from_single_file_on(path, config.as_deref(), targets, with_t5)?
        } else {
            Self::from_dir_on(path, targets, with_t5)?
        };
        if let Some(vae) = &model.vae {
            sd3.replace_vae(vae, &targets.vae)?;
        }
        Ok(sd3)
    }

    /// [`Sd3Model::load`] with every network kept as host tensors in the dtype its target asks for: what the RAM
    /// cache of recently used checkpoints holds; [`Sd3Model::place`] builds it on the targets' devices.
    pub fn load_host(model: &ResolvedModel, targets: &Targets, with_t5: bool) -> Result<Sd3Model, Sd3Error> {
        Self::load(model, &targets.host_copies(), with_t5)
    }

    /// Bytes of host memory held by a model from [`Sd3Model::load_host`].
    pub fn host_bytes(&self) -> u64 {
        let t5 = self.t5.as_ref().map_or(0, |(t5, _)| t5.host_bytes());
        self.clip_l.host_bytes()
            + self.clip_g.host_bytes()
            + t5
            + self.transformer.host_bytes()
            + self.vae.host_bytes()
    }

    /// A model from [`Sd3Model::load_host`] built on `targets`' devices (each network's dtype is its host copy's),
    /// sharing its host tensors: nothing is read from disk; on a GPU only the upload remains.
    pub fn place(&self, targets: &Targets) -> Result<Sd3Model, Sd3Error> {
        fn put<T>(r: &Resident<T>, t: &ModuleTarget) -> Result<Resident<T>, Sd3Error> {
            match r.place(&t.device, t.offload) {
                Some(placed) => placed.map_err(failed("placing a cached network")),
                None => Err(Sd3Error::Load {
                    path: PathBuf::from("<host cache>"),
                    message: "the cached model holds no host copy".into(),
                }),
            }
        }
        let t5 = match &self.t5 {
            Some((t5, tokenizer)) => Some((put(t5, &targets.text)?, Arc::clone(tokenizer))),
            None => None,
        };
        Ok(Sd3Model {
            clip_l: put(&self.clip_l, &targets.text)?,
            tokenizer_l: Arc::clone(&self.tokenizer_l),
            clip_g: put(&self.clip_g, &targets.text)?,
            tokenizer_g: Arc::clone(&self.tokenizer_g),
            t5,
            transformer: Sd3Transformer {
                network: put(&self.transformer.network, &targets.unet)?,
                config: self.transformer.config.clone(),
            },
            vae: put(&self.vae, &targets.vae)?,
            vae_config: self.vae_config.clone(),
            scheduler: self.scheduler.clone(),
            vae_tiling: false,
        })
    }

    /// Swaps in a standalone VAE file (A1111's `sd_vae`; diffusers' `AutoencoderKL.from_single_file(file,
    /// config=<model>, subfolder="vae")`): read in the original layout, with or without the checkpoint's
    /// `first_stage_model.` prefix, and built with this model's VAE config, so the scaling and shift factors stay
    /// the model's. An autoencoder of another shape (an SD1/SDXL VAE has 4 latent channels) is refused naming
    /// the file; the model keeps its own VAE then.
    pub fn replace_vae(&mut self, file: &Path, target: &ModuleTarget) -> Result<(), Sd3Error> {
        let shape = load(file, sdhive_checkpoint::inspect_vae_file(file))?;
        let own = &self.vae_config;
        if shape.latent_channels != own.latent_channels || shape.block_out_channels != own.block_out_channels
        {
            return Err(Sd3Error::Load {
                path: file.to_path_buf(),
                message: format!(
                    "an autoencoder with {} latent channels and widths {:?}; this SD3-family model's VAE has {} \
                     and {:?}",
                    shape.latent_channels, shape.block_out_channels, own.latent_channels, own.block_out_channels
                ),
            });
        }
        let weights = load(file, sdhive_checkpoint::load_vae_file_on(file, &Device::Cpu))?;
        let cfg = own.clone();
        self.vae =
            load(file, Resident::from_host(weights, target.clone(), move |vb| AutoencoderKL::new(vb, &cfg)))?;
        Ok(())
    }

    /// Bytes of the weights built on `device` (offloaded networks are not).
    pub fn resident_bytes_on(&self, device: &Device) -> u64 {
        let on = |d: &Device| d.same_device(device);
        let mut n = 0;
        for (d, bytes) in [
            (self.clip_l.device(), self.clip_l.resident_bytes()),
            (self.clip_g.device(), self.clip_g.resident_bytes()),
            (self.transformer.device(), self.transformer.resident_bytes()),
            (self.vae.device(), self.vae.resident_bytes()),
        ] {
            n += if on(d) { bytes } else { 0 };
        }
        if let Some((t5, _)) = &self.t5 {
            n += if on(t5.device()) { t5.resident_bytes() } else { 0 };
        }
        n
    }

    pub fn transformer_config(&self) -> &SD3TransformerConfig {
        self.transformer.config()
    }

    pub fn vae_config(&self) -> &AutoencoderKLConfig {
        &self.vae_config
    }

    fn device(&self) -> &Device {
        self.transformer.device()
    }

    /// One CLIP tower: the hidden state `(1, 77, H)` A1111's clip skip `skip` reads (`hidden_states[-(skip + 1)]`,
    /// the penultimate for 1) and the projected pooled output `(1, P)`, which clip skip leaves alone as diffusers'
    /// `_get_clip_prompt_embeds` does. A skip past the embedding output is refused naming `clip_skip`.
    fn clip(
        (model, name): (&ClipTextModel, &'static str),
        tokenizer: &ClipTokenizer,
        text: &str,
        skip: u32,
    ) -> Result<(Tensor, Tensor), Sd3Error> {
        let layers = model.config().num_hidden_layers;
        if skip == 0 || skip as usize > layers {
            return Err(Sd3Error::Invalid {
                field: "clip_skip",
                message: format!("{skip} is not between 1 and {layers}, the layers of this model's {name}"),
            });
        }
        let ids = tokenizer.encode_padded(text);
        let n = ids.len();
        // On the host: the encoder checks the ids there before uploading them.
        let out = Tensor::from_vec(ids, (1, n), &candle_core::Device::Cpu)
            .and_then(|ids| model.forward(&ids).map_err(candle_core::Error::wrap))
            .map_err(failed(name))?;
        let pooled = out.text_embeds.ok_or_else(|| Sd3Error::Failed {
            stage: name,
            message: "the CLIP encoder has no projection head".into(),
        })?;
        // `hidden_states` is the embedding output and one state per layer, `layers + 1` in all.
        Ok((out.hidden_states[layers - skip as usize].clone(), pooled))
    }

    /// The three text encoders for a stretch of prompts: built once when offloaded (a job's prompt and negative
    /// prompt share one build, as diffusers' model CPU offload loads them once per `encode_prompt`).
    fn text_encoders(&self) -> Result<TextEncoders<'_>, Sd3Error> {
        Ok(TextEncoders {
            clip_l: self.clip_l.in_use().map_err(failed("CLIP-L"))?,
            clip_g: self.clip_g.in_use().map_err(failed("CLIP-G"))?,
            t5: match &self.t5 {
                Some((encoder, _)) => Some(encoder.in_use().map_err(failed("T5"))?),
                None => None,
            },
        })
    }

    /// diffusers' `encode_prompt` for one prompt with A1111's clip skip `clip_skip` (diffusers' `clip_skip − 1`):
    /// the joint context `(1, 77 + max_sequence_length, D)` and the pooled embedding `(1, P_l + P_g)`.
    pub fn encode_prompt(
        &self,
        text: &str,
        max_sequence_length: usize,
        clip_skip: u32,
    ) -> Result<(Tensor, Tensor), Sd3Error> {
        self.encode_prompt_with(&self.text_encoders()?, text, max_sequence_length, clip_skip)
    }

    fn encode_prompt_with(
        &self,
        encoders: &TextEncoders<'_>,
        text: &str,
        max_sequence_length: usize,
        clip_skip: u32,
    ) -> Result<(Tensor, Tensor), Sd3Error> {
        let joint = self.transformer.config().joint_attention_dim;
        let (l, pooled_l) = Self::clip((&*encoders.clip_l, "CLIP-L"), &self.tokenizer_l, text, clip_skip)?;
        let (g, pooled_g) = Self::clip((&*encoders.clip_g, "CLIP-G"), &self.tokenizer_g, text, clip_skip)?;
        let t5 = match (&encoders.t5, &self.t5) {
            (Some(encoder), Some((_, tokenizer))) => {
                let ids = tokenizer.encode(text, max_sequence_length).map_err(|e| Sd3Error::Invalid {
                    field: "max_sequence_length",
                    message: e.to_string(),
                })?;
                let ids = Tensor::from_vec(ids, (1, max_sequence_length), encoder.device())
                    .map_err(failed("T5"))?;
                encoder.forward(&ids).map_err(failed("T5"))?
            }
            _ => {
                Tensor::zeros((1, max_sequence_length, joint), l.dtype(), l.device()).map_err(failed("T5"))?
            }
        };
        let width = t5.dim(D::Minus1).map_err(failed("T5"))?;
        let clip = Tensor::cat(&[&l, &g], D::Minus1).map_err(failed("context"))?;
        let clip_width = clip.dim(D::Minus1).map_err(failed("context"))?;
        if clip_width > width {
            return Err(Sd3Error::Failed {
                stage: "context",
                message: format!("the CLIP states ({clip_width}) are wider than T5's ({width})"),
            });
        }
        let clip = clip.pad_with_zeros(D::Minus1, 0, width - clip_width).map_err(failed("context"))?;
        let context = Tensor::cat(&[&clip, &t5.to_dtype(clip.dtype()).map_err(failed("context"))?], 1)
            .map_err(failed("context"))?;
        let pooled = Tensor::cat(&[&pooled_l, &pooled_g], D::Minus1).map_err(failed("pooled"))?;
        Ok((context, pooled))
    }

    /// img2img's starting latents: `(vae.encode(image).latent_dist.sample(generator) − shift) · scaling`, the
    /// image resized to `size` first.
    fn encode_image(
        &self,
        image: &RgbImage,
        size: (usize, usize),
        rng: &mut TorchGenerator,
    ) -> Result<Tensor, Sd3Error> {
        let resized = image.resized(size.0 as u32, size.1 as u32);
        let x = image_to_tensor(&resized, self.vae.device())
            .and_then(|x| x.to_dtype(self.vae.dtype()))
            .map_err(failed("init image"))?;
        let dist = self.vae.in_use().map_err(failed("vae"))?.encode(&x).map_err(failed("vae encode"))?;
        let numel = dist.mean.elem_count();
        let noise = Tensor::from_vec(rng.randn(numel), dist.mean.dims(), dist.mean.device())
            .and_then(|n| n.to_dtype(dist.mean.dtype()))
            .map_err(failed("vae sample"))?;
        let sample = dist.sample_with(&noise).map_err(failed("vae sample"))?;
        let vae = &self.vae_config;
        let shift = vae.shift_factor.unwrap_or(0.0);
        sample
            .to_dtype(DType::F32)
            .and_then(|s| s.affine(1.0, -shift)?.affine(vae.scaling_factor, 0.0))
            .and_then(|s| s.to_device(self.device()))
            .map_err(failed("vae sample"))
    }

    /// What diffusers' SD3 pipelines cannot run, refused before any work: a mask without an init image, DPM++ 2M
    /// and skip-layer guidance on img2img and inpainting (`StableDiffusion3Img2ImgPipeline` and
    /// `StableDiffusion3InpaintPipeline` call `scale_noise`, which `DPMSolverMultistepScheduler` lacks, and have no
    /// skip-layer guidance), skip-layer guidance without CFG (diffusers skips it silently) or with blocks the
    /// transformer lacks.
    /// The size a positive multiple of the transformer's patch in pixels, and at least one step.
    fn check_size(&self, req: &Sd3Request) -> Result<(), Sd3Error> {
        let factor = 8 * self.transformer.config().patch_size;
        for (field, v) in [("width", req.width), ("height", req.height)] {
            if v == 0 || v % factor != 0 {
                return Err(Sd3Error::Invalid {
                    field,
                    message: format!("{v} is not a positive multiple of {factor}"),
                });
            }
        }
        if req.steps == 0 {
            return Err(Sd3Error::Invalid { field: "steps", message: "must be at least 1".into() });
        }
        Ok(())
    }

    fn check_sampling(&self, req: &Sd3Request, cfg: bool, img2img: bool) -> Result<(), Sd3Error> {
        let invalid = |field: &'static str, message: String| Sd3Error::Invalid { field, message };
        if req.mask.is_some() && req.init_image.is_none() {
            return Err(invalid("mask", "a mask needs an init image to inpaint".into()));
        }
        if img2img && req.sampler == FlowSampler::DpmPp2M {
            return Err(invalid(
                "sampler",
                "DPM++ 2M is for text-to-image on SD3 models (diffusers' SD3 img2img and inpaint pipelines \
                 cannot run it); use Euler"
                    .into(),
            ));
        }
        let Some(g) = &req.skip_layer_guidance else {
            return Ok(());
        };
        g.validate().map_err(|e| invalid(e.field, e.message))?;
        if img2img {
            return Err(invalid(
                "skip_layer_guidance",
                "applies to text-to-image only, as in diffusers (its SD3 img2img and inpaint pipelines have none)"
                    .into(),
            ));
        }
        if !cfg {
            return Err(invalid(
                "skip_layer_guidance",
                format!(
                    "runs beside classifier-free guidance, which cfg_scale {} turns off (it must be above 1)",
                    req.guidance_scale
                ),
            ));
        }
        let blocks = self.transformer.config().num_layers;
        if let Some(l) = g.layers.iter().find(|&&l| l >= blocks) {
            return Err(invalid(
                "skip_layer_guidance.layers",
                format!(
                    "block {l} does not exist: this model's transformer has {blocks} (0 to {})",
                    blocks - 1
                ),
            ));
        }
        Ok(())
    }

    /// Text to image (or image to image with `init_image`, inpainting with `mask` too).
    pub fn generate(&self, req: &Sd3Request) -> Result<Sd3Output, Sd3Error> {
        self.generate_with(req, &mut |_, _, _| true)
    }

    /// Text to image, telling `on_step(step, steps, estimate)` after every step (1-based), with what gives the
    /// step's estimate of the clean latents (what previews show); `false` from it cancels the image before the
    /// next step.
    pub fn generate_with(
        &self,
        req: &Sd3Request,
        on_step: &mut dyn FnMut(usize, usize, &StepEstimate<'_>) -> bool,
    ) -> Result<Sd3Output, Sd3Error> {
        let (noise, latents) = self.denoise(req, None, on_step)?;
        let image = self.decode(&latents)?;
        Ok(Sd3Output { noise, latents, image })
    }

    /// The denoising loop of `generate_with`, returning the initial noise and the final latents undecoded.
    /// `init_latents` `(1, C, height/8, width/8)` makes it img2img from those latents (in the transformer's
    /// space, as `StableDiffusion3Img2ImgPipeline` takes an `image=` with the VAE's latent channels: no encode,
    /// no VAE sample drawn), in place of `req.init_image`.
    pub fn denoise(
        &self,
        req: &Sd3Request,
        init_latents: Option<&Tensor>,
        on_step: &mut dyn FnMut(usize, usize, &StepEstimate<'_>) -> bool,
    ) -> Result<(Tensor, Tensor), Sd3Error> {
        self.check_size(req)?;
        let cfg = req.guidance_scale > 1.0;
        self.check_sampling(req, cfg, req.init_image.is_some() || init_latents.is_some())?;
        let encoders = self.text_encoders()?;
        let (positive, positive_pooled) =
            self.encode_prompt_with(&encoders, &req.prompt, req.max_sequence_length, req.clip_skip)?;
        let (context, pooled) = if cfg {
            // diffusers' SD3 pipelines encode the negative prompt with `clip_skip=None` whatever they are given.
            let (nc, np) =
                self.encode_prompt_with(&encoders, &req.negative_prompt, req.max_sequence_length, 1)?;
            (
                Tensor::cat(&[&nc, &positive], 0).map_err(failed("context"))?,
                Tensor::cat(&[&np, &positive_pooled], 0).map_err(failed("pooled"))?,
            )
        } else {
            (positive.clone(), positive_pooled.clone())
        };
        // Offloaded text encoders leave the device before the MMDiT is built there.
        drop(encoders);
        let dtype = self.transformer.dtype();
        // The text encoders may run elsewhere (`--placement te=cpu`): what they made moves to the MMDiT.
        let to_transformer = |t: &Tensor| t.to_device(self.device()).and_then(|t| t.to_dtype(dtype));
        let (context, pooled) = (
            to_transformer(&context).map_err(failed("context"))?,
            to_transformer(&pooled).map_err(failed("pooled"))?,
        );
        // Skip-layer guidance's extra pass sees the positive prompt alone.
        let slg = match &req.skip_layer_guidance {
            Some(g) => Some((
                g,
                to_transformer(&positive).map_err(failed("context"))?,
                to_transformer(&positive_pooled).map_err(failed("pooled"))?,
            )),
            None => None,
        };
        let channels = self.transformer.config().in_channels;
        let shape = (1, channels, req.height / 8, req.width / 8);
        let numel = channels * (req.height / 8) * (req.width / 8);
        let mut rng = TorchGenerator::new(req.seed);
        // img2img draws the VAE's sample before the noise, from the same generator, as diffusers does.
        let init = match (init_latents, &req.init_image) {
            (Some(latents), _) => {
                if latents.dims() != [1, channels, req.height / 8, req.width / 8] {
                    return Err(Sd3Error::Failed {
                        stage: "init latents",
                        message: format!("shape {:?} is not {:?}", latents.dims(), shape),
                    });
                }
                let latents = latents.to_dtype(DType::F32).and_then(|l| l.to_device(self.device()));
                Some(latents.map_err(failed("init latents"))?)
            }
            (None, Some(image)) => Some(self.encode_image(image, (req.width, req.height), &mut rng)?),
            (None, None) => None,
        };
        let noise = Tensor::from_vec(rng.randn(numel), shape, self.device()).map_err(failed("noise"))?;
        let mut scheduler =
            FlowScheduler::new(req.sampler, &self.scheduler, req.steps).map_err(failed("scheduler"))?;
        let (start, mut latents) = match &init {
            Some(init) => {
                if !(0.0..=1.0).contains(&req.strength) {
                    return Err(Sd3Error::Invalid {
                        field: "denoising_strength",
                        message: format!("{} is not between 0 and 1", req.strength),
                    });
                }
                let start = FlowMatchEulerDiscrete::img2img_start(req.steps, req.strength);
                if start >= req.steps {
                    return Err(Sd3Error::Invalid {
                        field: "denoising_strength",
                        message: format!("{} leaves no step of {} to run", req.strength, req.steps),
                    });
                }
                scheduler.set_begin_index(start);
                // The inpaint pipeline starts from the bare noise at full strength; img2img always noises.
                let noised = if req.mask.is_some() && req.strength == 1.0 {
                    noise.clone()
                } else {
                    scheduler.scale_noise(init, &noise, start).map_err(failed("img2img noise"))?
                };
                (start, noised.to_dtype(dtype).map_err(failed("noise"))?)
            }
            None => (0, noise.to_dtype(dtype).map_err(failed("noise"))?),
        };
        // diffusers also encodes the masked image (drawing its VAE sample after the noise), but a 16-channel
        // transformer never reads it and nothing draws from the generator later, so it is left out.
        let inpaint = match (&req.mask, init) {
            (Some(mask), Some(init)) => {
                let full = mask_to_tensor(&mask.resized(req.width as u32, req.height as u32), self.device())
                    .map_err(failed("mask"))?;
                let mask =
                    nearest_downsample(&full, req.height / 8, req.width / 8).map_err(failed("mask"))?;
                Some(Inpaint { keep: mask.affine(-1.0, 1.0).map_err(failed("mask"))?, mask, init })
            }
            _ => None,
        };
        let run = req.steps - start;
        let transformer = self.transformer.in_use().map_err(failed("transformer"))?;
        for (i, t) in scheduler.timesteps().into_iter().enumerate().skip(start) {
            let v = velocity(&transformer, &latents, t, (&context, &pooled), cfg)?;
            let v = if cfg {
                let guided = guided_row(&v, 1, 0, req.guidance_scale).map_err(failed("guidance"))?;
                let text = v.narrow(0, 1, 1).map_err(failed("guidance"))?;
                match slg.as_ref().filter(|(g, _, _)| g.active_at(i, req.steps)) {
                    Some((g, positive, positive_pooled)) => {
                        let timestep = Tensor::full(t as f32, 1, self.device())
                            .and_then(|t| t.to_dtype(dtype))
                            .map_err(failed("skip-layer guidance"))?;
                        let skipped = transformer
                            .forward_skipping(&latents, &timestep, positive, positive_pooled, &g.layers)
                            .map_err(failed("transformer"))?;
                        let push = (text - skipped)
                            .and_then(|d| d.affine(g.scale, 0.0))
                            .map_err(failed("skip-layer guidance"))?;
                        (guided + push).map_err(failed("skip-layer guidance"))?
                    }
                    None => guided,
                }
            } else {
                v
            };
            let sigma = f64::from(scheduler.sigmas()[i]);
            let mut next = scheduler.step(&v, i, &latents).map_err(failed("scheduler"))?;
            if let Some(p) = &inpaint {
                next = p.blend(&scheduler, i + 1, &next, &noise).map_err(failed("inpaint blend"))?;
            }
            if !on_step(i + 1 - start, run, &StepEstimate { x: &latents, v: &v, sigma }) {
                return Err(Sd3Error::Cancelled);
            }
            latents = next;
        }
        Ok((noise, latents))
    }

    /// Text to image for a batch of `rows` that share `req`'s size, steps, sampler and T5 length (`req`'s own
    /// prompts, seed, scale and clip skip are the rows'), all guided (scale above 1) or none: one transformer call
    /// per step for every row, each row the latents [`Sd3Model::denoise`] gives its request alone (its noise from
    /// its own seed, its own contexts and CFG scale). `on_step(step, steps, estimate)` as there, the estimate over
    /// all rows. Returns the final latents `(B, C, h, w)`, undecoded.
    pub fn denoise_batch(
        &self,
        req: &Sd3Request,
        rows: &[Sd3Row],
        on_step: &mut dyn FnMut(usize, usize, &StepEstimate<'_>) -> bool,
    ) -> Result<Tensor, Sd3Error> {
        let invalid =
            |field: &'static str, message: &str| Sd3Error::Invalid { field, message: message.into() };
        let Some(first) = rows.first() else { return Err(invalid("n", "a batch needs at least one image")) };
        let cfg = first.guidance_scale > 1.0;
        if rows.iter().any(|r| (r.guidance_scale > 1.0) != cfg) {
            return Err(invalid(
                "cfg_scale",
                "a batch's images must all use classifier-free guidance or all not",
            ));
        }
        if req.init_image.is_some() || req.mask.is_some() || req.skip_layer_guidance.is_some() {
            return Err(invalid("init_images", "a batch runs text to image without skip-layer guidance"));
        }
        self.check_size(req)?;
        self.check_sampling(req, cfg, false)?;
        // Each distinct prompt encoded once (a request's n images share theirs).
        let encoders = self.text_encoders()?;
        let mut encoded: Vec<((String, u32), (Tensor, Tensor))> = Vec::new();
        let mut encode = |text: &str, skip: u32| -> Result<(Tensor, Tensor), Sd3Error> {
            if let Some((_, e)) = encoded.iter().find(|((t, k), _)| t == text && *k == skip) {
                return Ok(e.clone());
            }
            let e = self.encode_prompt_with(&encoders, text, req.max_sequence_length, skip)?;
            encoded.push(((text.to_string(), skip), e.clone()));
            Ok(e)
        };
        let (mut contexts, mut pooled) = (Vec::new(), Vec::new());
        if cfg {
            // diffusers' SD3 pipelines encode the negative prompt with `clip_skip=None` whatever they are given.
            for r in rows {
                let (c, p) = encode(&r.negative_prompt, 1)?;
                contexts.push(c);
                pooled.push(p);
            }
        }
        for r in rows {
            let (c, p) = encode(&r.prompt, r.clip_skip)?;
            contexts.push(c);
            pooled.push(p);
        }
        drop(encoded);
        drop(encoders);
        let dtype = self.transformer.dtype();
        // Guided rows stack as `[negatives…, positives…]`, the layout the doubled latents take.
        let stack = |parts: &[Tensor]| {
            Tensor::cat(parts, 0).and_then(|t| t.to_device(self.device())).and_then(|t| t.to_dtype(dtype))
        };
        let context = stack(&contexts).map_err(failed("context"))?;
        let pooled = stack(&pooled).map_err(failed("pooled"))?;
        let channels = self.transformer.config().in_channels;
        let numel = channels * (req.height / 8) * (req.width / 8);
        let b = rows.len();
        let noise: Vec<f32> = rows.iter().flat_map(|r| TorchGenerator::new(r.seed).randn(numel)).collect();
        let noise = Tensor::from_vec(noise, (b, channels, req.height / 8, req.width / 8), self.device())
            .map_err(failed("noise"))?;
        let mut scheduler =
            FlowScheduler::new(req.sampler, &self.scheduler, req.steps).map_err(failed("scheduler"))?;
        let mut latents = noise.to_dtype(dtype).map_err(failed("noise"))?;
        let transformer = self.transformer.in_use().map_err(failed("transformer"))?;
        for (i, t) in scheduler.timesteps().into_iter().enumerate() {
            let v = velocity(&transformer, &latents, t, (&context, &pooled), cfg)?;
            let v = if cfg {
                // Row by row, the ops `denoise` makes for one image, so each row's values are its own alone.
                rows.iter()
                    .enumerate()
                    .map(|(r, row)| guided_row(&v, b, r, row.guidance_scale))
                    .collect::<candle_core::Result<Vec<_>>>()
                    .and_then(|g| Tensor::cat(&g, 0))
                    .map_err(failed("guidance"))?
            } else {
                v
            };
            let sigma = f64::from(scheduler.sigmas()[i]);
            let next = scheduler.step(&v, i, &latents).map_err(failed("scheduler"))?;
            if !on_step(i + 1, req.steps, &StepEstimate { x: &latents, v: &v, sigma }) {
                return Err(Sd3Error::Cancelled);
            }
            latents = next;
        }
        Ok(latents)
    }

    /// The image of final latents: `vae.decode(latents / scaling_factor + shift_factor)` in 8 bits, in tiles when
    /// [`Sd3Model::vae_tiling`] says so. An offloaded MMDiT has left the device by now (`denoise` drops its use),
    /// before the VAE is built there.
    pub fn decode(&self, latents: &Tensor) -> Result<RgbImage, Sd3Error> {
        let vae = &self.vae_config;
        let shift = vae.shift_factor.unwrap_or(0.0);
        let z = latents
            .affine(1.0 / vae.scaling_factor, shift)
            .and_then(|z| z.to_device(self.vae.device()))
            .and_then(|z| z.to_dtype(self.vae.dtype()))
            .map_err(failed("decode"))?;
        // The VAE's mid-block attention is one head over every latent pixel (16384² scores at 1024²): sliced as the
        // SD1/SDXL memory plan slices it, so the decode does not set the job's peak above the denoising loop's.
        let _slices = limit_attention_scores(MAX_SCORE_ELEMENTS / ATTENTION_SLICES as usize);
        let network = self.vae.in_use().map_err(failed("vae"))?;
        let decoded = if self.vae_tiling { network.decode_tiled(&z) } else { network.decode(&z) };
        let decoded = decoded.map_err(failed("decode"))?;
        tensor_to_image(&decoded).map_err(failed("decode"))
    }
}
