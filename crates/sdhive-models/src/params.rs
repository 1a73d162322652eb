//! Where each weight of a built network lives, by the diffusers name its file gives it, so that LoRA deltas can be
//! merged into the network in place and taken out again exactly.
//!
//! A network does not keep its weights as the file names them: linears of one input are stacked into one matrix
//! (q, k and v; every block's k and v of the text context; every ResNet's time projection), convolution filters
//! are kept channels-last, the feed-forward's first product in the fused GEGLU kernel's row order, the edge
//! convolutions padded. Each of those steps reports what it made from what ([`stacked`], [`mapped`]) while the
//! network is built inside [`record`]; the weights the builder hands out are reported by [`RecordingBackend`].
//! The result, a [`ParamMap`], says for every weight which tensor holds it, at which rows, and how a tensor in the
//! file's layout becomes what is stored there. Writing through it changes the tensors the network computes with:
//! the same buffers, so a recorded CUDA graph replays the new weights unchanged.

use candle_core::{DType, Device, Result, Shape, Tensor, TensorId};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::Init;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

/// Turns a tensor in the layout the file gives a weight into the layout the network stores it in.
pub type Transform = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// One weight of a built network.
#[derive(Clone)]
pub struct ParamSlot {
    /// The tensor the network computes with.
    holder: Tensor,
    /// The weight's first row (dimension 0) in `holder`, and its rows there.
    offset: usize,
    rows: usize,
    /// Its shape as the file gives it.
    shape: Vec<usize>,
    /// File layout → stored layout, in order.
    transforms: Vec<Transform>,
}

impl std::fmt::Debug for ParamSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamSlot")
            .field("holder", &self.holder.dims())
            .field("offset", &self.offset)
            .field("rows", &self.rows)
            .field("shape", &self.shape)
            .field("transforms", &self.transforms.len())
            .finish()
    }
}

impl ParamSlot {
    /// The weight's shape as the file gives it.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn dtype(&self) -> DType {
        self.holder.dtype()
    }

    pub fn device(&self) -> &Device {
        self.holder.device()
    }

    /// Bytes of the stored weight.
    pub fn bytes(&self) -> u64 {
        (self.holder.elem_count() / self.holder.dim(0).unwrap_or(1).max(1) * self.rows) as u64
            * self.holder.dtype().size_in_bytes() as u64
    }

    fn block(&self) -> Result<Tensor> {
        self.holder.narrow(0, self.offset, self.rows)
    }

    /// A copy of the weight as stored, for [`ParamSlot::write`] to put back bit for bit. Only the weight's rows:
    /// `Tensor::copy` of a view would copy the whole holder (a stacked table of every block's k and v).
    pub fn read(&self) -> Result<Tensor> {
        self.block()?.force_contiguous()
    }

    /// Puts back what [`ParamSlot::read`] returned.
    pub fn write(&self, stored: &Tensor) -> Result<()> {
        self.holder.slice_set(stored, 0, self.offset)
    }

    /// Adds `delta` (the file's layout and shape, any float dtype and device) to the weight in place, summed in
    /// f32 and rounded once to the stored dtype.
    pub fn add(&self, delta: &Tensor) -> Result<()> {
        let mut d =
            delta.to_device(self.holder.device())?.to_dtype(DType::F32)?.reshape(self.shape.as_slice())?;
        for t in &self.transforms {
            d = t(&d)?;
        }
        let sum = merged(&self.block()?, &d)?.contiguous()?;
        self.holder.slice_set(&sum, 0, self.offset)
    }
}

/// Every recorded weight of one built network, by its name in the file.
#[derive(Clone, Debug, Default)]
pub struct ParamMap {
    slots: HashMap<String, ParamSlot>,
}

impl ParamMap {
    pub fn get(&self, name: &str) -> Option<&ParamSlot> {
        self.slots.get(name)
    }

