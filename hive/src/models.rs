//! The hive's view of the models: its own scan of the models dirs (the same catalogue every worker it starts
//! scans), the models workers report that are no catalogue entry, which worker holds which model loaded, the
//! hive's selected model (A1111's `sd_model_checkpoint` for requests that name none), and turning a client's
//! model name into the one string every worker understands — a checkpoint's canonical path, or the `--model`
//! argument of a model outside the library — with A1111's matching, so an unknown name is refused before it
//! is queued.

use crate::config::HiveConfig;
use crate::registry::WorkerStatus;
use crate::State;
use sdhive_catalog::{Catalog, CatalogConfig, CatalogError, Checkpoint, NotFound};
use sdhive_protocol::{file_stem, is_openai_model_name, ListedModel};

/// What the hive scans: the workers' models and VAE dirs, with the hash cache they share.
pub fn catalog_config(config: &HiveConfig) -> CatalogConfig {
    CatalogConfig {
        models_dirs: config.models_dirs.clone(),
        vae_dirs: config.vae_dirs.clone(),
        hash_cache: sdhive_catalog::default_hash_cache(),
    }
}

/// Scans the library (blocking: folder listings and file headers). Nothing configured: an empty catalogue.
pub fn scan(config: &HiveConfig) -> Result<Catalog, CatalogError> {
    if config.models_dirs.is_empty() && config.vae_dirs.is_empty() {
        return Ok(Catalog::default());
    }
    let mut catalog = Catalog::scan(&catalog_config(config))?;
    // The workers refuse GGUF files (no engine loads them through the library yet): so does the hive.
    catalog.checkpoints.retain(|c| c.format != sdhive_catalog::CheckpointFormat::Gguf);
    Ok(catalog)
}

fn path_string(c: &Checkpoint) -> String {
    c.path.to_string_lossy().into_owned()
}

/// The `model_source` a worker started with `--model arg` reports, found as the worker finds it: an existing
/// path that is a library checkpoint is that checkpoint; a library name that is no path is its checkpoint;
/// anything else stays the argument (a path outside the library, a hub repo id).
pub fn planned_source(catalog: &Catalog, arg: &str) -> String {
    catalog.entry_for_arg(arg).map(path_string).unwrap_or_else(|| arg.to_string())
}

/// Whether `query` names the model known as `alias` outside the catalogue, as the workers match their
/// `--model` argument: the same string (any case), or the same file stem.
pub fn same_model_name(alias: &str, query: &str) -> bool {
    let (a, q) = (alias.trim(), query.trim());
    !a.is_empty() && (a == q || a.eq_ignore_ascii_case(q) || file_stem(a) == file_stem(q))
}

/// A model that no catalogue entry stands for: a worker's `--model` outside the library (or an external
/// worker's model), known by the source string the worker reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Extra {
    pub source: String,
    /// The engine's name for it once a worker loaded it, else the source's stem.
    pub title: String,
    aliases: Vec<String>,
}

/// Every model workers hold or were started with that the catalogue lacks, once each.
pub fn extras(state: &State) -> Vec<Extra> {
    let mut out: Vec<Extra> = Vec::new();
    for w in state.workers.values().filter(|w| !matches!(w.status, WorkerStatus::Failed)) {
        let reg = w.registration.as_ref();
        let reported = reg.and_then(|r| r.model_source.as_deref());
        for source in [w.loaded.as_deref(), reported, w.planned_source.as_deref()].into_iter().flatten() {
            if in_catalog(&state.catalog, source) {
                continue;
            }
            // The engine's name belongs to the model it registered with.
            let name = reg
                .filter(|r| r.model_source.as_deref().is_none_or(|s| s == source))
                .map(|r| r.model.clone())
                .filter(|n| !n.is_empty());
            let mut aliases = vec![source.to_string(), file_stem(source).to_string()];
            aliases.extend(name.clone());
            if w.planned_source.as_deref() == Some(source) {
                aliases.extend(w.planned_model.clone());
            }
            match out.iter_mut().find(|e| e.source == source) {
                Some(e) => {
                    for a in aliases {
                        if !e.aliases.contains(&a) {
                            e.aliases.push(a);
                        }
                    }
                    if let Some(n) = name {
                        e.title = n;
                    }
                }
                None => out.push(Extra {
                    source: source.to_string(),
                    title: name.unwrap_or_else(|| file_stem(source).to_string()),
                    aliases,
                }),
            }
        }
    }
    out
}

