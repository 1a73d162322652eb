//! The fused attention kernels of `attention.cu` as a candle custom op over the projections' `(B, S, H·D)` q, k and
//! v: layout checks, the instantiation for the head dimension, storage type and device (the Hopper kernels from the
//! compute_90a PTX on compute capability 9.0), the launch.

use crate::cuda::{built_for, tensor_map, MapShape, TmaMap};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{self, CUdevice_attribute};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{
    bail, builder_arg, CudaDevice, CudaStorage, DType, Layout, Result, Shape, Tensor, WithDType,
};
use half::{bf16, f16};

const MODULE: &str = "sdhive_attention";
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
/// The same source for compute_90a (empty unless built for 9.0): the Hopper kernels.
const HOPPER_MODULE: &str = "sdhive_attention_sm90a";
const HOPPER_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention_sm90a.ptx"));
/// The head dimensions the kernels are instantiated for (a head of D values runs in the smallest DP ≥ D).
const PADDED_DIMS: [usize; 8] = [16, 32, 48, 64, 80, 96, 128, 160];

fn padded_dim(d: usize) -> Option<usize> {
    PADDED_DIMS.iter().copied().find(|&p| p >= d)
}

/// The Hopper kernels' block shapes (attention.cu's `HOPPER_BOTH` table): for head dimension `d`, the warpgroups
/// of 64 query rows per block and the dynamic shared memory (attention.cu's `Tiles`): three stages (four with the
/// mbarrier ring, D 64 and 80) of a 64-key K tile (D padded to whole k-steps of 16) and V tile (D columns, one more
/// chunk of ones at D 40 and 64), plus each warpgroup's Q tile where Q is read from shared memory (D 80).
fn hopper_shape(d: usize) -> Option<(usize, usize)> {
    let (warpgroups, q_shared, stages, ones) = match d {
        40 => (2, false, 3, 1),
        64 => (3, false, 4, 1),
        80 => (2, true, 4, 0),
        _ => return None,
    };
    let (kc, vc) = (d.div_ceil(16) * 2, d / 8 + ones);
    let q_tiles = if q_shared { warpgroups * 64 * kc * 16 } else { 0 };
    Some((warpgroups, stages * 64 * (kc + vc) * 16 + q_tiles))
}

/// The short-key kernel (attention.cu's `cross_attention`, instantiated by `CROSS_BOTH`) up to this many keys:
/// all of a (batch, head)'s keys and values stay in a block's shared memory.
const CROSS_KEYS: usize = 128;
/// Its key tile: K and V's rows in shared memory are zeroed up to a whole number of them.
const CROSS_TILE: usize = 80;

/// The short-key kernel's block for head dimension `d` (`CROSS_BOTH` in attention.cu): warps, 16-row atoms per
/// warp.
fn cross_shape(d: usize) -> Option<(usize, usize)> {
    match d {
        40 => Some((4, 2)),
        64 => Some((4, 1)),
        80 => Some((8, 1)),
        160 => Some((4, 1)),
        _ => None,
    }
}

/// Its dynamic shared memory for `sk` keys: K and V's rows up to a whole key tile and each warp's two Q tiles of
/// 16·atoms rows, rows of D padded to whole k-steps of 16 plus 8 elements.
fn cross_smem(d: usize, sk: usize, warps: usize, atoms: usize) -> usize {
    (2 * sk.div_ceil(CROSS_TILE) * CROSS_TILE + warps * 2 * 16 * atoms) * (d.div_ceil(16) * 16 + 8) * 2
}

/// An mma.sync instantiation's block (the table at the end of attention.cu): keys per stage (all key groups'),
/// query rows, key groups, threads.
struct MmaBlock {
    keys: usize,
    rows: usize,
    groups: usize,
    threads: u32,
}

/// The padded head dimensions with a key-split instantiation (`FLASH_SPLIT_BOTH`).
const SPLIT_DIMS: [usize; 1] = [160];

