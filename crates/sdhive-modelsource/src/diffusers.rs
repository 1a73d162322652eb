//! The diffusers folder layout: which components `model_index.json` declares, which files each needs (config,
//! tokenizer files, `.safetensors` weights — plain, sharded or the fp16 variant), whether a folder holds them
//! all, and which files to fetch from a repo listing. Shared by local folders and hub snapshots so that both
//! mean the same thing by "complete".

use crate::SourceError;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Components a pipeline declares that image generation never uses: fetching the safety checker alone would
/// cost ~1.2 GB for SD 1.x.
const UNUSED_COMPONENTS: [&str; 3] = ["safety_checker", "feature_extractor", "image_encoder"];

/// Weight file stems diffusers (`diffusion_pytorch_model`) and transformers (`model`) save under.
const WEIGHT_STEMS: [&str; 2] = ["diffusion_pytorch_model", "model"];

const TOKENIZER_EXTRAS: [&str; 3] = ["tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComponentKind {
    /// Needs `scheduler_config.json`.
    Scheduler,
    /// Needs `vocab.json` + `merges.txt` (CLIP BPE) or a `tokenizer.json`.
    Tokenizer,
    /// A network: needs `config.json` and `.safetensors` weights.
    Model,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Component {
    /// Also the component's folder name.
    pub name: String,
    pub library: String,
    pub class: String,
    pub kind: ComponentKind,
}

/// The parts of `model_index.json` that decide what a complete folder holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelIndex {
    /// `_class_name`, e.g. `StableDiffusionXLPipeline`.
    pub class_name: Option<String>,
    /// The components generation needs, in file order.
    pub components: Vec<Component>,
}

/// The weights file(s) of one component, in the order diffusers prefers them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightsFiles {
    /// One file, or every shard named by a `*.safetensors.index*.json` (the index itself is not included).
    pub files: Vec<PathBuf>,
    /// The `fp16` variant was used because no full-precision weights were present.
    pub fp16_variant: bool,
}

impl ModelIndex {
    pub fn parse(bytes: &[u8]) -> Result<ModelIndex, String> {
        let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        let obj = value.as_object().ok_or("expected a JSON object")?;
        let class_name = obj.get("_class_name").and_then(|v| v.as_str()).map(str::to_string);
        let mut components = Vec::new();
        for (name, entry) in obj {
            if name.starts_with('_') || UNUSED_COMPONENTS.contains(&name.as_str()) {
                continue;
            }
            // Non-array keys are pipeline flags (`requires_safety_checker`); `[null, null]` is an absent component.
            let Some([library, class]) = entry.as_array().map(Vec::as_slice) else { continue };
            let (Some(library), Some(class)) = (library.as_str(), class.as_str()) else { continue };
            // The name becomes a folder name under the model directory, so it must not be able to leave it.
            if !is_plain_name(name) {
                return Err(format!("component name {name:?} is not a plain folder name"));
            }
            components.push(Component {
                name: name.clone(),
                library: library.to_string(),
                class: class.to_string(),
                kind: kind_of(name, class),
            });
        }
        if components.is_empty() {
            return Err("it declares no components".into());
        }
        Ok(ModelIndex { class_name, components })
    }

    /// Reads `dir/model_index.json`.
    pub fn read(dir: &Path) -> Result<ModelIndex, SourceError> {
        ModelIndex::read_file(&dir.join("model_index.json"))
    }

    pub fn read_file(path: &Path) -> Result<ModelIndex, SourceError> {
        let bytes = std::fs::read(path).map_err(|e| SourceError::io(path, e))?;
        ModelIndex::parse(&bytes)
            .map_err(|reason| SourceError::InvalidModelIndex { path: path.to_path_buf(), reason })
    }
}

fn kind_of(name: &str, class: &str) -> ComponentKind {
    if class.ends_with("Scheduler") || name.starts_with("scheduler") {
        ComponentKind::Scheduler
    } else if class.contains("Tokenizer") || name.starts_with("tokenizer") {
        ComponentKind::Tokenizer
    } else {
        ComponentKind::Model
    }
}

