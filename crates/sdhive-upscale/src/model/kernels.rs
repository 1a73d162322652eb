//! This crate's CUDA kernels (`kernels.cu`) as candle custom ops, for channels-last maps on a GPU: the dense blocks'
//! join with LeakyReLU in the same pass, LeakyReLU alone, and the residual `s·a + b`. Each takes whole 16-byte
//! vectors per row from 16-byte boundaries ([`takes`]); callers fall back to candle's ops elsewhere.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{
    bail, builder_arg, CpuStorage, CudaDevice, CudaStorage, CustomOp1, CustomOp2, DType, Layout, Result,
    Shape, Tensor,
};
use half::{bf16, f16};

const MODULE: &str = "sdhive_upscale";
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/upscale_kernels.ptx"));
const THREADS: u32 = 256;

/// Whether the kernels take these tensors: on one CUDA device, one float dtype, contiguous from a 16-byte
/// boundary, rows (last dimension) of whole 16-byte vectors. `SDHIVE_FUSED_KERNELS=0` (the project's switch for its fused kernels) turns these off too.
pub(crate) fn takes(tensors: &[&Tensor]) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("SDHIVE_FUSED_KERNELS").map_or(true, |v| v != "0"));
    let Some(first) = tensors.first() else { return false };
    on && tensors.iter().all(|t| {
        let size = t.dtype().size_in_bytes();
        t.device().is_cuda()
            && t.device().same_device(first.device())
            && t.dtype() == first.dtype()
            && matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16)
            && t.is_contiguous()
            && (t.layout().start_offset() * size) % 16 == 0
            && t.dims().last().is_some_and(|&c| (c * size) % 16 == 0)
    })
}

fn suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        other => bail!("sdhive-upscale kernels: unsupported dtype {other:?}"),
    })
}

fn per_vector<T>() -> usize {
    16 / std::mem::size_of::<T>()
}

fn grid_for(n: usize) -> u32 {
    n.div_ceil(THREADS as usize).clamp(1, 65_535) as u32
}

fn config(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid_for(n), 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(s.as_cuda_slice::<T>()?.slice(start..end)),
        None => bail!("sdhive-upscale kernels: operands must be contiguous"),
    }
}

fn last_dim(l: &Layout) -> usize {
    l.dims().last().copied().unwrap_or(0)
}

macro_rules! by_dtype {
    ($dtype:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F16 => $f::<f16>($($arg),*),
            DType::BF16 => $f::<bf16>($($arg),*),
            other => bail!("sdhive-upscale kernels: unsupported dtype {other:?}"),
        }
    };
}

/// `cat([a, leaky_relu(b)], -1)`.
struct CatLeakyRelu;

