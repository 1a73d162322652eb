//! Linear layers as one cuBLASLt product each: `x·Wᵀ`, the bias added in the product's epilogue and a residual
//! read as its C operand (`D = x·Wᵀ + bias + C`), the way PyTorch's `addmm` adds a linear's bias. The activation
//! side is either tokens `(B, S, ·)` or channels-first `(B, ·, S)` (an NCHW map seen by a 1×1 projection), on
//! input and on output, so moving between the two layouts costs no copy. Each use replaces a product followed by a
//! full pass over its output (and, into channels-first, a transpose copy as well). Each shape's algorithm is the
//! fastest of cuBLASLt's offers, timed on its first call (see [`Plan::candidates`]).

use crate::cuda::{contiguous, held_view};
use crate::Side;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublaslt::result::{self as lt, CublasError};
use candle_core::cuda_backend::cudarc::cublaslt::sys;
use candle_core::cuda_backend::cudarc::driver::sys::{self as sys_driver, CUevent_flags};
use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::{CudaDType, DeviceId, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

/// Hopper's recommended cuBLASLt workspace; other GPUs are content with less.
const WORKSPACE: usize = 32 << 20;

/// Device, dtype, input side, output side, batch, tokens, in features, out features, bias, residual, GELU, and the
/// distance between samples of a token input whose samples are not back to back (0 when they are).
type Key = (DeviceId, DType, Side, Side, usize, usize, usize, usize, bool, bool, bool, usize);

fn lt_err(e: CublasError, what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuBLASLt {what}: {e:?}"))
}

/// Algorithms asked of the heuristic per shape.
const OFFERS: usize = 8;
/// Calls per algorithm when the offers are timed (after one untimed).
const TIMED_CALLS: usize = 8;
/// How much faster than the heuristic's first choice another offer must run to replace it: timing noise must not
/// flip a shape between two algorithms of the same speed.
const MARGIN: f32 = 0.97;

/// Whether each shape's offers are timed (`SDHIVE_LINEAR_TUNE=0` keeps the heuristic's first choice).
fn tuning_on() -> bool {
    switched_on!("SDHIVE_LINEAR_TUNE")
}

/// One shape's product description, layouts and algorithm.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    /// A, B, and C and D (the residual and the output share one layout).
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
    /// The heuristic's other offers, until the first call outside a CUDA graph capture times them against `algo`
    /// on its own operands and keeps the fastest. The heuristic's first choice is often not the fastest at the
    /// UNet's shapes (on an H100 the 64² attention's 320 → 320 query projection runs 1.4x faster on its eighth
    /// offer, with the L2 as a step leaves it; xtask/bench/linear_algos.cu). Offers that split K are left out:
    /// their sums differ in the last bits from the others', and a timing must not change what a product computes.
    candidates: Vec<sys::cublasLtMatmulAlgo_t>,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by this plan and used by nobody else; failures on teardown have no one to report to.
        unsafe {
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// cuBLASLt state per thread, as candle keeps its cuBLAS handles.
#[derive(Default)]
struct State {
    handles: HashMap<DeviceId, sys::cublasLtHandle_t>,
    workspaces: HashMap<DeviceId, CudaSlice<u8>>,
    plans: HashMap<Key, Plan>,
}

impl Drop for State {
    fn drop(&mut self) {
        self.plans.clear();
        for (_, h) in self.handles.drain() {
            // SAFETY: each handle was created here and is destroyed once.
            let _ = unsafe { lt::destroy_handle(h) };
        }
    }
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

fn data_type(dtype: DType) -> Result<sys::cudaDataType_t> {
    Ok(match dtype {
        DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
        DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
        DType::F32 => sys::cudaDataType_t::CUDA_R_32F,
        other => bail!("cuBLASLt linear: unsupported dtype {other:?}"),
    })
}

/// A column-major `rows × cols` layout, `batch` of them `stride` elements apart (0: one matrix shared by all).
fn layout(
    ty: sys::cudaDataType_t,
    (rows, cols, ld): (usize, usize, usize),
    batch: usize,
    stride: usize,
) -> std::result::Result<sys::cublasLtMatrixLayout_t, CublasError> {
    let l = lt::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64)?;
    if batch > 1 {
        let (count, offset) = (batch as i32, stride as i64);
        // SAFETY: `l` is live and the attribute sizes match their types.
        unsafe {
            lt::set_matrix_layout_attribute(
                l,
                sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                (&count) as *const i32 as *const c_void,
                std::mem::size_of::<i32>(),
            )?;
            lt::set_matrix_layout_attribute(
                l,
                sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                (&offset) as *const i64 as *const c_void,
                std::mem::size_of::<i64>(),
            )?;
        }
    }
    Ok(l)
}

fn set_desc<V>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: &V,
) -> Result<()> {
    // SAFETY: `desc` is live and `V` is the attribute's type.
    unsafe {
        lt::set_matmul_desc_attribute(desc, attr, v as *const V as *const c_void, std::mem::size_of::<V>())
    }
    .map_err(|e| lt_err(e, "descriptor"))
}

/// The product in cuBLASLt's column-major terms. Row-major `(r, c)` memory is column-major `(c, r)`, so:
/// - output tokens, D = `(N, S)` col-major = W (transposed) · X, the bias running along D's rows (per feature);
/// - output channels-first, D = `(S, N)` col-major = X (transposed) · W; no epilogue bias (it would run per token).
fn make_plan(handle: sys::cublasLtHandle_t, key: &Key) -> Result<Plan> {
    let &(_, dtype, input, output, b, s, k, n, bias, _, gelu, sample_stride) = key;
    let ty = data_type(dtype)?;
    let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
    let desc = lt::create_matmul_desc(compute, sys::cudaDataType_t::CUDA_R_32F)
        .map_err(|e| lt_err(e, "descriptor"))?;
    // cublasOperation_t: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 (an int-sized enum).
    let (t, nt) = (1i32, 0i32);
    let made = (|| -> std::result::Result<_, CublasError> {
        Ok(match (input, output) {
            (Side::Tokens, Side::Tokens) if sample_stride != 0 => {
                // Each sample's tokens are a stretch of a longer sequence (a narrow, read in place): one product
                // per sample, the weight shared.
                let a = layout(ty, (k, n, k), b, 0)?;
                let bl = layout(ty, (k, s, k), b, sample_stride)?;
                let cd = layout(ty, (n, s, n), b, n * s)?;
                ((t, nt), [a, bl, cd])
            }
            (Side::Tokens, Side::Tokens) => {
                // Tokens of every sample are one matrix: no batching needed.
                let a = layout(ty, (k, n, k), 1, 0)?;
                let bl = layout(ty, (k, b * s, k), 1, 0)?;
                let cd = layout(ty, (n, b * s, n), 1, 0)?;
                ((t, nt), [a, bl, cd])
            }
            (Side::ChannelsFirst, Side::Tokens) => {
                let a = layout(ty, (k, n, k), b, 0)?;
                let bl = layout(ty, (s, k, s), b, s * k)?;
                let cd = layout(ty, (n, s, n), b, n * s)?;
                ((t, t), [a, bl, cd])
            }
            (Side::Tokens, Side::ChannelsFirst) => {
                let a = layout(ty, (k, s, k), b, s * k)?;
                let bl = layout(ty, (k, n, k), b, 0)?;
                let cd = layout(ty, (s, n, s), b, n * s)?;
                ((t, nt), [a, bl, cd])
            }
            (Side::ChannelsFirst, Side::ChannelsFirst) => unreachable!("refused by linear()"),
        })
    })();
    let ((op_a, op_b), layouts) = match made {
        Ok(m) => m,
        Err(e) => {
            // SAFETY: created above, not used elsewhere.
            let _ = unsafe { lt::destroy_matmul_desc(desc) };
            return Err(lt_err(e, "matrix layout"));
        }
    };
    // The plan owns the descriptors from here, so every early return below destroys them.
    // SAFETY: the algorithm is plain data (an array of integers), replaced by the heuristic's before any use.
    let mut plan = Plan { desc, layouts, algo: unsafe { std::mem::zeroed() }, candidates: Vec::new() };
    set_desc(desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, &op_a)?;
    set_desc(desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, &op_b)?;
    let epilogue = match (bias, gelu) {
        (true, false) => Some(sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS),
        (true, true) => Some(sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS),
        (false, true) => Some(sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU),
        (false, false) => None,
    };
    if let Some(epilogue) = epilogue {
        set_desc(desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
    }
    if bias {
        // One bias for every sample of the batch.
        let zero = 0i64;
        set_desc(desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &zero)?;
    }
    let pref = lt::create_matmul_pref().map_err(|e| lt_err(e, "preference"))?;
    let ws = WORKSPACE as u64;
    // SAFETY: the results are plain data, written by the query for the first `found` entries.
    let mut offers: [sys::cublasLtMatmulHeuristicResult_t; OFFERS] = unsafe { std::mem::zeroed() };
    let mut found = 0i32;
    // SAFETY: `pref`, the descriptor and the layouts are live; the attribute is a u64, and the query writes at
    // most OFFERS results.
    let queried = unsafe {
        lt::set_matmul_pref_attribute(
            pref,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            (&ws) as *const u64 as *const c_void,
            std::mem::size_of::<u64>(),
        )
        .and_then(|()| {
            sys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                desc,
                layouts[0],
                layouts[1],
                layouts[2],
                layouts[2],
                pref,
                OFFERS as i32,
                offers.as_mut_ptr(),
                &mut found,
            )
            .result()
        })
    };
    // SAFETY: created above, used only for the query.
    let _ = unsafe { lt::destroy_matmul_pref(pref) };
    queried.map_err(|e| lt_err(e, &format!("no algorithm for {key:?}")))?;
    let offers = &offers[..(found.max(0) as usize).min(OFFERS)];
    let first = offers.first().ok_or_else(|| {
        lt_err(
            CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED),
            &format!("no algorithm for {key:?}"),
        )
    })?;
    plan.algo = first.algo;
    if tuning_on() {
        plan.candidates = offers[1..]
            .iter()
            .filter(|o| {
                o.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                    && o.workspaceSize <= WORKSPACE
                    && split_k(&o.algo) <= 1
            })
            .map(|o| o.algo)
            .collect();
    }
    Ok(plan)
}

