//! The transformer feed-forward's first product with GEGLU in its epilogue (`geglu_wgmma.cu`, Hopper only) as a
//! candle custom op: `x·W1ᵀ + b1` never reaches memory, only its GEGLU does. The kernel reads W1 and b1 with their
//! rows interleaved in blocks of [`INTERLEAVE`] (a block of the first half's rows, then the matching block of the
//! gate's), which [`interleave`] makes once, when a network loads; this module also owns the shape checks, the
//! choice of tiling per shape and the persistent form's tensor maps.

use crate::cuda::{aligned16, contiguous, sm90a_loads, tensor_map, MapShape};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{self, CUdevice_attribute};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{
    bail, builder_arg, CudaDevice, CudaStorage, DType, Device, Layout, Result, Shape, Tensor, WithDType,
};
use half::{bf16, f16};

const MODULE: &str = "sdhive_geglu_sm90a";
/// Empty unless the build is for compute capability 9.0 (build.rs).
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/geglu_wgmma_sm90a.ptx"));

/// Rows per block of W1's interleaving (`IL` in geglu_wgmma.cu).
pub const INTERLEAVE: usize = 64;
/// K values per main-loop step (`BK`): the kernel has no tail for a partial one.
const K_STEP: usize = 64;
/// The kernel's 32-bit in-tile offsets and arguments: K and H up to 2^20, M up to 2^31.
const MAX_DIM: usize = 1 << 20;

/// One instantiation of the persistent form (geglu_wgmma.cu's `GEGLU_PP` lines, whose parameters these repeat).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Persistent {
    name: &'static str,
    /// Rows per tile (64 or 128): one or two m64n128 accumulators per consumer warpgroup.
    rows: usize,
    stages: usize,
}

const PP_M128: Persistent = Persistent { name: "m128", rows: 128, stages: 5 };
const PP_M64: Persistent = Persistent { name: "m64", rows: 64, stages: 8 };

impl Persistent {
    /// Where the persistent form beats every tiling on an H100 (xtask/bench/geglu_gemm.cu, docs/benchmarks.md):
    /// 128-row tiles from SD1.5's 32² (2048 rows) up, 64-row tiles (so that the grid's last wave is short) at
    /// its 16² (512 rows). At a few hundred rows and below the 128-row tiling with five stages stays ahead.
    fn for_rows(m: usize) -> Option<Self> {
        if m >= 1024 {
            Some(PP_M128)
        } else if m > 256 {
            Some(PP_M64)
        } else {
            None
        }
    }

    /// `pp_smem_bytes` in geglu_wgmma.cu: the stages of an x tile and a 128-row W1 tile, 128 bytes a row, two
    /// staging slabs of `rows` rows of 128 + 16 bytes, 1024 bytes to align.
    fn smem(&self) -> usize {
        self.stages * (self.rows + 128) * 128 + 2 * self.rows * (128 + 16) + 1024
    }
}

/// Whether more than a few hundred rows take the persistent form: `SDHIVE_GEGLU_PINGPONG=0` keeps the tilings,
/// to measure the two against each other.
fn pingpong_on() -> bool {
    switched_on!("SDHIVE_GEGLU_PINGPONG")
}

/// One instantiation of geglu_wgmma.cu (its `GEGLU_WGMMA_BOTH` lines, whose parameters these repeat).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tile {
    name: &'static str,
    /// Warpgroups of 64 rows per block.
    warpgroups: usize,
    /// Product columns per block (half of them outputs).
    columns: usize,
    stages: usize,
    /// Whether the grid's x walks the rows (else the columns).
    rows_fast: bool,
}

const M128_N128: Tile = Tile { name: "m128_n128", warpgroups: 2, columns: 128, stages: 3, rows_fast: false };
const M128_N256: Tile = Tile { name: "m128_n256", warpgroups: 2, columns: 256, stages: 4, rows_fast: false };
const M64_N128: Tile = Tile { name: "m64_n128", warpgroups: 1, columns: 128, stages: 3, rows_fast: true };
const M128_N128_S5: Tile =
    Tile { name: "m128_n128_s5", warpgroups: 2, columns: 128, stages: 5, rows_fast: true };

impl Tile {
    /// The fastest of the four on an H100 at each of the SD1.5 and SDXL shapes (xtask/bench/geglu_gemm.cu,
    /// docs/benchmarks.md): wide tiles where many rows leave the product compute-bound, at K 1280 twice as wide;
    /// at fewer rows the tiling that fills the SMs best. Grids whose y would pass 65535 walk the rows in x instead.
    fn for_shape(m: usize, k: usize, h: usize) -> Self {
        let tile = if m >= 1024 {
            if k >= 1280 && h.is_multiple_of(M128_N256.columns / 2) {
                M128_N256
            } else {
                M128_N128
            }
        } else if m > 256 {
            M64_N128
        } else {
            M128_N128_S5
        };
        if !tile.rows_fast && m.div_ceil(tile.rows()) > u16::MAX as usize {
            return M64_N128;
        }
        tile
    }

    fn rows(&self) -> usize {
        64 * self.warpgroups
    }

