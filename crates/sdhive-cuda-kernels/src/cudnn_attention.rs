//! Attention through cuDNN's fused SDPA operation (`CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR`, cuDNN 9.13.1 and
//! later; the operation the cudnn-frontend builds for PyTorch's cuDNN attention), for the shapes where it measures
//! faster than our kernels (see [`chosen`]). Built on cuDNN's backend API directly: a graph of the one operation
//! on the projections' `(B, S, H·D)` layouts as they are (strides passed through, no copies), heuristics mode A,
//! the first engine configuration that finalises. Plans are cached per shape and strides; a shape cuDNN refuses is
//! remembered and left to our kernels. The workspace is the one the cuDNN convolutions share.

use crate::attention::view;
use crate::cudnn::with_workspace;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cudnn::sys;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, DeviceId};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;

use sys::cudnnBackendAttributeName_t as A;
use sys::cudnnBackendAttributeType_t as Ty;
use sys::cudnnBackendDescriptorType_t as D;

/// The first cuDNN with the SDPA operation in its backend API.
const MIN_VERSION: usize = 91301;

const Q: i64 = 1;
const K: i64 = 2;
const V: i64 = 3;
const O: i64 = 4;
const SCALE: i64 = 5;

/// Whether cuDNN takes an attention of head dimension `d` over `sk` keys: heads of 64 over more than the short-key
/// kernel's 128 keys (SD3's joint and MMDiT-X attention, SDXL's self-attention), where it measured faster than our
/// Hopper kernel (docs/benchmarks.md: SD3.5-medium step 52.8 → 47.7 ms, SDXL UNet step 30.5 → 28.7 ms on an H200).
/// SD1.5's heads of 40, 80 and 160 measured no faster through it and stay on our kernels.
/// `SDHIVE_CUDNN_ATTENTION=0` (or `SDHIVE_CUDNN=0`, no cuDNN at all) leaves every shape to our kernels.
pub(crate) fn chosen(d: usize, sk: usize) -> bool {
    switched_on!("SDHIVE_CUDNN") && switched_on!("SDHIVE_CUDNN_ATTENTION") && d == 64 && sk > 128
}

/// A backend descriptor, destroyed with its owner.
struct Desc(sys::cudnnBackendDescriptor_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: made by cudnnBackendCreateDescriptor and owned here alone.
        unsafe { sys::cudnnBackendDestroyDescriptor(self.0) };
    }
}

fn check(status: sys::cudnnStatus_t, what: &str) -> Result<()> {
    if status != sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        bail!("cuDNN attention: {what}: {status:?}")
    }
    Ok(())
}

impl Desc {
    fn new(kind: D, what: &str) -> Result<Self> {
        let mut d = std::ptr::null_mut();
        // SAFETY: writes one descriptor handle into `d`.
        check(unsafe { sys::cudnnBackendCreateDescriptor(kind, &mut d) }, what)?;
        Ok(Desc(d))
    }

    /// Sets attribute `name` to `values`, whose element type must be the one `ty` names.
    fn set<E>(&self, name: A, ty: Ty, values: &[E], what: &str) -> Result<()> {
        // SAFETY: `values` holds `len` elements of the type `ty` names (each caller pairs them).
        let status = unsafe {
            sys::cudnnBackendSetAttribute(self.0, name, ty, values.len() as i64, values.as_ptr().cast())
        };
        check(status, what)
    }

    fn finalize(&self, what: &str) -> Result<()> {
        // SAFETY: a descriptor made by `new`.
        check(unsafe { sys::cudnnBackendFinalize(self.0) }, what)
    }
}

