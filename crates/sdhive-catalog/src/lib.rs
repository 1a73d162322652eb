//! The model library's catalogue: which checkpoints, VAEs and refused files a node's models folders hold, named
//! and matched the way AUTOMATIC1111 names and matches them (`name`, `model_name`, `title` with the sha256
//! shorthash), so A1111 clients can pick models by the strings they already use. Scanning reads folder listings
//! and file headers only; content hashes come from a persistent cache or are computed on demand, one entry at a
//! time, because hashing a whole library at start-up would read every byte of it.

mod entry;
mod error;
mod find;
pub mod gguf;
mod hash;
mod header;
mod networks;
mod scan;
pub mod styles;
mod upscalers;

pub use entry::{Checkpoint, CheckpointFormat, Refused, Vae};
pub use error::{CatalogError, NotFound};
pub use networks::{
    checkpoint_text_widths, Embedding, EmbeddingWidth, Lora, LoraFormat, LoraNotFound, NetworkCatalog,
    NetworkHasher, NetworksConfig, RefusedNetwork,
};
pub use upscalers::{UpscalerCatalog, UpscalerFile, UpscalersConfig};

use hash::HashCache;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Where to look for models and where to remember their hashes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CatalogConfig {
    /// Checkpoint folders, scanned recursively. Also VAE sources: a `VAE` (case-insensitive) subfolder is scanned
    /// for VAEs, not checkpoints.
    pub models_dirs: Vec<PathBuf>,
    /// Extra VAE folders (scanned recursively).
    pub vae_dirs: Vec<PathBuf>,
    /// JSON file caching sha256 by (canonical path, size, mtime); `None` keeps hashes in memory only.
    pub hash_cache: Option<PathBuf>,
}

/// A scanned model library.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    /// Sorted by name, then by the order of the models dirs.
    pub checkpoints: Vec<Checkpoint>,
    pub refused: Vec<Refused>,
    /// Sorted by name, then by source (models dirs in order, then VAE dirs in order).
    pub vaes: Vec<Vae>,
    cache: HashCache,
}

impl Catalog {
    /// Scans every configured folder. A missing or unreadable configured folder is an error naming it; problems
    /// below it (bad files, broken symlinks, unreadable subfolders) are warnings or `refused` entries, since one
    /// bad file must not take the whole library offline. Never hashes.
    pub fn scan(config: &CatalogConfig) -> Result<Catalog, CatalogError> {
        let cache = HashCache::load(config.hash_cache.as_deref());
        let found = scan::scan(config, &cache)?;
        let mut checkpoints = found.checkpoints;
        checkpoints.sort_by(|(sa, a), (sb, b)| a.name.cmp(&b.name).then(sa.cmp(sb)));
        let mut refused = found.refused;
        refused.sort_by(|(sa, a), (sb, b)| a.name.cmp(&b.name).then(sa.cmp(sb)));
        let mut vaes = found.vaes;
        vaes.sort_by(|(sa, a), (sb, b)| a.name.cmp(&b.name).then(sa.cmp(sb)));
        // A VAE folder can be reached both as a models dir's `VAE/` and as a configured VAE dir.
        let mut seen = std::collections::HashSet::new();
        vaes.retain(|(_, v)| seen.insert((v.name.clone(), v.path.clone())));
        let catalog = Catalog {
            checkpoints: checkpoints.into_iter().map(|(_, c)| c).collect(),
            refused: refused.into_iter().map(|(_, r)| r).collect(),
            vaes: vaes.into_iter().map(|(_, v)| v).collect(),
            cache,
        };
        tracing::info!(
            "model catalogue: {} checkpoints, {} VAEs, {} refused",
            catalog.checkpoints.len(),
            catalog.vaes.len(),
            catalog.refused.len()
        );
        Ok(catalog)
    }

    /// Moves every checkpoint whose format the serving engine does not load (`loadable` lists those it does) to
    /// `refused`, saying which engine loads it; `engine` names the serving one in that message ("the candle
    /// engine"). A worker lists only what it can switch to, so no listed model fails for its format.
    pub fn retain_loadable(&mut self, loadable: &[CheckpointFormat], engine: &str) {
        let (kept, refused): (Vec<Checkpoint>, Vec<Checkpoint>) =
            std::mem::take(&mut self.checkpoints).into_iter().partition(|c| loadable.contains(&c.format));
        self.checkpoints = kept;
        for c in refused {
            let reason = match c.format {
                CheckpointFormat::Gguf => format!(
                    "GGUF checkpoints load on the stable-diffusion.cpp engine (sd-worker-vulkan, sd-worker-rocm), \
                     not on {engine}, which this worker runs: serve it from one of those, or use the model's \
                     .safetensors or diffusers form here"
                ),
                other => format!("{} checkpoints do not load on {engine}", other.name()),
            };
            self.refused.push(Refused { name: c.name, path: c.path, reason });
        }
        self.refused.sort_by(|a, b| a.name.cmp(&b.name));
    }

