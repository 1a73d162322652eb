//! The 3×3 convolution of 8×8 channels-last maps (`conv_splitk.cu`, Hopper only) as a candle custom op: the input
//! channels split among the blocks of a thread block cluster, their partial sums added inside it, bias and skip in
//! the epilogue. It takes SD1.5's lowest UNet level from cuDNN, which runs those convolutions well below the
//! memory's bandwidth (xtask/bench/conv_splitk.cu, docs/benchmarks.md). This module owns the shapes it takes and
//! the choice of instantiation per shape.

use crate::cuda::{aligned16, contiguous, held_view, sm90a_loads};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, builder_arg, CudaDevice, CudaStorage, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

const MODULE: &str = "sdhive_conv_splitk_sm90a";
/// Empty unless the build is for compute capability 9.0 (build.rs).
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/conv_splitk_sm90a.ptx"));

/// The maps' side (`SIDE` in conv_splitk.cu).
const SIDE: usize = 8;
/// Images per call the instantiations hold (`NB`).
const MAX_IMAGES: usize = 2;

/// One instantiation of conv_splitk.cu (its `CONV_SPLITK_BOTH` lines, whose parameters these repeat).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Split {
    /// Blocks per cluster, each with C/(64·S) of the input channels.
    splits: usize,
    /// Filter tiles in flight (`D`).
    depth: usize,
}

/// The fastest on an H100 at SD1.5's 8² shapes (1280 and 2560 input channels; xtask/bench/conv_splitk.cu): 100
/// blocks of 64 output channels.
const S5: Split = Split { splits: 5, depth: 8 };
/// For channel counts five splits do not divide.
const S4: Split = Split { splits: 4, depth: 6 };

impl Split {
    fn for_channels(c: usize) -> Option<Self> {
        [S5, S4].into_iter().find(|s| c.is_multiple_of(64 * s.splits))
    }

    fn name(&self, dtype: DType) -> String {
        let sfx = if dtype == DType::F16 { "f16" } else { "bf16" };
        format!("conv_splitk_s{}_b{MAX_IMAGES}_d{}_{sfx}", self.splits, self.depth)
    }

    /// `smem_bytes<S, NB, D>()` in conv_splitk.cu: the larger of the ring of D + 2 filter tiles (8 KB each) and
    /// the staged f32 partials (NB·64 pixels, rows of 72 floats); two halo slices (eight 8-channel columns of
    /// NB·100 pixels, 16 bytes each, one more per column); S slots for the partials received (a block's share of
    /// the pixels, rounded up); the mbarrier; 1024 bytes to align.
    fn smem(&self) -> usize {
        let (pitch, pixels) = (72 * 4, MAX_IMAGES * 64);
        let ring = (self.depth + 2) * 64 * 128;
        let halo = 8 * (MAX_IMAGES * 100 * 16 + 16);
        let slot = pixels.div_ceil(self.splits) * pitch;
        ring.max(pixels * pitch) + 2 * halo + self.splits * slot + 16 + 1024
    }
}

/// Why the kernel cannot take input `x` `(N, H, W, C)` and filter `(K, R, S, C)` at this stride and padding, or
/// `None` when it can (shapes only; [`takes`] adds the device and the types).
fn shape_refusal(x: &[usize], w: &[usize], stride: usize, padding: usize) -> Option<String> {
    let ([n, h, wd, c], [k, r, s, wc]) = (x, w) else {
        return Some(format!("input {x:?} and filter {w:?} are not 4-D"));
    };
    if (*h, *wd) != (SIDE, SIDE) || (*r, *s) != (3, 3) || stride != 1 || padding != 1 {
        return Some(format!(
            "only 3×3 filters, stride 1, padding 1 on {SIDE}×{SIDE} maps (input {x:?}, filter {w:?})"
        ));
    }
    if *n == 0 || *n > MAX_IMAGES {
        return Some(format!("{n} images (1 to {MAX_IMAGES})"));
    }
    if wc != c || Split::for_channels(*c).is_none() {
        return Some(format!("{c} input channels (filter {wc}): a multiple of 256 or 320"));
    }
    if *k == 0 || !k.is_multiple_of(64) || *k > 64 * 65_535 {
        return Some(format!("{k} output channels (a positive multiple of 64)"));
    }
    None
}

/// Whether [`conv2d`] takes these operands: f16 or bf16 on a compute capability 9.0 GPU (of a build for it),
/// contiguous, the shapes of [`shape_refusal`], a `(K)` bias and a skip of the output's shape, all of one type.
pub fn takes(
    x: &Tensor,
    weight: &Tensor,
    stride: usize,
    padding: usize,
    bias: &Tensor,
    skip: Option<&Tensor>,
) -> bool {
    let dtype = x.dtype();
    let same = |t: &Tensor| t.dtype() == dtype && t.device().same_device(x.device()) && t.is_contiguous();
    matches!(dtype, DType::F16 | DType::BF16)
        && [x, weight, bias].into_iter().chain(skip).all(same)
        && shape_refusal(x.dims(), weight.dims(), stride, padding).is_none()
        && bias.dims() == [weight.dims()[0]]
        && skip.is_none_or(|s| s.dims() == [x.dims()[0], SIDE, SIDE, weight.dims()[0]])
        && sm90a_loads(x.device(), PTX)
}

