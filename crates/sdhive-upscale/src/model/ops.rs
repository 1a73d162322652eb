//! The operations both networks are made of, over feature maps in the layout the network was built for
//! (`sdhive_models::ops::MapLayout`): NCHW with candle's convolution on the CPU (and sdhive's kernels for NCHW on a
//! GPU), or, on a CUDA device in f16/bf16 with cuDNN, channels-last maps whose 3×3 convolutions run through cuDNN's
//! NHWC tensor-core kernels with bias and skip in the epilogue, joined, upsampled and converted at the edges by
//! sdhive-cuda-kernels.

use super::file::Weights;
use crate::error::UpscaleError;
use candle_core::{DType, Device, Result, Tensor};
use sdhive_cuda_kernels as gpu;
use sdhive_models::ops::MapLayout;

/// A biased 3×3, stride-1, padding-1 convolution with its filter stored for the network's layout.
#[derive(Debug, Clone)]
pub(crate) struct Conv {
    weight: Tensor,
    bias: Tensor,
    layout: MapLayout,
}

/// How a convolution is stored beyond its file's filter and bias.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Storage {
    /// Zero input channels added up to this many (a channels-last network's first convolution reads its few
    /// image channels padded to whole 16-byte vectors).
    pub in_channels: Option<usize>,
    /// Zero filters (and biases) added up to this many outputs (its last convolution, likewise).
    pub out_channels: Option<usize>,
    /// Filter and bias multiplied by this (a residual scale folded into the convolution).
    pub scale: Option<f64>,
}

/// What building either network from its file shares: the file's weights, and the device and dtype with the map
/// layout these choose.
pub(crate) struct Builder<'a> {
    weights: &'a Weights<'a>,
    device: &'a Device,
    dtype: DType,
    pub layout: MapLayout,
}

impl<'a> Builder<'a> {
    pub fn new(weights: &'a Weights<'a>, device: &'a Device, dtype: DType) -> Self {
        Self { weights, device, dtype, layout: MapLayout::on(device, dtype) }
    }

    pub fn channels_last(&self) -> bool {
        self.layout == MapLayout::ChannelsLast
    }

    /// The channels a map of `channels` holds in this layout: channels-last, padded to whole 16-byte vectors (the
    /// edges' few image channels).
    pub fn width(&self, channels: usize) -> usize {
        if self.channels_last() {
            channels.next_multiple_of(8)
        } else {
            channels
        }
    }

    /// The file's tensor `name` as the network holds it.
    pub fn tensor(&self, name: &str) -> std::result::Result<Tensor, UpscaleError> {
        Ok(self.weights.get(name)?.to_dtype(self.dtype)?.to_device(self.device)?)
    }

    /// The convolution of the file's `{name}.weight` and `{name}.bias`.
    pub fn conv(&self, name: &str, storage: Storage) -> std::result::Result<Conv, UpscaleError> {
        let w = self.weights;
        let (f, b) = (w.get(&format!("{name}.weight"))?, w.get(&format!("{name}.bias"))?);
        Ok(Conv::new(f, b, storage, self.layout, self.device, self.dtype)?)
    }
}

impl Conv {
    /// From a `(K, C, 3, 3)` filter and `(K)` bias (f32, on the CPU), placed on `device` in `dtype`.
    pub fn new(
        filter: Tensor,
        bias: Tensor,
        storage: Storage,
        layout: MapLayout,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        let (k, c, _, _) = filter.dims4()?;
        let (mut filter, mut bias) = (filter, bias);
        if let Some(s) = storage.scale {
            filter = filter.affine(s, 0.0)?;
            bias = bias.affine(s, 0.0)?;
        }
        if let Some(n) = storage.in_channels.filter(|&n| n > c) {
            filter = filter.pad_with_zeros(1, 0, n - c)?;
        }
        if let Some(n) = storage.out_channels.filter(|&n| n > k) {
            filter = filter.pad_with_zeros(0, 0, n - k)?;
            bias = bias.pad_with_zeros(0, 0, n - k)?;
        }
        if layout == MapLayout::ChannelsLast {
            filter = filter.permute((0, 2, 3, 1))?.contiguous()?;
        }
        Ok(Self {
            weight: filter.to_dtype(dtype)?.to_device(device)?,
            bias: bias.to_dtype(dtype)?.to_device(device)?,
            layout,
        })
    }

