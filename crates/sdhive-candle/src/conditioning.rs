//! Prompt → UNet conditioning: A1111 emphasis and 75-token chunking on top of the CLIP encoders, clip skip, and
//! SDXL's two-encoder concatenation with its pooled embedding. For a plain prompt of at most 75 tokens the result
//! is exactly what diffusers' `encode_prompt` produces. Recent prompts' encodings are kept ([`TextCache`]), as A1111
//! keeps its last prompt's: a negative prompt a team shares, or a prompt run again with another seed, is not encoded
//! again.

use crate::model::{Family, SdModel, TextEncoder};
use candle_core::{DType, Device, Result, Tensor, D};
use sdhive_models::ClipTextModel;
use sdhive_tokenizer::prompt::{weighted_chunks, weighted_chunks_with, Chunk, ChunkOptions};
use std::sync::Mutex;

/// The text conditioning for one prompt.
#[derive(Clone)]
pub struct Conditioning {
    /// `[1, 77 · chunks, D]`.
    pub context: Tensor,
    /// SDXL: the second encoder's projected pooled output, `[1, P]`.
    pub pooled: Option<Tensor>,
}

/// Positive and negative conditioning with equal sequence lengths, ready to be stacked for CFG.
pub struct PromptPair {
    pub positive: Conditioning,
    pub negative: Conditioning,
}

/// Tokenises `text` for every encoder; all encoders share one vocabulary, so they chunk identically and only
/// their padding differs.
fn chunks_per_encoder(model: &SdModel, text: &str) -> Vec<Vec<Chunk>> {
    let opts = ChunkOptions { embeddings: model.embeddings.words.clone(), ..ChunkOptions::default() };
    model.encoders.iter().map(|e| weighted_chunks_with(&e.tokenizer, text, &opts)).collect()
}

/// A1111 pads the shorter prompt with empty chunks so both sides have the same sequence length.
fn pad_chunks(model: &SdModel, chunks: &mut [Vec<Chunk>], target: usize) {
    for (encoder, list) in model.encoders.iter().zip(chunks.iter_mut()) {
        while list.len() < target {
            let mut empty = weighted_chunks(&encoder.tokenizer, "");
            list.push(empty.remove(0));
        }
    }
}

/// The hidden state a family reads for A1111's clip skip `skip` (1 = last layer).
fn pick_hidden(
    family: Family,
    model: &ClipTextModel,
    (ids, extra): (&Tensor, Option<&Tensor>),
    skip: usize,
) -> Result<(Tensor, Option<Tensor>)> {
    let out = model.forward_with(ids, extra).map_err(candle_core::Error::wrap)?;
    let n = out.hidden_states.len();
    let hidden = match family {
        // diffusers' SD pipelines: last_hidden_state, or hidden_states[-(k+1)] through the final layer norm.
        Family::Sd if skip <= 1 => out.last_hidden_state.clone(),
        Family::Sd => {
            let idx = n.saturating_sub(skip);
            model.final_layer_norm(&out.hidden_states[idx]).map_err(candle_core::Error::wrap)?
        }
        // SDXL reads the penultimate layer (or earlier with clip skip) without the final layer norm.
        Family::Sdxl => out.hidden_states[n.saturating_sub(1 + skip)].clone(),
    };
    Ok((hidden, out.text_embeds))
}

/// Every chunk through one encoder (built once, on its own device, when it is offloaded).
fn encode_with(
    family: Family,
    (encoder, extra): (&TextEncoder, Option<&Tensor>),
    chunks: &[Chunk],
    skip: usize,
) -> Result<Vec<(Tensor, Option<Tensor>)>> {
    encoder
        .model
        .with(|m| {
            chunks
                .iter()
                .map(|c| pick_hidden(family, m, (&ids_tensor(&c.ids)?, extra), skip))
                .collect::<Result<Vec<_>>>()
        })
        .map_err(candle_core::Error::wrap)?
}

/// A1111's emphasis: scale each token's embedding by its weight, then restore the chunk's original mean (left
/// unscaled when the weighted mean is zero or not finite). The means stay on the device: reading them back would
/// make the host wait for the device, and a job joining a running batch would stall the batch's steps.
fn apply_weights(z: &Tensor, weights: &[f32]) -> Result<Tensor> {
    let original_mean = z.to_dtype(DType::F32)?.mean_all()?;
    let w = Tensor::from_slice(weights, (1, weights.len(), 1), z.device())?.to_dtype(z.dtype())?;
    let z = z.broadcast_mul(&w)?;
    let new_mean = z.to_dtype(DType::F32)?.mean_all()?;
    let usable = new_mean.ne(0f64)?.mul(&new_mean.abs()?.lt(f64::INFINITY)?)?;
    let factor = usable.where_cond(&(original_mean / &new_mean)?, &new_mean.ones_like()?)?;
    z.broadcast_mul(&factor.to_dtype(z.dtype())?)
}

