//! The extra-network catalogue: LoRA / LyCORIS files and textual-inversion embeddings, found in their folders
//! (`--lora-dir`, `--embeddings-dir`, and the `Lora`, `LyCORIS` and `embeddings` folders of a models dir, as in
//! A1111's `models/Lora`), named as A1111 names them (the file stem; a LoRA's alias is its `ss_output_name`
//! metadata) and matched as A1111 matches them. Scanning reads headers only and classifies each file by its
//! tensor names, so a checkpoint dropped into the LoRA folder is refused at scan time rather than failing a job.
//! Pickle files (`.pt`, `.ckpt`, `.bin`, `.pth`) are listed as refused and never opened. Hashes are A1111's: a
//! LoRA's is the sha256 of its data after the safetensors header ("addnet hash"), an embedding's the sha256 of
//! the whole file; both come from the shared hash cache or are computed on first use.

use crate::entry::splitext_root;
use crate::hash::{HashCache, HashKind, Stamp};
use crate::header::{self, Header};
use crate::CatalogError;
use serde_json::{Map, Value};
use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

/// Where to look for LoRAs and embeddings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetworksConfig {
    /// LoRA / LyCORIS folders, scanned recursively.
    pub lora_dirs: Vec<PathBuf>,
    /// Textual-inversion folders, scanned recursively.
    pub embeddings_dirs: Vec<PathBuf>,
    /// Models dirs whose `Lora` / `LyCORIS` and `embeddings` subfolders (any case) count as the above. A models
    /// dir without them adds nothing, so passing every models dir is always safe.
    pub models_dirs: Vec<PathBuf>,
    /// The hash cache shared with the checkpoint catalogue.
    pub hash_cache: Option<PathBuf>,
}

/// How a LoRA file stores its deltas, judged by its tensor names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraFormat {
    /// `lora_down`/`lora_up` pairs (kohya, A1111, LoCon, diffusers' kohya-style export).
    Lora,
    /// PEFT / diffusers `lora_A`/`lora_B`.
    Peft,
    /// LyCORIS LoHa (`hada_*`).
    LoHa,
    /// LyCORIS LoKr (`lokr_*`).
    LoKr,
}

impl LoraFormat {
    pub fn name(self) -> &'static str {
        match self {
            LoraFormat::Lora => "lora",
            LoraFormat::Peft => "peft",
            LoraFormat::LoHa => "loha",
            LoraFormat::LoKr => "lokr",
        }
    }
}

/// One LoRA or LyCORIS network.
#[derive(Debug, Clone, PartialEq)]
pub struct Lora {
    /// A1111's name: the file name without folders and extension.
    pub name: String,
    /// `ss_output_name` from the metadata, else the name.
    pub alias: String,
    /// Canonical absolute path.
    pub path: PathBuf,
    pub size: u64,
    pub format: LoraFormat,
    /// Whether it carries DoRA magnitudes (`dora_scale`).
    pub dora: bool,
    /// The safetensors `__metadata__` as stored (string values).
    pub metadata: Map<String, Value>,
    /// A1111's addnet hash (sha256 of the data after the header), once known.
    pub sha256: Option<String>,
}

impl Lora {
    /// The first 12 hex digits of the hash, as A1111's `Lora hashes` infotext shows them.
    pub fn shorthash(&self) -> Option<&str> {
        self.sha256.as_deref().and_then(|s| s.get(..12))
    }

    /// The metadata as A1111's `/sdapi/v1/loras` shows it: values that hold a JSON object or array (kohya's
    /// `ss_tag_frequency`, `ss_dataset_dirs`, …) parsed, the rest as stored.
    pub fn metadata_json(&self) -> Map<String, Value> {
        self.metadata
            .iter()
            .map(|(k, v)| {
                let parsed = v
                    .as_str()
                    .filter(|s| s.starts_with('{') || s.starts_with('['))
                    .and_then(|s| serde_json::from_str::<Value>(s).ok());
                (k.clone(), parsed.unwrap_or_else(|| v.clone()))
            })
            .collect()
    }
}

/// The text-encoder widths an embedding's vectors are made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmbeddingWidth {
    /// One text encoder: 768 (SD1.x), 1024 (SD2.x).
    Single(u64),
    /// SDXL's pair (`clip_l`, `clip_g`): 768 and 1280.
    Pair { clip_l: u64, clip_g: u64 },
}

