//! Finding and opening a diffusers component's weights (`unet/`, `vae/`, `text_encoder/`…),
//! plus a random-weight `VarBuilder` so full-size networks can be benchmarked without files.

use crate::error::{strip_backtrace, ModelError, Result};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use std::path::{Path, PathBuf};

/// Single-file names in preference order: full precision first, then the fp16 variants.
const SINGLE_FILES: [&str; 4] = [
    "diffusion_pytorch_model.safetensors",
    "model.safetensors",
    "diffusion_pytorch_model.fp16.safetensors",
    "model.fp16.safetensors",
];

/// Sharded checkpoints: the index maps each tensor to its shard.
const INDEX_FILES: [&str; 4] = [
    "diffusion_pytorch_model.safetensors.index.json",
    "model.safetensors.index.json",
    "diffusion_pytorch_model.safetensors.index.fp16.json",
    "model.safetensors.index.fp16.json",
];

/// The safetensors file(s) holding a component's weights in `dir`.
pub fn find_weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    if let Some(name) = SINGLE_FILES.iter().find(|n| dir.join(n).is_file()) {
        return Ok(vec![dir.join(name)]);
    }
    if let Some(name) = INDEX_FILES.iter().find(|n| dir.join(n).is_file()) {
        return shards_from_index(dir, &dir.join(name));
    }
    let looked_for = SINGLE_FILES
        .iter()
        .chain(INDEX_FILES.iter())
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    Err(ModelError::WeightsNotFound {
        dir: dir.to_path_buf(),
        looked_for,
    })
}

fn shards_from_index(dir: &Path, index: &Path) -> Result<Vec<PathBuf>> {
    let index_err = |reason: String| ModelError::WeightIndex {
        path: index.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(index).map_err(|e| index_err(e.to_string()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| index_err(e.to_string()))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| index_err("no `weight_map` object".into()))?;
    let mut files: Vec<PathBuf> = Vec::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| index_err(format!("shard of `{tensor}` is not a string")))?;
        let path = dir.join(file);
        if !files.contains(&path) {
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(index_err("`weight_map` is empty".into()));
    }
    Ok(files)
}

/// Memory-maps the given safetensors files into one `VarBuilder`.
pub fn open_safetensors(
    files: &[PathBuf],
    dtype: DType,
    device: &Device,
) -> Result<VarBuilder<'static>> {
    // Opening each file alone first gives an error that names the broken one.
    for f in files {
        // SAFETY: weights are read-only inputs; we rely on nobody truncating them while mapped,
        // the same contract as every mmap-based model loader.
        unsafe { candle_core::safetensors::MmapedSafetensors::new(f) }.map_err(|source| {
            ModelError::WeightsOpen {
                path: f.clone(),
                source: strip_backtrace(source),
            }
        })?;
    }
    // SAFETY: as above.
    unsafe { VarBuilder::from_mmaped_safetensors(files, dtype, device) }.map_err(|source| {
        ModelError::WeightsOpen {
            path: files.first().cloned().unwrap_or_default(),
            source: strip_backtrace(source),
        }
    })
}

/// Opens the weights of the diffusers component folder `dir` (tensors keep diffusers names).
pub fn load_component(dir: &Path, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
    open_safetensors(&find_weight_files(dir)?, dtype, device)
}

/// For error messages: the weight files of `dir`, or the folder itself when none is found.
pub(crate) fn describe_weights(dir: &Path) -> String {
    match find_weight_files(dir) {
        Ok(files) => files
            .iter()
            .map(|f| f.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        Err(_) => dir.display().to_string(),
    }
}

/// Serves every requested tensor with fresh random values instead of reading a file.
struct RandomWeights {
    std: f64,
}

impl SimpleBackend for RandomWeights {
    fn get(
        &self,
        s: Shape,
        _name: &str,
        hint: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        // Norm scales/shifts keep their constant init: random tiny gains would shrink
        // activations into denormals and distort the timings being measured.
        match hint {
            Init::Const(v) => (Tensor::ones(s, DType::F32, dev)? * v)?.to_dtype(dtype),
            _ => Tensor::randn(0f32, self.std as f32, s, dev)?.to_dtype(dtype),
        }
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("random weights need a shape for `{name}`")
    }

    fn contains_tensor(&self, _name: &str) -> bool {
        true
    }
}

/// A `VarBuilder` producing N(0, 0.02²) weights (norms at 1/0) for benchmarking full-size
/// networks, e.g. `UNet2DConditionModel::new(random_var_builder(..), &sd15_unet_config())`.
pub fn random_var_builder(dtype: DType, device: &Device) -> VarBuilder<'static> {
    VarBuilder::from_backend(Box::new(RandomWeights { std: 0.02 }), dtype, device.clone())
}
