//! The kernels as candle custom ops: each checks its layouts, picks the instantiation for the storage dtype and
//! launches on the tensors' own device and stream.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{self, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, LaunchArgs, LaunchConfig,
    PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{
    bail, builder_arg, CpuStorage, CudaDevice, CudaStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device,
    Layout, Result, Shape, Storage, Tensor,
};
use half::{bf16, f16};

const MODULE: &str = "sdhive_cuda_kernels";
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));
const THREADS: u32 = 256;

pub(crate) fn suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        other => bail!("sdhive-cuda-kernels: unsupported dtype {other:?}"),
    })
}

pub(crate) fn contiguous<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(s.as_cuda_slice::<T>()?.slice(start..end)),
        None => bail!("sdhive-cuda-kernels: {what} must be contiguous"),
    }
}

/// A tensor a custom op holds beside its operands (a residual, a shift), read-locked by `storage_and_layout`, as
/// a contiguous view of its CUDA buffer.
pub(crate) fn held_view<'a, T: CudaDType, G: std::ops::Deref<Target = Storage>>(
    held: &'a (G, &Layout),
    what: &str,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
    match &*held.0 {
        Storage::Cuda(s) => contiguous::<T>(s, held.1, what),
        _ => bail!("sdhive-cuda-kernels: {what} is not on the GPU"),
    }
}

/// A held `(N, C)` matrix whose rows are contiguous but may lie further apart than `C` (columns of a wider
/// table), as a view from its first to its last element and the distance between its rows.
fn held_rows_view<'a, T: CudaDType, G: std::ops::Deref<Target = Storage>>(
    held: &'a (G, &Layout),
    what: &str,
) -> Result<(candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>, usize)> {
    let Storage::Cuda(s) = &*held.0 else { bail!("sdhive-cuda-kernels: {what} is not on the GPU") };
    rows_view(s, held.1, what)
}

/// A `(N, C)` operand whose rows are contiguous but may lie further apart than `C` (a chunk of a wider table,
/// read in place), as a view from its first to its last element and the distance between its rows.
fn rows_view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<(candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>, usize)> {
    match (l.dims(), l.stride()) {
        ([n, c], [rs, 1]) if *n > 0 && *c > 0 => {
            let start = l.start_offset();
            let end = start + (n - 1) * rs + c;
            Ok((s.as_cuda_slice::<T>()?.slice(start..end), if *n == 1 { *c } else { *rs }))
        }
        (dims, strides) => {
            bail!("sdhive-cuda-kernels: {what} must be a matrix of contiguous rows, not {dims:?} {strides:?}")
        }
    }
}

/// Opts `func` in to `smem` bytes of dynamic shared memory where that is above the 48 KiB every kernel gets: before
/// its launch, and before an occupancy query counts on it.
pub(crate) fn opt_in_shared(func: &CudaFunction, smem: usize) -> Result<()> {
    if smem > 48 * 1024 {
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .w()?;
    }
    Ok(())
}

/// Whether a module's sm_90a PTX (`ptx`, empty unless the build is for compute capability 9.0) loads on `device`:
/// a CUDA device of compute capability 9.0 exactly.
pub(crate) fn sm90a_loads(device: &Device, ptx: &str) -> bool {
    match device {
        Device::Cuda(dev) => {
            !ptx.is_empty() && dev.cuda_stream().context().compute_capability().is_ok_and(|cc| cc == (9, 0))
        }
        _ => false,
    }
}

/// CUtensorMap's 128 opaque bytes as a kernel argument passed by value (`TmaMap` in wgmma_common.cuh).
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(crate) struct TmaMap(sys::CUtensorMap);
// SAFETY: plain bytes written by the driver, copied into the kernel's parameter space as they are.
unsafe impl DeviceRepr for TmaMap {}

/// How a tensor map lays its boxes out in shared memory and what it asks of L2.
pub(crate) struct MapShape<'a> {
    /// Elements per dimension, innermost first.
    pub dims: &'a [u64],
    /// Bytes between consecutive indices of every dimension but the innermost (multiples of 16).
    pub strides: &'a [u64],
    /// Elements per box in each dimension.
    pub boxes: &'a [u32],
    pub swizzle: sys::CUtensorMapSwizzle,
    pub l2: sys::CUtensorMapL2promotion,
}

/// A tiled tensor map over the f16/bf16 view `t` for the tensor memory accelerator; elements outside `dims` read
/// as zeros. `what` names the op in the error where the driver refuses the map (an unaligned address or stride).
pub(crate) fn tensor_map<T: CudaDType + candle_core::WithDType>(
    t: &CudaView<'_, T>,
    stream: &CudaStream,
    shape: &MapShape<'_>,
    what: &str,
) -> Result<TmaMap> {
    let data_type = match T::DTYPE {
        DType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        other => bail!("{what}: no tensor map for {other:?}"),
    };
    let rank = shape.dims.len();
    if !(1..=5).contains(&rank) || shape.strides.len() + 1 != rank || shape.boxes.len() != rank {
        bail!(
            "{what}: a tensor map of {rank} dimensions with {} strides and {} box sizes",
            shape.strides.len(),
            shape.boxes.len()
        );
    }
    let ones = [1u32; 5];
    let (ptr, _guard) = t.device_ptr(stream);
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: the arrays hold the `rank` dimensions, rank - 1 strides, rank box sizes and (at least) rank element
    // strides the driver reads; `map` is written in full on success, and the pointer is the view's live address.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            data_type,
            rank as u32,
            ptr as *mut std::ffi::c_void,
            shape.dims.as_ptr(),
            shape.strides.as_ptr(),
            shape.boxes.as_ptr(),
            ones.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            shape.swizzle,
            shape.l2,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        bail!("{what}: tensor map over {:?} with strides {:?} refused: {r:?}", shape.dims, shape.strides);
    }
    // SAFETY: written by the successful call above.
    Ok(TmaMap(unsafe { map.assume_init() }))
}

/// Whether a view starts on 16 bytes for 2-byte elements (an element offset that is a multiple of 8; candle's
/// allocations themselves are aligned), as kernels reading 16-byte chunks need.
pub(crate) fn aligned16(l: &Layout) -> bool {
    l.start_offset().is_multiple_of(8)
}

pub(crate) fn cpu_only(name: &str) -> Result<(CpuStorage, Shape)> {
    bail!("{name} is a CUDA kernel; the CPU has its own path")
}

/// Blocks for a grid-stride loop over `n` items (one per thread): enough to fill the GPU, no more.
fn grid_for(n: usize) -> u32 {
    (n.div_ceil(THREADS as usize)).clamp(1, 65_535) as u32
}

/// Items of a kernel that takes 16 bytes per thread when `vectorizable` (and its pointers are aligned, which
/// candle's allocations are), one element otherwise. Sizing the grid by elements there would launch
/// 16/size_of::<T>() times the threads, the surplus exiting at once: for the GEGLU that doubled its time.
fn items<T>(n: usize, vectorizable: bool) -> usize {
    if vectorizable {
        n / per_vector::<T>()
    } else {
        n
    }
}

/// Elements of T in one 16-byte load.
pub(crate) fn per_vector<T>() -> usize {
    16 / std::mem::size_of::<T>()
}

macro_rules! by_dtype {
    ($dtype:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F16 => $f::<f16>($($arg),*),
            DType::BF16 => $f::<bf16>($($arg),*),
            other => bail!("sdhive-cuda-kernels: unsupported dtype {other:?}"),
        }
    };
}

pub(crate) use by_dtype;

/// The scalars a kernel takes after its buffers, pushed in order.
pub(crate) trait Scalars {
    fn push<'a>(&'a self, k: &mut LaunchArgs<'a>);
}

macro_rules! scalars {
    ($($t:ident $i:tt),+) => {
        impl<$($t: DeviceRepr),+> Scalars for ($($t,)+) {
            fn push<'a>(&'a self, k: &mut LaunchArgs<'a>) {
                $(k.arg(&self.$i);)+
            }
        }
    };
}

scalars!(A 0);
scalars!(A 0, B 1);
scalars!(A 0, B 1, C 2);

/// A kernel by name in a PTX module: `(kernel, module, ptx)`.
pub(crate) type Kernel<'a> = (&'a str, &'a str, &'a str);

