//! Extra networks on the wire: a request's structured `loras` entry, one LoRA of `GET /sdapi/v1/loras` and
//! the `GET /sdapi/v1/embeddings` answer, all in A1111's shapes, with the merges the hive applies to its workers'
//! lists (one entry per name).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

fn one() -> f32 {
    1.0
}

/// `"loras": [{"name": "style", "weight": 0.8, "te_weight": 0.5}]`: the structured form of `<lora:style:0.5:0.8>`
/// (`weight` is the UNet multiplier, `te_weight` the text encoder's, defaulting to `weight`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraRequest {
    pub name: String,
    #[serde(default = "one")]
    pub weight: f32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub te_weight: Option<f32>,
}

impl LoraRequest {
    /// (text encoder, UNet) multipliers.
    pub fn multipliers(&self) -> (f32, f32) {
        (self.te_weight.unwrap_or(self.weight), self.weight)
    }
}

/// One entry of `GET /sdapi/v1/loras` (A1111's `create_lora_json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListedLora {
    pub name: String,
    pub alias: String,
    pub path: String,
    pub metadata: Map<String, Value>,
}

/// One embedding of `GET /sdapi/v1/embeddings`; `step` and the checkpoint fields are A1111's training records,
/// which safetensors embeddings do not carry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListedEmbedding {
    pub step: Option<u64>,
    pub sd_checkpoint: Option<String>,
    pub sd_checkpoint_name: Option<String>,
    pub shape: u64,
    pub vectors: u64,
}

/// `GET /sdapi/v1/embeddings`: those that fit the loaded model's text encoders, and the others.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmbeddingList {
    pub loaded: BTreeMap<String, ListedEmbedding>,
    pub skipped: BTreeMap<String, ListedEmbedding>,
}

impl EmbeddingList {
    /// Adds another worker's list: a name loaded anywhere is loaded (its workers may hold other models).
    pub fn merge(&mut self, other: EmbeddingList) {
        for (name, e) in other.loaded {
            self.skipped.remove(&name);
            self.loaded.entry(name).or_insert(e);
        }
        for (name, e) in other.skipped {
            if !self.loaded.contains_key(&name) {
                self.skipped.entry(name).or_insert(e);
            }
        }
    }
}

/// Several workers' LoRA lists as one, the first entry of each name kept, sorted by name.
pub fn union_loras(lists: impl IntoIterator<Item = Vec<ListedLora>>) -> Vec<ListedLora> {
    let mut by_name: BTreeMap<String, ListedLora> = BTreeMap::new();
    for lora in lists.into_iter().flatten() {
        by_name.entry(lora.name.clone()).or_insert(lora);
    }
    by_name.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_request_defaults() {
        let r: LoraRequest = serde_json::from_str(r#"{"name": "x"}"#).unwrap();
        assert_eq!(r.multipliers(), (1.0, 1.0));
        let r: LoraRequest =
            serde_json::from_str(r#"{"name": "x", "weight": 0.8, "te_weight": 0.5}"#).unwrap();
        assert_eq!(r.multipliers(), (0.5, 0.8));
        assert!(serde_json::from_str::<LoraRequest>(r#"{"name": "x", "wieght": 1}"#).is_err());
    }

    #[test]
    fn unions() {
        let lora = |name: &str, path: &str| ListedLora {
            name: name.into(),
            alias: name.into(),
            path: path.into(),
            metadata: Map::new(),
        };
        let merged = union_loras([
            vec![lora("b", "/1/b"), lora("a", "/1/a")],
            vec![lora("a", "/2/a"), lora("c", "/2/c")],
        ]);
        let got: Vec<(&str, &str)> = merged.iter().map(|l| (l.name.as_str(), l.path.as_str())).collect();
        assert_eq!(got, vec![("a", "/1/a"), ("b", "/1/b"), ("c", "/2/c")]);

        let e = ListedEmbedding {
            step: None,
            sd_checkpoint: None,
            sd_checkpoint_name: None,
            shape: 768,
            vectors: 1,
        };
        let mut a = EmbeddingList::default();
        a.skipped.insert("x".into(), e.clone());
        a.loaded.insert("y".into(), e.clone());
        let mut b = EmbeddingList::default();
        b.loaded.insert("x".into(), e.clone());
        b.skipped.insert("y".into(), e.clone());
        b.skipped.insert("z".into(), e);
        a.merge(b);
        assert_eq!(a.loaded.keys().collect::<Vec<_>>(), vec!["x", "y"]);
        assert_eq!(a.skipped.keys().collect::<Vec<_>>(), vec!["z"]);
    }
}
