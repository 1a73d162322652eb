//! Convolutions through cuDNN, set up as PyTorch does: half types with f32 accumulation ("pseudo-half") and
//! tensor-op math; f32 with FMA-only kernels (exact f32, as the parity tests want) or, inside
//! [`crate::tf32_convolutions`], TF32 tensor cores (PyTorch's default for cuDNN convolutions, which diffusers' upcast
//! SDXL VAE runs on). The algorithm comes from cuDNN's heuristics; descriptors and algorithm are cached per shape,
//! and one workspace per device only grows (candle's own cuDNN path asks for f16 accumulation and allocates a
//! zeroed workspace on every call). No im2col buffer: the f32 VAE at 1024² would need gigabytes for one. Maps and
//! filters are NCHW / KCRS, or channels-last NHWC / KRSC ([`conv2d_channels_last`]). Channels-last convolutions
//! can add their bias and a skip connection in cuDNN's own epilogue ([`conv2d_channels_last_epilogue`]), so the
//! output is written once instead of being read back by a separate add pass.

use crate::cuda::{contiguous, held_view};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cudnn::{
    self, sys, ActivationDescriptor, ConvBiasActivationForward, ConvDescriptor, ConvForward, Cudnn,
    CudnnDataType, FilterDescriptor, TensorDescriptor,
};
use candle_core::cuda_backend::cudarc::driver::{
    sys as sys_driver, CudaSlice, CudaStream, DevicePtr, DeviceRepr, DeviceSlice, SyncOnDrop,
};
use candle_core::cuda_backend::{CudaDType, DeviceId};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;

/// Device, dtype, TF32 allowed, channels-last, input (N, C, H, W), filter (K, C, R, S), stride, padding, bias
/// (and skip) in the epilogue.
type Key = (DeviceId, DType, bool, bool, [usize; 4], [usize; 4], usize, usize, bool);

/// A shape's descriptors and algorithm, for one storage type.
struct Plan<T> {
    conv: ConvDescriptor<f32>,
    x: TensorDescriptor<T>,
    w: FilterDescriptor<T>,
    y: TensorDescriptor<T>,
    epilogue: Option<Epilogue<T>>,
    algo: sys::cudnnConvolutionFwdAlgo_t,
    workspace: usize,
}

/// What `cudnnConvolutionBiasActivationForward` needs beyond the convolution: the bias as a (1, K, 1, 1) tensor
/// and an identity activation.
struct Epilogue<T> {
    bias: TensorDescriptor<T>,
    act: ActivationDescriptor<f32>,
}

enum AnyPlan {
    F16(Plan<f16>),
    Bf16(Plan<bf16>),
    F32(Plan<f32>),
}

trait Storage: CudaDType + DeviceRepr + CudnnDataType + candle_core::WithDType {
    fn plan(p: &AnyPlan) -> Option<&Plan<Self>>;
    fn wrap(p: Plan<Self>) -> AnyPlan;
}

macro_rules! storage {
    ($t:ty, $variant:ident) => {
        impl Storage for $t {
            fn plan(p: &AnyPlan) -> Option<&Plan<Self>> {
                match p {
                    AnyPlan::$variant(p) => Some(p),
                    _ => None,
                }
            }
            fn wrap(p: Plan<Self>) -> AnyPlan {
                AnyPlan::$variant(p)
            }
        }
    };
}

storage!(f16, F16);
storage!(bf16, Bf16);
storage!(f32, F32);

/// cuDNN state per thread (its handles are neither Send nor Sync), as candle keeps its own.
#[derive(Default)]
struct State {
    handles: HashMap<DeviceId, Arc<Cudnn>>,
    plans: HashMap<Key, AnyPlan>,
}

