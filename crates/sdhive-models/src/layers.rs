//! Weight-holding building blocks shared by the networks: norms, convolutions, linears and the
//! diffusers ResNet / down- / up-sampling blocks used by both the UNet and the VAE.

use crate::ops::{self, ConvExtras, PreNorm};
use candle_core::{Result, Tensor};
use candle_nn::{Conv2d, Conv2dConfig, Init, Linear, VarBuilder};

/// GroupNorm with diffusers' names `weight`/`bias`.
#[derive(Debug, Clone)]
pub struct GroupNorm {
    weight: Tensor,
    bias: Tensor,
    groups: usize,
    eps: f64,
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
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::group_norm(x, &self.weight, &self.bias, self.groups, self.eps)
    }

    /// `silu(self.forward(x))`, fused.
    pub fn forward_silu(&self, x: &Tensor) -> Result<Tensor> {
        ops::group_norm_silu(x, &self.weight, &self.bias, self.groups, self.eps)
    }

    /// This norm (then SiLU) as a convolution's input stage.
    pub(crate) fn as_pre_norm(&self) -> PreNorm<'_> {
        PreNorm { weight: &self.weight, bias: &self.bias, groups: self.groups, eps: self.eps }
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
}

pub fn linear(vb: VarBuilder, in_dim: usize, out_dim: usize, bias: bool) -> Result<Linear> {
    if bias {
        candle_nn::linear(in_dim, out_dim, vb)
    } else {
        candle_nn::linear_no_bias(in_dim, out_dim, vb)
    }
}

pub fn conv2d(
    vb: VarBuilder,
    in_c: usize,
    out_c: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
) -> Result<Conv2d> {
    let cfg = Conv2dConfig { padding, stride, ..Default::default() };
    candle_nn::conv2d(in_c, out_c, kernel, cfg, vb)
}

/// diffusers ResnetBlock2D (pre-norm, "default" time-embedding norm, SiLU).
#[derive(Debug, Clone)]
pub struct ResnetBlock2D {
    norm1: GroupNorm,
    conv1: Conv2d,
    time_emb_proj: Option<Linear>,
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
            Some(t) => Some(linear(vb.pp("time_emb_proj"), t, s.out_channels, true)?),
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

    /// `temb` is the already-computed time embedding `(B, T)`; the block applies SiLU itself.
    pub fn forward(&self, x: &Tensor, temb: Option<&Tensor>) -> Result<Tensor> {
        self.forward_owned(x.clone(), temb)
    }

    /// [`Self::forward`] taking the input by value, so it is freed as soon as the block no
    /// longer needs it (when the caller holds no other reference): at 256² a VAE input is 67 MB.
    pub fn forward_owned(&self, x: Tensor, temb: Option<&Tensor>) -> Result<Tensor> {
        let temb = match (&self.time_emb_proj, temb) {
            (Some(proj), Some(temb)) => Some(ops::linear(proj, &ops::silu(temb)?, None)?),
            _ => None,
        };
        // norm → SiLU → conv run as one op on the CPU: the activated input never exists whole.
        let h = ops::conv2d(
            &self.conv1,
            &x,
            ConvExtras {
                per_sample: temb.as_ref(),
                pre_norm: Some(self.norm1.as_pre_norm()),
                ..Default::default()
            },
        )?;
        let skip = match &self.conv_shortcut {
            Some(c) => ops::conv2d(c, &x, ConvExtras::default())?,
            None => x,
        };
        let out = ops::conv2d(
            &self.conv2,
            &h,
            ConvExtras {
                residual: Some(&skip),
                pre_norm: Some(self.norm2.as_pre_norm()),
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
            let x = x.pad_with_zeros(3, 0, 1)?.pad_with_zeros(2, 0, 1)?;
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
        let (_, _, h, w) = x.dims4()?;
        let (th, tw) = size.unwrap_or((2 * h, 2 * w));
        if (th, tw) == (2 * h, 2 * w) {
            // The convolution reads the input as if upsampled; nothing 4× larger is built.
            return ops::conv2d(&self.conv, x, ConvExtras { upsample: true, ..Default::default() });
        }
        let x = x.upsample_nearest2d(th, tw)?;
        ops::conv2d(&self.conv, &x, ConvExtras::default())
    }
}
