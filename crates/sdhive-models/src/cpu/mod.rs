//! Hand-written CPU kernels for the f32 hot paths of the UNet and VAE (convolution, group/layer
//! norm with fused activation, multi-head attention, GEGLU, linears with fused bias/residual),
//! and the plumbing between them and candle tensors. `crate::ops` calls these when every input
//! is f32 on the CPU and keeps candle's generic path for everything else; each kernel is tested
//! against that generic path.
//!
//! Why not candle's own CPU ops: its conv2d re-lays out the input and weight on every call and
//! gathers patches one element at a time, its group norm is a chain of broadcast ops, attention
//! needs head split/merge copies, and the element-wise math runs at the baseline x86-64 SIMD
//! width. Matrix products go through the `gemm` crate, as candle's do, with its AVX-512 kernels
//! enabled (`x86-v4` in this crate's manifest).

mod attention;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod conv;
mod dense;
mod gemm;
pub(crate) mod math;
mod norm;
mod winograd;

use crate::ops::ConvExtras;
use candle_core::{bail, CpuStorage, DType, Device, Result, Storage, StorageRef, Tensor};
use std::sync::Mutex;

/// A reusable f32 buffer for kernel temporaries (patch matrices, Winograd blocks). Reusing it
/// avoids page-faulting tens of megabytes in on every convolution; [`release_scratch`] drops it
/// after each network call, so a buffer sized for one network does not sit in memory while
/// another runs.
pub(crate) struct Scratch(Mutex<Vec<f32>>);

static SLOTS: [&Scratch; 4] =
    [&conv::COL_SCRATCH, &winograd::U_SCRATCH, &winograd::V_SCRATCH, &winograd::M_SCRATCH];

impl Scratch {
    pub const fn new() -> Self {
        Self(Mutex::new(Vec::new()))
    }

    /// A buffer of at least `len` elements (contents unspecified).
    pub fn take(&self, len: usize) -> Vec<f32> {
        let v = self.0.lock().map(|mut g| std::mem::take(&mut *g)).unwrap_or_default();
        // Keep the buffer unless it is far larger than needed: a decoder that moves from 512
        // channels at 64² to 128 channels at 256² should not carry the big one into its
        // memory peak.
        if v.len() >= len && v.len() <= 4 * len + (1 << 20) {
            return v;
        }
        // Zeroed allocation (calloc): fresh pages come zeroed from the kernel, with no extra
        // pass over them as `resize` would make.
        vec![0f32; len]
    }

    pub fn put(&self, v: Vec<f32>) {
        if let Ok(mut g) = self.0.lock() {
            if g.capacity() < v.capacity() {
                *g = v;
            }
        }
    }

    fn clear(&self) {
        if let Ok(mut g) = self.0.lock() {
            *g = Vec::new();
        }
    }
}

/// Frees the kernels' reusable buffers; the networks call it when a forward pass ends.
pub(crate) fn release_scratch() {
    for s in SLOTS {
        s.clear();
    }
}

/// Whether the fast path can take these tensors: all f32 on the CPU.
pub(crate) fn applies(ts: &[&Tensor]) -> bool {
    ts.iter().all(|t| t.device().is_cpu() && t.dtype() == DType::F32)
}

fn threads() -> usize {
    candle_core::utils::get_num_threads().max(1)
}

/// Read access to a contiguous f32 CPU tensor's elements.
struct F32<'a> {
    guard: StorageRef<'a>,
    start: usize,
    len: usize,
}

impl<'a> F32<'a> {
    fn new(t: &'a Tensor) -> Result<Self> {
        let (guard, layout) = t.storage_and_layout();
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("cpu kernel: input of shape {:?} is not contiguous", t.dims())
        };
        if !matches!(&*guard, Storage::Cpu(CpuStorage::F32(_))) {
            bail!(
                "cpu kernel: expected an f32 CPU tensor, got {:?} on {:?}",
                t.dtype(),
                t.device().location()
            )
        }
        Ok(Self { guard, start, len: end - start })
    }

    fn slice(&self) -> &[f32] {
        match &*self.guard {
            Storage::Cpu(CpuStorage::F32(v)) => &v[self.start..self.start + self.len],
            // `new` only accepts f32 CPU storage.
            _ => &[],
        }
    }
}

fn output(data: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
    Tensor::from_vec(data, shape, &Device::Cpu)
}

/// Calls `f` with the elements of `t` (made contiguous first) or `None`.
fn with_opt<R>(t: Option<&Tensor>, f: impl FnOnce(Option<&[f32]>) -> Result<R>) -> Result<R> {
    match t {
        Some(t) => {
            let t = t.contiguous()?;
            let d = F32::new(&t)?;
            f(Some(d.slice()))
        }
        None => f(None),
    }
}

fn check_len(what: &str, t: &Tensor, want: usize) -> Result<()> {
    if t.elem_count() != want {
        bail!("cpu kernel: {what} has shape {:?}, expected {want} elements", t.dims());
    }
    Ok(())
}

