//! LoRA networks merged into a loaded model's weights for the jobs that ask for them: when a job's set of LoRAs
//! (files and multipliers) differs from the set merged now, the changed weights are first put back as they were,
//! then each LoRA's deltas, times its text-encoder or UNet multiplier, are added to the weights on the device
//! they live on. Nothing runs per step: the denoising loop computes with ordinary weights.
//!
//! Putting back copies the kept originals (not subtracting the deltas), so a model after a LoRA job computes bit
//! for bit as one that never had it. A model's weights may share memory with the RAM cache's host copy (on the
//! CPU), so a model is put back before it is dropped.

use crate::model::SdModel;
use crate::residency::Originals;
use candle_core::Tensor;
use sdhive_engine::LoraUse;
use sdhive_lora::{LoraFile, ModelParams, Network};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum LoraApplyError {
    /// The request's LoRA cannot be used with this model (unreadable, unknown format, does not fit): the
    /// request's fault.
    #[error("LoRA `{name}`: {message}")]
    Invalid { name: String, message: String },
    /// Merging failed on the device.
    #[error("merging LoRA `{name}`: {message}")]
    Failed { name: String, message: String },
}

/// One merged LoRA as a job asked for it.
#[derive(Debug, Clone, PartialEq)]
struct Merged {
    path: PathBuf,
    modified: Option<std::time::SystemTime>,
    te: f32,
    unet: f32,
}

/// The LoRAs merged into a model now and what they changed.
#[derive(Default)]
pub struct AppliedLoras {
    merged: Vec<Merged>,
    unet: Originals,
    /// One per text encoder.
    text: Vec<Originals>,
    /// Files read recently, so that switching between a few LoRAs reads none of them again.
    files: FileCache,
    /// Where the last change of the set spent its time.
    pub last: ChangeTimes,
}

/// Host time of the last change of the merged set (device work is queued: it ends at the next synchronisation).
#[derive(Debug, Clone, Copy, Default)]
pub struct ChangeTimes {
    /// Putting back what the previous set changed.
    pub restore_ms: f64,
    /// Reading files that were not cached.
    pub read_ms: f64,
    /// Resolving the modules and adding the deltas.
    pub merge_ms: f64,
}

/// Parsed LoRA files, most recently used last; a file changed on disk (mtime) is read again.
#[derive(Default)]
struct FileCache {
    entries: Vec<(Merged, Arc<LoraFile>, u64)>,
}

/// Files kept, and the host memory they may hold together (tensors in the file's dtype: about the file's size).
const CACHED_FILES: usize = 4;
const CACHED_BYTES: u64 = 2 << 30;

impl FileCache {
    fn get(
        &mut self,
        key: &Merged,
        read: impl FnOnce() -> Result<LoraFile, sdhive_lora::LoraError>,
    ) -> Result<Arc<LoraFile>, sdhive_lora::LoraError> {
        let same = |m: &Merged| m.path == key.path && m.modified == key.modified;
        if let Some(at) = self.entries.iter().position(|(m, _, _)| same(m)) {
            let entry = self.entries.remove(at);
            let file = Arc::clone(&entry.1);
            self.entries.push(entry);
            return Ok(file);
        }
        let file = Arc::new(read()?);
        let bytes = std::fs::metadata(&key.path).map(|m| m.len()).unwrap_or(0);
        self.entries.retain(|(m, _, _)| m.path != key.path);
        self.entries.push((key.clone(), Arc::clone(&file), bytes));
        while self.entries.len() > CACHED_FILES
            || (self.entries.len() > 1 && self.entries.iter().map(|e| e.2).sum::<u64>() > CACHED_BYTES)
        {
            self.entries.remove(0);
        }
        Ok(file)
    }
}

impl AppliedLoras {
    /// Bytes kept to put the changed weights back (device memory for built networks).
    pub fn kept_bytes(&self) -> u64 {
        self.unet.bytes() + self.text.iter().map(Originals::bytes).sum::<u64>()
    }

    pub fn is_empty(&self) -> bool {
        self.merged.is_empty()
    }
}

fn merged_key(l: &LoraUse) -> Merged {
    let modified = std::fs::metadata(&l.path).and_then(|m| m.modified()).ok();
    Merged { path: l.path.clone(), modified, te: l.te, unet: l.unet }
}

/// Text-encoder weights may be named without the `text_model.` prefix (bare CLIP files); LoRA files always name
/// them with it.
fn canonical_text_name(name: &str) -> String {
    if name.starts_with("text_model.") || name.starts_with("text_projection") {
        name.to_string()
    } else {
        format!("text_model.{name}")
    }
}

