//! The UNet body replayed as a CUDA graph. A denoising loop calls the network with the same shapes every step;
//! the first call of a shape runs as usual (it also sizes the libraries' workspaces and plans), the second records
//! the body's ~700 launches into a graph, and later ones copy their inputs into the recorded input buffers and
//! replay it with one launch, so the step costs its GPU time and not the host's per-kernel work.
//!
//! The time embedding and the ResNets' projections of it stay outside the graph: they start from a host float,
//! which a recording cannot hold, and a denoising loop makes them for its whole schedule before the first step, so
//! a step only copies its row in. So does the table of the text context's k and v, made once per context; a
//! replay copies it into the recording only when it is another tensor than last time.

use candle_core::{Result, Tensor, TensorId};
use sdhive_cuda_kernels::Graph;
use std::sync::{Arc, Mutex};

/// Recorded graphs kept per network: one per input shape (batch, latent size, prompt length); the oldest goes
/// when another shape arrives. Each keeps its step's activation memory reserved (SDXL at 1024²: ~1.7 GB), so few.
const KEPT: usize = 2;

/// The input shapes that select a recording (a network has one dtype and device).
#[derive(Clone, PartialEq, Eq, Debug)]
struct Key {
    sample: Vec<usize>,
    temb: Vec<usize>,
    context: Vec<usize>,
}

struct Recorded {
    graph: Graph,
    sample: Tensor,
    temb: Tensor,
    context: Tensor,
    /// The tensor whose values `context` holds.
    context_from: TensorId,
    out: Tensor,
}

enum Slot {
    /// Ran once eagerly: the next call records.
    Warm,
    Ready(Box<Recorded>),
    /// Recording failed for this shape (why); it runs eagerly.
    Off(String),
}

/// The recordings of one network (shared by its clones: they hold the same weights).
#[derive(Clone, Default)]
pub(super) struct StepGraphs {
    slots: Arc<Mutex<Vec<(Key, Slot)>>>,
}

impl std::fmt::Debug for StepGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepGraphs")
    }
}

impl StepGraphs {
    /// How many shapes replay from a recording now, and why the others could not be recorded.
    pub(super) fn status(&self) -> (usize, Vec<String>) {
        let slots = self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let recorded = slots.iter().filter(|(_, s)| matches!(s, Slot::Ready(_))).count();
        let refused =
            slots.iter().filter_map(|(_, s)| if let Slot::Off(why) = s { Some(why.clone()) } else { None });
        (recorded, refused.collect())
    }

    /// `body(sample, temb, context)` on prepared inputs (contiguous, on the network's device, in its dtype),
    /// eagerly or from a recording of it. `out_shape` is what `body` returns for these inputs.
    pub(super) fn run(
        &self,
        inputs: [&Tensor; 3],
        out_shape: &[usize],
        body: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let [sample, temb, context] = inputs;
        let key = Key {
            sample: sample.dims().to_vec(),
            temb: temb.dims().to_vec(),
            context: context.dims().to_vec(),
        };
        let mut slots = self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let at = match slots.iter().position(|(k, _)| *k == key) {
            Some(at) => at,
            None => {
                if slots.len() >= KEPT {
                    slots.remove(0);
                    let _ = sdhive_cuda_kernels::trim_graph_memory(sample.device());
                }
                slots.push((key.clone(), Slot::Warm));
                return body(sample, temb, context);
            }
        };
        if matches!(slots[at].1, Slot::Warm) {
            slots[at].1 = match record(inputs, out_shape, &body) {
                Ok(recorded) => Slot::Ready(Box::new(recorded)),
                Err(e) => {
                    // The first line: candle appends a backtrace to some errors.
                    let e = e.to_string().lines().next().unwrap_or_default().to_string();
                    tracing::warn!(
                        "unet: recording the step as a CUDA graph failed for input {:?} ({e}); this shape runs \
                         kernel by kernel",
                        key.sample
                    );
                    Slot::Off(format!("input {:?}: {e}", key.sample))
                }
            };
        }
        match &mut slots[at].1 {
            Slot::Ready(r) if r.graph.replays_here() => r.replay(sample, temb, context),
            _ => body(sample, temb, context),
        }
    }
}

/// Records `body` on buffers of its own: copies of this call's inputs and an output allocated beforehand. Every
/// tensor `body` makes is dropped inside the recording, so the graph owns no memory after it ends.
fn record(
    [sample, temb, context]: [&Tensor; 3],
    out_shape: &[usize],
    body: &impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Recorded> {
    let device = sample.device().clone();
    let out = Tensor::zeros(out_shape, sample.dtype(), &device)?;
    let context_from = context.id();
    let (sample, temb, context) = (sample.copy()?, temb.copy()?, context.copy()?);
    let (graph, ()) = sdhive_cuda_kernels::capture_graph(&device, || {
        let y = body(&sample, &temb, &context)?;
        out.slice_set(&y, 0, 0)
    })?;
    Ok(Recorded { graph, sample, temb, context, context_from, out })
}

impl Recorded {
    fn replay(&mut self, sample: &Tensor, temb: &Tensor, context: &Tensor) -> Result<Tensor> {
        self.sample.slice_set(sample, 0, 0)?;
        self.temb.slice_set(temb, 0, 0)?;
        if context.id() != self.context_from {
            self.context.slice_set(context, 0, 0)?;
            self.context_from = context.id();
        }
        self.graph.launch()?;
        // The next replay overwrites the recorded output.
        self.out.copy()
    }
}
