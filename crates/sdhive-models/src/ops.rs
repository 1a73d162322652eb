//! The hot tensor operations of all three networks (convolution, linears, attention,
//! normalisation, gated activations), each behind one small function: f32 on the CPU goes to the
//! fused kernels of `crate::cpu`, contiguous tensors on a CUDA GPU to the fused kernels of
//! `sdhive_cuda_kernels` (built with the `cuda` feature), everything else to candle's generic ops, kept
//! here as the reference both sets of kernels are tested against. Also the layout a network keeps its
//! feature maps in ([`MapLayout`]).

use crate::cpu;
use crate::layers::Conv2d;
use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::Linear;
use sdhive_cuda_kernels::{self as gpu, Side};

/// How a network keeps its 4-D feature maps: NCHW, or channels-last NHWC where cuDNN's tensor-core convolutions
/// run without transposing (a CUDA device in f16/bf16 with cuDNN; see `sdhive_cuda_kernels::channels_last_on`).
/// Chosen when the network is built, from its device and dtype, and kept: its filters are stored to match.
/// Networks take and return NCHW whatever they keep inside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapLayout {
    ChannelsFirst,
    ChannelsLast,
}

impl MapLayout {
    /// The layout for a network built on `device` in `dtype`.
    pub fn on(device: &Device, dtype: DType) -> Self {
        if gpu::channels_last_on(device, dtype) {
            MapLayout::ChannelsLast
        } else {
            MapLayout::ChannelsFirst
        }
    }

    /// The layout for a network built from `vb`.
    pub fn of(vb: &candle_nn::VarBuilder) -> Self {
        Self::on(vb.device(), vb.dtype())
    }

    /// The dimension of a 4-D map that holds its channels.
    pub fn channel_dim(self) -> usize {
        match self {
            MapLayout::ChannelsFirst => 1,
            MapLayout::ChannelsLast => 3,
        }
    }

    /// `(batch, channels, height, width)` of a 4-D map.
    pub fn dims(self, x: &Tensor) -> Result<(usize, usize, usize, usize)> {
        let (a, b, c, d) = x.dims4()?;
        Ok(match self {
            MapLayout::ChannelsFirst => (a, b, c, d),
            MapLayout::ChannelsLast => (a, d, b, c),
        })
    }

    /// An NCHW map in this layout.
    pub fn from_nchw(self, x: &Tensor) -> Result<Tensor> {
        match self {
            MapLayout::ChannelsFirst => Ok(x.clone()),
            MapLayout::ChannelsLast => {
                let (b, c, h, w) = x.dims4()?;
                if gpu::applies(&[x]) {
                    // candle's strided copy is several times slower for this permutation.
                    return gpu::transpose_last2(&x.reshape((b, c, h * w))?)?.reshape((b, h, w, c));
                }
                x.permute((0, 2, 3, 1))?.contiguous()
            }
        }
    }

    /// A map in this layout as NCHW.
    pub fn to_nchw(self, x: &Tensor) -> Result<Tensor> {
        match self {
            MapLayout::ChannelsFirst => Ok(x.clone()),
            MapLayout::ChannelsLast => {
                let (b, h, w, c) = x.dims4()?;
                if gpu::applies(&[x]) {
                    return gpu::transpose_last2(&x.reshape((b, h * w, c))?)?.reshape((b, c, h, w));
                }
                x.permute((0, 3, 1, 2))?.contiguous()
            }
        }
    }

    /// An NCHW map in this layout with its channels padded with zeros to `width`.
    pub fn from_nchw_padded(self, x: &Tensor, width: usize) -> Result<Tensor> {
        let (b, c, h, w) = x.dims4()?;
        if c == width {
            return self.from_nchw(x);
        }
        if self == MapLayout::ChannelsLast && gpu::applies(&[x]) {
            return gpu::transpose_last2_padded(&x.reshape((b, c, h * w))?, width)?.reshape((b, h, w, width));
        }
        self.from_nchw(&x.pad_with_zeros(1, 0, width.saturating_sub(c))?)
    }

    /// The first `channels` channels of a map in this layout, as NCHW.
    pub fn to_nchw_narrow(self, x: &Tensor, channels: usize) -> Result<Tensor> {
        let (b, c, h, w) = self.dims(x)?;
        if c == channels {
            return self.to_nchw(x);
        }
        if self == MapLayout::ChannelsLast && gpu::applies(&[x]) {
            return gpu::transpose_last2_narrow(&x.reshape((b, h * w, c))?, channels)?
                .reshape((b, channels, h, w));
        }
        self.to_nchw(x)?.narrow(1, 0, channels)?.contiguous()
    }
}

/// Above this many attention-score elements per call we split the queries into chunks, so a
/// large VAE attention (one head over every pixel) does not need gigabytes of scores at once.
pub const MAX_SCORE_ELEMENTS: usize = 1 << 27;

thread_local! {
    /// The chunk limit in force on this thread. A memory plan lowers it for one job (attention slicing); it is
    /// per thread because a worker runs each job on its engine thread, and tests run side by side.
    static SCORE_LIMIT: std::cell::Cell<usize> = const { std::cell::Cell::new(MAX_SCORE_ELEMENTS) };
}

/// Restores the previous attention-score limit when dropped.
pub struct ScoreLimitGuard(usize);

impl Drop for ScoreLimitGuard {
    fn drop(&mut self) {
        SCORE_LIMIT.with(|l| l.set(self.0));
    }
}