/// How many slices an algorithm splits K into (1 when it does not say).
fn split_k(algo: &sys::cublasLtMatmulAlgo_t) -> i32 {
    let mut splits = 1i32;
    let mut written = 0usize;
    // SAFETY: the attribute is an int32 written into `splits`, whose size is passed.
    let _ = unsafe {
        sys::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
            (&mut splits) as *mut i32 as *mut c_void,
            std::mem::size_of::<i32>(),
            &mut written,
        )
    };
    splits
}

/// What puts the L2 in the state a step leaves it in before a timed call: a step streams every weight from memory
/// once while its activations are still in the L2 from the kernel that wrote them, so the L2 is flushed (by writing
/// twice its size) and the input `x` and the residual read back into it. Timed on warm weights instead, the offers
/// rank differently (xtask/bench/linear_algos.cu) and the picks lost as much in the step as they won.
fn step_like_l2<'a, T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    stream: &'a Arc<CudaStream>,
    x: &'a CudaView<'a, T>,
    residual: Option<&'a CudaView<'a, T>>,
) -> Result<impl FnMut() -> Result<()> + 'a> {
    let l2 = stream
        .context()
        .attribute(sys_driver::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        .w()?
        .max(1 << 20) as usize;
    let mut flush = dev.alloc_zeros::<u8>(2 * l2)?;
    let rlen = residual.map_or(0, |r| r.len());
    // SAFETY: scratch that only receives copies.
    let mut warm: CudaSlice<T> = unsafe { dev.alloc::<T>(x.len() + rlen)? };
    Ok(move || -> Result<()> {
        stream.memset_zeros(&mut flush).w()?;
        stream.memcpy_dtod(x, &mut warm.slice_mut(..x.len())).w()?;
        if let Some(r) = residual {
            stream.memcpy_dtod(r, &mut warm.slice_mut(x.len()..)).w()?;
        }
        Ok(())
    })
}

