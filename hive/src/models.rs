//! The hive's view of the models: its own scan of the models dirs (the same catalogue every worker it starts
//! scans), the models workers report that are no catalogue entry (their loaded model, and the libraries
//! external workers report), which worker holds which model loaded and which could load it, the
//! hive's selected model (A1111's `sd_model_checkpoint` for requests that name none), and turning a client's
//! model name into the one string every worker understands — a checkpoint's canonical path, or the `--model`
//! argument of a model outside the library — with A1111's matching, so an unknown name is refused before it
//! is queued.

use crate::config::HiveConfig;
use crate::registry::WorkerStatus;
use crate::State;
use sdhive_catalog::{Catalog, CatalogConfig, CatalogError, Checkpoint, NotFound};
use sdhive_protocol::{file_stem, is_openai_model_name, LibraryModel, ListedModel};

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
    // GGUF checkpoints stay listed: the stable-diffusion.cpp workers load them (`backend_loads` routes them).
    Catalog::scan(&catalog_config(config))
}

/// Whether a worker of `backend` loads the checkpoint `source` (a canonical path): a GGUF file only on the
/// stable-diffusion.cpp engine, as that worker's own library says (`EngineKind::loads_gguf`).
pub fn backend_loads(backend: &str, source: &str) -> bool {
    let gguf = std::path::Path::new(source).extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    !gguf || backend.parse::<shared_worker::Backend>().is_ok_and(|b| b.engine().loads_gguf())
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

/// A model that no catalogue entry stands for: a worker's `--model` outside the library, or a model of an
/// external worker's library, known by the source string the worker reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Extra {
    pub source: String,
    /// The engine's name for it once a worker loaded it, else its library title, else the source's stem.
    pub title: String,
    aliases: Vec<String>,
    /// How the worker's library lists it, when it does.
    listed: Option<LibraryModel>,
}

/// Every model workers hold, were started with or can load that the catalogue lacks, once each.
pub fn extras(state: &State) -> Vec<Extra> {
    let mut out: Vec<Extra> = Vec::new();
    let live =
        state.workers.values().filter(|w| !matches!(w.status, WorkerStatus::Failed | WorkerStatus::Stopped));
    for m in live.flat_map(|w| &w.library).filter(|m| !in_catalog(&state.catalog, &m.filename)) {
        if out.iter().any(|e| e.source == m.filename) {
            continue;
        }
        let mut aliases = vec![m.filename.clone(), file_stem(&m.filename).to_string()];
        aliases.extend([&m.name, &m.model_name, &m.title].into_iter().cloned());
        aliases.extend(m.hash.iter().chain(&m.sha256).cloned());
        out.push(Extra {
            source: m.filename.clone(),
            title: m.title.clone(),
            aliases,
            listed: Some(m.clone()),
        });
    }
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
                    // A library's title is A1111's; the engine's name only stands in where there is none.
                    if let Some(n) = name.filter(|_| e.listed.is_none()) {
                        e.title = n;
                    }
                }
                None => out.push(Extra {
                    source: source.to_string(),
                    title: name.unwrap_or_else(|| file_stem(source).to_string()),
                    aliases,
                    listed: None,
                }),
            }
        }
    }
    out
}