/// The attention-score chunk limit in force on this thread.
pub(crate) fn attention_score_limit() -> usize {
    SCORE_LIMIT.with(std::cell::Cell::get)
}

/// Caps the attention scores materialised at once on this thread at `max_elements` until the guard drops
/// (attention slicing: more, smaller score matrices; the result is the same).
pub fn limit_attention_scores(max_elements: usize) -> ScoreLimitGuard {
    ScoreLimitGuard(SCORE_LIMIT.with(|l| l.replace(max_elements.max(1))))
}

/// `softmax(q kᵀ · scale + mask) v` over already-split heads.
///
/// `q` is `(N, Sq, D)`, `k` is `(N, Sk, D)`, `v` is `(N, Sk, Dv)` with `N = batch * heads`;
/// `mask` is additive and broadcastable to `(N, Sq, Sk)`. With `upcast` the scores and softmax
/// run in f32 whatever the input dtype (diffusers' `upcast_attention` for SD2.x in f16).
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
    upcast: bool,
) -> Result<Tensor> {
    if mask.is_none() && cpu::applies(&[q, k, v]) {
        // Each of the N = batch·heads rows is one single-head problem.
        return cpu::attention(q, k, v, 1, scale);
    }
    let (n, sq, _) = q.dims3()?;
    let sk = k.dim(1)?;
    let per_query = n * sk;
    let limit = SCORE_LIMIT.with(std::cell::Cell::get);
    if per_query * sq <= limit || sq <= 1 {
        return attention_block(q, k, v, scale, mask, upcast);
    }
    let chunk = (limit / per_query).max(1);
    let mut outs = Vec::with_capacity(sq.div_ceil(chunk));
    let mut start = 0;
    while start < sq {
        let len = chunk.min(sq - start);
        let qc = q.narrow(1, start, len)?;
        let mc = match mask {
            Some(m) if m.rank() >= 2 && m.dim(D::Minus2)? == sq => {
                Some(m.narrow(m.rank() - 2, start, len)?)
            }
            Some(m) => Some(m.clone()),
            None => None,
        };
        outs.push(attention_block(&qc, k, v, scale, mc.as_ref(), upcast)?);
        start += len;
    }
    Tensor::cat(&outs, 1)
}

fn attention_block(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
    upcast: bool,
) -> Result<Tensor> {
    let in_dtype = q.dtype();
    let work_dtype = if upcast { DType::F32 } else { in_dtype };
    let scores = if upcast && matches!(in_dtype, DType::F16 | DType::BF16) && gpu::applies(&[q, k]) {
        // Half operands, f32 sums and scores: what converting them to f32 first computes, on tensor cores.
        gpu::attention_scores(q, k, scale)?
    } else {
        // Scaling q rather than the scores touches Sq·D values instead of Sq·Sk, and keeps half-precision scores
        // from overflowing before the scale (the usual 1/√64 is a power of two, so this is exact there).
        let q = (q.to_dtype(work_dtype)? * scale)?;
        let k = k.to_dtype(work_dtype)?;
        q.matmul(&k.t()?)?
    };
    let scores = match mask {
        Some(m) => scores.broadcast_add(&m.to_dtype(work_dtype)?)?,
        None => scores,
    };
    let probs = if gpu::applies(&[&scores]) {
        gpu::softmax_last_dim(&scores)?
    } else {
        candle_nn::ops::softmax_last_dim(&scores)?
    };
    let probs = probs.to_dtype(v.dtype())?;
    probs.matmul(v)
}

pub use gpu::{tf32_convolutions, Tf32Guard};

/// Whether [`multi_head_attention`] on `device` in `dtype` runs the fused kernel, which holds no score matrix
/// (what a memory estimate needs to know).
pub fn attention_is_fused(device: &candle_core::Device, dtype: DType) -> bool {
    gpu::attention_fused_on(device, dtype)
}

/// Whether [`fused_rms_norm`] takes `x` and its per-head `weight` (on a GPU the kernels run on).
pub fn fused_rms_norm_applies(x: &Tensor, weight: &Tensor) -> bool {
    gpu::applies_any_layout(&[x, weight]) && weight.is_contiguous() && gpu::rms_norm_takes(x, weight)
}

/// An MMDiT attention's joint sequence: per sample the rows of `a` then those of `b`, each head RMS-normalised by
/// `norms.0` in `a`'s rows and `norms.1` in `b`'s when given, in one kernel where the kernels take the tensors;
/// `None` otherwise (the caller composes it).
pub fn fused_joint_rows(
    a: &Tensor,
    b: &Tensor,
    norms: Option<(&Tensor, &Tensor)>,
    head_dim: usize,
    eps: f64,
) -> Result<Option<Tensor>> {
    let mut tensors = vec![a, b];
    if let Some((wa, wb)) = norms {
        tensors.extend([wa, wb]);
    }
    // The kernel reads strided rows (column ranges of stacked projections) and says itself what it takes.
    if !gpu::applies_any_layout(&tensors) {
        return Ok(None);
    }
    gpu::joint_rows(a, b, norms, head_dim, eps)
}

/// RMSNorm of every `weight`-wide row of `x` (each attention head), statistics in f32, in one kernel.
pub fn fused_rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    gpu::rms_norm(x, weight, eps)
}

