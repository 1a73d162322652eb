//! What the serving layers need to know about a model before stable-diffusion.cpp has read it: its family and
//! native size. stable-diffusion.cpp's C API does not report them, so they are read the way the candle engine
//! reads them — from a diffusers folder's UNet config, or from a single file's tensor names and shapes (a GGUF's
//! from its header, which also gives the weights' stored size and types).

use sdhive_engine::ModelShape;
use sdhive_modelsource::{ModelLocation, ResolvedModel};
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// `sd1`, `sd2`, `sdxl`, `sd3` (SD3 and SD3.5).
    pub family: String,
    pub native_width: u32,
    pub native_height: u32,
    /// A 9-channel inpainting UNet.
    pub inpainting: bool,
    /// A GGUF checkpoint's weights, which load in the file's own (often quantised) types.
    pub gguf: Option<GgufWeights>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufWeights {
    /// The weights' bytes as stored.
    pub bytes: u64,
    /// Their ggml types, most bytes first (`f16+q8_0`).
    pub types: String,
}

impl ModelInfo {
    pub fn read(model: &ResolvedModel) -> Result<ModelInfo, String> {
        match &model.location {
            ModelLocation::DiffusersDir(dir) if sdhive_checkpoint::is_sd3_folder(dir) => {
                let cfg = crate::sd3::transformer_config(dir)?;
                let side = cfg["sample_size"].as_u64().map_or(1024, |s| s as u32 * 8);
                Ok(ModelInfo::sd3(side))
            }
            ModelLocation::DiffusersDir(dir) => from_unet_config(&dir.join("unet").join("config.json")),
            ModelLocation::SingleFile(file) if model.location.is_gguf() => from_gguf(file),
            ModelLocation::SingleFile(file) => {
                if sdhive_checkpoint::is_sd3_file(file).map_err(|e| e.to_string())? {
                    // SAI's files carry no config; every SD3/SD3.5 is made for 1024².
                    return Ok(ModelInfo::sd3(1024));
                }
                from_single_file(file)
            }
        }
    }

    fn sd3(side: u32) -> ModelInfo {
        ModelInfo {
            family: "sd3".into(),
            native_width: side,
            native_height: side,
            inpainting: false,
            gguf: None,
        }
    }
}

impl ModelInfo {
    /// The model's shape for memory planning. stable-diffusion.cpp does not report its allocations, so the
    /// weights are the family's parameter count (UNet + text encoders + VAE) at `bytes_per_weight`; sd.cpp runs
    /// the CFG pair as two batch-1 calls and materialises attention scores (no flash attention by default).
    /// A GGUF's weights count at their size in the file, as they stay in its types.
    pub fn shape(&self, bytes_per_weight: u64) -> ModelShape {
        let (params, first_attention_level, heads) = match self.family.as_str() {
            "sdxl" => (3_470_000_000u64, 1, 10),
            "sd2" => (1_290_000_000, 0, 5),
            _ => (1_070_000_000, 0, 8),
        };
        ModelShape {
            weights_bytes: self.gguf.as_ref().map_or(params * bytes_per_weight, |g| g.bytes),
            activation_bytes: bytes_per_weight,
            vae_factor: 8,
            first_attention_level,
            heads_at_first_attention: heads,
            fused_attention: false,
            score_chunk_elements: None,
            // sd.cpp's default VAE tile (32 latent pixels a side).
            vae_tile_latent: 32,
            mmdit: None,
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
        gguf: None,
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

/// A GGUF holds no configs: the family (from its tensors) gives the native size, as diffusers' defaults do.
fn from_gguf(path: &Path) -> Result<ModelInfo, String> {
    let header = sdhive_catalog::gguf::read_header(path)?;
    let ckpt = header.sd_checkpoint()?;
    let side = default_side(ckpt.family);
    Ok(ModelInfo {
        family: ckpt.family.to_string(),
        native_width: side,
        native_height: side,
        inpainting: ckpt.inpainting,
        gguf: Some(GgufWeights { bytes: header.data_bytes, types: ckpt.weight_types }),
    })
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
    fn sd3_models() {
        let read =
            |location| ModelInfo::read(&ResolvedModel { name: "x".into(), location, vae: None }).unwrap();
        let folder = read(ModelLocation::DiffusersDir(fixture("models/sd35m")));
        // The tiny fixture's transformer has sample_size 8 (64 pixels); the full-size one 128.
        assert_eq!((folder.family.as_str(), folder.native_width, folder.inpainting), ("sd3", 64, false));
        let full = read(ModelLocation::DiffusersDir(fixture("sd35m-random")));
        assert_eq!((full.native_width, full.native_height), (1024, 1024));
        let file = read(ModelLocation::SingleFile(fixture("models/sd3.safetensors")));
        assert_eq!((file.family.as_str(), file.native_width), ("sd3", 1024));
    }

    #[test]
    fn single_files() {
        let xl = from_single_file(&fixture("models/sdxl.safetensors")).unwrap();
        assert_eq!(xl.family, "sdxl");
        let inpaint = from_single_file(&fixture("models/sd1-inpaint.safetensors")).unwrap();
        assert!(inpaint.inpainting);
        assert!(from_single_file(&fixture("golden/pipelines.json")).is_err());
    }

    #[test]
    fn gguf_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("xl-inpaint.gguf");
        sdhive_catalog::gguf::write_sd_for_tests(&path, "sdxl", 9).unwrap();
        let info = from_gguf(&path).unwrap();
        assert_eq!((info.family.as_str(), info.native_width, info.inpainting), ("sdxl", 1024, true));
        let gguf = info.gguf.clone().unwrap();
        assert_eq!(gguf.types, "q8_0+f16+f32");
        // The plan counts the file's bytes, not the family's parameters at 2 bytes.
        assert_eq!(info.shape(2).weights_bytes, gguf.bytes);
        assert!(gguf.bytes > 0 && gguf.bytes < 1_000_000);
        let resolved =
            ResolvedModel { name: "x".into(), location: ModelLocation::SingleFile(path.clone()), vae: None };
        assert_eq!(ModelInfo::read(&resolved).unwrap(), info);
        std::fs::write(&path, b"GGUF\x03\0\0\0").unwrap();
        assert!(ModelInfo::read(&resolved).unwrap_err().contains("truncated"));
    }
}