/// One textual-inversion embedding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Embedding {
    /// The word that stands for it in prompts: the file name without folders and extension.
    pub name: String,
    pub path: PathBuf,
    pub size: u64,
    pub width: EmbeddingWidth,
    /// How many token vectors it stands for.
    pub vectors: u64,
    /// sha256 of the whole file, once known.
    pub sha256: Option<String>,
}

impl Embedding {
    /// A1111's `shape`: the vector width, both encoders' widths added for SDXL.
    pub fn shape(&self) -> u64 {
        match self.width {
            EmbeddingWidth::Single(w) => w,
            EmbeddingWidth::Pair { clip_l, clip_g } => clip_l + clip_g,
        }
    }

    /// Whether it fits a model whose text encoders are `widths` wide (`[768]`, `[1024]`, `[768, 1280]`).
    pub fn fits(&self, widths: &[u64]) -> bool {
        match (self.width, widths) {
            (EmbeddingWidth::Single(w), [m]) => w == *m,
            (EmbeddingWidth::Pair { clip_l, clip_g }, [l, g]) => clip_l == *l && clip_g == *g,
            _ => false,
        }
    }

    pub fn shorthash(&self) -> Option<&str> {
        self.sha256.as_deref().and_then(|s| s.get(..12))
    }
}

/// A file in a LoRA or embeddings folder that is not listed, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedNetwork {
    /// The name a prompt would use for it (the file stem).
    pub name: String,
    pub path: PathBuf,
    /// `lora` or `embedding`.
    pub kind: &'static str,
    pub reason: String,
}

/// A LoRA name that matched nothing, with the most similar names (best first).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no LoRA `{query}`{}", hint(closest))]
pub struct LoraNotFound {
    pub query: String,
    pub closest: Vec<String>,
}

fn hint(closest: &[String]) -> String {
    if closest.is_empty() {
        "; no LoRAs are installed in the LoRA folders".into()
    } else {
        format!("; closest: {}", closest.join(", "))
    }
}

/// What the LoRA and embeddings folders hold.
#[derive(Debug, Clone, Default)]
pub struct NetworkCatalog {
    /// Sorted by name; one entry per name (later duplicates are refused, naming the first).
    pub loras: Vec<Lora>,
    pub embeddings: Vec<Embedding>,
    pub refused: Vec<RefusedNetwork>,
    cache: HashCache,
}

/// Computes hashes outside the catalogue's lock; shares the cache file with every other user.
#[derive(Debug, Clone)]
pub struct NetworkHasher {
    cache: HashCache,
}

impl NetworkHasher {
    /// A LoRA's addnet hash (full hex sha256), from the cache or computed now.
    pub fn lora_hash(&mut self, path: &Path) -> Result<String, CatalogError> {
        self.cache.hash_kind(path, HashKind::AfterHeader).map(|(sha, _)| sha)
    }

    /// An embedding's whole-file sha256, from the cache or computed now.
    pub fn embedding_hash(&mut self, path: &Path) -> Result<String, CatalogError> {
        self.cache.hash_kind(path, HashKind::File).map(|(sha, _)| sha)
    }
}

const PICKLE_EXTENSIONS: [&str; 4] = ["pt", "ckpt", "pth", "bin"];
const MAX_DEPTH: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Kind {
    Lora,
    Embedding,
}