/// The block of the instantiation for padded head dimension `dp`: 4 warps of 16-row atoms (two atoms each at DP
/// 48), or the split one's 2 warps times 4 key groups of 32 keys.
fn block_shape(dp: usize, split: bool) -> MmaBlock {
    let (keys, rows, groups, threads) = match dp {
        _ if split => (128, 32, 4, 256),
        48 => (32, 128, 1, 128),
        _ if dp <= 96 => (64, 64, 1, 128),
        _ => (32, 64, 1, 128),
    };
    MmaBlock { keys, rows, groups, threads }
}

/// Dynamic shared memory of the instantiation (attention.cu's layout): two stages of a K and a V tile, rows padded
/// by 8 elements, the query tile staged from the second stage on; afterwards the same space takes the later key
/// groups' outputs, maxima and sums (per 16 rows, DP/8 + 1 tiles of 512 bytes).
fn smem_bytes(dp: usize, split: bool) -> usize {
    let s = block_shape(dp, split);
    let stages = (4 * s.keys).max(2 * s.keys + s.rows) * (dp + 8) * 2;
    stages.max((s.groups - 1) * s.rows / 16 * (dp / 8 + 1) * 512)
}

/// One of `dev`'s attributes, as a count.
fn device_attribute(dev: &CudaDevice, attr: CUdevice_attribute) -> Result<usize> {
    Ok(dev.cuda_stream().context().attribute(attr).w()? as usize)
}

/// Whether the build targets GPUs with the kernel's instructions (mma.sync with bf16, cp.async: sm_80).
pub fn built_for_sm80() -> bool {
    built_for() >= 80
}

/// The kernel for one head dimension on one device.
enum Kernel {
    /// A Hopper (wgmma) kernel: `warpgroups` of 64 query rows per block, `smem` bytes of dynamic shared memory;
    /// `tma`: its instantiation whose K and V tiles come in by the tensor memory accelerator.
    Hopper { d: usize, warpgroups: usize, smem: usize, tma: bool },
    /// The mma.sync kernel for padded head dimension `dp`, or its key-split instantiation.
    MmaSync { dp: usize, split: bool },
    /// The short-key kernel: `warps` warps of `atoms` 16-row atoms, `smem` bytes of dynamic shared memory;
    /// `causal`: its instantiation with a causal mask (`CAUSAL` in attention.cu).
    Cross { d: usize, warps: usize, atoms: usize, smem: usize, causal: bool },
}

/// The head dimensions the short-key kernel has a causal instantiation for (the CLIP text encoders').
const CAUSAL_DIMS: [usize; 1] = [64];

impl Kernel {
    /// A Hopper kernel for heads of 40, 64 and 80 where the build has them and the device is compute capability 9.0
    /// (their sm_90a PTX loads nowhere else), else the mma.sync kernel for the padded head dimension. The Hopper
    /// kernels address a 64-key tile of K and V in 32-bit element offsets, so their rows (`key_stride` elements
    /// apart, the larger of the two) must lie less than 2^26 apart.
    fn for_head(dev: &CudaDevice, d: usize, key_stride: usize, tma: bool) -> Result<Self> {
        if let Some((warpgroups, smem)) = hopper_shape(d) {
            if !HOPPER_PTX.is_empty()
                && key_stride < 1 << 26
                && dev.cuda_stream().context().compute_capability().w()? == (9, 0)
            {
                return Ok(Kernel::Hopper { d, warpgroups, smem, tma });
            }
        }
        let Some(dp) = padded_dim(d) else { bail!("fused attention: head dimension {d} is over 160") };
        Ok(Kernel::MmaSync { dp, split: false })
    }

