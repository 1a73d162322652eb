//! A narrow product and the LayerNorm after it in one Hopper kernel (`linear_norm_wgmma.cu`) as a candle custom op:
//! `h = x·Wᵀ + bias (+ residual)` and `LayerNorm(h)`, both written from the accumulators, where cuBLASLt's product
//! would write h and a LayerNorm launch read it back; and the same kernel without the LayerNorm, for the products
//! with a residual that no norm follows (cuBLASLt's residual epilogue is slow at these shapes). This module owns the
//! shape checks and the instantiation table (one so far: 320 output features, SD1.5's 64² transformers).

use crate::cuda::{aligned16, contiguous, held_view, sm90a_loads};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, builder_arg, CudaDevice, CudaStorage, DType, Device, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

const MODULE: &str = "sdhive_linear_norm_sm90a";
/// Empty unless the build is for compute capability 9.0 (build.rs).
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/linear_norm_wgmma_sm90a.ptx"));

/// K values per main-loop step (`BK`): the kernel has no tail for a partial one.
const K_STEP: usize = 64;
/// The kernel's 32-bit in-tile offsets: K up to 2^20; M up to 2^31 (an `int`).
const MAX_K: usize = 1 << 20;
/// Rows per block (wgmma's M).
const ROWS: usize = 64;

/// One instantiation of linear_norm_wgmma.cu (its `LINEAR_NORM_BOTH` lines, whose parameters these repeat).
#[derive(Clone, Copy, Debug)]
struct Tile {
    /// Output features: whole rows per block.
    n: usize,
    warpgroups: usize,
    stages: usize,
}

/// 320 features (SD1.5's 64² transformers): in `xtask/bench/linear_norm.cu` on an H100, at 8192 rows, 10.5 µs
/// against 14.9 for cuBLASLt's product and the LayerNorm launch (proj_in), 11.1 against 17.9 with the residual
/// (the attentions' to_out). At K 1280 (the feed-forward's second product) it is slower than cuBLASLt alone.
const TILES: [Tile; 1] = [Tile { n: 320, warpgroups: 2, stages: 3 }];

impl Tile {
    fn for_n(n: usize) -> Option<Self> {
        TILES.iter().copied().find(|t| t.n == n)
    }

    /// The h-only instantiation's block (`linear_wgmma_half`): one warpgroup over half the columns, as many stages.
    fn half(&self) -> Self {
        Tile { n: self.n / 2, warpgroups: self.warpgroups / 2, stages: self.stages }
    }

    /// `smem_bytes` in linear_norm_wgmma.cu: the stages of an x and a W tile (128 bytes a row), the residual rows
    /// (N values padded by 16 bytes), bias, gamma and beta, a pair of f32 moments per warpgroup and row, and 1024
    /// bytes to align.
    fn smem(&self) -> usize {
        let pitch = self.n * 2 + 16;
        self.stages * (ROWS + self.n) * 128
            + ROWS * pitch
            + 3 * self.n * 2
            + self.warpgroups * ROWS * 8
            + 1024
    }
}

/// Why the kernel cannot take a product of `k` input features into `n` outputs, or `None` when it can.
fn shape_refusal(k: usize, n: usize) -> Option<String> {
    if k == 0 || !k.is_multiple_of(K_STEP) || k > MAX_K {
        return Some(format!("K {k} is not a positive multiple of {K_STEP} up to {MAX_K}"));
    }
    if Tile::for_n(n).is_none() {
        let have: Vec<usize> = TILES.iter().map(|t| t.n).collect();
        return Some(format!("N {n} has no instantiation (only {have:?})"));
    }
    None
}

/// Whether the products without the LayerNorm split each row over two blocks (`linear_wgmma_half`);
/// `SDHIVE_LINEAR_SPLIT=0` keeps whole rows per block, to measure the two against each other.
fn split_on() -> bool {
    switched_on!("SDHIVE_LINEAR_SPLIT")
}

/// [`crate::linear_norm_on`] without the environment switch.
pub fn product_on(device: &Device, dtype: DType, k: usize, n: usize) -> bool {
    matches!(dtype, DType::F16 | DType::BF16) && shape_refusal(k, n).is_none() && sm90a_loads(device, PTX)
}

