//! Weight-holding building blocks shared by the networks: norms, convolutions, linears and the
//! diffusers ResNet / down- / up-sampling blocks used by both the UNet and the VAE.

use crate::ops::{self, ConvExtras, MapLayout, PreNorm};
use candle_core::{Result, Tensor};
use candle_nn::{Init, Linear, VarBuilder};
use sdhive_cuda_kernels as gpu;

/// GroupNorm with diffusers' names `weight`/`bias`, over maps in its network's layout.
#[derive(Debug, Clone)]
pub struct GroupNorm {
    weight: Tensor,
    bias: Tensor,
    groups: usize,
    eps: f64,
    layout: MapLayout,
}

impl GroupNorm {
    pub fn new(vb: VarBuilder, groups: usize, channels: usize, eps: f64) -> Result<Self> {
        if groups == 0 || !channels.is_multiple_of(groups) {
            candle_core::bail!("{}: {groups} groups do not divide {channels} channels", vb.prefix());
        }
        Ok(Self {
            weight: vb.get_with_hints(channels, "weight", Init::Const(1.))?,
            bias: vb.get_with_hints(channels, "bias", Init::Const(0.))?,
            groups,
            eps,
            layout: MapLayout::of(&vb),
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::group_norm_map(x, &self.weight, &self.bias, (self.groups, self.eps), false, self.layout)
    }

    /// `silu(self.forward(x))`, fused.
    pub fn forward_silu(&self, x: &Tensor) -> Result<Tensor> {
        ops::group_norm_map(x, &self.weight, &self.bias, (self.groups, self.eps), true, self.layout)
    }

    /// This norm (then SiLU) as a convolution's input stage.
    pub(crate) fn as_pre_norm(&self) -> PreNorm<'_> {
        PreNorm { weight: &self.weight, bias: &self.bias, groups: self.groups, eps: self.eps, shift: None }
    }
}

/// LayerNorm with affine weight and bias.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    pub fn new(vb: VarBuilder, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: vb.get_with_hints(dim, "weight", Init::Const(1.))?,
            bias: vb.get_with_hints(dim, "bias", Init::Const(0.))?,
            eps,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::layer_norm(x, &self.weight, &self.bias, self.eps)
    }

    /// `(h, self.forward(h))` for the projection `h = x·weightᵀ + bias (+ residual)` that feeds this norm (a
    /// linear's or a 1×1 convolution's weight), fused where a GPU kernel has the shape
    /// ([`ops::project_then_norm`]).
    pub fn after_projection(
        &self,
        x: &Tensor,
        projection: (&Tensor, Option<&Tensor>),
        residual: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        ops::project_then_norm(x, projection, residual, (&self.weight, &self.bias, self.eps))
    }
}

pub fn linear(vb: VarBuilder, in_dim: usize, out_dim: usize, bias: bool) -> Result<Linear> {
    if bias {
        candle_nn::linear(in_dim, out_dim, vb)
    } else {
        candle_nn::linear_no_bias(in_dim, out_dim, vb)
    }
}

/// Linears of one input dimension as one, their outputs side by side in the order given (weights stacked along
/// the output dimension): what several products of the same input cost as one. Biases must be all present or all
/// absent. `None` for no linears.
pub fn stack_linears_opt(parts: &[Linear]) -> Result<Option<Linear>> {
    if parts.is_empty() {
        return Ok(None);
    }
    let weights: Vec<&Tensor> = parts.iter().map(Linear::weight).collect();
    let biases: Vec<&Tensor> = parts.iter().filter_map(Linear::bias).collect();
    let bias = match biases.len() {
        0 => None,
        n if n == parts.len() => Some(Tensor::cat(&biases, 0)?),
        _ => candle_core::bail!("stacking linears: {} of {} have a bias", biases.len(), parts.len()),
    };
    let stacked = Tensor::cat(&weights, 0)?;
    crate::params::stacked(&weights, &stacked);
    Ok(Some(Linear::new(stacked, bias)))
}

/// [`stack_linears_opt`] of at least one linear.
pub fn stack_linears(parts: &[Linear]) -> Result<Linear> {
    stack_linears_opt(parts)?.ok_or_else(|| candle_core::Error::Msg("stacking no linears".into()))
}

/// A block's linear of an input many blocks share (the UNet's time embedding, its text context): the block's own,
/// or, once handed over for stacking with the others' ([`stack_linears_opt`]), a column range of the stacked
/// product's output, which the caller then gives the block in place of the input.
#[derive(Debug, Clone)]
pub enum StackableLinear {
    Own(Linear),
    Table { offset: usize },
}