/// One cuDNN workspace per device that only grows, shared by the convolutions and the attention
/// (`cudnn_attention`).
#[derive(Default)]
struct Workspaces {
    current: HashMap<DeviceId, CudaSlice<u8>>,
    /// Workspaces outgrown by a larger one, kept for the CUDA graphs recorded with them.
    retired: Vec<CudaSlice<u8>>,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
    static WORKSPACES: RefCell<Workspaces> = RefCell::new(Workspaces::default());
    /// Set when cuDNN refused a convolution with its epilogue (`CUDNN_STATUS_NOT_SUPPORTED`, checked before anything
    /// runs), so [`conv2d_channels_last_epilogue`] takes the separate add instead.
    static EPILOGUE_REFUSED: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with this thread's cuDNN workspace on `dev`, grown to at least `need` bytes first (never while a CUDA
/// graph is recorded: the graph would own the new one, and freeing the old one is not a recordable operation).
pub(crate) fn with_workspace<R>(
    dev: &CudaDevice,
    need: usize,
    f: impl FnOnce(&mut CudaSlice<u8>) -> Result<R>,
) -> Result<R> {
    WORKSPACES.with(|w| {
        let mut w = w.borrow_mut();
        let w = &mut *w;
        let need = need.max(1);
        if w.current.get(&dev.id()).is_none_or(|s| s.len() < need) {
            if crate::graph::capturing() {
                bail!("cuDNN: the workspace would grow during a CUDA graph capture")
            }
            // SAFETY: workspace memory is scratch for cuDNN, never read before it writes it.
            let fresh = unsafe { dev.alloc::<u8>(need)? };
            // A recorded graph may still use the smaller one.
            if let Some(old) = w.current.insert(dev.id(), fresh) {
                w.retired.push(old);
            }
        }
        let Some(workspace) = w.current.get_mut(&dev.id()) else { bail!("cuDNN workspace missing") };
        f(workspace)
    })
}

fn wrap_err(e: impl std::fmt::Debug, what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuDNN {what}: {e:?}"))
}

fn make_plan<T: Storage>(
    cudnn: &Arc<Cudnn>,
    op: &Conv,
    x: [usize; 4],
    w: [usize; 4],
    tf32: bool,
    with_bias: bool,
) -> std::result::Result<Plan<T>, cudnn::CudnnError> {
    let i = |v: usize| v as i32;
    let (p, s) = (i(op.padding), i(op.stride));
    let mut conv = cudnn.create_conv2d::<f32>(
        [p, p],
        [s, s],
        [1, 1],
        sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
    )?;
    let math = match (T::DTYPE, tf32) {
        (DType::F32, false) => sys::cudnnMathType_t::CUDNN_FMA_MATH,
        (DType::F32, true) => sys::cudnnMathType_t::CUDNN_DEFAULT_MATH,
        _ => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
    };
    conv.set_math_type(math)?;
    // Descriptors take logical (N, C, H, W) / (K, C, R, S) sizes whatever the format.
    let format = if op.channels_last {
        sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC
    } else {
        sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW
    };
    let xd = cudnn.create_4d_tensor::<T>(format, x.map(i))?;
    let wd = cudnn.create_4d_filter::<T>(format, w.map(i))?;
    let yd = cudnn.create_4d_tensor::<T>(format, op.out_dims(x, w).map(i))?;
    let fwd = ConvForward { conv: &conv, x: &xd, w: &wd, y: &yd };
    let (algo, epilogue) = if with_bias {
        // The identity activation (no activation at all) is only implemented by this algorithm.
        let bias = cudnn.create_4d_tensor::<T>(format, [1, i(w[0]), 1, 1])?;
        let act = cudnn.create_activation::<f32>(
            sys::cudnnActivationMode_t::CUDNN_ACTIVATION_IDENTITY,
            sys::cudnnNanPropagation_t::CUDNN_NOT_PROPAGATE_NAN,
            0.0,
        )?;
        (
            sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
            Some(Epilogue { bias, act }),
        )
    } else {
        (fwd.pick_algorithm()?, None)
    };
    let workspace = fwd.get_workspace_size(algo)?;
    Ok(Plan { conv, x: xd, w: wd, y: yd, epilogue, algo, workspace })
}

struct Conv {
    stride: usize,
    padding: usize,
    /// Input (N, H, W, C), filter (K, R, S, C) and output (N, H, W, K) in memory, instead of NCHW / KCRS.
    channels_last: bool,
    /// Added in cuDNN's epilogue with the bias (the op's third operand; a call with a bias always uses the
    /// epilogue): a skip connection of the output's shape.
    skip: Option<Tensor>,
}

impl Conv {
    /// The logical (N, K, H, W) output of logical input `x` (N, C, H, W) and filter `w` (K, C, R, S).
    fn out_dims(&self, x: [usize; 4], w: [usize; 4]) -> [usize; 4] {
        let out = |len: usize, k: usize| (len + 2 * self.padding - k) / self.stride + 1;
        [x[0], w[0], out(x[2], w[2]), out(x[3], w[3])]
    }

    /// A tensor's logical (N, C, H, W) sizes from its shape in memory.
    fn logical(&self, l: &Layout) -> Result<[usize; 4]> {
        let (a, b, c, d) = l.shape().dims4()?;
        Ok(if self.channels_last { [a, d, b, c] } else { [a, b, c, d] })
    }

