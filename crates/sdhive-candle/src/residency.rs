//! Where each network of a pipeline lives: its device and dtype (`--placement`), and whether its weights stay
//! in host memory between uses (`--offload`). An offloaded network is rebuilt on its device from the host copy
//! each time it is used and dropped afterwards, so its device memory is held only while it runs.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use sdhive_models::params::{self, ParamMap};
use std::collections::HashMap;
use std::sync::Arc;

/// One network's device, dtype and residency.
#[derive(Debug, Clone)]
pub struct ModuleTarget {
    pub device: Device,
    pub dtype: DType,
    /// Keep the weights in host memory until the network is used.
    pub offload: bool,
    /// With `offload`: a host copy for the RAM cache, kept without the check build that `offload` otherwise
    /// makes at load (placing the copy on its device, right after, builds the network and checks the same).
    pub host_copy: bool,
}

/// Targets for the three networks of a pipeline.
#[derive(Debug, Clone)]
pub struct Targets {
    pub unet: ModuleTarget,
    pub text: ModuleTarget,
    pub vae: ModuleTarget,
}

impl Targets {
    /// Everything on one device in one dtype, resident.
    pub fn all(device: &Device, dtype: DType) -> Self {
        let t = ModuleTarget { device: device.clone(), dtype, offload: false, host_copy: false };
        Targets { unet: t.clone(), text: t.clone(), vae: t }
    }

    pub fn any_offloaded(&self) -> bool {
        [&self.unet, &self.text, &self.vae].iter().any(|t| t.offload)
    }

    /// Each network kept as a host copy on the CPU in the dtype its target asks for: what the RAM cache holds.
    pub fn host_copies(&self) -> Self {
        let host = |t: &ModuleTarget| ModuleTarget {
            device: Device::Cpu,
            dtype: t.dtype,
            offload: true,
            host_copy: true,
        };
        Targets { unet: host(&self.unet), text: host(&self.text), vae: host(&self.vae) }
    }
}

