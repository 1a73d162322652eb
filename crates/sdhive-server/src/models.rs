//! The model library as a worker serves it: the catalogue of its models dirs (plus the `--model` it was started
//! with when that lies outside them), the selected checkpoint and VAE (A1111's `sd_model_checkpoint` and `sd_vae`
//! options), turning a request's model name into a [`ModelSpec`] with A1111's matching, and what the engine
//! thread has loaded now. Handlers resolve names here at submission, so an unknown name is refused before it is
//! queued; the engine thread records every load and unload here.

use crate::locks::{lock, read, write};
use sdhive_catalog::{Catalog, CatalogConfig, Checkpoint, CheckpointFormat};
use sdhive_engine::{EngineInfo, ModelSpec};
use sdhive_protocol::{file_stem, is_openai_model_name, ListedModel};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ModelError {
    #[error("no model `{query}`{}", closest_hint(closest))]
    UnknownCheckpoint { query: String, closest: Vec<String> },
    #[error("no VAE `{query}`; choose `Automatic`, `None` or one of: {}", list_or_none(known))]
    UnknownVae { query: String, known: Vec<String> },
    #[error("no model is selected and none is loaded: pick one (`sd_model_checkpoint`, `model`)")]
    NothingSelected,
    #[error("the model library cannot be read: {0}")]
    Catalog(String),
}

fn closest_hint(closest: &[String]) -> String {
    if closest.is_empty() {
        String::new()
    } else {
        format!("; closest: {}", closest.join(", "))
    }
}

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() {
        "(none installed)".into()
    } else {
        names.join(", ")
    }
}

/// A1111's `sd_vae` values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VaeChoice {
    /// A VAE file named after the checkpoint (`<name>.vae.safetensors` beside it), else the checkpoint's own.
    Automatic,
    /// The checkpoint's own VAE.
    None,
    /// A file from the VAE folders, by name.
    File(String),
}

impl VaeChoice {
    pub fn parse(value: &str) -> VaeChoice {
        match value.trim() {
            "" | "Automatic" | "auto" => VaeChoice::Automatic,
            "None" => VaeChoice::None,
            name => VaeChoice::File(name.to_string()),
        }
    }

    pub fn as_option(&self) -> String {
        match self {
            VaeChoice::Automatic => "Automatic".into(),
            VaeChoice::None => "None".into(),
            VaeChoice::File(name) => name.clone(),
        }
    }
}

/// A VAE as `GET /sdapi/v1/sd-vae` lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct ListedVae {
    pub model_name: String,
    pub filename: String,
}

/// The model the engine thread has loaded, or last had.
#[derive(Debug, Clone, Default)]
struct Loaded {
    current: Option<(ModelSpec, EngineInfo)>,
    /// The latest engine's description, kept through unloads for what does not change between models.
    last_info: Option<EngineInfo>,
}

/// The `--model` a worker was started with when it is no catalogue entry (a path elsewhere, a hub repo id, or a
/// test's engine): listed and selectable like one.
#[derive(Debug, Clone)]
struct Extra {
    spec: ModelSpec,
    /// What clients may call it: the argument, its file stem, the name the engine reported.
    aliases: Vec<String>,
}

#[derive(Debug, Clone)]
struct Selection {
    checkpoint: Option<ModelSpec>,
    vae: VaeChoice,
}

pub struct ModelLibrary {
    config: CatalogConfig,
    /// The checkpoint formats the worker's engine loads, and that engine's name for the refusal of the others.
    loadable: (Vec<CheckpointFormat>, String),
    catalog: RwLock<Catalog>,
    extra: Mutex<Option<Extra>>,
    selection: Mutex<Selection>,
    loaded: RwLock<Loaded>,
    /// Whether the worker can load other models at all (false for a fixed engine handed to `AppState::new`).
    switchable: bool,
}

impl ModelLibrary {
    /// A library over `config`'s folders, scanned now (headers only: nothing is hashed), for an engine that loads
    /// diffusers folders and `.safetensors` files.
    pub fn scan(config: CatalogConfig) -> Result<ModelLibrary, ModelError> {
        let formats = [CheckpointFormat::Diffusers, CheckpointFormat::SafeTensors];
        ModelLibrary::scan_loading(config, &formats, "this worker's engine")
    }