/// Of `first` and `others`, the algorithm whose `TIMED_CALLS` calls of `call` take least time on `stream`, each
/// call timed alone after `prepare` (which puts the L2 in the state a step leaves it in), kept over `first` only by
/// more than [`MARGIN`]; an offer whose call fails is passed over.
fn fastest(
    stream: &CudaStream,
    first: sys::cublasLtMatmulAlgo_t,
    others: &[sys::cublasLtMatmulAlgo_t],
    mut prepare: impl FnMut() -> Result<()>,
    call: impl Fn(&sys::cublasLtMatmulAlgo_t) -> Result<()>,
) -> Result<sys::cublasLtMatmulAlgo_t> {
    let mut timed = |algo: &sys::cublasLtMatmulAlgo_t| -> Result<f32> {
        call(algo)?;
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let mut ms = 0f32;
        for _ in 0..TIMED_CALLS {
            prepare()?;
            let start = stream.record_event(flags).w()?;
            call(algo)?;
            let end = stream.record_event(flags).w()?;
            ms += start.elapsed_ms(&end).w()?;
        }
        Ok(ms)
    };
    let (mut best, mut best_ms) = (first, timed(&first)? * MARGIN);
    for algo in others {
        if let Ok(ms) = timed(algo) {
            if ms < best_ms {
                (best, best_ms) = (*algo, ms);
            }
        }
    }
    Ok(best)
}

