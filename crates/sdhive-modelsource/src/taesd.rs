//! Finding the TAESD preview decoders (`taesd` for SD1/SD2 latents, `taesdxl` for SDXL's) where people keep
//! them: A1111's `VAE-taesd/<name>_decoder.safetensors` (ComfyUI's `vae_approx/`) or a diffusers folder `<name>/`
//! inside a models dir, or madebyollin's repo in the Hugging Face cache (`models--madebyollin--<name>`, the
//! snapshot `refs/main` names). Only local files: a preview decoder is never downloaded. Pickles (`.pth`) are
//! noted, never loaded.

use crate::diffusers::find_weights;
use crate::hub::cached_snapshot;
use crate::repo_id::RepoRef;
use std::fmt;
use std::path::{Path, PathBuf};

/// Which latent space a TAESD decoder reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaesdKind {
    /// SD1.x / SD2.x latents: `taesd`.
    Sd,
    /// SDXL latents: `taesdxl`.
    Sdxl,
}

impl TaesdKind {
    pub const ALL: [TaesdKind; 2] = [TaesdKind::Sd, TaesdKind::Sdxl];

    /// `taesd` / `taesdxl`: the folder, file stem and repo name it goes by.
    pub fn name(self) -> &'static str {
        match self {
            TaesdKind::Sd => "taesd",
            TaesdKind::Sdxl => "taesdxl",
        }
    }

    /// The Hugging Face repo that publishes it.
    pub fn repo(self) -> String {
        format!("madebyollin/{}", self.name())
    }
}

/// No decoder of `kind` in any of the places looked at.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct TaesdNotFound {
    pub kind: TaesdKind,
    /// Every file or folder that would have been taken, in the order they are tried.
    pub looked_at: Vec<PathBuf>,
    /// Pickle files of the decoder that were seen and skipped.
    pub pickles: Vec<PathBuf>,
}

impl fmt::Display for TaesdNotFound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let places: Vec<String> = self.looked_at.iter().map(|p| p.display().to_string()).collect();
        write!(f, "no {} decoder found; looked for {}", self.kind.name(), places.join(", "))?;
        for p in &self.pickles {
            write!(
                f,
                "; {} is a pickle file, never loaded: convert it to .safetensors or use the .safetensors from {}",
                p.display(),
                self.kind.repo()
            )?;
        }
        Ok(())
    }
}

/// The folders of a models dir that hold taesd.py's decoder files: A1111's, then ComfyUI's.
const DECODER_FOLDERS: [&str; 2] = ["VAE-taesd", "vae_approx"];

/// The decoder of `kind`: a `.safetensors` file in taesd.py's layout or a diffusers folder (`config.json` and
/// its weights), from the first of: each models dir's `VAE-taesd/<name>_decoder.safetensors`, then
/// `vae_approx/<name>_decoder.safetensors`, then its `<name>/` folder; then madebyollin/`<name>`'s snapshot in
/// `hub_cache` (its diffusers files, else its `<name>_decoder.safetensors`).
pub fn find_taesd(
    kind: TaesdKind,
    models_dirs: &[PathBuf],
    hub_cache: &Path,
) -> Result<PathBuf, TaesdNotFound> {
    let name = kind.name();
    let mut looked_at = Vec::new();
    let mut pickles = Vec::new();
    let decoder_file = format!("{name}_decoder.safetensors");
    for dir in models_dirs {
        for folder in DECODER_FOLDERS {
            let file = dir.join(folder).join(&decoder_file);
            if file.is_file() {
                return Ok(file);
            }
            looked_at.push(file);
            let pickle = dir.join(folder).join(format!("{name}_decoder.pth"));
            if pickle.is_file() {
                pickles.push(pickle);
            }
        }
        let folder = dir.join(name);
        if is_diffusers_folder(&folder) {
            return Ok(folder);
        }
        looked_at.push(folder);
    }
    let repo = RepoRef { id: kind.repo(), revision: "main".into() };
    let repo_dir = hub_cache.join(repo.cache_folder());
    match cached_snapshot(&repo_dir, &repo.revision) {
        Some(snapshot) => {
            if is_diffusers_folder(&snapshot) {
                return Ok(snapshot);
            }
            let file = snapshot.join(&decoder_file);
            if file.is_file() {
                return Ok(file);
            }
            looked_at.push(snapshot);
        }
        None => looked_at.push(repo_dir),
    }
    Err(TaesdNotFound { kind, looked_at, pickles })
}