/// Whether `query` is one of A1111's names for `c` (any case, a trailing ` [hash]` ignored), not merely part
/// of its title.
fn names_exactly(c: &Checkpoint, query: &str) -> bool {
    let bare = query.trim_end().strip_suffix(']').and_then(|b| b.rsplit_once(" [")).map(|(n, _)| n);
    let path = path_string(c);
    let mut names = vec![c.name.as_str(), c.model_name.as_str(), c.name_for_extra(), path.as_str()];
    names.extend(c.sha256.as_deref());
    names.extend(c.shorthash());
    let title = c.title();
    names.push(&title);
    [Some(query), bare].into_iter().flatten().any(|q| names.iter().any(|n| n.eq_ignore_ascii_case(q.trim())))
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
    // A catalogue entry the name matches exactly, else a model outside the catalogue it names, else the
    // catalogue's looser matches (the shortest title containing it): an external worker's `b` is not lost to
    // the catalogue's `sdxl-base`.
    let found = state.catalog.find(q).ok();
    if let Some(c) = found.filter(|c| names_exactly(c, q)) {
        return Ok(Some(path_string(c)));
    }
    let extras = extras(state);
    let hit = extras.iter().find(|e| e.aliases.iter().any(|a| same_model_name(a, q)));
    if let Some(e) = hit {
        return Ok(Some(e.source.clone()));
    }
    if let Some(c) = found {
        return Ok(Some(path_string(c)));
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
        .filter(|w| w.holds(source))
        .map(|w| w.id.clone())
        .collect()
}

/// Workers that could run requests for `source` (up, or on their way up), by id.
fn available_on(state: &State, source: &str) -> Vec<String> {
    let in_catalog = in_catalog(&state.catalog, source);
    state
        .workers
        .values()
        .filter(|w| crate::router::may_serve(w) && w.can_load(source, in_catalog))
        .map(|w| w.id.clone())
        .collect()
}

/// One model as the hive lists it: the worker's entry, and where it can run.
#[derive(Debug, Clone, PartialEq)]
pub struct Listed {
    pub model: ListedModel,
    /// Workers that could load it: its requests go to one of them.
    pub available_on: Vec<String>,
}

impl Listed {
    pub fn a1111(&self) -> serde_json::Value {
        let mut v = self.model.a1111();
        v["available_on"] = serde_json::json!(self.available_on);
        v
    }

    pub fn openai(&self) -> serde_json::Value {
        let mut v = self.model.openai(0);
        v["available_on"] = serde_json::json!(self.available_on);
        v
    }
}

pub fn list(state: &State) -> Vec<Listed> {
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
        let loaded_on = loaded_on(state, &e.source);
        out.push(match e.listed {
            Some(m) => ListedModel {
                name: m.name,
                title: m.title,
                model_name: m.model_name,
                hash: m.hash,
                sha256: m.sha256,
                filename: m.filename,
                format: m.format,
                loaded_on,
            },
            None => ListedModel {
                name: e.title.clone(),
                model_name: file_stem(&e.title).to_string(),
                title: e.title,
                hash: None,
                sha256: None,
                loaded_on,
                filename: e.source,
                format: "path".into(),
            },
        });
    }
    out.into_iter()
        .map(|model| Listed { available_on: available_on(state, &model.filename), model })
        .collect()
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

/// The catalogue of `config`'s models dirs without a hash cache, and its checkpoints' sources (the paths a
/// worker reports): the library the routing tests put their workers on.
#[cfg(test)]
pub(crate) fn scan_for_tests(config: &HiveConfig) -> (sdhive_catalog::Catalog, Vec<String>) {
    let catalog = sdhive_catalog::Catalog::scan(&sdhive_catalog::CatalogConfig {
        hash_cache: None,
        ..catalog_config(config)
    })
    .expect("the test library scans");
    let sources = catalog.checkpoints.iter().map(|c| c.path.to_string_lossy().into_owned()).collect();
    (catalog, sources)
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
        let listed: Vec<ListedModel> = list(&state).into_iter().map(|l| l.model).collect();
        assert_eq!(listed.len(), 3, "{listed:?}");
        let extra = listed.iter().find(|m| m.format == "path").unwrap();
        assert_eq!(
            (extra.title.as_str(), extra.loaded_on.as_slice()),
            ("my-model", &["ext".to_string()][..])
        );
        // A worker that reports no library only runs what it has: not the catalogue's models.
        let w = &state.workers["ext"];
        assert!(w.can_load("/elsewhere/my-model.safetensors", false));
        assert!(!w.can_load(&listed[0].filename, true));
    }

    fn library_entry(path: &str, title: &str, sha: Option<&str>) -> LibraryModel {
        LibraryModel {
            filename: path.into(),
            name: file_stem(path).to_string() + ".safetensors",
            title: title.into(),
            model_name: file_stem(path).into(),
            hash: sha.map(|s| s[..10].to_string()),
            sha256: sha.map(String::from),
            format: "safetensors".into(),
        }
    }

    #[test]
    fn an_external_workers_library_is_listed_resolved_and_routed_to() {
        let (_dir, catalog) = library();
        let mut state = State { catalog, ..Default::default() };
        let sha = "abcdef0123".repeat(6) + "abcd";
        let (a, b) = ("/remote/a.safetensors", "/remote/b.safetensors");
        let mut req = request("ext", "http://h:1", 1);
        req.model_source = Some(a.into());
        req.switchable = true;
        req.library = Some(vec![
            library_entry(a, "a.safetensors [1111111111]", None),
            library_entry(b, "b.safetensors [abcdef0123]", Some(&sha)),
        ]);
        state.register(req, Instant::now()).unwrap();
        // By A1111's names for it, its hashes and its path.
        for q in ["b", "b.safetensors", "b.safetensors [abcdef0123]", "abcdef0123", sha.as_str(), b] {
            assert_eq!(resolve(&state, Some(q)), Ok(Some(b.into())), "{q}");
        }
        assert!(state.workers["ext"].can_load(b, false), "any model of its library");
        assert!(servable(&state, b));
        let listed = list(&state);
        let entry = listed.iter().find(|l| l.model.filename == b).unwrap();
        assert_eq!(entry.model.title, "b.safetensors [abcdef0123]", "the library's title");
        assert_eq!(entry.model.sha256.as_deref(), Some(sha.as_str()));
        assert!(entry.model.loaded_on.is_empty());
        assert_eq!(entry.available_on, ["ext"]);
        assert_eq!(entry.a1111()["available_on"], serde_json::json!(["ext"]));
        assert_eq!(entry.openai()["id"], "b.safetensors");
        let loaded = listed.iter().find(|l| l.model.filename == a).unwrap();
        assert_eq!(loaded.model.loaded_on, ["ext"]);
        assert_eq!(loaded.model.title, "a.safetensors [1111111111]", "not replaced by the engine's name");
        // The catalogue's models are not the external worker's to run.
        let own = listed
            .iter()
            .find(|l| l.model.format != "safetensors" || l.model.filename.ends_with("sd1.safetensors"));
        assert!(own.is_some_and(|l| l.available_on.is_empty()), "{listed:?}");

        // A changed library arrives with a heartbeat.
        let hb: sdhive_protocol::Heartbeat = serde_json::from_value(serde_json::json!({
            "worker_id": "ext", "state": "idle", "queue_depth": 0, "running_job": null,
            "memory_total_bytes": null, "memory_free_bytes": null, "jobs_succeeded": 0, "jobs_failed": 0,
            "jobs_cancelled": 0, "uptime_secs": 1.0, "model_source": a,
            "library": [library_entry("/remote/c.safetensors", "c.safetensors", None)],
        }))
        .unwrap();
        assert!(state.heartbeat("ext", hb, Instant::now()));
        assert_eq!(resolve(&state, Some("c")), Ok(Some("/remote/c.safetensors".into())));
        assert!(resolve(&state, Some(b)).is_err(), "gone from its library");
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
            arch: None,
        }];
        let plan = crate::plan::plan(&devices, &config, |_: &std::path::Path| true);
        let notes: Vec<String> = preload_notes(&plan, &catalog).into_iter().map(|n| n.text).collect();
        let notes = notes.join("\n");
        assert!(notes.contains(&format!("preloads {sd1}")), "{notes}");
        assert!(
            notes.contains("model sdxl: no worker preloads it (more models than workers); loaded on demand"),
            "{notes}"
        );
        assert!(notes.contains("model /nowhere/x.safetensors: NOT SERVED"), "{notes}");
    }

    #[test]
    fn gguf_checkpoints_go_only_to_stable_diffusion_cpp_workers() {
        assert!(backend_loads("vulkan", "/m/x.gguf") && backend_loads("rocm", "/m/x.GGUF"));
        assert!(!backend_loads("cpu", "/m/x.gguf") && !backend_loads("cuda", "/m/x.gguf"));
        assert!(backend_loads("cpu", "/m/x.safetensors") && backend_loads("cpu", "/m/sd15"));
        let cpu = WorkerEntry::managed("c", "cpu", 0, None);
        let vulkan = WorkerEntry::managed("v", "vulkan", 0, None);
        assert!(!cpu.can_load("/m/x.gguf", true) && vulkan.can_load("/m/x.gguf", true));
        assert!(cpu.can_load("/m/x.safetensors", true));
    }
}