impl NetworkCatalog {
    /// Scans every configured folder. A configured folder that is missing or unreadable is an error naming it;
    /// anything wrong below it is a warning or a refused entry. Never hashes.
    pub fn scan(config: &NetworksConfig) -> Result<NetworkCatalog, CatalogError> {
        let cache = HashCache::load(config.hash_cache.as_deref());
        let mut roots: Vec<(PathBuf, Kind)> = Vec::new();
        for (dirs, kind, label) in [
            (&config.lora_dirs, Kind::Lora, "LoRA"),
            (&config.embeddings_dirs, Kind::Embedding, "embeddings"),
        ] {
            for dir in dirs {
                let root = fs::canonicalize(dir).map_err(|e| CatalogError::Dir {
                    kind: label,
                    path: dir.clone(),
                    source: e,
                })?;
                if !root.is_dir() {
                    return Err(CatalogError::NotADir { kind: label, path: dir.clone() });
                }
                roots.push((root, kind));
            }
        }
        for dir in &config.models_dirs {
            roots.extend(models_subfolders(dir));
        }
        let mut seen = HashSet::new();
        roots.retain(|r| seen.insert(r.clone()));

        let mut found =
            Found { loras: Vec::new(), embeddings: Vec::new(), refused: Vec::new(), cache: &cache };
        for (root, kind) in &roots {
            let mut files = Vec::new();
            walk(root, root, 0, &mut vec![], &mut files);
            for path in files {
                found.file(&path, *kind);
            }
        }
        let Found { mut loras, mut embeddings, mut refused, .. } = found;
        // Sorted by name with a stable sort, so the first folder given wins a name clash, as A1111's later
        // entries would not: there the last file scanned silently replaces the others.
        loras.sort_by(|a, b| a.name.cmp(&b.name));
        embeddings.sort_by(|a, b| a.name.cmp(&b.name));
        let mut kept_loras: Vec<Lora> = Vec::with_capacity(loras.len());
        for lora in loras {
            match kept_loras.iter().find(|k| k.name == lora.name && k.path != lora.path) {
                Some(first) => refused.push(duplicate(&lora.name, &lora.path, &first.path, "lora")),
                None if kept_loras.iter().any(|k| k.path == lora.path) => {}
                None => kept_loras.push(lora),
            }
        }
        let mut kept_embeddings: Vec<Embedding> = Vec::with_capacity(embeddings.len());
        for emb in embeddings {
            match kept_embeddings.iter().find(|k| k.name == emb.name && k.path != emb.path) {
                Some(first) => refused.push(duplicate(&emb.name, &emb.path, &first.path, "embedding")),
                None if kept_embeddings.iter().any(|k| k.path == emb.path) => {}
                None => kept_embeddings.push(emb),
            }
        }
        refused.sort_by(|a, b| a.name.cmp(&b.name).then(a.path.cmp(&b.path)));
        for r in &refused {
            tracing::warn!("not listing {} {}: {}", r.kind, r.path.display(), r.reason);
        }
        tracing::info!(
            "extra networks: {} LoRAs, {} embeddings, {} refused",
            kept_loras.len(),
            kept_embeddings.len(),
            refused.len()
        );
        Ok(NetworkCatalog { loras: kept_loras, embeddings: kept_embeddings, refused, cache })
    }

    /// The LoRA a prompt or request names, as A1111's `load_networks` looks it up: by name, else by alias
    /// (an alias shared by several files matches none of them); then both again ignoring case, where A1111
    /// would fail.
    pub fn find_lora(&self, query: &str) -> Result<&Lora, LoraNotFound> {
        self.find_lora_index(query).map(|i| &self.loras[i])
    }

    pub fn find_lora_index(&self, query: &str) -> Result<usize, LoraNotFound> {
        let query = query.trim();
        let not_found = || LoraNotFound { query: query.to_string(), closest: self.closest_loras(query, 3) };
        if query.is_empty() {
            return Err(not_found());
        }
        for fold in [false, true] {
            let eq = |a: &str| if fold { a.to_lowercase() == query.to_lowercase() } else { a == query };
            if let Some(i) = self.loras.iter().position(|l| eq(&l.name)) {
                return Ok(i);
            }
            let by_alias: Vec<usize> = (0..self.loras.len()).filter(|&i| eq(&self.loras[i].alias)).collect();
            if let [i] = by_alias[..] {
                return Ok(i);
            }
        }
        Err(not_found())
    }

    /// A refused file a prompt's name stands for (so "pickle files are refused" beats "no LoRA").
    pub fn refused_lora(&self, query: &str) -> Option<&RefusedNetwork> {
        let query = query.trim();
        self.refused.iter().find(|r| r.kind == "lora" && r.name.eq_ignore_ascii_case(query))
    }

    /// The `n` LoRA names most like `query`, best first.
    pub fn closest_loras(&self, query: &str, n: usize) -> Vec<String> {
        let q: Vec<char> = query.trim().to_lowercase().chars().collect();
        let mut scored: Vec<(f64, &str)> = self
            .loras
            .iter()
            .map(|l| {
                let s = crate::find::similarity(&q, &l.name.to_lowercase())
                    .max(crate::find::similarity(&q, &l.alias.to_lowercase()));
                (s, l.name.as_str())
            })
            .collect();
        scored.sort_by(|a, b| b.0.total_cmp(&a.0));
        scored.into_iter().take(n).map(|(_, name)| name.to_string()).collect()
    }

