//! What the catalogue lists (checkpoints, VAEs, refused files) and the A1111 names derived from a checkpoint's
//! path relative to its models dir: `model_name`, `name_for_extra`, `shorthash` and `title` are computed exactly
//! as `modules/sd_models.py` `CheckpointInfo` computes them, because clients send those strings back verbatim.

use std::path::PathBuf;

/// How a checkpoint is stored on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CheckpointFormat {
    /// A folder laid out by diffusers' `save_pretrained` (`model_index.json` plus component folders).
    Diffusers,
    /// A single-file (A1111/ComfyUI style) `.safetensors` checkpoint.
    SafeTensors,
    /// A single-file `.gguf` checkpoint (stable-diffusion.cpp style quantised weights).
    Gguf,
}

impl CheckpointFormat {
    pub fn name(&self) -> &'static str {
        match self {
            CheckpointFormat::Diffusers => "diffusers",
            CheckpointFormat::SafeTensors => "safetensors",
            CheckpointFormat::Gguf => "gguf",
        }
    }
}

/// One loadable checkpoint of the library.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// A1111's `name`: the path relative to its models dir with '/' separators, with the extension for files
    /// (`sub/a.safetensors`); the relative folder path for a diffusers folder (`sub/sd15`).
    pub name: String,
    /// A1111's `model_name`: `splitext(name.replace('/', '_'))[0]` (`sub_a`). Diffusers folders keep their whole
    /// name (`sub_sd1.5`), since a folder has no extension to drop.
    pub model_name: String,
    /// Canonical absolute path of the file, or of the diffusers folder.
    pub path: PathBuf,
    /// Canonical models dir it was found under.
    pub root: PathBuf,
    pub format: CheckpointFormat,
    /// File size in bytes; for a diffusers folder the sum of the files inside it.
    pub size: u64,
    /// Lower-case hex sha256 of the file, known from the hash cache at scan time or computed by
    /// `Catalog::ensure_hash`. Always `None` for diffusers folders: A1111 has no hash for them.
    pub sha256: Option<String>,
}

impl Checkpoint {
    pub(crate) fn new(
        name: String,
        path: PathBuf,
        root: PathBuf,
        format: CheckpointFormat,
        size: u64,
        sha256: Option<String>,
    ) -> Self {
        let underscored = name.replace('/', "_");
        let model_name = if format == CheckpointFormat::Diffusers {
            underscored
        } else {
            splitext_root(&underscored).to_string()
        };
        Checkpoint { name, model_name, path, root, format, size, sha256 }
    }

    /// The first 10 hex digits of the sha256, as A1111 shows them in titles.
    pub fn shorthash(&self) -> Option<&str> {
        self.sha256.as_deref().and_then(|s| s.get(..10))
    }

    /// A1111's `title`: `name [shorthash]`, or just `name` while unhashed.
    pub fn title(&self) -> String {
        match self.shorthash() {
            Some(short) => format!("{} [{short}]", self.name),
            None => self.name.clone(),
        }
    }

    /// A1111's `name_for_extra`: the file name without folders and extension; a diffusers folder's own name.
    pub fn name_for_extra(&self) -> &str {
        let base = self.name.rsplit('/').next().unwrap_or(&self.name);
        if self.format == CheckpointFormat::Diffusers {
            base
        } else {
            splitext_root(base)
        }
    }
}

/// A file under a models dir that looks like a checkpoint but will not be loaded, with why (shown in listings so
/// a user knows why their model is missing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// Path relative to its models dir, like `Checkpoint::name`.
    pub name: String,
    pub path: PathBuf,
    pub reason: String,
}

/// A standalone VAE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vae {
    /// The file name with extension, as A1111's `sd_vae` option values (`vae-ft-mse.safetensors`).
    pub name: String,
    /// Canonical absolute path.
    pub path: PathBuf,
    pub size: u64,
    /// Lower-case hex sha256, from the hash cache or `Catalog::ensure_vae_hash`.
    pub sha256: Option<String>,
}

/// Python's `os.path.splitext(s)[0]` for a name without separators: the last dot starts the extension unless only
/// dots precede it (`.hidden` has none).
pub(crate) fn splitext_root(s: &str) -> &str {
    match s.rfind('.') {
        Some(dot) if s[..dot].chars().any(|c| c != '.') => &s[..dot],
        _ => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ckpt(name: &str, format: CheckpointFormat, sha: Option<&str>) -> Checkpoint {
        Checkpoint::new(name.into(), PathBuf::new(), PathBuf::new(), format, 0, sha.map(String::from))
    }

    #[test]
    fn splitext_matches_python() {
        assert_eq!(splitext_root("a.safetensors"), "a");
        assert_eq!(splitext_root("a.b.safetensors"), "a.b");
        assert_eq!(splitext_root("noext"), "noext");
        assert_eq!(splitext_root(".hidden"), ".hidden");
        assert_eq!(splitext_root("..x"), "..x");
        assert_eq!(splitext_root("..x.y"), "..x");
        assert_eq!(splitext_root("trailing."), "trailing");
    }

    #[test]
    fn a1111_names() {
        let c = ckpt("sub/a.b.safetensors", CheckpointFormat::SafeTensors, None);
        assert_eq!(c.model_name, "sub_a.b");
        assert_eq!(c.name_for_extra(), "a.b");
        assert_eq!(c.title(), "sub/a.b.safetensors");
        assert_eq!(c.shorthash(), None);

        let sha = "0123456789abcdef".repeat(4);
        let c = ckpt("a.safetensors", CheckpointFormat::SafeTensors, Some(&sha));
        assert_eq!(c.shorthash(), Some("0123456789"));
        assert_eq!(c.title(), "a.safetensors [0123456789]");

        let d = ckpt("sub/sd1.5", CheckpointFormat::Diffusers, None);
        assert_eq!(d.model_name, "sub_sd1.5");
        assert_eq!(d.name_for_extra(), "sd1.5");
    }
}
