//! LoRA networks merged into a loaded model's weights for the jobs that ask for them: when a job's set of LoRAs
//! (files and multipliers) differs from the set merged now, the changed weights are first put back as they were,
//! then each LoRA's deltas, times its text-encoder or UNet multiplier, are added to the weights on the device
//! they live on. Nothing runs per step: the denoising loop computes with ordinary weights.
//!
//! Putting back copies the kept originals (not subtracting the deltas), so a model after a LoRA job computes bit
//! for bit as one that never had it. A model's weights may share memory with the RAM cache's host copy (on the
//! CPU), so a model is put back before it is dropped.
//!
//! [`AppliedLoras`] works on any model through [`LoraNetworks`]: SD1/SDXL's [`SdModel`] (its networks resident or
//! host copies) and SD3's [`Sd3Model`] (the MMDiT as the denoiser, CLIP-L and CLIP-G as the text encoders, each
//! likewise resident or a host copy).

use crate::model::SdModel;
use crate::residency::Originals;
use crate::sd3::Sd3Model;
use candle_core::{Device, Tensor};
use sdhive_engine::LoraUse;
use sdhive_lora::{Denoiser, LoraFile, ModelParams, Network};
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

/// A model's networks as merging sees them: the denoiser ([`Network::Unet`]: a UNet, or SD3's MMDiT) and the text
/// encoders, each changed in place and put back from what it kept.
pub(crate) trait LoraNetworks {
    /// The weights a LoRA may change, by diffusers name with their shapes, and per text encoder the name each
    /// canonical (`text_model.`-prefixed) name has in the network.
    fn lora_params(&self) -> (ModelParams, Vec<HashMap<String, String>>);

    /// Where `network`'s deltas are made; `None` when the model has no such network.
    fn delta_device(&self, network: Network) -> Option<Device>;

    /// Adds `delta` (the file's shape) to `network`'s weight `name`, keeping the weight in `originals` the first
    /// time it changes.
    fn add_delta(
        &mut self,
        network: Network,
        name: &str,
        delta: &Tensor,
        originals: &mut Originals,
    ) -> candle_core::Result<()>;

    /// Puts back every weight of `network` that `originals` holds.
    fn restore(&mut self, network: Network, originals: &mut Originals) -> candle_core::Result<()>;

    /// The denoiser's weights changed: what was made from them beforehand is stale.
    fn denoiser_changed(&self) {}
}

fn no_network(network: Network) -> candle_core::Error {
    candle_core::Error::Msg(format!("the model has no {network:?} network"))
}

impl AppliedLoras {
    /// Bytes kept to put the changed weights back (device memory for built networks).
    pub fn kept_bytes(&self) -> u64 {
        self.unet.bytes() + self.text.iter().map(Originals::bytes).sum::<u64>()
    }

    pub fn is_empty(&self) -> bool {
        self.merged.is_empty()
    }

    /// What the text encoders' weights depend on: the merged files (as read) and their text-encoder multipliers.
    pub(crate) fn text_state(&self) -> Vec<(PathBuf, Option<std::time::SystemTime>, u32)> {
        self.merged.iter().map(|m| (m.path.clone(), m.modified, m.te.to_bits())).collect()
    }

    /// Makes the LoRAs merged into `nets` exactly `loras` (nothing for an empty list). On an error `nets` is left
    /// with no LoRA merged.
    pub(crate) fn set(
        &mut self,
        nets: &mut dyn LoraNetworks,
        loras: &[LoraUse],
    ) -> Result<(), LoraApplyError> {
        let wanted: Vec<Merged> = loras.iter().map(merged_key).collect();
        if wanted == self.merged {
            return Ok(());
        }
        let started = Instant::now();
        self.restore(nets).map_err(|e| LoraApplyError::Failed {
            name: "(restoring weights)".into(),
            message: e.to_string(),
        })?;
        self.last = ChangeTimes { restore_ms: ms_since(started), ..ChangeTimes::default() };
        if loras.is_empty() {
            return Ok(());
        }
        match self.merge_all(nets, loras, &wanted) {
            Ok(()) => {
                self.merged = wanted;
                Ok(())
            }
            Err(e) => {
                if let Err(restore) = self.restore(nets) {
                    tracing::error!("putting weights back after a failed LoRA merge: {restore}");
                }
                Err(e)
            }
        }
    }

