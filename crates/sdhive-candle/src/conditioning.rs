//! Prompt → UNet conditioning: A1111 emphasis and 75-token chunking on top of the CLIP encoders, clip skip, and
//! SDXL's two-encoder concatenation with its pooled embedding. For a plain prompt of at most 75 tokens the result
//! is exactly what diffusers' `encode_prompt` produces.

use crate::model::{Family, SdModel, TextEncoder};
use candle_core::{DType, Device, Result, Tensor, D};
use sdhive_models::ClipTextModel;
use sdhive_tokenizer::prompt::{weighted_chunks, weighted_chunks_with, Chunk, ChunkOptions};

/// The text conditioning for one prompt.
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
    let device = encoder.model.device().clone();
    encoder
        .model
        .with(|m| {
            chunks
                .iter()
                .map(|c| pick_hidden(family, m, (&ids_tensor(&c.ids, &device)?, extra), skip))
                .collect::<Result<Vec<_>>>()
        })
        .map_err(candle_core::Error::wrap)?
}

/// A1111's emphasis: scale each token's embedding by its weight, then restore the chunk's original mean.
fn apply_weights(z: &Tensor, weights: &[f32]) -> Result<Tensor> {
    let original_mean = z.to_dtype(DType::F32)?.mean_all()?.to_scalar::<f32>()?;
    let w = Tensor::from_slice(weights, (1, weights.len(), 1), z.device())?.to_dtype(z.dtype())?;
    let z = z.broadcast_mul(&w)?;
    let new_mean = z.to_dtype(DType::F32)?.mean_all()?.to_scalar::<f32>()?;
    if new_mean == 0.0 || !new_mean.is_finite() {
        return Ok(z);
    }
    z.affine(f64::from(original_mean / new_mean), 0.0)
}

fn ids_tensor(ids: &[u32], device: &Device) -> Result<Tensor> {
    Tensor::from_slice(ids, (1, ids.len()), device)
}

fn encode_chunks(model: &SdModel, chunks: &[Vec<Chunk>], skip: usize) -> Result<Conditioning> {
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
