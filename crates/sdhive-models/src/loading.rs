//! Finding and opening a diffusers component's weights (`unet/`, `vae/`, `text_encoder/`…),
//! plus a random-weight `VarBuilder` so full-size networks can be benchmarked without files (and, recorded,
//! written out as a full-size diffusers folder for end-to-end runs).

use crate::error::{strip_backtrace, ModelError, Result};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

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
    let looked_for = SINGLE_FILES.iter().chain(INDEX_FILES.iter()).copied().collect::<Vec<_>>().join(", ");
    Err(ModelError::WeightsNotFound { dir: dir.to_path_buf(), looked_for })
}

fn shards_from_index(dir: &Path, index: &Path) -> Result<Vec<PathBuf>> {
    let index_err = |reason: String| ModelError::WeightIndex { path: index.to_path_buf(), reason };
    let text = std::fs::read_to_string(index).map_err(|e| index_err(e.to_string()))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| index_err(e.to_string()))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| index_err("no `weight_map` object".into()))?;
    let mut files: Vec<PathBuf> = Vec::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| index_err(format!("shard of `{tensor}` is not a string")))?;
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

/// Memory-maps the given safetensors files into one `VarBuilder`, whose weights a surrounding
/// [`crate::params::record`] records.
pub fn open_safetensors(files: &[PathBuf], dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
    // Opening each file alone first gives an error that names the broken one.
    for f in files {
        // SAFETY: weights are read-only inputs; we rely on nobody truncating them while mapped,
        // the same contract as every mmap-based model loader.
        unsafe { candle_core::safetensors::MmapedSafetensors::new(f) }
            .map_err(|source| ModelError::WeightsOpen { path: f.clone(), source: strip_backtrace(source) })?;
    }
    // SAFETY: as above.
    let mapped = unsafe { candle_core::safetensors::MmapedSafetensors::multi(files) }.map_err(|source| {
        ModelError::WeightsOpen {
            path: files.first().cloned().unwrap_or_default(),
            source: strip_backtrace(source),
        }
    })?;
    Ok(crate::params::recording_builder(mapped, dtype, device))
}

/// Opens the weights of the diffusers component folder `dir` (tensors keep diffusers names).
pub fn load_component(dir: &Path, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
    open_safetensors(&find_weight_files(dir)?, dtype, device)
}

/// Reads every tensor of the component folder `dir` into host memory, in the file's dtype (for networks kept
/// off the device between uses).
pub fn read_component(dir: &Path) -> Result<HashMap<String, Tensor>> {
    use rayon::prelude::*;
    let mut out = HashMap::new();
    for f in find_weight_files(dir)? {
        let open_err = |source| ModelError::WeightsOpen { path: f.clone(), source: strip_backtrace(source) };
        // Mapped and copied out tensor by tensor on every core: one copy of each byte (reading the file into a
        // buffer first would make two) and the fresh host pages are touched in parallel, which for gigabytes
        // of weights is most of the time.
        // SAFETY: as in `open_safetensors`.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(&f) }.map_err(open_err)?;
        let names: Vec<String> = st.tensors().into_iter().map(|(name, _)| name).collect();
        let tensors: Vec<(String, Tensor)> = names
            .into_par_iter()
            .map(|name| st.load(&name, &Device::Cpu).map(|t| (name, t)))
            .collect::<candle_core::Result<_>>()
            .map_err(open_err)?;
        out.extend(tensors);
    }
    Ok(out)
}

/// Number of weight values in the component folder `dir`, from the safetensors headers alone.
pub fn count_component_values(dir: &Path) -> Result<u64> {
    let mut n = 0u64;
    for f in find_weight_files(dir)? {
        // SAFETY: as in `open_safetensors`; only the header is read.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(&f) }
            .map_err(|source| ModelError::WeightsOpen { path: f.clone(), source: strip_backtrace(source) })?;
        n += st.tensors().iter().map(|(_, v)| v.shape().iter().product::<usize>() as u64).sum::<u64>();
    }
    Ok(n)
}

/// For error messages: the weight files of `dir`, or the folder itself when none is found.
pub fn describe_weights(dir: &Path) -> String {
    match find_weight_files(dir) {
        Ok(files) => files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "),
        Err(_) => dir.display().to_string(),
    }
}

/// Period of the random pool; large enough that no layer sees an obviously repeating pattern
/// in a row, small enough to generate instantly.
const POOL_LEN: usize = 1 << 20;