    /// The short-key kernel where it has an instantiation for heads of `d`, the `sk` keys are at most
    /// [`CROSS_KEYS`] and its shared memory fits the device's; measured faster than the others at every UNet
    /// shape with 77 keys (notes at `CROSS_BOTH` in attention.cu).
    fn for_keys(dev: &CudaDevice, d: usize, sk: usize) -> Result<Option<Self>> {
        let Some((warps, atoms)) = cross_shape(d) else { return Ok(None) };
        let smem = cross_smem(d, sk, warps, atoms);
        let optin = CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
        if sk > CROSS_KEYS || smem > device_attribute(dev, optin)? {
            return Ok(None);
        }
        Ok(Some(Kernel::Cross { d, warps, atoms, smem, causal: false }))
    }

    /// [`Kernel::for_head`] for `sk` keys and `blocks(rows)` blocks of `rows` query rows: the short-key kernel up
    /// to [`CROSS_KEYS`] keys ([`Kernel::for_keys`]); else the key-split instantiation where its blocks (one per SM)
    /// fit in one wave and its shared memory in the device's, as at SD1.5's 16² and 8² maps, whose 64-row grids
    /// leave most SMs idle.
    fn for_launch(
        dev: &CudaDevice,
        d: usize,
        sk: usize,
        key_stride: usize,
        tma: bool,
        blocks: impl Fn(usize) -> usize,
    ) -> Result<Self> {
        if let Some(cross) = Self::for_keys(dev, d, sk)? {
            return Ok(cross);
        }
        let kernel = Self::for_head(dev, d, key_stride, tma)?;
        if let Kernel::MmaSync { dp, .. } = kernel {
            if SPLIT_DIMS.contains(&dp) {
                let sms =
                    device_attribute(dev, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
                let smem = device_attribute(
                    dev,
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                )?;
                if blocks(block_shape(dp, true).rows) <= sms && smem_bytes(dp, true) <= smem {
                    return Ok(Kernel::MmaSync { dp, split: true });
                }
            }
        }
        Ok(kernel)
    }

    fn name(&self, dtype: DType) -> Result<String> {
        let sfx = match dtype {
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            other => bail!("fused attention: unsupported dtype {other:?}"),
        };
        Ok(match self {
            Kernel::Hopper { d, tma: false, .. } => format!("attention_wgmma_d{d}_{sfx}"),
            Kernel::Hopper { d, tma: true, .. } => format!("attention_wgmma_d{d}_tma_{sfx}"),
            Kernel::MmaSync { dp, split: false } => format!("flash_attention_d{dp}_{sfx}"),
            Kernel::MmaSync { dp, split: true } => format!("flash_attention_d{dp}_split_{sfx}"),
            Kernel::Cross { d, causal: false, .. } => format!("cross_attention_d{d}_{sfx}"),
            Kernel::Cross { d, causal: true, .. } => format!("causal_attention_d{d}_{sfx}"),
        })
    }
}

/// The name of the kernel that runs attention with head dimension `d` in `dtype` on `dev` ([`Kernel::for_head`]),
/// for keys and values whose rows lie `key_stride` elements apart (a small grid may take the key-split
/// instantiation instead, [`Kernel::for_launch`]).
pub fn kernel_for(dev: &CudaDevice, d: usize, dtype: DType, key_stride: usize) -> Result<String> {
    Kernel::for_head(dev, d, key_stride, tma_on())?.name(dtype)
}

/// The name of the kernel that runs attention with head dimension `d` over `sk` keys in `dtype` on `dev`: the
/// short-key kernel ([`Kernel::for_keys`]) or [`kernel_for`]'s.
pub fn kernel_for_keys(
    dev: &CudaDevice,
    d: usize,
    sk: usize,
    dtype: DType,
    key_stride: usize,
) -> Result<String> {
    match Kernel::for_keys(dev, d, sk)? {
        Some(cross) => cross.name(dtype),
        None => kernel_for(dev, d, dtype, key_stride),
    }
}

/// Why the fused kernel cannot take these projections, or `None` when it can.
pub fn unsupported(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize) -> Option<String> {
    if !built_for_sm80() {
        return Some(format!("built for compute capability {}; the kernel needs 8.0", built_for()));
    }
    if !q.device().is_cuda() || !k.device().same_device(q.device()) || !v.device().same_device(q.device()) {
        return Some("tensors are not on one CUDA device".into());
    }
    if !matches!(q.dtype(), DType::F16 | DType::BF16) || k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        return Some(format!("dtype {:?} (f16 or bf16 only)", q.dtype()));
    }
    let (Ok((b, _, c)), Ok((kb, sk, kc)), Ok((vb, vs, vc))) = (q.dims3(), k.dims3(), v.dims3()) else {
        return Some("q, k and v must be (B, S, H·D)".into());
    };
    if heads == 0
        || !c.is_multiple_of(heads)
        || kb != b
        || vb != b
        || kc != c
        || vc != c
        || vs != sk
        || sk == 0
    {
        return Some(format!("shapes q {:?} k {:?} v {:?} with {heads} heads", q.dims(), k.dims(), v.dims()));
    }
    let d = c / heads;
    if !d.is_multiple_of(8) || padded_dim(d).is_none() {
        return Some(format!("head dimension {d} (a multiple of 8 up to 160)"));
    }
    // 16-byte loads: every row start a multiple of 8 elements.
    for t in [q, k, v] {
        let l = t.layout();
        if l.stride()[2] != 1
            || !l.stride()[1].is_multiple_of(8)
            || !l.stride()[0].is_multiple_of(8)
            || !l.start_offset().is_multiple_of(8)
        {
            return Some(format!(
                "layout {:?} offset {} (rows of 8-aligned elements)",
                l.stride(),
                l.start_offset()
            ));
        }
    }
    None
}