    /// As [`ModelLibrary::scan`], for an engine (`engine` names it) that loads `formats`: checkpoints of other
    /// formats are listed as refused, saying where they load.
    pub fn scan_loading(
        config: CatalogConfig,
        formats: &[CheckpointFormat],
        engine: &str,
    ) -> Result<ModelLibrary, ModelError> {
        let loadable = (formats.to_vec(), engine.to_string());
        let catalog = scan(&config, &loadable)?;
        for refused in &catalog.refused {
            tracing::warn!(file = %refused.path.display(), "not listed: {}", refused.reason);
        }
        Ok(ModelLibrary {
            config,
            loadable,
            catalog: RwLock::new(catalog),
            extra: Mutex::new(None),
            selection: Mutex::new(Selection { checkpoint: None, vae: VaeChoice::Automatic }),
            loaded: RwLock::new(Loaded::default()),
            switchable: true,
        })
    }

    /// A library of exactly one model whose engine was loaded elsewhere and cannot be switched.
    pub fn fixed(name: &str, info: &EngineInfo) -> ModelLibrary {
        let spec = ModelSpec::new(info.model.clone(), name);
        let aliases = vec![name.to_string(), info.model.clone()];
        ModelLibrary {
            config: CatalogConfig { models_dirs: vec![], vae_dirs: vec![], hash_cache: None },
            loadable: (Vec::new(), String::new()),
            catalog: RwLock::new(Catalog::default()),
            extra: Mutex::new(Some(Extra { spec: spec.clone(), aliases })),
            selection: Mutex::new(Selection { checkpoint: Some(spec.clone()), vae: VaeChoice::Automatic }),
            loaded: RwLock::new(Loaded {
                current: Some((spec, info.clone())),
                last_info: Some(info.clone()),
            }),
            switchable: false,
        }
    }

    pub fn switchable(&self) -> bool {
        self.switchable
    }

    /// Adds the `--model` argument: the catalogue entry it names when it is one, else an entry of its own.
    /// Returns its spec (without a VAE: the selection adds that).
    pub fn add_model_arg(&self, arg: &str) -> ModelSpec {
        if let Some(entry) = read(&self.catalog).entry_for_arg(arg) {
            return spec_of(entry);
        }
        // The engine reports the resolved name; an empty name here lets it.
        let spec = ModelSpec::new("", arg);
        let aliases = vec![arg.to_string(), file_stem(arg).to_string()];
        *lock(&self.extra) = Some(Extra { spec: spec.clone(), aliases });
        spec
    }

    /// The first checkpoint of the catalogue, as A1111 loads when none is named.
    pub fn first_checkpoint(&self) -> Option<ModelSpec> {
        read(&self.catalog).checkpoints.first().map(spec_of)
    }

    pub fn select_checkpoint(&self, spec: &ModelSpec) {
        let mut base = spec.clone();
        base.vae = None;
        lock(&self.selection).checkpoint = Some(base);
    }

    pub fn selected_checkpoint(&self) -> Option<ModelSpec> {
        lock(&self.selection).checkpoint.clone()
    }

    pub fn select_vae(&self, choice: VaeChoice) {
        lock(&self.selection).vae = choice;
    }

    pub fn selected_vae(&self) -> VaeChoice {
        lock(&self.selection).vae.clone()
    }

    /// Checks a VAE choice against the VAE folders.
    pub fn check_vae(&self, choice: &VaeChoice) -> Result<(), ModelError> {
        match choice {
            VaeChoice::File(name) => self.vae_path(name).map(drop),
            _ => Ok(()),
        }
    }

    fn vae_path(&self, name: &str) -> Result<PathBuf, ModelError> {
        let catalog = read(&self.catalog);
        match catalog.find_vae(name) {
            Some(vae) => Ok(vae.path.clone()),
            None => Err(ModelError::UnknownVae {
                query: name.to_string(),
                known: catalog.vaes.iter().map(|v| v.name.clone()).collect(),
            }),
        }
    }

