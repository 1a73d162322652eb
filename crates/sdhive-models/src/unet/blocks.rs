//! The UNet's down, mid and up blocks (diffusers `DownBlock2D`, `CrossAttnDownBlock2D`,
//! `UNetMidBlock2DCrossAttn`, `UpBlock2D`, `CrossAttnUpBlock2D`), one type per direction with
//! the attention layers present or absent.

use super::config::{BlockKind, BlockPlan};
use super::transformer::{Transformer2DModel, TransformerSpec};
use crate::layers::{Downsample2D, ResnetBlock2D, ResnetSpec, Upsample2D};
use crate::ops::MapLayout;
use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;

/// Settings every block of one UNet shares.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockCommon {
    pub temb_channels: usize,
    pub groups: usize,
    pub eps: f64,
    pub use_linear_projection: bool,
    pub upcast_attention: bool,
    pub downsample_padding: usize,
    pub mid_block_scale_factor: f64,
}

fn transformer(
    vb: VarBuilder,
    plan: &BlockPlan,
    common: &BlockCommon,
    channels: usize,
) -> Result<Transformer2DModel> {
    Transformer2DModel::new(
        vb,
        TransformerSpec {
            channels,
            heads: plan.heads,
            layers: plan.transformer_layers,
            context_dim: plan.cross_attention_dim,
            groups: common.groups,
            use_linear_projection: common.use_linear_projection,
            upcast_attention: common.upcast_attention,
        },
    )
}