// Shared so that a host copy kept in the RAM cache can build the network again on another target.
type Build<T> = Arc<dyn Fn(VarBuilder<'static>) -> sdhive_models::Result<T> + Send + Sync>;

enum State<T> {
    Loaded(T),
    Host { weights: HashMap<String, Tensor>, build: Build<T> },
}

/// A network, either built on its device or kept as host tensors and built on demand.
pub struct Resident<T> {
    target: ModuleTarget,
    state: State<T>,
    /// Where the built network keeps each weight (empty for a host copy: its weights are the map itself).
    params: ParamMap,
    /// Bytes of its weights in the target dtype (what it occupies on the device while built).
    weight_bytes: u64,
}

/// The weights a merge changed, as they were before: what [`Resident::restore`] puts back.
#[derive(Default)]
pub struct Originals {
    weights: HashMap<String, Tensor>,
}

impl Originals {
    /// Bytes held (on the network's device for a built network, in host memory for a host copy).
    pub fn bytes(&self) -> u64 {
        self.weights.values().map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.weights.is_empty()
    }

    /// Adds `delta` (the file's shape) in place to the weight `name` of the built network `params` maps, keeping
    /// the weight as it was the first time it changes. The network's buffers, and so a recorded CUDA graph, stay
    /// valid.
    pub(crate) fn add_in_place(
        &mut self,
        params: &ParamMap,
        name: &str,
        delta: &Tensor,
    ) -> candle_core::Result<()> {
        let slot = params
            .get(name)
            .ok_or_else(|| candle_core::Error::Msg(format!("no weight `{name}` to change")))?;
        if !self.weights.contains_key(name) {
            self.weights.insert(name.to_string(), slot.read()?);
        }
        slot.add(delta)
    }

    /// Puts every weight kept back into the built network `params` maps, bit for bit, and empties itself.
    pub(crate) fn restore_in_place(&mut self, params: &ParamMap) -> candle_core::Result<()> {
        for (name, original) in self.weights.drain() {
            if let Some(slot) = params.get(&name) {
                slot.write(&original)?;
            }
        }
        Ok(())
    }
}

impl<T> Resident<T> {
    /// A network already built on `target.device`.
    pub fn loaded(model: T, params: ParamMap, target: ModuleTarget, weight_bytes: u64) -> Self {
        Resident { target, state: State::Loaded(model), params, weight_bytes }
    }

    /// Host tensors (any dtype, on the CPU) from which `build` makes the network on `target.device` when used;
    /// built right away unless `target.offload`.
    pub fn from_host(
        weights: HashMap<String, Tensor>,
        target: ModuleTarget,
        build: impl Fn(VarBuilder<'static>) -> sdhive_models::Result<T> + Send + Sync + 'static,
    ) -> sdhive_models::Result<Self> {
        let mut weights = weights;
        let weight_bytes =
            weights.values().map(|t| (t.elem_count() * target.dtype.size_in_bytes()) as u64).sum();
        let build: Build<T> = Arc::new(build);
        let (state, params) = if target.offload {
            // Built once now so a bad checkpoint fails at load, not at the first request; the build also says in
            // which dtype the network reads each weight (T5 reads `wo` in f32 when in f16).
            let used = if target.host_copy {
                HashMap::new()
            } else {
                let (model, params) = params::record(|| build(builder(&weights, &target)));
                model?;
                weights.keys().filter_map(|n| Some((n.clone(), params.get(n)?.dtype()))).collect()
            };
            // A host copy holds what the network will be built from: converted once here (half the memory of
            // an f32 checkpoint used in f16, half the upload), not at every build, into the dtype each weight is
            // read in, so a build from it computes as the network built straight from the file.
            for (name, tensor) in weights.iter_mut() {
                let dtype = used.get(name).copied().unwrap_or(target.dtype);
                if tensor.dtype() != dtype && tensor.dtype().is_float() {
                    *tensor = tensor
                        .to_dtype(dtype)
                        .map_err(|source| sdhive_models::ModelError::Tensor { model: "host copy", source })?;
                }
            }
            (State::Host { weights, build }, ParamMap::default())
        } else {
            let (model, params) = params::record(|| build(builder(&weights, &target)));
            (State::Loaded(model?), params)
        };
        Ok(Resident { target, state, params, weight_bytes })
    }

    /// Bytes of the host copy's tensors (0 for a network built on its device).
    pub fn host_bytes(&self) -> u64 {
        match &self.state {
            State::Host { weights, .. } => {
                weights.values().map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64).sum()
            }
            State::Loaded(_) => 0,
        }
    }

    /// The same network from this host copy on `target` (its dtype is this copy's): built there now unless
    /// `target.offload`. The host tensors are shared, not copied; `None` when this network is not a host copy.
    pub fn place(&self, device: &Device, offload: bool) -> Option<sdhive_models::Result<Resident<T>>> {
        let State::Host { weights, build } = &self.state else { return None };
        let target =
            ModuleTarget { device: device.clone(), dtype: self.target.dtype, offload, host_copy: false };
        let built = if offload {
            Ok((State::Host { weights: weights.clone(), build: Arc::clone(build) }, ParamMap::default()))
        } else {
            let (model, params) = params::record(|| build(builder(weights, &target)));
            model.map(|m| (State::Loaded(m), params))
        };
        Some(built.map(|(state, params)| Resident { target, state, params, weight_bytes: self.weight_bytes }))
    }

    /// Runs `f` on the network, building it on its device first when offloaded.
    pub fn with<R>(&self, f: impl FnOnce(&T) -> R) -> sdhive_models::Result<R> {
        match &self.state {
            State::Loaded(m) => Ok(f(m)),
            State::Host { weights, build } => {
                let model = build(builder(weights, &self.target))?;
                Ok(f(&model))
            }
        }
    }

    /// The network for a stretch of work: borrowed when resident, built on its device from the host copy when
    /// offloaded (dropped, freeing its device memory, with the handle). Unlike [`Resident::with`], the caller's
    /// own errors pass through untouched across a whole loop.
    pub fn in_use(&self) -> sdhive_models::Result<InUse<'_, T>> {
        match &self.state {
            State::Loaded(m) => Ok(InUse::Borrowed(m)),
            State::Host { weights, build } => Ok(InUse::Built(build(builder(weights, &self.target))?)),
        }
    }

    pub fn device(&self) -> &Device {
        &self.target.device
    }

    pub fn dtype(&self) -> DType {
        self.target.dtype
    }

    pub fn offloaded(&self) -> bool {
        matches!(self.state, State::Host { .. })
    }

    /// Device bytes its weights hold between uses: none when offloaded.
    pub fn resident_bytes(&self) -> u64 {
        if self.offloaded() {
            0
        } else {
            self.weight_bytes
        }
    }

    /// The weights a LoRA can change (linear and convolution weights), by name, in the file's shapes.
    pub fn param_shapes(&self) -> HashMap<String, Vec<usize>> {
        match &self.state {
            State::Loaded(_) => self.params.shapes(),
            State::Host { weights, .. } => weights
                .iter()
                .filter(|(name, t)| params::is_lora_weight(name, t))
                .map(|(name, t)| (name.clone(), t.dims().to_vec()))
                .collect(),
        }
    }

    /// A copy of the weight `name` as the network holds it (stored layout for a built network).
    pub fn read_param(&self, name: &str) -> Option<candle_core::Result<Tensor>> {
        match &self.state {
            State::Loaded(_) => self.params.get(name).map(|slot| slot.read()),
            State::Host { weights, .. } => weights.get(name).map(|t| Ok(t.clone())),
        }
    }

    /// Where a weight's deltas are best made: the device of a built network, host memory for a host copy.
    pub fn delta_device(&self) -> Device {
        match &self.state {
            State::Loaded(_) => self.target.device.clone(),
            State::Host { .. } => Device::Cpu,
        }
    }

    /// Adds `delta` (the file's shape) to the weight `name`, keeping the weight as it was in `originals` the
    /// first time it changes. A built network changes in place (its buffers, and so a recorded CUDA graph, stay
    /// valid); a host copy gets a new tensor, so the RAM cache's copy it shares tensors with is untouched.
    pub fn add_delta(
        &mut self,
        name: &str,
        delta: &Tensor,
        originals: &mut Originals,
    ) -> candle_core::Result<()> {
        match &mut self.state {
            State::Loaded(_) => originals.add_in_place(&self.params, name, delta),
            State::Host { weights, .. } => {
                let current = weights
                    .get(name)
                    .ok_or_else(|| candle_core::Error::Msg(format!("no weight `{name}` to change")))?;
                let sum = params::merged(current, delta)?;
                let before = weights.insert(name.to_string(), sum);
                if let Some(before) = before {
                    originals.weights.entry(name.to_string()).or_insert(before);
                }
                Ok(())
            }
        }
    }

    /// Puts back every weight `originals` holds, bit for bit, and empties it.
    pub fn restore(&mut self, originals: &mut Originals) -> candle_core::Result<()> {
        match &mut self.state {
            State::Loaded(_) => originals.restore_in_place(&self.params),
            State::Host { weights, .. } => {
                weights.extend(originals.weights.drain());
                Ok(())
            }
        }
    }

    /// The built network, when it is resident (benchmarks and tests that drive it directly).
    pub fn get(&self) -> Option<&T> {
        match &self.state {
            State::Loaded(m) => Some(m),
            State::Host { .. } => None,
        }
    }
}

