//! Where each network of a pipeline lives: its device and dtype (`--placement`), and whether its weights stay
//! in host memory between uses (`--offload`). An offloaded network is rebuilt on its device from the host copy
//! each time it is used and dropped afterwards, so its device memory is held only while it runs.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
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
    /// Bytes of its weights in the target dtype (what it occupies on the device while built).
    weight_bytes: u64,
}

impl<T> Resident<T> {
    /// A network already built on `target.device`.
    pub fn loaded(model: T, target: ModuleTarget, weight_bytes: u64) -> Self {
        Resident { target, state: State::Loaded(model), weight_bytes }
    }

    /// Host tensors (any dtype, on the CPU) from which `build` makes the network on `target.device` when used;
    /// built right away unless `target.offload`.
    pub fn from_host(
        weights: HashMap<String, Tensor>,
        target: ModuleTarget,
        build: impl Fn(VarBuilder<'static>) -> sdhive_models::Result<T> + Send + Sync + 'static,
    ) -> sdhive_models::Result<Self> {
        let mut weights = weights;
        if target.offload {
            // A host copy holds what the network will be built from: converted once here (half the memory of
            // an f32 checkpoint used in f16, half the upload), not at every build.
            for tensor in weights.values_mut() {
                if tensor.dtype() != target.dtype && tensor.dtype().is_float() {
                    *tensor = tensor
                        .to_dtype(target.dtype)
                        .map_err(|source| sdhive_models::ModelError::Tensor { model: "host copy", source })?;
                }
            }
        }
        let weight_bytes =
            weights.values().map(|t| (t.elem_count() * target.dtype.size_in_bytes()) as u64).sum();
        let build: Build<T> = Arc::new(build);
        let state = if target.offload {
            // Built once now so a bad checkpoint fails at load, not at the first request.
            if !target.host_copy {
                build(builder(&weights, &target))?;
            }
            State::Host { weights, build }
        } else {
            State::Loaded(build(builder(&weights, &target))?)
        };
        Ok(Resident { target, state, weight_bytes })
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
        let state = if offload {
            Ok(State::Host { weights: weights.clone(), build: Arc::clone(build) })
        } else {
            build(builder(weights, &target)).map(State::Loaded)
        };
        Some(state.map(|state| Resident { target, state, weight_bytes: self.weight_bytes }))
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

    /// The built network, when it is resident (benchmarks and tests that drive it directly).
    pub fn get(&self) -> Option<&T> {
        match &self.state {
            State::Loaded(m) => Some(m),
            State::Host { .. } => None,
        }
    }
}

/// A `VarBuilder` that copies each host tensor to the target device and dtype as the network asks for it.
fn builder(weights: &HashMap<String, Tensor>, target: &ModuleTarget) -> VarBuilder<'static> {
    VarBuilder::from_tensors(weights.clone(), target.dtype, &target.device)
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