    /// The checkpoint `query` names, matched as A1111's `get_closet_checkpoint_match` (see `find_index`).
    pub fn find(&self, query: &str) -> Result<&Checkpoint, NotFound> {
        self.find_index(query).map(|i| &self.checkpoints[i])
    }

    /// Like `find`, but the index, for `ensure_hash`. Order: exact alias (`name`, `title`, canonical path,
    /// sha256, then `model_name`, shorthash, `model_name [shorthash]`, then `name_for_extra`); the shortest
    /// title containing the query; both again with a trailing ` [checksum]` stripped; all of it again ignoring
    /// case.
    pub fn find_index(&self, query: &str) -> Result<usize, NotFound> {
        find::find_index(&self.checkpoints, query)
            .ok_or_else(|| NotFound { query: query.to_string(), closest: self.closest_titles(query, 3) })
    }

    /// The VAE named `query`: its file name (`vae-ft-mse.safetensors`), that name without `.safetensors`, or
    /// its path; case-insensitively if nothing matches exactly.
    pub fn find_vae(&self, query: &str) -> Option<&Vae> {
        self.find_vae_index(query).map(|i| &self.vaes[i])
    }

    pub fn find_vae_index(&self, query: &str) -> Option<usize> {
        if query.trim().is_empty() {
            return None;
        }
        let stem = |v: &Vae| v.name.strip_suffix(".safetensors").map(str::to_string);
        let exact = self
            .vaes
            .iter()
            .position(|v| v.name == query || stem(v).as_deref() == Some(query) || v.path == Path::new(query));
        // A path as the user typed it (relative, through symlinks) names the same file as its canonical form.
        let by_path = || {
            let canonical = std::fs::canonicalize(query).ok()?;
            self.vaes.iter().position(|v| v.path == canonical)
        };
        exact.or_else(by_path).or_else(|| {
            let q = query.to_lowercase();
            self.vaes.iter().position(|v| {
                let name = v.name.to_lowercase();
                name == q || name.strip_suffix(".safetensors") == Some(q.as_str())
            })
        })
    }

    /// A1111's "Automatic" VAE: `<stem>.vae.safetensors` in the checkpoint's folder. `.vae.pt` files are never
    /// listed (pickle), so they never match. Diffusers folders carry their own VAE and get `None`.
    pub fn vae_beside(&self, ckpt: &Checkpoint) -> Option<&Vae> {
        if ckpt.format == CheckpointFormat::Diffusers {
            return None;
        }
        // Both where the checkpoint was listed and where it really is (they differ for a symlinked checkpoint).
        let listed = ckpt
            .root
            .join(&ckpt.name)
            .parent()
            .map(|dir| dir.join(format!("{}.vae.safetensors", ckpt.name_for_extra())))
            .and_then(|p| std::fs::canonicalize(p).ok());
        let real = ckpt.path.file_name().map(|f| {
            let stem = entry::splitext_root(&f.to_string_lossy()).to_string();
            ckpt.path.with_file_name(format!("{stem}.vae.safetensors"))
        });
        [real, listed].into_iter().flatten().find_map(|want| self.vaes.iter().find(|v| v.path == want))
    }

    /// The sha256 of checkpoint `index`: already known, from the cache file, or computed now (streamed; minutes
    /// for a large file) and stored in the entry and the cache file. `None` for diffusers folders.
    pub fn ensure_hash(&mut self, index: usize) -> Result<Option<String>, CatalogError> {
        let len = self.checkpoints.len();
        let ckpt = self.checkpoints.get(index).ok_or(CatalogError::NoSuchCheckpoint { index, len })?;
        if ckpt.format == CheckpointFormat::Diffusers {
            return Ok(None);
        }
        if let Some(sha) = &ckpt.sha256 {
            return Ok(Some(sha.clone()));
        }
        let path = ckpt.path.clone();
        let (sha, stamp) = self.cache.hash(&path)?;
        self.share_hash(&path, &sha, stamp.size);
        Ok(Some(sha))
    }

