//! CUDA graph capture of a call's whole launch sequence, replayed later with one launch: a UNet step is ~700
//! kernels whose host-side cost (candle's per-op bookkeeping, each driver launch) is as long as their GPU time, so
//! replaying the recorded graph takes the host out of the step.
//!
//! Capture records what the calling thread issues on the device's stream; nothing executes until [`Graph::launch`].
//! Memory allocated during capture becomes the graph's own (its addresses are baked into the recorded launches), so
//! every tensor made inside the captured call must also be dropped inside it, and the buffers it reads and writes
//! from outside (inputs, the output, the libraries' workspaces) must outlive the graph.

use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph, CudaStream};
use candle_core::{Device, Result};
use std::cell::Cell;
use std::sync::Arc;

thread_local! {
    static CAPTURING: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is inside [`capture`]: cached workspaces must not be allocated or replaced then (a graph
/// would own the new one, and freeing the old one is not a recordable operation).
pub(crate) fn capturing() -> bool {
    CAPTURING.with(Cell::get)
}

/// A recorded launch sequence, ready to replay on the stream it was captured from.
pub struct Graph {
    graph: CudaGraph,
    thread: std::thread::ThreadId,
}

// SAFETY: the driver's graph objects may be used from any thread as long as calls on one are not concurrent
// (cuda-driver-api "graphs thread safety"); `Graph` is not `Sync`, so one owner at a time touches it, and
// `launch` refuses every thread but the capturing one, whose stream and workspaces the recording uses.
unsafe impl Send for Graph {}

impl Graph {
    /// Whether [`Graph::launch`] works on this thread (the capturing one).
    pub fn replays_here(&self) -> bool {
        std::thread::current().id() == self.thread
    }

    /// Replays the recorded work, queued after what the stream already holds. Only on the capturing thread: the
    /// stream is that thread's own, and so are the workspaces the recorded calls use.
    pub fn launch(&self) -> Result<()> {
        if !self.replays_here() {
            candle_core::bail!("a CUDA graph replays only on the thread that captured it");
        }
        self.graph.launch().map_err(|e| candle_core::Error::Msg(format!("CUDA graph launch: {e:?}")))
    }
}

fn stream_of(device: &Device) -> Result<Arc<CudaStream>> {
    Ok(device.as_cuda_device()?.cuda_stream())
}

fn driver(e: impl std::fmt::Debug, what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("CUDA graph {what}: {e:?}"))
}

/// Records what `body` issues on `device`'s stream from this thread, instead of running it, and instantiates the
/// recording. `body`'s result is returned beside the graph; tensors in it hold memory the graph writes only when
/// launched. A `body` that fails, or that does something a recording cannot hold (a host-device copy from
/// pageable memory, a synchronisation), fails the capture and leaves the stream as it was.
pub fn capture<T>(device: &Device, body: impl FnOnce() -> Result<T>) -> Result<(Graph, T)> {
    let stream = stream_of(device)?;
    let ctx = stream.context().clone();
    // A stale error from an earlier drop must not be blamed on this capture.
    ctx.check_err().map_err(|e| driver(e, "before capture"))?;
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| driver(e, "begin capture"))?;
    CAPTURING.with(|c| c.set(true));
    let out = body();
    CAPTURING.with(|c| c.set(false));
    // Ending the capture is what returns the stream to normal work, so it happens whatever `body` did.
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    let dropped = ctx.check_err();
    let out = out?;
    dropped.map_err(|e| driver(e, "capture (a free inside it)"))?;
    let graph = ended.map_err(|e| driver(e, "capture"))?.ok_or_else(|| driver("empty", "capture"))?;
    let copies = host_copies(graph.cu_graph())?;
    if !copies.is_empty() {
        candle_core::bail!(
            "the recording copies from host memory {} time(s), which a replay would read stale (candle uploads \
             the shape of a strided operand that way), before: {}",
            copies.len(),
            copies.join(", ")
        );
    }
    graph.upload().map_err(|e| driver(e, "upload"))?;
    Ok((Graph { graph, thread: std::thread::current().id() }, out))
}