impl SdModel {
    /// Makes the merged LoRAs exactly `loras` (nothing for an empty list). On an error the model is left with no
    /// LoRA merged.
    pub fn set_loras(&mut self, loras: &[LoraUse]) -> Result<(), LoraApplyError> {
        let wanted: Vec<Merged> = loras.iter().map(merged_key).collect();
        if wanted == self.loras.merged {
            return Ok(());
        }
        let started = Instant::now();
        self.restore_loras().map_err(|e| LoraApplyError::Failed {
            name: "(restoring weights)".into(),
            message: e.to_string(),
        })?;
        self.loras.last = ChangeTimes { restore_ms: ms_since(started), ..ChangeTimes::default() };
        if loras.is_empty() {
            return Ok(());
        }
        match self.merge_all(loras, &wanted) {
            Ok(()) => {
                self.loras.merged = wanted;
                Ok(())
            }
            Err(e) => {
                if let Err(restore) = self.restore_loras() {
                    tracing::error!("putting weights back after a failed LoRA merge: {restore}");
                }
                Err(e)
            }
        }
    }

    /// Puts every weight a LoRA changed back as it was.
    pub fn restore_loras(&mut self) -> candle_core::Result<()> {
        let unet_changed = !self.loras.unet.is_empty();
        self.unet.restore(&mut self.loras.unet)?;
        for (encoder, originals) in self.encoders.iter_mut().zip(self.loras.text.iter_mut()) {
            encoder.model.restore(originals)?;
        }
        self.loras.merged.clear();
        if unet_changed {
            if let Some(unet) = self.unet.get() {
                unet.weights_changed();
            }
        }
        Ok(())
    }

    fn model_params(&self) -> (ModelParams, Vec<HashMap<String, String>>) {
        let mut text_names = Vec::new();
        let text = self
            .encoders
            .iter()
            .map(|e| {
                let mut back = HashMap::new();
                let shapes = e
                    .model
                    .param_shapes()
                    .into_iter()
                    .map(|(name, shape)| {
                        let canonical = canonical_text_name(&name);
                        back.insert(canonical.clone(), name);
                        (canonical, shape)
                    })
                    .collect();
                text_names.push(back);
                shapes
            })
            .collect();
        let params = ModelParams {
            unet: self.unet.param_shapes(),
            text,
            // The LDM names of kohya's SDXL files count blocks by a uniform depth; every released UNet has one.
            unet_layers_per_block: match &self.unet_config.layers_per_block {
                sdhive_models::IntOrList::Int(n) => *n,
                sdhive_models::IntOrList::List(v) => v.first().copied().unwrap_or(2),
            },
            unet_down_blocks: self.unet_config.block_out_channels.len(),
        };
        (params, text_names)
    }

    fn merge_all(&mut self, loras: &[LoraUse], keys: &[Merged]) -> Result<(), LoraApplyError> {
        let started = Instant::now();
        let mut read_ms = 0.0;
        let (params, text_names) = self.model_params();
        self.loras.text.resize_with(self.encoders.len(), Originals::default);
        let mut unet_changed = false;
        for (lora, key) in loras.iter().zip(keys) {
            let invalid = |e: &dyn std::fmt::Display| LoraApplyError::Invalid {
                name: lora.name.clone(),
                message: e.to_string(),
            };
            let failed = |e: &dyn std::fmt::Display| LoraApplyError::Failed {
                name: lora.name.clone(),
                message: e.to_string(),
            };
            let reading = Instant::now();
            let file = self.loras.files.get(key, || LoraFile::read(&lora.path)).map_err(|e| invalid(&e))?;
            read_ms += ms_since(reading);
            let patches = file.resolve(&params).map_err(|e| invalid(&e))?;
            for patch in &patches {
                let (multiplier, shape) = match patch.network {
                    Network::Unet => (lora.unet, params.unet.get(&patch.target)),
                    Network::TextEncoder(i) => {
                        (lora.te, params.text.get(i).and_then(|m| m.get(&patch.target)))
                    }
                };
                if multiplier == 0.0 {
                    continue;
                }
                let shape =
                    shape.ok_or_else(|| invalid(&format!("the model has no weight `{}`", patch.target)))?;
                let (resident_device, name): (_, &str) = match patch.network {
                    Network::Unet => (self.unet.delta_device(), &patch.target),
                    Network::TextEncoder(i) => {
                        let name = text_names.get(i).and_then(|m| m.get(&patch.target)).ok_or_else(|| {
                            invalid(&format!("the model has no text-encoder weight `{}`", patch.target))
                        })?;
                        (self.encoders[i].model.delta_device(), name)
                    }
                };
                let delta = file.delta(patch, shape, &resident_device).map_err(|e| invalid(&e))?;
                let delta = scaled(&delta, multiplier).map_err(|e| failed(&e))?;
                match patch.network {
                    Network::Unet => {
                        unet_changed = true;
                        self.unet.add_delta(name, &delta, &mut self.loras.unet)
                    }
                    Network::TextEncoder(i) => {
                        self.encoders[i].model.add_delta(name, &delta, &mut self.loras.text[i])
                    }
                }
                .map_err(|e| failed(&e))?;
            }
        }
        if unet_changed {
            if let Some(unet) = self.unet.get() {
                unet.weights_changed();
            }
        }
        self.loras.last.read_ms = read_ms;
        self.loras.last.merge_ms = ms_since(started) - read_ms;
        Ok(())
    }
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn scaled(delta: &Tensor, multiplier: f32) -> candle_core::Result<Tensor> {
    if multiplier == 1.0 {
        Ok(delta.clone())
    } else {
        delta.affine(f64::from(multiplier), 0.0)
    }
}
