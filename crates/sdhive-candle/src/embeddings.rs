//! Textual-inversion embeddings for the jobs that name them: each embedding's vectors stand after the text
//! encoders' vocabulary, one id per vector, and the prompt's word for it becomes those ids (as the tokens
//! diffusers' `load_textual_inversion` adds to the tokenizer). SDXL embeddings carry one set of vectors per
//! encoder (`clip_l`, `clip_g`).

use crate::model::SdModel;
use candle_core::{Tensor, D};
use sdhive_engine::EmbeddingUse;
use sdhive_tokenizer::EmbeddingWord;
use std::path::PathBuf;
use thiserror::Error;

#[derive(Debug, Error)]
#[error("embedding `{name}`: {message}")]
pub struct EmbeddingError {
    pub name: String,
    pub message: String,
}

/// The most vectors an embedding may have: a chunk holds 75 tokens, and an embedding is never split.
const MAX_VECTORS: usize = 75;

/// An embedding read for this model: its vectors for each text encoder.
struct Loaded {
    name: String,
    path: PathBuf,
    modified: Option<std::time::SystemTime>,
    /// `(n, width)` per encoder, on the host.
    vectors: Vec<Tensor>,
}

/// The embeddings a job uses, as the tokenizer and the encoders need them.
#[derive(Default)]
pub struct ActiveEmbeddings {
    /// Read files, kept while jobs keep naming them.
    loaded: Vec<Loaded>,
    /// The prompt words and their ids.
    pub words: Vec<EmbeddingWord>,
    /// Per encoder: every active embedding's vectors in id order, `(N, width)`; `None` without embeddings.
    pub tables: Vec<Option<Tensor>>,
}

/// An encoder's vocabulary size and width, from its token embedding's shape.
fn encoder_shape(model: &SdModel, i: usize) -> Option<(usize, usize)> {
    let shapes = model.encoders.get(i)?.model.param_shapes();
    let table = shapes
        .get("text_model.embeddings.token_embedding.weight")
        .or_else(|| shapes.get("embeddings.token_embedding.weight"))?;
    Some((table[0], table[1]))
}

impl ActiveEmbeddings {
    /// What an encoding depends on beyond the token ids: the active embeddings (ids past the vocabulary are theirs,
    /// in this order) and the files they were read from.
    pub(crate) fn state(&self) -> Vec<(String, PathBuf, Option<std::time::SystemTime>)> {
        self.loaded.iter().map(|l| (l.name.clone(), l.path.clone(), l.modified)).collect()
    }
}

fn modified(path: &std::path::Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

impl SdModel {
    /// The widths of the text encoders' token embeddings (what an embedding's vectors must have).
    pub fn text_widths(&self) -> Vec<u32> {
        (0..self.encoders.len()).filter_map(|i| encoder_shape(self, i)).map(|(_, w)| w as u32).collect()
    }

    /// Makes `uses` the embeddings the next prompts are encoded with (none for an empty list).
    pub fn set_embeddings(&mut self, uses: &[EmbeddingUse]) -> Result<(), EmbeddingError> {
        // Most jobs name none: nothing to read or look up then.
        if uses.is_empty() && self.embeddings.loaded.is_empty() {
            return Ok(());
        }
        let err = |name: &str, message: String| EmbeddingError { name: name.to_string(), message };
        let shapes: Vec<(usize, usize)> = (0..self.encoders.len())
            .map(|i| {
                encoder_shape(self, i)
                    .ok_or_else(|| err("", "the text encoder has no token embedding".into()))
            })
            .collect::<Result<_, _>>()?;
        let vocab = shapes.first().map(|s| s.0).unwrap_or(0);
        if shapes.iter().any(|s| s.0 != vocab) {
            return Err(err("", "this model's text encoders have vocabularies of different sizes".into()));
        }
        let mut kept = std::mem::take(&mut self.embeddings.loaded);
        let mut loaded = Vec::with_capacity(uses.len());
        for u in uses {
            let stamp = modified(&u.path);
            if let Some(at) = kept.iter().position(|l| l.path == u.path && l.modified == stamp) {
                let mut l = kept.swap_remove(at);
                l.name = u.name.clone();
                loaded.push(l);
                continue;
            }
            let file = sdhive_lora::Embedding::read(&u.path).map_err(|e| err(&u.name, e.to_string()))?;
            let vectors = shapes
                .iter()
                .enumerate()
                .map(|(i, &(_, width))| {
                    file.for_encoder(i, width).cloned().ok_or_else(|| {
                        let have: Vec<usize> =
                            file.vectors.iter().filter_map(|v| v.dim(D::Minus1).ok()).collect();
                        let want: Vec<usize> = shapes.iter().map(|s| s.1).collect();
                        err(
                            &u.name,
                            format!(
                                "its vectors (width {have:?}) do not fit this model's text encoder{} (width {want:?})",
                                if want.len() > 1 { "s" } else { "" }
                            ),
                        )
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let counts: Vec<usize> = vectors.iter().filter_map(|v| v.dim(0).ok()).collect();
            match counts.first() {
                Some(&n) if n > 0 && n <= MAX_VECTORS && counts.iter().all(|&c| c == n) => {}
                _ => {
                    return Err(err(
                        &u.name,
                        format!(
                            "{counts:?} vectors: needs 1 to {MAX_VECTORS}, the same number for each encoder"
                        ),
                    ))
                }
            }
            loaded.push(Loaded { name: u.name.clone(), path: u.path.clone(), modified: stamp, vectors });
        }
        let mut words = Vec::with_capacity(loaded.len());
        let mut next = vocab as u32;
        for l in &loaded {
            let n = l.vectors.first().and_then(|v| v.dim(0).ok()).unwrap_or(0) as u32;
            words.push(EmbeddingWord { name: l.name.clone(), ids: (next..next + n).collect() });
            next += n;
        }
        let tables = (0..self.encoders.len())
            .map(|i| {
                let parts: Vec<&Tensor> = loaded.iter().map(|l| &l.vectors[i]).collect();
                if parts.is_empty() {
                    Ok(None)
                } else {
                    Tensor::cat(&parts, 0).map(Some)
                }
            })
            .collect::<candle_core::Result<Vec<_>>>()
            .map_err(|e| err("", e.to_string()))?;
        self.embeddings = ActiveEmbeddings { loaded, words, tables };
        Ok(())
    }
}