/// A network in use: see [`Resident::in_use`].
pub enum InUse<'a, T> {
    Borrowed(&'a T),
    Built(T),
}

impl<T> std::ops::Deref for InUse<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        match self {
            InUse::Borrowed(m) => m,
            InUse::Built(m) => m,
        }
    }
}

/// A `VarBuilder` that copies each host tensor to the target device and dtype as the network asks for it (and
/// reports each to a surrounding [`params::record`]).
fn builder(weights: &HashMap<String, Tensor>, target: &ModuleTarget) -> VarBuilder<'static> {
    params::recording_builder(weights.clone(), target.dtype, &target.device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn weights() -> HashMap<String, Tensor> {
        let w = Tensor::arange(0f32, 6.0, &Device::Cpu).and_then(|t| t.reshape((2, 3))).expect("tensor");
        HashMap::from([("w".to_string(), w)])
    }

    fn counting_build(
        builds: &Arc<AtomicUsize>,
    ) -> impl Fn(VarBuilder<'static>) -> sdhive_models::Result<Tensor> + Send + Sync + 'static {
        let builds = builds.clone();
        move |vb: VarBuilder<'static>| {
            builds.fetch_add(1, Ordering::SeqCst);
            vb.get((2, 3), "w").map_err(|source| sdhive_models::ModelError::Tensor { model: "test", source })
        }
    }

    #[test]
    fn offloaded_networks_are_built_per_use_in_the_target_dtype() {
        let builds = Arc::new(AtomicUsize::new(0));
        let target = ModuleTarget { device: Device::Cpu, dtype: DType::F16, offload: true, host_copy: false };
        let r = Resident::from_host(weights(), target, counting_build(&builds)).expect("load");
        assert!(r.offloaded() && r.get().is_none());
        assert_eq!(r.resident_bytes(), 0);
        assert_eq!(builds.load(Ordering::SeqCst), 1, "checked once at load");
        let dtype = r.with(|t| t.dtype()).expect("use");
        assert_eq!(dtype, DType::F16);
        r.with(|_| ()).expect("use");
        assert_eq!(builds.load(Ordering::SeqCst), 3, "rebuilt at every use");
    }

    #[test]
    fn resident_networks_are_built_once() {
        let builds = Arc::new(AtomicUsize::new(0));
        let target =
            ModuleTarget { device: Device::Cpu, dtype: DType::F32, offload: false, host_copy: false };
        let r = Resident::from_host(weights(), target, counting_build(&builds)).expect("load");
        assert_eq!(r.resident_bytes(), 24);
        let sum = r.with(|t| t.sum_all().and_then(|s| s.to_scalar::<f32>())).expect("use").expect("sum");
        assert_eq!(sum, 15.0);
        assert!(r.get().is_some());
        assert_eq!(builds.load(Ordering::SeqCst), 1);
    }
}