/// Runs a grid-stride `kernel(inputs…, out, scalars…)` over `items` (one per thread) and returns `out`, a new
/// buffer of `out_elems` elements that the kernel must write in full; the inputs are read as contiguous T buffers.
pub(crate) fn launch_over<T: CudaDType + DeviceRepr>(
    (name, module, ptx): Kernel<'_>,
    inputs: &[(&CudaStorage, &Layout)],
    out_elems: usize,
    items: usize,
    scalars: impl Scalars,
) -> Result<CudaStorage> {
    let Some(&(first, _)) = inputs.first() else {
        bail!("sdhive-cuda-kernels: {name} launched without inputs")
    };
    let dev: &CudaDevice = first.device();
    let views = inputs
        .iter()
        .map(|&(s, l)| contiguous::<T>(s, l, "every input"))
        .collect::<Result<Vec<_>>>()
        .map_err(|e| e.context(format!("launching {name}")))?;
    // SAFETY: written in full by the kernel (the caller's contract above).
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(out_elems)? };
    let func = dev.get_or_load_custom_func(name, module, ptx)?;
    let mut k = func.builder();
    for v in &views {
        k.arg(v);
    }
    k.arg(&out);
    scalars.push(&mut k);
    let cfg =
        LaunchConfig { grid_dim: (grid_for(items), 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the callers pass the arguments each kernel's signature takes, the inputs holding `items` items.
    unsafe { k.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// The custom op of a kernel over two or three operands (`CustomOp2`, `CustomOp3`), CUDA only:
/// `|op, a, b[, c]| forward` takes the op and each operand's storage and layout and returns the output with its
/// shape.
macro_rules! cuda_op {
    ($op:ty, $name:literal, |$s:pat_param, $a:ident, $b:ident| $forward:expr) => {
        $crate::cuda::cuda_op!(@impl CustomOp2, $op, $name, [a al, b bl], |$s, $a, $b| $forward);
    };
    ($op:ty, $name:literal, |$s:pat_param, $a:ident, $b:ident, $c:ident| $forward:expr) => {
        $crate::cuda::cuda_op!(@impl CustomOp3, $op, $name, [a al, b bl, c cl], |$s, $a, $b, $c| $forward);
    };
    (@impl $trait:ident, $op:ty, $name:literal, [$($x:ident $xl:ident),+], |$s:pat_param, $($v:ident),+|
        $forward:expr) => {
        impl candle_core::$trait for $op {
            fn name(&self) -> &'static str {
                $name
            }

            fn cpu_fwd(
                &self,
                $($x: &candle_core::CpuStorage, $xl: &candle_core::Layout),+
            ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
                let _ = ($($x, $xl),+);
                $crate::cuda::cpu_only($name)
            }

            fn cuda_fwd(
                &self,
                $($x: &candle_core::CudaStorage, $xl: &candle_core::Layout),+
            ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
                let ($s, $($v),+) = (self, $(($x, $xl)),+);
                $forward
            }
        }
    };
}
pub(crate) use cuda_op;

/// [`cuda_op`] over three operands with the op's method `$forward(&self, a, b, c)` as the forward pass.
macro_rules! cuda_op3 {
    ($op:ty, $name:literal, $forward:ident) => {
        $crate::cuda::cuda_op!($op, $name, |op, a, b, c| op.$forward(a, b, c));
    };
}
pub(crate) use cuda_op3;

/// The custom op of a normalisation: input, weight and bias in, output shaped like the input, CUDA only; `$launch`
/// is generic over the storage type.
macro_rules! normalisation_op {
    ($op:ty, $name:literal, $launch:ident) => {
        impl $op {
            fn normalisation_forward(
                &self,
                x: (&CudaStorage, &Layout),
                w: (&CudaStorage, &Layout),
                b: (&CudaStorage, &Layout),
            ) -> Result<(CudaStorage, Shape)> {
                let out = by_dtype!(x.0.dtype(), $launch(self, x, w, b))?;
                Ok((out, x.1.shape().clone()))
            }
        }
        cuda_op3!($op, $name, normalisation_forward);
    };
}

/// The custom ops of a product with an optional bias, CUDA only: two operands (input, weight) without, three with
/// the bias third; `$run(op, x, w, bias)` takes both and returns the output with its shape.
macro_rules! optional_bias_op {
    ($op:ty, $name:literal, $name_bias:literal, $run:ident) => {
        $crate::cuda::cuda_op!($op, $name, |op, x, w| op.$run(x, w, None));
        $crate::cuda::cuda_op!($op, $name_bias, |op, x, w, b| op.$run(x, w, Some(b)));
    };
}
pub(crate) use optional_bias_op;

/// The custom op of a one-input kernel, CUDA only: `$launch(op, x, layout)` is generic over the storage type and
/// `$shape(op, layout)` gives the output's shape.
macro_rules! single_input_op {
    ($op:ty, $name:literal, $launch:ident, $shape:expr) => {
        impl CustomOp1 for $op {
            fn name(&self) -> &'static str {
                $name
            }

            fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
                cpu_only(self.name())
            }

            fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
                let out = by_dtype!(x.dtype(), $launch(self, x, l))?;
                let shape: fn(&$op, &Layout) -> Result<Shape> = $shape;
                Ok((out, shape(self, l)?))
            }
        }
    };
}
pub(crate) use single_input_op;

struct GroupNorm {
    groups: usize,
    eps: f32,
    silu: bool,
}