/// A tensor descriptor: 4-D `dims`/`strides` in elements, 16-byte aligned (our kernels' checks hold it).
fn tensor(
    uid: i64,
    dtype: sys::cudnnDataType_t,
    dims: [i64; 4],
    strides: [i64; 4],
    by_value: bool,
) -> Result<Desc> {
    let t = Desc::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor descriptor")?;
    t.set(A::CUDNN_ATTR_TENSOR_DATA_TYPE, Ty::CUDNN_TYPE_DATA_TYPE, &[dtype], "tensor type")?;
    t.set(A::CUDNN_ATTR_TENSOR_DIMENSIONS, Ty::CUDNN_TYPE_INT64, &dims, "tensor dimensions")?;
    t.set(A::CUDNN_ATTR_TENSOR_STRIDES, Ty::CUDNN_TYPE_INT64, &strides, "tensor strides")?;
    t.set(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, Ty::CUDNN_TYPE_INT64, &[uid], "tensor id")?;
    t.set(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, Ty::CUDNN_TYPE_INT64, &[16i64], "tensor alignment")?;
    if by_value {
        t.set(A::CUDNN_ATTR_TENSOR_IS_BY_VALUE, Ty::CUDNN_TYPE_BOOLEAN, &[true], "tensor by value")?;
    }
    t.finalize("tensor descriptor")?;
    Ok(t)
}

/// A finalised execution plan and everything it was built from (kept alive with it).
struct Plan {
    plan: Desc,
    workspace: usize,
    _parts: Vec<Desc>,
}

/// Batch, heads, query rows, keys, head dimension, and the batch and row strides of q, k, v.
type Shape = (usize, usize, usize, usize, usize, [usize; 6]);
type Key = (DeviceId, DType, Shape);

struct Handle(sys::cudnnHandle_t);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: made by cudnnCreate and owned here alone.
        unsafe { sys::cudnnDestroy(self.0) };
    }
}