/// One path segment of letters, digits, `_`, `-`, `.`, not hidden and not `..`.
fn is_plain_name(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with('.')
        && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// How a component's weights are stored, chosen from its file names alone.
#[derive(Debug, Clone, PartialEq, Eq)]
enum WeightsChoice {
    Single(String),
    Sharded { index: String },
}

/// Full precision first (single file, then sharded), the fp16 variant only when that is all there is.
fn choose_weights(names: &BTreeSet<String>) -> Option<(WeightsChoice, bool)> {
    for fp16 in [false, true] {
        for stem in WEIGHT_STEMS {
            let (single, index) = if fp16 {
                (format!("{stem}.fp16.safetensors"), format!("{stem}.safetensors.index.fp16.json"))
            } else {
                (format!("{stem}.safetensors"), format!("{stem}.safetensors.index.json"))
            };
            if names.contains(&single) {
                return Some((WeightsChoice::Single(single), fp16));
            }
            if names.contains(&index) {
                return Some((WeightsChoice::Sharded { index }, fp16));
            }
        }
    }
    None
}

pub(crate) fn is_shard_index(file: &str) -> bool {
    file.contains(".safetensors.index") && file.ends_with(".json")
}

/// The distinct shard file names an index's `weight_map` points at, refusing any that is not a plain file name.
pub(crate) fn shard_names(index_path: &Path) -> Result<Vec<String>, SourceError> {
    let bad = |reason: String| SourceError::InvalidSafetensors { path: index_path.to_path_buf(), reason };
    let bytes = std::fs::read(index_path).map_err(|e| SourceError::io(index_path, e))?;
    let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
    let map =
        value.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| bad("no `weight_map`".into()))?;
    let mut shards = BTreeSet::new();
    for file in map.values() {
        let file = file.as_str().ok_or_else(|| bad("a `weight_map` value is not a string".into()))?;
        if !is_plain_name(file) || !file.ends_with(".safetensors") {
            return Err(bad(format!("shard {file:?} is not a plain .safetensors file name")));
        }
        shards.insert(file.to_string());
    }
    if shards.is_empty() {
        return Err(bad("`weight_map` is empty".into()));
    }
    Ok(shards.into_iter().collect())
}

fn list_dir(dir: &Path) -> BTreeSet<String> {
    let Ok(entries) = std::fs::read_dir(dir) else { return BTreeSet::new() };
    entries
        .flatten()
        // is_file follows symlinks, which is how hub snapshots point at their blobs; dangling ones drop out.
        .filter(|e| e.path().is_file())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect()
}

/// Names of weights formats we deliberately do not load, to explain why a folder has "no weights".
fn unsupported_weights(names: &BTreeSet<String>) -> Vec<&str> {
    names
        .iter()
        .filter(|n| {
            [".bin", ".ckpt", ".pt", ".pth", ".msgpack", ".onnx", ".pb"].iter().any(|ext| n.ends_with(ext))
        })
        .map(String::as_str)
        .collect()
}

fn missing_weights_message(component: &str, names: &BTreeSet<String>) -> String {
    let others = unsupported_weights(names);
    if others.is_empty() {
        format!("{component}/diffusion_pytorch_model.safetensors (or model.safetensors)")
    } else {
        format!(
            "{component}/ has no .safetensors weights (found {}; only .safetensors is supported)",
            others.join(", ")
        )
    }
}

/// The `.safetensors` weights diffusers would load from `component_dir`, or `None` when there are none (or a
/// shard named by the index is missing). Engines use this to load a component from a resolved folder.
pub fn find_weights(component_dir: &Path) -> Option<WeightsFiles> {
    find_weights_explained(component_dir, "").ok()
}

fn find_weights_explained(dir: &Path, label: &str) -> Result<WeightsFiles, String> {
    let names = list_dir(dir);
    let (choice, fp16_variant) =
        choose_weights(&names).ok_or_else(|| missing_weights_message(label, &names))?;
    let files = match choice {
        WeightsChoice::Single(file) => vec![dir.join(file)],
        WeightsChoice::Sharded { index } => {
            let shards = shard_names(&dir.join(&index)).map_err(|e| format!("{label}/{index}: {e}"))?;
            let missing: Vec<String> = shards.iter().filter(|s| !names.contains(*s)).cloned().collect();
            if !missing.is_empty() {
                return Err(format!("{label}/{} (listed in {index})", missing.join(", ")));
            }
            shards.into_iter().map(|s| dir.join(s)).collect()
        }
    };
    Ok(WeightsFiles { files, fp16_variant })
}