/// The recorded copies whose source is host memory, each named by the kernel that follows it (its grid size and
/// the bytes copied). A captured copy from pageable memory keeps the host address and reads it again at every
/// replay, long after the buffer it pointed at was freed.
fn host_copies(graph: sys::CUgraph) -> Result<Vec<String>> {
    let check = |r: sys::CUresult, what: &str| match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(driver(e, what)),
    };
    let mut count = 0usize;
    // SAFETY: the first call only reports the count; the second fills exactly `count` handles.
    check(unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) }, "node count")?;
    let mut nodes = vec![std::ptr::null_mut(); count];
    check(unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count) }, "nodes")?;
    let mut found = Vec::new();
    for &node in &nodes[..count] {
        let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` belongs to `graph`, which is alive; the out-parameters are plain values.
        check(unsafe { sys::cuGraphNodeGetType(node, &mut kind) }, "node type")?;
        if kind != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY {
            continue;
        }
        let mut copy = std::mem::MaybeUninit::<sys::CUDA_MEMCPY3D>::uninit();
        // SAFETY: as above; a memcpy node's parameters are one CUDA_MEMCPY3D, all written on success.
        check(unsafe { sys::cuGraphMemcpyNodeGetParams(node, copy.as_mut_ptr()) }, "copy parameters")?;
        let copy = unsafe { copy.assume_init() };
        if copy.srcMemoryType != sys::CUmemorytype::CU_MEMORYTYPE_HOST {
            continue;
        }
        found.push(format!("{} ({} B)", next_kernel(node), copy.WidthInBytes));
    }
    Ok(found)
}

/// The name and grid of the kernel node right after `node`, or `?`.
fn next_kernel(node: sys::CUgraphNode) -> String {
    let mut next = [std::ptr::null_mut(); 1];
    let mut n = 1usize;
    // SAFETY: room for one dependent; the driver reports how many it wrote.
    let r = unsafe {
        sys::cuGraphNodeGetDependentNodes_v2(node, next.as_mut_ptr(), std::ptr::null_mut(), &mut n)
    };
    if r != sys::CUresult::CUDA_SUCCESS || n == 0 {
        return "?".into();
    }
    // SAFETY: a kernel node's parameters; the name is a NUL-terminated string owned by the driver.
    unsafe {
        let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        if sys::cuGraphNodeGetType(next[0], &mut kind) != sys::CUresult::CUDA_SUCCESS
            || kind != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL
        {
            return "a non-kernel node".into();
        }
        let mut params = std::mem::MaybeUninit::<sys::CUDA_KERNEL_NODE_PARAMS>::uninit();
        if sys::cuGraphKernelNodeGetParams_v2(next[0], params.as_mut_ptr()) != sys::CUresult::CUDA_SUCCESS {
            return "?".into();
        }
        let params = params.assume_init();
        let mut name: *const std::ffi::c_char = std::ptr::null();
        let known =
            sys::cuFuncGetName(&mut name, params.func) == sys::CUresult::CUDA_SUCCESS && !name.is_null();
        let name =
            if known { std::ffi::CStr::from_ptr(name).to_string_lossy().into_owned() } else { "?".into() };
        format!("{name} grid {}×{}×{}", params.gridDimX, params.gridDimY, params.gridDimZ)
    }
}

/// Gives the device the memory of destroyed graphs back (the driver keeps it reserved for later graphs).
pub fn trim(device: &Device) -> Result<()> {
    let stream = stream_of(device)?;
    let ordinal = stream.context().cu_device();
    // SAFETY: a plain driver call on a device handle cudarc opened.
    let r = unsafe { sys::cuDeviceGraphMemTrim(ordinal) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(driver(r, "memory trim"));
    }
    Ok(())
}

/// `(reserved, most reserved, used)` bytes of the device's graph memory: what recorded graphs keep between
/// replays (the driver may back graphs launched on one stream with the same physical memory).
pub fn memory(device: &Device) -> Result<(u64, u64, u64)> {
    let ordinal = stream_of(device)?.context().cu_device();
    let read = |attr: sys::CUgraphMem_attribute| -> Result<u64> {
        let mut v: u64 = 0;
        // SAFETY: a plain driver call on a device handle cudarc opened; these attributes are u64 (cuuint64_t).
        let r = unsafe {
            sys::cuDeviceGetGraphMemAttribute(ordinal, attr, &mut v as *mut u64 as *mut std::ffi::c_void)
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(driver(r, "memory attribute"));
        }
        Ok(v)
    };
    use sys::CUgraphMem_attribute::*;
    Ok((
        read(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)?,
        read(CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)?,
        read(CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT)?,
    ))
}

/// `(reserved, used, most used)` bytes of the device's default memory pool, which every allocation of the
/// device's stream comes from; then the reserve beyond what is allocated goes back to the driver.
pub fn pool_usage_then_trim(device: &Device) -> Result<(u64, u64, u64)> {
    let stream = stream_of(device)?;
    stream.synchronize().map_err(|e| driver(e, "synchronise"))?;
    let ordinal = stream.context().cu_device();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: plain driver calls on a device handle cudarc opened; the attributes read are u64 (cuuint64_t).
    unsafe {
        let r = sys::cuDeviceGetDefaultMemPool(&mut pool, ordinal);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(driver(r, "default memory pool"));
        }
        let read = |attr: sys::CUmemPool_attribute| -> Result<u64> {
            let mut v: u64 = 0;
            let r = sys::cuMemPoolGetAttribute(pool, attr, &mut v as *mut u64 as *mut std::ffi::c_void);
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(driver(r, "memory pool attribute"));
            }
            Ok(v)
        };
        let usage = (
            read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        );
        let r = sys::cuMemPoolTrimTo(pool, 0);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(driver(r, "memory pool trim"));
        }
        Ok(usage)
    }
}
