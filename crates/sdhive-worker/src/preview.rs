//! `serve --preview`: how the worker's engines make the previews of `preview_every`, decided once at start. TAESD
//! decoders are looked for (`sdhive_modelsource::find_taesd`: the models dirs, then the Hugging Face cache) and
//! loaded on the worker's device; every model the worker then loads previews with its family's decoder, or with
//! the latent preview where that one is missing. On the CPU `auto` keeps the latent preview: a full-size TAESD
//! decode there costs seconds per preview (docs/operations.md), a latent one nothing.

use anyhow::Context;
use candle_core::DType;
use sdhive_candle::{Previews, TaesdDecoders};
use sdhive_engine::PreviewMode;
use sdhive_models::TaesdDecoder;
use sdhive_modelsource::{find_taesd, TaesdKind, TaesdNotFound};
use shared_worker::{Backend, DeviceHandle};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What the engines of a worker on `backend` get for `mode`. `dtype`: the worker's (the backend's default when
/// `None`). Fails for `taesd` when no decoder is found (naming every place looked at) or a found one does not
/// load.
pub fn setup(
    backend: Backend,
    mode: PreviewMode,
    models_dirs: &[PathBuf],
    hub_cache: &Path,
    device: &DeviceHandle,
    dtype: Option<DType>,
) -> anyhow::Result<Previews> {
    let device = match (mode, device) {
        (PreviewMode::Off, _) => return Ok(Previews::Off),
        (PreviewMode::Latent, _) => return Ok(Previews::Latent),
        (_, DeviceHandle::Ggml(_)) => {
            if mode == PreviewMode::Taesd {
                tracing::warn!(
                    "--preview taesd: the stable-diffusion.cpp engine of {} sends no previews",
                    backend.binary_name()
                );
            }
            return Ok(Previews::Latent);
        }
        (PreviewMode::Auto, _) if backend == Backend::Cpu => {
            tracing::info!(
                "latent previews on the CPU (--preview taesd for TAESD's, at seconds per preview)"
            );
            return Ok(Previews::Latent);
        }
        (_, DeviceHandle::Candle(device)) => device,
    };
    let dtype = dtype.unwrap_or_else(|| backend.default_dtype());
    let mut decoders = TaesdDecoders::default();
    let mut missing: Vec<TaesdNotFound> = Vec::new();
    for kind in TaesdKind::ALL {
        let path = match find_taesd(kind, models_dirs, hub_cache) {
            Ok(path) => path,
            Err(not_found) => {
                missing.push(not_found);
                continue;
            }
        };
        let decoder = match TaesdDecoder::load(&path, dtype, device) {
            Ok(d) => Arc::new(d),
            Err(e) if mode == PreviewMode::Auto => {
                let name = kind.name();
                tracing::warn!(path = %path.display(), "cannot load the {name} decoder, latent previews instead: {e}");
                continue;
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("--preview taesd: cannot load the {} decoder {}", kind.name(), path.display())
                })
            }
        };
        tracing::info!(path = %path.display(), "TAESD previews with {}", kind.name());
        match kind {
            TaesdKind::Sd => decoders.sd = Some(decoder),
            TaesdKind::Sdxl => decoders.sdxl = Some(decoder),
        }
    }
    if decoders.sd.is_none() && decoders.sdxl.is_none() {
        if mode == PreviewMode::Taesd {
            let looked: Vec<String> = missing.iter().map(ToString::to_string).collect();
            anyhow::bail!(
                "--preview taesd: {}. Put taesd_decoder.safetensors / taesdxl_decoder.safetensors (from \
                 madebyollin/taesd and madebyollin/taesdxl) in a models dir's VAE-taesd/ folder, or pass \
                 --preview latent",
                looked.join("; ")
            );
        }
        return Ok(Previews::Latent);
    }
    for not_found in &missing {
        tracing::warn!("models of that family get latent previews: {not_found}");
    }
    Ok(Previews::Taesd(decoders))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixtures() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/taesd")
    }

    fn cpu() -> DeviceHandle {
        DeviceHandle::Candle(candle_core::Device::Cpu)
    }

    fn found(p: &Previews) -> (bool, bool) {
        match p {
            Previews::Taesd(d) => (d.sd.is_some(), d.sdxl.is_some()),
            _ => (false, false),
        }
    }

    /// The Hugging Face cache layout with `madebyollin/<name>` as the diffusers folder of the fixture.
    fn hub_with(dir: &Path, name: &str) {
        let hash = "89ab89ab89ab89ab89ab89ab89ab89ab89ab89ab";
        let repo = dir.join(format!("models--madebyollin--{name}"));
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), hash).unwrap();
        let snapshot = repo.join("snapshots").join(hash);
        std::fs::create_dir_all(&snapshot).unwrap();
        for file in ["config.json", "diffusion_pytorch_model.safetensors"] {
            std::fs::copy(fixtures().join(name).join(file), snapshot.join(file)).unwrap();
        }
    }

    #[test]
    fn auto_uses_taesd_on_gpus_where_found_and_latent_on_the_cpu() {
        let tmp = tempfile::tempdir().unwrap();
        let hub = tmp.path().join("hub");
        let dirs = [fixtures()];
        // A GPU backend's decision, the decoders loaded on the CPU for the test.
        let p = setup(Backend::Cuda, PreviewMode::Auto, &dirs, &hub, &cpu(), Some(DType::F32)).unwrap();
        assert_eq!(found(&p), (true, true));
        let p = setup(Backend::Cpu, PreviewMode::Auto, &dirs, &hub, &cpu(), None).unwrap();
        assert!(matches!(p, Previews::Latent));
        let p = setup(Backend::Cuda, PreviewMode::Auto, &[], &hub, &cpu(), Some(DType::F32)).unwrap();
        assert!(matches!(p, Previews::Latent), "nothing found: latent");
        let p = setup(Backend::Cpu, PreviewMode::Off, &dirs, &hub, &cpu(), None).unwrap();
        assert!(matches!(p, Previews::Off));
        let p = setup(
            Backend::Vulkan,
            PreviewMode::Taesd,
            &dirs,
            &hub,
            &DeviceHandle::Ggml("Vulkan0".into()),
            None,
        );
        assert!(matches!(p, Ok(Previews::Latent)), "stable-diffusion.cpp: no TAESD");
    }

    #[test]
    fn taesd_is_found_in_the_hugging_face_cache_per_family() {
        let tmp = tempfile::tempdir().unwrap();
        let hub = tmp.path().join("hub");
        hub_with(&hub, "taesdxl");
        let p = setup(Backend::Cpu, PreviewMode::Taesd, &[], &hub, &cpu(), None).unwrap();
        assert_eq!(found(&p), (false, true), "only SDXL's decoder is cached");
        hub_with(&hub, "taesd");
        let p = setup(Backend::Cpu, PreviewMode::Taesd, &[], &hub, &cpu(), None).unwrap();
        assert_eq!(found(&p), (true, true));
    }

    #[test]
    fn taesd_without_weights_or_with_a_broken_file_is_an_error_naming_the_paths() {
        let tmp = tempfile::tempdir().unwrap();
        let (models, hub) = (tmp.path().join("models"), tmp.path().join("hub"));
        std::fs::create_dir_all(&models).unwrap();
        let err = setup(Backend::Cpu, PreviewMode::Taesd, std::slice::from_ref(&models), &hub, &cpu(), None)
            .unwrap_err();
        let message = format!("{err:#}");
        for needle in [
            models.join("VAE-taesd/taesd_decoder.safetensors"),
            models.join("VAE-taesd/taesdxl_decoder.safetensors"),
            models.join("taesd"),
            hub.join("models--madebyollin--taesdxl"),
        ] {
            assert!(message.contains(&needle.display().to_string()), "{message}");
        }
        std::fs::create_dir_all(models.join("VAE-taesd")).unwrap();
        std::fs::write(models.join("VAE-taesd/taesd_decoder.safetensors"), b"truncated").unwrap();
        let err = setup(Backend::Cpu, PreviewMode::Taesd, std::slice::from_ref(&models), &hub, &cpu(), None)
            .unwrap_err();
        let message = format!("{err:#}");
        assert!(
            message.contains("taesd_decoder.safetensors") && message.contains("cannot load"),
            "{message}"
        );
        // `auto` goes on with the latent preview instead.
        let p = setup(Backend::Cuda, PreviewMode::Auto, &[models], &hub, &cpu(), Some(DType::F32)).unwrap();
        assert!(matches!(p, Previews::Latent));
    }
}