    /// The spec a job runs with: `checkpoint` names one (A1111's matching), or the selection; `vae` overrides
    /// the selected VAE choice.
    pub fn resolve(
        &self,
        checkpoint: Option<&str>,
        vae: Option<&VaeChoice>,
    ) -> Result<ModelSpec, ModelError> {
        let base = match checkpoint.map(str::trim).filter(|q| !q.is_empty()) {
            Some(q) if is_openai_model_name(q) => self.default_checkpoint()?,
            Some(q) => self.find(q)?,
            None => self.default_checkpoint()?,
        };
        self.with_vae_choice(base, vae)
    }

    /// `base` with the VAE file `choice` (the selected one when `None`) stands for.
    fn with_vae_choice(&self, base: ModelSpec, choice: Option<&VaeChoice>) -> Result<ModelSpec, ModelError> {
        let vae = match choice.cloned().unwrap_or_else(|| self.selected_vae()) {
            VaeChoice::None => None,
            VaeChoice::File(name) => Some(self.vae_path(&name)?),
            VaeChoice::Automatic => self.vae_beside(&base),
        };
        Ok(base.with_vae(vae))
    }

    /// `base` with the selected VAE (`Automatic` at start); its own VAE when the selected file is gone.
    pub fn with_selected_vae(&self, base: ModelSpec) -> ModelSpec {
        self.with_vae_choice(base.clone(), None).unwrap_or_else(|e| {
            tracing::warn!("{e}; using the checkpoint's own VAE");
            base
        })
    }

    fn default_checkpoint(&self) -> Result<ModelSpec, ModelError> {
        if let Some(spec) = self.selected_checkpoint() {
            return Ok(spec);
        }
        match &read(&self.loaded).current {
            Some((spec, _)) => Ok(ModelSpec { vae: None, ..spec.clone() }),
            None => Err(ModelError::NothingSelected),
        }
    }

    /// A checkpoint by any name A1111 accepts for it.
    pub fn find(&self, query: &str) -> Result<ModelSpec, ModelError> {
        if let Some(extra) = lock(&self.extra).as_ref() {
            let loaded_name = self.loaded_name_of(&extra.spec);
            let hit = extra.aliases.iter().chain(loaded_name.iter()).any(|a| {
                let a = a.trim();
                !a.is_empty()
                    && (a == query || a.eq_ignore_ascii_case(query) || file_stem(a) == file_stem(query))
            });
            if hit {
                return Ok(extra.spec.clone());
            }
        }
        let catalog = read(&self.catalog);
        match catalog.find(query) {
            Ok(entry) => Ok(spec_of(entry)),
            Err(not_found) => {
                let mut closest = not_found.closest;
                if let Some(extra) = lock(&self.extra).as_ref() {
                    closest.push(self.extra_title(extra));
                }
                Err(ModelError::UnknownCheckpoint { query: query.to_string(), closest })
            }
        }
    }

    fn loaded_name_of(&self, spec: &ModelSpec) -> Option<String> {
        let loaded = read(&self.loaded);
        let info = match &loaded.current {
            Some((s, info)) if s.source == spec.source => Some(info),
            _ => None,
        };
        info.map(|i| i.model.clone())
    }

    fn extra_title(&self, extra: &Extra) -> String {
        if !extra.spec.name.is_empty() {
            return extra.spec.name.clone();
        }
        self.loaded_name_of(&extra.spec).unwrap_or_else(|| file_stem(&extra.spec.source).to_string())
    }

    fn vae_beside(&self, spec: &ModelSpec) -> Option<PathBuf> {
        let catalog = read(&self.catalog);
        let entry = entry_of(&catalog, spec)?;
        catalog.vae_beside(entry).map(|v| v.path.clone())
    }

