//! A network call replayed as a CUDA graph, shared by the UNet step and the VAE decode. Both are called again and
//! again with the same shapes and issue hundreds of small launches whose host-side cost (candle's bookkeeping per
//! op, one driver call each) is as long as their GPU time, so run kernel by kernel they follow the host's load.
//! The first call of a shape runs as usual (it also sizes the libraries' workspaces and plans), the second records
//! the call into a graph on buffers of its own, and later ones copy their inputs into the recorded input buffers
//! and replay it with one launch.
//!
//! A recording allocates its activations from the driver's graph memory, which stays reserved between replays (the
//! driver may back the graphs launched on one stream with the same physical memory, since they never run at the
//! same time); dropping a recording gives that memory back to the driver.

use candle_core::{DType, Result, Tensor, TensorId};
use sdhive_cuda_kernels::Graph;
use std::cell::Cell;
use std::sync::{Arc, Mutex};

/// Recorded graphs kept per network: one per input shape; the least recently used goes when another shape
/// arrives. Each keeps its call's activation memory reserved (SDXL at 1024²: ~1.7 GB for the UNet step), so few,
/// unless this thread records batches ([`record_batches`]).
const KEPT: usize = 2;

/// Calls with an input of a larger batch run kernel by kernel and leave the recordings alone, unless this thread
/// records batches.
const GRAPHED_BATCH: usize = 2;

thread_local! {
    /// The most images per call this thread records ([`record_batches`]).
    static BATCHES: Cell<usize> = const { Cell::new(1) };
}

/// Lets calls of up to `images` images (each guided image two rows) replay from recordings on this thread, one
/// recording per batch size kept beside the single image's. A batching engine thread sets it: there a batched
/// step's ~700 launches took the host 23–31 ms against 29–30 ms on the device (SD1.5, 7–8 images, H200), so the
/// host, which also admits requests and hands images on, fell behind the device; replayed, the network is one
/// launch (~2 ms of host time at 8 images). Graphs launched on one stream share their activations' physical
/// memory, so the recordings of smaller batches reserve little beside the largest one's.
pub fn record_batches(images: usize) {
    BATCHES.with(|b| b.set(images.max(1)));
}

/// The graph memory `device` reserves that a batched step on this thread may count as free: a recorded batch size
/// replays inside it, and a new size's first call has the idle recordings' share given back ([`Graphs::run`]).
/// Nothing on a thread that does not record batches, where no such call gives it back.
pub fn batch_graph_memory(device: &candle_core::Device) -> u64 {
    if BATCHES.with(Cell::get) <= 1 {
        return 0;
    }
    sdhive_cuda_kernels::graph_memory(device).map_or(0, |(reserved, _, _)| reserved)
}

/// The largest input batch this thread records for a network, and how many shapes it keeps recorded.
fn limits(batched: bool) -> (usize, usize) {
    let images = if batched { BATCHES.with(Cell::get) } else { 1 };
    (GRAPHED_BATCH * images, KEPT.max(images + 1))
}

/// How a replay brings a recorded input up to date.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Refresh {
    /// Copied in at every replay.
    Always,
    /// Copied in only when the call passes another tensor than last time (a table made once and reused).
    WhenAnotherTensor,
}

/// What selects a recording: the input shapes (a network has one dtype and device) and the settings of this
/// thread that change which kernels a call issues.
#[derive(Clone, PartialEq, Eq, Debug)]
struct Key {
    shapes: Vec<Vec<usize>>,
    /// f32 convolutions on TF32 tensor cores (the upcast SDXL VAE's).
    tf32: bool,
    /// The attention-score chunk limit (attention slicing), which changes how many products the attention makes.
    score_limit: usize,
}

impl Key {
    fn of(inputs: &[&Tensor]) -> Self {
        Key {
            shapes: inputs.iter().map(|t| t.dims().to_vec()).collect(),
            tf32: sdhive_cuda_kernels::tf32_convolutions_on(),
            score_limit: crate::ops::attention_score_limit(),
        }
    }
}

struct Recorded {
    graph: Graph,
    /// The buffers the recording reads its inputs from.
    inputs: Vec<Tensor>,
    /// The tensors whose values `inputs` hold.
    from: Vec<TensorId>,
    out: Tensor,
}

enum Slot {
    /// Ran once kernel by kernel, returning this shape and dtype: the next call records.
    Warm(Vec<usize>, DType),
    Ready(Box<Recorded>),
    /// Recording failed for this shape (why); it runs kernel by kernel.
    Off(String),
}

/// The recordings of one network (shared by its clones: they hold the same weights).
#[derive(Clone)]
pub(crate) struct Graphs<const N: usize> {
    /// The network, for the log.
    network: &'static str,
    refresh: [Refresh; N],
    /// Records batches where this thread asks for it ([`record_batches`]): the denoisers, which a batching
    /// engine calls at every batch size, not the decoders and encoders, called image by image.
    batched: bool,
    /// Least recently used first.
    slots: Arc<Mutex<Vec<(Key, Slot)>>>,
}