/// An adaptive norm's `layer_norm(x) · (1 + scale) + shift` for `(B, S, D)` `x` and `(B, D)` rows in one kernel
/// pass, where the kernels take the tensors; `None` otherwise (the caller composes it).
pub fn fused_modulated_layer_norm(
    x: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
    eps: f64,
) -> Result<Option<Tensor>> {
    if x.rank() != 3 || !gpu::applies(&[x]) {
        return Ok(None);
    }
    let (Some(shift), Some(scale)) = (modulation_rows(shift, x)?, modulation_rows(scale, x)?) else {
        return Ok(None);
    };
    gpu::modulated_layer_norm(x, &shift, &scale, eps).map(Some)
}

/// A `(B, D)` row of an adaptive norm's modulation for the kernels beside `x`: a chunk of the modulation table as it
/// is (its rows are contiguous, only further apart: the kernels read it in place), anything else made contiguous;
/// `None` when it is not on `x`'s device in `x`'s dtype.
fn modulation_rows(t: &Tensor, x: &Tensor) -> Result<Option<Tensor>> {
    if t.dtype() != x.dtype() || !t.device().same_device(x.device()) {
        return Ok(None);
    }
    match t.stride() {
        [_, 1] => Ok(Some(t.clone())),
        _ => t.contiguous().map(Some),
    }
}

/// `x + gate · y` for `(B, S, D)` `x`, `y` and a `(B, D)` gate in one kernel pass, where the kernels take the
/// tensors; `None` otherwise.
pub fn fused_gated_add(x: &Tensor, gate: &Tensor, y: &Tensor) -> Result<Option<Tensor>> {
    if x.rank() != 3 || !gpu::applies(&[x, y]) {
        return Ok(None);
    }
    let Some(gate) = modulation_rows(gate, x)? else { return Ok(None) };
    gpu::gated_add(x, &gate, y).map(Some)
}

/// `(B, S, H·D)` → `(B·H, S, D)`, contiguous so the batched matmuls need no copies.
pub fn split_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, s, hd) = x.dims3()?;
    x.reshape((b, s, heads, hd / heads))?.transpose(1, 2)?.contiguous()?.reshape((b * heads, s, hd / heads))
}

/// `(B·H, S, D)` → `(B, S, H·D)`.
pub fn merge_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (bh, s, d) = x.dims3()?;
    x.reshape((bh / heads, heads, s, d))?.transpose(1, 2)?.contiguous()?.reshape((bh / heads, s, heads * d))
}

/// Multi-head attention on the projections' `(B, S, H·D)` layout, returning `(B, Sq, H·Dv)`:
/// the split into heads, `softmax(q kᵀ · scale) v` and the merge back.
pub fn multi_head_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    scale: f64,
    upcast: bool,
) -> Result<Tensor> {
    if cpu::applies(&[q, k, v]) {
        return cpu::attention(q, k, v, heads, scale);
    }
    // The fused kernel keeps scores and softmax in f32, which is what `upcast` asks for.
    if gpu::attention_applies(q, k, v, heads) {
        return gpu::attention(q, k, v, heads, scale);
    }
    let o = attention(
        &split_heads(q, heads)?,
        &split_heads(k, heads)?,
        &split_heads(v, heads)?,
        scale,
        None,
        upcast,
    )?;
    merge_heads(&o, heads)
}

/// GroupNorm (then SiLU with `silu`) of a 4-D map in `layout`.
pub fn group_norm_map(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    (groups, eps): (usize, f64),
    silu: bool,
    layout: MapLayout,
) -> Result<Tensor> {
    match layout {
        MapLayout::ChannelsFirst if silu => group_norm_silu(x, weight, bias, groups, eps),
        MapLayout::ChannelsFirst => group_norm(x, weight, bias, groups, eps),
        MapLayout::ChannelsLast => {
            if gpu::channels_last_fits(x) && gpu::applies(&[x, weight, bias]) {
                return gpu::group_norm_channels_last(x, None, weight, bias, groups, eps, silu);
            }
            let nchw = group_norm_map(
                &layout.to_nchw(x)?,
                weight,
                bias,
                (groups, eps),
                silu,
                MapLayout::ChannelsFirst,
            )?;
            layout.from_nchw(&nchw)
        }
    }
}

/// GroupNorm over `(B, C, …)` with per-channel affine; statistics in f32 for half inputs.
pub fn group_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, groups: usize, eps: f64) -> Result<Tensor> {
    if cpu::applies(&[x, weight, bias]) {
        return cpu::group_norm(x, weight, bias, groups, eps, false);
    }
    if gpu::applies(&[x, weight, bias]) {
        return gpu::group_norm(x, weight, bias, groups, eps, false);
    }
    group_norm_reference(x, weight, bias, groups, eps)
}

/// `silu(group_norm(x))`, the pre-activation of every ResNet block, in one pass on the CPU.
pub fn group_norm_silu(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
) -> Result<Tensor> {
    if cpu::applies(&[x, weight, bias]) {
        return cpu::group_norm(x, weight, bias, groups, eps, true);
    }
    if gpu::applies(&[x, weight, bias]) {
        return gpu::group_norm(x, weight, bias, groups, eps, true);
    }
    group_norm_reference(x, weight, bias, groups, eps)?.silu()
}

pub(crate) fn group_norm_reference(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    if dims.len() < 3 {
        candle_core::bail!("group_norm expects a (B, C, ...) tensor, got {:?}", dims);
    }
    let (b, c) = (dims[0], dims[1]);
    let group_size = dims[2..].iter().product::<usize>() * c / groups;
    let in_dtype = x.dtype();
    let work = match in_dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    };
    let xg = x.to_dtype(work)?.reshape((b, groups, group_size))?;
    let mean = (xg.sum_keepdim(2)? / group_size as f64)?;
    let centered = xg.broadcast_sub(&mean)?;
    let var = (centered.sqr()?.sum_keepdim(2)? / group_size as f64)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    let mut wshape = vec![1usize; dims.len()];
    wshape[1] = c;
    normed
        .to_dtype(in_dtype)?
        .reshape(dims)?
        .broadcast_mul(&weight.reshape(wshape.clone())?)?
        .broadcast_add(&bias.reshape(wshape)?)
}