    /// The A1111 title of `spec`'s checkpoint.
    pub fn title_of(&self, spec: &ModelSpec) -> String {
        let catalog = read(&self.catalog);
        if let Some(entry) = entry_of(&catalog, spec) {
            return entry.title();
        }
        drop(catalog);
        match lock(&self.extra).as_ref() {
            Some(extra) if extra.spec.source == spec.source => self.extra_title(extra),
            _ => spec.name.clone(),
        }
    }

    /// The sha256 of `spec`'s checkpoint, once hashed.
    pub fn sha256_of(&self, spec: &ModelSpec) -> Option<String> {
        let catalog = read(&self.catalog);
        entry_of(&catalog, spec)?.sha256.clone()
    }

    /// The VAE option value a loaded spec stands for.
    pub fn vae_name_of(&self, spec: &ModelSpec) -> Option<String> {
        let path = spec.vae.as_ref()?;
        let catalog = read(&self.catalog);
        Some(
            catalog
                .vaes
                .iter()
                .find(|v| &v.path == path)
                .map(|v| v.name.clone())
                .unwrap_or_else(|| path.display().to_string()),
        )
    }

    /// Every checkpoint: the catalogue's, then the `--model` entry if it is none of them; `worker` is named in
    /// `loaded_on` of the loaded one.
    pub fn list(&self, worker: &str) -> Vec<ListedModel> {
        let loaded = self.current().map(|(spec, _)| spec.source);
        let on = |filename: &str| -> Vec<String> {
            if loaded.as_deref() == Some(filename) {
                vec![worker.to_string()]
            } else {
                vec![]
            }
        };
        let catalog = read(&self.catalog);
        let mut out: Vec<ListedModel> = catalog
            .checkpoints
            .iter()
            .map(|e| ListedModel {
                name: e.name.clone(),
                title: e.title(),
                model_name: e.model_name.clone(),
                hash: e.shorthash().map(str::to_string),
                sha256: e.sha256.clone(),
                filename: e.path.display().to_string(),
                format: e.format.name().to_string(),
                loaded_on: on(&e.path.to_string_lossy()),
            })
            .collect();
        drop(catalog);
        if let Some(extra) = lock(&self.extra).as_ref() {
            let title = self.extra_title(extra);
            out.push(ListedModel {
                name: title.clone(),
                model_name: file_stem(&title).to_string(),
                title,
                hash: None,
                sha256: None,
                filename: extra.spec.source.clone(),
                format: "path".into(),
                loaded_on: on(&extra.spec.source),
            });
        }
        out
    }

    /// Files in the models dirs that are not listed, and why (pickles, unreadable headers).
    pub fn refused(&self) -> Vec<(String, String)> {
        read(&self.catalog).refused.iter().map(|r| (r.path.display().to_string(), r.reason.clone())).collect()
    }

    pub fn list_vaes(&self) -> Vec<ListedVae> {
        read(&self.catalog)
            .vaes
            .iter()
            .map(|v| ListedVae { model_name: v.name.clone(), filename: v.path.display().to_string() })
            .collect()
    }

    /// Rescans the folders; what was loaded or selected stays as it is.
    pub fn refresh(&self) -> Result<(), ModelError> {
        let fresh = scan(&self.config, &self.loadable)?;
        *write(&self.catalog) = fresh;
        Ok(())
    }

    /// Hashes `spec`'s checkpoint file in the background if the catalogue lacks its sha256 (A1111 hashes on
    /// load): jobs and listings go on meanwhile.
    pub fn hash_in_background(self: &Arc<Self>, spec: &ModelSpec) {
        let (library, spec) = (Arc::clone(self), spec.clone());
        let spawned =
            std::thread::Builder::new().name("sdhive-hash".into()).spawn(move || library.hash_loaded(&spec));
        if let Err(e) = spawned {
            tracing::warn!("cannot start the hashing thread: {e}");
        }
    }

