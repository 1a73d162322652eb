//! The products of the UNet's conditioning that every block would otherwise make on its own: each ResNet's
//! projection of the time embedding and each transformer block's k and v of the text context. Both inputs are
//! the same for every block of a call, so their weights are stacked at load into one matrix each, and a call
//! makes two products (one tall weight each) instead of one small product per block; the blocks read their
//! columns of the results in place.

use super::blocks::{DownBlock, MidBlock, UpBlock};
use crate::layers::stack_linears_opt;
use crate::ops;
use candle_core::{Result, Tensor};
use candle_nn::Linear;

#[derive(Debug, Clone)]
pub(crate) struct ConditioningTables {
    /// Every ResNet's `time_emb_proj`, weight `(ΣC, T)`.
    time: Option<Linear>,
    /// Every transformer block's `attn2.to_k` and `attn2.to_v`, weight `(Σ2·inner, Cctx)`.
    context: Option<Linear>,
}

impl ConditioningTables {
    /// Takes the projections over from the blocks, telling each where its columns will be.
    pub fn stack(down: &mut [DownBlock], mid: &mut MidBlock, up: &mut [UpBlock]) -> Result<Self> {
        let resnets = down
            .iter_mut()
            .flat_map(DownBlock::resnets_mut)
            .chain(mid.resnets_mut())
            .chain(up.iter_mut().flat_map(UpBlock::resnets_mut));
        let time = stack_handed_over(resnets, |r, offset| r.hand_over_time_projection(offset))?;
        let transformers = down
            .iter_mut()
            .flat_map(DownBlock::transformers_mut)
            .chain(mid.transformers_mut())
            .chain(up.iter_mut().flat_map(UpBlock::transformers_mut));
        let attentions = transformers.flat_map(|t| t.context_attentions_mut());
        let context = stack_handed_over(attentions, |a, offset| a.hand_over_context_kv(offset))?;
        Ok(Self { time, context })
    }

    /// What the ResNets take for the activated time embedding `(B, T)`: the `(B, ΣC)` table of their projections.
    pub fn time(&self, activated: &Tensor) -> Result<Tensor> {
        table(&self.time, activated)
    }

    /// What the transformer blocks take for the text context `(B, T, Cctx)`: the `(B, T, Σ2·inner)` table of
    /// their k and v.
    pub fn context(&self, context: &Tensor) -> Result<Tensor> {
        table(&self.context, context)
    }
}

/// The stacked product of `input`, or `input` itself where no block handed a linear over.
fn table(stacked: &Option<Linear>, input: &Tensor) -> Result<Tensor> {
    match stacked {
        Some(l) => ops::linear(l, input, None),
        None => Ok(input.clone()),
    }
}

/// The linears `hand_over` takes from each module, stacked in that order, each module told the column its
/// outputs will start at.
fn stack_handed_over<'a, M: 'a>(
    modules: impl Iterator<Item = &'a mut M>,
    hand_over: impl Fn(&mut M, usize) -> Option<Linear>,
) -> Result<Option<Linear>> {
    let mut parts = Vec::new();
    let mut offset = 0;
    for module in modules {
        if let Some(part) = hand_over(module, offset) {
            offset += part.weight().dim(0)?;
            parts.push(part);
        }
    }
    stack_linears_opt(&parts)
}
