//! Owns the meaning of the one `--model` argument: turning a local diffusers folder, a `.safetensors` or `.gguf`
//! file or a Hugging Face repo id into a checked, canonical location an engine can load, without letting the argument
//! reach files it should not (model roots, repo-id validation) and without ever loading pickle checkpoints.
//! Also finds the TAESD preview decoders in the models dirs and the hub cache (`taesd`).

mod diffusers;
mod error;
mod hub;
mod local;
mod options;
mod repo_id;
mod taesd;

pub use diffusers::{find_weights, Component, ComponentKind, ModelIndex, WeightsFiles};
pub use error::SourceError;
pub use options::{default_hub_cache, ResolveOptions};
pub use repo_id::RepoRef;
pub use taesd::{find_taesd, TaesdKind, TaesdNotFound};

use std::path::{Path, PathBuf};

/// Where a resolved model lives on disk. Both paths are canonical.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelLocation {
    /// A folder laid out by diffusers' `save_pretrained` (`model_index.json` plus one folder per component),
    /// checked to hold every component's config and `.safetensors` weights.
    DiffusersDir(PathBuf),
    /// A single-file checkpoint: an original-layout `.safetensors` (A1111/ComfyUI style) or a `.gguf` (the
    /// stable-diffusion.cpp engine's quantised form; see [`ModelLocation::is_gguf`]), its header checked.
    SingleFile(PathBuf),
}

/// A model ready to hand to an engine: a display name (used in infotext and `/v1/info`) and its location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedModel {
    pub name: String,
    pub location: ModelLocation,
    /// A standalone VAE file that replaces the model's own (A1111's `sd_vae`); `None` keeps the model's.
    pub vae: Option<PathBuf>,
}

impl ModelLocation {
    pub fn path(&self) -> &Path {
        match self {
            ModelLocation::DiffusersDir(p) | ModelLocation::SingleFile(p) => p,
        }
    }

    /// A single file in GGUF form, by its magic: a hub-cache blob has no extension to go by.
    pub fn is_gguf(&self) -> bool {
        let ModelLocation::SingleFile(path) = self else { return false };
        let mut magic = [0u8; 4];
        std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic)).is_ok()
            && &magic == b"GGUF"
    }
}

/// Resolves a standalone VAE file (A1111's `sd_vae`): it must exist inside the model roots and be a `.safetensors`
/// file; pickles are refused.
pub fn resolve_vae(path: &Path, opts: &ResolveOptions) -> Result<PathBuf, SourceError> {
    local::resolve_vae(&local::expand_home(&path.to_string_lossy()), opts)
}

/// Resolves `arg` in this order: an existing path (diffusers folder, `.safetensors` or `.gguf` file), else a path-looking
/// argument is reported missing, else a Hugging Face repo id `org/name[@revision]` looked up in the hub cache and
/// downloaded there when incomplete (unless offline).
pub fn resolve(arg: &str, opts: &ResolveOptions) -> Result<ResolvedModel, SourceError> {
    let trimmed = arg.trim();
    if trimmed.is_empty() {
        return Err(SourceError::Empty);
    }
    let path = local::expand_home(trimmed);
    // symlink_metadata so that a dangling symlink counts as "given as a path" and is reported as missing.
    if path.symlink_metadata().is_ok() {
        return local::resolve_path(&path, opts);
    }
    if local::looks_like_path(trimmed) {
        return Err(SourceError::NotFound { path });
    }
    if repo_id::looks_like_repo_id(trimmed) {
        let repo = RepoRef::parse(trimmed)?;
        return hub::resolve_repo(&repo, opts);
    }
    Err(SourceError::NeitherPathNorRepo { arg: trimmed.to_string() })
}