fn group_norm_launch<T: CudaDType + DeviceRepr>(
    op: &GroupNorm,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.0.device();
    let dims = x.1.dims();
    let (batch, channels) = (dims[0], dims[1]);
    let inner: usize = dims[2..].iter().product();
    let group_elems = channels / op.groups * inner;
    let groups_total = batch * op.groups;
    // Enough blocks per group to fill the GPU, each reading at least a few thousand values.
    let chunks = group_elems.div_ceil(4096).clamp(1, 256);
    let sfx = suffix(x.0.dtype())?;
    let xs = contiguous::<T>(x.0, x.1, "group_norm input")?;
    let ws = contiguous::<T>(w.0, w.1, "group_norm weight")?;
    let bs = contiguous::<T>(b.0, b.1, "group_norm bias")?;
    // SAFETY: every element is written by the stats kernel before the apply kernel reads it.
    let partial: CudaSlice<f32> = unsafe { dev.alloc::<f32>(groups_total * chunks * 3)? };
    // SAFETY: written in full by the apply kernel.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(batch * channels * inner)? };
    let cfg = LaunchConfig {
        grid_dim: (chunks as u32, groups_total as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let stats = dev.get_or_load_custom_func(&format!("gn_stats_{sfx}"), MODULE, PTX)?;
    let mut a = stats.builder();
    a.arg(&xs);
    a.arg(&partial);
    builder_arg!(a, group_elems as u32, chunks as u32);
    // SAFETY: the arguments match the kernel's signature; the buffers hold the sizes computed above.
    unsafe { a.launch(cfg) }.w()?;
    let apply = dev.get_or_load_custom_func(&format!("gn_apply_{sfx}"), MODULE, PTX)?;
    let mut a = apply.builder();
    a.arg(&xs);
    a.arg(&ws);
    a.arg(&bs);
    a.arg(&out);
    a.arg(&partial);
    builder_arg!(
        a,
        group_elems as u32,
        chunks as u32,
        (channels / op.groups) as u32,
        inner as u32,
        op.groups as u32,
        op.eps,
        i32::from(op.silu)
    );
    // SAFETY: as above.
    unsafe { a.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

normalisation_op!(GroupNorm, "sdhive-group-norm", group_norm_launch);

pub fn group_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
    silu: bool,
) -> Result<Tensor> {
    let dims = x.dims();
    if dims.len() < 3 || groups == 0 || !dims[1].is_multiple_of(groups) {
        bail!("group_norm: input {dims:?} cannot be split into {groups} groups");
    }
    if weight.elem_count() != dims[1] || bias.elem_count() != dims[1] {
        bail!("group_norm: weight/bias must have {} values", dims[1]);
    }
    let op = GroupNorm { groups, eps: eps as f32, silu };
    x.apply_op3_no_bwd(&weight.flatten_all()?, &bias.flatten_all()?, &op)
}

struct AddChannel {
    channels: usize,
    inner: usize,
    /// `channels` for a per-sample `add`, 0 for a bias shared by every sample.
    add_batch_stride: usize,
    /// Channels-last (`inner` 1): rows of `channels` values per sample.
    rows_per_sample: usize,
}

fn add_channel_launch<T: CudaDType + DeviceRepr>(
    op: &AddChannel,
    y: (&CudaStorage, &Layout),
    add: (&CudaStorage, &Layout),
    residual: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let dev: &CudaDevice = y.0.device();
    let n = y.1.shape().elem_count();
    let sfx = suffix(y.0.dtype())?;
    let ys = contiguous::<T>(y.0, y.1, "input")?;
    let adds = contiguous::<T>(add.0, add.1, "added term")?;
    let res = residual.map(|(s, l)| contiguous::<T>(s, l, "residual")).transpose()?;
    // SAFETY: written in full by the kernel.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
    let func = dev.get_or_load_custom_func(&format!("add_channel_{sfx}"), MODULE, PTX)?;
    let mut a = func.builder();
    a.arg(&ys);
    a.arg(&adds);
    let null: u64 = 0;
    match &res {
        Some(r) => a.arg(r),
        None => a.arg(&null),
    };
    a.arg(&out);
    builder_arg!(
        a,
        n,
        op.channels as u32,
        op.inner as u32,
        op.add_batch_stride as u32,
        op.rows_per_sample.max(1) as u32
    );
    // The kernel's own test for its 16-byte path, less the pointers' alignment.
    let vec = per_vector::<T>();
    let last = op.inner == 1 && op.channels.is_multiple_of(vec) && op.add_batch_stride.is_multiple_of(vec);
    let vectorizable = (last || op.inner.is_multiple_of(vec)) && n.is_multiple_of(vec);
    let cfg = LaunchConfig {
        grid_dim: (grid_for(items::<T>(n, vectorizable)), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; a missing residual is the null pointer it tests.
    unsafe { a.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

impl CustomOp2 for AddChannel {
    fn name(&self) -> &'static str {
        "sdhive-add-channel"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        cpu_only(CustomOp2::name(self))
    }

    fn cuda_fwd(
        &self,
        y: &CudaStorage,
        yl: &Layout,
        a: &CudaStorage,
        al: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let out = by_dtype!(y.dtype(), add_channel_launch(self, (y, yl), (a, al), None))?;
        Ok((out, yl.shape().clone()))
    }
}

impl CustomOp3 for AddChannel {
    fn name(&self) -> &'static str {
        "sdhive-add-channel-residual"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_only(CustomOp3::name(self))
    }

    fn cuda_fwd(
        &self,
        y: &CudaStorage,
        yl: &Layout,
        a: &CudaStorage,
        al: &Layout,
        r: &CudaStorage,
        rl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let out = by_dtype!(y.dtype(), add_channel_launch(self, (y, yl), (a, al), Some((r, rl))))?;
        Ok((out, yl.shape().clone()))
    }
}

pub fn add_channel(y: &Tensor, add: &Tensor, residual: Option<&Tensor>, last_dim: bool) -> Result<Tensor> {
    let dims = y.dims();
    let (channels, inner, samples) = if last_dim {
        let c = *dims.last().unwrap_or(&0);
        (c, 1, if dims.len() >= 2 { dims[0] } else { 1 })
    } else {
        if dims.len() < 2 {
            bail!("add_channel: input {dims:?} has no channel dimension");
        }
        (dims[1], dims[2..].iter().product::<usize>(), dims[0])
    };
    let add_rows = add.elem_count() / channels.max(1);
    let add_batch_stride = match add_rows {
        _ if !add.elem_count().is_multiple_of(channels.max(1)) => {
            bail!("add_channel: {:?} does not fit {dims:?}", add.dims())
        }
        1 => 0,
        r if r == samples => channels,
        _ => bail!("add_channel: {:?} does not fit {dims:?}", add.dims()),
    };
    let rows_per_sample = if last_dim { y.elem_count() / (samples * channels).max(1) } else { 1 };
    if let Some(r) = residual {
        if r.dims() != dims {
            bail!("add_channel: residual {:?} differs from {dims:?}", r.dims());
        }
    }
    let op = AddChannel { channels, inner, add_batch_stride, rows_per_sample };
    let add = add.flatten_all()?;
    match residual {
        Some(r) => y.apply_op3_no_bwd(&add, r, &op),
        None => y.apply_op2_no_bwd(&add, &op),
    }
}

/// The compute capability the PTX was built for (build.rs).
pub(crate) fn built_for() -> u32 {
    env!("SDHIVE_CUDA_COMPUTE_CAP").parse().unwrap_or(0)
}

/// Whether the PTX has thread block clusters (built for sm_90 or later; kernels.cu has no cluster kernel below).
pub(crate) fn clusters_built() -> bool {
    built_for() >= 90
}

/// Pixels of one group each thread of `gn_group_nhwc` holds at most (`GN_GROUP_UNITS` in kernels.cu).
const GROUP_UNITS: usize = 32;

/// How the one-launch channels-last GroupNorm (`gn_group_nhwc_c{cluster}`: one cluster of `cluster` blocks of
/// `threads` per group and sample) takes this map, or `None` where the two-launch path ([`group_norm_slabs`])
/// runs: `per_group` channels of `elem` bytes in 4-byte units, at most [`GROUP_UNITS`] pixels per thread. One
/// block while 512 threads would hold at most 16 pixels each (1024 threads at most 12), else, where the build has
/// clusters (`clusters`: sm_90 and later) and the map has at most 1024 pixels, a cluster of two 1024-thread
/// blocks holding at most 16 each. On an H100 (`xtask/bench/group_norm_shapes.cu`, graphs of 50 calls) one block
/// takes 3.4-7.5 us at the SD1.5 UNet's 32²-8² maps against 8-9.5 us for the two launches, and two blocks 10.0
/// and 12.0 us at 32²·1280 and ·1920 against 11.8 and 13.0; at 64² maps and SDXL's 32²·2560 the two launches
/// win (64²·320: 11.5 against 15.6 us; 32²·2560: 16.3 against 21.4).
pub(crate) fn group_norm_one_launch(
    pixels: usize,
    channels: usize,
    groups: usize,
    elem: usize,
    clusters: bool,
) -> Option<(usize, usize)> {
    let unit = 4 / elem;
    let per_group = channels / groups;
    if unit == 0 || !per_group.is_multiple_of(unit) {
        return None;
    }
    let upp = per_group / unit;
    let per_thread = |threads: usize, cluster: usize| pixels.div_ceil((threads / upp) * cluster);
    let (threads, cluster) = if 512 / upp > 0 && per_thread(512, 1) <= 16 {
        (512, 1)
    } else if 1024 / upp > 0 && per_thread(1024, 1) <= 12 {
        (1024, 1)
    } else if clusters && pixels <= 1024 && 1024 / upp > 0 && per_thread(1024, 2) <= 16 {
        (1024, 2)
    } else {
        return None;
    };
    (threads / upp > 0 && per_thread(threads, cluster) <= GROUP_UNITS).then_some((threads, cluster))
}

/// Most threads of a `gn_slab_moments_nhwc` block, 16-byte vectors each holds, groups per chunk, and vectors
/// each `gn_slab_apply_nhwc` thread holds (GN_SLAB_* in kernels.cu).
const SLAB_THREADS: usize = 512;
const SLAB_HOLD: usize = 8;
const SLAB_GROUPS: usize = 32;
const SLAB_APPLY_HOLD: usize = 4;
/// Most slabs per sample (what each normalisation block merges per group).
const SLAB_MAX: usize = 64;

/// How the two-launch channels-last GroupNorm splits a map (kernels.cu's gn_slab_*): `chunk` channels of whole
/// groups per block, the pixels of a sample in `slabs` for the moments (blocks of `threads`) and in
/// `apply_blocks` for the normalisation (blocks of `apply_threads`).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct SlabPlan {
    pub chunk: usize,
    pub slabs: usize,
    pub threads: usize,
    pub apply_blocks: usize,
    pub apply_threads: usize,
}

/// The split of a map of `samples` × `pixels` × `channels` (`elem` bytes each) in `groups` for the two-launch
/// GroupNorm, or `None` where a chunk of whole groups is wider than a block's threads have vectors for (or a map
/// is beyond what a grid's 65535 rows of 1024-thread normalisation blocks cover, some 67 million pixels). A chunk
/// is the least common multiple of a vector's and a group's channels, doubled up to 64 bytes per pixel where the
/// channels allow (shorter runs waste most of each 32-byte memory sector); the slabs are the fewest that keep
/// every thread at [`SLAB_HOLD`] vectors, doubled while the moments launch has fewer than 256 blocks and its
/// blocks keep two warps' worth of work, and at most [`SLAB_MAX`] (a block then takes its slab in steps).
/// `xtask/bench/group_norm_shapes.cu` on an H100: 64²·320 in 11.8 us against 19.8 for the three launches before
/// them and 15.6 for two-block clusters; SDXL's 128²·320 in 33 against 56 us.
pub(crate) fn group_norm_slabs(
    samples: usize,
    pixels: usize,
    channels: usize,
    groups: usize,
    elem: usize,
) -> Option<SlabPlan> {
    let vec = 16 / elem;
    let per_group = channels / groups;
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let mut chunk = vec / gcd(vec, per_group) * per_group;
    while chunk * elem < 64 && channels.is_multiple_of(2 * chunk) && 2 * chunk / per_group <= SLAB_GROUPS {
        chunk *= 2;
    }
    let vpc = chunk / vec;
    if vpc > SLAB_THREADS || !channels.is_multiple_of(chunk) {
        return None;
    }
    let rows = |slabs: usize| pixels.div_ceil(slabs).div_ceil(SLAB_HOLD);
    let mut slabs = 1;
    while rows(slabs) * vpc > SLAB_THREADS {
        slabs *= 2;
    }
    while (channels / chunk) * slabs * samples < 256 && rows(slabs * 2) * vpc >= 64 {
        slabs *= 2;
    }
    // Every normalisation block merges all slabs of its groups: past 64 a block takes its slab in steps instead.
    let slabs = slabs.min(SLAB_MAX);
    // Blocks of 128 threads for the normalisation, larger where a map would need more than a grid's 65535 rows
    // of them.
    let apply_blocks = |threads: usize| pixels.div_ceil((threads / vpc) * SLAB_APPLY_HOLD);
    let apply_threads = [128, 256, 512, 1024]
        .into_iter()
        .map(|t: usize| t.max(vpc.next_multiple_of(32)))
        .find(|&t| t <= 1024 && apply_blocks(t) <= 65_535)?;
    Some(SlabPlan {
        chunk,
        slabs,
        threads: (rows(slabs).min(SLAB_THREADS / vpc) * vpc).next_multiple_of(32),
        apply_blocks: apply_blocks(apply_threads),
        apply_threads,
    })
}

/// Pixels each `gn_rows_moments_nhwc` thread loads together, and each `gn_rows_apply_nhwc` thread (GN_ROWS_BATCH
/// and GN_ROWS_APPLY in kernels.cu).
const ROWS_BATCH: usize = 8;
const ROWS_APPLY: usize = 4;
/// Maps of at least this many bytes take the streaming GroupNorm ([`group_norm_rows`]) before the others. On an
/// H200 (graphs of 20 calls, f16, shift and SiLU) it takes SD1.5's 64²·320 at batch 16 (42 MB) in 43 us against
/// 62 for the slab launches, the VAE's 512²·128 (67 MB) in 69 against 135 and 32²·640 at batch 16 (21 MB) in 26
/// against 29 for one launch; below about 17 MB its fixed cost loses (64²·320 at batch 2: 16-18 against 12 us).
const ROWS_MIN_BYTES: usize = 20 << 20;

/// How the streaming two-launch GroupNorm (kernels.cu's gn_rows_*) takes a map: blocks of `threads` (whole pixel
/// rows: a row is C / vector 16-byte vectors), the moments over `slabs` slabs of each sample's pixels, then
/// `apply_blocks` normalisation blocks per sample of `per_block` pixels each. The slabs give the moments launch
/// about 256 blocks (at most 256 per sample, each thread at least a batch of pixels). `None` where a row has more
/// vectors than a moments block may have threads (512 for 16-bit maps, 1024 for f32: the kernel's launch bounds).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct RowsPlan {
    pub threads: usize,
    pub slabs: usize,
    pub per_block: usize,
    pub apply_blocks: usize,
}

pub(crate) fn group_norm_rows(
    samples: usize,
    pixels: usize,
    channels: usize,
    elem: usize,
) -> Option<RowsPlan> {
    let vpr = channels / (16 / elem.max(1));
    let most = if elem == 4 { 1024 } else { 512 };
    if vpr == 0 || vpr > most || samples == 0 || pixels == 0 {
        return None;
    }
    let rows = (256 / vpr).max(1);
    let threads = (rows * vpr).next_multiple_of(32);
    let most_slabs = pixels.div_ceil(rows * ROWS_BATCH).clamp(1, 256);
    let slabs = 256usize.div_ceil(samples).clamp(1, most_slabs);
    let per_block = rows * ROWS_APPLY * 2;
    Some(RowsPlan { threads, slabs, per_block, apply_blocks: pixels.div_ceil(per_block) })
}

/// Per-sample counters of the streaming GroupNorm's moments blocks (the last block of a sample merges the slabs),
/// one zeroed buffer per device that only grows: each launch leaves its counters at zero (atomicInc wraps), and
/// launches on the device's one stream never overlap.
#[derive(Default)]
struct Counters {
    current: std::collections::HashMap<candle_core::cuda_backend::DeviceId, CudaSlice<u32>>,
    /// Buffers outgrown by a larger one, kept for the CUDA graphs recorded with them.
    retired: Vec<CudaSlice<u32>>,
}

thread_local! {
    static COUNTERS: std::cell::RefCell<Counters> = std::cell::RefCell::new(Counters::default());
}

/// Runs `f` with this thread's zeroed GroupNorm counters on `dev`, at least `need` of them (grown only outside a
/// CUDA graph capture, as the cuDNN workspace).
fn with_counters<R>(
    dev: &CudaDevice,
    need: usize,
    f: impl FnOnce(&CudaSlice<u32>) -> Result<R>,
) -> Result<R> {
    COUNTERS.with(|c| {
        let mut c = c.borrow_mut();
        let c = &mut *c;
        if c.current.get(&dev.id()).is_none_or(|s| s.len() < need) {
            if crate::graph::capturing() {
                bail!("group_norm: its counters would grow during a CUDA graph capture")
            }
            let fresh = dev.alloc_zeros::<u32>(need.max(64))?;
            if let Some(old) = c.current.insert(dev.id(), fresh) {
                c.retired.push(old);
            }
        }
        let Some(counters) = c.current.get(&dev.id()) else { bail!("group_norm counters missing") };
        f(counters)
    })
}

/// GroupNorm over channels-last `(N, …, C)` maps: large maps stream through two launches over whole pixel rows
/// ([`group_norm_rows`]); others take one launch where one or two blocks hold a group (see
/// [`group_norm_one_launch`]), else two over chunks of channels (per-slab moments, then the normalisation; see
/// [`group_norm_slabs`]).
/// Needs `C` a multiple of 16 bytes' worth of values, at most [`MAX_LAST_CHANNELS`].
struct GroupNormLast {
    groups: usize,
    eps: f32,
    silu: bool,
    /// `(N, C)`, added to every pixel of its sample before the statistics; its rows may be further apart than C.
    shift: Option<Tensor>,
    /// `(N, …, C2)`: the map joined after the input's channels (the up path's skip), read in place; the output
    /// is then `(2, N, …, C + C2)`, the normalised join and the join itself.
    second: Option<Tensor>,
}

fn group_norm_last_launch<T: CudaDType + DeviceRepr>(
    op: &GroupNormLast,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.0.device();
    let dims = x.1.dims();
    let samples = dims[0];
    let first = dims[dims.len() - 1];
    let pixels = x.1.shape().elem_count() / (samples * first);
    let second = op.second.as_ref().map(|t| t.storage_and_layout());
    let x2 = second.as_ref().map(|h| held_view::<T, _>(h, "group_norm joined map")).transpose()?;
    let channels = first + op.second.as_ref().map_or(0, |t| t.dims().last().copied().unwrap_or(0));
    let n = samples * pixels * channels;
    let sfx = suffix(x.0.dtype())?;
    let xs = contiguous::<T>(x.0, x.1, "group_norm input")?;
    let ws = contiguous::<T>(w.0, w.1, "group_norm weight")?;
    let bs = contiguous::<T>(b.0, b.1, "group_norm bias")?;
    let shift = op.shift.as_ref().map(|t| t.storage_and_layout());
    let ss = shift.as_ref().map(|h| held_rows_view::<T, _>(h, "group_norm shift")).transpose()?;
    let null: u64 = 0;
    let shift_stride = ss.as_ref().map_or(0, |(_, stride)| *stride as u32);
    let c1 = first as u32;
    // SAFETY: written in full by the kernels: the normalised map, and after it the joined one where there is one.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(if x2.is_some() { 2 * n } else { n })? };
    let (normed, joined) = (out.slice(0..n), x2.as_ref().map(|_| out.slice(n..2 * n)));
    // The kernels' first arguments: the input, the joined map and where it starts (a null pointer without one),
    // and the shift (likewise); those that normalise also take where the join goes, then weight, bias and output.
    macro_rules! input_and_shift {
        ($a:ident, $cat:expr) => {
            $a.arg(&xs);
            match &x2 {
                Some(v) => $a.arg(v),
                None => $a.arg(&null),
            };
            $a.arg(&c1);
            if $cat {
                match &joined {
                    Some(v) => $a.arg(v),
                    None => $a.arg(&null),
                };
            }
            match &ss {
                Some((s, _)) => $a.arg(s),
                None => $a.arg(&null),
            };
            $a.arg(&shift_stride);
        };
    }
    macro_rules! normalisation_operands {
        ($a:ident) => {
            input_and_shift!($a, true);
            $a.arg(&ws);
            $a.arg(&bs);
            $a.arg(&normed);
        };
    }
    let elem = std::mem::size_of::<T>();
    if let Some(plan) =
        (n * elem >= ROWS_MIN_BYTES).then(|| group_norm_rows(samples, pixels, channels, elem)).flatten()
    {
        let groups = op.groups;
        // SAFETY: every (sample, slab, group) triple is written before the sample's last block reads it, and
        // every (sample, group) statistic before the normalisation reads it.
        let scratch: CudaSlice<f32> = unsafe { dev.alloc::<f32>(samples * groups * (plan.slabs * 3 + 2))? };
        let (partial, stats) = (
            scratch.slice(0..samples * plan.slabs * groups * 3),
            scratch.slice(samples * plan.slabs * groups * 3..),
        );
        with_counters(dev, samples, |done| {
            let func = dev.get_or_load_custom_func(&format!("gn_rows_moments_nhwc_{sfx}"), MODULE, PTX)?;
            let mut a = func.builder();
            input_and_shift!(a, false);
            a.arg(&partial);
            a.arg(&stats);
            a.arg(done);
            builder_arg!(a, pixels as u32, channels as u32, groups as u32, plan.slabs as u32, op.eps);
            let cfg = LaunchConfig {
                grid_dim: (plan.slabs as u32, samples as u32, 1),
                block_dim: (plan.threads as u32, 1, 1),
                // Every thread's channel means and squared deviations, then its count.
                shared_mem_bytes: (plan.threads * (2 * per_vector::<T>() + 1) * 4) as u32,
            };
            // SAFETY: the arguments match the kernel's signature; the slabs cover every pixel, `partial` and
            // `stats` hold every slab's and sample's moments, `done` a zeroed counter per sample.
            unsafe { a.launch(cfg) }.w()
        })?;
        let func = dev.get_or_load_custom_func(&format!("gn_rows_apply_nhwc_{sfx}"), MODULE, PTX)?;
        let mut a = func.builder();
        normalisation_operands!(a);
        a.arg(&stats);
        builder_arg!(
            a,
            pixels as u32,
            channels as u32,
            groups as u32,
            plan.per_block as u32,
            i32::from(op.silu)
        );
        let cfg = LaunchConfig {
            grid_dim: (plan.apply_blocks as u32, samples as u32, 1),
            block_dim: (plan.threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above; the apply blocks cover every pixel.
        unsafe { a.launch(cfg) }.w()?;
        return Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()));
    }
    if let Some((threads, cluster)) =
        group_norm_one_launch(pixels, channels, op.groups, elem, clusters_built())
    {
        let func = dev.get_or_load_custom_func(&format!("gn_group_nhwc_c{cluster}_{sfx}"), MODULE, PTX)?;
        let mut a = func.builder();
        normalisation_operands!(a);
        builder_arg!(a, pixels as u32, channels as u32, op.groups as u32, op.eps, i32::from(op.silu));
        let cfg = LaunchConfig {
            grid_dim: ((op.groups * cluster) as u32, samples as u32, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; `cluster` blocks of `threads` cover every pixel of
        // a group, and the grid is whole clusters.
        unsafe { a.launch(cfg) }.w()?;
        return Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()));
    }
    let Some(plan) = group_norm_slabs(samples, pixels, channels, op.groups, elem) else {
        bail!(
            "group_norm (channels-last): {pixels} pixels of {channels} channels in {} groups fit no split of the \
             kernels (a chunk of whole groups wider than a block, or a map past a grid's reach)",
            op.groups
        )
    };
    let chunks = (channels / plan.chunk) as u32;
    // SAFETY: every (sample, slab, group) triple is written by the moments kernel before the apply kernel reads
    // it.
    let partial: CudaSlice<f32> = unsafe { dev.alloc::<f32>(samples * plan.slabs * op.groups * 3)? };
    let func = dev.get_or_load_custom_func(&format!("gn_slab_moments_nhwc_{sfx}"), MODULE, PTX)?;
    let mut a = func.builder();
    input_and_shift!(a, false);
    a.arg(&partial);
    builder_arg!(a, pixels as u32, channels as u32, op.groups as u32, plan.chunk as u32, plan.slabs as u32);
    let vec = per_vector::<T>();
    let cfg = LaunchConfig {
        grid_dim: (chunks, plan.slabs as u32, samples as u32),
        block_dim: (plan.threads as u32, 1, 1),
        // Every thread's vector of sums, then one float per thread (at least per channel of the chunk).
        shared_mem_bytes: ((plan.threads * vec + plan.threads.max(plan.chunk)) * 4) as u32,
    };
    // SAFETY: the arguments match the kernel's signature; the plan's slabs cover every pixel within the threads'
    // hold, and `partial` holds every slab's moments.
    unsafe { a.launch(cfg) }.w()?;
    let func = dev.get_or_load_custom_func(&format!("gn_slab_apply_nhwc_{sfx}"), MODULE, PTX)?;
    let mut a = func.builder();
    normalisation_operands!(a);
    a.arg(&partial);
    builder_arg!(
        a,
        pixels as u32,
        channels as u32,
        op.groups as u32,
        plan.chunk as u32,
        plan.slabs as u32,
        op.eps,
        i32::from(op.silu)
    );
    let cfg = LaunchConfig {
        grid_dim: (chunks, plan.apply_blocks as u32, samples as u32),
        block_dim: (plan.apply_threads as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: as above; the apply blocks cover every pixel within the threads' hold.
    unsafe { a.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

impl GroupNormLast {
    fn forward(
        &self,
        x: (&CudaStorage, &Layout),
        w: (&CudaStorage, &Layout),
        b: (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let out = by_dtype!(x.0.dtype(), group_norm_last_launch(self, x, w, b))?;
        let Some(second) = &self.second else { return Ok((out, x.1.shape().clone())) };
        let mut dims = vec![2];
        dims.extend_from_slice(x.1.dims());
        if let (Some(c), Some(c2)) = (dims.last_mut(), second.dims().last()) {
            *c += c2;
        }
        Ok((out, Shape::from(dims)))
    }
}

cuda_op3!(GroupNormLast, "sdhive-group-norm-channels-last", forward);

/// The most channels the channels-last kernels take (the networks' widest map is 2560 channels, an up block's
/// input); a GroupNorm's chunk of whole groups must also fit one block ([`group_norm_slabs`]).
pub const MAX_LAST_CHANNELS: usize = 4096;

/// Whether `t`'s first element sits on a 16-byte boundary (buffers themselves are 16-byte aligned), as the
/// kernels that move 16-byte vectors need.
fn starts_16_aligned(t: &Tensor) -> bool {
    (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16)
}

/// Whether channels-last `x` suits the 16-byte kernels: its last dimension whole 16-byte vectors, at most
/// [`MAX_LAST_CHANNELS`], and the data 16-byte aligned.
pub fn channels_last_fits(x: &Tensor) -> bool {
    let vec = 16 / x.dtype().size_in_bytes().max(1);
    let c = x.dims().last().copied().unwrap_or(0);
    x.rank() >= 3 && c > 0 && c.is_multiple_of(vec) && c <= MAX_LAST_CHANNELS && starts_16_aligned(x)
}

/// Whether channels-last `b` can follow `a`'s channels in one GroupNorm's join: both [`channels_last_fits`] and
/// contiguous, of one type on one device, their other dimensions equal, the join at most [`MAX_LAST_CHANNELS`] wide.
pub(crate) fn joinable(a: &Tensor, b: &Tensor) -> bool {
    let (da, db) = (a.dims(), b.dims());
    let n = da.len();
    channels_last_fits(a)
        && channels_last_fits(b)
        && a.is_contiguous()
        && b.is_contiguous()
        && a.dtype() == b.dtype()
        && a.device().same_device(b.device())
        && db.len() == n
        && da[..n - 1] == db[..n - 1]
        && da[n - 1] + db[n - 1] <= MAX_LAST_CHANNELS
}

/// GroupNorm over channels-last `x` (see the public wrapper); with `second`, over `x` and `second` joined along
/// their channels, returning `(2, N, …, C + C2)`: the normalised join, then the join itself.
pub fn group_norm_last(
    (x, second): (&Tensor, Option<&Tensor>),
    shift: Option<&Tensor>,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
    silu: bool,
) -> Result<Tensor> {
    let dims = x.dims();
    let c = dims.last().copied().unwrap_or(0) + second.map_or(0, |s| s.dims().last().copied().unwrap_or(0));
    if !channels_last_fits(x) || groups == 0 || !c.is_multiple_of(groups) {
        bail!(
            "group_norm (channels-last): input {dims:?} cannot be split into {groups} groups of 16-byte runs"
        );
    }
    if let Some(s) = second {
        if !joinable(x, s) {
            bail!(
                "group_norm (channels-last): cannot join {:?} {:?} to the input {dims:?} {:?}",
                s.dims(),
                s.dtype(),
                x.dtype()
            );
        }
    }
    if weight.elem_count() != c || bias.elem_count() != c {
        bail!("group_norm: weight/bias must have {c} values");
    }
    if let Some(s) = shift {
        if s.dims() != [dims[0], c] || s.dtype() != x.dtype() {
            bail!(
                "group_norm: shift {:?} {:?} must be ({}, {c}) {:?}",
                s.dims(),
                s.dtype(),
                dims[0],
                x.dtype()
            );
        }
    }
    // The normalisation reads weight, bias and shift 16 bytes at a time: each must start on a 16-byte boundary
    // and the shift's rows lie a whole number of vectors apart.
    let vectors = |t: &Tensor| -> Result<Tensor> {
        let t = t.flatten_all()?;
        if t.is_contiguous() && starts_16_aligned(&t) {
            Ok(t)
        } else {
            t.force_contiguous()
        }
    };
    let shift = shift
        .map(|s| match s.stride() {
            [rs, 1] if rs.is_multiple_of(16 / s.dtype().size_in_bytes()) && starts_16_aligned(s) => {
                Ok(s.clone())
            }
            _ => s.force_contiguous(),
        })
        .transpose()?;
    let op = GroupNormLast { groups, eps: eps as f32, silu, shift, second: second.cloned() };
    x.apply_op3_no_bwd(&vectors(weight)?, &vectors(bias)?, &op)
}

/// Nearest-neighbour ×2 of channels-last `(N, H, W, C)`.
struct Upsample2xLast;

fn upsample_last_launch<T: CudaDType + DeviceRepr>(
    _: &Upsample2xLast,
    x: &CudaStorage,
    l: &Layout,
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.device();
    let (b, h, w, c) = l.shape().dims4()?;
    let n = b * 4 * h * w * c;
    let xs = contiguous::<T>(x, l, "upsample input")?;
    // SAFETY: written in full by the kernel.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
    let func =
        dev.get_or_load_custom_func(&format!("upsample2x_nhwc_{}", suffix(x.dtype())?), MODULE, PTX)?;
    let mut a = func.builder();
    a.arg(&xs);
    a.arg(&out);
    builder_arg!(a, h as u32, w as u32, c as u32, n);
    let vectors = n / per_vector::<T>();
    let cfg =
        LaunchConfig { grid_dim: (grid_for(vectors), 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature.
    unsafe { a.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

single_input_op!(Upsample2xLast, "sdhive-upsample2x-channels-last", upsample_last_launch, |_, l| {
    let (b, h, w, c) = l.shape().dims4()?;
    Ok(Shape::from((b, 2 * h, 2 * w, c)))
});

pub fn upsample2x_last(x: &Tensor) -> Result<Tensor> {
    if x.rank() != 4 || !channels_last_fits(x) {
        bail!("upsample (channels-last): input {:?} does not suit the 16-byte kernel", x.dims());
    }
    x.apply_op1_no_bwd(&Upsample2xLast)
}

/// A batch repeated whole `copies` times: one launch where candle's cat makes one copy per part.
struct RepeatBatch {
    copies: usize,
}

fn repeat_launch<T: CudaDType + DeviceRepr>(
    op: &RepeatBatch,
    x: &CudaStorage,
    l: &Layout,
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.device();
    let n = l.shape().elem_count();
    let xs = contiguous::<T>(x, l, "repeated sample")?;
    // SAFETY: written in full by the kernel.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n * op.copies)? };
    let func = dev.get_or_load_custom_func("repeat_vec", MODULE, PTX)?;
    let mut a = func.builder();
    a.arg(&xs);
    a.arg(&out);
    let vectors = n / per_vector::<T>();
    builder_arg!(a, vectors, op.copies as u32);
    let cfg =
        LaunchConfig { grid_dim: (grid_for(vectors), 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature; the input holds `vectors` whole vectors.
    unsafe { a.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

single_input_op!(RepeatBatch, "sdhive-repeat-batch", repeat_launch, |op: &RepeatBatch, l: &Layout| {
    let mut dims = l.dims().to_vec();
    dims[0] *= op.copies;
    Ok(Shape::from(dims))
});

/// Whether the repeat kernel takes `x`: a batch of whole 16-byte vectors from a 16-byte boundary.
pub fn repeat_fits(x: &Tensor) -> bool {
    let vec = 16 / x.dtype().size_in_bytes().max(1);
    x.rank() > 0 && x.elem_count() > 0 && x.elem_count().is_multiple_of(vec) && starts_16_aligned(x)
}

/// `x`'s batch repeated whole to `batch` samples (the batch a multiple of `x`'s), as `Tensor::cat` of copies of
/// `x` along the batch but in one launch.
pub fn repeat_batch(x: &Tensor, batch: usize) -> Result<Tensor> {
    let b = x.dims().first().copied().unwrap_or(0);
    if !repeat_fits(x) || batch == 0 || !batch.is_multiple_of(b) {
        bail!(
            "repeat to a batch of {batch}: input {:?} is not whole copies' worth of 16-byte vectors",
            x.dims()
        );
    }
    x.apply_op1_no_bwd(&RepeatBatch { copies: batch / b })
}

/// Two channels-last maps joined along their channels by `kernel(a, b, out, va, vb, rows)`, one launch that moves
/// each output row's `va + vb` 16-byte vectors from the one input or the other (`b`'s as they are or activated).
fn join_last_launch<T: CudaDType + DeviceRepr>(
    kernel: Kernel<'_>,
    a: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let (ca, cb) = (last_dim(a.1), last_dim(b.1));
    let rows = a.1.shape().elem_count() / ca.max(1);
    let vec = per_vector::<T>();
    let scalars = ((ca / vec) as u32, (cb / vec) as u32, rows);
    launch_over::<T>(kernel, &[a, b], rows * (ca + cb), rows * (ca + cb) / vec, scalars)
}

/// [`join_last_launch`] for the operands' dtype, with the joined map's shape.
pub(crate) fn join_last(
    kernel: Kernel<'_>,
    a: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let out = by_dtype!(a.0.dtype(), join_last_launch(kernel, a, b))?;
    let mut dims = a.1.dims().to_vec();
    if let Some(c) = dims.last_mut() {
        *c += last_dim(b.1);
    }
    Ok((out, Shape::from(dims)))
}

fn last_dim(l: &Layout) -> usize {
    l.dims().last().copied().unwrap_or(0)
}

/// Two channels-last maps joined along their channels as they are (the UNet's skip connections).
struct ConcatLast;

cuda_op!(ConcatLast, "sdhive-concat-channels-last", |_, a, b| {
    join_last(("concat_rows_vec", MODULE, PTX), a, b)
});

pub fn concat_last(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (da, db) = (a.dims(), b.dims());
    let same_rows = da.len() == db.len() && da.len() >= 2 && da[..da.len() - 1] == db[..db.len() - 1];
    if !same_rows || a.dtype() != b.dtype() || !channels_last_fits(a) || !channels_last_fits(b) {
        bail!("concat (channels-last): {da:?} and {db:?} do not suit the 16-byte kernel");
    }
    a.apply_op2_no_bwd(b, &ConcatLast)
}

/// Batched transpose of `(B, M, Ns)` to `(B, N, Mp)`: the input's first `take` = N of its Ns columns, the output's
/// rows padded with zeros from M to `pad_to` = Mp.
struct Transpose {
    take: Option<usize>,
    pad_to: Option<usize>,
}

impl Transpose {
    /// `(B, M, Ns)` → `(B, M, N, Ns, Mp)`.
    fn dims(&self, l: &Layout) -> Result<(usize, usize, usize, usize, usize)> {
        let (b, m, ns) = l.shape().dims3()?;
        let (n, mp) = (self.take.unwrap_or(ns), self.pad_to.unwrap_or(m));
        if n > ns || mp < m {
            bail!("transpose: cannot take {n} of {ns} columns or pad {m} rows to {mp}");
        }
        if b > 65_535 || mp.div_ceil(32) > 65_535 || m * ns > u32::MAX as usize || n * mp > u32::MAX as usize
        {
            bail!("transpose: {:?} is too large for one launch", l.dims());
        }
        Ok((b, m, n, ns, mp))
    }
}

fn transpose_launch<T: CudaDType + DeviceRepr>(
    op: &Transpose,
    x: &CudaStorage,
    l: &Layout,
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.device();
    let (b, m, n, ns, mp) = op.dims(l)?;
    let xs = contiguous::<T>(x, l, "transpose input")?;
    // SAFETY: written in full by the kernel, padding included.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(b * n * mp)? };
    let func = dev.get_or_load_custom_func(&format!("transpose_{}", suffix(x.dtype())?), MODULE, PTX)?;
    let mut a = func.builder();
    a.arg(&xs);
    a.arg(&out);
    builder_arg!(a, m as u32, n as u32, ns as u32, mp as u32);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(32) as u32, mp.div_ceil(32) as u32, b as u32),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature.
    unsafe { a.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

single_input_op!(Transpose, "sdhive-transpose", transpose_launch, |op, l| {
    let (b, _, n, _, mp) = op.dims(l)?;
    Ok(Shape::from((b, n, mp)))
});

pub fn transpose_last2(x: &Tensor) -> Result<Tensor> {
    x.apply_op1_no_bwd(&Transpose { take: None, pad_to: None })
}

/// [`transpose_last2`] of `(B, M, N)` with the output's rows padded with zeros to `width` ≥ M: an NCHW map of a few
/// channels to channels-last with its channels padded (`(B, C, H·W)` → `(B, H·W, width)`).
pub fn transpose_last2_padded(x: &Tensor, width: usize) -> Result<Tensor> {
    x.apply_op1_no_bwd(&Transpose { take: None, pad_to: Some(width) })
}

/// [`transpose_last2`] of the first `n` columns of `(B, M, Ns)`: the first `n` channels of a channels-last map
/// to NCHW (`(B, H·W, Ns)` → `(B, n, H·W)`).
pub fn transpose_last2_narrow(x: &Tensor, n: usize) -> Result<Tensor> {
    x.apply_op1_no_bwd(&Transpose { take: Some(n), pad_to: None })
}

struct Softmax;

fn softmax_launch<T: CudaDType + DeviceRepr>(
    _: &Softmax,
    x: &CudaStorage,
    l: &Layout,
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.device();
    let dims = l.dims();
    let cols = *dims.last().unwrap_or(&1);
    let rows = l.shape().elem_count() / cols.max(1);
    let xs = contiguous::<T>(x, l, "softmax input")?;
    // SAFETY: written in full by the kernel.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(rows * cols)? };
    let func = dev.get_or_load_custom_func(&format!("softmax_{}", suffix(x.dtype())?), MODULE, PTX)?;
    let mut a = func.builder();
    a.arg(&xs);
    a.arg(&out);
    builder_arg!(a, rows as u32, cols as u32);
    let warps_per_block = (THREADS / 32) as usize;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(warps_per_block) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature.
    unsafe { a.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

single_input_op!(Softmax, "sdhive-softmax", softmax_launch, |_, l| Ok(l.shape().clone()));

pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if x.dims().iter().product::<usize>() / x.dims().last().copied().unwrap_or(1).max(1) > u32::MAX as usize {
        bail!("softmax: too many rows");
    }
    x.apply_op1_no_bwd(&Softmax)
}

struct Geglu;

fn geglu_launch<T: CudaDType + DeviceRepr>(
    x: &CudaStorage,
    l: &Layout,
    bias: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.device();
    let dims = l.dims();
    let last = *dims.last().unwrap_or(&0);
    let half = last / 2;
    let rows = l.shape().elem_count() / last.max(1);
    let xs = contiguous::<T>(x, l, "geglu input")?;
    let bs = bias.map(|(s, l)| contiguous::<T>(s, l, "geglu bias")).transpose()?;
    // SAFETY: written in full by the kernel.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(rows * half)? };
    let func = dev.get_or_load_custom_func(&format!("geglu_{}", suffix(x.dtype())?), MODULE, PTX)?;
    let mut a = func.builder();
    a.arg(&xs);
    let null: u64 = 0;
    match &bs {
        Some(b) => a.arg(b),
        None => a.arg(&null),
    };
    a.arg(&out);
    builder_arg!(a, rows, half as u32);
    let cfg = LaunchConfig {
        grid_dim: (grid_for(items::<T>(rows * half, half.is_multiple_of(per_vector::<T>()))), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; a missing bias is the null pointer it tests.
    unsafe { a.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

fn halved(l: &Layout) -> Shape {
    let mut dims = l.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last /= 2;
    }
    Shape::from(dims)
}

impl CustomOp2 for Geglu {
    fn name(&self) -> &'static str {
        "sdhive-geglu-bias"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        cpu_only(CustomOp2::name(self))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        l: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let out = by_dtype!(x.dtype(), geglu_launch(x, l, Some((b, bl))))?;
        Ok((out, halved(l)))
    }
}

impl CustomOp1 for Geglu {
    fn name(&self) -> &'static str {
        "sdhive-geglu"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        cpu_only(CustomOp1::name(self))
    }

    fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let out = by_dtype!(x.dtype(), geglu_launch(x, l, None))?;
        Ok((out, halved(l)))
    }
}

pub fn geglu(x: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let last = x.dims().last().copied().unwrap_or(0);
    if !last.is_multiple_of(2) || last == 0 {
        bail!("geglu: the last dimension of {:?} must be even", x.dims());
    }
    match bias {
        Some(b) if b.elem_count() != last => bail!("geglu: bias {:?} for rows of {last}", b.dims()),
        Some(b) => x.apply_op2_no_bwd(&b.flatten_all()?, &Geglu),
        None => x.apply_op1_no_bwd(&Geglu),
    }
}

struct LayerNorm {
    eps: f32,
    /// Rows that share one weight and bias row; `None`: all of them.
    group_rows: Option<usize>,
    /// The weight is an adaptive norm's `scale`, applied as `1 + scale`.
    weight_plus_one: bool,
}

fn layer_norm_launch<T: CudaDType + DeviceRepr>(
    op: &LayerNorm,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.0.device();
    let cols = *x.1.dims().last().unwrap_or(&1);
    let rows = x.1.shape().elem_count() / cols.max(1);
    let xs = contiguous::<T>(x.0, x.1, "layer_norm input")?;
    let group_rows = op.group_rows.unwrap_or(rows).max(1);
    let groups = rows.div_ceil(group_rows);
    // Per-sample rows may be chunks of a wider modulation table (rows contiguous, further apart).
    let ((ws, w_stride), (bs, b_stride)) = if op.group_rows.is_some() {
        (rows_view::<T>(w.0, w.1, "layer_norm weight")?, rows_view::<T>(b.0, b.1, "layer_norm bias")?)
    } else {
        (
            (contiguous::<T>(w.0, w.1, "layer_norm weight")?, cols),
            (contiguous::<T>(b.0, b.1, "layer_norm bias")?, cols),
        )
    };
    let rows_of = |len: usize, stride: usize| (len + stride - cols) / stride;
    if rows_of(ws.len(), w_stride) != groups || rows_of(bs.len(), b_stride) != groups {
        bail!("layer_norm: weight/bias rows do not match {rows} rows in groups of {group_rows}");
    }
    // SAFETY: written in full by the kernel.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(rows * cols)? };
    // Rows past the 8 16-byte vectors a lane of `layer_norm` holds take the kernel that holds 16.
    let kernel =
        if cols * x.0.dtype().size_in_bytes() > 32 * 8 * 16 { "layer_norm_wide" } else { "layer_norm" };
    let func = dev.get_or_load_custom_func(&format!("{kernel}_{}", suffix(x.0.dtype())?), MODULE, PTX)?;
    let mut a = func.builder();
    a.arg(&xs);
    a.arg(&ws);
    a.arg(&bs);
    a.arg(&out);
    let one_plus = if op.weight_plus_one { 1f32 } else { 0f32 };
    builder_arg!(
        a,
        rows as u32,
        cols as u32,
        op.eps,
        group_rows as u32,
        w_stride as u32,
        b_stride as u32,
        one_plus
    );
    let warps_per_block = (THREADS / 32) as usize;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(warps_per_block) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature.
    unsafe { a.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

normalisation_op!(LayerNorm, "sdhive-layer-norm", layer_norm_launch);

pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let cols = x.dims().last().copied().unwrap_or(0);
    if weight.elem_count() != cols || bias.elem_count() != cols {
        bail!("layer_norm: weight/bias must have {cols} values");
    }
    x.apply_op3_no_bwd(weight, bias, &LayerNorm { eps: eps as f32, group_rows: None, weight_plus_one: false })
}

/// An adaptive norm's `layer_norm(x) · (1 + scale) + shift` for `x` `(B, S, D)` and `(B, D)` rows of `shift` and
/// `scale` in one pass; the rows may be chunks of a wider modulation table (read in place, no copy).
pub fn modulated_layer_norm(x: &Tensor, shift: &Tensor, scale: &Tensor, eps: f64) -> Result<Tensor> {
    let (b, s, d) = x.dims3()?;
    if scale.dims() != [b, d] || shift.dims() != [b, d] {
        bail!(
            "modulated_layer_norm: shift/scale must be ({b}, {d}), got {:?} and {:?}",
            shift.dims(),
            scale.dims()
        );
    }
    let op = LayerNorm { eps: eps as f32, group_rows: Some(s), weight_plus_one: true };
    x.apply_op3_no_bwd(scale, shift, &op)
}

/// RMSNorm over rows of `d` values (`x`'s elements in order) with a `d`-value weight.
struct RmsNorm {
    d: usize,
    eps: f32,
}

fn rms_norm_launch<T: CudaDType + DeviceRepr>(
    op: &RmsNorm,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.0.device();
    let n = x.1.shape().elem_count();
    let rows = n / op.d;
    let xs = contiguous::<T>(x.0, x.1, "rms_norm input")?;
    let ws = contiguous::<T>(w.0, w.1, "rms_norm weight")?;
    // SAFETY: written in full by the kernel.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
    let func = dev.get_or_load_custom_func(&format!("rms_norm_{}", suffix(x.0.dtype())?), MODULE, PTX)?;
    let mut a = func.builder();
    a.arg(&xs);
    a.arg(&ws);
    a.arg(&out);
    builder_arg!(a, rows, op.d as u32, op.eps);
    let warps_per_block = (THREADS / 32) as usize;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(warps_per_block) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature.
    unsafe { a.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

cuda_op!(RmsNorm, "sdhive-rms-norm", |op, x, w| {
    let out = by_dtype!(x.0.dtype(), rms_norm_launch(op, x, w))?;
    Ok((out, x.1.shape().clone()))
});

/// RMSNorm of every `weight.len()`-wide row of `x` (an attention head of `(B, S, H·D)`), statistics in f32, with
/// diffusers' roundings in half precision.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let d = weight.elem_count();
    if d == 0 || !x.elem_count().is_multiple_of(d) || !x.dims().last().is_some_and(|c| c.is_multiple_of(d)) {
        bail!("rms_norm: rows of {d} do not divide {:?}", x.dims());
    }
    let norms = Some((weight, weight));
    if joint_rows_fit(x, None, norms, d) {
        return run_joint_rows(x, None, norms, d, eps);
    }
    x.apply_op2_no_bwd(weight, &RmsNorm { d, eps: eps as f32 })
}

/// The joint token sequence of an MMDiT attention, `(B, Sa + Sb, C)` from `a` `(B, Sa, C)` and `b` `(B, Sb, C)`,
/// and with `norms` each `d`-wide head RMS-normalised by `norms.0` (rows of `a`) or `norms.1` (rows of `b`): the
/// concatenation and the per-head norms of the query or key in one pass (16 bytes per thread).
struct JointRows {
    /// `b` and the norm weights, held beside the op's operand `a`.
    b: Option<Tensor>,
    norms: Option<(Tensor, Tensor)>,
    sb: usize,
    d: usize,
    eps: f32,
}

/// Whether [`rms_norm`] reads `x` in place through the joint-rows kernel.
pub(crate) fn rms_norm_in_place(x: &Tensor, weight: &Tensor) -> bool {
    joint_rows_fit(x, None, Some((weight, weight)), weight.elem_count())
}

/// `(B, S, C)` tokens whose rows are contiguous and evenly spaced (a column range of wider rows: a narrow of a
/// stacked q/k/v projection's output) as the `(B·S, C)` matrix of those rows; `None` for any other layout.
fn token_rows(l: &Layout) -> Option<Layout> {
    let (&[b, s, c], &[bs, rs, 1]) = (l.dims(), l.stride()) else { return None };
    (b == 1 || bs == s * rs)
        .then(|| Layout::new(Shape::from((b * s, c)), vec![rs.max(c), 1], l.start_offset()))
}

/// Whether the joint-rows kernel takes `a` (and `b`, and the norm weights) with heads of `d`: rows contiguous,
/// evenly spaced ([`token_rows`]) and 16-byte aligned (candle's allocations are), widths in whole 16-byte vectors,
/// and a head's vectors a power of two up to 32.
fn joint_rows_fit(a: &Tensor, b: Option<&Tensor>, norms: Option<(&Tensor, &Tensor)>, d: usize) -> bool {
    let Ok((batch, _, c)) = a.dims3() else { return false };
    let vec = 16 / a.dtype().size_in_bytes();
    let rows = |t: &Tensor| {
        t.dtype() == a.dtype()
            && token_rows(t.layout())
                .is_some_and(|r| r.start_offset().is_multiple_of(vec) && r.stride()[0].is_multiple_of(vec))
    };
    let aligned = |t: &Tensor| {
        t.is_contiguous() && t.dtype() == a.dtype() && t.layout().start_offset().is_multiple_of(vec)
    };
    let head_vectors = d / vec;
    rows(a)
        && c.is_multiple_of(d)
        && d.is_multiple_of(vec)
        && head_vectors.is_power_of_two()
        && head_vectors <= 32
        && b.is_none_or(|b| rows(b) && b.dims3().is_ok_and(|(bb, _, bc)| bb == batch && bc == c))
        && norms.is_none_or(|(wa, wb)| [wa, wb].iter().all(|w| aligned(w) && w.elem_count() == d))
}

/// The joint-rows kernel on tensors [`joint_rows_fit`] takes.
fn run_joint_rows(
    a: &Tensor,
    b: Option<&Tensor>,
    norms: Option<(&Tensor, &Tensor)>,
    d: usize,
    eps: f64,
) -> Result<Tensor> {
    let op = JointRows {
        b: b.cloned(),
        norms: norms.map(|(wa, wb)| (wa.clone(), wb.clone())),
        sb: b.map_or(Ok(0), |b| b.dim(1))?,
        d,
        eps: eps as f32,
    };
    a.apply_op1_no_bwd(&op)
}

fn joint_rows_launch<T: CudaDType + DeviceRepr>(
    op: &JointRows,
    a: &CudaStorage,
    al: &Layout,
) -> Result<CudaStorage> {
    let dev: &CudaDevice = a.device();
    let (batch, sa, c) = al.shape().dims3()?;
    let n = batch * (sa + op.sb) * c;
    let vectors = n / per_vector::<T>();
    let rows = |l: &Layout| {
        token_rows(l)
            .ok_or_else(|| candle_core::Error::Msg("joint rows: tokens must be evenly spaced rows".into()))
    };
    let (av, ra) = rows_view::<T>(a, &rows(al)?, "joint rows")?;
    let held_b = op.b.as_ref().map(|b| b.storage_and_layout());
    let b_rows = held_b.as_ref().map(|(_, l)| rows(l)).transpose()?;
    let bv = match (&held_b, &b_rows) {
        (Some((g, _)), Some(l)) => match &**g {
            Storage::Cuda(s) => Some(rows_view::<T>(s, l, "joint rows")?),
            _ => bail!("joint rows: b is not on the GPU"),
        },
        _ => None,
    };
    let rb = bv.as_ref().map_or(c, |(_, r)| *r);
    let bv = bv.map(|(v, _)| v);
    let held_w = op.norms.as_ref().map(|(wa, wb)| (wa.storage_and_layout(), wb.storage_and_layout()));
    let wv = held_w
        .as_ref()
        .map(|(wa, wb)| {
            Ok::<_, candle_core::Error>((held_view::<T, _>(wa, "norm")?, held_view::<T, _>(wb, "norm")?))
        })
        .transpose()?;
    // SAFETY: written in full by the kernel.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
    let name = if wv.is_some() { "joint_rows_norm" } else { "joint_rows" };
    let func = dev.get_or_load_custom_func(&format!("{name}_{}", suffix(a.dtype())?), MODULE, PTX)?;
    let mut k = func.builder();
    k.arg(&av);
    // Without `b` its pointer is never read (no row comes from it): `a`'s stands in.
    match &bv {
        Some(b) => k.arg(b),
        None => k.arg(&av),
    };
    // Without norms the weights are never read: `a`'s pointer stands in.
    match &wv {
        Some((wa, wb)) => {
            k.arg(wa);
            k.arg(wb);
        }
        None => {
            k.arg(&av);
            k.arg(&av);
        }
    }
    k.arg(&out);
    let vec = per_vector::<T>();
    builder_arg!(
        k,
        vectors,
        sa as u32,
        op.sb as u32,
        (ra / vec) as u32,
        (rb / vec) as u32,
        c as u32,
        op.d as u32,
        op.eps
    );
    let cfg = LaunchConfig {
        grid_dim: (vectors.div_ceil(THREADS as usize) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; the grid covers every vector once.
    unsafe { k.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

impl CustomOp1 for JointRows {
    fn name(&self) -> &'static str {
        "sdhive-joint-rows"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        cpu_only(self.name())
    }

    fn cuda_fwd(&self, a: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let out = by_dtype!(a.dtype(), joint_rows_launch(self, a, l))?;
        let (batch, sa, c) = l.shape().dims3()?;
        Ok((out, Shape::from((batch, sa + self.sb, c))))
    }
}

/// `(B, Sa + Sb, C)`: per sample the rows of `a` `(B, Sa, C)` then those of `b` `(B, Sb, C)`, each `d`-wide head
/// RMS-normalised (statistics in f32, diffusers' roundings) by `norms.0` in `a`'s rows and `norms.1` in `b`'s when
/// given: an MMDiT's joint query or key (or value, without norms) in one pass. `None` where the kernel does not
/// take the tensors (the caller composes it).
pub fn joint_rows(
    a: &Tensor,
    b: &Tensor,
    norms: Option<(&Tensor, &Tensor)>,
    d: usize,
    eps: f64,
) -> Result<Option<Tensor>> {
    if !joint_rows_fit(a, Some(b), norms, d) {
        return Ok(None);
    }
    run_joint_rows(a, Some(b), norms, d, eps).map(Some)
}

/// `x + gate · y` for `(B, S, D)` `x` and `y` with a `(B, D)` gate (rows contiguous, any distance apart).
struct GatedAdd;

fn gated_add_launch<T: CudaDType + DeviceRepr>(
    x: (&CudaStorage, &Layout),
    gate: (&CudaStorage, &Layout),
    y: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.0.device();
    let (_, s, d) = x.1.shape().dims3()?;
    let n = x.1.shape().elem_count();
    let xs = contiguous::<T>(x.0, x.1, "gated_add input")?;
    let (gs, gate_stride) = rows_view::<T>(gate.0, gate.1, "gated_add gate")?;
    let ys = contiguous::<T>(y.0, y.1, "gated_add update")?;
    // SAFETY: written in full by the kernel.
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
    let func = dev.get_or_load_custom_func(&format!("gated_add_{}", suffix(x.0.dtype())?), MODULE, PTX)?;
    let mut a = func.builder();
    a.arg(&xs);
    a.arg(&gs);
    a.arg(&ys);
    a.arg(&out);
    builder_arg!(a, n, d as u32, s * d, gate_stride as u32);
    let vectorizable = d.is_multiple_of(per_vector::<T>()) && gate_stride.is_multiple_of(per_vector::<T>());
    let cfg = LaunchConfig {
        grid_dim: (grid_for(items::<T>(n, vectorizable)), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature.
    unsafe { a.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

cuda_op!(GatedAdd, "sdhive-gated-add", |_, x, g, y| {
    let out = by_dtype!(x.0.dtype(), gated_add_launch(x, g, y))?;
    Ok((out, x.1.shape().clone()))
});

pub fn gated_add(x: &Tensor, gate: &Tensor, y: &Tensor) -> Result<Tensor> {
    let (b, _, d) = x.dims3()?;
    if y.dims() != x.dims() || gate.dims() != [b, d] {
        bail!("gated_add: x {:?}, gate {:?}, y {:?}", x.dims(), gate.dims(), y.dims());
    }
    x.apply_op3_no_bwd(gate, y, &GatedAdd)
}

/// The convolution's geometry, for im2col.
struct Im2Col {
    kh: usize,
    kw: usize,
    stride: usize,
    pad: usize,
    out_h: usize,
    out_w: usize,
}

fn im2col_launch<T: CudaDType + DeviceRepr>(op: &Im2Col, x: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.device();
    let (b, c, h, w) = l.shape().dims4()?;
    let n = b * c * op.kh * op.kw * op.out_h * op.out_w;
    let xs = contiguous::<T>(x, l, "convolution input")?;
    // SAFETY: written in full by the kernel.
    let col: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
    let func = dev.get_or_load_custom_func(&format!("im2col_{}", suffix(x.dtype())?), MODULE, PTX)?;
    let mut a = func.builder();
    a.arg(&xs);
    a.arg(&col);
    builder_arg!(
        a,
        c as u32,
        h as u32,
        w as u32,
        op.kh as u32,
        op.kw as u32,
        op.stride as u32,
        op.pad as u32,
        op.out_h as u32,
        op.out_w as u32,
        n
    );
    let cfg = LaunchConfig { grid_dim: (grid_for(n), 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature.
    unsafe { a.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(col, dev.clone()))
}

single_input_op!(Im2Col, "sdhive-im2col", im2col_launch, |op, l| {
    let (b, c, _, _) = l.shape().dims4()?;
    Ok(Shape::from((b, c * op.kh * op.kw, op.out_h * op.out_w)))
});

/// `conv2d(x, weight)` without bias for NCHW `x` and `weight` `(out, in, kh, kw)`: a 1×1 stride-1 convolution
/// is one matrix product; others go through im2col in the (in·kh·kw, pixels) layout, so the product with the
/// weight yields NCHW without a transpose.
pub fn conv2d(x: &Tensor, weight: &Tensor, stride: usize, padding: usize) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    let (co, ci, kh, kw) = weight.dims4()?;
    if ci != c || stride == 0 || h + 2 * padding < kh || w + 2 * padding < kw {
        bail!("conv2d: input {:?} does not fit weight {:?}", x.dims(), weight.dims());
    }
    let out_h = (h + 2 * padding - kh) / stride + 1;
    let out_w = (w + 2 * padding - kw) / stride + 1;
    let k = ci * kh * kw;
    let w2 = weight.reshape((1, co, k))?.broadcast_as((b, co, k))?;
    let col = if kh == 1 && kw == 1 && stride == 1 && padding == 0 {
        x.reshape((b, c, h * w))?
    } else {
        x.apply_op1_no_bwd(&Im2Col { kh, kw, stride, pad: padding, out_h, out_w })?
    };
    w2.matmul(&col)?.reshape((b, co, out_h, out_w))
}
