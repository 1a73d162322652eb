//! The model lists as clients read them, from a worker or a hive alike: one checkpoint's entry in
//! `GET /sdapi/v1/sd-models` (A1111's shape) and `GET /v1/models` (OpenAI's), with where it is loaded; and the
//! few name rules both sides apply before a catalogue lookup.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// OpenAI's own model names: clients with a fixed model list send these, meaning "your model".
pub const OPENAI_MODEL_NAMES: &[&str] =
    &["dall-e-2", "dall-e-3", "gpt-image-1", "gpt-image-1-mini", "gpt-image-1.5"];

/// Whether `name` is one of OpenAI's model names (any case).
pub fn is_openai_model_name(name: &str) -> bool {
    OPENAI_MODEL_NAMES.iter().any(|n| n.eq_ignore_ascii_case(name.trim()))
}

/// The last path component without a checkpoint extension (`models/v1-5.safetensors` → `v1-5`): how a model
/// outside the library is matched by name.
pub fn file_stem(name: &str) -> &str {
    let base = name.trim().trim_end_matches(['/', '\\']).rsplit(['/', '\\']).next().unwrap_or(name);
    [".safetensors", ".ckpt", ".pt", ".bin", ".gguf"]
        .iter()
        .find_map(|ext| base.strip_suffix(ext))
        .unwrap_or(base)
}

/// One checkpoint of a model library.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListedModel {
    /// A1111's `name`: the path under its models dir; unique, and unlike the title stable across hashing (the
    /// OpenAI id).
    pub name: String,
    /// `name [short hash]`, or `name` until the file is hashed.
    pub title: String,
    pub model_name: String,
    /// The sha256's first 10 hex digits.
    pub hash: Option<String>,
    pub sha256: Option<String>,
    /// The checkpoint's path (or the `--model` argument of a model outside the library).
    pub filename: String,
    /// `diffusers`, `safetensors`, or `path` for a model outside the library.
    pub format: String,
    /// Ids of the workers that have it loaded.
    pub loaded_on: Vec<String>,
}

impl ListedModel {
    /// A1111's `sd-models` entry (with `loaded_on` beside A1111's keys).
    pub fn a1111(&self) -> Value {
        json!({
            "title": self.title,
            "model_name": self.model_name,
            "hash": self.hash,
            "sha256": self.sha256,
            "filename": self.filename,
            "config": null,
            "loaded_on": self.loaded_on,
        })
    }

    /// OpenAI's model object, with A1111's names and where it is loaded; `created` in Unix seconds.
    pub fn openai(&self, created: u64) -> Value {
        json!({
            "id": self.name,
            "object": "model",
            "created": created,
            "owned_by": "sdhive",
            "model_name": self.model_name,
            "title": self.title,
            "filename": self.filename,
            "format": self.format,
            "sha256": self.sha256,
            "loaded_on": self.loaded_on,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(file_stem("models/v1-5.safetensors"), "v1-5");
        assert_eq!(file_stem("sd15/"), "sd15");
        assert_eq!(file_stem("C:\\m\\x.ckpt"), "x");
        assert_eq!(file_stem("stabilityai/sd-turbo"), "sd-turbo");
        assert!(is_openai_model_name("DALL-E-3") && !is_openai_model_name("sd15"));
    }
}