/// `torch.cat([a, b], dim=channels)` of two 4-D maps in `layout`: channels-last maps on the GPU join in one
/// launch (candle's cat copies each input in a strided pass of its own; the kernel checks the other dimensions).
pub fn cat_channels(layout: MapLayout, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if layout == MapLayout::ChannelsLast && gpu::channels_last_fits(a) && gpu::channels_last_fits(b) {
        return gpu::concat_channels_last(a, b);
    }
    Tensor::cat(&[a, b], layout.channel_dim())
}

/// `silu(group_norm(cat(a, b)))` and `cat(a, b)` (channels joined), channels-last on the GPU, in one launch that
/// reads `a` and `b` where they lie; `None` where the kernels do not take them (the caller joins and normalises).
pub(crate) fn group_norm_joined(
    layout: MapLayout,
    a: &Tensor,
    b: &Tensor,
    norm: PreNorm,
) -> Result<Option<(Tensor, Tensor)>> {
    let takes = layout == MapLayout::ChannelsLast
        && norm.shift.is_none()
        && gpu::applies(&[a, b, norm.weight, norm.bias])
        && gpu::group_norm_joined_applies(a, b);
    if !takes {
        return Ok(None);
    }
    gpu::group_norm_channels_last_joined(a, b, norm.weight, norm.bias, norm.groups, norm.eps, true).map(Some)
}

/// `x`'s samples repeated whole to `batch` samples (`[x…, x…]`; `x` already at `batch` comes back as is): states
/// the two halves of a guided batch share until they first differ (the UNet's guided prefix), made once and then
/// copied.
pub fn expand_batch(x: &Tensor, batch: usize) -> Result<Tensor> {
    let b = x.dim(0)?;
    if b == batch {
        return Ok(x.clone());
    }
    if b == 0 || !batch.is_multiple_of(b) {
        candle_core::bail!("cannot expand a batch of {b} to {batch}: it must be whole copies of the batch");
    }
    if gpu::repeat_fits(x) {
        return gpu::repeat_batch(x, batch);
    }
    Tensor::cat(&vec![x; batch / b], 0)
}

/// LayerNorm over the last dimension, two-pass in f32: candle's fused kernel uses
/// `E[x²] − E[x]²`, which cancels badly on CLIP's large-magnitude outlier channels.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if cpu::applies(&[x, weight, bias]) {
        return cpu::layer_norm(x, weight, bias, eps);
    }
    if gpu::applies(&[x, weight, bias]) {
        return gpu::layer_norm(x, weight, bias, eps);
    }
    layer_norm_reference(x, weight, bias, eps)
}

pub(crate) fn layer_norm_reference(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let in_dtype = x.dtype();
    let n = x.dim(D::Minus1)? as f64;
    let xf = x.to_dtype(DType::F32)?;
    let mean = (xf.sum_keepdim(D::Minus1)? / n)?;
    let centered = xf.broadcast_sub(&mean)?;
    let var = (centered.sqr()?.sum_keepdim(D::Minus1)? / n)?;
    centered
        .broadcast_div(&(var + eps)?.sqrt()?)?
        .to_dtype(in_dtype)?
        .broadcast_mul(weight)?
        .broadcast_add(bias)
}

pub fn silu(x: &Tensor) -> Result<Tensor> {
    if cpu::applies(&[x]) {
        return cpu::silu(x);
    }
    x.silu()
}

/// diffusers' GEGLU: the projection's first half gated by the exact (erf) GELU of its second.
pub fn geglu(x: &Tensor) -> Result<Tensor> {
    if cpu::applies(&[x]) {
        return cpu::geglu(x);
    }
    if gpu::applies(&[x]) {
        return gpu::geglu(x);
    }
    geglu_reference(x)
}

pub(crate) fn geglu_reference(x: &Tensor) -> Result<Tensor> {
    let last = x.dim(D::Minus1)?;
    let half = last / 2;
    let hidden = x.narrow(D::Minus1, 0, half)?;
    let gate = x.narrow(D::Minus1, half, half)?;
    hidden.mul(&gate.gelu_erf()?)
}

/// What a convolution adds to its output besides its bias; on the CPU these cost no extra pass.
#[derive(Default, Clone, Copy)]
pub(crate) struct ConvExtras<'a> {
    /// `(B, Cout)`, added to every pixel of that sample's channel (the ResNet time embedding).
    pub per_sample: Option<&'a Tensor>,
    /// `(B, Cout, Ho, Wo)`, added element-wise (a skip connection).
    pub residual: Option<&'a Tensor>,
    /// Convolve the input nearest-neighbour upsampled ×2 (diffusers' `Upsample2D`).
    pub upsample: bool,
    /// Convolve `silu(group_norm(x))` instead of `x` (the ResNet block's pre-activation); on
    /// the CPU the normalised input is never materialised.
    pub pre_norm: Option<PreNorm<'a>>,
}