impl StackableLinear {
    /// Gives the linear up for stacking, its outputs to start at column `offset` of the stacked product; `None`
    /// when already handed over.
    pub fn hand_over(&mut self, offset: usize) -> Option<Linear> {
        match std::mem::replace(self, StackableLinear::Table { offset }) {
            StackableLinear::Own(l) => Some(l),
            table => {
                *self = table;
                None
            }
        }
    }

    /// The projection of `input` (`width` outputs): the block's own product, or the `width` columns at its offset
    /// of `input`, then the stacked product's output.
    pub fn apply(&self, input: &Tensor, width: usize) -> Result<Tensor> {
        match self {
            StackableLinear::Own(l) => ops::linear(l, input, None),
            StackableLinear::Table { offset } => input.narrow(candle_core::D::Minus1, *offset, width),
        }
    }
}

/// A biased 2-D convolution (groups and dilation 1) whose filter matches the layout of the maps it reads:
/// `(K, C, R, S)` for NCHW, `(K, R, S, C)` for channels-last.
#[derive(Debug, Clone)]
pub struct Conv2d {
    weight: Tensor,
    bias: Option<Tensor>,
    stride: usize,
    padding: usize,
    layout: MapLayout,
}

impl Conv2d {
    /// From a `(K, C, R, S)` filter, stored for maps in `layout`.
    pub fn new(
        filter: Tensor,
        bias: Option<Tensor>,
        stride: usize,
        padding: usize,
        layout: MapLayout,
    ) -> Result<Self> {
        let weight = match layout {
            MapLayout::ChannelsFirst => filter,
            MapLayout::ChannelsLast => {
                let to_channels_last: crate::params::Transform =
                    std::sync::Arc::new(|f: &Tensor| f.permute((0, 2, 3, 1))?.contiguous());
                let weight = to_channels_last(&filter)?;
                crate::params::mapped(&filter, &weight, to_channels_last);
                weight
            }
        };
        Ok(Self { weight, bias, stride, padding, layout })
    }

    /// The filter as stored: `(K, C, R, S)` or, channels-last, `(K, R, S, C)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    pub fn stride(&self) -> usize {
        self.stride
    }

    pub fn padding(&self) -> usize {
        self.padding
    }

    pub fn layout(&self) -> MapLayout {
        self.layout
    }

    pub fn out_channels(&self) -> usize {
        self.weight.dims().first().copied().unwrap_or(0)
    }

    /// The same convolution over NCHW maps.
    pub fn channels_first(&self) -> Result<Self> {
        let filter = match self.layout {
            MapLayout::ChannelsFirst => self.weight.clone(),
            MapLayout::ChannelsLast => self.weight.permute((0, 3, 1, 2))?.contiguous()?,
        };
        Ok(Self { weight: filter, layout: MapLayout::ChannelsFirst, ..self.clone() })
    }
}

/// A convolution in the layout of the network `vb` builds (see [`MapLayout::of`]).
pub fn conv2d(
    vb: VarBuilder,
    in_c: usize,
    out_c: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
) -> Result<Conv2d> {
    let layout = MapLayout::of(&vb);
    conv2d_in(vb, in_c, out_c, kernel, stride, padding, layout)
}

/// A convolution over NCHW maps whatever the network keeps: the VAE's 1×1 convolutions of the latents outside it.
pub fn conv2d_nchw(
    vb: VarBuilder,
    in_c: usize,
    out_c: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
) -> Result<Conv2d> {
    conv2d_in(vb, in_c, out_c, kernel, stride, padding, MapLayout::ChannelsFirst)
}

/// Which side of its network an [`EdgeConv`] stands on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Edge {
    First,
    Last,
}

/// A network's first or last convolution, between the few (3–9) image or latent channels outside, NCHW, and the
/// network's own layout. Channels-last, the narrow side is padded with zero channels to a multiple of 8 (zero
/// filter columns on the way in; zero filter rows and bias on the way out, dropped again by the transpose to
/// NCHW): cuDNN then runs its NHWC tensor-core kernels with the bias in the epilogue, and only the narrow side is
/// transposed. Given 4 channels it reformats input, filter and output around an older kernel instead: SD1.5's last
/// convolution took 45 µs that way, 11 µs padded (H100).
#[derive(Debug, Clone)]
pub struct EdgeConv {
    conv: Conv2d,
    edge: Edge,
    /// The channels outside: the input's of a first convolution, the output's of a last one.
    outside: usize,
}

