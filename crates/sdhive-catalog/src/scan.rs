//! The walk over the models and VAE folders: which entries become checkpoints, VAEs or refusals. Every walk is
//! confined to its canonical root (a symlink leading out of it is skipped, so a library cannot be made to list
//! or later serve files elsewhere on the host), and reads at most a safetensors or GGUF header per file, so
//! start-up stays fast however large the library is. Hashes come only from the cache here.

use crate::entry::{Checkpoint, CheckpointFormat, Refused, Vae};
use crate::hash::{HashCache, Stamp};
use crate::header::{self, Kind};
use crate::{CatalogConfig, CatalogError};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Folders of other model kinds in an A1111 `models/` tree (lower-cased); their safetensors are not checkpoints.
/// `VAE-taesd` (ComfyUI: `vae_approx`) and the `taesd`/`taesdxl` diffusers folders hold the preview decoders
/// (`serve --preview`).
const SKIPPED_DIRS: [&str; 11] = [
    "lora",
    "lycoris",
    "embeddings",
    "esrgan",
    "realesrgan",
    "hypernetworks",
    "controlnet",
    "vae-taesd",
    "vae_approx",
    "taesd",
    "taesdxl",
];

/// Pickle formats: refused by extension, never opened.
const PICKLE_EXTENSIONS: [&str; 3] = ["ckpt", "pt", "pth"];

/// Deeper than any real library; stops pathological symlink chains that are not strictly loops.
const MAX_DEPTH: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// A models dir: classify files.
    Models,
    /// A VAE folder: every `.safetensors` is a VAE.
    Vae,
}

/// What the walk found; `usize` is the index of the configured folder (models dirs first, then VAE dirs), the
/// tie-break of the catalogue's ordering.
#[derive(Debug, Default)]
pub(crate) struct Found {
    pub checkpoints: Vec<(usize, Checkpoint)>,
    pub refused: Vec<(usize, Refused)>,
    pub vaes: Vec<(usize, Vae)>,
}

pub(crate) fn scan(config: &CatalogConfig, cache: &HashCache) -> Result<Found, CatalogError> {
    let mut found = Found::default();
    let dirs = config
        .models_dirs
        .iter()
        .map(|d| (d, "models", Mode::Models))
        .chain(config.vae_dirs.iter().map(|d| (d, "VAE", Mode::Vae)));
    let mut seen: Vec<(PathBuf, Mode)> = Vec::new();
    for (source, (dir, kind, mode)) in dirs.enumerate() {
        let root =
            fs::canonicalize(dir).map_err(|e| CatalogError::Dir { kind, path: dir.clone(), source: e })?;
        if !root.is_dir() {
            return Err(CatalogError::NotADir { kind, path: dir.clone() });
        }
        // The same folder configured twice (perhaps through a symlink) would list everything twice.
        if seen.contains(&(root.clone(), mode)) {
            tracing::debug!("{kind} dir {} is configured twice; scanning it once", dir.display());
            continue;
        }
        seen.push((root.clone(), mode));
        let mut walker = Walker { root: &root, source, cache, found: &mut found, ancestors: Vec::new() };
        if mode == Mode::Models && root.join("model_index.json").is_file() {
            // A models dir that is itself one diffusers folder: list it under its own name.
            let name =
                root.file_name().map_or_else(|| root.display().to_string(), |n| n.to_string_lossy().into());
            walker.diffusers(&root, &name);
            continue;
        }
        walker.walk(&root, "", mode, 0).map_err(|e| CatalogError::Dir {
            kind,
            path: dir.clone(),
            source: e,
        })?;
    }
    Ok(found)
}

struct Walker<'a> {
    root: &'a Path,
    source: usize,
    cache: &'a HashCache,
    found: &'a mut Found,
    /// Canonical folders on the way down from the root: entering one again would be a symlink loop.
    ancestors: Vec<PathBuf>,
}

