//! The UNet's spatial transformer: diffusers `Transformer2DModel` (continuous input) with its
//! `BasicTransformerBlock`s (self-attention, cross-attention, GEGLU feed-forward).

use crate::layers::{conv2d, linear, stack_linears, Conv2d, GroupNorm, LayerNorm, StackableLinear};
use crate::ops::{self, MapLayout};
use candle_core::{bail, Result, Tensor, D};
use candle_nn::{Linear, VarBuilder};

/// diffusers `Attention` as used by the UNet: bias-free q/k/v, biased `to_out.0`.
#[derive(Debug, Clone)]
pub struct CrossAttention {
    projections: Projections,
    to_out: Linear,
    heads: usize,
    inner: usize,
    scale: f64,
    upcast: bool,
}

/// The input projections, stacked at load so that what one call needs of the same input is one product: the
/// attention reads q, k and v as column ranges of it, in place.
#[derive(Debug, Clone)]
enum Projections {
    /// Self-attention: `to_q`, `to_k`, `to_v` of the tokens, weight `(3·inner, C)`.
    Tokens(Linear),
    /// Attention to a context: `to_q` of the tokens, and `to_k` and `to_v` of the context stacked (weight
    /// `(2·inner, Cctx)`), which the UNet takes over into one product for all its blocks
    /// ([`CrossAttention::hand_over_context_kv`]).
    Context { to_q: Linear, kv: StackableLinear },
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
        let part = |name: &str, dim: usize| linear(vb.pp(name), dim, inner, false);
        let projections = match context_dim {
            None => Projections::Tokens(stack_linears(&[
                part("to_q", query_dim)?,
                part("to_k", query_dim)?,
                part("to_v", query_dim)?,
            ])?),
            Some(ctx) => Projections::Context {
                to_q: part("to_q", query_dim)?,
                kv: StackableLinear::Own(stack_linears(&[part("to_k", ctx)?, part("to_v", ctx)?])?),
            },
        };
        Ok(Self {
            projections,
            to_out: linear(vb.pp("to_out.0"), inner, query_dim, true)?,
            heads,
            inner,
            scale: (head_dim as f64).powf(-0.5),
            upcast,
        })
    }

    /// `x` `(B, S, C)`; `context` `(B, T, Cctx)` for attention to a context, `None` for self-attention.
    pub fn forward(&self, x: &Tensor, context: Option<&Tensor>) -> Result<Tensor> {
        self.forward_residual(x, context, None)
    }

    /// Gives up the k and v projections of the context (one weight `(2·inner, Cctx)`, k's rows first) so the
    /// caller can stack them with other blocks' into one product; from then on the `context` given to
    /// [`Self::forward`] must be that product's `(B, T, Σ)` output, whose `2·inner` columns at `offset` this
    /// block reads. `None` for self-attention (or when already handed over).
    pub fn hand_over_context_kv(&mut self, offset: usize) -> Option<Linear> {
        let Projections::Context { kv, .. } = &mut self.projections else { return None };
        kv.hand_over(offset)
    }

    /// [`Self::forward`] plus `residual` (`(B, S, C)`), added by the output projection.
    pub fn forward_residual(
        &self,
        x: &Tensor,
        context: Option<&Tensor>,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        ops::linear(&self.to_out, &self.attend(x, context)?, residual)
    }

    /// [`Self::forward_residual`] and `norm` of it, the norm fused with the output projection where a kernel can.
    fn forward_then_norm(
        &self,
        x: &Tensor,
        context: Option<&Tensor>,
        residual: &Tensor,
        norm: &LayerNorm,
    ) -> Result<(Tensor, Tensor)> {
        let o = self.attend(x, context)?;
        norm.after_projection(&o, (self.to_out.weight(), self.to_out.bias()), Some(residual))
    }

    /// The heads' attention, merged, before the output projection.
    fn attend(&self, x: &Tensor, context: Option<&Tensor>) -> Result<Tensor> {
        let n = self.inner;
        let (q, kv) = match (&self.projections, context) {
            (Projections::Tokens(qkv), None) => {
                let qkv = ops::linear(qkv, x, None)?;
                (qkv.narrow(D::Minus1, 0, n)?, qkv.narrow(D::Minus1, n, 2 * n)?)
            }
            (Projections::Context { to_q, kv }, Some(context)) => {
                (ops::linear(to_q, x, None)?, kv.apply(context, 2 * n)?)
            }
            (Projections::Tokens(_), Some(_)) => bail!("self-attention takes no context"),
            (Projections::Context { .. }, None) => bail!("cross-attention needs a context"),
        };
        let (k, v) = (kv.narrow(D::Minus1, 0, n)?, kv.narrow(D::Minus1, n, n)?);
        ops::multi_head_attention(&q, &k, &v, self.heads, self.scale, self.upcast)
    }
}