    /// `smem_bytes` in geglu_wgmma.cu: the stages of an x and a W1 tile, 128 bytes a row, and 1024 bytes to align.
    fn smem(&self) -> usize {
        self.stages * (self.rows() + self.columns) * 128 + 1024
    }

    fn grid(&self, m: usize, h: usize) -> (u32, u32, u32) {
        let (rows, cols) = (m.div_ceil(self.rows()) as u32, (2 * h / self.columns) as u32);
        if self.rows_fast {
            (rows, cols, 1)
        } else {
            (cols, rows, 1)
        }
    }
}

/// Why the kernel cannot take a product of `k` input features into `h` outputs, or `None` when it can.
fn shape_refusal(k: usize, h: usize) -> Option<String> {
    if k == 0 || !k.is_multiple_of(K_STEP) || k > MAX_DIM {
        return Some(format!("K {k} is not a positive multiple of {K_STEP} up to {MAX_DIM}"));
    }
    if h == 0 || !h.is_multiple_of(INTERLEAVE) || h > MAX_DIM {
        return Some(format!("H {h} is not a positive multiple of {INTERLEAVE} up to {MAX_DIM}"));
    }
    None
}

/// [`crate::geglu_product_on`] without the environment switch.
pub fn product_on(device: &Device, dtype: DType, k: usize, h: usize) -> bool {
    matches!(dtype, DType::F16 | DType::BF16) && shape_refusal(k, h).is_none() && sm90a_loads(device, PTX)
}

/// W1 `(2H, K)` and b1 `(2H)` with their rows in the kernel's order: for each block of [`INTERLEAVE`] outputs,
/// its first-half rows then its gate rows. Works on any device (plain candle ops).
pub fn interleave(w1: &Tensor, b1: &Tensor) -> Result<(Tensor, Tensor)> {
    let (n, k) = w1.dims2()?;
    let h = n / 2;
    if n != 2 * h || !h.is_multiple_of(INTERLEAVE) || h == 0 {
        bail!(
            "interleave_geglu: W1 {:?} must have 2H rows with H a positive multiple of {INTERLEAVE}",
            w1.dims()
        );
    }
    if b1.elem_count() != n {
        bail!("interleave_geglu: bias {:?} for W1 {:?}", b1.dims(), w1.dims());
    }
    let blocks = h / INTERLEAVE;
    let w = w1.reshape((2, blocks, INTERLEAVE, k))?.transpose(0, 1)?.contiguous()?.reshape((n, k))?;
    let b = b1.reshape((2, blocks, INTERLEAVE))?.transpose(0, 1)?.contiguous()?.reshape(n)?;
    Ok((w, b))
}

struct GegluProduct {
    /// Whether the persistent form may run.
    pingpong: bool,
}

/// The persistent form's two tensor maps, over x `(M, K)` and the interleaved W1 `(2H, K)`: boxes of 64 K values
/// × `rows` rows of x and × 128 rows of W1, 128-byte swizzle, rows past M read as zeros. `None` where the driver
/// refuses one.
fn pp_maps<T: CudaDType + WithDType>(
    dev: &CudaDevice,
    x: &CudaView<'_, T>,
    w: &CudaView<'_, T>,
    (m, k, h): (usize, usize, usize),
    rows: usize,
) -> Option<(crate::cuda::TmaMap, crate::cuda::TmaMap)> {
    let stream = dev.cuda_stream();
    let row_bytes = [k as u64 * T::DTYPE.size_in_bytes() as u64];
    let map = |t: &CudaView<'_, T>, n: usize, box_rows: usize| {
        let shape = MapShape {
            dims: &[k as u64, n as u64],
            strides: &row_bytes,
            boxes: &[K_STEP as u32, box_rows as u32],
            swizzle: sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            l2: sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        };
        tensor_map(t, &stream, &shape, "fused GEGLU product").ok()
    };
    Some((map(x, m, rows)?, map(w, 2 * h, 128)?))
}

