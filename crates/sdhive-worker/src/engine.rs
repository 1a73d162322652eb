//! Building the engine for a backend: the candle engine on the devices candle drives (CPU, CUDA, Metal), the
//! stable-diffusion.cpp engine on the ggml ones (Vulkan, ROCm). Both subcommands load through here, so which
//! engine a binary runs is decided in one place; `serve` gets an [`EngineFactory`] that does the same for every
//! model switch (the candle one through its RAM cache of recently used checkpoints).

use anyhow::{bail, Context};
use candle_core::DType;
use sdhive_candle::{ModuleTarget, Targets};
use sdhive_catalog::CheckpointFormat;
use sdhive_engine::{BoxError, Engine, EngineFactory, Limits, ModelSpec, Module, Placement};
use sdhive_modelsource::{ResolveOptions, ResolvedModel};
use shared_worker::{Backend, DeviceHandle, DeviceInfo};
use std::sync::Arc;

/// What the command line says about loading, beyond the model and device.
#[derive(Debug, Clone, Default)]
pub struct EngineOptions {
    /// `None`: the backend's default (f32 on CPU, f16 on GPUs).
    pub dtype: Option<DType>,
    pub placement: Placement,
    pub limits: Limits,
    /// The most device memory the candle engine may plan for, weights included.
    pub memory_budget: Option<u64>,
    /// How the candle engine makes `preview_every` previews (`serve --preview`).
    pub previews: sdhive_candle::Previews,
    /// SD3: leave T5 out (its part of the context is zeros, as diffusers' `text_encoder_3=None`).
    pub no_t5: bool,
}

pub fn load(
    backend: Backend,
    device: DeviceHandle,
    info: &DeviceInfo,
    model: &ResolvedModel,
    opts: EngineOptions,
) -> anyhow::Result<Box<dyn Engine>> {
    load_with(backend, device, info, model, opts, None)
}

/// Loads the models a serving worker is asked for, on one device.
pub struct Factory {
    backend: Backend,
    device: DeviceHandle,
    info: DeviceInfo,
    opts: EngineOptions,
    resolve: ResolveOptions,
    cache: sdhive_candle::HostCache,
}

/// The checkpoint formats the engine of `backend` loads: the library lists the others as refused, and a GGUF
/// `--model` on a candle worker is refused before anything loads.
pub fn checkpoint_formats(backend: Backend) -> Vec<CheckpointFormat> {
    let mut formats = vec![CheckpointFormat::Diffusers, CheckpointFormat::SafeTensors];
    if backend.engine().loads_gguf() {
        formats.push(CheckpointFormat::Gguf);
    }
    formats
}

impl Factory {
    /// `checkpoint_cache`: how many recently used checkpoints the candle engine keeps in host memory.
    pub fn new(
        backend: Backend,
        device: DeviceHandle,
        info: DeviceInfo,
        opts: EngineOptions,
        resolve: ResolveOptions,
        checkpoint_cache: usize,
    ) -> Self {
        Factory {
            backend,
            device,
            info,
            opts,
            resolve,
            cache: sdhive_candle::HostCache::new(checkpoint_cache),
        }
    }
}

impl EngineFactory for Factory {
    fn load(&mut self, spec: &ModelSpec) -> Result<Box<dyn Engine>, BoxError> {
        let mut model = sdhive_modelsource::resolve(&spec.source, &self.resolve)
            .with_context(|| format!("cannot use model {}", spec.source))?;
        if !spec.name.is_empty() {
            model.name = spec.name.clone();
        }
        model.vae = spec
            .vae
            .as_ref()
            .map(|vae| {
                sdhive_modelsource::resolve_vae(vae, &self.resolve)
                    .with_context(|| format!("cannot use VAE {}", vae.display()))
            })
            .transpose()?;
        tracing::info!(model = %model.name, path = %model.location.path().display(), vae = ?model.vae, "loading");
        let engine = load_with(
            self.backend,
            self.device.clone(),
            &self.info,
            &model,
            self.opts.clone(),
            Some(&mut self.cache),
        )?;
        Ok(engine)
    }
}

