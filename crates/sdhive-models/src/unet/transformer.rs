//! The UNet's spatial transformer: diffusers `Transformer2DModel` (continuous input) with its
//! `BasicTransformerBlock`s (self-attention, cross-attention, GEGLU feed-forward).

use crate::layers::{conv2d, linear, Conv2d, GroupNorm, LayerNorm};
use crate::ops::{self, MapLayout};
use candle_core::{Result, Tensor};
use candle_nn::{Linear, VarBuilder};

/// diffusers `Attention` as used by the UNet: bias-free q/k/v, biased `to_out.0`.
#[derive(Debug, Clone)]
pub struct CrossAttention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    heads: usize,
    scale: f64,
    upcast: bool,
}

impl CrossAttention {
    /// `context_dim` is `None` for self-attention.
    pub fn new(
        vb: VarBuilder,
        query_dim: usize,
        context_dim: Option<usize>,
        heads: usize,
        head_dim: usize,
        upcast: bool,
    ) -> Result<Self> {
        let inner = heads * head_dim;
        let ctx = context_dim.unwrap_or(query_dim);
        Ok(Self {
            to_q: linear(vb.pp("to_q"), query_dim, inner, false)?,
            to_k: linear(vb.pp("to_k"), ctx, inner, false)?,
            to_v: linear(vb.pp("to_v"), ctx, inner, false)?,
            to_out: linear(vb.pp("to_out.0"), inner, query_dim, true)?,
            heads,
            scale: (head_dim as f64).powf(-0.5),
            upcast,
        })
    }

    /// `x` `(B, S, C)`; `context` `(B, T, Cctx)` or `None` to attend to `x` itself.
    pub fn forward(&self, x: &Tensor, context: Option<&Tensor>) -> Result<Tensor> {
        self.forward_residual(x, context, None)
    }

    /// [`Self::forward`] plus `residual` (`(B, S, C)`), added by the output projection.
    pub fn forward_residual(
        &self,
        x: &Tensor,
        context: Option<&Tensor>,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        let ctx = context.unwrap_or(x);
        let q = ops::linear(&self.to_q, x, None)?;
        let k = ops::linear(&self.to_k, ctx, None)?;
        let v = ops::linear(&self.to_v, ctx, None)?;
        let o = ops::multi_head_attention(&q, &k, &v, self.heads, self.scale, self.upcast)?;
        ops::linear(&self.to_out, &o, residual)
    }
}

/// `FeedForward` with GEGLU: `net.0.proj` (to 2×inner), gate, `net.2` (back to dim).
#[derive(Debug, Clone)]
struct FeedForward {
    proj_in: Linear,
    proj_out: Linear,
}

impl FeedForward {
    fn new(vb: VarBuilder, dim: usize) -> Result<Self> {
        let inner = dim * 4;
        Ok(Self {
            proj_in: linear(vb.pp("net.0.proj"), dim, inner * 2, true)?,
            proj_out: linear(vb.pp("net.2"), inner, dim, true)?,
        })
    }

    /// `proj_out(geglu(proj_in(x))) + residual`.
    fn forward(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let h = ops::linear_geglu(&self.proj_in, x)?;
        ops::linear(&self.proj_out, &h, Some(residual))
    }
}

#[derive(Debug, Clone)]
struct BasicTransformerBlock {
    norm1: LayerNorm,
    attn1: CrossAttention,
    norm2: LayerNorm,
    attn2: CrossAttention,
    norm3: LayerNorm,
    ff: FeedForward,
}

impl BasicTransformerBlock {
    fn new(
        vb: VarBuilder,
        dim: usize,
        heads: usize,
        head_dim: usize,
        context_dim: usize,
        upcast: bool,
    ) -> Result<Self> {
        // diffusers' BasicTransformerBlock default norm_eps.
        let eps = 1e-5;
        Ok(Self {
            norm1: LayerNorm::new(vb.pp("norm1"), dim, eps)?,
            attn1: CrossAttention::new(vb.pp("attn1"), dim, None, heads, head_dim, upcast)?,
            norm2: LayerNorm::new(vb.pp("norm2"), dim, eps)?,
            attn2: CrossAttention::new(vb.pp("attn2"), dim, Some(context_dim), heads, head_dim, upcast)?,
            norm3: LayerNorm::new(vb.pp("norm3"), dim, eps)?,
            ff: FeedForward::new(vb.pp("ff"), dim)?,
        })
    }