/// `FeedForward` with GEGLU: `net.0.proj` (to 2×inner), gate, `net.2` (back to dim).
#[derive(Debug, Clone)]
struct FeedForward {
    proj_in: FeedForwardIn,
    proj_out: Linear,
}

/// How `net.0.proj` is kept: as loaded, or, where the fused Hopper product with GEGLU takes it
/// (`sdhive_cuda_kernels::geglu_product_on`), only in that kernel's interleaved row order, so that the weights are
/// not held twice.
#[derive(Debug, Clone)]
enum FeedForwardIn {
    Linear(Linear),
    Interleaved { weight: Tensor, bias: Tensor },
}

impl FeedForward {
    fn new(vb: VarBuilder, dim: usize) -> Result<Self> {
        let inner = dim * 4;
        let proj_in = linear(vb.pp("net.0.proj"), dim, inner * 2, true)?;
        let proj_in = match proj_in.bias() {
            Some(bias) if sdhive_cuda_kernels::geglu_product_on(vb.device(), vb.dtype(), dim, inner) => {
                let (weight, bias) = sdhive_cuda_kernels::interleave_geglu(proj_in.weight(), bias)?;
                let rows = proj_in.weight().dim(0)?;
                let interleave: crate::params::Transform = std::sync::Arc::new(move |w: &Tensor| {
                    let zeros = Tensor::zeros(rows, w.dtype(), w.device())?;
                    Ok(sdhive_cuda_kernels::interleave_geglu(w, &zeros)?.0)
                });
                crate::params::mapped(proj_in.weight(), &weight, interleave);
                FeedForwardIn::Interleaved { weight, bias }
            }
            _ => FeedForwardIn::Linear(proj_in),
        };
        Ok(Self { proj_in, proj_out: linear(vb.pp("net.2"), inner, dim, true)? })
    }