fn load_with(
    backend: Backend,
    device: DeviceHandle,
    info: &DeviceInfo,
    model: &ResolvedModel,
    opts: EngineOptions,
    cache: Option<&mut sdhive_candle::HostCache>,
) -> anyhow::Result<Box<dyn Engine>> {
    let context = || format!("cannot load model {} from {}", model.name, model.location.path().display());
    if model.location.is_gguf() && !backend.engine().loads_gguf() {
        bail!(
            "{}: GGUF checkpoints load on the stable-diffusion.cpp engine (sd-worker-vulkan, sd-worker-rocm), not on \
             {}, which {} runs: use the model's .safetensors or diffusers form",
            model.location.path().display(),
            backend.engine().name(),
            backend.binary_name()
        );
    }
    match device {
        DeviceHandle::Candle(device) => {
            let dtype = opts.dtype.unwrap_or_else(|| backend.default_dtype());
            let target = |module: Module, dtype: DType| -> anyhow::Result<ModuleTarget> {
                let placed = match opts.placement.device_of(module) {
                    None => device.clone(),
                    Some(r) => {
                        shared_worker::placement_device(backend, &device, info.index, &r.backend, r.index)?
                    }
                };
                // Modules moved to the CPU run in f32: candle's CPU kernels have no fast half-precision path.
                let dtype = if placed.is_cpu() && !device.is_cpu() { DType::F32 } else { dtype };
                Ok(ModuleTarget {
                    device: placed,
                    dtype,
                    offload: opts.placement.offloaded(module),
                    host_copy: false,
                })
            };
            let targets = |dtype: DType| -> anyhow::Result<Targets> {
                Ok(Targets {
                    unet: target(Module::Diffusion, dtype)?,
                    text: target(Module::TextEncoder, dtype)?,
                    vae: target(Module::Vae, dtype)?,
                })
            };
            let sd3 = match &model.location {
                sdhive_modelsource::ModelLocation::DiffusersDir(dir) => sdhive_candle::is_sd3_folder(dir),
                sdhive_modelsource::ModelLocation::SingleFile(file) => {
                    sdhive_checkpoint::is_sd3_file(file).with_context(context)?
                }
            };
            if sd3 {
                let targets = targets(opts.dtype.unwrap_or_else(|| backend.default_sd3_dtype()))?;
                return load_sd3(backend, &targets, info, model, &opts, cache).with_context(context);
            }
            let targets = targets(dtype)?;
            // Jobs are planned against the memory of the device the UNet runs on.
            let planned = DeviceHandle::Candle(targets.unet.device.clone());
            let load_opts = sdhive_candle::LoadOptions {
                targets,
                backend_name: backend.name().to_string(),
                device_name: info.name.clone(),
                memory: Some(Arc::new(move || shared_worker::memory(&planned))),
                memory_budget: opts.memory_budget,
            };
            let engine = match cache {
                Some(cache) => sdhive_candle::CandleEngine::load_cached(model, load_opts, cache),
                None => sdhive_candle::CandleEngine::load(model, load_opts),
            }
            .with_context(context)?;
            Ok(Box::new(engine.with_limits(opts.limits).with_previews(&opts.previews)))
        }
        DeviceHandle::Ggml(name) => load_sdcpp(backend, name, info, model, opts).with_context(context),
    }
}

