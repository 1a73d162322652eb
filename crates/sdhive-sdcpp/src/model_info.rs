//! What the serving layers need to know about a model before stable-diffusion.cpp has read it: its family and
//! native size. stable-diffusion.cpp's C API does not report them, so they are read the way the candle engine
//! reads them — from a diffusers folder's UNet config, or from a single file's tensor names and shapes.

use sdhive_engine::ModelShape;
use sdhive_modelsource::{ModelLocation, ResolvedModel};
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// `sd1`, `sd2`, `sdxl`.
    pub family: String,
    pub native_width: u32,
    pub native_height: u32,
    /// A 9-channel inpainting UNet.
    pub inpainting: bool,
}

impl ModelInfo {
    pub fn read(model: &ResolvedModel) -> Result<ModelInfo, String> {
        match &model.location {
            ModelLocation::DiffusersDir(dir) => from_unet_config(&dir.join("unet").join("config.json")),
            ModelLocation::SingleFile(file) => from_single_file(file),
        }
    }
}

impl ModelInfo {
    /// The model's shape for memory planning. stable-diffusion.cpp does not report its allocations, so the
    /// weights are the family's parameter count (UNet + text encoders + VAE) at `bytes_per_weight`; sd.cpp runs
    /// the CFG pair as two batch-1 calls and materialises attention scores (no flash attention by default).
    pub fn shape(&self, bytes_per_weight: u64) -> ModelShape {
        let (params, first_attention_level, heads) = match self.family.as_str() {
            "sdxl" => (3_470_000_000u64, 1, 10),
            "sd2" => (1_290_000_000, 0, 5),
            _ => (1_070_000_000, 0, 8),
        };
        ModelShape {
            weights_bytes: params * bytes_per_weight,
            activation_bytes: bytes_per_weight,
            vae_factor: 8,
            first_attention_level,
            heads_at_first_attention: heads,
            fused_attention: false,
            score_chunk_elements: None,
            // sd.cpp's default VAE tile (32 latent pixels a side).
            vae_tile_latent: 32,
        }
    }
}

fn from_unet_config(path: &Path) -> Result<ModelInfo, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let cfg: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(from_unet_value(&cfg))
}

fn from_unet_value(cfg: &serde_json::Value) -> ModelInfo {
    // SDXL is the UNet with the `text_time` add-embedding; SD2's text encoder is 1024 wide, SD1's 768.
    let family = if cfg["addition_embed_type"].as_str() == Some("text_time") {
        "sdxl"
    } else if cfg["cross_attention_dim"].as_u64() == Some(1024) {
        "sd2"
    } else {
        "sd1"
    };
    // diffusers' sample_size is in latent pixels; the VAE scales by 8 for every family here.
    let side = cfg["sample_size"].as_u64().map(|s| s as u32 * 8).unwrap_or(default_side(family));
    ModelInfo {
        family: family.into(),
        native_width: side,
        native_height: side,
        inpainting: cfg["in_channels"].as_u64() == Some(9),
    }
}

fn default_side(family: &str) -> u32 {
    match family {
        "sdxl" => 1024,
        "sd2" => 768,
        _ => 512,
    }
}

fn from_single_file(path: &Path) -> Result<ModelInfo, String> {
    let file = sdhive_checkpoint::SingleFile::open(path).map_err(|e| e.to_string())?;
    let inspection = file.inspect(None).map_err(|e| e.to_string())?;
    // The inferred UNet config carries sample_size and in_channels; the family comes from the text encoders.
    Ok(ModelInfo { family: file.family().as_str().to_string(), ..from_unet_value(&inspection.configs.unet) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(rel: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(rel)
    }

    #[test]
    fn diffusers_folders() {
        let sd1 = from_unet_config(&fixture("models/sd1/unet/config.json")).unwrap();
        assert_eq!(sd1.family, "sd1");
        assert!(!sd1.inpainting);
        let xl = from_unet_config(&fixture("models/sdxl/unet/config.json")).unwrap();
        assert_eq!(xl.family, "sdxl");
        let inpaint = from_unet_config(&fixture("models/sd1-inpaint/unet/config.json")).unwrap();
        assert!(inpaint.inpainting);
        let full = from_unet_config(&fixture("sd15-random/unet/config.json")).unwrap();
        assert_eq!((full.family.as_str(), full.native_width, full.native_height), ("sd1", 512, 512));
    }

    #[test]
    fn single_files() {
        let xl = from_single_file(&fixture("models/sdxl.safetensors")).unwrap();
        assert_eq!(xl.family, "sdxl");
        let inpaint = from_single_file(&fixture("models/sd1-inpaint.safetensors")).unwrap();
        assert!(inpaint.inpainting);
        assert!(from_single_file(&fixture("golden/pipelines.json")).is_err());
    }
}