struct Linear {
    input: Side,
    output: Side,
    residual: Option<Tensor>,
    /// GELU (tanh approximation) in the epilogue, after the bias.
    gelu: bool,
}

/// 0 for an input whose samples lie back to back (contiguous), else the distance between a token input's
/// samples whose rows are contiguous (a stretch of each sample's longer token sequence); any other layout is
/// refused.
fn sample_stride(input: Side, l: &Layout) -> Result<usize> {
    if l.is_contiguous() {
        return Ok(0);
    }
    match (input, l.dims(), l.stride()) {
        // One sample's rows are one matrix wherever its batch stride points.
        (Side::Tokens, [1, s, k], [_, ks, 1]) if ks == k => Ok(s * k),
        (Side::Tokens, [_, s, k], [bs, ks, 1]) if ks == k && *bs >= s * k => Ok(*bs),
        _ => bail!(
            "cuBLASLt linear: the input {:?} (strides {:?}) is not contiguous rows",
            l.dims(),
            l.stride()
        ),
    }
}

impl Linear {
    /// `(batch, tokens, in features)` of the input and the output shape.
    fn dims(&self, xl: &Layout, wl: &Layout) -> Result<((usize, usize, usize, usize), Shape)> {
        let (n, wk) = wl.shape().dims2()?;
        let dims = xl.dims();
        let (b, s, k) = match (self.input, dims.len()) {
            (Side::Tokens, 2) => (1, dims[0], dims[1]),
            (Side::Tokens, 3) => (dims[0], dims[1], dims[2]),
            (Side::ChannelsFirst, 3) => (dims[0], dims[2], dims[1]),
            _ => bail!("cuBLASLt linear: input {dims:?} is not {:?}", self.input),
        };
        if k != wk {
            bail!("cuBLASLt linear: input {dims:?} does not fit weight {:?}", wl.dims());
        }
        let shape = match (self.output, dims.len()) {
            (Side::Tokens, 2) => Shape::from((s, n)),
            (Side::Tokens, _) => Shape::from((b, s, n)),
            (Side::ChannelsFirst, _) => Shape::from((b, n, s)),
        };
        Ok(((b, s, k, n), shape))
    }
}