/// An SD3-family diffusers folder or SAI single file, each network on its target (`--placement`, `--offload`;
/// module `te` is all three text encoders), with a standalone VAE in place of its own where one is chosen,
/// through the RAM cache like SD1/SDXL, its jobs planned against the memory of the device the MMDiT runs on.
fn load_sd3(
    backend: Backend,
    targets: &Targets,
    info: &DeviceInfo,
    model: &ResolvedModel,
    opts: &EngineOptions,
    cache: Option<&mut sdhive_candle::HostCache>,
) -> anyhow::Result<Box<dyn Engine>> {
    let with_t5 = !opts.no_t5;
    let sd3 = match cache {
        Some(cache) => cache.load_sd3(model, targets, with_t5)?,
        None => sdhive_candle::Sd3Model::load(model, targets, with_t5)?,
    };
    let names = (backend.name(), info.name.as_str());
    let planned = DeviceHandle::Candle(targets.unet.device.clone());
    let memory: sdhive_candle::MemoryQuery = Arc::new(move || shared_worker::memory(&planned));
    let engine = sdhive_candle::Sd3Engine::from_model(sd3, &model.name, targets.unet.dtype, names)
        .with_memory(Some(memory), opts.memory_budget);
    Ok(Box::new(engine.with_limits(opts.limits.clone())))
}

#[cfg(feature = "sdcpp")]
fn load_sdcpp(
    backend: Backend,
    ggml_device: String,
    info: &DeviceInfo,
    model: &ResolvedModel,
    opts: EngineOptions,
) -> anyhow::Result<Box<dyn Engine>> {
    use sdhive_sdcpp::{LoadOptions, SdCppEngine, WeightType};
    let weight_type = match opts.dtype {
        None | Some(DType::F16) => WeightType::F16,
        Some(DType::F32) => WeightType::F32,
        Some(other) => bail!("the stable-diffusion.cpp engine runs f16 or f32 weights, not {other:?}"),
    };
    let load_opts = LoadOptions {
        ggml_device,
        backend_name: backend.name().to_string(),
        device_name: info.name.clone(),
        weight_type: Some(weight_type),
        placement: opts.placement,
        threads: None,
        memory_budget: opts.memory_budget,
        no_t5: opts.no_t5,
    };
    Ok(Box::new(SdCppEngine::load(model, load_opts)?.with_limits(opts.limits)))
}

#[cfg(not(feature = "sdcpp"))]
fn load_sdcpp(
    backend: Backend,
    _ggml_device: String,
    _info: &DeviceInfo,
    _model: &ResolvedModel,
    _opts: EngineOptions,
) -> anyhow::Result<Box<dyn Engine>> {
    bail!("this binary was built without the stable-diffusion.cpp engine that {backend} needs")
}

#[cfg(test)]
mod tests {
    use super::*;
    use sdhive_modelsource::ModelLocation;

    #[test]
    fn only_the_stable_diffusion_cpp_backends_load_gguf() {
        for backend in Backend::ALL {
            let gguf = checkpoint_formats(backend).contains(&CheckpointFormat::Gguf);
            assert_eq!(gguf, matches!(backend, Backend::Vulkan | Backend::Rocm), "{backend}");
        }
    }

    #[test]
    fn a_candle_worker_refuses_a_gguf_checkpoint_naming_the_file_and_where_it_loads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v1-5-q8_0.gguf");
        sdhive_catalog::gguf::write_sd_for_tests(&path, "sd1", 4).unwrap();
        let model =
            ResolvedModel { name: "v1-5-q8_0".into(), location: ModelLocation::SingleFile(path), vae: None };
        let info = DeviceInfo {
            backend: Backend::Cpu,
            index: 0,
            name: "cpu".into(),
            memory_total_bytes: None,
            memory_free_bytes: None,
            driver: None,
            threads: None,
        };
        let device = DeviceHandle::Candle(candle_core::Device::Cpu);
        let err = load(Backend::Cpu, device, &info, &model, EngineOptions::default()).err().expect("refused");
        let message = format!("{err:#}");
        assert!(message.contains("v1-5-q8_0.gguf") && message.contains("stable-diffusion.cpp"), "{message}");
        assert!(message.contains("sd-worker-cpu"), "{message}");
    }
}
