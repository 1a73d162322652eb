//! The RAM cache of recently used checkpoints (`--checkpoint-cache N`, A1111's `sd_checkpoints_limit`): each
//! entry is a model read and converted once into host memory, in the dtypes its device runs, so switching back
//! to it skips the disk, the name mapping and the casts and only uploads. On a CPU worker the loaded model shares
//! its entry's tensors, so caching the model in use costs nothing extra. Entries are dropped oldest first beyond
//! `N`, and while the machine's available memory is short.

use crate::model::{LoadError, SdModel};
use crate::residency::Targets;
use candle_core::DType;
use sdhive_modelsource::{ModelLocation, ResolvedModel};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;

/// What identifies a cached model: its files and the dtypes its networks were converted to.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Key {
    location: ModelLocation,
    vae: Option<PathBuf>,
    dtypes: [DType; 3],
}

impl Key {
    fn new(model: &ResolvedModel, targets: &Targets) -> Self {
        Key {
            location: model.location.clone(),
            vae: model.vae.clone(),
            dtypes: [targets.unet.dtype, targets.text.dtype, targets.vae.dtype],
        }
    }
}

/// Below this share of the machine's memory available, the cache gives entries back.
const MIN_AVAILABLE_SHARE: f64 = 0.15;

pub struct HostCache {
    capacity: usize,
    /// Oldest first.
    entries: VecDeque<(Key, Arc<SdModel>)>,
    /// `(total, available)` bytes of host memory; `None` where it cannot be read.
    memory: fn() -> Option<(u64, u64)>,
}

impl HostCache {
    /// A cache of at most `capacity` models; 0 loads every model straight from disk onto its device.
    pub fn new(capacity: usize) -> Self {
        HostCache { capacity, entries: VecDeque::new(), memory: host_memory }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Host bytes the cached models hold.
    pub fn bytes(&self) -> u64 {
        self.entries.iter().map(|(_, m)| m.host_bytes()).sum()
    }

    /// Whether `model` (on `targets`) is cached.
    pub fn contains(&self, model: &ResolvedModel, targets: &Targets) -> bool {
        let key = Key::new(model, targets);
        self.entries.iter().any(|(k, _)| *k == key)
    }

    /// `model` built on `targets`: from its cached host copy when there is one, else read from disk (into the
    /// cache when it has room).
    pub fn load(&mut self, model: &ResolvedModel, targets: &Targets) -> Result<SdModel, LoadError> {
        if self.capacity == 0 {
            return SdModel::load(model, targets);
        }
        let key = Key::new(model, targets);
        let host = match self.entries.iter().position(|(k, _)| *k == key) {
            Some(i) => {
                let (_, host) = self.entries.remove(i).expect("index from position");
                tracing::info!(model = %model.name, "switching from the RAM cache");
                host
            }
            None => Arc::new(SdModel::load_host(model, targets)?),
        };
        // Placing builds the networks, which checks the host copy (kept unchecked): only a copy that placed
        // is cached.
        let placed = host.place(&model.name, targets)?;
        self.entries.push_back((key, host));
        self.trim();
        Ok(placed)
    }

    fn trim(&mut self) {
        while self.entries.len() > self.capacity {
            self.entries.pop_front();
        }
        // The newest entry stays: it backs the model just loaded (on the CPU it is that model's memory).
        while self.entries.len() > 1 && self.memory_short() {
            if let Some((_, dropped)) = self.entries.pop_front() {
                tracing::info!(model = %dropped.name, "available memory is short: dropping it from the RAM cache");
            }
        }
    }

    fn memory_short(&self) -> bool {
        match (self.memory)() {
            Some((total, available)) if total > 0 => (available as f64) < MIN_AVAILABLE_SHARE * total as f64,
            _ => false,
        }
    }
}

/// `MemTotal` and `MemAvailable` from `/proc/meminfo`.
fn host_memory() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    };
    Some((field("MemTotal:")?, field("MemAvailable:")?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn fixture(name: &str) -> ResolvedModel {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name);
        sdhive_modelsource::resolve(&dir.to_string_lossy(), &Default::default()).expect("fixture model")
    }

    #[test]
    fn cached_models_share_their_tensors_and_are_dropped_oldest_first() {
        let targets = Targets::all(&Device::Cpu, DType::F32);
        let mut cache = HostCache::new(2);
        cache.memory = || None;
        let sd1 = fixture("sd1");
        let sdxl = fixture("sdxl.safetensors");
        let a = cache.load(&sd1, &targets).expect("sd1");
        assert_eq!(cache.len(), 1);
        assert!(cache.bytes() > 0);
        let b = cache.load(&sdxl, &targets).expect("sdxl");
        assert_eq!(b.family.name(), "sdxl");
        let again = cache.load(&sd1, &targets).expect("sd1 from the cache");
        assert_eq!(cache.len(), 2);
        assert_eq!(a.native_size, again.native_size);
        let third = fixture("sd1.safetensors");
        cache.load(&third, &targets).expect("third");
        assert_eq!(cache.len(), 2);
        assert!(!cache.contains(&sdxl, &targets), "the least recently used entry goes");
        assert!(cache.contains(&sd1, &targets) && cache.contains(&third, &targets));
    }

    #[test]
    fn short_memory_keeps_only_the_newest_entry() {
        let targets = Targets::all(&Device::Cpu, DType::F32);
        let mut cache = HostCache::new(4);
        cache.memory = || Some((100, 10));
        cache.load(&fixture("sd1"), &targets).expect("sd1");
        cache.load(&fixture("sd1.safetensors"), &targets).expect("sd1 file");
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn capacity_zero_caches_nothing() {
        let mut cache = HostCache::new(0);
        cache.load(&fixture("sd1"), &Targets::all(&Device::Cpu, DType::F32)).expect("sd1");
        assert!(cache.is_empty());
    }
}
