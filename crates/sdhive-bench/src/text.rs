//! Text-encoder timing: the family's CLIP encoders with random weights, run as the pipelines run them per
//! request — the prompt and the negative prompt, one 77-token sequence each, through every encoder.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use sdhive_models::{random_var_builder, ClipTextConfig, ClipTextModel};

use crate::Family;

pub struct TextEncoders {
    models: Vec<ClipTextModel>,
    ids: Tensor,
}

impl TextEncoders {
    pub fn new(dev: &Device, dtype: DType, family: Family) -> Result<Self> {
        let mut configs = vec![(ClipTextConfig::sd15(), false)];
        if family == Family::Sdxl {
            configs.push((ClipTextConfig::sdxl_text_encoder_2(), true));
        }
        let models = configs
            .iter()
            .map(|(cfg, projection)| {
                ClipTextModel::new(random_var_builder(dtype, dev), cfg, *projection)
                    .context("building a text encoder with random weights")
            })
            .collect::<Result<Vec<_>>>()?;
        // Token ids within every vocabulary: a start token, words, the end token, padding.
        let ids: Vec<u32> = (0..77u32).map(|i| if i < 20 { 49406 - 1000 + i * 37 } else { 49407 }).collect();
        Ok(Self { models, ids: Tensor::from_vec(ids, (1, 77), dev)? })
    }

    /// Prompt and negative prompt through every encoder.
    pub fn encode_pair(&self) -> Result<()> {
        for _ in 0..2 {
            for m in &self.models {
                m.forward(&self.ids).context("text encoder")?;
            }
        }
        Ok(())
    }

    /// Each encoder's CUDA graph status: shapes replayed, and why any could not be recorded.
    pub fn graph_status(&self) -> Vec<(usize, Vec<String>)> {
        self.models.iter().map(|m| m.graph_status()).collect()
    }
}