    /// The embeddings named in `text` as whole words, ignoring case (CLIP's tokenizer lower-cases the prompt
    /// before A1111 matches embedding names against it), in order of first appearance.
    pub fn embeddings_in(&self, text: &str) -> Vec<usize> {
        let lower = text.to_lowercase();
        let mut hits: Vec<(usize, usize)> = self
            .embeddings
            .iter()
            .enumerate()
            .filter_map(|(i, e)| whole_word(&lower, &e.name.to_lowercase()).map(|at| (at, i)))
            .collect();
        hits.sort();
        hits.into_iter().map(|(_, i)| i).collect()
    }

    /// A clone of the hash cache, to hash outside whatever lock guards this catalogue.
    pub fn hasher(&self) -> NetworkHasher {
        NetworkHasher { cache: self.cache.clone() }
    }

    /// The addnet hash of LoRA `index`: known, cached, or computed now.
    pub fn ensure_lora_hash(&mut self, index: usize) -> Result<String, CatalogError> {
        let len = self.loras.len();
        let lora = self.loras.get(index).ok_or(CatalogError::NoSuchNetwork { kind: "LoRA", index, len })?;
        if let Some(sha) = &lora.sha256 {
            return Ok(sha.clone());
        }
        let path = lora.path.clone();
        let (sha, _) = self.cache.hash_kind(&path, HashKind::AfterHeader)?;
        self.record_lora_hash(&path, &sha);
        Ok(sha)
    }

    /// Stores a LoRA hash computed by a [`NetworkHasher`].
    pub fn record_lora_hash(&mut self, path: &Path, sha: &str) {
        for l in self.loras.iter_mut().filter(|l| l.path == path) {
            l.sha256 = Some(sha.to_string());
        }
    }

    /// Stores an embedding hash computed by a [`NetworkHasher`].
    pub fn record_embedding_hash(&mut self, path: &Path, sha: &str) {
        for e in self.embeddings.iter_mut().filter(|e| e.path == path) {
            e.sha256 = Some(sha.to_string());
        }
    }
}

/// Byte offset of the first occurrence of `word` in `text` with no word character on either side.
fn whole_word(text: &str, word: &str) -> Option<usize> {
    if word.is_empty() {
        return None;
    }
    let is_word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    let mut from = 0;
    while let Some(offset) = text[from..].find(word) {
        let at = from + offset;
        let end = at + word.len();
        if !is_word(text[..at].chars().next_back()) && !is_word(text[end..].chars().next()) {
            return Some(at);
        }
        from = at + text[at..].chars().next().map_or(1, char::len_utf8);
    }
    None
}

fn duplicate(name: &str, path: &Path, first: &Path, kind: &'static str) -> RefusedNetwork {
    RefusedNetwork {
        name: name.to_string(),
        path: path.to_path_buf(),
        kind,
        reason: format!("another {kind} named `{name}` is listed ({}); rename one of them", first.display()),
    }
}

/// A models dir's `Lora`, `LyCORIS` and `embeddings` folders, kept only when they stay inside it.
fn models_subfolders(dir: &Path) -> Vec<(PathBuf, Kind)> {
    let Ok(root) = fs::canonicalize(dir) else { return vec![] };
    let Ok(entries) = fs::read_dir(&root) else { return vec![] };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_lowercase();
        let kind = match name.as_str() {
            "lora" | "lycoris" => Kind::Lora,
            "embeddings" => Kind::Embedding,
            _ => continue,
        };
        match fs::canonicalize(entry.path()) {
            Ok(p) if p.starts_with(&root) && p.is_dir() => out.push((p, kind)),
            Ok(p) => tracing::warn!("skipping {}: it leads outside {}", p.display(), root.display()),
            Err(e) => tracing::warn!("skipping {}: {e}", entry.path().display()),
        }
    }
    out.sort();
    out
}