/// GroupNorm over `(B, C, …)`, then SiLU when `silu`.
pub(crate) fn group_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
    silu: bool,
) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    if dims.len() < 2 || groups == 0 || !dims[1].is_multiple_of(groups) {
        bail!("group_norm: {groups} groups for a tensor of shape {dims:?}");
    }
    let c = dims[1];
    check_len("group_norm weight", weight, c)?;
    check_len("group_norm bias", bias, c)?;
    let spatial = dims[2..].iter().product::<usize>();
    let x = x.contiguous()?;
    let (w, b) = (weight.contiguous()?, bias.contiguous()?);
    let (xd, wd, bd) = (F32::new(&x)?, F32::new(&w)?, F32::new(&b)?);
    let out = norm::group_norm(xd.slice(), c, spatial, groups, eps, wd.slice(), bd.slice(), silu);
    output(out, &dims)
}

/// LayerNorm over the last dimension.
pub(crate) fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let Some(&dim) = dims.last() else { bail!("layer_norm: scalar input") };
    check_len("layer_norm weight", weight, dim)?;
    check_len("layer_norm bias", bias, dim)?;
    let x = x.contiguous()?;
    let (w, b) = (weight.contiguous()?, bias.contiguous()?);
    let (xd, wd, bd) = (F32::new(&x)?, F32::new(&w)?, F32::new(&b)?);
    output(norm::layer_norm(xd.slice(), dim, eps, wd.slice(), bd.slice()), &dims)
}

pub(crate) fn silu(x: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    let mut out = F32::new(&x)?.slice().to_vec();
    math::silu_inplace(&mut out);
    output(out, x.dims())
}

/// GEGLU over the last dimension (`[hidden, gate]` halves).
pub(crate) fn geglu(x: &Tensor) -> Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let Some(last) = dims.last_mut() else { bail!("geglu: scalar input") };
    if *last % 2 != 0 {
        bail!("geglu: last dimension {} is odd", *last);
    }
    *last /= 2;
    let inner = *last;
    let x = x.contiguous()?;
    let xd = F32::new(&x)?;
    let src = xd.slice();
    let mut out = vec![0f32; src.len() / 2];
    if let Some(rows) = 8192usize.checked_div(inner) {
        use rayon::prelude::*;
        let rows_per_task = rows.max(1);
        out.par_chunks_mut(rows_per_task * inner)
            .zip(src.par_chunks(rows_per_task * 2 * inner))
            .for_each(|(o, s)| math::geglu_rows(s, o, inner));
    }
    output(out, &dims)
}

/// Conv2d (groups 1, dilation 1) of NCHW `x` with `weight` `(Cout, Cin, Kh, Kw)`.
pub(crate) fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: usize,
    padding: usize,
    extras: ConvExtras,
) -> Result<Tensor> {
    let (batch, c_in, sh, sw) = x.dims4()?;
    let (c_out, wc_in, kh, kw) = weight.dims4()?;
    if wc_in != c_in {
        bail!("conv2d: input has {c_in} channels, the weight expects {wc_in}");
    }
    if stride == 0 {
        bail!("conv2d: stride 0");
    }
    let (h, w) = if extras.upsample { (2 * sh, 2 * sw) } else { (sh, sw) };
    if h + 2 * padding < kh || w + 2 * padding < kw {
        bail!("conv2d: {kh}×{kw} kernel larger than the padded {h}×{w} input");
    }
    let s =
        conv::ConvShape { batch, c_in, h, w, c_out, kh, kw, stride, pad: padding, upsample: extras.upsample };
    let out_dims = [batch, c_out, s.h_out(), s.w_out()];
    if let Some(b) = bias {
        check_len("conv2d bias", b, c_out)?;
    }
    if let Some(p) = extras.per_sample {
        check_len("conv2d per-sample term", p, batch * c_out)?;
    }
    if let Some(r) = extras.residual {
        if r.dims() != out_dims {
            bail!("conv2d: residual has shape {:?}, the output {out_dims:?}", r.dims());
        }
    }
    let x = x.contiguous()?;
    let weight = weight.contiguous()?;
    let (xd, wd) = (F32::new(&x)?, F32::new(&weight)?);
    let pre = match &extras.pre_norm {
        Some(p) => {
            if p.groups == 0 || c_in % p.groups != 0 {
                bail!("conv2d: {} groups do not divide {c_in} input channels", p.groups);
            }
            check_len("group_norm weight", p.weight, c_in)?;
            check_len("group_norm bias", p.bias, c_in)?;
            let (nw, nb) = (p.weight.contiguous()?, p.bias.contiguous()?);
            let (nwd, nbd) = (F32::new(&nw)?, F32::new(&nb)?);
            let spatial = sh * sw;
            Some(norm::group_norm_coefficients(
                xd.slice(),
                c_in,
                spatial,
                p.groups,
                p.eps,
                nwd.slice(),
                nbd.slice(),
            ))
        }
        None => None,
    };
    let out = with_opt(bias, |bias| {
        with_opt(extras.per_sample, |per_sample| {
            with_opt(extras.residual, |residual| {
                let epi = conv::Epilogue { bias, per_sample, residual };
                Ok(conv::conv2d(xd.slice(), pre.as_deref(), wd.slice(), &s, &epi, threads()))
            })
        })
    })?;
    output(out, &out_dims)
}