    /// Puts every weight a LoRA changed in `nets` back as it was.
    pub(crate) fn restore(&mut self, nets: &mut dyn LoraNetworks) -> candle_core::Result<()> {
        let denoiser_changed = !self.unet.is_empty();
        nets.restore(Network::Unet, &mut self.unet)?;
        for (i, originals) in self.text.iter_mut().enumerate() {
            if !originals.is_empty() {
                nets.restore(Network::TextEncoder(i), originals)?;
            }
        }
        self.merged.clear();
        if denoiser_changed {
            nets.denoiser_changed();
        }
        Ok(())
    }

    fn merge_all(
        &mut self,
        nets: &mut dyn LoraNetworks,
        loras: &[LoraUse],
        keys: &[Merged],
    ) -> Result<(), LoraApplyError> {
        let started = Instant::now();
        let mut read_ms = 0.0;
        let (params, text_names) = nets.lora_params();
        self.text.resize_with(params.text.len(), Originals::default);
        let mut denoiser_changed = false;
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
            let file = self.files.get(key, || LoraFile::read(&lora.path)).map_err(|e| invalid(&e))?;
            read_ms += ms_since(reading);
            let patches = file.resolve(&params).map_err(|e| invalid(&e))?;
            for patch in &patches {
                let (multiplier, shape, name) = match patch.network {
                    Network::Unet => (lora.unet, params.unet.get(&patch.target), Some(&patch.target)),
                    Network::TextEncoder(i) => (
                        lora.te,
                        params.text.get(i).and_then(|m| m.get(&patch.target)),
                        text_names.get(i).and_then(|m| m.get(&patch.target)),
                    ),
                };
                if multiplier == 0.0 {
                    continue;
                }
                let (Some(shape), Some(name)) = (shape, name) else {
                    return Err(invalid(&format!("the model has no weight `{}`", patch.target)));
                };
                let device =
                    nets.delta_device(patch.network).ok_or_else(|| failed(&no_network(patch.network)))?;
                let delta = file.delta(patch, shape, &device).map_err(|e| invalid(&e))?;
                let delta = scaled(&delta, multiplier).map_err(|e| failed(&e))?;
                let originals = match patch.network {
                    Network::Unet => {
                        denoiser_changed = true;
                        &mut self.unet
                    }
                    Network::TextEncoder(i) => {
                        self.text.get_mut(i).ok_or_else(|| failed(&no_network(patch.network)))?
                    }
                };
                nets.add_delta(patch.network, name, &delta, originals).map_err(|e| failed(&e))?;
            }
        }
        if denoiser_changed {
            nets.denoiser_changed();
        }
        self.last.read_ms = read_ms;
        self.last.merge_ms = ms_since(started) - read_ms;
        Ok(())
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

/// A text encoder's weights under their canonical names, and the canonical → stored name map.
fn canonical_text(
    shapes: HashMap<String, Vec<usize>>,
) -> (HashMap<String, Vec<usize>>, HashMap<String, String>) {
    let mut back = HashMap::new();
    let shapes = shapes
        .into_iter()
        .map(|(name, shape)| {
            let canonical = canonical_text_name(&name);
            back.insert(canonical.clone(), name);
            (canonical, shape)
        })
        .collect();
    (shapes, back)
}

impl SdModel {
    /// Makes the merged LoRAs exactly `loras` (nothing for an empty list). On an error the model is left with no
    /// LoRA merged.
    pub fn set_loras(&mut self, loras: &[LoraUse]) -> Result<(), LoraApplyError> {
        let mut applied = std::mem::take(&mut self.loras);
        let result = applied.set(self, loras);
        self.loras = applied;
        result
    }