/// The group norm whose output, through SiLU, a convolution reads.
#[derive(Clone, Copy)]
pub(crate) struct PreNorm<'a> {
    pub weight: &'a Tensor,
    pub bias: &'a Tensor,
    pub groups: usize,
    pub eps: f64,
    /// `(B, Cin)`, added to the input before it is normalised: the time embedding of the ResNet convolution
    /// before this norm, where [`time_embedding_joins_norm`] says so.
    pub shift: Option<&'a Tensor>,
}

/// Whether a ResNet should hand its time embedding to the norm before `conv` (the block's second convolution;
/// `x`, the block's input, stands for the maps that norm reads: same device, type and layout) instead of adding
/// it after its first one: on the channels-last GPU path the norm adds it while reading, so neither convolution
/// needs an add pass (the first adds only its bias, in cuDNN's epilogue). Elsewhere the first convolution's
/// epilogue adds it for free.
pub(crate) fn time_embedding_joins_norm(conv: &Conv2d, x: &Tensor) -> bool {
    conv.layout() == MapLayout::ChannelsLast && gpu::channels_last_fits(x)
}

/// NCHW `x` with its norm's shift added (a `(B, C)` term over every pixel), for the paths whose norm cannot take
/// one.
fn shift_input<'a>(x: &Tensor, extras: ConvExtras<'a>) -> Result<(Tensor, ConvExtras<'a>)> {
    match extras.pre_norm {
        Some(p @ PreNorm { shift: Some(shift), .. }) => {
            let (b, c) = shift.dims2()?;
            let x = x.broadcast_add(&shift.reshape((b, c, 1, 1))?)?;
            Ok((x, ConvExtras { pre_norm: Some(PreNorm { shift: None, ..p }), ..extras }))
        }
        _ => Ok((x.clone(), extras)),
    }
}

/// `conv(x) + extras`, `x` in the convolution's layout.
pub(crate) fn conv2d(conv: &Conv2d, x: &Tensor, extras: ConvExtras) -> Result<Tensor> {
    if conv.layout() == MapLayout::ChannelsLast {
        return conv2d_channels_last(conv, x, extras);
    }
    let (x, extras) = shift_input(x, extras)?;
    let x = &x;
    let tensors = conv_tensors(conv, x, &extras);
    if cpu::applies(&tensors) {
        return cpu::conv2d(x, conv.weight(), conv.bias(), conv.stride(), conv.padding(), extras);
    }
    if gpu::applies(&tensors) {
        return conv2d_gpu(conv, x, extras);
    }
    conv2d_reference(conv, x, extras)
}

/// The operands a convolution's kernels read whole (contiguous). Not the norm's shift: the NCHW paths add it to
/// the input first ([`shift_input`]), and the channels-last GroupNorm reads it in place, strided rows included
/// (the UNet hands its ResNets columns of one table).
fn conv_tensors<'a>(conv: &'a Conv2d, x: &'a Tensor, extras: &ConvExtras<'a>) -> Vec<&'a Tensor> {
    let mut tensors = vec![x, conv.weight()];
    tensors.extend(conv.bias());
    tensors.extend(extras.per_sample);
    tensors.extend(extras.residual);
    if let Some(p) = &extras.pre_norm {
        tensors.extend([p.weight, p.bias]);
    }
    tensors
}

/// The bias and the per-sample term as one `(1, Cout)` or `(B, Cout)` tensor for a single add pass.
fn channel_add(conv: &Conv2d, extras: &ConvExtras) -> Result<Option<Tensor>> {
    let c_out = conv.out_channels();
    Ok(match (conv.bias(), extras.per_sample) {
        // The kernel where it applies: candle's broadcast add uploads the operands' strides from host memory,
        // which a CUDA graph cannot replay.
        (Some(b), Some(p)) if gpu::applies(&[p, b]) => Some(gpu::add_bias_last(p, b, None)?),
        (Some(b), Some(p)) => Some(p.broadcast_add(&b.reshape((1, c_out))?)?.contiguous()?),
        (Some(b), None) => Some(b.reshape((1, c_out))?),
        (None, Some(p)) => Some(p.contiguous()?),
        (None, None) => None,
    })
}

/// The GPU path: the fused GroupNorm+SiLU, candle's convolution without its bias, and one pass adding bias, time
/// embedding and skip connection together.
fn conv2d_gpu(conv: &Conv2d, x: &Tensor, extras: ConvExtras) -> Result<Tensor> {
    let x = match &extras.pre_norm {
        Some(p) => gpu::group_norm(x, p.weight, p.bias, p.groups, p.eps, true)?,
        None => x.clone(),
    };
    let x = if extras.upsample {
        let (_, _, h, w) = x.dims4()?;
        x.upsample_nearest2d(2 * h, 2 * w)?
    } else {
        x
    };
    let y = gpu::conv2d(&x, conv.weight(), conv.stride(), conv.padding())?;
    let c_out = conv.out_channels();
    match (channel_add(conv, &extras)?, extras.residual) {
        (Some(a), r) if gpu::applies(&[&y, &a]) && r.is_none_or(|r| gpu::applies(&[&y, r])) => {
            gpu::add_channel(&y, &a, r)
        }
        (Some(a), r) => {
            let y = y.broadcast_add(&a.reshape((a.dim(0)?, c_out, 1, 1))?)?;
            r.map_or(Ok(y.clone()), |r| y + r)
        }
        (None, Some(r)) => y + r,
        (None, None) => Ok(y),
    }
}