    fn out_channels(&self) -> usize {
        self.weight.dims().first().copied().unwrap_or(0)
    }

    /// `conv(x) + bias (+ skip)`, `x` and `skip` in the convolution's layout.
    pub fn forward(&self, x: &Tensor, skip: Option<&Tensor>) -> Result<Tensor> {
        let k = self.out_channels();
        match self.layout {
            MapLayout::ChannelsLast
                if gpu::channels_last_fits(x) && skip.is_none_or(gpu::channels_last_fits) =>
            {
                gpu::conv2d_channels_last_epilogue(x, &self.weight, 1, 1, &self.bias, skip)
            }
            MapLayout::ChannelsLast => {
                // Maps the kernels do not take (not contiguous): through NCHW with candle's convolution.
                let layout = MapLayout::ChannelsLast;
                let w = self.weight.permute((0, 3, 1, 2))?.contiguous()?;
                let y = layout.to_nchw(x)?.conv2d(&w, 1, 1, 1, 1)?;
                let y = y.broadcast_add(&self.bias.reshape((1, k, 1, 1))?)?;
                let y = match skip {
                    Some(s) => (y + layout.to_nchw(s)?)?,
                    None => y,
                };
                layout.from_nchw(&y)
            }
            MapLayout::ChannelsFirst if gpu::applies(&[x, &self.weight, &self.bias]) => {
                let y = gpu::conv2d(x, &self.weight, 1, 1)?;
                match skip {
                    Some(s) if !s.is_contiguous() => {
                        gpu::add_channel(&y, &self.bias.reshape((1, k))?, None)? + s
                    }
                    _ => gpu::add_channel(&y, &self.bias.reshape((1, k))?, skip),
                }
            }
            MapLayout::ChannelsFirst => {
                let y =
                    x.conv2d(&self.weight, 1, 1, 1, 1)?.broadcast_add(&self.bias.reshape((1, k, 1, 1))?)?;
                match skip {
                    Some(s) => y + s,
                    None => Ok(y),
                }
            }
        }
    }
}

/// The most pixels one launch of sdhive's channels-last → NCHW transpose takes (its grid spans the pixels in
/// blocks of 32 along a dimension of at most 65 535 blocks).
const TRANSPOSE_MAX_PIXELS: usize = 65_535 * 32;

/// The first `channels` channels of a map in `layout` as NCHW (a network's last convolution's padded output),
/// in bands of rows where the map is larger than one transpose launch takes (a 2048² output is 4 M pixels).
pub(crate) fn to_nchw_narrow(layout: MapLayout, y: &Tensor, channels: usize) -> Result<Tensor> {
    let (_, _, h, w) = layout.dims(y)?;
    if layout == MapLayout::ChannelsFirst || h * w <= TRANSPOSE_MAX_PIXELS || w > TRANSPOSE_MAX_PIXELS {
        return layout.to_nchw_narrow(y, channels);
    }
    let rows = TRANSPOSE_MAX_PIXELS / w;
    let bands = (0..h)
        .step_by(rows)
        .map(|top| layout.to_nchw_narrow(&y.narrow(1, top, rows.min(h - top))?, channels))
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&bands, 2)
}

/// `LeakyReLU(0.2)`: one pass of sdhive-cuda-kernels' kernel on a GPU; elsewhere `max(x, 0.2·x)`, which equals
/// `x` for `x ≥ 0` and `0.2·x` below, bit for bit.
pub(crate) fn leaky_relu(x: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if gpu::vector_rows_apply(&[x]) {
        return gpu::leaky_relu(x);
    }
    x.maximum(&x.affine(0.2, 0.0)?)
}

/// `torch.cat((a, leaky_relu(b)), dim=channels)`: a dense block's features joined with its newest, activated. On a
/// GPU, channels-last, one pass writes the join (the activation is never stored on its own).
pub(crate) fn cat_leaky_relu(a: &Tensor, b: &Tensor, layout: MapLayout) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if layout == MapLayout::ChannelsLast && gpu::vector_rows_apply(&[a, b]) {
        return gpu::cat_leaky_relu(a, b);
    }
    cat(a, &leaky_relu(b)?, layout)
}