fn launch<T: CudaDType + DeviceRepr>(
    op: &Linear,
    key: Key,
    out_len: usize,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    bias: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let dev: &CudaDevice = x.0.device();
    let stream = dev.cuda_stream();
    let xv = match key.11 {
        0 => contiguous::<T>(x.0, x.1, "input")?,
        stride => {
            let (b, s, k) = (key.4, key.5, key.6);
            let start = x.1.start_offset();
            x.0.as_cuda_slice::<T>()?.slice(start..start + (b - 1) * stride + s * k)
        }
    };
    let wv = contiguous::<T>(w.0, w.1, "weight")?;
    let bv = bias.map(|(s, l)| contiguous::<T>(s, l, "bias")).transpose()?;
    let residual = op.residual.as_ref().map(|r| r.storage_and_layout());
    let rv = residual.as_ref().map(|h| held_view::<T, _>(h, "the linear's residual")).transpose()?;
    // SAFETY: the product writes every element of D.
    let mut out: CudaSlice<T> = unsafe { dev.alloc::<T>(out_len)? };
    STATE.with(|state| -> Result<()> {
        let mut state = state.borrow_mut();
        let state = &mut *state;
        let handle = match state.handles.get(&dev.id()) {
            Some(&h) => h,
            None => {
                let h = lt::create_handle().map_err(|e| lt_err(e, "handle"))?;
                state.handles.insert(dev.id(), h);
                h
            }
        };
        let ws = match state.workspaces.entry(dev.id()) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(_) if crate::graph::capturing() => {
                bail!("cuBLASLt: the first workspace would be allocated during a CUDA graph capture")
            }
            // SAFETY: scratch for cuBLASLt, never read before it is written.
            Entry::Vacant(e) => e.insert(unsafe { dev.alloc::<u8>(WORKSPACE)? }),
        };
        let plan = match state.plans.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(make_plan(handle, &key)?),
        };
        let (xp, _gx) = xv.device_ptr(&stream);
        let (wp, _gw) = wv.device_ptr(&stream);
        let bp = bv.as_ref().map(|b| b.device_ptr(&stream));
        let rp = rv.as_ref().map(|r| r.device_ptr(&stream));
        let (dp, _gd) = out.device_ptr_mut(&stream);
        let (wsp, _gws) = ws.device_ptr_mut(&stream);
        if let Some((p, _)) = &bp {
            let ptr = *p as *const c_void;
            set_desc(
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &ptr,
            )?;
        }
        // Into tokens the weight is A; into channels-first the activations are (see `make_plan`).
        let (a, b) = if key.3 == Side::Tokens { (wp, xp) } else { (xp, wp) };
        let (alpha, beta) = (1f32, if rp.is_some() { 1f32 } else { 0f32 });
        let c = rp.as_ref().map_or(dp, |(p, _)| *p);
        let [al, bl, cdl] = plan.layouts;
        let desc = plan.desc;
        let call = |algo: &sys::cublasLtMatmulAlgo_t| {
            // SAFETY: the layouts were made for exactly these shapes and this storage type; every buffer is
            // contiguous at its offset and lives until the guards above drop, after the launch is queued. D is
            // never C, so calling again recomputes the same D.
            unsafe {
                lt::matmul(
                    handle,
                    desc,
                    (&alpha) as *const f32 as *const c_void,
                    (&beta) as *const f32 as *const c_void,
                    a as *const c_void,
                    al,
                    b as *const c_void,
                    bl,
                    c as *const c_void,
                    cdl,
                    dp as *mut c_void,
                    cdl,
                    algo,
                    wsp as *mut c_void,
                    WORKSPACE,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            }
            .map_err(|e| lt_err(e, &format!("product {key:?}")))
        };
        if !plan.candidates.is_empty() && !crate::graph::capturing() {
            plan.algo = fastest(
                &stream,
                plan.algo,
                &plan.candidates,
                step_like_l2(dev, &stream, &xv, rv.as_ref())?,
                call,
            )?;
            plan.candidates.clear();
        }
        call(&plan.algo)
    })?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

