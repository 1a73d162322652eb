//! The worker's LoRAs and textual-inversion embeddings: the scanned catalogue, its A1111 listings
//! (`/sdapi/v1/loras`, `/sdapi/v1/embeddings`), and resolving what a request uses into the engine request's
//! `loras` and `embeddings` (prompt tags, the structured `loras` field, embedding names in either prompt).
//! Every miss is refused here, before the job is queued, with an error naming the request field and the
//! network. Short hashes for the infotext are computed on first use of a file (sha256 of a 150 MB LoRA takes
//! about 0.3 s) on the caller's blocking thread, and kept in the shared hash cache, so a file is hashed once
//! per node, and every image records the hashes A1111 would.

use crate::locks::{lock, read, write};
use sdhive_catalog::{checkpoint_text_widths, CatalogError, NetworkCatalog, NetworkHasher, NetworksConfig};
use sdhive_engine::{parse_networks, EmbeddingUse, GenerateRequest, LoraUse, ModelSpec, ValidationError};
use sdhive_protocol::{EmbeddingList, ListedEmbedding, ListedLora, LoraRequest};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

fn invalid(field: &'static str, message: impl Into<String>) -> ValidationError {
    ValidationError { field, message: message.into() }
}

pub struct Networks {
    config: NetworksConfig,
    catalog: RwLock<NetworkCatalog>,
    /// One hashing at a time: two requests naming a new LoRA at once then read it once, and the disk is not
    /// asked for two large files in parallel.
    hasher: Mutex<NetworkHasher>,
    /// Text-encoder widths by model source (read from a header or config once per model).
    widths: Mutex<HashMap<String, Option<Vec<u64>>>>,
}

impl Networks {
    /// The catalogue of `config`'s folders, scanned now (headers only).
    pub fn scan(config: NetworksConfig) -> Result<Networks, CatalogError> {
        let catalog = NetworkCatalog::scan(&config)?;
        Ok(Networks {
            hasher: Mutex::new(catalog.hasher()),
            catalog: RwLock::new(catalog),
            config,
            widths: Mutex::new(HashMap::new()),
        })
    }

    /// `scan`, or an empty catalogue with the error logged: a server that is already starting must not stop
    /// for its LoRA folder (the worker's start-up checks the folders before this).
    pub fn scan_or_empty(config: NetworksConfig) -> Networks {
        Networks::scan(config.clone()).unwrap_or_else(|e| {
            tracing::error!("cannot scan the LoRA / embeddings folders: {e}; serving without them");
            Networks {
                hasher: Mutex::new(NetworkCatalog::default().hasher()),
                catalog: RwLock::new(NetworkCatalog::default()),
                config,
                widths: Mutex::new(HashMap::new()),
            }
        })
    }

    /// Rescans the folders (`refresh-loras`, `refresh-embeddings`).
    pub fn refresh(&self) -> Result<(), CatalogError> {
        let fresh = NetworkCatalog::scan(&self.config)?;
        *write(&self.catalog) = fresh;
        Ok(())
    }

    /// `GET /sdapi/v1/loras`.
    pub fn list_loras(&self) -> Vec<ListedLora> {
        read(&self.catalog)
            .loras
            .iter()
            .map(|l| ListedLora {
                name: l.name.clone(),
                alias: l.alias.clone(),
                path: l.path.display().to_string(),
                metadata: l.metadata_json(),
            })
            .collect()
    }

    /// `GET /sdapi/v1/embeddings` for a model whose text encoders are `widths` wide; every embedding counts as
    /// loaded when they are unknown (no model loaded), as in A1111 before its first model.
    pub fn list_embeddings(&self, widths: Option<&[u64]>) -> EmbeddingList {
        let mut out = EmbeddingList::default();
        for e in &read(&self.catalog).embeddings {
            let listed = ListedEmbedding {
                step: None,
                sd_checkpoint: None,
                sd_checkpoint_name: None,
                shape: e.shape(),
                vectors: e.vectors,
            };
            if widths.is_none_or(|w| e.fits(w)) {
                out.loaded.insert(e.name.clone(), listed);
            } else {
                out.skipped.insert(e.name.clone(), listed);
            }
        }
        out
    }

    /// Files in the folders that are not listed, and why.
    pub fn refused(&self) -> Vec<(String, String)> {
        read(&self.catalog).refused.iter().map(|r| (r.path.display().to_string(), r.reason.clone())).collect()
    }

    /// The text-encoder widths of `spec`'s model: from its files when it is a local checkpoint, else from the
    /// engine's `family` (`sd1` 768, `sd2` 1024, `sdxl` 768 + 1280); `None` when neither tells.
    pub fn text_widths(&self, spec: &ModelSpec, family: Option<&str>) -> Option<Vec<u64>> {
        let from_files = {
            let mut cache = lock(&self.widths);
            cache
                .entry(spec.source.clone())
                .or_insert_with(|| checkpoint_text_widths(Path::new(&spec.source)))
                .clone()
        };
        from_files.or_else(|| match family? {
            "sd1" => Some(vec![768]),
            "sd2" => Some(vec![1024]),
            "sdxl" => Some(vec![768, 1280]),
            _ => None,
        })
    }