    /// The checkpoint a `--model` argument names: an existing path is the entry of that file or folder (none
    /// when it lies outside the library), anything else a name looked up as [`Catalog::find`] does. Workers
    /// and the hive both read their `--model` through this, so they agree on what it is.
    pub fn entry_for_arg(&self, arg: &str) -> Option<&Checkpoint> {
        if Path::new(arg).exists() {
            let canonical = std::fs::canonicalize(arg).ok()?;
            return self.checkpoints.iter().find(|e| e.path == canonical);
        }
        self.find(arg).ok()
    }

    /// The sha256 of VAE `index`, as `ensure_hash`.
    pub fn ensure_vae_hash(&mut self, index: usize) -> Result<Option<String>, CatalogError> {
        let len = self.vaes.len();
        let vae = self.vaes.get(index).ok_or(CatalogError::NoSuchVae { index, len })?;
        if let Some(sha) = &vae.sha256 {
            return Ok(Some(sha.clone()));
        }
        let path = vae.path.clone();
        let (sha, stamp) = self.cache.hash(&path)?;
        self.share_hash(&path, &sha, stamp.size);
        Ok(Some(sha))
    }

    /// Records a hash computed elsewhere (on a copy of this catalogue, so that reading a large file held no
    /// lock on this one) for every entry that is the file at `path`.
    pub fn record_hash(&mut self, path: &Path, sha: &str) {
        let size = self.checkpoints.iter().find(|c| c.path == path).map(|c| c.size);
        let size = size.or_else(|| self.vaes.iter().find(|v| v.path == path).map(|v| v.size)).unwrap_or(0);
        self.share_hash(path, sha, size);
    }

    /// Every entry that is the same file (symlinks, a folder listed twice) gets the hash too.
    fn share_hash(&mut self, path: &Path, sha: &str, size: u64) {
        for c in
            self.checkpoints.iter_mut().filter(|c| c.path == path && c.format != CheckpointFormat::Diffusers)
        {
            c.sha256 = Some(sha.to_string());
            c.size = size;
        }
        for v in self.vaes.iter_mut().filter(|v| v.path == path) {
            v.sha256 = Some(sha.to_string());
            v.size = size;
        }
    }

    /// The `n` titles most similar to `query`, best first, for "did you mean" messages.
    pub fn closest_titles(&self, query: &str, n: usize) -> Vec<String> {
        find::closest_titles(&self.checkpoints, query, n)
    }
}

/// Where the hash cache lives by default: `$SDHIVE_HASH_CACHE`, else `$XDG_CACHE_HOME/sdhive/hashes.json`, else
/// `$HOME/.cache/sdhive/hashes.json`; `None` when none of them is set.
pub fn default_hash_cache() -> Option<PathBuf> {
    hash_cache_from(|key| std::env::var_os(key))
}

fn hash_cache_from(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    if let Some(file) = var("SDHIVE_HASH_CACHE").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(file));
    }
    cache_dir_from(var).map(|dir| dir.join("hashes.json"))
}

/// sdhive's cache folder: `$XDG_CACHE_HOME/sdhive`, else `$HOME/.cache/sdhive`; `None` when neither is set.
pub fn default_cache_dir() -> Option<PathBuf> {
    cache_dir_from(|key| std::env::var_os(key))
}

fn cache_dir_from(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let var = |key| var(key).filter(|v| !v.is_empty()).map(PathBuf::from);
    // The XDG spec says relative values are invalid and must be ignored.
    if let Some(xdg) = var("XDG_CACHE_HOME").filter(|p| p.is_absolute()) {
        return Some(xdg.join("sdhive"));
    }
    var("HOME").map(|home| home.join(".cache").join("sdhive"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_cache_location() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |key: &str| pairs.iter().find(|(k, _)| *k == key).map(|(_, v)| OsString::from(v))
        };
        assert_eq!(
            hash_cache_from(env(&[("SDHIVE_HASH_CACHE", "/c/h.json"), ("HOME", "/home/u")])),
            Some(PathBuf::from("/c/h.json"))
        );
        assert_eq!(
            hash_cache_from(env(&[("XDG_CACHE_HOME", "/xdg"), ("HOME", "/home/u")])),
            Some(PathBuf::from("/xdg/sdhive/hashes.json"))
        );
        assert_eq!(
            hash_cache_from(env(&[("XDG_CACHE_HOME", "rel"), ("HOME", "/home/u")])),
            Some(PathBuf::from("/home/u/.cache/sdhive/hashes.json"))
        );
        assert_eq!(
            hash_cache_from(env(&[("SDHIVE_HASH_CACHE", ""), ("HOME", "/home/u")])),
            Some(PathBuf::from("/home/u/.cache/sdhive/hashes.json"))
        );
        assert_eq!(hash_cache_from(env(&[])), None);
    }
}
