//! The worker's command line as clap sees it. Values stay as typed here (sampler names, paths); turning them into
//! a request is `request`'s job, so parse errors and meaning errors are reported separately.

use candle_core::DType;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(about = "Stable Diffusion worker", version, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate images from a prompt (txt2img, or img2img/inpaint with --init-image/--mask) and write PNGs.
    Generate(GenerateArgs),
    /// Serve the model over HTTP (native jobs, OpenAI and A1111 APIs), optionally registering with a hive.
    Serve(crate::serve::ServeArgs),
}

#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    /// A diffusers folder, a .safetensors checkpoint, or a Hugging Face repo id `org/name[@revision]`.
    #[arg(long, short = 'm', value_name = "MODEL")]
    pub model: String,

    /// What to draw.
    #[arg(long, short = 'p')]
    pub prompt: String,

    /// What to steer away from.
    #[arg(long, default_value = "")]
    pub negative_prompt: String,

    /// Denoising steps.
    #[arg(long, default_value_t = 20)]
    pub steps: u32,

    /// Classifier-free guidance scale; 1 disables the negative pass.
    #[arg(long, default_value_t = 7.0)]
    pub cfg_scale: f32,

    /// Output width; default: the model's native size, or the init image's.
    #[arg(long)]
    pub width: Option<u32>,

    /// Output height; default as for --width.
    #[arg(long)]
    pub height: Option<u32>,

    /// Seed of the first image (image i uses seed + i); default: random.
    #[arg(long)]
    pub seed: Option<u64>,

    /// A1111 sampler name: Euler, Euler a, DDIM, DPM++ 2M, LCM, PNDM (or e.g. "DPM++ 2M Karras").
    #[arg(long, default_value = "Euler a")]
    pub sampler: String,

    /// Noise schedule: Automatic or Karras; default: what the sampler name says, else Automatic.
    #[arg(long)]
    pub scheduler: Option<String>,

    /// Number of images.
    #[arg(short = 'n', long = "count", default_value_t = 1)]
    pub n: u32,

    /// 1 uses the text encoder's last layer, 2 the one before it (A1111 meaning).
    #[arg(long, default_value_t = 1)]
    pub clip_skip: u32,

    /// Start from this image (img2img); PNG, JPEG or WebP.
    #[arg(long, value_name = "FILE")]
    pub init_image: Option<PathBuf>,

    /// img2img denoising strength: 1.0 repaints fully.
    #[arg(long, default_value_t = 0.75)]
    pub strength: f32,

    /// Inpainting mask (white = repaint); needs --init-image.
    #[arg(long, value_name = "FILE")]
    pub mask: Option<PathBuf>,

    /// A standalone VAE (.safetensors, original layout) in place of the model's own, as A1111's `sd_vae`.
    #[arg(long, value_name = "FILE")]
    pub vae: Option<PathBuf>,

    /// Only load local models inside this folder (repeatable).
    #[arg(long = "model-root", value_name = "DIR")]
    pub model_roots: Vec<PathBuf>,

    /// A folder of LoRA .safetensors files that `<lora:name:weight>` tags in --prompt name (repeatable).
    #[arg(long = "lora-dir", value_name = "DIR")]
    pub lora_dirs: Vec<PathBuf>,

    /// A folder of textual-inversion embeddings, used by name in --prompt / --negative-prompt (repeatable).
    #[arg(long = "embeddings-dir", value_name = "DIR")]
    pub embeddings_dirs: Vec<PathBuf>,

    /// Never download from the Hugging Face hub (also: HF_HUB_OFFLINE=1).
    #[arg(long)]
    pub offline: bool,

    /// Device index on this binary's backend.
    #[arg(long, default_value_t = 0)]
    pub device: usize,

    /// Weight and activation precision; default: f32 on CPU, f16 on GPUs (bf16 for SD3/SD3.5 on CUDA).
    #[arg(long, value_enum)]
    pub dtype: Option<DTypeArg>,

    /// SD3/SD3.5: leave the T5 text encoder out (its context is zeros, as diffusers' `text_encoder_3=None`;
    /// saves about 9 GB in f16 for T5-XXL at some cost in prompt following).
    #[arg(long)]
    pub no_t5: bool,

    /// Per-module devices, e.g. `te=cpu,unet=cuda0,vae=cuda0` (modules: unet, te, vae; devices: cpu or this
    /// binary's backend with an index).
    #[arg(long, default_value = "")]
    pub placement: String,

    /// Modules whose weights stay in host memory until used, e.g. `te,vae`.
    #[arg(long, default_value = "")]
    pub offload: String,

    /// The most device memory jobs may be planned for, weights included (e.g. 8G, 512M); bigger jobs use VAE
    /// tiling and attention slicing, or are refused. Default: whatever the device has free.
    #[arg(long, value_parser = crate::cli::parse_bytes)]
    pub memory_budget: Option<u64>,

    /// Output PNG; with -n > 1, `stem-0.png`, `stem-1.png`, … next to it.
    #[arg(long, short = 'o', value_name = "FILE")]
    pub output: PathBuf,
}

/// `serve --preview`, as clap lists it; see [`sdhive_engine::PreviewMode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PreviewArg {
    Auto,
    Taesd,
    Latent,
    Off,
}

impl From<PreviewArg> for sdhive_engine::PreviewMode {
    fn from(p: PreviewArg) -> Self {
        use sdhive_engine::PreviewMode;
        match p {
            PreviewArg::Auto => PreviewMode::Auto,
            PreviewArg::Taesd => PreviewMode::Taesd,
            PreviewArg::Latent => PreviewMode::Latent,
            PreviewArg::Off => PreviewMode::Off,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DTypeArg {
    F32,
    F16,
    Bf16,
}

impl From<DTypeArg> for DType {
    fn from(d: DTypeArg) -> DType {
        match d {
            DTypeArg::F32 => DType::F32,
            DTypeArg::F16 => DType::F16,
            DTypeArg::Bf16 => DType::BF16,
        }
    }
}

/// `8G`, `512M`, `1.5GiB`, `1000000` (bytes): binary units, as memory sizes are usually meant.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| format!("`{s}` is not a size (e.g. 8G, 512M)"))?;
    let shift = match unit.trim().to_ascii_lowercase().trim_end_matches("ib").trim_end_matches('b') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        other => return Err(format!("unknown unit `{other}` in `{s}` (use K, M, G or T)")),
    };
    Ok((value * (1u64 << shift) as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_binary_units() {
        assert_eq!(parse_bytes("8G"), Ok(8 << 30));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("2 gb"), Ok(2 << 30));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3X").unwrap_err().contains("unknown unit"));
    }
}