    /// The shape in memory of logical (N, C, H, W) sizes.
    fn physical(&self, [n, c, h, w]: [usize; 4]) -> [usize; 4] {
        if self.channels_last {
            [n, h, w, c]
        } else {
            [n, c, h, w]
        }
    }
}

/// A device buffer by its address: the z operand of a convolution without skip is the output, already borrowed
/// mutably.
struct Alias<'a, T> {
    ptr: sys_driver::CUdeviceptr,
    len: usize,
    stream: &'a Arc<CudaStream>,
    marker: PhantomData<T>,
}

impl<T> DeviceSlice<T> for Alias<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtr<T> for Alias<'_, T> {
    fn device_ptr<'b>(&'b self, _: &'b CudaStream) -> (sys_driver::CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

fn launch<T: Storage>(
    op: &Conv,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    bias: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.0.device();
    let (Some((xs, _)), Some((ws, _))) = (x.1.contiguous_offsets(), w.1.contiguous_offsets()) else {
        bail!("cuDNN convolution: input and filter must be contiguous")
    };
    let (xdims, wdims) = (op.logical(x.1)?, op.logical(w.1)?);
    let ydims = op.out_dims(xdims, wdims);
    let tf32 = x.0.dtype() == DType::F32 && crate::tf32_convolutions_on();
    let key: Key =
        (dev.id(), x.0.dtype(), tf32, op.channels_last, xdims, wdims, op.stride, op.padding, bias.is_some());
    let xv = x.0.as_cuda_slice::<T>()?.slice(xs..);
    let wv = w.0.as_cuda_slice::<T>()?.slice(ws..);
    let bv = match bias {
        Some((s, l)) if l.shape().elem_count() == ydims[1] => {
            Some(contiguous::<T>(s, l, "the convolution's bias")?)
        }
        Some((_, l)) => bail!("cuDNN convolution: bias {:?} for {} output channels", l.dims(), ydims[1]),
        None => None,
    };
    let skip = op.skip.as_ref().map(|r| r.storage_and_layout());
    let zv = match &skip {
        Some(held) if held.1.dims() == op.physical(ydims) => {
            Some(held_view::<T, _>(held, "the convolution's skip")?)
        }
        Some((_, l)) => {
            bail!("cuDNN convolution: skip {:?} differs from the output {:?}", l.dims(), op.physical(ydims))
        }
        None => None,
    };
    // SAFETY: cuDNN writes every output element (beta = 0).
    let mut y: CudaSlice<T> = unsafe { dev.alloc::<T>(ydims.iter().product())? };
    STATE.with(|state| -> Result<()> {
        let mut state = state.borrow_mut();
        let state = &mut *state;
        let cudnn = match state.handles.get(&dev.id()) {
            Some(h) => h.clone(),
            None => {
                let h = Cudnn::new(dev.cuda_stream()).map_err(|e| wrap_err(e, "handle"))?;
                state.handles.insert(dev.id(), h.clone());
                h
            }
        };
        let plan = match state.plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let plan = make_plan::<T>(&cudnn, op, xdims, wdims, tf32, bv.is_some())
                    .map_err(|e| wrap_err(e, &format!("plan for {xdims:?} * {wdims:?}")))?;
                e.insert(T::wrap(plan))
            }
        };
        let Some(plan) = T::plan(plan) else {
            bail!("cuDNN convolution: plan cache holds another dtype for {key:?}")
        };
        with_workspace(dev, plan.workspace, |workspace| {
            if let (Some(e), Some(bv)) = (&plan.epilogue, &bv) {
                let fwd = ConvBiasActivationForward {
                    conv: &plan.conv,
                    act: &e.act,
                    x: &plan.x,
                    w: &plan.w,
                    z: &plan.y,
                    bias: &e.bias,
                    y: &plan.y,
                };
                // Without a skip (alpha2 = 0) cuDNN does not read z, but wants a buffer of the output's size: the
                // output itself, as TensorFlow passes it. The input, z and the bias are one pointer type for cuDNN's
                // wrapper, so each goes by its address.
                let stream = dev.cuda_stream();
                let alias = |ptr, len| Alias::<T> { ptr, len, stream: &stream, marker: PhantomData };
                let src = alias(xv.device_ptr(&stream).0, xv.len());
                let (z, alpha2) = match &zv {
                    Some(z) => (alias(z.device_ptr(&stream).0, z.len()), T::one()),
                    None => (alias(y.device_ptr(&stream).0, y.len()), T::zero()),
                };
                let bias = alias(bv.device_ptr(&stream).0, bv.len());
                // SAFETY: the descriptors were made for exactly these shapes and this storage type; the buffers are
                // contiguous at their offsets; z and the bias match the output and (1, K, 1, 1) descriptors, and z
                // is read only with a skip (then it is the skip, not y).
                let done = unsafe {
                    fwd.launch(plan.algo, Some(workspace), (T::one(), alpha2), &src, &wv, &z, &bias, &mut y)
                };
                return match done {
                    Err(cudnn::CudnnError(sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED)) => {
                        EPILOGUE_REFUSED.with(|r| r.set(true));
                        bail!("cuDNN convolution: bias and skip in the epilogue not supported for {key:?}")
                    }
                    other => other.map_err(|e| wrap_err(e, "convolution with bias")),
                };
            }
            let fwd = ConvForward { conv: &plan.conv, x: &plan.x, w: &plan.w, y: &plan.y };
            // SAFETY: the descriptors were made for exactly these shapes and this storage type; the buffers are
            // contiguous at their offsets.
            unsafe { fwd.launch(plan.algo, Some(workspace), (T::one(), T::zero()), &xv, &wv, &mut y) }
                .map_err(|e| wrap_err(e, "convolution"))
        })
    })?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