impl EdgeConv {
    /// The first convolution of the network `vb` builds: NCHW `in_c` channels in, its layout out.
    pub fn first(vb: VarBuilder, in_c: usize, out_c: usize, kernel: usize, padding: usize) -> Result<Self> {
        Self::new(vb, in_c, out_c, kernel, padding, Edge::First)
    }

    /// The last convolution of the network `vb` builds: its layout in, NCHW `out_c` channels out.
    pub fn last(vb: VarBuilder, in_c: usize, out_c: usize, kernel: usize, padding: usize) -> Result<Self> {
        Self::new(vb, in_c, out_c, kernel, padding, Edge::Last)
    }

    fn new(
        vb: VarBuilder,
        in_c: usize,
        out_c: usize,
        kernel: usize,
        padding: usize,
        edge: Edge,
    ) -> Result<Self> {
        let layout = MapLayout::of(&vb);
        let conv = conv2d_in(vb, in_c, out_c, kernel, 1, padding, MapLayout::ChannelsFirst)?;
        let outside = if edge == Edge::First { in_c } else { out_c };
        if layout == MapLayout::ChannelsFirst {
            return Ok(Self { conv, edge, outside });
        }
        let pad = outside.next_multiple_of(8) - outside;
        let padded_dim = if edge == Edge::First { 1 } else { 0 };
        let pad_filter: crate::params::Transform =
            std::sync::Arc::new(move |f: &Tensor| f.pad_with_zeros(padded_dim, 0, pad));
        let filter = pad_filter(conv.weight())?;
        crate::params::mapped(conv.weight(), &filter, pad_filter);
        let bias = match edge {
            Edge::First => conv.bias().cloned(),
            Edge::Last => conv.bias().map(|b| b.pad_with_zeros(0, 0, pad)).transpose()?,
        };
        let conv = Conv2d::new(filter, bias, 1, padding, layout)?;
        Ok(Self { conv, edge, outside })
    }

    /// A first convolution takes NCHW maps and returns them in the network's layout; a last one the reverse.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(y) = self.on_gpu(x)? {
            return Ok(y);
        }
        let layout = self.conv.layout();
        match self.edge {
            Edge::First => {
                let width = layout.dims(self.conv.weight())?.1;
                ops::conv2d(&self.conv, &layout.from_nchw_padded(x, width)?, ConvExtras::default())
            }
            Edge::Last => {
                let y = ops::conv2d(&self.conv, x, ConvExtras::default())?;
                layout.to_nchw_narrow(&y, self.outside)
            }
        }
    }

    /// Channels-last on the GPU, the convolution and the change of layout in one launch of the edge kernels
    /// (`None` where they do not take the shapes: then the padded convolution and a transpose).
    fn on_gpu(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let (w, Some(b)) = (self.conv.weight(), self.conv.bias()) else { return Ok(None) };
        if self.conv.layout() != MapLayout::ChannelsLast
            || self.conv.stride() != 1
            || self.conv.padding() != 1
        {
            return Ok(None);
        }
        match self.edge {
            Edge::First if gpu::edge_conv_in_applies(x, w, b) => gpu::edge_conv_in(x, w, b).map(Some),
            Edge::Last if gpu::edge_conv_out_applies(x, w, b, self.outside) => {
                gpu::edge_conv_out(x, w, b, self.outside).map(Some)
            }
            _ => Ok(None),
        }
    }
}

fn conv2d_in(
    vb: VarBuilder,
    in_c: usize,
    out_c: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    layout: MapLayout,
) -> Result<Conv2d> {
    // candle_nn's initialisation hints, for builders that create the weights.
    let filter =
        vb.get_with_hints((out_c, in_c, kernel, kernel), "weight", candle_nn::init::DEFAULT_KAIMING_NORMAL)?;
    let bound = 1. / (in_c as f64).sqrt();
    let bias = vb.get_with_hints(out_c, "bias", Init::Uniform { lo: -bound, up: bound })?;
    Conv2d::new(filter, Some(bias), stride, padding, layout)
}

/// diffusers ResnetBlock2D (pre-norm, "default" time-embedding norm, SiLU).
#[derive(Debug, Clone)]
pub struct ResnetBlock2D {
    norm1: GroupNorm,
    conv1: Conv2d,
    time_emb_proj: Option<StackableLinear>,
    norm2: GroupNorm,
    conv2: Conv2d,
    conv_shortcut: Option<Conv2d>,
    output_scale_factor: f64,
}

/// Shape parameters of one [`ResnetBlock2D`].
#[derive(Debug, Clone, Copy)]
pub struct ResnetSpec {
    pub in_channels: usize,
    pub out_channels: usize,
    pub temb_channels: Option<usize>,
    pub groups: usize,
    pub eps: f64,
    pub output_scale_factor: f64,
}