/// The op: x, W and the bias as its operands; the residual and the LayerNorm's weight and bias (none: h alone)
/// held beside them.
struct LinearNorm {
    residual: Option<Tensor>,
    norm: Option<(Tensor, Tensor)>,
    eps: f32,
}

fn launch<T: CudaDType + DeviceRepr>(
    op: &LinearNorm,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
    (m, k, tile): (usize, usize, Tile),
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.0.device();
    let sfx = if x.0.dtype() == DType::F16 { "f16" } else { "bf16" };
    // Without the norm, each row in two blocks of half the columns (`linear_wgmma_half`), where the switch allows.
    let (kernel, block) = match &op.norm {
        Some(_) => ("linear_norm_wgmma", tile),
        None if split_on() => ("linear_wgmma_half", tile.half()),
        None => ("linear_wgmma", tile),
    };
    let func = dev.get_or_load_custom_func(&format!("{kernel}_n{}_{sfx}", tile.n), MODULE, PTX)?;
    let xs = contiguous::<T>(x.0, x.1, "product-and-LayerNorm input")?;
    let ws = contiguous::<T>(w.0, w.1, "product-and-LayerNorm weight")?;
    let bs = contiguous::<T>(b.0, b.1, "product-and-LayerNorm bias")?;
    let residual = op.residual.as_ref().map(|r| r.storage_and_layout());
    let rv = residual.as_ref().map(|h| held_view::<T, _>(h, "product-and-LayerNorm residual")).transpose()?;
    let norm = op.norm.as_ref().map(|(g, b)| (g.storage_and_layout(), b.storage_and_layout()));
    let nv = match &norm {
        Some((g, b)) => {
            Some((held_view::<T, _>(g, "LayerNorm weight")?, held_view::<T, _>(b, "LayerNorm bias")?))
        }
        None => None,
    };
    let n = tile.n;
    let halves = if nv.is_some() { 2 } else { 1 };
    // SAFETY: every element of h (and of n with the norm) is written by the kernel (each block stores its rows
    // below M).
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(halves * m * n)? };
    {
        let h = out.slice(0..m * n);
        let normed = (halves == 2).then(|| out.slice(m * n..2 * m * n));
        crate::cuda::opt_in_shared(&func, block.smem())?;
        let null = 0u64;
        let mut a = func.builder();
        a.arg(&xs);
        a.arg(&ws);
        a.arg(&bs);
        match &rv {
            Some(r) => a.arg(r),
            None => a.arg(&null),
        };
        match &nv {
            Some((g, b)) => {
                a.arg(g);
                a.arg(b);
            }
            None => {
                a.arg(&null);
                a.arg(&null);
            }
        }
        a.arg(&h);
        match &normed {
            Some(v) => a.arg(v),
            None => a.arg(&null),
        };
        builder_arg!(a, m as i32, k as i32, op.eps);
        let cfg = LaunchConfig {
            grid_dim: (m.div_ceil(ROWS) as u32, (tile.n / block.n) as u32, 1),
            block_dim: (128 * block.warpgroups as u32, 1, 1),
            shared_mem_bytes: block.smem() as u32,
        };
        // SAFETY: the arguments match the kernel's signature (a null residual is allowed; without the norm so are
        // gamma, beta and n, which that kernel never reads or writes); `LinearNorm::forward` checked the shapes (K
        // whole steps, N an instantiation's, the residual M×N, gamma and beta N), that every view is contiguous and
        // 16-byte aligned, and `product` the device's compute capability.
        unsafe { a.launch(cfg) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

crate::cuda::cuda_op3!(LinearNorm, "sdhive-linear-norm", forward);

impl LinearNorm {
    fn forward(
        &self,
        (x, xl): (&CudaStorage, &Layout),
        (w, wl): (&CudaStorage, &Layout),
        (b, bl): (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let (n, k) = wl.shape().dims2()?;
        let dims = xl.dims();
        if dims.last() != Some(&k) {
            bail!("product and LayerNorm: input {dims:?} does not fit the weight {:?}", wl.dims());
        }
        if let Some(why) = shape_refusal(k, n) {
            bail!("product and LayerNorm: {why}");
        }
        let Some(tile) = Tile::for_n(n) else { bail!("product and LayerNorm: N {n}") };
        let mut vectors = vec![("bias", bl.shape())];
        if let Some((g, b)) = &self.norm {
            vectors.extend([("LayerNorm weight", g.shape()), ("LayerNorm bias", b.shape())]);
        }
        for (what, t) in vectors {
            if t.elem_count() != n {
                bail!("product and LayerNorm: {what} {:?} for {n} features", t.dims());
            }
        }
        let m = xl.shape().elem_count() / k;
        if m > i32::MAX as usize {
            bail!("product and LayerNorm: {m} rows (at most 2^31 - 1)");
        }
        let mut out_dims = dims.to_vec();
        if let Some(last) = out_dims.last_mut() {
            *last = n;
        }
        if let Some(r) = &self.residual {
            if r.dims() != out_dims.as_slice() {
                bail!("product and LayerNorm: residual {:?} differs from the output {out_dims:?}", r.dims());
            }
            if !aligned16(r.layout()) {
                bail!("product and LayerNorm: the residual must start on 16 bytes");
            }
        }
        let norm_aligned =
            self.norm.as_ref().is_none_or(|(g, b)| aligned16(g.layout()) && aligned16(b.layout()));
        if !aligned16(xl) || !aligned16(wl) || !aligned16(bl) || !norm_aligned {
            bail!("product and LayerNorm: operands must start on 16 bytes (element offsets multiples of 8)");
        }
        if self.norm.is_some() {
            // h, then its LayerNorm.
            out_dims.insert(0, 2);
        }
        let out = match x.dtype() {
            DType::F16 => launch::<f16>(self, (x, xl), (w, wl), (b, bl), (m, k, tile))?,
            DType::BF16 => launch::<bf16>(self, (x, xl), (w, wl), (b, bl), (m, k, tile))?,
            other => bail!("product and LayerNorm: unsupported dtype {other:?} (f16 or bf16)"),
        };
        Ok((out, Shape::from(out_dims)))
    }
}

/// [`crate::linear_norm`] (`norm` the LayerNorm's weight, bias and eps) and [`crate::linear_rows`] (no norm: h
/// alone, returned as both): checks what the op cannot see (devices, dtypes, the compute capability), then the op.
pub fn product(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    residual: Option<&Tensor>,
    norm: Option<(&Tensor, &Tensor, f64)>,
) -> Result<(Tensor, Tensor)> {
    let (n, k) = weight.dims2()?;
    if let Some(why) = shape_refusal(k, n) {
        bail!("product and LayerNorm: {why}");
    }
    if x.dims().last() != Some(&k) {
        bail!("product and LayerNorm: input {:?} does not fit the weight {:?}", x.dims(), weight.dims());
    }
    let mut tensors = vec![weight, bias];
    tensors.extend(residual);
    if let Some((g, b, _)) = norm {
        tensors.extend([g, b]);
    }
    if !matches!(x.dtype(), DType::F16 | DType::BF16) || tensors.iter().any(|t| t.dtype() != x.dtype()) {
        bail!("product and LayerNorm: every tensor in one of f16 or bf16 (input {:?})", x.dtype());
    }
    if tensors.iter().any(|t| !t.device().same_device(x.device())) {
        bail!("product and LayerNorm: the tensors are not on one device");
    }
    if !sm90a_loads(x.device(), PTX) {
        bail!("product and LayerNorm: needs a compute capability 9.0 GPU and a build for it (CUDA_COMPUTE_CAP=90)");
    }
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = n;
    }
    if x.elem_count() == 0 {
        // No rows: no grid to launch.
        let z = Tensor::zeros(dims, x.dtype(), x.device())?;
        return Ok((z.clone(), z));
    }
    let op = LinearNorm {
        residual: residual.map(Tensor::contiguous).transpose()?,
        norm: match norm {
            Some((g, b, _)) => Some((g.contiguous()?, b.contiguous()?)),
            None => None,
        },
        eps: norm.map_or(0.0, |(_, _, eps)| eps as f32),
    };
    let out = x.contiguous()?.apply_op3_no_bwd(&weight.contiguous()?, &bias.contiguous()?, &op)?;
    if op.norm.is_some() {
        Ok((out.get(0)?, out.get(1)?))
    } else {
        Ok((out.clone(), out))
    }
}
