//! One generation request as every front end (CLI, native jobs, OpenAI, A1111) hands it to an engine, plus the
//! limits an operator configures and the validation that turns bad input into an error naming the field.

use crate::image_io::{infotext_fits, GrayImage, OutputFormat, RgbImage};
use crate::sampler::{Sampler, Schedule};
use serde::Serialize;
use thiserror::Error;

/// A validated-on-demand generation request. Sizes left `None` fall back to the model's native resolution
/// (or to the init image's size for img2img).
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: String,
    pub negative_prompt: String,
    pub steps: u32,
    pub cfg_scale: f32,
    pub width: Option<u32>,
    pub height: Option<u32>,
    /// `None` draws a random seed; image `i` of the batch uses `seed + i` (A1111's convention).
    pub seed: Option<u64>,
    /// Number of images.
    pub n: u32,
    pub sampler: Sampler,
    pub schedule: Schedule,
    /// A1111 meaning: 1 uses the last text-encoder layer, 2 the one before it, …
    pub clip_skip: u32,
    pub init_image: Option<RgbImage>,
    /// Denoising strength for img2img / inpaint: 1.0 repaints fully, small values stay close to the init image.
    pub strength: f32,
    /// White = repaint, black = keep. Requires `init_image`.
    pub mask: Option<GrayImage>,
    /// Attach a preview to every k-th progress report; 0 = never.
    pub preview_every: u32,
    /// The latent approximation for those previews even where the worker decodes them with TAESD: A1111's
    /// default live preview ("Approx"), which its API's `/progress` serves.
    pub preview_approx: bool,
    /// LoRA / LyCORIS networks to apply, resolved to their files (from the prompt's `<lora:…>` tags, which stay
    /// in `prompt` for the infotext and are removed before tokenising, and from structured `loras` fields).
    pub loras: Vec<LoraUse>,
    /// Textual-inversion embeddings named in the prompt or negative prompt, resolved to their files.
    pub embeddings: Vec<EmbeddingUse>,
    /// A1111's hires fix (txt2img only): `width`×`height` is the first pass, the output is larger.
    pub hires: Option<crate::hires::HiresFix>,
    /// How the finished images are encoded (PNG unless the client asks for JPEG or WebP).
    pub output: OutputFormat,
    /// Skip-layer guidance (SD3-family models only; other engines refuse it).
    pub skip_layer_guidance: Option<SkipLayerGuidance>,
}

/// Skip-layer guidance (SLG) as diffusers' `StableDiffusion3Pipeline` runs it (SD3.5-medium's recipe: layers 7, 8,
/// 9): at the steps in its window, besides the CFG pair, the transformer runs on the positive prompt with these
/// blocks left out, and the guided prediction moves away from that one by `scale`.
///
/// The fractions are f64 because the window's edges are compared with step indices (`i > n·start`), where an f32
/// `0.01` (just below 0.01) would take in a step Python's `0.01` leaves out.
#[derive(Debug, Clone, PartialEq)]
pub struct SkipLayerGuidance {
    /// The transformer blocks left out (diffusers' `skip_guidance_layers`), counted from 0.
    pub layers: Vec<usize>,
    /// `skip_layer_guidance_scale`.
    pub scale: f64,
    /// `skip_layer_guidance_start`: the extra pass runs at steps `i` with `n·start < i < n·stop` (of `n` steps).
    pub start: f64,
    /// `skip_layer_guidance_stop`.
    pub stop: f64,
}

impl SkipLayerGuidance {
    /// diffusers' defaults for what a request leaves out.
    pub const DEFAULT_SCALE: f64 = 2.8;
    pub const DEFAULT_START: f64 = 0.01;
    pub const DEFAULT_STOP: f64 = 0.2;

    /// `layers` with diffusers' default scale and window.
    pub fn with_layers(layers: Vec<usize>) -> Self {
        SkipLayerGuidance {
            layers,
            scale: Self::DEFAULT_SCALE,
            start: Self::DEFAULT_START,
            stop: Self::DEFAULT_STOP,
        }
    }