fn cat_launch<T: CudaDType + DeviceRepr>(
    a: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dev: &CudaDevice = a.0.device();
    let (ca, cb) = (last_dim(a.1), last_dim(b.1));
    let rows = a.1.shape().elem_count() / ca.max(1);
    let vec = per_vector::<T>();
    let (av, bv) = (view::<T>(a.0, a.1)?, view::<T>(b.0, b.1)?);
    // SAFETY: written in full by the kernel.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(rows * (ca + cb))? };
    let func =
        dev.get_or_load_custom_func(&format!("cat_leaky_relu_{}", suffix(a.0.dtype())?), MODULE, PTX)?;
    let mut k = func.builder();
    k.arg(&av);
    k.arg(&bv);
    k.arg(&out);
    builder_arg!(k, (ca / vec) as u32, (cb / vec) as u32, rows);
    // SAFETY: the arguments match the kernel's signature; both inputs hold `rows` rows of whole vectors.
    unsafe { k.launch(config(rows * (ca + cb) / vec)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

impl CustomOp2 for CatLeakyRelu {
    fn name(&self) -> &'static str {
        "sdhive-upscale-cat-leaky-relu"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("{} runs on CUDA only", self.name())
    }

    fn cuda_fwd(
        &self,
        a: &CudaStorage,
        al: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let out = by_dtype!(a.dtype(), cat_launch((a, al), (b, bl)))?;
        let mut dims = al.dims().to_vec();
        if let Some(c) = dims.last_mut() {
            *c += last_dim(bl);
        }
        Ok((out, Shape::from(dims)))
    }
}

/// Channels-last `a` and `leaky_relu(b)` joined along their channels in one pass. Call only where [`takes`] both
/// and their other dimensions agree.
pub(crate) fn cat_leaky_relu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (da, db) = (a.dims(), b.dims());
    if da.len() != db.len() || da.len() < 2 || da[..da.len() - 1] != db[..db.len() - 1] {
        bail!("cat_leaky_relu: {da:?} and {db:?} differ outside their channels");
    }
    a.apply_op2_no_bwd(b, &CatLeakyRelu)
}

/// `leaky_relu(x)`, out of place.
struct LeakyRelu;

fn leaky_launch<T: CudaDType + DeviceRepr>(x: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.device();
    let n = l.shape().elem_count() / per_vector::<T>();
    let xv = view::<T>(x, l)?;
    // SAFETY: written in full by the kernel.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(l.shape().elem_count())? };
    let func = dev.get_or_load_custom_func(&format!("leaky_relu_{}", suffix(x.dtype())?), MODULE, PTX)?;
    let mut k = func.builder();
    k.arg(&xv);
    k.arg(&out);
    builder_arg!(k, n);
    // SAFETY: the arguments match the kernel's signature.
    unsafe { k.launch(config(n)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

impl CustomOp1 for LeakyRelu {
    fn name(&self) -> &'static str {
        "sdhive-upscale-leaky-relu"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("{} runs on CUDA only", self.name())
    }

    fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        Ok((by_dtype!(x.dtype(), leaky_launch(x, l))?, l.shape().clone()))
    }
}

/// LeakyReLU(0.2) in one pass. Call only where [`takes`] `x`.
pub(crate) fn leaky_relu(x: &Tensor) -> Result<Tensor> {
    x.apply_op1_no_bwd(&LeakyRelu)
}

/// `s·a + b`.
struct ScaleAdd(f32);

fn scale_add_launch<T: CudaDType + DeviceRepr>(
    s: f32,
    a: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dev: &CudaDevice = a.0.device();
    let elems = a.1.shape().elem_count();
    let n = elems / per_vector::<T>();
    let (av, bv) = (view::<T>(a.0, a.1)?, view::<T>(b.0, b.1)?);
    // SAFETY: written in full by the kernel.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(elems)? };
    let func = dev.get_or_load_custom_func(&format!("scale_add_{}", suffix(a.0.dtype())?), MODULE, PTX)?;
    let mut k = func.builder();
    k.arg(&av);
    k.arg(&bv);
    k.arg(&out);
    builder_arg!(k, s, n);
    // SAFETY: the arguments match the kernel's signature; both inputs hold `n` vectors.
    unsafe { k.launch(config(n)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

impl CustomOp2 for ScaleAdd {
    fn name(&self) -> &'static str {
        "sdhive-upscale-scale-add"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("{} runs on CUDA only", self.name())
    }

    fn cuda_fwd(
        &self,
        a: &CudaStorage,
        al: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        Ok((by_dtype!(a.dtype(), scale_add_launch(self.0, (a, al), (b, bl)))?, al.shape().clone()))
    }
}

/// `s·a + b` in one pass, `a` and `b` of one shape. Call only where [`takes`] both.
pub(crate) fn scale_add(a: &Tensor, s: f64, b: &Tensor) -> Result<Tensor> {
    if a.dims() != b.dims() {
        bail!("scale_add: {:?} and {:?} differ", a.dims(), b.dims());
    }
    a.apply_op2_no_bwd(b, &ScaleAdd(s as f32))
}