/// Why the causal kernel cannot take these projections (self-attention: as many queries as keys, at most
/// [`CROSS_KEYS`] of them, heads of a dimension in [`CAUSAL_DIMS`]), or `None` when it can.
pub fn unsupported_causal(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize) -> Option<String> {
    if let Some(why) = unsupported(q, k, v, heads) {
        return Some(why);
    }
    let (sq, sk, d) = (q.dim(1).ok()?, k.dim(1).ok()?, q.dim(2).ok()? / heads);
    if sq != sk || sk > CROSS_KEYS || !CAUSAL_DIMS.contains(&d) {
        return Some(format!("causal attention over {sq} queries, {sk} keys, heads of {d}"));
    }
    let candle_core::Device::Cuda(dev) = q.device() else { return Some("not a CUDA device".into()) };
    match Kernel::for_keys(dev, d, sk) {
        Ok(Some(_)) => None,
        Ok(None) => Some(format!("{sk} keys of {d} values do not fit the short-key kernel's shared memory")),
        Err(e) => Some(e.to_string()),
    }
}

/// Whether the Hopper kernels take their TMA instantiations (`HOPPER_TMA` in attention.cu: K and V tiles by the
/// tensor memory accelerator; on an H100 SD1.5's (2, 4096, 8, 40) self-attention 152-154 against 167-170 µs,
/// (2, 1024, 8, 80) 23 against 26.6, SDXL's (2, 4096, 10, 64) 294 against 310). `SDHIVE_ATTENTION_TMA=0` keeps
/// the cp.async tile loads, to measure the two against each other.
pub(crate) fn tma_on() -> bool {
    switched_on!("SDHIVE_ATTENTION_TMA")
}