/// `x · wᵀ + bias (+ residual)` over the last dimension of `x`; `w` `(out, in)`.
pub(crate) fn linear(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let (out_dim, in_dim) = w.dims2()?;
    let mut dims = x.dims().to_vec();
    match dims.last_mut() {
        Some(d) if *d == in_dim => *d = out_dim,
        _ => bail!("linear: input {:?} does not end in {in_dim}", x.dims()),
    }
    let rows = x.elem_count() / in_dim.max(1);
    if let Some(b) = bias {
        check_len("linear bias", b, out_dim)?;
    }
    if let Some(r) = residual {
        if r.dims() != dims {
            bail!("linear: residual has shape {:?}, the output {dims:?}", r.dims());
        }
    }
    let x = x.contiguous()?;
    let w = w.contiguous()?;
    let (xd, wd) = (F32::new(&x)?, F32::new(&w)?);
    let out = with_opt(bias, |bias| {
        with_opt(residual, |residual| {
            Ok(dense::linear(xd.slice(), rows, in_dim, wd.slice(), out_dim, bias, residual, threads()))
        })
    })?;
    output(out, &dims)
}

/// Multi-head attention on `(B, S, H·D)` projections; returns `(B, Sq, H·Dv)`.
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, scale: f64) -> Result<Tensor> {
    let (batch, q_len, qd) = q.dims3()?;
    let (kb, kv_len, kd) = k.dims3()?;
    let (vb, vl, vd) = v.dims3()?;
    if heads == 0
        || qd != kd
        || qd % heads != 0
        || vd % heads != 0
        || kb != batch
        || vb != batch
        || vl != kv_len
    {
        bail!(
            "attention: q {:?}, k {:?}, v {:?} with {heads} heads do not fit",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let s =
        attention::AttnShape { batch, q_len, kv_len, heads, head_dim: qd / heads, v_head_dim: vd / heads };
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (qd_, kd_, vd_) = (F32::new(&q)?, F32::new(&k)?, F32::new(&v)?);
    let out = attention::attention(qd_.slice(), kd_.slice(), vd_.slice(), &s, scale as f32);
    output(out, &[batch, q_len, vd])
}

/// NCHW `x` → tokens `(B, H·W, Cout)` through a 1×1 projection `w` (`(Cout, Cin)` or
/// `(Cout, Cin, 1, 1)`).
pub(crate) fn image_to_tokens(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (batch, c_in, h, wd) = x.dims4()?;
    let c_out = w.dim(0)?;
    check_len("projection weight", w, c_out * c_in)?;
    if let Some(b) = bias {
        check_len("projection bias", b, c_out)?;
    }
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let (xd, wdata) = (F32::new(&x)?, F32::new(&w)?);
    let out = with_opt(bias, |bias| {
        Ok(dense::image_to_tokens(xd.slice(), batch, c_in, h * wd, wdata.slice(), c_out, bias, threads()))
    })?;
    output(out, &[batch, h * wd, c_out])
}

/// Tokens `(B, H·W, Cin)` → NCHW `(B, Cout, H, W)` through a 1×1 projection, plus `residual`.
pub(crate) fn tokens_to_image(
    tokens: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    (h, wd): (usize, usize),
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let (batch, pixels, c_in) = tokens.dims3()?;
    if pixels != h * wd {
        bail!("tokens_to_image: {pixels} tokens for a {h}×{wd} image");
    }
    let c_out = w.dim(0)?;
    check_len("projection weight", w, c_out * c_in)?;
    if let Some(b) = bias {
        check_len("projection bias", b, c_out)?;
    }
    let out_dims = [batch, c_out, h, wd];
    if let Some(r) = residual {
        if r.dims() != out_dims {
            bail!("tokens_to_image: residual has shape {:?}, the output {out_dims:?}", r.dims());
        }
    }
    let (t, w) = (tokens.contiguous()?, w.contiguous()?);
    let (td, wdata) = (F32::new(&t)?, F32::new(&w)?);
    let out = with_opt(bias, |bias| {
        with_opt(residual, |residual| {
            Ok(dense::tokens_to_image(
                td.slice(),
                batch,
                c_in,
                pixels,
                wdata.slice(),
                c_out,
                bias,
                residual,
                threads(),
            ))
        })
    })?;
    output(out, &out_dims)
}

#[cfg(test)]
mod tests;