/// cuDNN state per thread, as the convolutions keep theirs (handles are neither Send nor Sync).
#[derive(Default)]
struct State {
    handles: HashMap<DeviceId, Handle>,
    /// Why cuDNN has no plan for a shape (the library older than [`MIN_VERSION`] among the reasons).
    plans: HashMap<Key, std::result::Result<Plan, String>>,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

fn data_type(dtype: DType) -> Result<sys::cudnnDataType_t> {
    Ok(match dtype {
        DType::F16 => sys::cudnnDataType_t::CUDNN_DATA_HALF,
        DType::BF16 => sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
        other => bail!("cuDNN attention: dtype {other:?}"),
    })
}

fn make_plan(handle: sys::cudnnHandle_t, dtype: DType, (b, h, sq, sk, d, s): Shape) -> Result<Plan> {
    let ty = data_type(dtype)?;
    let i = |v: usize| v as i64;
    let dims = |rows: usize| [i(b), i(h), i(rows), i(d)];
    // (B, S, H·D) read as (B, H, S, D): a head is D columns further along a row.
    let q = tensor(Q, ty, dims(sq), [i(s[0]), i(d), i(s[1]), 1], false)?;
    let k = tensor(K, ty, dims(sk), [i(s[2]), i(d), i(s[3]), 1], false)?;
    let v = tensor(V, ty, dims(sk), [i(s[4]), i(d), i(s[5]), 1], false)?;
    let o = tensor(O, ty, dims(sq), [i(sq * h * d), i(d), i(h * d), 1], false)?;
    let scale = tensor(SCALE, sys::cudnnDataType_t::CUDNN_DATA_FLOAT, [1; 4], [1; 4], true)?;
    let op = Desc::new(D::CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR, "SDPA operation")?;
    let bd = Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR;
    op.set(A::CUDNN_ATTR_OPERATION_SDPA_FWD_QDESC, bd, &[q.0], "q")?;
    op.set(A::CUDNN_ATTR_OPERATION_SDPA_FWD_KDESC, bd, &[k.0], "k")?;
    op.set(A::CUDNN_ATTR_OPERATION_SDPA_FWD_VDESC, bd, &[v.0], "v")?;
    op.set(A::CUDNN_ATTR_OPERATION_SDPA_FWD_ODESC, bd, &[o.0], "o")?;
    op.set(A::CUDNN_ATTR_OPERATION_SDPA_FWD_SCALEDESC, bd, &[scale.0], "scale")?;
    op.finalize("SDPA operation")?;
    let graph = Desc::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph")?;
    graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, bd, &[op.0], "graph operations")?;
    graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, Ty::CUDNN_TYPE_HANDLE, &[handle], "graph handle")?;
    graph.finalize("operation graph")?;
    let heur = Desc::new(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics")?;
    heur.set(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, bd, &[graph.0], "heuristics graph")?;
    let mode = sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A;
    heur.set(A::CUDNN_ATTR_ENGINEHEUR_MODE, Ty::CUDNN_TYPE_HEUR_MODE, &[mode], "heuristics mode")?;
    heur.finalize("heuristics")?;
    let mut count = 0i64;
    // SAFETY: asks for the number of results only (no array).
    let status = unsafe {
        sys::cudnnBackendGetAttribute(
            heur.0,
            A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            bd,
            0,
            &mut count,
            std::ptr::null_mut(),
        )
    };
    check(status, "heuristics results")?;
    let configs = (0..count.max(0))
        .map(|_| Desc::new(D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine configuration"))
        .collect::<Result<Vec<_>>>()?;
    let mut raw: Vec<sys::cudnnBackendDescriptor_t> = configs.iter().map(|c| c.0).collect();
    let mut got = 0i64;
    // SAFETY: `raw` holds `count` engine-configuration descriptors for cuDNN to fill.
    let status = unsafe {
        sys::cudnnBackendGetAttribute(
            heur.0,
            A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            bd,
            count,
            &mut got,
            raw.as_mut_ptr().cast(),
        )
    };
    check(status, "heuristics results")?;
    let mut last = String::from("the heuristics offer no engine");
    for config in configs.into_iter().take(got.max(0) as usize) {
        let plan = Desc::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan")?;
        plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, Ty::CUDNN_TYPE_HANDLE, &[handle], "plan handle")?;
        plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, bd, &[config.0], "plan configuration")?;
        if let Err(e) = plan.finalize("execution plan") {
            last = e.to_string();
            continue;
        }
        let mut workspace = 0i64;
        let mut n = 0i64;
        // SAFETY: one i64 out.
        let status = unsafe {
            sys::cudnnBackendGetAttribute(
                plan.0,
                A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                Ty::CUDNN_TYPE_INT64,
                1,
                &mut n,
                (&mut workspace as *mut i64).cast(),
            )
        };
        check(status, "plan workspace size")?;
        let parts = vec![q, k, v, o, scale, op, graph, heur, config];
        return Ok(Plan { plan, workspace: workspace.max(0) as usize, _parts: parts });
    }
    bail!("cuDNN attention: no engine for {:?}: {last}", (b, h, sq, sk, d))
}

fn version() -> usize {
    // SAFETY: a plain query.
    unsafe { sys::cudnnGetVersion() }
}

/// The shapes this thread planned: how many cuDNN took, and why it refused the others.
#[cfg(test)]
pub(crate) fn plans() -> (usize, Vec<String>) {
    STATE.with(|s| {
        let s = s.borrow();
        let refused = s.plans.values().filter_map(|p| p.as_ref().err().cloned()).collect();
        (s.plans.values().filter(|p| p.is_ok()).count(), refused)
    })
}

fn handle(state: &mut State, dev: &CudaDevice) -> Result<Option<sys::cudnnHandle_t>> {
    if let Some(h) = state.handles.get(&dev.id()) {
        return Ok(Some(h.0));
    }
    if version() < MIN_VERSION {
        return Ok(None);
    }
    let mut raw = std::ptr::null_mut();
    // SAFETY: writes one handle; the stream is the device's own, alive as long as the device.
    unsafe {
        check(sys::cudnnCreate(&mut raw), "handle")?;
        let h = Handle(raw);
        check(sys::cudnnSetStream(raw, dev.cuda_stream().cu_stream() as sys::cudaStream_t), "stream")?;
        state.handles.insert(dev.id(), h);
    }
    Ok(Some(raw))
}