impl Walker<'_> {
    /// Lists `dir` (canonical) whose path relative to the root, as the user sees it, is `rel`. Only failing to
    /// list `dir` itself is an error; everything below is skipped with a warning.
    fn walk(&mut self, dir: &Path, rel: &str, mode: Mode, depth: usize) -> io::Result<()> {
        let mut entries = Vec::new();
        for entry in fs::read_dir(dir)? {
            match entry {
                Ok(e) => entries.push(e),
                Err(e) => tracing::warn!("skipping an entry of {}: {e}", dir.display()),
            }
        }
        entries.sort_by_key(|e| e.file_name());
        self.ancestors.push(dir.to_path_buf());
        for entry in entries {
            let file_name = entry.file_name();
            let name = file_name.to_string_lossy();
            if name.starts_with('.') {
                continue;
            }
            let rel = if rel.is_empty() { name.to_string() } else { format!("{rel}/{name}") };
            // `dir` is canonical, so a child that is not a symlink is canonical as it stands.
            let listed = dir.join(&file_name);
            let file_type = match entry.file_type() {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!("skipping {}: {e}", listed.display());
                    continue;
                }
            };
            let (path, is_dir) = if file_type.is_symlink() {
                match self.follow(&listed) {
                    Some(target) => target,
                    None => continue,
                }
            } else {
                (listed, file_type.is_dir())
            };
            if is_dir {
                self.dir(&path, &name, &rel, mode, depth + 1);
            } else {
                self.file(&path, &name, &rel, mode);
            }
        }
        self.ancestors.pop();
        Ok(())
    }

    /// Resolves a symlink, keeping it only if it stays inside the root.
    fn follow(&self, link: &Path) -> Option<(PathBuf, bool)> {
        let target = match fs::canonicalize(link) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!("skipping {}: broken symlink ({e})", link.display());
                return None;
            }
        };
        if !target.starts_with(self.root) {
            tracing::warn!(
                "skipping {}: the symlink leads outside {} (to {})",
                link.display(),
                self.root.display(),
                target.display()
            );
            return None;
        }
        match fs::metadata(&target) {
            Ok(m) => Some((target, m.is_dir())),
            Err(e) => {
                tracing::warn!("skipping {}: {e}", link.display());
                None
            }
        }
    }

    fn dir(&mut self, path: &Path, name: &str, rel: &str, mode: Mode, depth: usize) {
        if self.ancestors.iter().any(|a| a == path) {
            tracing::warn!("skipping {}: symlink loop", self.root.join(rel).display());
            return;
        }
        if depth > MAX_DEPTH {
            tracing::warn!(
                "skipping {}: nested deeper than {MAX_DEPTH} folders",
                self.root.join(rel).display()
            );
            return;
        }
        let mut mode = mode;
        if mode == Mode::Models {
            if path.join("model_index.json").is_file() {
                self.diffusers(path, rel);
                return;
            }
            let lower = name.to_lowercase();
            if lower == "vae" {
                mode = Mode::Vae;
            } else if SKIPPED_DIRS.contains(&lower.as_str()) {
                tracing::debug!("skipping {}: not a checkpoint folder", path.display());
                return;
            }
        }
        if let Err(e) = self.walk(path, rel, mode, depth) {
            tracing::warn!("skipping unreadable folder {}: {e}", path.display());
        }
    }

    fn file(&mut self, path: &Path, name: &str, rel: &str, mode: Mode) {
        let lower = name.to_lowercase();
        let ext = lower.rsplit_once('.').map_or("", |(_, e)| e);
        match (mode, ext) {
            (Mode::Vae, "safetensors") => self.vae(path, name),
            (Mode::Vae, e) if PICKLE_EXTENSIONS.contains(&e) => {
                tracing::warn!("skipping VAE {}: pickle files are never loaded", path.display());
            }
            (Mode::Models, "safetensors") => match header::tensor_names(path) {
                Err(reason) => self.refuse(path, rel, format!("invalid safetensors header: {reason}")),
                Ok(names) => match header::classify(&names, &lower) {
                    Kind::Checkpoint => self.checkpoint(path, rel, CheckpointFormat::SafeTensors),
                    Kind::Vae => self.vae(path, name),
                    Kind::Other => {
                        tracing::debug!("ignoring {}: neither a checkpoint nor a VAE", path.display());
                    }
                },
            },
            (Mode::Models, "gguf") => {
                match crate::gguf::read_header(path).and_then(|h| h.sd_checkpoint().map(drop)) {
                    Ok(()) => self.checkpoint(path, rel, CheckpointFormat::Gguf),
                    Err(reason) => self.refuse(path, rel, format!("GGUF file: {reason}")),
                }
            }
            (Mode::Models, e) if PICKLE_EXTENSIONS.contains(&e) => {
                let stem = crate::entry::splitext_root(name);
                let reason = format!(
                    "pickle checkpoints are never loaded (unpickling can run arbitrary code): convert it to \
                     .safetensors (e.g. in Python: `sd = torch.load(\"{name}\", weights_only=True); \
                     safetensors.torch.save_file(sd.get(\"state_dict\", sd), \"{stem}.safetensors\")`)"
                );
                self.refuse(path, rel, reason);
            }
            _ => {}
        }
    }

    fn checkpoint(&mut self, path: &Path, rel: &str, format: CheckpointFormat) {
        let stamp = match fs::metadata(path) {
            Ok(m) => Stamp::of(&m),
            Err(e) => return self.refuse(path, rel, format!("cannot stat it: {e}")),
        };
        let sha256 = self.cache.lookup(path, stamp);
        let ckpt = Checkpoint::new(
            rel.to_string(),
            path.to_path_buf(),
            self.root.to_path_buf(),
            format,
            stamp.size,
            sha256,
        );
        self.found.checkpoints.push((self.source, ckpt));
    }

    fn diffusers(&mut self, path: &Path, rel: &str) {
        let size = dir_size(path, self.root, 0);
        let ckpt = Checkpoint::new(
            rel.to_string(),
            path.to_path_buf(),
            self.root.to_path_buf(),
            CheckpointFormat::Diffusers,
            size,
            None,
        );
        self.found.checkpoints.push((self.source, ckpt));
    }

    fn vae(&mut self, path: &Path, name: &str) {
        let stamp = match fs::metadata(path) {
            Ok(m) => Stamp::of(&m),
            Err(e) => {
                tracing::warn!("skipping VAE {}: {e}", path.display());
                return;
            }
        };
        let vae = Vae {
            name: name.to_string(),
            path: path.to_path_buf(),
            size: stamp.size,
            sha256: self.cache.lookup(path, stamp),
        };
        self.found.vaes.push((self.source, vae));
    }

    fn refuse(&mut self, path: &Path, rel: &str, reason: String) {
        tracing::warn!("not listing {}: {reason}", path.display());
        let refused = Refused { name: rel.to_string(), path: path.to_path_buf(), reason };
        self.found.refused.push((self.source, refused));
    }
}

/// Total size of the files in a diffusers folder. Informational only, so unreadable entries count as zero;
/// symlinked files count only if they stay inside the root, and symlinked folders not at all (no loops).
fn dir_size(dir: &Path, root: &Path, depth: usize) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else { return 0 };
    let mut total = 0;
    for entry in entries.flatten() {
        let Ok(file_type) = entry.file_type() else { continue };
        let path = entry.path();
        if file_type.is_dir() {
            if depth < MAX_DEPTH {
                total += dir_size(&path, root, depth + 1);
            }
        } else if file_type.is_symlink() {
            let inside = fs::canonicalize(&path).is_ok_and(|t| t.starts_with(root));
            if let (true, Ok(meta)) = (inside, fs::metadata(&path)) {
                if meta.is_file() {
                    total += meta.len();
                }
            }
        } else if let Ok(meta) = entry.metadata() {
            total += meta.len();
        }
    }
    total
}