impl<const N: usize> std::fmt::Debug for Graphs<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Graphs({})", self.network)
    }
}

impl<const N: usize> Graphs<N> {
    pub(crate) fn new(network: &'static str, refresh: [Refresh; N]) -> Self {
        Graphs { network, refresh, batched: false, slots: Arc::default() }
    }

    /// These recordings follow [`record_batches`].
    pub(crate) fn batched(self) -> Self {
        Graphs { batched: true, ..self }
    }

    /// How many shapes replay from a recording now, and why the others could not be recorded.
    pub(crate) fn status(&self) -> (usize, Vec<String>) {
        let slots = self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let recorded = slots.iter().filter(|(_, s)| matches!(s, Slot::Ready(_))).count();
        let refused =
            slots.iter().filter_map(|(_, s)| if let Slot::Off(why) = s { Some(why.clone()) } else { None });
        (recorded, refused.collect())
    }

    /// `body(inputs)` on prepared inputs (contiguous, on the network's device, in its dtype), kernel by kernel or
    /// from a recording of it. `body` must return a tensor of the same shape for inputs of the same shapes.
    pub(crate) fn run(
        &self,
        inputs: [&Tensor; N],
        body: impl Fn([&Tensor; N]) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let (largest, kept) = limits(self.batched);
        for t in &inputs {
            if t.dim(0)? > largest {
                return body(inputs);
            }
        }
        let key = Key::of(&inputs);
        let mut slots = self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(at) = slots.iter().position(|(k, _)| *k == key) else {
            let evicted = slots.len() >= kept && matches!(slots.remove(0).1, Slot::Ready(_));
            // A new batch size runs kernel by kernel from the device's pool once: on a thread that records
            // batches the physical memory idle recordings keep goes back to the driver for it
            // ([`batch_graph_memory`]), and their next replays map it again.
            if evicted || largest > GRAPHED_BATCH {
                let _ = sdhive_cuda_kernels::trim_graph_memory(inputs[0].device());
            }
            let y = body(inputs)?;
            slots.push((key, Slot::Warm(y.dims().to_vec(), y.dtype())));
            return Ok(y);
        };
        let entry = slots.remove(at);
        slots.push(entry);
        let (key, slot) = slots.last_mut().expect("the entry just pushed");
        if let Slot::Warm(shape, dtype) = slot {
            let warm = (std::mem::take(shape), *dtype);
            *slot = match record(inputs, (&warm.0, warm.1), &body) {
                Ok(recorded) => Slot::Ready(Box::new(recorded)),
                Err(e) => {
                    // The first line: candle appends a backtrace to some errors.
                    let e = e.to_string().lines().next().unwrap_or_default().to_string();
                    tracing::warn!(
                        "{}: recording a call as a CUDA graph failed for inputs {:?} ({e}); this shape runs \
                         kernel by kernel",
                        self.network,
                        key.shapes
                    );
                    Slot::Off(format!("inputs {:?}: {e}", key.shapes))
                }
            };
        }
        match slot {
            Slot::Ready(r) if r.graph.replays_here() => r.replay(inputs, &self.refresh),
            _ => body(inputs),
        }
    }
}

/// Records `body` on buffers of its own: copies of this call's inputs and an output allocated beforehand. Every
/// tensor `body` makes is dropped inside the recording, so the graph owns no memory after it ends.
fn record<const N: usize>(
    inputs: [&Tensor; N],
    (shape, dtype): (&[usize], DType),
    body: &impl Fn([&Tensor; N]) -> Result<Tensor>,
) -> Result<Recorded> {
    let device = inputs[0].device().clone();
    let out = Tensor::zeros(shape, dtype, &device)?;
    let from = inputs.iter().map(|t| t.id()).collect();
    let copies = inputs.iter().map(|t| t.copy()).collect::<Result<Vec<_>>>()?;
    let (graph, ()) = sdhive_cuda_kernels::capture_graph(&device, || {
        let y = body(std::array::from_fn(|i| &copies[i]))?;
        out.slice_set(&y, 0, 0)
    })?;
    Ok(Recorded { graph, inputs: copies, from, out })
}

impl Recorded {
    fn replay<const N: usize>(&mut self, inputs: [&Tensor; N], refresh: &[Refresh; N]) -> Result<Tensor> {
        for (i, input) in inputs.iter().enumerate() {
            if refresh[i] == Refresh::Always || input.id() != self.from[i] {
                self.inputs[i].slice_set(input, 0, 0)?;
                self.from[i] = input.id();
            }
        }
        self.graph.launch()?;
        // The next replay overwrites the recorded output.
        self.out.copy()
    }
}