/// A chunk's ids on the host: the encoder checks them there before uploading them (read back from the device,
/// they would make the host wait for whatever the device runs, a batch's step included).
fn ids_tensor(ids: &[u32]) -> Result<Tensor> {
    Tensor::from_slice(ids, (1, ids.len()), &Device::Cpu)
}

/// Encodings kept: a few prompts' worth (an SDXL context of one chunk is 77 × 2048 values).
const CACHED_ENCODINGS: usize = 16;

/// What an encoding depends on beyond its chunks and clip skip: the LoRAs merged into the text encoders, the
/// active embeddings, and where each encoder runs (its outputs live there).
#[derive(PartialEq)]
struct TextState {
    loras: Vec<(std::path::PathBuf, Option<std::time::SystemTime>, u32)>,
    embeddings: Vec<(String, std::path::PathBuf, Option<std::time::SystemTime>)>,
    devices: Vec<candle_core::DeviceLocation>,
}

impl TextState {
    fn of(model: &SdModel) -> Self {
        TextState {
            loras: model.loras.text_state(),
            embeddings: model.embeddings.state(),
            devices: model.encoders.iter().map(|e| e.model.device().location()).collect(),
        }
    }
}

/// What an encoding is kept by: clip skip and each encoder's chunks.
type TextKey = (usize, Vec<Vec<Chunk>>);

/// Encodings made under one [`TextState`], most recently used last.
struct Kept {
    state: TextState,
    entries: Vec<(TextKey, Conditioning)>,
}

/// Recent encodings, valid for one [`TextState`]: any change of it empties the cache.
#[derive(Default)]
pub(crate) struct TextCache {
    inner: Mutex<Option<Kept>>,
}

impl TextCache {
    fn get(&self, state: &TextState, key: &TextKey) -> Option<Conditioning> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let kept = inner.as_mut().filter(|k| k.state == *state)?;
        let at = kept.entries.iter().position(|(k, _)| k == key)?;
        let entry = kept.entries.remove(at);
        let hit = entry.1.clone();
        kept.entries.push(entry);
        Some(hit)
    }

    fn put(&self, state: TextState, key: TextKey, value: Conditioning) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let kept = match inner.take() {
            Some(kept) if kept.state == state => inner.insert(kept),
            _ => inner.insert(Kept { state, entries: Vec::new() }),
        };
        if kept.entries.len() >= CACHED_ENCODINGS {
            kept.entries.remove(0);
        }
        kept.entries.push((key, value));
    }

    /// Encodings kept now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map_or(0, |k| k.entries.len())
    }
}

/// Every encoder's chunks, from the cache when they were encoded lately under the same [`TextState`].
fn encode_chunks(model: &SdModel, chunks: &[Vec<Chunk>], skip: usize) -> Result<Conditioning> {
    let state = TextState::of(model);
    let key = (skip, chunks.to_vec());
    if let Some(hit) = model.text_cache.get(&state, &key) {
        return Ok(hit);
    }
    let encoded = encode_chunks_now(model, chunks, skip)?;
    model.text_cache.put(state, key, encoded.clone());
    Ok(encoded)
}

fn encode_chunks_now(model: &SdModel, chunks: &[Vec<Chunk>], skip: usize) -> Result<Conditioning> {
    let count = chunks.first().map(Vec::len).unwrap_or(0);
    let mut per_encoder = model
        .encoders
        .iter()
        .enumerate()
        .zip(chunks)
        .map(|((i, encoder), list)| {
            let extra = model.embeddings.tables.get(i).and_then(Option::as_ref);
            encode_with(model.family, (encoder, extra), list, skip)
        })
        .collect::<Result<Vec<_>>>()?;
    // SDXL's pooled embedding: the projected output of the last encoder that has one, first chunk.
    let pooled = per_encoder.iter_mut().rev().find_map(|outs| outs.first_mut().and_then(|o| o.1.take()));
    let mut parts = Vec::with_capacity(count);
    for c in 0..count {
        let hidden: Vec<Tensor> = per_encoder.iter().map(|outs| outs[c].0.clone()).collect();
        let z = if hidden.len() == 1 { hidden[0].clone() } else { Tensor::cat(&hidden, D::Minus1)? };
        let chunk = &chunks[0][c];
        parts.push(if chunk.is_unweighted() { z } else { apply_weights(&z, &chunk.weights)? });
    }
    let context = if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(&parts, 1)? };
    Ok(Conditioning { context, pooled })
}