/// Every file below `dir` (canonical), in name order; symlinks are followed only while they stay inside `root`.
pub(crate) fn walk(
    root: &Path,
    dir: &Path,
    depth: usize,
    ancestors: &mut Vec<PathBuf>,
    out: &mut Vec<PathBuf>,
) {
    if depth > MAX_DEPTH || ancestors.iter().any(|a| a == dir) {
        tracing::warn!("skipping {}: nested too deep or a symlink loop", dir.display());
        return;
    }
    let mut entries: Vec<_> = match fs::read_dir(dir) {
        Ok(e) => e.flatten().collect(),
        Err(e) => {
            tracing::warn!("skipping unreadable folder {}: {e}", dir.display());
            return;
        }
    };
    entries.sort_by_key(|e| e.file_name());
    ancestors.push(dir.to_path_buf());
    for entry in entries {
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let listed = entry.path();
        let Ok(file_type) = entry.file_type() else { continue };
        let (path, is_dir) = if file_type.is_symlink() {
            match fs::canonicalize(&listed) {
                Ok(t) if t.starts_with(root) => {
                    let is_dir = t.is_dir();
                    (t, is_dir)
                }
                Ok(t) => {
                    tracing::warn!(
                        "skipping {}: the symlink leads outside {} (to {})",
                        listed.display(),
                        root.display(),
                        t.display()
                    );
                    continue;
                }
                Err(e) => {
                    tracing::warn!("skipping {}: broken symlink ({e})", listed.display());
                    continue;
                }
            }
        } else {
            (listed, file_type.is_dir())
        };
        if is_dir {
            walk(root, &path, depth + 1, ancestors, out);
        } else {
            out.push(path);
        }
    }
    ancestors.pop();
}

struct Found<'a> {
    loras: Vec<Lora>,
    embeddings: Vec<Embedding>,
    refused: Vec<RefusedNetwork>,
    cache: &'a HashCache,
}

impl Found<'_> {
    fn file(&mut self, path: &Path, kind: Kind) {
        let Some(file_name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else { return };
        let lower = file_name.to_lowercase();
        let ext = lower.rsplit_once('.').map_or("", |(_, e)| e);
        let name = splitext_root(&file_name).to_string();
        let kind_name = match kind {
            Kind::Lora => "lora",
            Kind::Embedding => "embedding",
        };
        let refuse = |reason: String| RefusedNetwork {
            name: name.clone(),
            path: path.to_path_buf(),
            kind: kind_name,
            reason,
        };
        if PICKLE_EXTENSIONS.contains(&ext) {
            self.refused.push(refuse(format!(
                "pickle files are never loaded (unpickling can run arbitrary code): convert `{file_name}` to \
                 .safetensors"
            )));
            return;
        }
        if ext != "safetensors" {
            return;
        }
        let stamp = match fs::metadata(path) {
            Ok(m) => Stamp::of(&m),
            Err(e) => return self.refused.push(refuse(format!("cannot stat it: {e}"))),
        };
        let header = match header::read_header(path) {
            Ok(h) => h,
            Err(reason) => return self.refused.push(refuse(format!("invalid safetensors header: {reason}"))),
        };
        match kind {
            Kind::Lora => match classify_lora(&header) {
                Ok((format, dora)) => {
                    let alias = header
                        .metadata
                        .get("ss_output_name")
                        .and_then(Value::as_str)
                        .filter(|s| !s.trim().is_empty())
                        .map_or_else(|| name.clone(), str::to_string);
                    self.loras.push(Lora {
                        name: name.clone(),
                        alias,
                        path: path.to_path_buf(),
                        size: stamp.size,
                        format,
                        dora,
                        metadata: header.metadata,
                        sha256: self.cache.lookup_kind(path, stamp, HashKind::AfterHeader),
                    });
                }
                Err(reason) => self.refused.push(refuse(reason)),
            },
            Kind::Embedding => match classify_embedding(&header) {
                Ok((width, vectors)) => self.embeddings.push(Embedding {
                    name: name.clone(),
                    path: path.to_path_buf(),
                    size: stamp.size,
                    width,
                    vectors,
                    sha256: self.cache.lookup_kind(path, stamp, HashKind::File),
                }),
                Err(reason) => self.refused.push(refuse(reason)),
            },
        }
    }
}