    /// Computes the sha256 of `spec`'s checkpoint file if the catalogue lacks it, outside the catalogue's lock
    /// so listings go on meanwhile.
    pub fn hash_loaded(&self, spec: &ModelSpec) {
        let path = Path::new(&spec.source);
        let needed = {
            let catalog = read(&self.catalog);
            catalog.checkpoints.iter().position(|e| e.path == path && e.sha256.is_none() && e.path.is_file())
        };
        let Some(index) = needed else { return };
        // Hashed on a copy: reading gigabytes must not hold the lock that every listing takes.
        let mut copy = read(&self.catalog).clone();
        match copy.ensure_hash(index) {
            Ok(Some(sha)) => write(&self.catalog).record_hash(path, &sha),
            Ok(None) => {}
            Err(e) => tracing::warn!(file = %path.display(), "cannot hash: {e}"),
        }
    }

    // ---- engine-thread side ----

    pub fn record_loaded(&self, spec: &ModelSpec, info: &EngineInfo) {
        let mut loaded = write(&self.loaded);
        loaded.current = Some((spec.clone(), info.clone()));
        loaded.last_info = Some(info.clone());
    }

    pub fn record_unloaded(&self) {
        write(&self.loaded).current = None;
    }

    /// What is loaded now.
    pub fn current(&self) -> Option<(ModelSpec, EngineInfo)> {
        read(&self.loaded).current.clone()
    }

    /// The loaded engine's description, or the last one's after an unload.
    pub fn info(&self) -> Option<EngineInfo> {
        let loaded = read(&self.loaded);
        loaded.current.as_ref().map(|(_, i)| i.clone()).or_else(|| loaded.last_info.clone())
    }
}

/// The catalogue of `config`'s folders, less what the engine here does not load (`loadable`): those are moved to
/// the refused list, so nothing listed fails for its format.
fn scan(
    config: &CatalogConfig,
    (formats, engine): &(Vec<CheckpointFormat>, String),
) -> Result<Catalog, ModelError> {
    let mut catalog = Catalog::scan(config).map_err(|e| ModelError::Catalog(e.to_string()))?;
    catalog.retain_loadable(formats, engine);
    Ok(catalog)
}

/// The catalogue entry a spec was made from (specs carry the canonical path as their source).
fn entry_of<'c>(catalog: &'c Catalog, spec: &ModelSpec) -> Option<&'c Checkpoint> {
    catalog.checkpoints.iter().find(|e| e.path.to_string_lossy() == spec.source)
}

fn spec_of(entry: &Checkpoint) -> ModelSpec {
    ModelSpec::new(entry.model_name.clone(), entry.path.to_string_lossy())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vae_choices_round_trip() {
        for v in ["Automatic", "None", "x.safetensors"] {
            assert_eq!(VaeChoice::parse(v).as_option(), v);
        }
        assert_eq!(VaeChoice::parse(""), VaeChoice::Automatic);
    }

    #[test]
    fn gguf_checkpoints_are_listed_only_for_an_engine_that_loads_them() {
        let dir = tempfile::tempdir().unwrap();
        sdhive_catalog::gguf::write_sd_for_tests(&dir.path().join("xl-q8_0.gguf"), "sdxl", 4).unwrap();
        let config = CatalogConfig { models_dirs: vec![dir.path().into()], ..Default::default() };
        let all = [CheckpointFormat::Diffusers, CheckpointFormat::SafeTensors, CheckpointFormat::Gguf];
        let sdcpp = ModelLibrary::scan_loading(config.clone(), &all, "stable-diffusion.cpp").unwrap();
        let spec = sdcpp.find("xl-q8_0").unwrap();
        assert!(spec.source.ends_with("xl-q8_0.gguf"), "{spec:?}");
        assert_eq!(sdcpp.list("w")[0].format, "gguf");
        assert!(sdcpp.refused().is_empty());

        let candle = ModelLibrary::scan(config).unwrap();
        assert!(candle.list("w").is_empty());
        assert!(matches!(candle.find("xl-q8_0"), Err(ModelError::UnknownCheckpoint { .. })));
        let refused = candle.refused();
        assert!(
            refused[0].0.ends_with("xl-q8_0.gguf") && refused[0].1.contains("stable-diffusion.cpp"),
            "{refused:?}"
        );
        // A rescan keeps to the engine's formats.
        sdcpp.refresh().unwrap();
        assert_eq!(sdcpp.list("w").len(), 1);
    }
}