    /// Fills `req.loras` from the prompt's tags and `structured`, and `req.embeddings` from the embedding names in
    /// the prompt and negative prompt that fit `widths` (all of them when `None`). Blocks while a file used for
    /// the first time is hashed: call it off the async workers.
    pub fn resolve(
        &self,
        req: &mut GenerateRequest,
        structured: &[LoraRequest],
        widths: Option<&[u64]>,
    ) -> Result<(), ValidationError> {
        let (text, tags) = parse_networks(&req.prompt).map_err(|e| invalid("prompt", e.to_string()))?;
        let mut wanted: Vec<(&'static str, String, f32, f32)> =
            tags.into_iter().map(|t| ("prompt", t.name, t.te, t.unet)).collect();
        for (i, l) in structured.iter().enumerate() {
            let (te, unet) = l.multipliers();
            for (what, v) in [("weight", unet), ("te_weight", te)] {
                if !v.is_finite() {
                    return Err(invalid(
                        "loras",
                        format!("loras[{i}].{what} must be a finite number, got {v}"),
                    ));
                }
            }
            wanted.push(("loras", l.name.clone(), te, unet));
        }
        let mut loras: Vec<(LoraUse, &'static str)> = Vec::with_capacity(wanted.len());
        for (field, name, te, unet) in wanted {
            let path = self.lora_path(field, &name)?;
            if let Some((_, first)) = loras.iter().find(|(l, _)| l.path == path) {
                return Err(invalid(
                    field,
                    format!("the LoRA `{name}` is named twice (also in `{first}`); name each LoRA once"),
                ));
            }
            loras.push((LoraUse { name, path, te, unet, hash: None }, field));
        }
        for (lora, field) in &mut loras {
            lora.hash = Some(self.lora_shorthash(field, &lora.name, &lora.path)?);
        }
        req.loras = loras.into_iter().map(|(l, _)| l).collect();

        let mut embeddings: Vec<EmbeddingUse> = Vec::new();
        for (field, text) in [("prompt", text.as_str()), ("negative_prompt", req.negative_prompt.as_str())] {
            let found: Vec<(String, PathBuf, Option<String>)> = {
                let catalog = read(&self.catalog);
                catalog
                    .embeddings_in(text)
                    .into_iter()
                    .map(|i| &catalog.embeddings[i])
                    .filter(|e| widths.is_none_or(|w| e.fits(w)))
                    .map(|e| (e.name.clone(), e.path.clone(), e.shorthash().map(str::to_string)))
                    .collect()
            };
            for (name, path, hash) in found {
                if embeddings.iter().any(|e| e.path == path) {
                    continue;
                }
                let hash = match hash {
                    Some(h) => h,
                    None => self.embedding_shorthash(field, &name, &path)?,
                };
                embeddings.push(EmbeddingUse { name, path, hash: Some(hash) });
            }
        }
        req.embeddings = embeddings;
        Ok(())
    }

    /// The file of the LoRA `name`; a miss rescans once first (a file copied in since the last scan is found, as
    /// A1111's `load_networks` does).
    fn lora_path(&self, field: &'static str, name: &str) -> Result<PathBuf, ValidationError> {
        let lookup = || {
            let catalog = read(&self.catalog);
            match catalog.find_lora(name) {
                Ok(l) => Ok(l.path.clone()),
                Err(miss) => Err(Box::new((miss, catalog.refused_lora(name).cloned()))),
            }
        };
        let (miss, refused) = match lookup() {
            Ok(path) => return Ok(path),
            Err(found) if found.1.is_some() => (None, found.1),
            Err(_) => {
                if let Err(e) = self.refresh() {
                    tracing::warn!("cannot rescan the LoRA folders: {e}");
                }
                match lookup() {
                    Ok(path) => return Ok(path),
                    Err(found) => (Some(found.0), found.1),
                }
            }
        };
        Err(match (refused, miss) {
            (Some(r), _) => invalid(
                field,
                format!("the LoRA `{name}` ({}) is not usable: {}", r.path.display(), r.reason),
            ),
            (None, Some(miss)) => invalid(field, miss.to_string()),
            (None, None) => invalid(field, format!("no LoRA `{name}`")),
        })
    }

    fn lora_shorthash(
        &self,
        field: &'static str,
        name: &str,
        path: &Path,
    ) -> Result<String, ValidationError> {
        let known = read(&self.catalog)
            .loras
            .iter()
            .find(|l| l.path == path)
            .and_then(|l| l.shorthash().map(str::to_string));
        if let Some(h) = known {
            return Ok(h);
        }
        let sha = lock(&self.hasher)
            .lora_hash(path)
            .map_err(|e| invalid(field, format!("the LoRA `{name}` cannot be read: {e}")))?;
        write(&self.catalog).record_lora_hash(path, &sha);
        Ok(sha[..12].to_string())
    }

    fn embedding_shorthash(
        &self,
        field: &'static str,
        name: &str,
        path: &Path,
    ) -> Result<String, ValidationError> {
        let sha = lock(&self.hasher)
            .embedding_hash(path)
            .map_err(|e| invalid(field, format!("the embedding `{name}` cannot be read: {e}")))?;
        write(&self.catalog).record_embedding_hash(path, &sha);
        Ok(sha[..12].to_string())
    }
}