/// Checks that `dir` holds everything `model_index.json` needs; the error lists every missing file.
pub(crate) fn check_complete(dir: &Path) -> Result<ModelIndex, SourceError> {
    let index = ModelIndex::read(dir)?;
    let mut missing = Vec::new();
    for c in &index.components {
        let cdir = dir.join(&c.name);
        let names = list_dir(&cdir);
        let need = |file: &str, missing: &mut Vec<String>| {
            if !names.contains(file) {
                missing.push(format!("{}/{file}", c.name));
            }
        };
        match c.kind {
            ComponentKind::Scheduler => need("scheduler_config.json", &mut missing),
            ComponentKind::Tokenizer => {
                if !names.contains("tokenizer.json") {
                    need("vocab.json", &mut missing);
                    need("merges.txt", &mut missing);
                }
            }
            ComponentKind::Model => {
                need("config.json", &mut missing);
                if let Err(m) = find_weights_explained(&cdir, &c.name) {
                    missing.push(m);
                }
            }
        }
    }
    if missing.is_empty() {
        Ok(index)
    } else {
        Err(SourceError::IncompleteDiffusers { dir: dir.to_path_buf(), missing })
    }
}

/// Which files of a repo listing (`siblings`, paths relative to the repo root) make a complete folder.
/// Shard indexes are listed but not their shards, which are only known once the index is downloaded.
/// `Err` lists what the repo lacks.
pub(crate) fn plan_downloads(index: &ModelIndex, siblings: &[String]) -> Result<Vec<String>, Vec<String>> {
    let mut plan = vec!["model_index.json".to_string()];
    let mut problems = Vec::new();
    for c in &index.components {
        let prefix = format!("{}/", c.name);
        let names: BTreeSet<String> = siblings
            .iter()
            .filter_map(|s| s.strip_prefix(&prefix))
            .filter(|rest| !rest.contains('/'))
            .map(str::to_string)
            .collect();
        let mut take = |file: &str, required: bool| {
            if names.contains(file) {
                plan.push(format!("{prefix}{file}"));
                true
            } else {
                if required {
                    problems.push(format!("{prefix}{file} is not in the repo"));
                }
                false
            }
        };
        match c.kind {
            ComponentKind::Scheduler => {
                take("scheduler_config.json", true);
            }
            ComponentKind::Tokenizer => {
                let fast = take("tokenizer.json", false);
                take("vocab.json", !fast);
                take("merges.txt", !fast);
                for extra in TOKENIZER_EXTRAS {
                    take(extra, false);
                }
            }
            ComponentKind::Model => {
                take("config.json", true);
                match choose_weights(&names) {
                    Some((WeightsChoice::Single(f), _)) | Some((WeightsChoice::Sharded { index: f }, _)) => {
                        plan.push(format!("{prefix}{f}"))
                    }
                    None => problems.push(missing_weights_message(&c.name, &names)),
                }
            }
        }
    }
    if problems.is_empty() {
        Ok(plan)
    } else {
        Err(problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SD15_INDEX: &str = r#"{
        "_class_name": "StableDiffusionPipeline",
        "feature_extractor": ["transformers", "CLIPImageProcessor"],
        "requires_safety_checker": true,
        "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
        "image_encoder": [null, null],
        "scheduler": ["diffusers", "PNDMScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"]
    }"#;

    fn list(files: &[&str]) -> Vec<String> {
        files.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn index_lists_only_used_components() {
        let idx = ModelIndex::parse(SD15_INDEX.as_bytes()).unwrap();
        let names: Vec<&str> = idx.components.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["scheduler", "text_encoder", "tokenizer", "unet", "vae"]);
        assert_eq!(idx.class_name.as_deref(), Some("StableDiffusionPipeline"));
        assert_eq!(idx.components[0].kind, ComponentKind::Scheduler);
        assert_eq!(idx.components[2].kind, ComponentKind::Tokenizer);
        assert_eq!(idx.components[3].kind, ComponentKind::Model);
    }

    #[test]
    fn index_refuses_escaping_component_names_and_garbage() {
        assert!(ModelIndex::parse(br#"{"../x": ["diffusers", "AutoencoderKL"]}"#).is_err());
        assert!(ModelIndex::parse(br#"{"a/b": ["diffusers", "AutoencoderKL"]}"#).is_err());
        assert!(ModelIndex::parse(b"[1, 2]").is_err());
        assert!(ModelIndex::parse(b"{}").is_err());
        assert!(ModelIndex::parse(b"not json").is_err());
    }

    #[test]
    fn plan_prefers_safetensors_and_skips_other_formats() {
        // Shaped like the listing of a typical SD 1.5 repo, which carries every format at once.
        let siblings = list(&[
            "model_index.json",
            "v1-5-pruned.ckpt",
            "v1-5-pruned.safetensors",
            "feature_extractor/preprocessor_config.json",
            "safety_checker/config.json",
            "safety_checker/model.safetensors",
            "scheduler/scheduler_config.json",
            "text_encoder/config.json",
            "text_encoder/model.safetensors",
            "text_encoder/model.fp16.safetensors",
            "text_encoder/pytorch_model.bin",
            "text_encoder/flax_model.msgpack",
            "tokenizer/merges.txt",
            "tokenizer/special_tokens_map.json",
            "tokenizer/tokenizer_config.json",
            "tokenizer/vocab.json",
            "unet/config.json",
            "unet/diffusion_pytorch_model.bin",
            "unet/diffusion_pytorch_model.fp16.safetensors",
            "unet/diffusion_pytorch_model.safetensors",
            "unet/diffusion_flax_model.msgpack",
            "vae/config.json",
            "vae/diffusion_pytorch_model.safetensors",
            "onnx/unet/model.onnx",
        ]);
        let idx = ModelIndex::parse(SD15_INDEX.as_bytes()).unwrap();
        let plan = plan_downloads(&idx, &siblings).unwrap();
        assert_eq!(
            plan,
            list(&[
                "model_index.json",
                "scheduler/scheduler_config.json",
                "text_encoder/config.json",
                "text_encoder/model.safetensors",
                "tokenizer/vocab.json",
                "tokenizer/merges.txt",
                "tokenizer/tokenizer_config.json",
                "tokenizer/special_tokens_map.json",
                "unet/config.json",
                "unet/diffusion_pytorch_model.safetensors",
                "vae/config.json",
                "vae/diffusion_pytorch_model.safetensors",
            ])
        );
    }

    #[test]
    fn plan_uses_fp16_or_shards_only_when_needed_and_explains_bin_only_repos() {
        let idx = ModelIndex::parse(br#"{"unet": ["diffusers", "UNet2DConditionModel"]}"#).unwrap();
        let fp16 = list(&["unet/config.json", "unet/diffusion_pytorch_model.fp16.safetensors"]);
        assert_eq!(plan_downloads(&idx, &fp16).unwrap()[2], "unet/diffusion_pytorch_model.fp16.safetensors");
        let sharded = list(&[
            "unet/config.json",
            "unet/diffusion_pytorch_model.safetensors.index.json",
            "unet/diffusion_pytorch_model-00001-of-00002.safetensors",
            "unet/diffusion_pytorch_model-00002-of-00002.safetensors",
            "unet/diffusion_pytorch_model.fp16.safetensors",
        ]);
        assert_eq!(
            plan_downloads(&idx, &sharded).unwrap()[2],
            "unet/diffusion_pytorch_model.safetensors.index.json"
        );
        let bin_only = list(&["unet/config.json", "unet/diffusion_pytorch_model.bin"]);
        let problems = plan_downloads(&idx, &bin_only).unwrap_err();
        assert!(problems[0].contains("diffusion_pytorch_model.bin"), "{problems:?}");
        assert!(problems[0].contains("only .safetensors"), "{problems:?}");
    }

    #[test]
    fn local_check_follows_shard_indexes() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("model_index.json"), br#"{"unet": ["diffusers", "UNet2DConditionModel"]}"#)
            .unwrap();
        std::fs::create_dir(d.join("unet")).unwrap();
        std::fs::write(d.join("unet/config.json"), b"{}").unwrap();
        std::fs::write(
            d.join("unet/diffusion_pytorch_model.safetensors.index.json"),
            br#"{"weight_map": {"a": "s-1.safetensors", "b": "s-2.safetensors", "c": "s-1.safetensors"}}"#,
        )
        .unwrap();
        std::fs::write(d.join("unet/s-1.safetensors"), b"").unwrap();
        match check_complete(d) {
            Err(SourceError::IncompleteDiffusers { missing, .. }) => {
                assert_eq!(
                    missing,
                    ["unet/s-2.safetensors (listed in diffusion_pytorch_model.safetensors.index.json)"]
                )
            }
            other => panic!("{other:?}"),
        }
        std::fs::write(d.join("unet/s-2.safetensors"), b"").unwrap();
        check_complete(d).unwrap();
        let w = find_weights(&d.join("unet")).unwrap();
        assert_eq!(w.files, [d.join("unet/s-1.safetensors"), d.join("unet/s-2.safetensors")]);
        assert!(!w.fp16_variant);
    }

    #[test]
    fn shard_index_cannot_point_outside_the_folder() {
        let dir = tempfile::tempdir().unwrap();
        let index = dir.path().join("i.json");
        std::fs::write(&index, br#"{"weight_map": {"a": "../../etc/x.safetensors"}}"#).unwrap();
        assert!(shard_names(&index).is_err());
    }
}