/// The 5-D tensor map the TMA kernel reads K or V (laid out as `l`) through: (8 values, `sk` keys, D/8 chunks of
/// 8, heads, batch) with the tensor's row and batch strides, boxes of one 64-key tile; keys past `sk` read as zeros.
/// `unsupported` has made every stride a multiple of 8 elements (16 bytes, as the driver requires).
fn kv_map<T: CudaDType + WithDType>(
    t: &CudaView<'_, T>,
    l: &Layout,
    stream: &CudaStream,
    (d, sk, heads, b): (usize, usize, usize, usize),
) -> Result<TmaMap> {
    let elem = T::DTYPE.size_in_bytes() as u64;
    let (bs, ss) = (l.stride()[0] as u64, l.stride()[1] as u64);
    let shape = MapShape {
        dims: &[8, sk as u64, (d / 8) as u64, heads as u64, b as u64],
        strides: &[ss * elem, 8 * elem, d as u64 * elem, bs * elem],
        boxes: &[8, 64, (d / 8) as u32, 1, 1],
        swizzle: sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
        l2: sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
    };
    tensor_map(t, stream, &shape, "fused attention")
}

struct Attention {
    heads: usize,
    scale: f32,
    /// Whether a Hopper kernel may take its TMA instantiation.
    tma: bool,
    /// Whether cuDNN's attention may take the shapes `cudnn_attention::chosen` gives it.
    #[cfg_attr(not(feature = "cudnn"), allow(dead_code))]
    cudnn: bool,
    /// Row r attends to keys 0..=r only (the short-key kernel's causal instantiation).
    causal: bool,
}

/// A tensor's storage from its first element on, as a kernel argument.
pub(crate) fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
    Ok(s.as_cuda_slice::<T>()?.slice(l.start_offset()..))
}