/// A convolution of a channels-last map `(B, H, W, C)` with its `(K, R, S, C)` filter: the channels-last
/// GroupNorm+SiLU (with its shift) and upsampling, cuDNN in NHWC adding bias and skip in its epilogue (a 1×1
/// convolution is one product over the pixel rows, bias and skip in its epilogue too); a time embedding given
/// here rather than to the next norm takes one more pass.
fn conv2d_channels_last(conv: &Conv2d, x: &Tensor, extras: ConvExtras) -> Result<Tensor> {
    let tensors = conv_tensors(conv, x, &extras);
    let shift_fits = extras
        .pre_norm
        .and_then(|p| p.shift)
        .is_none_or(|s| s.device().same_device(x.device()) && s.dtype() == x.dtype());
    if !(gpu::applies(&tensors) && gpu::channels_last_fits(x) && shift_fits) {
        return conv2d_through_nchw(conv, x, extras);
    }
    let x = match &extras.pre_norm {
        Some(p) => gpu::group_norm_channels_last(x, p.shift, p.weight, p.bias, p.groups, p.eps, true)?,
        None => x.clone(),
    };
    let x = if extras.upsample { gpu::upsample2x_channels_last(&x)? } else { x };
    let (b, h, w, c) = x.dims4()?;
    let (k, r, s, _) = conv.weight().dims4()?;
    let pointwise = r == 1 && s == 1 && conv.stride() == 1 && conv.padding() == 0;
    let residual = extras.residual.map(|r| r.contiguous()).transpose()?;
    let y = if pointwise {
        let tokens = x.reshape((b, h * w, c))?;
        let weight = conv.weight().reshape((k, c))?;
        if extras.per_sample.is_none() && gpu::linear_applies(&[&tokens, &weight]) {
            let residual = residual.map(|r| r.reshape((b, h * w, k))).transpose()?;
            let y =
                gpu::linear(&tokens, &weight, conv.bias(), residual.as_ref(), Side::Tokens, Side::Tokens)?;
            return y.reshape((b, h, w, k));
        }
        tokens.broadcast_matmul(&weight.t()?)?.reshape((b, h, w, k))?
    } else if let (Some(bias), None) = (conv.bias(), extras.per_sample) {
        let (stride, padding) = (conv.stride(), conv.padding());
        return gpu::conv2d_channels_last_epilogue(
            &x,
            conv.weight(),
            stride,
            padding,
            bias,
            residual.as_ref(),
        );
    } else {
        gpu::conv2d_channels_last(&x, conv.weight(), conv.stride(), conv.padding())?
    };
    match (channel_add(conv, &extras)?, residual) {
        (Some(a), r) => gpu::add_bias_last(&y, &a, r.as_ref()),
        (None, Some(r)) => y + r,
        (None, None) => Ok(y),
    }
}

/// A channels-last convolution the kernels cannot take (not contiguous, odd channel counts), through NCHW.
fn conv2d_through_nchw(conv: &Conv2d, x: &Tensor, extras: ConvExtras) -> Result<Tensor> {
    through_nchw(conv, x, extras, conv2d)
}

/// Channels-last `conv` as the NCHW convolution `f`: input and skip transposed to NCHW, the result back.
fn through_nchw(
    conv: &Conv2d,
    x: &Tensor,
    extras: ConvExtras,
    f: fn(&Conv2d, &Tensor, ConvExtras) -> Result<Tensor>,
) -> Result<Tensor> {
    let layout = MapLayout::ChannelsLast;
    let residual = extras.residual.map(|r| layout.to_nchw(r)).transpose()?;
    let y = f(
        &conv.channels_first()?,
        &layout.to_nchw(x)?,
        ConvExtras { residual: residual.as_ref(), ..extras },
    )?;
    layout.from_nchw(&y)
}

/// The plain candle ops, NCHW: the reference the kernels are tested against.
pub(crate) fn conv2d_reference(conv: &Conv2d, x: &Tensor, extras: ConvExtras) -> Result<Tensor> {
    if conv.layout() == MapLayout::ChannelsLast {
        return through_nchw(conv, x, extras, conv2d_reference);
    }
    let (x, extras) = shift_input(x, extras)?;
    let x = match &extras.pre_norm {
        Some(p) => group_norm_reference(&x, p.weight, p.bias, p.groups, p.eps)?.silu()?,
        None => x.clone(),
    };
    let x = if extras.upsample {
        let (_, _, h, w) = x.dims4()?;
        x.upsample_nearest2d(2 * h, 2 * w)?
    } else {
        x.clone()
    };
    let mut y = x.conv2d(conv.weight(), conv.padding(), conv.stride(), 1, 1)?;
    if let Some(bias) = conv.bias() {
        y = y.broadcast_add(&bias.reshape((1, conv.out_channels(), 1, 1))?)?;
    }
    if let Some(p) = extras.per_sample {
        let (b, c) = p.dims2()?;
        y = y.broadcast_add(&p.reshape((b, c, 1, 1))?)?;
    }
    match extras.residual {
        Some(r) => y + r,
        None => Ok(y),
    }
}

/// On a GPU where the fused kernels apply: the product `x·Wᵀ` alone and `l`'s bias, for a kernel that adds the
/// bias in the pass it makes anyway (with `also`, the other tensors that pass reads). `None` elsewhere.
fn gpu_product_without_bias<'a>(
    l: &'a Linear,
    x: &Tensor,
    also: Option<&Tensor>,
) -> Result<Option<(Tensor, &'a Tensor)>> {
    let Some(bias) = l.bias() else { return Ok(None) };
    let mut tensors = vec![x, l.weight(), bias];
    tensors.extend(also);
    if !gpu::applies(&tensors) {
        return Ok(None);
    }
    let y = Linear::new(l.weight().clone(), None).forward(x)?;
    Ok(y.is_contiguous().then_some((y, bias)))
}

