//! Convolutions through cuDNN, set up as PyTorch does: half types with f32 accumulation ("pseudo-half") and
//! tensor-op math; f32 with FMA-only kernels (exact f32, as the parity tests want) or, inside
//! [`crate::tf32_convolutions`], TF32 tensor cores (PyTorch's default for cuDNN convolutions, which diffusers' upcast
//! SDXL VAE runs on). The algorithm comes from cuDNN's heuristics; descriptors and algorithm are cached per shape,
//! and one workspace per device only grows (candle's own cuDNN path asks for f16 accumulation and allocates a
//! zeroed workspace on every call). No im2col buffer: the f32 VAE at 1024² would need gigabytes for one. Maps and
//! filters are NCHW / KCRS, or channels-last NHWC / KRSC ([`conv2d_channels_last`]).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cudnn::{
    self, sys, ConvDescriptor, ConvForward, Cudnn, CudnnDataType, FilterDescriptor, TensorDescriptor,
};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, DeviceId};
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, CustomOp2, DType, Layout, Result, Shape, Tensor,
};
use half::{bf16, f16};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

/// Device, dtype, TF32 allowed, channels-last, input (N, C, H, W), filter (K, C, R, S), stride, padding.
type Key = (DeviceId, DType, bool, bool, [usize; 4], [usize; 4], usize, usize);

/// A shape's descriptors and algorithm, for one storage type.
struct Plan<T> {
    conv: ConvDescriptor<f32>,
    x: TensorDescriptor<T>,
    w: FilterDescriptor<T>,
    y: TensorDescriptor<T>,
    algo: sys::cudnnConvolutionFwdAlgo_t,
    workspace: usize,
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
    workspaces: HashMap<DeviceId, CudaSlice<u8>>,
    /// Workspaces outgrown by a larger one, kept for the CUDA graphs recorded with them.
    retired: Vec<CudaSlice<u8>>,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
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
    let algo = fwd.pick_algorithm()?;
    let workspace = fwd.get_workspace_size(algo)?;
    Ok(Plan { conv, x: xd, w: wd, y: yd, algo, workspace })
}

struct Conv {
    stride: usize,
    padding: usize,
    /// Input (N, H, W, C), filter (K, R, S, C) and output (N, H, W, K) in memory, instead of NCHW / KCRS.
    channels_last: bool,
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

fn launch<T: Storage>(
    op: &Conv,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.0.device();
    let (Some((xs, _)), Some((ws, _))) = (x.1.contiguous_offsets(), w.1.contiguous_offsets()) else {
        bail!("cuDNN convolution: input and filter must be contiguous")
    };
    let (xdims, wdims) = (op.logical(x.1)?, op.logical(w.1)?);
    let ydims = op.out_dims(xdims, wdims);
    let tf32 = x.0.dtype() == DType::F32 && crate::tf32_allowed();
    let key: Key = (dev.id(), x.0.dtype(), tf32, op.channels_last, xdims, wdims, op.stride, op.padding);
    let xv = x.0.as_cuda_slice::<T>()?.slice(xs..);
    let wv = w.0.as_cuda_slice::<T>()?.slice(ws..);
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
                let plan = make_plan::<T>(&cudnn, op, xdims, wdims, tf32)
                    .map_err(|e| wrap_err(e, &format!("plan for {xdims:?} * {wdims:?}")))?;
                e.insert(T::wrap(plan))
            }
        };
        let Some(plan) = T::plan(plan) else {
            bail!("cuDNN convolution: plan cache holds another dtype for {key:?}")
        };
        let need = plan.workspace.max(1);
        if state.workspaces.get(&dev.id()).is_none_or(|w| w.len() < need) {
            if crate::graph::capturing() {
                bail!("cuDNN convolution: the workspace would grow during a CUDA graph capture")
            }
            // SAFETY: workspace memory is scratch for cuDNN, never read before it writes it.
            let fresh = unsafe { dev.alloc::<u8>(need)? };
            // A captured graph may still use the smaller one.
            if let Some(old) = state.workspaces.insert(dev.id(), fresh) {
                state.retired.push(old);
            }
        }
        let Some(workspace) = state.workspaces.get_mut(&dev.id()) else { bail!("cuDNN workspace missing") };
        let fwd = ConvForward { conv: &plan.conv, x: &plan.x, w: &plan.w, y: &plan.y };
        // SAFETY: the descriptors were made for exactly these shapes and this storage type; the buffers are
        // contiguous at their offsets.
        unsafe { fwd.launch(plan.algo, Some(workspace), (T::one(), T::zero()), &xv, &wv, &mut y) }
            .map_err(|e| wrap_err(e, "convolution"))
    })?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

impl CustomOp2 for Conv {
    fn name(&self) -> &'static str {
        "sdhive-cudnn-conv2d"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        crate::cuda::cpu_only(self.name())
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let shape = Shape::from(self.physical(self.out_dims(self.logical(xl)?, self.logical(wl)?)).to_vec());
        let y = match x.dtype() {
            DType::F16 => launch::<f16>(self, (x, xl), (w, wl))?,
            DType::BF16 => launch::<bf16>(self, (x, xl), (w, wl))?,
            DType::F32 => launch::<f32>(self, (x, xl), (w, wl))?,
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
    x.apply_op2_no_bwd(weight, &Conv { stride, padding, channels_last: false })
}

/// [`conv2d`] on channels-last tensors: input (N, H, W, C), filter (K, R, S, C), output (N, Ho, Wo, K). cuDNN's
/// tensor-core kernels work in this layout, so nothing is transposed on the way (NCHW calls transpose the input,
/// the filter and the output every time).
pub fn conv2d_channels_last(x: &Tensor, weight: &Tensor, stride: usize, padding: usize) -> Result<Tensor> {
    let (_, h, w, c) = x.dims4()?;
    let (_, r, s, wc) = weight.dims4()?;
    if wc != c || h + 2 * padding < r || w + 2 * padding < s || stride == 0 {
        bail!(
            "conv2d (channels-last): input {:?} and filter {:?} do not fit (stride {stride}, padding {padding})",
            x.dims(),
            weight.dims()
        );
    }
    x.apply_op2_no_bwd(weight, &Conv { stride, padding, channels_last: true })
}
