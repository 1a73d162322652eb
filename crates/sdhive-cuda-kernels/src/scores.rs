//! Attention scores of half-precision queries and keys in f32, `scale · q kᵀ`, as one batched cuBLAS product on
//! tensor cores (f16/bf16 operands, f32 accumulation and output). An upcast softmax (the VAE's one-head attention,
//! `upcast_softmax=True` in diffusers) wants its scores in f32; converting q and k to f32 first put the product on
//! FMA-only f32 kernels (TF32 stays off for products, as in PyTorch), a 4096 × 4096 × 512 product taking 0.37 ms on
//! an H200. The values agree to f32 rounding: each half value is exact in f32, and the sums are f32 either way.

use crate::cuda::contiguous;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::{result as blas, sys};
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaStorage, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use std::ffi::c_void;

struct Scores {
    scale: f32,
}

impl Scores {
    fn forward(
        &self,
        q: (&CudaStorage, &Layout),
        k: (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let ((qs, ql), (ks, kl)) = (q, k);
        let (n, sq, d) = ql.shape().dims3()?;
        let (nk, sk, dk) = kl.shape().dims3()?;
        if nk != n || dk != d {
            bail!(
                "attention scores: queries {:?} and keys {:?} differ in batch or width",
                ql.dims(),
                kl.dims()
            );
        }
        let int = |v: usize, what: &str| -> Result<i32> {
            i32::try_from(v)
                .map_err(|_| candle_core::Error::Msg(format!("attention scores: {what} {v} too large")))
        };
        let (sq_i, sk_i, d_i, n_i) =
            (int(sq, "queries")?, int(sk, "keys")?, int(d, "width")?, int(n, "batch")?);
        if ks.dtype() != qs.dtype() {
            bail!("attention scores: queries in {:?}, keys in {:?}", qs.dtype(), ks.dtype());
        }
        let dims = [n_i, sq_i, sk_i, d_i];
        let out = match qs.dtype() {
            DType::F16 => product::<f16>(q, k, self.scale, sys::cudaDataType::CUDA_R_16F, dims)?,
            DType::BF16 => product::<bf16>(q, k, self.scale, sys::cudaDataType::CUDA_R_16BF, dims)?,
            other => bail!("attention scores: {other:?} operands (f16 or bf16 only)"),
        };
        Ok((out, Shape::from((n, sq, sk))))
    }
}

fn product<T: CudaDType>(
    (qs, ql): (&CudaStorage, &Layout),
    (ks, kl): (&CudaStorage, &Layout),
    scale: f32,
    ty: sys::cudaDataType,
    [n, sq, sk, d]: [i32; 4],
) -> Result<CudaStorage> {
    let dev = qs.device().clone();
    let stream = dev.cuda_stream();
    let (qv, kv) = (contiguous::<T>(qs, ql, "queries")?, contiguous::<T>(ks, kl, "keys")?);
    let len = |a: i32, b: i32| a as usize * b as usize;
    // SAFETY: written in full by the product (beta 0).
    let mut out = unsafe { dev.alloc::<f32>(n as usize * len(sq, sk))? };
    let (alpha, beta) = (scale, 0f32);
    let blas_handle = dev.cublas_handle();
    let (qp, gq) = qv.device_ptr(&stream);
    let (kp, gk) = kv.device_ptr(&stream);
    let (op, go) = out.device_ptr_mut(&stream);
    // Column-major terms: the row-major (sq, sk) scores are the (sk, sq) product Kᵀ·Q of K and Q stored
    // column-major as (d, sk) and (d, sq).
    // SAFETY: the pointers are live device buffers of the sizes the strides and counts describe (the guards above
    // drop after the call is queued), on the stream the handle is bound to; alpha and beta are host f32 as the
    // compute type wants.
    unsafe {
        blas::gemm_strided_batched_ex(
            *blas_handle.handle(),
            sys::cublasOperation_t::CUBLAS_OP_T,
            sys::cublasOperation_t::CUBLAS_OP_N,
            sk,
            sq,
            d,
            (&alpha) as *const f32 as *const c_void,
            kp as *const c_void,
            ty,
            d,
            len(sk, d) as i64,
            qp as *const c_void,
            ty,
            d,
            len(sq, d) as i64,
            (&beta) as *const f32 as *const c_void,
            op as *mut c_void,
            sys::cudaDataType::CUDA_R_32F,
            sk,
            len(sq, sk) as i64,
            n,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .w()?;
    drop((gq, gk, go));
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

crate::cuda::cuda_op!(Scores, "sdhive-attention-scores", |op, q, k| op.forward(q, k));

/// `scale · q kᵀ` in f32 for f16/bf16 `q` (N, Sq, D) and `k` (N, Sk, D), each contiguous.
pub fn attention_scores(q: &Tensor, k: &Tensor, scale: f64) -> Result<Tensor> {
    q.apply_op2_no_bwd(k, &Scores { scale: scale as f32 })
}