    /// Every weight's name and shape as the file gives it.
    pub fn shapes(&self) -> HashMap<String, Vec<usize>> {
        self.slots.iter().map(|(n, s)| (n.clone(), s.shape.clone())).collect()
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

#[derive(Default)]
struct Recorder {
    /// The weights each live tensor holds.
    held: HashMap<TensorId, Vec<String>>,
    slots: HashMap<String, ParamSlot>,
}

thread_local! {
    static RECORDER: RefCell<Option<Recorder>> = const { RefCell::new(None) };
}

/// Whether LoRA can change the weight `name`: linear and convolution weights (rank 2 or 4).
pub fn is_lora_weight(name: &str, t: &Tensor) -> bool {
    name.ends_with(".weight") && matches!(t.rank(), 2 | 4)
}

/// `current + delta` (the delta reshaped to the weight's shape, on its device), summed in f32 and rounded once
/// to the weight's dtype.
pub fn merged(current: &Tensor, delta: &Tensor) -> Result<Tensor> {
    let delta = delta.to_device(current.device())?.to_dtype(DType::F32)?.reshape(current.shape())?;
    (current.to_dtype(DType::F32)? + delta)?.to_dtype(current.dtype())
}

/// Only the weights LoRA can change are recorded, and only contiguous ones (they are written in place).
fn recorded(name: &str, t: &Tensor) -> bool {
    is_lora_weight(name, t) && t.is_contiguous()
}

/// Runs `build` (which builds a network from a builder over a [`RecordingBackend`]) and returns what it built
/// with the map of its weights.
pub fn record<T>(build: impl FnOnce() -> T) -> (T, ParamMap) {
    let outer = RECORDER.with(|r| r.borrow_mut().replace(Recorder::default()));
    let built = build();
    let recorder = RECORDER.with(|r| std::mem::replace(&mut *r.borrow_mut(), outer)).unwrap_or_default();
    (built, ParamMap { slots: recorder.slots })
}

fn with_recorder(f: impl FnOnce(&mut Recorder)) {
    RECORDER.with(|r| {
        if let Some(rec) = r.borrow_mut().as_mut() {
            f(rec)
        }
    })
}

/// The builder handed out `t` as the weight `name`.
fn source(name: &str, t: &Tensor) {
    if !recorded(name, t) {
        return;
    }
    with_recorder(|rec| {
        let rows = t.dim(0).unwrap_or(0);
        rec.held.entry(t.id()).or_default().push(name.to_string());
        rec.slots.insert(
            name.to_string(),
            ParamSlot {
                holder: t.clone(),
                offset: 0,
                rows,
                shape: t.dims().to_vec(),
                transforms: Vec::new(),
            },
        );
    })
}

/// `result` is `parts` concatenated along dimension 0: the weights they hold move there, at their offsets.
pub(crate) fn stacked(parts: &[&Tensor], result: &Tensor) {
    with_recorder(|rec| {
        let mut offset = 0;
        let mut names = Vec::new();
        for part in parts {
            for name in rec.held.remove(&part.id()).unwrap_or_default() {
                if let Some(slot) = rec.slots.get_mut(&name) {
                    slot.holder = result.clone();
                    slot.offset += offset;
                    names.push(name);
                }
            }
            offset += part.dim(0).unwrap_or(0);
        }
        if !names.is_empty() {
            rec.held.insert(result.id(), names);
        }
    })
}

/// `result` is `transform(source)`, where `source` holds one weight whole. A tensor holding several weights
/// cannot be re-laid out weight by weight: those weights are dropped from the map (a LoRA on them is refused).
pub(crate) fn mapped(source: &Tensor, result: &Tensor, transform: Transform) {
    with_recorder(|rec| {
        let names = rec.held.remove(&source.id()).unwrap_or_default();
        let whole = names.len() == 1
            && rec.slots.get(&names[0]).is_some_and(|s| s.offset == 0 && Some(s.rows) == source.dim(0).ok());
        if !whole {
            for name in &names {
                rec.slots.remove(name);
            }
            return;
        }
        if let Some(slot) = rec.slots.get_mut(&names[0]) {
            slot.holder = result.clone();
            slot.rows = result.dim(0).unwrap_or(0);
            slot.transforms.push(transform);
        }
        rec.held.insert(result.id(), names);
    })
}

/// A weight source that reports every weight it hands out to the [`record`] running on this thread.
pub struct RecordingBackend<B> {
    inner: B,
}

impl<B: SimpleBackend> RecordingBackend<B> {
    pub fn new(inner: B) -> Self {
        Self { inner }
    }
}

impl<B: SimpleBackend> SimpleBackend for RecordingBackend<B> {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let t = self.inner.get(s, name, h, dtype, dev)?;
        source(name, &t);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        let t = self.inner.get_unchecked(name, dtype, dev)?;
        source(name, &t);
        Ok(t)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

/// A builder over `backend` whose weights are recorded by a surrounding [`record`].
pub fn recording_builder<B: SimpleBackend + 'static>(
    backend: B,
    dtype: DType,
    device: &Device,
) -> candle_nn::VarBuilder<'static> {
    candle_nn::VarBuilder::from_backend(Box::new(RecordingBackend::new(backend)), dtype, device.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_nn::VarBuilder;

    fn t(rows: usize, cols: usize, start: f32) -> Tensor {
        Tensor::arange(start, start + (rows * cols) as f32, &Device::Cpu)
            .and_then(|t| t.reshape((rows, cols)))
            .expect("tensor")
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().and_then(|t| t.to_vec1()).expect("values")
    }

    #[test]
    fn stacked_and_mapped_weights_are_found_and_changed_in_place() {
        let weights = HashMap::from([
            ("a.weight".to_string(), t(2, 3, 0.0)),
            ("b.weight".to_string(), t(1, 3, 100.0)),
            ("c.weight".to_string(), t(2, 2, 200.0)),
            ("a.bias".to_string(), t(1, 2, 0.0).flatten_all().expect("bias")),
        ]);
        let vb = recording_builder(weights, DType::F32, &Device::Cpu);
        let ((stack, flipped), map) = record(|| {
            let a = vb.get((2, 3), "a.weight").expect("a");
            let b = vb.get((1, 3), "b.weight").expect("b");
            let _bias = vb.get(2, "a.bias").expect("bias");
            let stack = Tensor::cat(&[&a, &b], 0).expect("cat");
            stacked(&[&a, &b], &stack);
            let c = vb.get((2, 2), "c.weight").expect("c");
            let flip: Transform = Arc::new(|x: &Tensor| x.t()?.contiguous());
            let flipped = flip(&c).expect("flip");
            mapped(&c, &flipped, flip);
            (stack, flipped)
        });
        assert_eq!(map.len(), 3, "biases are not recorded");
        assert_eq!(map.get("b.weight").expect("b").shape(), &[1, 3]);

        let before = values(&stack);
        let saved = map.get("b.weight").expect("b").read().expect("read");
        assert_eq!(saved.dims(), &[1, 3], "only the weight's rows are kept");
        map.get("b.weight")
            .expect("b")
            .add(&Tensor::ones((1, 3), DType::F32, &Device::Cpu).unwrap())
            .unwrap();
        let after = values(&stack);
        assert_eq!(&after[..6], &before[..6], "a's rows untouched");
        assert_eq!(&after[6..], &[101.0, 102.0, 103.0]);
        map.get("b.weight").expect("b").write(&saved).expect("write");
        assert_eq!(values(&stack), before, "restored bit for bit");

        // c is stored transposed: a delta in the file's layout lands transposed.
        let delta = Tensor::new(&[[1f32, 2.0], [0.0, 0.0]], &Device::Cpu).unwrap();
        map.get("c.weight").expect("c").add(&delta).unwrap();
        assert_eq!(values(&flipped), vec![201.0, 202.0, 203.0, 203.0]);
    }

    #[test]
    fn a_tensor_of_several_weights_re_laid_out_drops_them() {
        let weights =
            HashMap::from([("a.weight".to_string(), t(2, 2, 0.0)), ("b.weight".to_string(), t(2, 2, 4.0))]);
        let vb = recording_builder(weights, DType::F32, &Device::Cpu);
        let (_, map) = record(|| {
            let a = vb.get((2, 2), "a.weight").expect("a");
            let b = vb.get((2, 2), "b.weight").expect("b");
            let stack = Tensor::cat(&[&a, &b], 0).expect("cat");
            stacked(&[&a, &b], &stack);
            let flip: Transform = Arc::new(|x: &Tensor| x.t()?.contiguous());
            mapped(&stack, &flip(&stack).expect("flip"), flip);
        });
        assert!(map.is_empty());
    }

    #[test]
    fn nothing_is_recorded_outside_record() {
        let weights = HashMap::from([("a.weight".to_string(), t(2, 2, 0.0))]);
        let vb: VarBuilder = recording_builder(weights, DType::F32, &Device::Cpu);
        vb.get((2, 2), "a.weight").expect("a");
        RECORDER.with(|r| assert!(r.borrow().is_none()));
    }
}