/// `a · s + b` (a residual scaled into its skip): one pass on a GPU; elsewhere PyTorch's two operations.
pub(crate) fn scale_add(a: &Tensor, s: f64, b: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if gpu::vector_rows_apply(&[a, b]) && a.dims() == b.dims() {
        return gpu::scale_add(a, s, b);
    }
    a.affine(s, 0.0)? + b
}

/// PReLU with one slope per channel: `relu(x) + w·(x − relu(x))` (the second term is exactly `min(x, 0)·w`).
pub(crate) fn prelu(x: &Tensor, slope: &Tensor, layout: MapLayout) -> Result<Tensor> {
    let c = slope.elem_count();
    let slope = match layout {
        MapLayout::ChannelsFirst => slope.reshape((1, c, 1, 1))?,
        MapLayout::ChannelsLast => slope.reshape((1, 1, 1, c))?,
    };
    let r = x.relu()?;
    r.clone() + (x - &r)?.broadcast_mul(&slope)?
}

/// `torch.cat((a, b), dim=channels)`.
pub(crate) fn cat(a: &Tensor, b: &Tensor, layout: MapLayout) -> Result<Tensor> {
    if layout == MapLayout::ChannelsLast && gpu::channels_last_fits(a) && gpu::channels_last_fits(b) {
        return gpu::concat_channels_last(a, b);
    }
    Tensor::cat(&[a, b], layout.channel_dim())
}

/// Nearest-neighbour ×2 (`nn.Upsample(scale_factor=2)`, `F.interpolate(…, mode="nearest")`).
pub(crate) fn upsample2x(x: &Tensor, layout: MapLayout) -> Result<Tensor> {
    match layout {
        MapLayout::ChannelsLast if gpu::channels_last_fits(x) => gpu::upsample2x_channels_last(x),
        _ => {
            let nchw = layout.to_nchw(x)?;
            let (_, _, h, w) = nchw.dims4()?;
            layout.from_nchw(&nchw.upsample_nearest2d(2 * h, 2 * w)?)
        }
    }
}

/// `torch.pixel_unshuffle(x, r)` of NCHW `x`: channel `c·r² + i·r + j` holds the pixels at offset `(i, j)` of each
/// `r`×`r` cell of channel `c`.
pub(crate) fn pixel_unshuffle(x: &Tensor, r: usize) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    x.reshape(vec![b, c, h / r, r, w / r, r])?.permute(vec![0, 1, 3, 5, 2, 4])?.contiguous()?.reshape((
        b,
        c * r * r,
        h / r,
        w / r,
    ))
}

/// `nn.PixelShuffle(r)` of NCHW `x`, the inverse of [`pixel_unshuffle`].
pub(crate) fn pixel_shuffle(x: &Tensor, r: usize) -> Result<Tensor> {
    let (b, crr, h, w) = x.dims4()?;
    let c = crr / (r * r);
    x.reshape(vec![b, c, r, r, h, w])?.permute(vec![0, 1, 4, 2, 5, 3])?.contiguous()?.reshape((
        b,
        c,
        h * r,
        w * r,
    ))
}

/// `F.pad(x, (0, pad_w, 0, pad_h), mode="reflect")` of NCHW `x`: the last rows and columns mirrored past the
/// bottom and right edges (the edge itself not repeated). `pad` must be smaller than the side.
pub(crate) fn reflect_pad(x: &Tensor, pad_h: usize, pad_w: usize) -> Result<Tensor> {
    let mirror = |x: &Tensor, dim: usize, pad: usize| -> Result<Tensor> {
        if pad == 0 {
            return Ok(x.clone());
        }
        let n = x.dim(dim)?;
        let idx: Vec<u32> = (0..n).chain((0..pad).map(|i| n - 2 - i)).map(|i| i as u32).collect();
        let idx = Tensor::new(idx, x.device())?;
        x.index_select(&idx, dim)
    };
    mirror(&mirror(x, 2, pad_h)?, 3, pad_w)
}