    /// Whether step `i` (from 0) of `steps` runs the extra pass: diffusers' `i > n·start and i < n·stop`.
    pub fn active_at(&self, i: usize, steps: usize) -> bool {
        let (i, n) = (i as f64, steps as f64);
        i > n * self.start && i < n * self.stop
    }

    /// The checks that need no model: at least one layer, `0 ≤ scale ≤ 100`, `0 ≤ start ≤ stop ≤ 1`.
    pub fn validate(&self) -> Result<(), ValidationError> {
        if self.layers.is_empty() {
            return Err(invalid("skip_layer_guidance.layers", "must name at least one transformer block"));
        }
        if !(self.scale.is_finite() && (0.0..=100.0).contains(&self.scale)) {
            return Err(invalid(
                "skip_layer_guidance.scale",
                format!("must be a number between 0 and 100, got {}", self.scale),
            ));
        }
        for (field, v) in [("skip_layer_guidance.start", self.start), ("skip_layer_guidance.stop", self.stop)]
        {
            if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
                return Err(invalid(
                    field,
                    format!("must be a fraction of the steps between 0 and 1, got {v}"),
                ));
            }
        }
        if self.start > self.stop {
            return Err(invalid(
                "skip_layer_guidance.start",
                format!("{} is after stop {}", self.start, self.stop),
            ));
        }
        Ok(())
    }
}

/// One LoRA (or LyCORIS) network a request applies.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraUse {
    /// The name the request used (A1111's: the file's stem), shown in errors and the infotext.
    pub name: String,
    pub path: std::path::PathBuf,
    /// Multiplier of its text-encoder part (A1111's `te`).
    pub te: f32,
    /// Multiplier of its UNet part (A1111's `unet`).
    pub unet: f32,
    /// A1111's short hash (first 12 hex digits of the sha256 of the tensor data after the safetensors header),
    /// for the infotext's `Lora hashes`; `None` when not known.
    pub hash: Option<String>,
}

/// One textual-inversion embedding a request uses: the prompt's word `name` stands for its vectors.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingUse {
    pub name: String,
    pub path: std::path::PathBuf,
    /// A1111's short hash (first 12 hex digits of the file's sha256), for the infotext's `TI hashes`.
    pub hash: Option<String>,
}

impl Default for GenerateRequest {
    fn default() -> Self {
        GenerateRequest {
            prompt: String::new(),
            negative_prompt: String::new(),
            steps: 20,
            cfg_scale: 7.0,
            width: None,
            height: None,
            seed: None,
            n: 1,
            sampler: Sampler::EulerA,
            schedule: Schedule::Automatic,
            clip_skip: 1,
            init_image: None,
            strength: 0.75,
            mask: None,
            preview_every: 0,
            preview_approx: false,
            loras: Vec::new(),
            embeddings: Vec::new(),
            hires: None,
            output: OutputFormat::PNG,
            skip_layer_guidance: None,
        }
    }
}

/// Operator-configurable caps applied before a request reaches the engine.
#[derive(Debug, Clone, Serialize)]
pub struct Limits {
    pub max_width: u32,
    pub max_height: u32,
    pub max_steps: u32,
    pub max_n: u32,
    pub max_prompt_chars: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_width: 2048, max_height: 2048, max_steps: 150, max_n: 8, max_prompt_chars: 20_000 }
    }
}

/// A request field that failed validation; `field` is the request's field name as the user wrote it.
#[derive(Debug, Clone, Error, PartialEq)]
#[error("invalid `{field}`: {message}")]
pub struct ValidationError {
    pub field: &'static str,
    pub message: String,
}

fn invalid(field: &'static str, message: impl Into<String>) -> ValidationError {
    ValidationError { field, message: message.into() }
}

