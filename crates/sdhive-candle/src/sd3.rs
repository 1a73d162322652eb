//! SD3 / SD3.5 text-to-image on the candle engine, as diffusers' `StableDiffusion3Pipeline` computes it: a model
//! read from a diffusers folder (CLIP-L and CLIP-G with their projection heads, T5 — optional, zeros when left
//! out as diffusers makes them —, the MMDiT transformer, the 16-channel VAE, the flow-match scheduler), the joint
//! context built as `encode_prompt` builds it (each CLIP's penultimate hidden state, joined along the features,
//! zero-padded to T5's width, then T5's states appended along the sequence; the projected pooled outputs joined),
//! classifier-free guidance with the negative prompt first, Euler flow-matching steps, and the decode of
//! `latents / scaling_factor + shift_factor`.
//!
//! This is the pipeline the engine will serve SD3 through; the serving engine (`SdModel`, LoRAs, the RAM cache,
//! batching) does not route SD3 models here yet.

use crate::tensor_image::{image_to_tensor, tensor_to_image};
use candle_core::{DType, Device, Tensor, D};
use sdhive_engine::RgbImage;
use sdhive_models::{
    AutoencoderKL, AutoencoderKLConfig, ClipTextConfig, ClipTextModel, SD3Transformer2DModel,
    SD3TransformerConfig, T5Config, T5EncoderModel,
};
use sdhive_rng::TorchGenerator;
use sdhive_schedulers::{FlowMatchConfig, FlowMatchEulerDiscrete};
use sdhive_tokenizer::{ClipTokenizer, PadToken, T5Tokenizer, T5_DEFAULT_MAX_LEN};
use std::path::{Path, PathBuf};
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