/// `geglu(linear(l, x))`; on the GPU the projection's bias is added inside the GEGLU pass.
pub(crate) fn linear_geglu(l: &Linear, x: &Tensor) -> Result<Tensor> {
    match gpu_product_without_bias(l, x, None)? {
        Some((y, bias)) => gpu::geglu_bias(&y, Some(bias)),
        None => geglu(&linear(l, x, None)?),
    }
}

/// `geglu(x·W1ᵀ + b1)` in one Hopper kernel, with W1 and b1 as `sdhive_cuda_kernels::interleave_geglu` stored them
/// at load (where `geglu_product_on` said so).
pub(crate) fn linear_geglu_interleaved(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
    gpu::linear_geglu_interleaved(&x.contiguous()?, weight, bias)
}

/// `x·weightᵀ (+ bias) (+ residual)` for a `(Cout, Cin)` or `(Cout, Cin, 1, 1)` weight (a linear layer's or a 1×1
/// convolution's) over tokens `(B, S, Cin)`.
pub(crate) fn project(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let (c_out, c_in) = (weight.dim(0)?, weight.elem_count() / weight.dim(0)?.max(1));
    linear(&Linear::new(weight.reshape((c_out, c_in))?, bias.cloned()), x, residual)
}

/// `h = x·weightᵀ + bias (+ residual)` (a `(Cout, Cin)` or `(Cout, Cin, 1, 1)` weight, as [`project`]) and
/// `layer_norm(h)`. On Hopper, where the kernel has the shape, one kernel writes both from its accumulators
/// (`sdhive_cuda_kernels::linear_norm`); elsewhere the product, then the LayerNorm.
pub(crate) fn project_then_norm(
    x: &Tensor,
    (weight, bias): (&Tensor, Option<&Tensor>),
    residual: Option<&Tensor>,
    (ln_weight, ln_bias, eps): (&Tensor, &Tensor, f64),
) -> Result<(Tensor, Tensor)> {
    let (c_out, c_in) = (weight.dim(0)?, weight.elem_count() / weight.dim(0)?.max(1));
    if let Some(bias) = bias {
        let mut others = vec![weight, bias, ln_weight, ln_bias];
        others.extend(residual);
        if rows_kernel_takes(x, (c_out, c_in), &others) {
            let weight = weight.reshape((c_out, c_in))?;
            return gpu::linear_norm(x, &weight, bias, residual, ln_weight, ln_bias, eps);
        }
    }
    let h = project(x, weight, bias, residual)?;
    let n = layer_norm(&h, ln_weight, ln_bias, eps)?;
    Ok((h, n))
}

/// Whether the product-and-LayerNorm kernel (with its norm or without) takes `x` against an `(n, k)` weight, with
/// `others` (the weight, biases, residual, norm parameters) beside it: one dtype and device throughout, and a
/// shape the kernel is instantiated for on this device.
fn rows_kernel_takes(x: &Tensor, (n, k): (usize, usize), others: &[&Tensor]) -> bool {
    others.iter().all(|t| t.dtype() == x.dtype() && t.device().same_device(x.device()))
        && x.dims().last() == Some(&k)
        && gpu::linear_norm_on(x.device(), x.dtype(), k, n)
}

/// `linear(x) (+ residual)`.
pub(crate) fn linear(l: &Linear, x: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
    let mut tensors = vec![x, l.weight()];
    tensors.extend(l.bias());
    tensors.extend(residual);
    if cpu::applies(&tensors) {
        return cpu::linear(x, l.weight(), l.bias(), residual);
    }
    // A stretch of each sample's longer token sequence (the joint attention's image or text rows) is read in
    // place by a product per sample, instead of copied out first.
    if x.rank() == 3 && !x.is_contiguous() && matches!(x.stride(), [_, k, 1] if *k == x.dim(2)?) {
        let mut others = vec![l.weight()];
        others.extend(l.bias());
        others.extend(residual);
        let alike = others.iter().all(|t| t.dtype() == x.dtype() && t.device().same_device(x.device()));
        if alike && gpu::linear_applies(&others) {
            return gpu::linear(x, l.weight(), l.bias(), residual, Side::Tokens, Side::Tokens);
        }
    }
    // On Hopper, at the widths the product-and-LayerNorm kernel has, the same kernel without the norm: faster than
    // cuBLASLt there, with the residual (its epilogue's weak case) and without.
    if let Some(bias) = l.bias() {
        if matches!(x.rank(), 2 | 3) && rows_kernel_takes(x, l.weight().dims2()?, &tensors) {
            return gpu::linear_rows(x, l.weight(), bias, residual);
        }
    }
    // One product with bias and residual in its epilogue.
    if matches!(x.rank(), 2 | 3) && gpu::linear_applies(&tensors) {
        return gpu::linear(x, l.weight(), l.bias(), residual, Side::Tokens, Side::Tokens);
    }
    // The matmul alone, then bias and residual in one pass instead of candle's broadcast add.
    if let Some((y, bias)) = gpu_product_without_bias(l, x, residual)? {
        return gpu::add_bias_last(&y, bias, residual);
    }
    let y = l.forward(x)?;
    match residual {
        Some(r) => y + r,
        None => Ok(y),
    }
}

