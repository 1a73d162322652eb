//! The 3×3 convolutions at a channels-last network's edges (`edge_conv.cu`) as candle custom ops: the first one
//! reads the few NCHW channels outside and writes the network's channels-last map, the last one reads that map and
//! writes the few NCHW channels out, each in one launch with its bias. This module owns which shapes they take.

use crate::cuda::{aligned16, contiguous};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, builder_arg, CudaDevice, CudaStorage, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

const MODULE: &str = "sdhive_edge_conv";
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/edge_conv.ptx"));

/// Rows of the last convolution's filter (`edge_out`'s products are 8 output channels wide).
const OUT_ROWS: usize = 8;
/// Input channels of the first convolution (`edge_in4`).
const IN_CHANNELS: usize = 4;

fn sfx(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        other => bail!("edge convolution: unsupported dtype {other:?} (f16 or bf16)"),
    })
}

/// The crate's element-wise conditions ([`crate::applies`]: contiguous, one CUDA device, one type) in f16 or bf16.
fn half_operands(ts: &[&Tensor]) -> bool {
    crate::applies(ts) && matches!(ts[0].dtype(), DType::F16 | DType::BF16)
}

/// Why `edge_out` cannot take map `(N, H, W, C)`, filter `(8, 3, 3, C)` and `k` output channels, or `None`.
fn out_refusal(x: &[usize], w: &[usize], k: usize) -> Option<String> {
    let ([_, h, wd, c], [rows, r, s, wc]) = (x, w) else {
        return Some(format!("map {x:?} and filter {w:?} are not 4-D"));
    };
    if (*r, *s) != (3, 3) || *rows != OUT_ROWS || wc != c {
        return Some(format!("filter {w:?}: ({OUT_ROWS}, 3, 3, {c}) for a map of {c} channels"));
    }
    if k == 0 || k > OUT_ROWS {
        return Some(format!("{k} output channels (1 to {OUT_ROWS})"));
    }
    if !c.is_multiple_of(32) || !wd.is_multiple_of(16) || *h == 0 {
        return Some(format!("map {x:?}: channels a multiple of 32, width a multiple of 16"));
    }
    None
}

/// Why `edge_in4` cannot take input `(N, 4, H, W)` and filter `(K, 3, 3, CP)`, or `None`.
fn in_refusal(x: &[usize], w: &[usize]) -> Option<String> {
    let ([_, c, h, wd], [k, r, s, cp]) = (x, w) else {
        return Some(format!("input {x:?} and filter {w:?} are not 4-D"));
    };
    if *c != IN_CHANNELS || (*r, *s) != (3, 3) || *cp < *c || !cp.is_multiple_of(8) {
        return Some(format!("input {x:?} and filter {w:?}: {IN_CHANNELS} input channels, a 3×3 filter"));
    }
    if *k == 0 || !k.is_multiple_of(2) || *k > 2048 {
        return Some(format!("{k} output channels (even, at most 2048)"));
    }
    if !wd.is_multiple_of(16) || *h == 0 {
        return Some(format!("input {x:?}: width a multiple of 16"));
    }
    None
}

/// Whether [`conv_out`] takes these operands: f16 or bf16 where the crate's kernels apply, on a build for sm_80 or
/// later, the shapes of `out_refusal`, an `(8)` bias.
pub fn out_takes(x: &Tensor, weight: &Tensor, bias: &Tensor, k: usize) -> bool {
    crate::cuda::built_for() >= 80
        && half_operands(&[x, weight, bias])
        && out_refusal(x.dims(), weight.dims(), k).is_none()
        && bias.dims() == [OUT_ROWS]
}

/// Whether [`conv_in`] takes these operands: f16 or bf16 where the crate's kernels apply, the shapes of
/// `in_refusal`, a `(K)` bias.
pub fn in_takes(x: &Tensor, weight: &Tensor, bias: &Tensor) -> bool {
    half_operands(&[x, weight, bias])
        && in_refusal(x.dims(), weight.dims()).is_none()
        && bias.dims() == [weight.dims()[0]]
}

#[derive(Clone, Copy)]
enum Edge {
    /// The last convolution, `k` output channels kept.
    Out {
        k: usize,
    },
    In,
}

struct EdgeConv(Edge);