pub fn in_catalog(catalog: &Catalog, source: &str) -> bool {
    catalog.checkpoints.iter().any(|c| c.path.as_os_str() == source)
}

/// A client's model name resolved: the source to route by and forward, or `None` for "whatever the workers
/// have" (no model named, and no selected model any worker can run).
pub type Resolved = Option<String>;

/// Resolves `query` (a request's model field, `None` when it names none) as the workers would: OpenAI's names
/// and no name mean the selected model; otherwise A1111's matching over the catalogue, then the models outside
/// it by source, name or stem. Unknown: `NotFound` with the closest titles.
pub fn resolve(state: &State, query: Option<&str>) -> Result<Resolved, NotFound> {
    let query = query.map(str::trim).filter(|q| !q.is_empty());
    let Some(q) = query.filter(|q| !is_openai_model_name(q)) else {
        return Ok(default_model(state));
    };
    if let Ok(c) = state.catalog.find(q) {
        return Ok(Some(path_string(c)));
    }
    let extras = extras(state);
    let hit = extras.iter().find(|e| e.aliases.iter().any(|a| same_model_name(a, q)));
    if let Some(e) = hit {
        return Ok(Some(e.source.clone()));
    }
    let mut closest = state.catalog.closest_titles(q, 3);
    for e in &extras {
        if closest.len() < 3 && !closest.contains(&e.title) {
            closest.push(e.title.clone());
        }
    }
    Err(NotFound { query: q.to_string(), closest })
}

/// The model requests that name none run with: the selected one while some worker can run it.
pub fn default_model(state: &State) -> Resolved {
    state.selected.clone().filter(|m| servable(state, m))
}

/// Whether a worker that is up, or on its way up, could run requests for `source`.
pub fn servable(state: &State, source: &str) -> bool {
    let in_catalog = in_catalog(&state.catalog, source);
    state.workers.values().any(|w| crate::router::may_serve(w) && w.can_load(source, in_catalog))
}

/// The model the hive selects at start: the first configured model, else the catalogue's first checkpoint
/// (what a worker started without `--model` loads).
pub fn initial_selection(config: &HiveConfig, catalog: &Catalog) -> Option<String> {
    match config.models.first() {
        Some(m) => Some(planned_source(catalog, m)),
        None => catalog.checkpoints.first().map(path_string),
    }
}

/// A1111's title for `source`: the catalogue's, else the name a worker reported for it.
pub fn title_of(state: &State, source: &str) -> String {
    if let Some(c) = state.catalog.checkpoints.iter().find(|c| c.path.as_os_str() == source) {
        return c.title();
    }
    extras(state)
        .into_iter()
        .find(|e| e.source == source)
        .map(|e| e.title)
        .unwrap_or_else(|| file_stem(source).into())
}

/// Workers that hold `source` loaded (or will have, once what the hive sent them ran), by id.
fn loaded_on(state: &State, source: &str) -> Vec<String> {
    state
        .workers
        .values()
        .filter(|w| {
            w.registration.is_some() && !matches!(w.status, WorkerStatus::Failed | WorkerStatus::Stopped)
        })
        .filter(|w| w.loaded.as_deref() == Some(source))
        .map(|w| w.id.clone())
        .collect()
}

