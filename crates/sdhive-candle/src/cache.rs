//! The RAM cache of recently used checkpoints (`--checkpoint-cache N`, A1111's `sd_checkpoints_limit`): each
//! entry is a model read and converted once into host memory, in the dtypes its device runs, so switching back
//! to it skips the disk, the name mapping and the casts and only uploads. On a CPU worker the loaded model shares
//! its entry's tensors, so caching the model in use costs nothing extra. Entries are dropped oldest first beyond
//! `N`, and while the machine's available memory is short.

use crate::model::{LoadError, SdModel};
use crate::residency::Targets;
use crate::sd3::{Sd3Error, Sd3Model};
use candle_core::DType;
use sdhive_modelsource::{ModelLocation, ResolvedModel};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;

/// What identifies a cached model: its files, the dtypes its networks were converted to and, for SD3, whether
/// T5 was read.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Key {
    location: ModelLocation,
    vae: Option<PathBuf>,
    dtypes: [DType; 3],
    with_t5: bool,
}

impl Key {
    fn new(model: &ResolvedModel, targets: &Targets, with_t5: bool) -> Self {
        Key {
            location: model.location.clone(),
            vae: model.vae.clone(),
            dtypes: [targets.unet.dtype, targets.text.dtype, targets.vae.dtype],
            with_t5,
        }
    }
}

/// A cached model of either engine family.
enum Cached {
    Sd(Box<SdModel>),
    Sd3(Box<Sd3Model>),
}

impl Cached {
    fn host_bytes(&self) -> u64 {
        match self {
            Cached::Sd(m) => m.host_bytes(),
            Cached::Sd3(m) => m.host_bytes(),
        }
    }
}

/// Below this share of the machine's memory available, the cache gives entries back.
const MIN_AVAILABLE_SHARE: f64 = 0.15;