fn launch<T: CudaDType + DeviceRepr>(
    edge: Edge,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let dev: &CudaDevice = x.0.device();
    let xs = contiguous::<T>(x.0, x.1, "edge convolution input")?;
    let ws = contiguous::<T>(w.0, w.1, "edge convolution filter")?;
    let bs = contiguous::<T>(b.0, b.1, "edge convolution bias")?;
    let sfx = sfx(x.0.dtype())?;
    let (xd, wd) = (x.1.dims(), w.1.dims());
    // Both take a block per 16 pixels: the last one a warp per tap, the first one a thread per two output channels.
    let (name, (n, h, wi), wide, threads, out_dims) = match edge {
        Edge::Out { k } => {
            let (n, h, wi, c) = (xd[0], xd[1], xd[2], xd[3]);
            ("edge_out", (n, h, wi), (c, k), 9 * 32, vec![n, k, h, wi])
        }
        Edge::In => {
            let (n, h, wi, k, cp) = (xd[0], xd[2], xd[3], wd[0], wd[3]);
            ("edge_in4", (n, h, wi), (cp, k), (k / 2).next_multiple_of(32), vec![n, h, wi, k])
        }
    };
    let cfg = LaunchConfig {
        grid_dim: ((n * h * wi / 16) as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let elems: usize = out_dims.iter().product();
    let func = dev.get_or_load_custom_func(&format!("{name}_{sfx}"), MODULE, PTX)?;
    // SAFETY: written in full by the kernel: every pixel of the map, every kept output channel.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(elems)? };
    let mut a = func.builder();
    a.arg(&xs);
    a.arg(&ws);
    a.arg(&bs);
    a.arg(&out);
    builder_arg!(a, h as u32, wi as u32, wide.0 as u32, wide.1 as u32);
    // SAFETY: the arguments match the kernel's signature; `EdgeConv::forward` checked the shapes (the refusals
    // above), that every view is contiguous and starts on 16 bytes, and `out_takes` the build's architecture.
    unsafe { a.launch(cfg) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(out_dims)))
}

crate::cuda::cuda_op3!(EdgeConv, "sdhive-edge-conv", forward);

impl EdgeConv {
    fn forward(
        &self,
        (x, xl): (&CudaStorage, &Layout),
        (w, wl): (&CudaStorage, &Layout),
        (b, bl): (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let why = match self.0 {
            Edge::Out { k } => out_refusal(xl.dims(), wl.dims(), k)
                .or_else(|| (bl.dims() != [OUT_ROWS]).then(|| format!("bias {:?}", bl.dims()))),
            Edge::In => in_refusal(xl.dims(), wl.dims())
                .or_else(|| (bl.dims() != [wl.dims()[0]]).then(|| format!("bias {:?}", bl.dims()))),
        };
        if let Some(why) = why {
            bail!("edge convolution: {why}");
        }
        if !aligned16(xl) || !aligned16(wl) || !aligned16(bl) {
            bail!("edge convolution: operands must start on 16 bytes (element offsets multiples of 8)");
        }
        // f32 reaches `launch` only to be refused by `sfx`.
        crate::cuda::by_dtype!(x.dtype(), launch(self.0, (x, xl), (w, wl), (b, bl)))
    }
}

/// The last convolution: channels-last `x` `(N, H, W, C)`, filter `(8, 3, 3, C)` whose rows past `k` are zero,
/// bias `(8)`; stride 1, padding 1; returns NCHW `(N, k, H, W)`. Only where [`out_takes`] says so.
pub fn conv_out(x: &Tensor, weight: &Tensor, bias: &Tensor, k: usize) -> Result<Tensor> {
    if !out_takes(x, weight, bias, k) {
        let why = out_refusal(x.dims(), weight.dims(), k).unwrap_or_else(|| {
            "f16 or bf16 operands of one type, contiguous, on a GPU of sm_80 or later".into()
        });
        bail!("edge convolution: {why} (map {:?}, filter {:?})", x.dims(), weight.dims());
    }
    x.apply_op3_no_bwd(weight, bias, &EdgeConv(Edge::Out { k }))
}

/// The first convolution: NCHW `x` `(N, 4, H, W)`, channels-last filter `(K, 3, 3, CP)` (columns past 4 unused),
/// bias `(K)`; stride 1, padding 1; returns channels-last `(N, H, W, K)`. Only where [`in_takes`] says so.
pub fn conv_in(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
    if !in_takes(x, weight, bias) {
        let why = in_refusal(x.dims(), weight.dims())
            .unwrap_or_else(|| "f16 or bf16 operands of one type, contiguous, on one GPU".into());
        bail!("edge convolution: {why} (input {:?}, filter {:?})", x.dims(), weight.dims());
    }
    x.apply_op3_no_bwd(weight, bias, &EdgeConv(Edge::In))
}