fn attention_launch<T: CudaDType + DeviceRepr + WithDType>(
    op: &Attention,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dev: &CudaDevice = q.0.device();
    let (b, sq, c) = q.1.shape().dims3()?;
    let sk = k.1.shape().dims3()?.1;
    let d = c / op.heads;
    #[cfg(feature = "cudnn")]
    if op.cudnn && !op.causal && crate::cudnn_attention::chosen(d, sk) {
        if let Some(out) = crate::cudnn_attention::attention::<T>((op.heads, op.scale), q, k, v)? {
            return Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()));
        }
    }
    let key_stride = k.1.stride()[1].max(v.1.stride()[1]);
    let mut kernel = if op.causal {
        match Kernel::for_keys(dev, d, sk)? {
            Some(Kernel::Cross { d, warps, atoms, smem, .. }) => {
                Kernel::Cross { d, warps, atoms, smem, causal: true }
            }
            _ => bail!("causal attention: no kernel for {sk} keys of {d} values"),
        }
    } else {
        Kernel::for_launch(dev, d, sk, key_stride, op.tma, |rows| b * op.heads * sq.div_ceil(rows))?
    };
    let (qs, ks, vs) = (view::<T>(q.0, q.1)?, view::<T>(k.0, k.1)?, view::<T>(v.0, v.1)?);
    // The TMA kernel's tensor maps; where the driver refuses one (a stride it cannot take, as a batch stride of
    // 0), the same kernel with cp.async tile loads.
    let mut maps = None;
    if let Kernel::Hopper { tma: tma @ true, .. } = &mut kernel {
        let stream = dev.cuda_stream();
        let map = |t: &CudaView<'_, T>, l: &Layout| kv_map(t, l, &stream, (d, sk, op.heads, b));
        match (map(&ks, k.1), map(&vs, v.1)) {
            (Ok(km), Ok(vm)) => maps = Some((km, vm)),
            _ => *tma = false,
        }
    }
    let name = kernel.name(q.0.dtype())?;
    // Blocks per (batch, head): one per block of query rows, or for the short-key kernel as many as give each warp
    // the fewest chunks of 16·atoms rows that the resident warps allow, so that its blocks run in one wave and
    // each warp's loop overlaps a chunk's Q load with the previous chunk's work (notes at `CROSS_BOTH` in
    // attention.cu).
    let (func, smem, width, threads) = match kernel {
        Kernel::Hopper { warpgroups, smem, .. } => {
            let func = dev.get_or_load_custom_func(&name, HOPPER_MODULE, HOPPER_PTX)?;
            crate::cuda::opt_in_shared(&func, smem)?;
            (func, smem, sq.div_ceil(64 * warpgroups), 128 * warpgroups as u32)
        }
        Kernel::MmaSync { dp, split } => {
            let (s, smem) = (block_shape(dp, split), smem_bytes(dp, split));
            let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
            crate::cuda::opt_in_shared(&func, smem)?;
            (func, smem, sq.div_ceil(s.rows), s.threads)
        }
        Kernel::Cross { warps, atoms, smem, .. } => {
            let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
            crate::cuda::opt_in_shared(&func, smem)?;
            let threads = 32 * warps as u32;
            let resident =
                func.occupancy_max_active_blocks_per_multiprocessor(threads, smem, None).w()?.max(1);
            let sms = device_attribute(dev, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            let chunks = sq.div_ceil(16 * atoms);
            let per_warp = (b * op.heads * chunks).div_ceil(sms * resident as usize * warps).max(1);
            (func, smem, chunks.div_ceil(warps * per_warp), threads)
        }
    };
    // SAFETY: every element is written by the kernel (each (row, head) by its block, all D columns).
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(b * sq * c)? };
    let mut a = func.builder();
    a.arg(&qs);
    a.arg(&ks);
    a.arg(&vs);
    a.arg(&out);
    let stride = |l: &Layout, i: usize| l.stride()[i] as i64;
    builder_arg!(
        a,
        sq as i32,
        sk as i32,
        d as i32,
        op.heads as i32,
        stride(q.1, 0),
        stride(q.1, 1),
        stride(k.1, 0),
        stride(k.1, 1),
        stride(v.1, 0),
        stride(v.1, 1),
        op.scale * std::f32::consts::LOG2_E
    );
    if let Some((km, vm)) = &maps {
        a.arg(km);
        a.arg(vm);
    }
    let cfg = LaunchConfig {
        grid_dim: (width as u32, op.heads as u32, b as u32),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // SAFETY: the arguments match the kernel's signature; `unsupported` checked the strides and alignment, and
    // the views start at each tensor's offset.
    unsafe { a.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

crate::cuda::cuda_op3!(Attention, "sdhive-attention", forward);

impl Attention {
    fn forward(
        &self,
        (q, ql): (&CudaStorage, &Layout),
        (k, kl): (&CudaStorage, &Layout),
        (v, vl): (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let out = match q.dtype() {
            DType::F16 => attention_launch::<f16>(self, (q, ql), (k, kl), (v, vl))?,
            DType::BF16 => attention_launch::<bf16>(self, (q, ql), (k, kl), (v, vl))?,
            other => bail!("fused attention: unsupported dtype {other:?}"),
        };
        Ok((out, ql.shape().clone()))
    }
}

pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, scale: f64) -> Result<Tensor> {
    attention_with(q, k, v, heads, scale, Kernels { tma: tma_on(), cudnn: true })
}

pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, scale: f64) -> Result<Tensor> {
    if let Some(why) = unsupported_causal(q, k, v, heads) {
        bail!("causal attention cannot take these tensors: {why}");
    }
    q.apply_op3_no_bwd(
        k,
        v,
        &Attention { heads, scale: scale as f32, tma: false, cudnn: false, causal: true },
    )
}

/// Which of the kernels that take a shape [`attention_with`] may run (the tests compare them).
#[derive(Clone, Copy)]
pub(crate) struct Kernels {
    /// The Hopper kernels' TMA instantiation.
    pub tma: bool,
    /// cuDNN's attention (in builds with the `cudnn` feature).
    pub cudnn: bool,
}

pub(crate) fn attention_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    scale: f64,
    Kernels { tma, cudnn }: Kernels,
) -> Result<Tensor> {
    if let Some(why) = unsupported(q, k, v, heads) {
        bail!("fused attention cannot take these tensors: {why}");
    }
    q.apply_op3_no_bwd(k, v, &Attention { heads, scale: scale as f32, tma, cudnn, causal: false })
}