pub struct HostCache {
    capacity: usize,
    /// Oldest first.
    entries: VecDeque<(Key, Arc<Cached>)>,
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
        self.contains_with(model, targets, true)
    }

    /// Whether the SD3 model `model` (on `targets`, with T5 read or not) is cached.
    pub fn contains_with(&self, model: &ResolvedModel, targets: &Targets, with_t5: bool) -> bool {
        let key = Key::new(model, targets, with_t5);
        self.entries.iter().any(|(k, _)| *k == key)
    }

    /// `model` built on `targets`: from its cached host copy when there is one, else read from disk (into the
    /// cache when it has room).
    pub fn load(&mut self, model: &ResolvedModel, targets: &Targets) -> Result<SdModel, LoadError> {
        if self.capacity == 0 {
            return SdModel::load(model, targets);
        }
        self.load_as(
            Key::new(model, targets, true),
            model,
            || Ok(Cached::Sd(Box::new(SdModel::load_host(model, targets)?))),
            |cached| match cached {
                Cached::Sd(host) => host.place(&model.name, targets),
                Cached::Sd3(_) => Err(LoadError::Layout {
                    path: model.location.path().to_path_buf(),
                    message: "the RAM cache holds this model as SD3".into(),
                }),
            },
        )
    }

    /// The SD3-family `model` built on `targets` (T5 read or left out), as [`HostCache::load`].
    pub fn load_sd3(
        &mut self,
        model: &ResolvedModel,
        targets: &Targets,
        with_t5: bool,
    ) -> Result<Sd3Model, Sd3Error> {
        if self.capacity == 0 {
            return Sd3Model::load(model, targets, with_t5);
        }
        self.load_as(
            Key::new(model, targets, with_t5),
            model,
            || Ok(Cached::Sd3(Box::new(Sd3Model::load_host(model, targets, with_t5)?))),
            |cached| match cached {
                Cached::Sd3(host) => host.place(targets),
                Cached::Sd(_) => Err(Sd3Error::Load {
                    path: model.location.path().to_path_buf(),
                    message: "the RAM cache holds this model as SD 1.x/2.x/XL".into(),
                }),
            },
        )
    }

    fn load_as<M, E>(
        &mut self,
        key: Key,
        model: &ResolvedModel,
        read: impl FnOnce() -> Result<Cached, E>,
        place: impl FnOnce(&Cached) -> Result<M, E>,
    ) -> Result<M, E> {
        let host = match self.entries.iter().position(|(k, _)| *k == key) {
            Some(i) => {
                let (_, host) = self.entries.remove(i).expect("index from position");
                tracing::info!(model = %model.name, "switching from the RAM cache");
                host
            }
            None => Arc::new(read()?),
        };
        // Placing builds the networks, which checks the host copy (kept unchecked): only a copy that placed
        // is cached.
        let placed = place(&host)?;
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
            if let Some((dropped, _)) = self.entries.pop_front() {
                let model = dropped.location.path().display().to_string();
                tracing::info!(%model, "available memory is short: dropping it from the RAM cache");
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
    use crate::sd3::Sd3Request;
    use candle_core::Device;
    use sdhive_engine::Engine as _;

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

    /// An SD3 model is cached like the others (T5 read or not being two entries): switching back to it reads no
    /// file (its folder is gone by then) and gives the image of the model read from disk, its standalone VAE
    /// included.
    #[test]
    fn sd3_models_come_back_from_ram_as_they_were_read() {
        let targets = Targets::all(&Device::Cpu, DType::F32);
        let mut cache = HostCache::new(2);
        cache.memory = || None;
        let tmp = tempfile::tempdir().expect("temp dir");
        let folder = tmp.path().join("sd3");
        let models = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models");
        copy_dir(&models.join("sd3"), &folder);
        let vae = models.join("VAE/sd3-alt.safetensors");
        let sd3 = ResolvedModel {
            vae: Some(vae.clone()),
            ..sdhive_modelsource::resolve(&folder.to_string_lossy(), &Default::default()).expect("sd3")
        };
        let req = Sd3Request { width: 64, height: 64, steps: 2, ..Sd3Request::new("a photo of a cat", 7) };
        let mut fresh = Sd3Model::from_dir(&folder, DType::F32, &Device::Cpu, true).expect("sd3 from disk");
        fresh.replace_vae(&vae, &targets.vae).expect("its VAE");
        let want = fresh.generate(&req).expect("fresh image").image;

        cache.load_sd3(&sd3, &targets, true).expect("sd3");
        assert!(cache.contains_with(&sd3, &targets, true) && !cache.contains_with(&sd3, &targets, false));
        assert!(cache.bytes() > 0);
        cache.load(&fixture("sd1"), &targets).expect("sd1");
        std::fs::remove_dir_all(&folder).expect("the folder goes");
        let again = cache.load_sd3(&sd3, &targets, true).expect("sd3 from the cache, without its files");
        assert_eq!(again.generate(&req).expect("cached image").image, want);
        assert_eq!(cache.len(), 2);
        // A job's LoRA merged into the served model (which shares the cache's tensors on the CPU) leaves with the
        // engine: the next placement is the plain model.
        let lora = sdhive_engine::LoraUse {
            name: "sd3_kohya".into(),
            path: models.join("Lora/sd3_kohya.safetensors"),
            te: 1.0,
            unet: 1.0,
            hash: None,
        };
        let mut engine = crate::Sd3Engine::from_model(again, "sd3", DType::F32, ("cpu", "cpu"));
        let job = sdhive_engine::GenerateRequest {
            prompt: req.prompt.clone(),
            steps: 2,
            width: Some(64),
            height: Some(64),
            seed: Some(7),
            loras: vec![lora],
            ..Default::default()
        };
        let merged = engine.generate(&job, &mut |_| sdhive_engine::Control::Continue).expect("with the LoRA");
        drop(engine);
        let plain = cache.load_sd3(&sd3, &targets, true).expect("sd3 from the cache again");
        let plain = plain.generate(&req).expect("plain image").image;
        assert_ne!(merged.images[0].image, plain, "the LoRA changed nothing");
        assert_eq!(plain, want, "the cached copy kept the LoRA");
    }

    fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
        std::fs::create_dir_all(to).expect("mkdir");
        for entry in std::fs::read_dir(from).expect("read_dir").flatten() {
            let dest = to.join(entry.file_name());
            if entry.path().is_dir() {
                copy_dir(&entry.path(), &dest);
            } else {
                std::fs::copy(entry.path(), dest).expect("copy");
            }
        }
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