crate::cuda::optional_bias_op!(Conv, "sdhive-cudnn-conv2d", "sdhive-cudnn-conv2d-bias", forward);

impl Conv {
    fn forward(
        &self,
        x: (&CudaStorage, &Layout),
        w: (&CudaStorage, &Layout),
        bias: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        let shape =
            Shape::from(self.physical(self.out_dims(self.logical(x.1)?, self.logical(w.1)?)).to_vec());
        let y = match x.0.dtype() {
            DType::F16 => launch::<f16>(self, x, w, bias)?,
            DType::BF16 => launch::<bf16>(self, x, w, bias)?,
            DType::F32 => launch::<f32>(self, x, w, bias)?,
            other => bail!("cuDNN convolution: unsupported dtype {other:?}"),
        };
        Ok((y, shape))
    }
}

/// Whether [`conv2d`] takes this input: f32, f16 or bf16.
pub fn applies(x: &Tensor) -> bool {
    matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
}

pub fn conv2d(x: &Tensor, weight: &Tensor, stride: usize, padding: usize) -> Result<Tensor> {
    let (_, c, h, w) = x.dims4()?;
    let (_, wc, r, s) = weight.dims4()?;
    if wc != c || h + 2 * padding < r || w + 2 * padding < s || stride == 0 {
        bail!(
            "conv2d: input {:?} and filter {:?} do not fit (stride {stride}, padding {padding})",
            x.dims(),
            weight.dims()
        );
    }
    x.apply_op2_no_bwd(weight, &Conv { stride, padding, channels_last: false, skip: None })
}

/// [`conv2d`] on channels-last tensors: input (N, H, W, C), filter (K, R, S, C), output (N, Ho, Wo, K). cuDNN's
/// tensor-core kernels work in this layout, so nothing is transposed on the way (NCHW calls transpose the input,
/// the filter and the output every time).
pub fn conv2d_channels_last(x: &Tensor, weight: &Tensor, stride: usize, padding: usize) -> Result<Tensor> {
    check_channels_last(x, weight, stride, padding)?;
    x.apply_op2_no_bwd(weight, &Conv { stride, padding, channels_last: true, skip: None })
}

/// [`conv2d_channels_last`] `+ bias (+ skip)`, both added in cuDNN's epilogue: `bias` `(K)`, `skip` the output's
/// shape. Where cuDNN refuses the fused form for a shape or type, the convolution and one add pass.
pub fn conv2d_channels_last_epilogue(
    x: &Tensor,
    weight: &Tensor,
    stride: usize,
    padding: usize,
    bias: &Tensor,
    skip: Option<&Tensor>,
) -> Result<Tensor> {
    check_channels_last(x, weight, stride, padding)?;
    let op = Conv { stride, padding, channels_last: true, skip: skip.cloned() };
    EPILOGUE_REFUSED.with(|r| r.set(false));
    match x.apply_op3_no_bwd(weight, bias, &op) {
        Err(_) if EPILOGUE_REFUSED.with(|r| r.take()) => {
            let y = conv2d_channels_last(x, weight, stride, padding)?;
            crate::cuda::add_channel(&y, bias, skip, true)
        }
        done => done,
    }
}

fn check_channels_last(x: &Tensor, weight: &Tensor, stride: usize, padding: usize) -> Result<()> {
    let (_, h, w, c) = x.dims4()?;
    let (_, r, s, wc) = weight.dims4()?;
    if wc != c || h + 2 * padding < r || w + 2 * padding < s || stride == 0 {
        bail!(
            "conv2d (channels-last): input {:?} and filter {:?} do not fit (stride {stride}, padding {padding})",
            x.dims(),
            weight.dims()
        );
    }
    Ok(())
}