impl GenerateRequest {
    /// Checks every field against `limits` and against each other. Model-dependent checks (e.g. a sampler the
    /// engine lacks) are the engine's job.
    pub fn validate(&self, limits: &Limits) -> Result<(), ValidationError> {
        for (field, text) in [("prompt", &self.prompt), ("negative_prompt", &self.negative_prompt)] {
            if text.chars().count() > limits.max_prompt_chars {
                return Err(invalid(field, format!("longer than {} characters", limits.max_prompt_chars)));
            }
        }
        if self.steps == 0 || self.steps > limits.max_steps {
            return Err(invalid(
                "steps",
                format!("must be between 1 and {}, got {}", limits.max_steps, self.steps),
            ));
        }
        if !self.cfg_scale.is_finite() || self.cfg_scale < 0.0 || self.cfg_scale > 100.0 {
            return Err(invalid(
                "cfg_scale",
                format!("must be a number between 0 and 100, got {}", self.cfg_scale),
            ));
        }
        for (field, value, max) in
            [("width", self.width, limits.max_width), ("height", self.height, limits.max_height)]
        {
            if let Some(v) = value {
                if v == 0 || v % 8 != 0 {
                    return Err(invalid(field, format!("must be a positive multiple of 8, got {v}")));
                }
                if v > max {
                    return Err(invalid(field, format!("must be at most {max}, got {v}")));
                }
            }
        }
        if self.n == 0 || self.n > limits.max_n {
            return Err(invalid("n", format!("must be between 1 and {}, got {}", limits.max_n, self.n)));
        }
        if self.clip_skip == 0 || self.clip_skip > 12 {
            return Err(invalid("clip_skip", format!("must be between 1 and 12, got {}", self.clip_skip)));
        }
        if self.schedule == Schedule::Karras && !self.sampler.supports_karras() {
            return Err(invalid(
                "scheduler",
                format!("the Karras schedule is not available with sampler {}", self.sampler),
            ));
        }
        if self.init_image.is_some() && !(self.strength > 0.0 && self.strength <= 1.0) {
            return Err(invalid("strength", format!("must be in (0, 1], got {}", self.strength)));
        }
        if self.mask.is_some() && self.init_image.is_none() {
            return Err(invalid("mask", "a mask needs an init image to inpaint"));
        }
        if let Some(hires) = &self.hires {
            if self.init_image.is_some() {
                return Err(invalid(
                    "enable_hr",
                    "hires fix is for txt2img; img2img takes the size it is given",
                ));
            }
            if let (Some(w), Some(h)) = (self.width, self.height) {
                hires.validate(w, h, limits)?;
            }
            if let Some(p) = &hires.prompt {
                if p.chars().count() > limits.max_prompt_chars {
                    return Err(invalid(
                        "hr_prompt",
                        format!("longer than {} characters", limits.max_prompt_chars),
                    ));
                }
            }
        }
        if let Some(slg) = &self.skip_layer_guidance {
            slg.validate()?;
        }
        if !infotext_fits(self.output.format, self.infotext_bound()) {
            return Err(invalid(
                "output_format",
                format!(
                    "the prompts are too long for the generation parameters to fit a {}'s EXIF (64 KiB); ask \
                     for png or webp",
                    self.output.format
                ),
            ));
        }
        if let Some(img) = &self.init_image {
            let (w, h) = self.output_size_with_default((img.width, img.height));
            if w == 0 || h == 0 {
                return Err(invalid(
                    "init_image",
                    format!("{}x{} is smaller than 8x8", img.width, img.height),
                ));
            }
        }
        Ok(())
    }

    /// The output size: explicit width/height, else the init image's size rounded down to a multiple of 8,
    /// else `native` (the model's resolution).
    pub fn output_size(&self, native: (u32, u32)) -> (u32, u32) {
        match &self.init_image {
            Some(img) => self.output_size_with_default((img.width / 8 * 8, img.height / 8 * 8)),
            None => self.output_size_with_default(native),
        }
    }

    fn output_size_with_default(&self, default: (u32, u32)) -> (u32, u32) {
        (self.width.unwrap_or(default.0), self.height.unwrap_or(default.1))
    }

    /// An upper bound on the infotext's length in UTF-16 units: the prompts, and room for the parameters line
    /// (LoRA and embedding hashes included) that no request makes longer than a few thousand characters.
    fn infotext_bound(&self) -> usize {
        let units = |text: &str| text.encode_utf16().count();
        let hires = self.hires.as_ref().map_or(0, |h| {
            h.prompt.as_deref().map_or(0, units) + h.negative_prompt.as_deref().map_or(0, units)
        });
        let networks = 64 * (self.loras.len() + self.embeddings.len());
        let slg = self.skip_layer_guidance.as_ref().map_or(0, |g| 8 * g.layers.len());
        units(&self.prompt) + units(&self.negative_prompt) + hires + networks + slg + 4096
    }