/// `softmax(q kᵀ · scale) v` per head through cuDNN into a new `(B, Sq, H·D)` buffer, or `None` where cuDNN has no
/// plan for the shape (then our kernels run it). The layouts are those our kernels' checks accepted.
pub(crate) fn attention<T: CudaDType + DeviceRepr>(
    (heads, scale): (usize, f32),
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<Option<CudaSlice<T>>> {
    let dev: &CudaDevice = q.0.device();
    let (b, sq, c) = q.1.shape().dims3()?;
    let sk = k.1.shape().dims3()?.1;
    let d = c / heads;
    let st = |l: &Layout| [l.stride()[0], l.stride()[1]];
    let [qb, qs] = st(q.1);
    let [kb, ks] = st(k.1);
    let [vb, vs] = st(v.1);
    let key: Key = (dev.id(), q.0.dtype(), (b, heads, sq, sk, d, [qb, qs, kb, ks, vb, vs]));
    STATE.with(|state| -> Result<Option<CudaSlice<T>>> {
        let mut state = state.borrow_mut();
        let state = &mut *state;
        if !state.plans.contains_key(&key) {
            // Building a plan compiles and loads kernels: not while a CUDA graph is being recorded (the first,
            // eager call of a shape builds it).
            if crate::graph::capturing() {
                return Ok(None);
            }
            let plan = match handle(state, dev)? {
                Some(h) => make_plan(h, key.1, key.2).map_err(|e| e.to_string()),
                None => Err(format!("cuDNN {} has no SDPA operation (9.13.1 and later)", version())),
            };
            state.plans.insert(key, plan);
        }
        let (Some(Ok(plan)), Some(h)) = (state.plans.get(&key), state.handles.get(&dev.id())) else {
            return Ok(None);
        };
        let stream = dev.cuda_stream();
        let (qv, kv, vv) = (view::<T>(q.0, q.1)?, view::<T>(k.0, k.1)?, view::<T>(v.0, v.1)?);
        // SAFETY: cuDNN writes every output element.
        let out: CudaSlice<T> = unsafe { dev.alloc::<T>(b * sq * c)? };
        let (qp, _gq) = qv.device_ptr(&stream);
        let (kp, _gk) = kv.device_ptr(&stream);
        let (vp, _gv) = vv.device_ptr(&stream);
        let (op, _go) = out.device_ptr(&stream);
        with_workspace(dev, plan.workspace, |workspace| {
            let (ws, _gw) = workspace.device_ptr(&stream);
            let pack = Desc::new(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack")?;
            let ptrs: [*mut c_void; 5] = [
                qp as *mut c_void,
                kp as *mut c_void,
                vp as *mut c_void,
                op as *mut c_void,
                (&scale as *const f32).cast_mut().cast(),
            ];
            pack.set(
                A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
                Ty::CUDNN_TYPE_INT64,
                &[Q, K, V, O, SCALE],
                "ids",
            )?;
            pack.set(A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, Ty::CUDNN_TYPE_VOID_PTR, &ptrs, "pointers")?;
            let ws = ws as *mut c_void;
            pack.set(A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, Ty::CUDNN_TYPE_VOID_PTR, &[ws], "workspace")?;
            pack.finalize("variant pack")?;
            // SAFETY: the pack's pointers are live for the call (the views' guards and `scale` outlive it) and
            // were described to the plan with these shapes and strides.
            check(unsafe { sys::cudnnBackendExecute(h.0, plan.plan.0, pack.0) }, "execute")
        })?;
        drop((_gq, _gk, _gv, _go));
        Ok(Some(out))
    })
}