    /// Puts every weight a LoRA changed back as it was.
    pub fn restore_loras(&mut self) -> candle_core::Result<()> {
        let mut applied = std::mem::take(&mut self.loras);
        let result = applied.restore(self);
        self.loras = applied;
        result
    }
}

impl LoraNetworks for SdModel {
    fn lora_params(&self) -> (ModelParams, Vec<HashMap<String, String>>) {
        let (text, text_names) = self.encoders.iter().map(|e| canonical_text(e.model.param_shapes())).unzip();
        let params = ModelParams {
            unet: self.unet.param_shapes(),
            text,
            // The LDM names of kohya's SDXL files count blocks by a uniform depth; every released UNet has one.
            unet_layers_per_block: match &self.unet_config.layers_per_block {
                sdhive_models::IntOrList::Int(n) => *n,
                sdhive_models::IntOrList::List(v) => v.first().copied().unwrap_or(2),
            },
            unet_down_blocks: self.unet_config.block_out_channels.len(),
            denoiser: Denoiser::Unet,
        };
        (params, text_names)
    }

    fn delta_device(&self, network: Network) -> Option<Device> {
        match network {
            Network::Unet => Some(self.unet.delta_device()),
            Network::TextEncoder(i) => self.encoders.get(i).map(|e| e.model.delta_device()),
        }
    }

    fn add_delta(
        &mut self,
        network: Network,
        name: &str,
        delta: &Tensor,
        originals: &mut Originals,
    ) -> candle_core::Result<()> {
        match network {
            Network::Unet => self.unet.add_delta(name, delta, originals),
            Network::TextEncoder(i) => match self.encoders.get_mut(i) {
                Some(e) => e.model.add_delta(name, delta, originals),
                None => Err(no_network(network)),
            },
        }
    }

    fn restore(&mut self, network: Network, originals: &mut Originals) -> candle_core::Result<()> {
        match network {
            Network::Unet => self.unet.restore(originals),
            Network::TextEncoder(i) => match self.encoders.get_mut(i) {
                Some(e) => e.model.restore(originals),
                None => Err(no_network(network)),
            },
        }
    }

    fn denoiser_changed(&self) {
        if let Some(unet) = self.unet.get() {
            unet.weights_changed();
        }
    }
}

impl LoraNetworks for Sd3Model {
    fn lora_params(&self) -> (ModelParams, Vec<HashMap<String, String>>) {
        let (text, text_names) =
            [&self.clip_l, &self.clip_g].into_iter().map(|m| canonical_text(m.param_shapes())).unzip();
        let params = ModelParams {
            unet: self.transformer.param_shapes(),
            text,
            unet_layers_per_block: 0,
            unet_down_blocks: 0,
            denoiser: Denoiser::Mmdit,
        };
        (params, text_names)
    }

    fn delta_device(&self, network: Network) -> Option<Device> {
        match network {
            Network::Unet => Some(self.transformer.delta_device()),
            Network::TextEncoder(0) => Some(self.clip_l.delta_device()),
            Network::TextEncoder(1) => Some(self.clip_g.delta_device()),
            Network::TextEncoder(_) => None,
        }
    }

    // An offloaded network's host copy takes the deltas (`Resident::add_delta`), so every rebuild has the LoRA.
    fn add_delta(
        &mut self,
        network: Network,
        name: &str,
        delta: &Tensor,
        originals: &mut Originals,
    ) -> candle_core::Result<()> {
        match network {
            Network::Unet => self.transformer.add_delta(name, delta, originals),
            Network::TextEncoder(0) => self.clip_l.add_delta(name, delta, originals),
            Network::TextEncoder(1) => self.clip_g.add_delta(name, delta, originals),
            Network::TextEncoder(_) => Err(no_network(network)),
        }
    }

    fn restore(&mut self, network: Network, originals: &mut Originals) -> candle_core::Result<()> {
        match network {
            Network::Unet => self.transformer.restore(originals),
            Network::TextEncoder(0) => self.clip_l.restore(originals),
            Network::TextEncoder(1) => self.clip_g.restore(originals),
            Network::TextEncoder(_) => Err(no_network(network)),
        }
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
