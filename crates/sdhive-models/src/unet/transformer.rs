//! The UNet's spatial transformer: diffusers `Transformer2DModel` (continuous input) with its
//! `BasicTransformerBlock`s (self-attention, cross-attention, GEGLU feed-forward).

use crate::layers::{conv2d, linear, GroupNorm, LayerNorm};
use crate::ops;
use candle_core::{Module, Result, Tensor};
use candle_nn::{Conv2d, Linear, VarBuilder};

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
        let ctx = context.unwrap_or(x);
        let q = ops::split_heads(&self.to_q.forward(x)?, self.heads)?;
        let k = ops::split_heads(&self.to_k.forward(ctx)?, self.heads)?;
        let v = ops::split_heads(&self.to_v.forward(ctx)?, self.heads)?;
        let o = ops::attention(&q, &k, &v, self.scale, None, self.upcast)?;
        self.to_out.forward(&ops::merge_heads(&o, self.heads)?)
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

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.proj_out.forward(&ops::geglu(&self.proj_in.forward(x)?)?)
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
        let x = (self.attn1.forward(&self.norm1.forward(x)?, None)? + x)?;
        let x = (self.attn2.forward(&self.norm2.forward(&x)?, Some(context))? + &x)?;
        self.ff.forward(&self.norm3.forward(&x)?)? + x
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
        Ok(Self { norm, proj_in, blocks, proj_out })
    }

    pub fn forward(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        let (b, _, h, w) = x.dims4()?;
        let residual = x;
        let x = self.norm.forward(x)?;
        let to_tokens = |t: &Tensor| -> Result<Tensor> {
            let c = t.dim(1)?;
            t.permute((0, 2, 3, 1))?.reshape((b, h * w, c))
        };
        let mut tokens = match &self.proj_in {
            Projection::Conv(conv) => to_tokens(&conv.forward(&x)?)?,
            Projection::Linear(l) => l.forward(&to_tokens(&x)?)?,
        };
        for block in &self.blocks {
            tokens = block.forward(&tokens, context)?;
        }
        let to_image = |t: &Tensor| -> Result<Tensor> {
            let c = t.dim(2)?;
            t.reshape((b, h, w, c))?.permute((0, 3, 1, 2))?.contiguous()
        };
        let out = match &self.proj_out {
            Projection::Conv(conv) => conv.forward(&to_image(&tokens)?)?,
            Projection::Linear(l) => to_image(&l.forward(&tokens)?)?,
        };
        out + residual
    }
}