    fn forward(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        let x = self.attn1.forward_residual(&self.norm1.forward(x)?, None, Some(x))?;
        let x = self.attn2.forward_residual(&self.norm2.forward(&x)?, Some(context), Some(&x))?;
        self.ff.forward(&self.norm3.forward(&x)?, &x)
    }
}

#[derive(Debug, Clone)]
enum Projection {
    Conv(Conv2d),
    Linear(Linear),
}

/// Shape parameters of one [`Transformer2DModel`].
#[derive(Debug, Clone, Copy)]
pub struct TransformerSpec {
    pub channels: usize,
    pub heads: usize,
    pub layers: usize,
    pub context_dim: usize,
    pub groups: usize,
    pub use_linear_projection: bool,
    pub upcast_attention: bool,
}

/// GroupNorm → proj_in → transformer blocks over the `H·W` tokens → proj_out, plus residual.
#[derive(Debug, Clone)]
pub struct Transformer2DModel {
    norm: GroupNorm,
    proj_in: Projection,
    blocks: Vec<BasicTransformerBlock>,
    proj_out: Projection,
    layout: MapLayout,
}

impl Transformer2DModel {
    pub fn new(vb: VarBuilder, s: TransformerSpec) -> Result<Self> {
        let c = s.channels;
        let head_dim = c / s.heads;
        let inner = s.heads * head_dim;
        // diffusers hard-codes eps 1e-6 for this norm, unlike the resnets' norm_eps.
        let norm = GroupNorm::new(vb.pp("norm"), s.groups, c, 1e-6)?;
        let proj = |name: &str, i: usize, o: usize| -> Result<Projection> {
            Ok(if s.use_linear_projection {
                Projection::Linear(linear(vb.pp(name), i, o, true)?)
            } else {
                Projection::Conv(conv2d(vb.pp(name), i, o, 1, 1, 0)?)
            })
        };
        let proj_in = proj("proj_in", c, inner)?;
        let blocks = (0..s.layers)
            .map(|i| {
                BasicTransformerBlock::new(
                    vb.pp(format!("transformer_blocks.{i}")),
                    inner,
                    s.heads,
                    head_dim,
                    s.context_dim,
                    s.upcast_attention,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let proj_out = proj("proj_out", inner, c)?;
        Ok(Self { norm, proj_in, blocks, proj_out, layout: MapLayout::of(&vb) })
    }

    /// `x` a map in the network's layout.
    pub fn forward(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        let (w_in, b_in) = self.proj_in.weight_bias();
        let (w_out, b_out) = self.proj_out.weight_bias();
        if self.layout == MapLayout::ChannelsLast {
            // Channels-last maps are the tokens already.
            let (b, h, w, c) = x.dims4()?;
            let normed = self.norm.forward(x)?.reshape((b, h * w, c))?;
            let mut tokens = ops::project(&normed, w_in, b_in, None)?;
            for block in &self.blocks {
                tokens = block.forward(&tokens, context)?;
            }
            let out = ops::project(&tokens, w_out, b_out, Some(&x.reshape((b, h * w, c))?))?;
            return out.reshape((b, h, w, c));
        }
        let (_, _, h, w) = x.dims4()?;
        let normed = self.norm.forward(x)?;
        // A 1×1 conv and a linear projection are the same product; only the weight's shape
        // differs, and the kernels read the NCHW ↔ token layouts through strides.
        let mut tokens = ops::image_to_tokens(&normed, w_in, b_in)?;
        for block in &self.blocks {
            tokens = block.forward(&tokens, context)?;
        }
        ops::tokens_to_image(&tokens, w_out, b_out, (h, w), Some(x))
    }
}

impl Projection {
    fn weight_bias(&self) -> (&Tensor, Option<&Tensor>) {
        match self {
            Projection::Conv(c) => (c.weight(), c.bias()),
            Projection::Linear(l) => (l.weight(), l.bias()),
        }
    }
}