    /// The effective strength: txt2img always starts from pure noise.
    pub fn effective_strength(&self) -> Option<f32> {
        self.init_image.as_ref().map(|_| self.strength)
    }
}

/// A seed for requests that name none: below 2^32, so the value also works in A1111 and ComfyUI.
pub fn random_seed() -> u64 {
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    let mut h = RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0),
    );
    h.finish() & 0xffff_ffff
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> GenerateRequest {
        GenerateRequest { prompt: "a cat".into(), ..Default::default() }
    }

    #[test]
    fn default_request_is_valid() {
        assert_eq!(req().validate(&Limits::default()), Ok(()));
    }

    #[test]
    fn rejects_sizes_not_multiple_of_eight_or_too_large() {
        let l = Limits::default();
        let e = GenerateRequest { width: Some(511), ..req() }.validate(&l).unwrap_err();
        assert_eq!(e.field, "width");
        let e = GenerateRequest { height: Some(4096), ..req() }.validate(&l).unwrap_err();
        assert_eq!(e.field, "height");
        let e = GenerateRequest { width: Some(0), ..req() }.validate(&l).unwrap_err();
        assert_eq!(e.field, "width");
    }

    #[test]
    fn rejects_bad_steps_cfg_n_strength_and_orphan_mask() {
        let l = Limits::default();
        assert_eq!(GenerateRequest { steps: 0, ..req() }.validate(&l).unwrap_err().field, "steps");
        assert_eq!(GenerateRequest { steps: 151, ..req() }.validate(&l).unwrap_err().field, "steps");
        assert_eq!(
            GenerateRequest { cfg_scale: f32::NAN, ..req() }.validate(&l).unwrap_err().field,
            "cfg_scale"
        );
        assert_eq!(GenerateRequest { n: 9, ..req() }.validate(&l).unwrap_err().field, "n");
        let img = RgbImage { width: 64, height: 64, data: vec![0; 64 * 64 * 3] };
        let e = GenerateRequest { init_image: Some(img.clone()), strength: 0.0, ..req() }.validate(&l);
        assert_eq!(e.unwrap_err().field, "strength");
        let e = GenerateRequest { init_image: Some(img), strength: 1.5, ..req() }.validate(&l);
        assert_eq!(e.unwrap_err().field, "strength");
        let mask = GrayImage { width: 64, height: 64, data: vec![0; 64 * 64] };
        let e = GenerateRequest { mask: Some(mask), ..req() }.validate(&l);
        assert_eq!(e.unwrap_err().field, "mask");
    }

    #[test]
    fn karras_only_where_the_sampler_has_it() {
        let l = Limits::default();
        let ok = GenerateRequest { sampler: Sampler::DpmPp2M, schedule: Schedule::Karras, ..req() };
        assert!(ok.validate(&l).is_ok());
        let bad = GenerateRequest { sampler: Sampler::Ddim, schedule: Schedule::Karras, ..req() };
        assert_eq!(bad.validate(&l).unwrap_err().field, "scheduler");
    }

    #[test]
    fn a_jpeg_refuses_prompts_its_exif_cannot_hold() {
        use crate::image_io::ImageFormat;
        let l = Limits { max_prompt_chars: 40_000, ..Limits::default() };
        let jpeg = OutputFormat::new(ImageFormat::Jpeg, 80);
        let long = GenerateRequest { prompt: "x".repeat(30_000), output: jpeg, ..req() };
        assert_eq!(long.validate(&l).unwrap_err().field, "output_format");
        let long = GenerateRequest { negative_prompt: "猫".repeat(30_000), ..long };
        assert_eq!(long.validate(&l).unwrap_err().field, "output_format");
        let webp = OutputFormat::new(ImageFormat::Webp, 80);
        assert!(GenerateRequest { output: webp, ..long.clone() }.validate(&l).is_ok());
        assert!(GenerateRequest { output: OutputFormat::PNG, ..long }.validate(&l).is_ok());
        assert!(GenerateRequest { prompt: "x".repeat(20_000), output: jpeg, ..req() }.validate(&l).is_ok());
    }

    #[test]
    fn skip_layer_guidance_fields_are_checked() {
        let l = Limits::default();
        let with = |g: SkipLayerGuidance| GenerateRequest { skip_layer_guidance: Some(g), ..req() };
        let ok = SkipLayerGuidance::with_layers(vec![7, 8, 9]);
        assert_eq!(with(ok.clone()).validate(&l), Ok(()));
        let field = |g: SkipLayerGuidance| with(g).validate(&l).unwrap_err().field;
        assert_eq!(field(SkipLayerGuidance { layers: vec![], ..ok.clone() }), "skip_layer_guidance.layers");
        assert_eq!(field(SkipLayerGuidance { scale: -0.1, ..ok.clone() }), "skip_layer_guidance.scale");
        assert_eq!(field(SkipLayerGuidance { scale: f64::NAN, ..ok.clone() }), "skip_layer_guidance.scale");
        assert_eq!(field(SkipLayerGuidance { start: -0.5, ..ok.clone() }), "skip_layer_guidance.start");
        assert_eq!(field(SkipLayerGuidance { stop: 1.5, ..ok.clone() }), "skip_layer_guidance.stop");
        assert_eq!(
            field(SkipLayerGuidance { start: 0.5, stop: 0.2, ..ok.clone() }),
            "skip_layer_guidance.start"
        );
        assert!(with(SkipLayerGuidance { start: 0.3, stop: 0.3, scale: 0.0, ..ok }).validate(&l).is_ok());
    }

    /// diffusers' window `n·start < i < n·stop`, with Python's f64 products: of 100 steps, 0.01 starts after
    /// step 1 and 0.2 stops before step 20.
    #[test]
    fn skip_layer_guidance_runs_inside_its_window() {
        let g = SkipLayerGuidance::with_layers(vec![7]);
        let active: Vec<usize> = (0..100).filter(|&i| g.active_at(i, 100)).collect();
        assert_eq!(active, (2..20).collect::<Vec<_>>());
        let g = SkipLayerGuidance { start: 0.01, stop: 0.5, ..g };
        let active: Vec<usize> = (0..3).filter(|&i| g.active_at(i, 3)).collect();
        assert_eq!(active, [1]);
    }

    #[test]
    fn output_size_follows_request_then_init_image_then_model() {
        assert_eq!(req().output_size((512, 512)), (512, 512));
        assert_eq!(GenerateRequest { width: Some(640), ..req() }.output_size((512, 512)), (640, 512));
        let img = RgbImage { width: 100, height: 70, data: vec![0; 100 * 70 * 3] };
        let r = GenerateRequest { init_image: Some(img), ..req() };
        assert_eq!(r.output_size((512, 512)), (96, 64));
    }
}

/// The f64 of the decimal an f32 prints as (0.7f32 → 0.7, not 0.699999988079071): clients send decimal strengths and
/// diffusers truncates `n·strength` (or `n − n·strength`) computed on that decimal's f64, which the widened f32
/// can fall on the other side of (0.7 of 10 steps: diffusers runs 7, the widened value 6).
pub fn decimal_f64(v: f32) -> f64 {
    v.to_string().parse().unwrap_or(f64::from(v))
}

#[cfg(test)]
mod decimal_tests {
    use super::decimal_f64;

    #[test]
    fn strengths_keep_the_decimal_the_client_sent() {
        for (v, want) in [(0.7f32, 0.7f64), (0.8, 0.8), (0.35, 0.35), (1.0, 1.0), (0.0, 0.0)] {
            assert_eq!(decimal_f64(v), want);
        }
        assert_eq!((10.0 * f64::from(0.7f32)).trunc(), 6.0, "the widened f32 is below the decimal");
        assert_eq!((10.0 * decimal_f64(0.7)).trunc(), 7.0, "as Python's int(10 * 0.7)");
    }
}