/// Serves every requested tensor from a fixed pool of N(0, std²) values, read from a
/// name-dependent offset. Drawing a fresh normal per weight would take about a minute for
/// SDXL; tiling a pool is memory-bound, and the weights are deterministic across runs so
/// benchmark numbers are comparable.
struct RandomWeights {
    pool: Vec<f32>,
    // Half-precision copies so big half models skip an f32 round trip per tensor.
    pool_f16: Vec<half::f16>,
    pool_bf16: Vec<half::bf16>,
}

impl RandomWeights {
    fn new(std: f32, seed: u64) -> Self {
        let mut state = seed;
        let mut next_unit = move || {
            // splitmix64 → uniform in (0, 1]
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 11) as f64 + 1.0) / (1u64 << 53) as f64
        };
        let mut pool = Vec::with_capacity(POOL_LEN);
        while pool.len() < POOL_LEN {
            // Box–Muller gives two normals per pair of uniforms.
            let (u1, u2) = (next_unit(), next_unit());
            let r = (-2.0 * u1.ln()).sqrt();
            let theta = 2.0 * std::f64::consts::PI * u2;
            pool.push((r * theta.cos()) as f32 * std);
            pool.push((r * theta.sin()) as f32 * std);
        }
        let pool_f16 = pool.iter().map(|&v| half::f16::from_f32(v)).collect();
        let pool_bf16 = pool.iter().map(|&v| half::bf16::from_f32(v)).collect();
        Self { pool, pool_f16, pool_bf16 }
    }

    fn tile<T: Copy>(pool: &[T], start: usize, n: usize) -> Vec<T> {
        let mut start = start;
        let mut data = Vec::with_capacity(n);
        while data.len() < n {
            let take = (n - data.len()).min(pool.len() - start);
            data.extend_from_slice(&pool[start..start + take]);
            start = 0;
        }
        data
    }

    fn offset(name: &str) -> usize {
        // FNV-1a: a stable, dependency-free hash of the tensor name.
        let h =
            name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        (h % POOL_LEN as u64) as usize
    }
}

impl SimpleBackend for RandomWeights {
    fn get(
        &self,
        s: Shape,
        name: &str,
        hint: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        // Norm scales/shifts keep their constant init: random tiny gains would shrink
        // activations into denormals and distort the timings being measured.
        if let Init::Const(v) = hint {
            return (Tensor::ones(s, DType::F32, dev)? * v)?.to_dtype(dtype);
        }
        let n = s.elem_count();
        let start = Self::offset(name);
        match dtype {
            DType::F16 => Tensor::from_vec(Self::tile(&self.pool_f16, start, n), s, dev),
            DType::BF16 => Tensor::from_vec(Self::tile(&self.pool_bf16, start, n), s, dev),
            _ => Tensor::from_vec(Self::tile(&self.pool, start, n), s, dev)?.to_dtype(dtype),
        }
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("random weights need a shape for `{name}`")
    }

    fn contains_tensor(&self, _name: &str) -> bool {
        true
    }
}

/// A `VarBuilder` producing deterministic N(0, 0.02²) weights (norms at 1/0) for benchmarking
/// full-size networks, e.g. `UNet2DConditionModel::new(random_var_builder(..), &sd15_unet_config())`.
pub fn random_var_builder(dtype: DType, device: &Device) -> VarBuilder<'static> {
    VarBuilder::from_backend(Box::new(RandomWeights::new(0.02, 0x5D_4E_1F)), dtype, device.clone())
}

/// Every tensor a recording random `VarBuilder` handed out, by its diffusers name.
#[derive(Clone, Default)]
pub struct RecordedWeights(Arc<Mutex<HashMap<String, Tensor>>>);

impl RecordedWeights {
    /// Takes the tensors recorded so far, leaving the record empty.
    pub fn take(&self) -> HashMap<String, Tensor> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

struct Recording {
    inner: RandomWeights,
    seen: RecordedWeights,
}

impl SimpleBackend for Recording {
    fn get(
        &self,
        s: Shape,
        name: &str,
        hint: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.inner.get(s, name, hint, dtype, dev)?;
        self.seen.0.lock().unwrap_or_else(PoisonError::into_inner).insert(name.to_string(), t.clone());
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.inner.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, _name: &str) -> bool {
        true
    }
}

/// [`random_var_builder`]'s weights, each also kept in the returned record so a network built from it can be
/// saved (`candle_core::safetensors::save`) and loaded back like a downloaded model.
pub fn recording_random_var_builder(dtype: DType, device: &Device) -> (VarBuilder<'static>, RecordedWeights) {
    let seen = RecordedWeights::default();
    let backend = Recording { inner: RandomWeights::new(0.02, 0x5D_4E_1F), seen: seen.clone() };
    (VarBuilder::from_backend(Box::new(backend), dtype, device.clone()), seen)
}