pub fn list(state: &State) -> Vec<ListedModel> {
    let mut out: Vec<ListedModel> = state
        .catalog
        .checkpoints
        .iter()
        .map(|c| ListedModel {
            name: c.name.clone(),
            title: c.title(),
            model_name: c.model_name.clone(),
            hash: c.shorthash().map(String::from),
            sha256: c.sha256.clone(),
            filename: path_string(c),
            format: c.format.name().into(),
            loaded_on: loaded_on(state, &path_string(c)),
        })
        .collect();
    for e in extras(state) {
        out.push(ListedModel {
            name: e.title.clone(),
            model_name: file_stem(&e.title).to_string(),
            title: e.title,
            hash: None,
            sha256: None,
            loaded_on: loaded_on(state, &e.source),
            filename: e.source,
            format: "path".into(),
        });
    }
    out
}

/// One line about the models for `hive devices` and the start-up log; `warn` for a model that cannot be
/// served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub warn: bool,
    pub text: String,
}

/// What `hive devices` and the start-up log say about the configured models: which worker preloads which,
/// and what becomes of the models no worker preloads — loaded on demand when the library holds them, refused
/// (with the remedy) when it does not.
pub fn preload_notes(plan: &crate::plan::Plan, catalog: &Catalog) -> Vec<Note> {
    let mut notes = Vec::new();
    let info = |text: String| Note { warn: false, text };
    for w in &plan.workers {
        notes.push(info(match &w.model {
            Some(m) => format!("worker {} preloads {m}", w.worker_id),
            None => match catalog.checkpoints.first() {
                Some(c) => format!(
                    "worker {} preloads {} (the models dirs' first checkpoint)",
                    w.worker_id,
                    c.title()
                ),
                None => format!(
                    "worker {} starts without a model (the models dirs hold no checkpoint)",
                    w.worker_id
                ),
            },
        }));
    }
    if plan.workers.is_empty() {
        return notes;
    }
    for m in &plan.on_demand {
        if in_catalog(catalog, &planned_source(catalog, m)) {
            notes.push(info(format!(
                "model {m}: no worker preloads it (more models than workers); loaded on demand"
            )));
        } else {
            notes.push(Note {
                warn: true,
                text: format!(
                    "model {m}: NOT SERVED: no worker preloads it (more models than workers) and it lies outside \
                     every models dir, so no worker can load it on demand; add its folder with --models-dir"
                ),
            });
        }
    }
    if !catalog.checkpoints.is_empty() {
        notes.push(info(format!(
            "every checkpoint of the models dirs ({} listed) loads on demand on an idle worker",
            catalog.checkpoints.len()
        )));
    }
    notes
}