struct ConvSplitK {
    skip: Option<Tensor>,
}

fn launch<T: CudaDType + DeviceRepr>(
    op: &ConvSplitK,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
    (n, c, k): (usize, usize, usize),
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.0.device();
    let Some(split) = Split::for_channels(c) else { bail!("8² convolution: {c} input channels") };
    let func = dev.get_or_load_custom_func(&split.name(x.0.dtype()), MODULE, PTX)?;
    let xs = contiguous::<T>(x.0, x.1, "8² convolution input")?;
    let ws = contiguous::<T>(w.0, w.1, "8² convolution filter")?;
    let bs = contiguous::<T>(b.0, b.1, "8² convolution bias")?;
    let held = op.skip.as_ref().map(|s| s.storage_and_layout());
    let skip = held.as_ref().map(|h| held_view::<T, _>(h, "8² convolution skip")).transpose()?;
    // SAFETY: every element of the output is written: each cluster covers 64 output channels of every pixel of
    // the n images, its blocks a share each.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n * SIDE * SIDE * k)? };
    crate::cuda::opt_in_shared(&func, split.smem())?;
    let mut a = func.builder();
    a.arg(&xs);
    a.arg(&ws);
    a.arg(&bs);
    // The kernel reads no skip from a null pointer.
    let null = 0u64;
    match &skip {
        Some(s) => a.arg(s),
        None => a.arg(&null),
    };
    a.arg(&out);
    builder_arg!(a, n as i32, c as i32, k as i32);
    let cfg = LaunchConfig {
        grid_dim: (split.splits as u32, (k / 64) as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: split.smem() as u32,
    };
    // SAFETY: the arguments match the kernel's signature; `ConvSplitK::forward` checked the shapes (8×8 maps,
    // 3×3 filter, channels split evenly, whole 64-channel output tiles), that every view is contiguous and 16-byte
    // aligned, and `conv2d` the device's compute capability. The grid's x is the cluster size the kernel fixes.
    unsafe { a.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

crate::cuda::cuda_op3!(ConvSplitK, "sdhive-conv-splitk", forward);

impl ConvSplitK {
    fn forward(
        &self,
        (x, xl): (&CudaStorage, &Layout),
        (w, wl): (&CudaStorage, &Layout),
        (b, bl): (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        if let Some(why) = shape_refusal(xl.dims(), wl.dims(), 1, 1) {
            bail!("8² convolution: {why}");
        }
        let (n, c, k) = (xl.dims()[0], xl.dims()[3], wl.dims()[0]);
        if bl.dims() != [k] {
            bail!("8² convolution: bias {:?} for {k} output channels", bl.dims());
        }
        let out_dims = [n, SIDE, SIDE, k];
        if let Some(s) = &self.skip {
            if s.dims() != out_dims || !s.is_contiguous() {
                bail!("8² convolution: skip {:?} is not a contiguous {out_dims:?}", s.dims());
            }
        }
        let skip_aligned = self.skip.as_ref().is_none_or(|s| s.layout().start_offset().is_multiple_of(8));
        if !aligned16(xl) || !aligned16(wl) || !aligned16(bl) || !skip_aligned {
            bail!("8² convolution: operands must start on 16 bytes (element offsets multiples of 8)");
        }
        let out = match x.dtype() {
            DType::F16 => launch::<f16>(self, (x, xl), (w, wl), (b, bl), (n, c, k))?,
            DType::BF16 => launch::<bf16>(self, (x, xl), (w, wl), (b, bl), (n, c, k))?,
            other => bail!("8² convolution: unsupported dtype {other:?} (f16 or bf16)"),
        };
        Ok((out, Shape::from(out_dims.to_vec())))
    }
}

/// `conv(x, weight) + bias (+ skip)` for channels-last `x` `(N, 8, 8, C)`, filter `(K, 3, 3, C)`, stride 1,
/// padding 1; `skip` `(N, 8, 8, K)`. Only where [`takes`] says so.
pub fn conv2d(x: &Tensor, weight: &Tensor, bias: &Tensor, skip: Option<&Tensor>) -> Result<Tensor> {
    if !takes(x, weight, 1, 1, bias, skip) {
        let why = shape_refusal(x.dims(), weight.dims(), 1, 1).unwrap_or_else(|| {
            "f16 or bf16 operands of one type, contiguous, on a compute capability 9.0 GPU".into()
        });
        bail!("8² convolution: {why} (input {:?}, filter {:?})", x.dims(), weight.dims());
    }
    x.apply_op3_no_bwd(weight, bias, &ConvSplitK { skip: skip.cloned() })
}

/// Whether the device could run the kernel at all (for the tests: a non-Hopper GPU skips them).
#[cfg(test)]
pub fn on(device: &candle_core::Device) -> bool {
    sm90a_loads(device, PTX)
}