/// The time rows for `x`'s samples: the table's, or for the single sample a guided batch shares (the UNet's
/// prefix, which runs only where every sample has the same row) the first.
fn time_rows(temb: &Tensor, x: &Tensor) -> Result<Tensor> {
    let b = x.dim(0)?;
    if temb.dim(0)? == b {
        Ok(temb.clone())
    } else {
        temb.narrow(0, 0, b)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct DownBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2DModel>,
    downsampler: Option<Downsample2D>,
}

impl DownBlock {
    pub fn new(vb: VarBuilder, plan: &BlockPlan, common: &BlockCommon) -> Result<Self> {
        let mut resnets = Vec::with_capacity(plan.resnets);
        let mut attentions = Vec::new();
        for i in 0..plan.resnets {
            let in_c = if i == 0 { plan.in_channels } else { plan.out_channels };
            resnets.push(ResnetBlock2D::new(
                vb.pp(format!("resnets.{i}")),
                ResnetSpec {
                    in_channels: in_c,
                    out_channels: plan.out_channels,
                    temb_channels: Some(common.temb_channels),
                    groups: common.groups,
                    eps: common.eps,
                    output_scale_factor: 1.0,
                },
            )?);
            if plan.kind == BlockKind::CrossAttn {
                attentions.push(transformer(
                    vb.pp(format!("attentions.{i}")),
                    plan,
                    common,
                    plan.out_channels,
                )?);
            }
        }
        let downsampler = if plan.resample {
            Some(Downsample2D::new(vb.pp("downsamplers.0"), plan.out_channels, common.downsample_padding)?)
        } else {
            None
        };
        Ok(Self { resnets, attentions, downsampler })
    }

    pub fn resnets_mut(&mut self) -> impl Iterator<Item = &mut ResnetBlock2D> {
        self.resnets.iter_mut()
    }

    pub fn transformers_mut(&mut self) -> impl Iterator<Item = &mut Transformer2DModel> {
        self.attentions.iter_mut()
    }

    /// Returns the block output and the skip states it hands to the up path.
    pub fn forward(&self, x: &Tensor, temb: &Tensor, context: &Tensor) -> Result<(Tensor, Vec<Tensor>)> {
        let mut x = x.clone();
        let mut skips = Vec::with_capacity(self.resnets.len() + 1);
        for (i, resnet) in self.resnets.iter().enumerate() {
            let rows = time_rows(temb, &x)?;
            x = resnet.forward_owned(x, Some(&rows))?;
            if let Some(attn) = self.attentions.get(i) {
                x = attn.forward(&x, context)?;
            }
            skips.push(x.clone());
        }
        if let Some(down) = &self.downsampler {
            x = down.forward(&x)?;
            skips.push(x.clone());
        }
        Ok((x, skips))
    }
}

#[derive(Debug, Clone)]
pub(crate) struct MidBlock {
    first: ResnetBlock2D,
    layers: Vec<(Transformer2DModel, ResnetBlock2D)>,
}

impl MidBlock {
    pub fn new(vb: VarBuilder, plan: &BlockPlan, common: &BlockCommon) -> Result<Self> {
        let c = plan.in_channels;
        let spec = ResnetSpec {
            in_channels: c,
            out_channels: c,
            temb_channels: Some(common.temb_channels),
            groups: common.groups,
            eps: common.eps,
            output_scale_factor: common.mid_block_scale_factor,
        };
        let first = ResnetBlock2D::new(vb.pp("resnets.0"), spec)?;
        // One attention/resnet pair (diffusers' num_layers = 1).
        let layers = (0..plan.resnets - 1)
            .map(|i| {
                Ok((
                    transformer(vb.pp(format!("attentions.{i}")), plan, common, c)?,
                    ResnetBlock2D::new(vb.pp(format!("resnets.{}", i + 1)), spec)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { first, layers })
    }

    pub fn resnets_mut(&mut self) -> impl Iterator<Item = &mut ResnetBlock2D> {
        std::iter::once(&mut self.first).chain(self.layers.iter_mut().map(|(_, r)| r))
    }

    pub fn transformers_mut(&mut self) -> impl Iterator<Item = &mut Transformer2DModel> {
        self.layers.iter_mut().map(|(t, _)| t)
    }

    pub fn forward(&self, x: &Tensor, temb: &Tensor, context: &Tensor) -> Result<Tensor> {
        let mut x = self.first.forward(x, Some(temb))?;
        for (attn, resnet) in &self.layers {
            x = attn.forward(&x, context)?;
            x = resnet.forward_owned(x, Some(temb))?;
        }
        Ok(x)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct UpBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2DModel>,
    upsampler: Option<Upsample2D>,
    layout: MapLayout,
}

impl UpBlock {
    pub fn new(vb: VarBuilder, plan: &BlockPlan, common: &BlockCommon) -> Result<Self> {
        let n = plan.resnets;
        let mut resnets = Vec::with_capacity(n);
        let mut attentions = Vec::new();
        for i in 0..n {
            let skip_c = if i == n - 1 { plan.in_channels } else { plan.out_channels };
            let in_c = if i == 0 { plan.prev_output_channels } else { plan.out_channels };
            resnets.push(ResnetBlock2D::new(
                vb.pp(format!("resnets.{i}")),
                ResnetSpec {
                    in_channels: in_c + skip_c,
                    out_channels: plan.out_channels,
                    temb_channels: Some(common.temb_channels),
                    groups: common.groups,
                    eps: common.eps,
                    // diffusers passes resnet_out_scale_factor only to other up-block kinds.
                    output_scale_factor: 1.0,
                },
            )?);
            if plan.kind == BlockKind::CrossAttn {
                attentions.push(transformer(
                    vb.pp(format!("attentions.{i}")),
                    plan,
                    common,
                    plan.out_channels,
                )?);
            }
        }
        let upsampler = if plan.resample {
            Some(Upsample2D::new(vb.pp("upsamplers.0"), plan.out_channels)?)
        } else {
            None
        };
        Ok(Self { resnets, attentions, upsampler, layout: MapLayout::of(&vb) })
    }

    pub fn num_resnets(&self) -> usize {
        self.resnets.len()
    }

    pub fn resnets_mut(&mut self) -> impl Iterator<Item = &mut ResnetBlock2D> {
        self.resnets.iter_mut()
    }

    pub fn transformers_mut(&mut self) -> impl Iterator<Item = &mut Transformer2DModel> {
        self.attentions.iter_mut()
    }

    /// `skips` are consumed from the back, newest first, as diffusers pops them.
    pub fn forward(
        &self,
        x: &Tensor,
        skips: &[Tensor],
        temb: &Tensor,
        context: &Tensor,
        upsample_size: Option<(usize, usize)>,
    ) -> Result<Tensor> {
        let mut x = x.clone();
        for (i, resnet) in self.resnets.iter().enumerate() {
            let skip = &skips[skips.len() - 1 - i];
            x = resnet.forward_joined(&x, skip, self.layout, Some(temb))?;
            if let Some(attn) = self.attentions.get(i) {
                x = attn.forward(&x, context)?;
            }
        }
        if let Some(up) = &self.upsampler {
            x = up.forward(&x, upsample_size)?;
        }
        Ok(x)
    }
}