impl ResnetBlock2D {
    pub fn new(vb: VarBuilder, s: ResnetSpec) -> Result<Self> {
        let norm1 = GroupNorm::new(vb.pp("norm1"), s.groups, s.in_channels, s.eps)?;
        let conv1 = conv2d(vb.pp("conv1"), s.in_channels, s.out_channels, 3, 1, 1)?;
        let time_emb_proj = match s.temb_channels {
            Some(t) => Some(StackableLinear::Own(linear(vb.pp("time_emb_proj"), t, s.out_channels, true)?)),
            None => None,
        };
        let norm2 = GroupNorm::new(vb.pp("norm2"), s.groups, s.out_channels, s.eps)?;
        let conv2 = conv2d(vb.pp("conv2"), s.out_channels, s.out_channels, 3, 1, 1)?;
        let conv_shortcut = if s.in_channels != s.out_channels {
            Some(conv2d(vb.pp("conv_shortcut"), s.in_channels, s.out_channels, 1, 1, 0)?)
        } else {
            None
        };
        Ok(Self {
            norm1,
            conv1,
            time_emb_proj,
            norm2,
            conv2,
            conv_shortcut,
            output_scale_factor: s.output_scale_factor,
        })
    }

    /// `temb` is the time embedding `(B, T)` already through SiLU (the UNet activates it once for all its
    /// blocks), or, once the block has handed its projection over, the table of every block's projection of it.
    pub fn forward(&self, x: &Tensor, temb: Option<&Tensor>) -> Result<Tensor> {
        self.forward_owned(x.clone(), temb)
    }

    /// Gives up the time-embedding projection (weight `(C, T)` and bias) so the caller can stack it with other
    /// blocks' into one product; from then on [`Self::forward`] reads its `C` columns at `offset` of the
    /// product's `(B, ΣC)` output instead of projecting. `None` for a block without one (or already handed over).
    pub fn hand_over_time_projection(&mut self, offset: usize) -> Option<Linear> {
        self.time_emb_proj.as_mut()?.hand_over(offset)
    }

    /// [`Self::forward`] taking the input by value, so it is freed as soon as the block no
    /// longer needs it (when the caller holds no other reference): at 256² a VAE input is 67 MB.
    pub fn forward_owned(&self, x: Tensor, temb: Option<&Tensor>) -> Result<Tensor> {
        self.forward_normed(x, None, temb)
    }

    /// [`Self::forward`] of `a` and `b` joined along their channels (an up block's input and its skip state):
    /// channels-last on the GPU the first norm reads both where they lie and writes the join for the shortcut
    /// in the same launch, so no concatenation pass runs before it.
    pub fn forward_joined(
        &self,
        a: &Tensor,
        b: &Tensor,
        layout: MapLayout,
        temb: Option<&Tensor>,
    ) -> Result<Tensor> {
        if let Some((normed, x)) = ops::group_norm_joined(layout, a, b, self.norm1.as_pre_norm())? {
            return self.forward_normed(x, Some(normed), temb);
        }
        self.forward_owned(ops::cat_channels(layout, a, b)?, temb)
    }

    /// The block on input `x`, whose first norm (through SiLU) is `normed` where the caller made it already.
    fn forward_normed(&self, x: Tensor, normed: Option<Tensor>, temb: Option<&Tensor>) -> Result<Tensor> {
        let temb = match (&self.time_emb_proj, temb) {
            (Some(proj), Some(temb)) => Some(proj.apply(temb, self.conv2.out_channels())?),
            _ => None,
        };
        // The time embedding is added to conv1's output: in conv1's epilogue, or while norm2 reads that output
        // (which takes the table's columns in place).
        let (temb1, temb2) = match temb {
            Some(t) if ops::time_embedding_joins_norm(&self.conv2, &x) => (None, Some(t)),
            Some(t) => (Some(t.contiguous()?), None),
            None => (None, None),
        };
        // norm → SiLU → conv run as one op on the CPU: the activated input never exists whole.
        let h = match &normed {
            Some(n) => {
                ops::conv2d(&self.conv1, n, ConvExtras { per_sample: temb1.as_ref(), ..Default::default() })?
            }
            None => ops::conv2d(
                &self.conv1,
                &x,
                ConvExtras {
                    per_sample: temb1.as_ref(),
                    pre_norm: Some(self.norm1.as_pre_norm()),
                    ..Default::default()
                },
            )?,
        };
        let skip = match &self.conv_shortcut {
            Some(c) => ops::conv2d(c, &x, ConvExtras::default())?,
            None => x,
        };
        let out = ops::conv2d(
            &self.conv2,
            &h,
            ConvExtras {
                residual: Some(&skip),
                pre_norm: Some(PreNorm { shift: temb2.as_ref(), ..self.norm2.as_pre_norm() }),
                ..Default::default()
            },
        )?;
        if self.output_scale_factor == 1.0 {
            Ok(out)
        } else {
            out / self.output_scale_factor
        }
    }
}