/// A loaded SD3-family model.
pub struct Sd3Model {
    pub clip_l: ClipTextModel,
    pub tokenizer_l: ClipTokenizer,
    pub clip_g: ClipTextModel,
    pub tokenizer_g: ClipTokenizer,
    /// `None`: left out (diffusers' `text_encoder_3=None`), its part of the context is zeros.
    pub t5: Option<(T5EncoderModel, T5Tokenizer)>,
    pub transformer: SD3Transformer2DModel,
    pub vae: AutoencoderKL,
    pub scheduler: FlowMatchConfig,
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
        }
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
    /// `tokenizer*`, `transformer`, `vae`, `scheduler`); `with_t5: false` leaves T5 out (about 9 GB in f16 for
    /// T5-XXL), as does a folder without `text_encoder_3`.
    pub fn from_dir(dir: &Path, dtype: DType, device: &Device, with_t5: bool) -> Result<Sd3Model, Sd3Error> {
        let sub = |name: &str| dir.join(name);
        let clip = |name: &str| {
            let path = sub(name);
            load(&path, ClipTextModel::from_dir(&path, true, dtype, device))
        };
        let tokenizer = |name: &str| {
            let path = sub(name);
            load(&path, ClipTokenizer::from_dir(&path))
        };
        let t5 = match (with_t5, sub("text_encoder_3").is_dir()) {
            (true, true) => {
                let encoder = load(
                    &sub("text_encoder_3"),
                    T5EncoderModel::from_dir(&sub("text_encoder_3"), dtype, device),
                )?;
                let tokenizer = load(&sub("tokenizer_3"), T5Tokenizer::from_dir(&sub("tokenizer_3")))?;
                Some((encoder, tokenizer))
            }
            _ => None,
        };
        let scheduler_file = sub("scheduler").join("scheduler_config.json");
        Ok(Sd3Model {
            clip_l: clip("text_encoder")?,
            tokenizer_l: tokenizer("tokenizer")?,
            clip_g: clip("text_encoder_2")?,
            tokenizer_g: tokenizer("tokenizer_2")?,
            t5,
            transformer: load(
                &sub("transformer"),
                SD3Transformer2DModel::from_dir(&sub("transformer"), dtype, device),
            )?,
            vae: load(&sub("vae"), AutoencoderKL::from_dir(&sub("vae"), dtype, device))?,
            scheduler: load(&scheduler_file, FlowMatchConfig::from_file(&scheduler_file))?,
        })
    }

    /// Reads an SD3 / SD3.5 single file in SAI's layout, converted by `sdhive_checkpoint` into the networks
    /// `from_dir` builds. `config_dir`, a diffusers folder of the model (diffusers' `from_single_file(config=…)`),
    /// gives the configs and the tokenizers; text encoders the file does not carry (SD3.5 files carry none) come
    /// from its `text_encoder*` folders. Without a folder the configs are inferred and CLIP uses the bundled
    /// vocabulary (a file with T5 then needs the folder's `tokenizer_3`).
    pub fn from_single_file(
        file: &Path,
        config_dir: Option<&Path>,
        dtype: DType,
        device: &Device,
        with_t5: bool,
    ) -> Result<Sd3Model, Sd3Error> {
        let c = load(file, sdhive_checkpoint::load_sd3_single_file_on(file, config_dir, device))?;
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
        let build = |weights: std::collections::HashMap<String, Tensor>| {
            candle_nn::VarBuilder::from_tensors(weights, dtype, device)
        };
        let sub = |name: &str| config_dir.map(|d| d.join(name));
        let transformer_cfg: SD3TransformerConfig = parse(file, "transformer", &c.configs.transformer)?;
        let vae_cfg: AutoencoderKLConfig = parse(file, "vae", &c.configs.vae)?;
        let transformer = load(file, SD3Transformer2DModel::new(build(c.transformer), &transformer_cfg))?;
        let vae = load(file, AutoencoderKL::new(build(c.vae), &vae_cfg))?;
        let clip = |weights: Option<std::collections::HashMap<String, Tensor>>,
                    cfg: Option<&serde_json::Value>,
                    name: &str|
         -> Result<ClipTextModel, Sd3Error> {
            match (weights, cfg) {
                (Some(w), Some(cfg)) => {
                    let cfg: ClipTextConfig = parse(file, name, cfg)?;
                    load(file, ClipTextModel::new(build(w), &cfg, true))
                }
                // The converter has checked that the config folder has this encoder.
                _ => match sub(name) {
                    Some(path) => load(&path, ClipTextModel::from_dir(&path, true, dtype, device)),
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
            Some(path) => load(&path, ClipTokenizer::from_dir(&path)),
            None => load(file, ClipTokenizer::bundled(pad)),
        };
        let t5_tokenizer = || {
            let path = sub("tokenizer_3").filter(|d| d.is_dir()).ok_or_else(|| Sd3Error::Load {
                path: file.to_path_buf(),
                message:
                    "T5 needs its tokenizer: give the model's diffusers folder (with `tokenizer_3`) as config"
                        .into(),
            })?;
            load(&path, T5Tokenizer::from_dir(&path))
        };
        let t5 = match (with_t5, c.text_encoder_3, c.configs.text_encoder_3.as_ref()) {
            (false, _, _) => None,
            (true, Some(w), Some(cfg)) => {
                let cfg: T5Config = parse(file, "text_encoder_3", cfg)?;
                Some((load(file, T5EncoderModel::new(build(w), &cfg))?, t5_tokenizer()?))
            }
            (true, _, _) => match sub("text_encoder_3").filter(|d| d.is_dir()) {
                Some(path) => {
                    Some((load(&path, T5EncoderModel::from_dir(&path, dtype, device))?, t5_tokenizer()?))
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
            transformer,
            vae,
            scheduler,
        })
    }

    fn device(&self) -> &Device {
        self.transformer.device()
    }

    /// One CLIP tower: the penultimate hidden state `(1, 77, H)` and the projected pooled output `(1, P)`.
    fn clip(&self, large: bool, text: &str) -> candle_core::Result<(Tensor, Tensor)> {
        let (model, tokenizer) =
            if large { (&self.clip_g, &self.tokenizer_g) } else { (&self.clip_l, &self.tokenizer_l) };
        let ids = tokenizer.encode_padded(text);
        let n = ids.len();
        let ids = Tensor::from_vec(ids, (1, n), self.device())?;
        let out = model.forward(&ids).map_err(candle_core::Error::wrap)?;
        let k = out.hidden_states.len();
        let pooled = out
            .text_embeds
            .ok_or_else(|| candle_core::Error::Msg("the CLIP encoder has no projection head".into()))?;
        Ok((out.hidden_states[k - 2].clone(), pooled))
    }

    /// diffusers' `encode_prompt` for one prompt: the joint context `(1, 77 + max_sequence_length, D)` and the
    /// pooled embedding `(1, P_l + P_g)`.
    pub fn encode_prompt(
        &self,
        text: &str,
        max_sequence_length: usize,
    ) -> Result<(Tensor, Tensor), Sd3Error> {
        let joint = self.transformer.config().joint_attention_dim;
        let (l, pooled_l) = self.clip(false, text).map_err(failed("CLIP-L"))?;
        let (g, pooled_g) = self.clip(true, text).map_err(failed("CLIP-G"))?;
        let t5 = match &self.t5 {
            Some((encoder, tokenizer)) => {
                let ids = tokenizer.encode(text, max_sequence_length).map_err(|e| Sd3Error::Invalid {
                    field: "max_sequence_length",
                    message: e.to_string(),
                })?;
                let ids =
                    Tensor::from_vec(ids, (1, max_sequence_length), self.device()).map_err(failed("T5"))?;
                encoder.forward(&ids).map_err(failed("T5"))?
            }
            None => Tensor::zeros((1, max_sequence_length, joint), l.dtype(), self.device())
                .map_err(failed("T5"))?,
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
        let dist = self.vae.encode(&x).map_err(failed("vae encode"))?;
        let numel = dist.mean.elem_count();
        let noise = Tensor::from_vec(rng.randn(numel), dist.mean.dims(), dist.mean.device())
            .and_then(|n| n.to_dtype(dist.mean.dtype()))
            .map_err(failed("vae sample"))?;
        let sample = dist.sample_with(&noise).map_err(failed("vae sample"))?;
        let vae = self.vae.config();
        let shift = vae.shift_factor.unwrap_or(0.0);
        sample
            .to_dtype(DType::F32)
            .and_then(|s| s.affine(1.0, -shift)?.affine(vae.scaling_factor, 0.0))
            .and_then(|s| s.to_device(self.device()))
            .map_err(failed("vae sample"))
    }

    /// Text to image (or image to image with `init_image`).
    pub fn generate(&self, req: &Sd3Request) -> Result<Sd3Output, Sd3Error> {
        self.generate_with(req, &mut |_, _| true)
    }

    /// Text to image, telling `on_step(step, steps)` after every step (1-based); `false` from it cancels the
    /// image before the next step.
    pub fn generate_with(
        &self,
        req: &Sd3Request,
        on_step: &mut dyn FnMut(usize, usize) -> bool,
    ) -> Result<Sd3Output, Sd3Error> {
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
        let cfg = req.guidance_scale > 1.0;
        let (context, pooled) = self.encode_prompt(&req.prompt, req.max_sequence_length)?;
        let (context, pooled) = if cfg {
            let (nc, np) = self.encode_prompt(&req.negative_prompt, req.max_sequence_length)?;
            (
                Tensor::cat(&[&nc, &context], 0).map_err(failed("context"))?,
                Tensor::cat(&[&np, &pooled], 0).map_err(failed("pooled"))?,
            )
        } else {
            (context, pooled)
        };
        let dtype = self.transformer.dtype();
        let (context, pooled) = (
            context.to_dtype(dtype).map_err(failed("context"))?,
            pooled.to_dtype(dtype).map_err(failed("pooled"))?,
        );
        let channels = self.transformer.config().in_channels;
        let shape = (1, channels, req.height / 8, req.width / 8);
        let numel = channels * (req.height / 8) * (req.width / 8);
        let mut rng = TorchGenerator::new(req.seed);
        // img2img draws the VAE's sample before the noise, from the same generator, as diffusers does.
        let init = match &req.init_image {
            Some(image) => Some(self.encode_image(image, (req.width, req.height), &mut rng)?),
            None => None,
        };
        let noise = Tensor::from_vec(rng.randn(numel), shape, self.device()).map_err(failed("noise"))?;
        let mut scheduler =
            FlowMatchEulerDiscrete::new(&self.scheduler, req.steps).map_err(failed("scheduler"))?;
        let (start, mut latents) = match init {
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
                let noised = scheduler.scale_noise(&init, &noise, start).map_err(failed("img2img noise"))?;
                (start, noised.to_dtype(dtype).map_err(failed("noise"))?)
            }
            None => (0, noise.to_dtype(dtype).map_err(failed("noise"))?),
        };
        let run = req.steps - start;
        for (i, t) in scheduler.timesteps().into_iter().enumerate().skip(start) {
            let batch = if cfg { 2 } else { 1 };
            let input = if cfg { Tensor::cat(&[&latents, &latents], 0) } else { Ok(latents.clone()) }
                .map_err(failed("denoise"))?;
            let timestep = Tensor::full(t as f32, batch, self.device())
                .and_then(|t| t.to_dtype(dtype))
                .map_err(failed("denoise"))?;
            let v = self
                .transformer
                .forward(&input, &timestep, &context, &pooled)
                .map_err(failed("transformer"))?;
            let v = if cfg {
                let uncond = v.narrow(0, 0, 1).map_err(failed("guidance"))?;
                let text = v.narrow(0, 1, 1).map_err(failed("guidance"))?;
                let delta = (text - &uncond).map_err(failed("guidance"))?;
                (uncond + delta.affine(req.guidance_scale, 0.0).map_err(failed("guidance"))?)
                    .map_err(failed("guidance"))?
            } else {
                v
            };
            latents = scheduler.step(&v, i, &latents).map_err(failed("scheduler"))?;
            if !on_step(i + 1 - start, run) {
                return Err(Sd3Error::Cancelled);
            }
        }
        let vae = self.vae.config();
        let shift = vae.shift_factor.unwrap_or(0.0);
        let z = latents.affine(1.0 / vae.scaling_factor, shift).map_err(failed("decode"))?;
        let decoded = self.vae.decode(&z).map_err(failed("decode"))?;
        let image = tensor_to_image(&decoded).map_err(failed("decode"))?;
        Ok(Sd3Output { noise, latents, image })
    }
}