fn launch<T: CudaDType + DeviceRepr + WithDType>(
    op: &GegluProduct,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
    (m, k, h): (usize, usize, usize),
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.0.device();
    let sfx = if x.0.dtype() == DType::F16 { "f16" } else { "bf16" };
    let xs = contiguous::<T>(x.0, x.1, "fused GEGLU product input")?;
    let ws = contiguous::<T>(w.0, w.1, "fused GEGLU product weight")?;
    let bs = contiguous::<T>(b.0, b.1, "fused GEGLU product bias")?;
    // SAFETY: every element of the M×H output is written by the kernel (each tile stores its rows below M).
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(m * h)? };
    // The persistent form where it runs and the driver takes its tensor maps, else the tiling for the shape.
    let maps = Persistent::for_rows(m)
        .filter(|_| op.pingpong)
        .and_then(|pp| Some((pp, pp_maps(dev, &xs, &ws, (m, k, h), pp.rows)?)));
    let (name, smem, grid, threads) = match &maps {
        Some((pp, _)) => {
            let sms = dev
                .cuda_stream()
                .context()
                .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .w()?;
            let tiles = m.div_ceil(pp.rows) * (2 * h / 128);
            let grid = (tiles.min(sms.max(1) as usize) as u32, 1, 1);
            (format!("geglu_pp_{}_{sfx}", pp.name), pp.smem(), grid, 288)
        }
        None => {
            let tile = Tile::for_shape(m, k, h);
            let threads = 128 * tile.warpgroups as u32;
            (format!("geglu_wgmma_{}_{sfx}", tile.name), tile.smem(), tile.grid(m, h), threads)
        }
    };
    let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    crate::cuda::opt_in_shared(&func, smem)?;
    let mut a = func.builder();
    match &maps {
        Some((_, (xm, wm))) => {
            a.arg(xm);
            a.arg(wm);
        }
        None => {
            a.arg(&xs);
            a.arg(&ws);
        }
    }
    a.arg(&bs);
    a.arg(&out);
    builder_arg!(a, m as i32, k as i32, h as i32);
    let cfg = LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: smem as u32 };
    // SAFETY: the arguments match the kernel's signature (tensor maps over the views passed beside them for the
    // persistent form, the views themselves for the tilings); `GegluProduct::forward` checked the shapes (K a
    // whole number of steps, H of interleave blocks and of the tile's outputs), that every view is contiguous and
    // 16-byte aligned, and the device's compute capability.
    unsafe { a.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

crate::cuda::cuda_op3!(GegluProduct, "sdhive-geglu-product", forward);

impl GegluProduct {
    fn forward(
        &self,
        (x, xl): (&CudaStorage, &Layout),
        (w, wl): (&CudaStorage, &Layout),
        (b, bl): (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let (n, k) = wl.shape().dims2()?;
        let h = n / 2;
        let dims = xl.dims();
        if dims.last() != Some(&k) {
            bail!("fused GEGLU product: input {dims:?} does not fit the weight {:?}", wl.dims());
        }
        if let Some(why) = shape_refusal(k, h) {
            bail!("fused GEGLU product: {why}");
        }
        if n != 2 * h || bl.shape().elem_count() != n {
            bail!("fused GEGLU product: weight {:?} and bias {:?} (2H rows)", wl.dims(), bl.dims());
        }
        if !aligned16(xl) || !aligned16(wl) || !aligned16(bl) {
            bail!("fused GEGLU product: operands must start on 16 bytes (element offsets multiples of 8)");
        }
        let m = xl.shape().elem_count() / k;
        if m > i32::MAX as usize {
            bail!("fused GEGLU product: {m} rows (at most 2^31 - 1)");
        }
        let mut out_dims = dims.to_vec();
        if let Some(last) = out_dims.last_mut() {
            *last = h;
        }
        let shape = Shape::from(out_dims);
        let out = match x.dtype() {
            DType::F16 => launch::<f16>(self, (x, xl), (w, wl), (b, bl), (m, k, h))?,
            DType::BF16 => launch::<bf16>(self, (x, xl), (w, wl), (b, bl), (m, k, h))?,
            other => bail!("fused GEGLU product: unsupported dtype {other:?} (f16 or bf16)"),
        };
        Ok((out, shape))
    }
}

/// [`crate::linear_geglu_interleaved`]: checks what the op cannot see (devices, dtypes, the compute capability),
/// then the op.
pub fn product(x: &Tensor, w_il: &Tensor, b_il: &Tensor) -> Result<Tensor> {
    product_with(x, w_il, b_il, pingpong_on())
}

/// [`product`] with the persistent form allowed or not (the tests compare the two).
pub(crate) fn product_with(x: &Tensor, w_il: &Tensor, b_il: &Tensor, pingpong: bool) -> Result<Tensor> {
    let (n, k) = w_il.dims2()?;
    if let Some(why) = shape_refusal(k, n / 2) {
        bail!("fused GEGLU product: {why}");
    }
    if x.dims().last() != Some(&k) {
        bail!("fused GEGLU product: input {:?} does not fit the weight {:?}", x.dims(), w_il.dims());
    }
    if !matches!(x.dtype(), DType::F16 | DType::BF16)
        || w_il.dtype() != x.dtype()
        || b_il.dtype() != x.dtype()
    {
        bail!(
            "fused GEGLU product: dtypes {:?}, {:?}, {:?} (one of f16 or bf16)",
            x.dtype(),
            w_il.dtype(),
            b_il.dtype()
        );
    }
    if !w_il.device().same_device(x.device()) || !b_il.device().same_device(x.device()) {
        bail!("fused GEGLU product: the tensors are not on one device");
    }
    if !sm90a_loads(x.device(), PTX) {
        bail!("fused GEGLU product: needs a compute capability 9.0 GPU and a build for it (CUDA_COMPUTE_CAP=90)");
    }
    if x.elem_count() == 0 {
        // No rows: no grid to launch.
        let mut dims = x.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = n / 2;
        }
        return Tensor::zeros(dims, x.dtype(), x.device());
    }
    x.apply_op3_no_bwd(w_il, b_il, &GegluProduct { pingpong })
}