/// Stride-2 3×3 conv. With `padding == 0` (the VAE encoder) diffusers first pads one zero
/// row/column at the bottom/right only, so the asymmetry is reproduced here.
#[derive(Debug, Clone)]
pub struct Downsample2D {
    conv: Conv2d,
    asymmetric_pad: bool,
}

impl Downsample2D {
    pub fn new(vb: VarBuilder, channels: usize, padding: usize) -> Result<Self> {
        Ok(Self {
            conv: conv2d(vb.pp("conv"), channels, channels, 3, 2, padding)?,
            asymmetric_pad: padding == 0,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.asymmetric_pad {
            let h_dim = match self.conv.layout() {
                MapLayout::ChannelsFirst => 2,
                MapLayout::ChannelsLast => 1,
            };
            let x = x.pad_with_zeros(h_dim + 1, 0, 1)?.pad_with_zeros(h_dim, 0, 1)?;
            ops::conv2d(&self.conv, &x, ConvExtras::default())
        } else {
            ops::conv2d(&self.conv, x, ConvExtras::default())
        }
    }
}

/// Nearest-neighbour ×2 (or to an explicit size for odd resolutions) followed by a 3×3 conv.
#[derive(Debug, Clone)]
pub struct Upsample2D {
    conv: Conv2d,
}

impl Upsample2D {
    pub fn new(vb: VarBuilder, channels: usize) -> Result<Self> {
        Ok(Self { conv: conv2d(vb.pp("conv"), channels, channels, 3, 1, 1)? })
    }

    pub fn forward(&self, x: &Tensor, size: Option<(usize, usize)>) -> Result<Tensor> {
        let layout = self.conv.layout();
        let (_, _, h, w) = layout.dims(x)?;
        let (th, tw) = size.unwrap_or((2 * h, 2 * w));
        if (th, tw) == (2 * h, 2 * w) {
            // On the CPU the convolution reads the input as if upsampled; nothing 4× larger is built.
            return ops::conv2d(&self.conv, x, ConvExtras { upsample: true, ..Default::default() });
        }
        let x = layout.from_nchw(&layout.to_nchw(x)?.upsample_nearest2d(th, tw)?)?;
        ops::conv2d(&self.conv, &x, ConvExtras::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loading::random_var_builder;
    use candle_core::{DType, Device};

    /// A ResNet that handed its time projection over reads its columns of the stacked product (another block's
    /// before them) and gives what its own projection gave; stacking refuses a mix of biased and bias-free parts.
    #[test]
    fn handed_over_time_projection_reads_its_columns() {
        let dev = Device::Cpu;
        let vb = random_var_builder(DType::F32, &dev);
        let spec = |c| ResnetSpec {
            in_channels: 8,
            out_channels: c,
            temb_channels: Some(12),
            groups: 4,
            eps: 1e-5,
            output_scale_factor: 1.0,
        };
        let x = Tensor::randn(0f32, 1.0, (2, 8, 6, 6), &dev).expect("x");
        let temb = Tensor::randn(0f32, 1.0, (2, 12), &dev).expect("temb");
        let own = ResnetBlock2D::new(vb.pp("a"), spec(16)).expect("resnet");
        let want = own.forward(&x, Some(&temb)).expect("own");

        let mut other = ResnetBlock2D::new(vb.pp("b"), spec(8)).expect("resnet");
        let mut tabled = own.clone();
        let first = other.hand_over_time_projection(0).expect("b's projection");
        let second = tabled.hand_over_time_projection(8).expect("a's projection");
        assert!(tabled.hand_over_time_projection(0).is_none(), "handed over once");
        let table =
            ops::linear(&stack_linears(&[first, second.clone()]).expect("stack"), &temb, None).expect("t");
        assert_eq!(table.dims(), &[2, 24]);
        let got = tabled.forward(&x, Some(&table)).expect("from the table");
        let gap = (got - &want).and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>()).expect("gap");
        assert!(gap < 1e-5, "{gap}");

        let bare = Linear::new(second.weight().clone(), None);
        assert!(stack_linears(&[second, bare]).is_err());
        assert!(stack_linears_opt(&[]).expect("none").is_none());
    }
}