    /// `proj_out(geglu(proj_in(x))) + residual`.
    fn forward(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let h = match &self.proj_in {
            FeedForwardIn::Linear(l) => ops::linear_geglu(l, x)?,
            FeedForwardIn::Interleaved { weight, bias } => ops::linear_geglu_interleaved(x, weight, bias)?,
        };
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

    /// `x` and `norm1(x)`, which the caller has (from the projection before the block, where it comes fused).
    /// Each later norm is made with the attention output projection it follows.
    /// A single sample with a context of several (the UNet's guided prefix) becomes the context's batch after
    /// the self-attention, where the samples first differ.
    fn forward(&self, x: &Tensor, normed: &Tensor, context: &Tensor) -> Result<Tensor> {
        let (x, normed) = self.attn1.forward_then_norm(normed, None, x, &self.norm2)?;
        let batch = context.dim(0)?;
        let (x, normed) = (ops::expand_batch(&x, batch)?, ops::expand_batch(&normed, batch)?);
        let (x, normed) = self.attn2.forward_then_norm(&normed, Some(context), &x, &self.norm3)?;
        self.ff.forward(&normed, &x)
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

    /// The blocks' attentions to the context, for stacking their k and v projections.
    pub(crate) fn context_attentions_mut(&mut self) -> impl Iterator<Item = &mut CrossAttention> {
        self.blocks.iter_mut().map(|b| &mut b.attn2)
    }

    /// `x` a map in the network's layout. A single sample `x` with a context of several is shared by all of
    /// them: the blocks run once up to the first attention to the context, and the output has the context's
    /// batch.
    pub fn forward(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        let (w_in, b_in) = self.proj_in.weight_bias();
        let (w_out, b_out) = self.proj_out.weight_bias();
        if self.layout == MapLayout::ChannelsLast {
            // Channels-last maps are the tokens already.
            let (b, h, w, c) = x.dims4()?;
            let normed = self.norm.forward(x)?.reshape((b, h * w, c))?;
            // The first block's norm1 comes with proj_in.
            let mut tokens = match self.blocks.first() {
                Some(first) => {
                    let (tokens, normed) = first.norm1.after_projection(&normed, (w_in, b_in), None)?;
                    first.forward(&tokens, &normed, context)?
                }
                None => ops::project(&normed, w_in, b_in, None)?,
            };
            for block in self.blocks.iter().skip(1) {
                tokens = block.forward(&tokens, &block.norm1.forward(&tokens)?, context)?;
            }
            let batch = tokens.dim(0)?;
            let residual = ops::expand_batch(&x.reshape((b, h * w, c))?, batch)?;
            let out = ops::project(&tokens, w_out, b_out, Some(&residual))?;
            return out.reshape((batch, h, w, c));
        }
        let (_, _, h, w) = x.dims4()?;
        let normed = self.norm.forward(x)?;
        // A 1×1 conv and a linear projection are the same product; only the weight's shape
        // differs, and the kernels read the NCHW ↔ token layouts through strides.
        let mut tokens = ops::image_to_tokens(&normed, w_in, b_in)?;
        for block in &self.blocks {
            tokens = block.forward(&tokens, &block.norm1.forward(&tokens)?, context)?;
        }
        ops::tokens_to_image(&tokens, w_out, b_out, (h, w), Some(&ops::expand_batch(x, tokens.dim(0)?)?))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::stack_linears;
    use crate::loading::random_var_builder;
    use candle_core::{DType, Device};

    fn max_gap(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>()).expect("gap")
    }

    /// A block that handed its k and v over reads them from the columns of a wider table (another block's
    /// before them) and gives what its own projections gave; self-attention's stacked q/k/v gives diffusers'
    /// three products' result, checked against them computed one by one.
    #[test]
    fn handed_over_context_projection_reads_its_columns() {
        let dev = Device::Cpu;
        let vb = random_var_builder(DType::F32, &dev);
        let x = Tensor::randn(0f32, 1.0, (2, 5, 16), &dev).expect("x");
        let ctx = Tensor::randn(0f32, 1.0, (2, 7, 24), &dev).expect("ctx");
        let own = CrossAttention::new(vb.pp("a"), 16, Some(24), 2, 8, false).expect("attention");
        let want = own.forward(&x, Some(&ctx)).expect("own");

        let mut other = CrossAttention::new(vb.pp("b"), 16, Some(24), 2, 8, false).expect("attention");
        let mut tabled = own.clone();
        let first = other.hand_over_context_kv(0).expect("kv of b");
        let offset = first.weight().dim(0).expect("rows");
        let second = tabled.hand_over_context_kv(offset).expect("kv of a");
        assert!(tabled.hand_over_context_kv(0).is_none(), "handed over once");
        let table = ops::linear(&stack_linears(&[first, second]).expect("stack"), &ctx, None).expect("table");
        let got = tabled.forward(&x, Some(&table)).expect("from the table");
        assert!(max_gap(&got, &want) < 1e-5, "{}", max_gap(&got, &want));

        let selfish = CrossAttention::new(vb.pp("s"), 16, None, 2, 8, false).expect("self-attention");
        let part = |n: &str| linear(vb.pp("s").pp(n), 16, 16, false).expect("part");
        let (q, k, v) = (part("to_q"), part("to_k"), part("to_v"));
        let (q, k, v) = (ops::linear(&q, &x, None), ops::linear(&k, &x, None), ops::linear(&v, &x, None));
        let o = ops::multi_head_attention(
            &q.expect("q"),
            &k.expect("k"),
            &v.expect("v"),
            2,
            8f64.powf(-0.5),
            false,
        )
        .expect("attention");
        let want =
            ops::linear(&linear(vb.pp("s").pp("to_out.0"), 16, 16, true).expect("out"), &o, None).expect("o");
        let got = selfish.forward(&x, None).expect("stacked");
        assert!(max_gap(&got, &want) < 1e-5, "{}", max_gap(&got, &want));
        assert!(selfish.forward(&x, Some(&ctx)).is_err(), "self-attention refuses a context");
    }
}
