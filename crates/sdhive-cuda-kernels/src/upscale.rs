//! The upscalers' kernels (`upscale.cu`) as candle custom ops, for channels-last ESRGAN maps on a GPU: the dense
//! blocks' join with LeakyReLU in the same pass, LeakyReLU alone, and the residual `s·a + b`. Each takes whole
//! 16-byte vectors per row from 16-byte boundaries (the public wrappers' `vector_rows_apply`).

use crate::cuda::{
    by_dtype, cpu_only, cuda_op, join_last, launch_over, per_vector, single_input_op, suffix, Kernel,
};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
use candle_core::cuda_backend::CudaDType;
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

const MODULE: &str = "sdhive_upscale";
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/upscale.ptx"));

/// The name of `kernel`'s instantiation for `dtype` (`leaky_relu_f16`).
fn instance(kernel: &str, dtype: DType) -> Result<String> {
    Ok(format!("{kernel}_{}", suffix(dtype)?))
}

fn in_module(name: &str) -> Kernel<'_> {
    (name, MODULE, PTX)
}

/// `cat([a, leaky_relu(b)], -1)`.
struct CatLeakyRelu;

cuda_op!(CatLeakyRelu, "sdhive-upscale-cat-leaky-relu", |_, a, b| {
    join_last(in_module(&instance("cat_leaky_relu", a.0.dtype())?), a, b)
});

/// Channels-last `a` and `leaky_relu(b)` joined along their channels; their other dimensions must agree.
pub(crate) fn cat_leaky_relu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (da, db) = (a.dims(), b.dims());
    if da.len() != db.len() || da.len() < 2 || da[..da.len() - 1] != db[..db.len() - 1] {
        bail!("cat_leaky_relu: {da:?} and {db:?} differ outside their channels");
    }
    a.apply_op2_no_bwd(b, &CatLeakyRelu)
}

/// `leaky_relu(x)`, out of place.
struct LeakyRelu;

fn leaky_launch<T: CudaDType + DeviceRepr>(
    _: &LeakyRelu,
    x: &CudaStorage,
    l: &Layout,
) -> Result<CudaStorage> {
    let elems = l.shape().elem_count();
    let n = elems / per_vector::<T>();
    launch_over::<T>(in_module(&instance("leaky_relu", x.dtype())?), &[(x, l)], elems, n, (n,))
}

fn same_shape(_: &LeakyRelu, l: &Layout) -> Result<Shape> {
    Ok(l.shape().clone())
}

single_input_op!(LeakyRelu, "sdhive-upscale-leaky-relu", leaky_launch, same_shape);

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
    let elems = a.1.shape().elem_count();
    let n = elems / per_vector::<T>();
    launch_over::<T>(in_module(&instance("scale_add", a.0.dtype())?), &[a, b], elems, n, (s, n))
}

cuda_op!(ScaleAdd, "sdhive-upscale-scale-add", |op, a, b| {
    Ok((by_dtype!(a.0.dtype(), scale_add_launch(op.0, a, b))?, a.1.shape().clone()))
});

/// `s·a + b`, `a` and `b` of one shape.
pub(crate) fn scale_add(a: &Tensor, s: f64, b: &Tensor) -> Result<Tensor> {
    if a.dims() != b.dims() {
        bail!("scale_add: {:?} and {:?} differ", a.dims(), b.dims());
    }
    a.apply_op2_no_bwd(b, &ScaleAdd(s as f32))
}