/// `gelu_tanh(linear(x))`: on the GPU the GELU runs in the product's epilogue.
pub(crate) fn linear_gelu(l: &Linear, x: &Tensor) -> Result<Tensor> {
    let mut tensors = vec![x, l.weight()];
    tensors.extend(l.bias());
    if matches!(x.rank(), 2 | 3) && gpu::linear_applies(&tensors) {
        return gpu::linear_gelu(x, l.weight(), l.bias());
    }
    linear(l, x, None)?.gelu()
}

/// A 1×1 projection (`weight` `(Cout, Cin)` or `(Cout, Cin, 1, 1)`) of NCHW `x` into tokens
/// `(B, H·W, Cout)`.
pub(crate) fn image_to_tokens(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let mut tensors = vec![x, weight];
    tensors.extend(bias);
    if cpu::applies(&tensors) {
        return cpu::image_to_tokens(x, weight, bias);
    }
    let (b, c, h, w) = x.dims4()?;
    let c_out = weight.dim(0)?;
    if gpu::linear_applies(&tensors) {
        let (x, weight) = (x.reshape((b, c, h * w))?, weight.reshape((c_out, c))?);
        return gpu::linear(&x, &weight, bias, None, Side::ChannelsFirst, Side::Tokens);
    }
    let tokens = x.reshape((b, c, h * w))?.transpose(1, 2)?;
    let y = tokens.broadcast_matmul(&weight.reshape((c_out, c))?.t()?)?;
    match bias {
        Some(bias) if gpu::applies(&[&y, bias]) => gpu::add_bias_last(&y, bias, None),
        Some(bias) => y.broadcast_add(bias),
        None => Ok(y),
    }
}

/// Tokens `(B, H·W, Cin)` through a 1×1 projection back to NCHW `(B, Cout, H, W)`, plus
/// `residual`.
pub(crate) fn tokens_to_image(
    tokens: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    (h, w): (usize, usize),
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let mut tensors = vec![tokens, weight];
    tensors.extend(bias);
    tensors.extend(residual);
    if cpu::applies(&tensors) {
        return cpu::tokens_to_image(tokens, weight, bias, (h, w), residual);
    }
    let (b, _, c) = tokens.dims3()?;
    let c_out = weight.dim(0)?;
    if gpu::linear_applies(&tensors) {
        // The product lands channels-first: no transpose copy, and bias and residual in at most one more pass.
        let residual = residual.map(|r| r.reshape((b, c_out, h * w))).transpose()?;
        let y = gpu::linear(
            tokens,
            &weight.reshape((c_out, c))?,
            bias,
            residual.as_ref(),
            Side::Tokens,
            Side::ChannelsFirst,
        )?;
        return y.reshape((b, c_out, h, w));
    }
    let mut y = tokens.broadcast_matmul(&weight.reshape((c_out, c))?.t()?)?;
    if let Some(bias) = bias {
        y = if gpu::applies(&[&y, bias]) {
            gpu::add_bias_last(&y, bias, None)?
        } else {
            y.broadcast_add(bias)?
        };
    }
    let y = y.transpose(1, 2)?.reshape((b, c_out, h, w))?;
    match residual {
        Some(r) => y + r,
        None => Ok(y),
    }
}

/// OpenAI CLIP's `x · sigmoid(1.702 x)`.
pub fn quick_gelu(x: &Tensor) -> Result<Tensor> {
    x.mul(&candle_nn::ops::sigmoid(&(x * 1.702)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn chunked_attention_matches_single_block() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1., (2, 9, 4), &dev)?;
        let k = Tensor::randn(0f32, 1., (2, 7, 4), &dev)?;
        let v = Tensor::randn(0f32, 1., (2, 7, 3), &dev)?;
        let full = attention_block(&q, &k, &v, 0.5, None, false)?;
        let mut parts = Vec::new();
        for (s, l) in [(0, 4), (4, 4), (8, 1)] {
            parts.push(attention_block(&q.narrow(1, s, l)?, &k, &v, 0.5, None, false)?);
        }
        let chunked = Tensor::cat(&parts, 1)?;
        let diff = (full - chunked)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "diff {diff}");
        Ok(())
    }

    #[test]
    fn score_limit_slices_per_thread_and_restores() -> Result<()> {
        let dev = Device::Cpu;
        // f64 takes the generic path (the CPU kernels stream attention without a score matrix).
        let q = Tensor::randn(0f64, 1., (2, 9, 4), &dev)?;
        let k = Tensor::randn(0f64, 1., (2, 7, 4), &dev)?;
        let v = Tensor::randn(0f64, 1., (2, 7, 3), &dev)?;
        let full = attention(&q, &k, &v, 0.5, None, false)?;
        let sliced = {
            // Two query rows of 2·7 scores per chunk.
            let _guard = limit_attention_scores(28);
            assert_eq!(SCORE_LIMIT.with(std::cell::Cell::get), 28);
            let other = std::thread::spawn(|| SCORE_LIMIT.with(std::cell::Cell::get)).join().expect("thread");
            assert_eq!(other, MAX_SCORE_ELEMENTS, "the limit is this thread's alone");
            attention(&q, &k, &v, 0.5, None, false)?
        };
        assert_eq!(SCORE_LIMIT.with(std::cell::Cell::get), MAX_SCORE_ELEMENTS);
        let diff = (full - sliced)?.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(diff < 1e-12, "diff {diff}");
        Ok(())
    }

    #[test]
    fn heads_round_trip() -> Result<()> {
        let x = Tensor::randn(0f32, 1., (2, 5, 12), &Device::Cpu)?;
        let y = merge_heads(&split_heads(&x, 3)?, 3)?;
        let diff = (x - y)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        Ok(())
    }
}
