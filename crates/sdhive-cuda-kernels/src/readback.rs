//! Device-to-host copies that the stream runs in its order while the host goes on: a live preview's pixels start
//! on their way after the step that made them, and the host takes them once it has queued the next step, so the GPU
//! never waits for the host in between (a synchronous read drains the queue first). The copies land in page-locked
//! memory (not write-combined: the host reads it), kept per thread for the next copy of the same size.

use candle_core::cuda_backend::cudarc::driver::{CudaEvent, DeviceRepr, PinnedHostSlice, ValidAsZeroBits};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{Result, Storage, Tensor};
use std::cell::RefCell;

/// A value type the copies carry, with the thread's spare buffers of that type.
pub trait Pooled: CudaDType + DeviceRepr + ValidAsZeroBits + Copy + 'static {
    fn with_pool<R>(f: impl FnOnce(&mut Vec<PinnedHostSlice<Self>>) -> R) -> R;
}

macro_rules! pooled {
    ($($t:ty),*) => {$(
        impl Pooled for $t {
            fn with_pool<R>(f: impl FnOnce(&mut Vec<PinnedHostSlice<Self>>) -> R) -> R {
                thread_local!(static POOL: RefCell<Vec<PinnedHostSlice<$t>>> = const { RefCell::new(Vec::new()) });
                POOL.with(|p| f(&mut p.borrow_mut()))
            }
        }
    )*};
}
pooled!(f32, u8);

/// Spare buffers kept per type and thread: a job's previews take one or two sizes.
const SPARES: usize = 4;

/// A copy on its way: the page-locked buffer and an event recorded behind the copy. The buffer's own event is
/// recorded by cudarc only while it tracks events, which the workers switch off (`shared_worker::single_stream`):
/// waiting on it alone would read the buffer before the copy lands.
pub(crate) struct Pending<T> {
    host: PinnedHostSlice<T>,
    landed: CudaEvent,
}

/// Queues the copy of the CUDA tensor `t` (contiguous) into page-locked memory.
pub(crate) fn start<T: Pooled>(t: &Tensor) -> Result<Pending<T>> {
    let n = t.elem_count();
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else { candle_core::bail!("readback: not a CUDA tensor") };
    if !layout.is_contiguous() {
        candle_core::bail!("readback: the tensor must be contiguous");
    }
    let src = cs.as_cuda_slice::<T>()?.slice(layout.start_offset()..layout.start_offset() + n);
    let stream = cs.device.cuda_stream();
    let spare = T::with_pool(|pool| pool.iter().position(|h| h.len() == n).map(|i| pool.swap_remove(i)));
    let mut host = match spare {
        Some(h) => h,
        // SAFETY: written in full by the copy below before anything reads it.
        None => unsafe { stream.context().alloc_pinned_with_flags::<T>(n, 0) }.w()?,
    };
    stream.memcpy_dtoh(&src, &mut host).w()?;
    let landed = stream.record_event(None).w()?;
    Ok(Pending { host, landed })
}

/// The values of a copy [`start`] queued, once it has landed; its buffer goes back to the thread's spares.
pub(crate) fn finish<T: Pooled>(Pending { host, landed }: Pending<T>) -> Result<Vec<T>> {
    landed.synchronize().w()?;
    let values = host.as_slice().w()?.to_vec();
    T::with_pool(|pool| {
        if pool.len() < SPARES {
            pool.push(host);
        }
    });
    Ok(values)
}