/// A diffusers model folder: `config.json` and safetensors weights.
fn is_diffusers_folder(dir: &Path) -> bool {
    dir.join("config.json").is_file() && find_weights(dir).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    const HASH: &str = "0123456789abcdef0123456789abcdef01234567";

    fn touch(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"x").unwrap();
    }

    fn diffusers_folder(dir: &Path) {
        touch(&dir.join("config.json"));
        touch(&dir.join("diffusion_pytorch_model.safetensors"));
    }

    #[test]
    fn a1111_folder_then_diffusers_folder_then_the_hub_cache() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b, hub) = (tmp.path().join("a"), tmp.path().join("b"), tmp.path().join("hub"));
        let dirs = vec![a.clone(), b.clone()];
        let err = find_taesd(TaesdKind::Sd, &dirs, &hub).unwrap_err();
        assert_eq!(
            err.looked_at,
            [
                a.join("VAE-taesd/taesd_decoder.safetensors"),
                a.join("vae_approx/taesd_decoder.safetensors"),
                a.join("taesd"),
                b.join("VAE-taesd/taesd_decoder.safetensors"),
                b.join("vae_approx/taesd_decoder.safetensors"),
                b.join("taesd"),
                hub.join("models--madebyollin--taesd"),
            ]
        );
        let message = err.to_string();
        assert!(
            message.contains("no taesd decoder") && message.contains("models--madebyollin--taesd"),
            "{message}"
        );

        // The hub cache as huggingface_hub lays it out: refs/main names the snapshot.
        let repo = hub.join("models--madebyollin--taesd");
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), HASH).unwrap();
        let snapshot = repo.join("snapshots").join(HASH);
        touch(&snapshot.join("taesd_decoder.safetensors"));
        assert_eq!(find_taesd(TaesdKind::Sd, &dirs, &hub), Ok(snapshot.join("taesd_decoder.safetensors")));
        diffusers_folder(&snapshot);
        assert_eq!(find_taesd(TaesdKind::Sd, &dirs, &hub), Ok(snapshot.clone()));
        // SDXL's decoder is another repo.
        let err = find_taesd(TaesdKind::Sdxl, &dirs, &hub).unwrap_err();
        assert_eq!(err.looked_at.last(), Some(&hub.join("models--madebyollin--taesdxl")));

        // A folder without weights is not a decoder; with them it is, and a models dir beats the cache.
        touch(&b.join("taesd/config.json"));
        assert_eq!(find_taesd(TaesdKind::Sd, &dirs, &hub), Ok(snapshot));
        touch(&b.join("taesd/diffusion_pytorch_model.safetensors"));
        assert_eq!(find_taesd(TaesdKind::Sd, &dirs, &hub), Ok(b.join("taesd")));
        touch(&b.join("vae_approx/taesd_decoder.safetensors"));
        assert_eq!(
            find_taesd(TaesdKind::Sd, &dirs, &hub),
            Ok(b.join("vae_approx/taesd_decoder.safetensors"))
        );
        touch(&b.join("VAE-taesd/taesd_decoder.safetensors"));
        assert_eq!(find_taesd(TaesdKind::Sd, &dirs, &hub), Ok(b.join("VAE-taesd/taesd_decoder.safetensors")));
        touch(&a.join("VAE-taesd/taesd_decoder.safetensors"));
        assert_eq!(find_taesd(TaesdKind::Sd, &dirs, &hub), Ok(a.join("VAE-taesd/taesd_decoder.safetensors")));
    }

    #[test]
    fn pickles_are_named_in_the_error_and_never_taken() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        touch(&dir.join("VAE-taesd/taesdxl_decoder.pth"));
        let err =
            find_taesd(TaesdKind::Sdxl, std::slice::from_ref(&dir), &tmp.path().join("hub")).unwrap_err();
        assert_eq!(err.pickles, [dir.join("VAE-taesd/taesdxl_decoder.pth")]);
        let message = err.to_string();
        assert!(message.contains("taesdxl_decoder.pth is a pickle file"), "{message}");
    }
}