/// An unknown-model answer's message, as the workers word it.
pub fn not_found_message(e: &NotFound) -> String {
    if e.closest.is_empty() {
        format!("no model `{}`", e.query)
    } else {
        format!("no model `{}`; closest: {}", e.query, e.closest.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::tests::request;
    use crate::registry::WorkerEntry;
    use std::time::Instant;

    fn library() -> (tempfile::TempDir, Catalog) {
        let dir = tempfile::tempdir().unwrap();
        let models = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models");
        std::fs::copy(models.join("sd1.safetensors"), dir.path().join("sd1.safetensors")).unwrap();
        std::fs::copy(models.join("sdxl.safetensors"), dir.path().join("sdxl-base.safetensors")).unwrap();
        let config = HiveConfig { models_dirs: vec![dir.path().into()], ..Default::default() };
        let catalog = Catalog::scan(&CatalogConfig { hash_cache: None, ..catalog_config(&config) }).unwrap();
        (dir, catalog)
    }

    #[test]
    fn names_resolve_as_a1111_and_unknown_ones_name_the_closest() {
        let (dir, catalog) = library();
        let sd1 = std::fs::canonicalize(dir.path().join("sd1.safetensors")).unwrap().display().to_string();
        let mut state = State { catalog, ..Default::default() };
        for q in ["sd1", "sd1.safetensors", sd1.as_str(), "SD1"] {
            assert_eq!(resolve(&state, Some(q)), Ok(Some(sd1.clone())), "{q}");
        }
        assert_eq!(resolve(&state, Some("sdxl")), resolve(&state, Some("sdxl-base.safetensors")));
        // No name and OpenAI's names mean the selected model, when some worker can run it.
        assert_eq!(resolve(&state, None), Ok(None));
        state.selected = Some(sd1.clone());
        assert_eq!(resolve(&state, Some("dall-e-3")), Ok(None), "no worker yet");
        let mut w = WorkerEntry::managed("w1", "cpu", 0, None);
        w.status = WorkerStatus::Starting;
        state.workers.insert("w1".into(), w);
        assert_eq!(resolve(&state, Some("dall-e-3")), Ok(Some(sd1.clone())));
        let e = resolve(&state, Some("sd-1")).unwrap_err();
        assert_eq!(e.closest.first().map(String::as_str), Some("sd1.safetensors"), "{e:?}");
        assert!(not_found_message(&e).contains("closest: sd1.safetensors"), "{}", not_found_message(&e));
    }

    #[test]
    fn models_outside_the_library_are_known_by_what_workers_report() {
        let (_dir, catalog) = library();
        let mut state = State { catalog, ..Default::default() };
        let mut req = request("ext", "http://h:1", 1);
        req.model = "my-model".into();
        req.model_source = Some("/elsewhere/my-model.safetensors".into());
        req.switchable = true;
        state.register(req, Instant::now()).unwrap();
        for q in ["my-model", "/elsewhere/my-model.safetensors", "my-model.safetensors"] {
            assert_eq!(resolve(&state, Some(q)), Ok(Some("/elsewhere/my-model.safetensors".into())), "{q}");
        }
        let listed = list(&state);
        assert_eq!(listed.len(), 3, "{listed:?}");
        let extra = listed.iter().find(|m| m.format == "path").unwrap();
        assert_eq!(
            (extra.title.as_str(), extra.loaded_on.as_slice()),
            ("my-model", &["ext".to_string()][..])
        );
        // An external worker only runs what it has: not the catalogue's models.
        let w = &state.workers["ext"];
        assert!(w.can_load("/elsewhere/my-model.safetensors", false));
        assert!(!w.can_load(&listed[0].filename, true));
    }

    #[test]
    fn configured_models_map_to_the_catalogue_like_the_workers_do() {
        let (dir, catalog) = library();
        let sd1 = std::fs::canonicalize(dir.path().join("sd1.safetensors")).unwrap().display().to_string();
        let relative = dir.path().join(".").join("sd1.safetensors").display().to_string();
        assert_eq!(planned_source(&catalog, &relative), sd1);
        assert_eq!(planned_source(&catalog, "sd1"), sd1, "a library name");
        assert_eq!(planned_source(&catalog, "org/repo"), "org/repo");
        let config = HiveConfig {
            models: vec![sd1.clone(), "sdxl".into(), "/nowhere/x.safetensors".into()],
            backend: Some("cpu".into()),
            workers_dir: Some("/w".into()),
            ..Default::default()
        };
        let devices = vec![crate::detect::Device {
            backend: shared_worker::Backend::Cpu,
            index: 0,
            vendor: crate::detect::Vendor::Other,
            name: "cpu".into(),
            memory_total_bytes: None,
            memory_free_bytes: None,
            driver: None,
            software: false,
        }];
        let plan = crate::plan::plan(&devices, &config, |_| true);
        let notes: Vec<String> = preload_notes(&plan, &catalog).into_iter().map(|n| n.text).collect();
        let notes = notes.join("\n");
        assert!(notes.contains(&format!("preloads {sd1}")), "{notes}");
        assert!(
            notes.contains("model sdxl: no worker preloads it (more models than workers); loaded on demand"),
            "{notes}"
        );
        assert!(notes.contains("model /nowhere/x.safetensors: NOT SERVED"), "{notes}");
    }
}