/// The LoRA format its tensor names say, and whether it has DoRA magnitudes; or why it is no LoRA.
pub(crate) fn classify_lora(header: &Header) -> Result<(LoraFormat, bool), String> {
    let names = || header.tensors.iter().map(|(n, _)| n.as_str());
    let has = |pat: &str| names().any(|n| n.contains(pat));
    let dora = has("dora_scale") || has(".lora_magnitude_vector");
    let format = if has("hada_w1_a") {
        LoraFormat::LoHa
    } else if has("lokr_w1") {
        LoraFormat::LoKr
    } else if has("lora_A.") || has("lora_B.") {
        LoraFormat::Peft
    } else if has("lora_down") || has("lora_up") || has("lora.down") || has("lora.up") {
        LoraFormat::Lora
    } else if header::classify(&names().map(str::to_string).collect::<Vec<_>>(), "") != header::Kind::Other {
        return Err("this is a checkpoint or VAE, not a LoRA: move it to a models dir".into());
    } else if names().any(|n| n.starts_with("lora_unet_") || n.starts_with("lora_te")) {
        return Err(
            "a LyCORIS form other than LoRA, LoCon, LoHa and LoKr (e.g. full `diff` or (IA)^3): not supported"
                .into(),
        );
    } else {
        let first: Vec<&str> = names().take(3).collect();
        return Err(format!(
            "no LoRA tensors (`lora_down`/`lora_up`, `lora_A`/`lora_B`, `hada_*`, `lokr_*`); it holds {}",
            if first.is_empty() { "no tensors".to_string() } else { format!("e.g. {}", first.join(", ")) }
        ));
    };
    Ok((format, dora))
}

/// The text-encoder width and vector count of an embedding file: `clip_l`+`clip_g` (SDXL), `emb_params`, or a
/// single tensor of shape `[vectors, width]` or `[width]` (diffusers' `learned_embeds`).
pub(crate) fn classify_embedding(header: &Header) -> Result<(EmbeddingWidth, u64), String> {
    let get = |name: &str| header.tensors.iter().find(|(n, _)| n == name).map(|(_, s)| s.as_slice());
    let rows_cols = |shape: &[u64]| -> Option<(u64, u64)> {
        match shape {
            [w] => Some((1, *w)),
            [n, w] => Some((*n, *w)),
            _ => None,
        }
    };
    if let (Some(l), Some(g)) = (get("clip_l"), get("clip_g")) {
        let ((nl, wl), (ng, wg)) = rows_cols(l)
            .zip(rows_cols(g))
            .ok_or_else(|| format!("clip_l {l:?} / clip_g {g:?} are not [vectors, width] tensors"))?;
        if nl != ng {
            return Err(format!("clip_l has {nl} vectors but clip_g {ng}"));
        }
        return Ok((EmbeddingWidth::Pair { clip_l: wl, clip_g: wg }, ng));
    }
    let single = get("emb_params").or(match header.tensors.as_slice() {
        [(_, shape)] => Some(shape.as_slice()),
        _ => None,
    });
    match single {
        Some(shape) => {
            let (n, w) = rows_cols(shape).ok_or_else(|| format!("its tensor has shape {shape:?}, not [vectors, width]"))?;
            if n == 0 || w == 0 {
                return Err(format!("its tensor has an empty shape {shape:?}"));
            }
            Ok((EmbeddingWidth::Single(w), n))
        }
        None => Err(format!(
            "not a textual-inversion embedding: expected `emb_params`, `clip_l`+`clip_g` or one tensor, found {} \
             tensors",
            header.tensors.len()
        )),
    }
}

/// The text-encoder widths of a checkpoint, from its configs (diffusers folder) or its header (single file):
/// `[768]` for SD1.x, `[1024]` for SD2.x, `[768, 1280]` for SDXL, whatever sizes a small test model has.
/// `None` when neither says.
pub fn checkpoint_text_widths(path: &Path) -> Option<Vec<u64>> {
    if path.is_dir() {
        let hidden = |folder: &str| -> Option<u64> {
            let text = fs::read_to_string(path.join(folder).join("config.json")).ok()?;
            serde_json::from_str::<Value>(&text).ok()?.get("hidden_size")?.as_u64()
        };
        let first = hidden("text_encoder")?;
        return Some(std::iter::once(first).chain(hidden("text_encoder_2")).collect());
    }
    let header = header::read_header(path).ok()?;
    let width = |name: &str| {
        header.tensors.iter().find(|(n, _)| n == name).and_then(|(_, shape)| shape.get(1).copied())
    };
    let sdxl = (
        width("conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight"),
        width("conditioner.embedders.1.model.token_embedding.weight"),
    );
    if let (Some(l), Some(g)) = sdxl {
        return Some(vec![l, g]);
    }
    width("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight")
        .or_else(|| width("cond_stage_model.model.token_embedding.weight"))
        .map(|w| vec![w])
}