impl Linear {
    fn run(
        &self,
        x: (&CudaStorage, &Layout),
        w: (&CudaStorage, &Layout),
        bias: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        let ((b, s, k, n), shape) = self.dims(x.1, w.1)?;
        if let Some(r) = &self.residual {
            if r.shape() != &shape {
                bail!("cuBLASLt linear: residual {:?} differs from the output {:?}", r.dims(), shape.dims());
            }
        }
        let stride = sample_stride(self.input, x.1)?;
        if stride != 0 && self.output != Side::Tokens {
            bail!("cuBLASLt linear: a strided token input goes to tokens only");
        }
        let dev: &CudaDevice = x.0.device();
        let key: Key = (
            dev.id(),
            x.0.dtype(),
            self.input,
            self.output,
            b,
            s,
            k,
            n,
            bias.is_some(),
            self.residual.is_some(),
            self.gelu,
            stride,
        );
        let len = shape.elem_count();
        let out = match x.0.dtype() {
            DType::F16 => launch::<f16>(self, key, len, x, w, bias)?,
            DType::BF16 => launch::<bf16>(self, key, len, x, w, bias)?,
            DType::F32 => launch::<f32>(self, key, len, x, w, bias)?,
            other => bail!("cuBLASLt linear: unsupported dtype {other:?}"),
        };
        Ok((out, shape))
    }
}

crate::cuda::optional_bias_op!(Linear, "sdhive-lt-linear", "sdhive-lt-linear-bias", run);

/// `x·Wᵀ (+ bias) (+ residual)` with `weight` `(N, K)`: `x` is `(B, S, K)` or `(S, K)` tokens, or `(B, K, S)`
/// channels-first; the output is tokens `(B, S, N)` (`(S, N)` for 2-D tokens) or channels-first `(B, N, S)`, and
/// `residual` must have the output's shape. Every tensor must be contiguous (the caller makes them so). Into
/// channels-first the bias is added in a second pass (cuBLASLt's epilogue bias runs along the other axis there).
pub fn linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
    input: Side,
    output: Side,
) -> Result<Tensor> {
    if input == Side::ChannelsFirst && output == Side::ChannelsFirst {
        bail!("cuBLASLt linear: channels-first to channels-first is a 1×1 convolution");
    }
    if let (Side::ChannelsFirst, Some(b)) = (output, bias) {
        let y = x.apply_op2_no_bwd(weight, &Linear { input, output, residual: None, gelu: false })?;
        return crate::cuda::add_channel(&y, b, residual, false);
    }
    let op = Linear { input, output, residual: residual.cloned(), gelu: false };
    match bias {
        Some(b) => x.apply_op3_no_bwd(weight, b, &op),
        None => x.apply_op2_no_bwd(weight, &op),
    }
}

/// `gelu_tanh(x·Wᵀ + bias)` over tokens `(B, S, K)` or `(S, K)`, the GELU (tanh approximation, as candle's
/// `gelu` and diffusers' `gelu-approximate`) in cuBLASLt's epilogue: the feed-forward's first product without a
/// pass over its 4×-wide output. Every tensor must be contiguous.
pub fn linear_gelu(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let op = Linear { input: Side::Tokens, output: Side::Tokens, residual: None, gelu: true };
    match bias {
        Some(b) => x.apply_op3_no_bwd(weight, b, &op),
        None => x.apply_op2_no_bwd(weight, &op),
    }
}