/// Encodes the positive and negative prompts with matching chunk counts. An empty SDXL negative prompt becomes
/// zeros when the model asks for it (diffusers' `force_zeros_for_empty_prompt`, also A1111's behaviour).
pub fn encode_pair(model: &SdModel, prompt: &str, negative: &str, clip_skip: u32) -> Result<PromptPair> {
    let skip = clip_skip.max(1) as usize;
    let mut pos = chunks_per_encoder(model, prompt);
    let zero_negative = model.force_zeros_for_empty_prompt && negative.is_empty();
    if zero_negative {
        let positive = encode_chunks(model, &pos, skip)?;
        let negative = Conditioning {
            context: positive.context.zeros_like()?,
            pooled: positive.pooled.as_ref().map(Tensor::zeros_like).transpose()?,
        };
        return Ok(PromptPair { positive, negative });
    }
    let mut neg = chunks_per_encoder(model, negative);
    let target = pos[0].len().max(neg[0].len());
    pad_chunks(model, &mut pos, target);
    pad_chunks(model, &mut neg, target);
    // diffusers' pipelines apply clip skip to the positive prompt only; the negative prompt always reads the
    // default layer. We follow the oracle (A1111 would skip on both sides).
    Ok(PromptPair { positive: encode_chunks(model, &pos, skip)?, negative: encode_chunks(model, &neg, 1)? })
}

/// Only the positive prompt: for runs without classifier-free guidance.
pub fn encode_positive(model: &SdModel, prompt: &str, clip_skip: u32) -> Result<Conditioning> {
    encode_chunks(model, &chunks_per_encoder(model, prompt), clip_skip.max(1) as usize)
}

#[cfg(test)]
mod tests {
    use super::apply_weights;
    use candle_core::{DType, Device, Tensor};

    /// A1111's formula with the means read back, as the host computes it.
    fn on_the_host(z: &Tensor, weights: &[f32]) -> Vec<f32> {
        let mean =
            |t: &Tensor| t.to_dtype(DType::F32).unwrap().mean_all().unwrap().to_scalar::<f32>().unwrap();
        let original = mean(z);
        let w = Tensor::from_slice(weights, (1, weights.len(), 1), z.device())
            .unwrap()
            .to_dtype(z.dtype())
            .unwrap();
        let z = z.broadcast_mul(&w).unwrap();
        let new = mean(&z);
        let z = if new == 0.0 || !new.is_finite() {
            z
        } else {
            z.affine(f64::from(original / new), 0.0).unwrap()
        };
        z.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn emphasis_keeps_the_mean_as_a1111_computes_it() {
        let weights = [1.0, 1.1, 1.21, 0.9, 1.0, 1.5];
        let z = Tensor::randn(0.3f32, 1.0, (1, 6, 8), &Device::Cpu).unwrap();
        for dtype in [DType::F32, DType::F16] {
            let z = z.to_dtype(dtype).unwrap();
            let ours = apply_weights(&z, &weights).unwrap().to_dtype(DType::F32).unwrap();
            assert_eq!(
                ours.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                on_the_host(&z, &weights),
                "{dtype:?}"
            );
        }
        // On the test device (a GPU where one is chosen), within rounding of its storage type.
        let test = crate::test_device::test_device();
        let on_device = z.to_device(&test.device).unwrap().to_dtype(test.dtype).unwrap();
        let ours = apply_weights(&on_device, &weights).unwrap().to_dtype(DType::F32).unwrap();
        let ours = ours.to_device(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let want = on_the_host(&on_device, &weights);
        let tol = if test.dtype == DType::F32 { 1e-6 } else { 1e-2 };
        for (a, b) in ours.iter().zip(&want) {
            assert!((a - b).abs() <= tol * b.abs().max(1.0), "{}: {a} against {b}", test.label);
        }
        // A weighted mean of zero leaves the weighted values unscaled (no division by it).
        let z = Tensor::from_slice(&[1f32, -1.0, 2.0, -2.0], (1, 2, 2), &Device::Cpu).unwrap();
        let ours = apply_weights(&z, &[1.0, 1.0]).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(ours, on_the_host(&z, &[1.0, 1.0]));
        assert_eq!(ours, vec![1.0, -1.0, 2.0, -2.0]);
    }
}
