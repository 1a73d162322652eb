//! Local model paths: canonicalisation and model-root confinement (checked on the canonical path, so `..` and
//! symlinks cannot escape), format detection, and a header check of single `.safetensors` and `.gguf` files so a
//! truncated or mislabelled file fails here with its name rather than deep inside an engine.

use crate::diffusers;
use crate::{ModelLocation, ResolveOptions, ResolvedModel, SourceError};
use std::fs::File;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

/// Extensions of pickle-based checkpoints: loading one can execute code, so they are refused by name.
const PICKLE_EXTENSIONS: [&str; 5] = ["ckpt", "pt", "pth", "bin", "pkl"];

/// A real header is a few hundred KB at most; the cap stops a corrupt length from allocating gigabytes.
const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

/// `~` and `~/x` as a shell would expand them, for arguments passed through config files or quoted.
pub(crate) fn expand_home(arg: &str) -> PathBuf {
    let home = || std::env::var_os("HOME").filter(|h| !h.is_empty()).map(PathBuf::from);
    if arg == "~" {
        if let Some(h) = home() {
            return h;
        }
    } else if let Some(rest) = arg.strip_prefix("~/") {
        if let Some(h) = home() {
            return h.join(rest);
        }
    }
    PathBuf::from(arg)
}

/// Whether a missing `arg` was clearly meant as a path (so "not found" is the right error, not a repo lookup).
/// Only the part before `@` counts, so a repo id with a bad revision is still reported as a bad repo id.
pub(crate) fn looks_like_path(arg: &str) -> bool {
    let head = arg.split_once('@').map_or(arg, |(head, _)| head);
    let lower = head.to_ascii_lowercase();
    let model_ext = lower
        .rsplit_once('.')
        .is_some_and(|(_, e)| ["safetensors", "sft", "gguf"].contains(&e) || PICKLE_EXTENSIONS.contains(&e));
    Path::new(arg).is_absolute()
        || matches!(head, "." | "..")
        || head.starts_with("./")
        || head.starts_with("../")
        || head.starts_with('~')
        || head.contains('\\')
        || head.ends_with('/')
        || head.matches('/').count() >= 2
        || model_ext
}

pub(crate) fn resolve_path(path: &Path, opts: &ResolveOptions) -> Result<ResolvedModel, SourceError> {
    let canonical = std::fs::canonicalize(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => SourceError::NotFound { path: path.to_path_buf() },
        _ => SourceError::io(path, e),
    })?;
    check_roots(path, &canonical, &opts.model_roots)?;
    let meta = std::fs::metadata(&canonical).map_err(|e| SourceError::io(path, e))?;
    let name = display_name(path, &canonical, meta.is_dir());
    if meta.is_dir() {
        if !canonical.join("model_index.json").is_file() {
            return Err(SourceError::UnknownFormat {
                path: path.to_path_buf(),
                reason:
                    "a folder without model_index.json (expected a diffusers folder or a .safetensors file)"
                        .into(),
            });
        }
        diffusers::check_complete(&canonical)?;
        return Ok(ResolvedModel { name, location: ModelLocation::DiffusersDir(canonical), vae: None });
    }
    // The given name decides the format: hub-cache blobs that snapshot symlinks point at have no extension.
    let ext = path
        .extension()
        .or_else(|| canonical.extension())
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .unwrap_or_default();
    if ext == "safetensors" || ext == "sft" {
        check_safetensors_header(&canonical)
            .map_err(|reason| SourceError::InvalidSafetensors { path: path.to_path_buf(), reason })?;
        return Ok(ResolvedModel { name, location: ModelLocation::SingleFile(canonical), vae: None });
    }
    if ext == "gguf" {
        // Checked as far as its header can tell (framing, a whole Stable Diffusion checkpoint); which engines
        // load it is the worker's business.
        sdhive_catalog::gguf::read_header(&canonical)
            .and_then(|h| h.sd_checkpoint())
            .map_err(|reason| SourceError::InvalidGguf { path: path.to_path_buf(), reason })?;
        return Ok(ResolvedModel { name, location: ModelLocation::SingleFile(canonical), vae: None });
    }
    if PICKLE_EXTENSIONS.contains(&ext.as_str()) {
        return Err(SourceError::PickleUnsupported { path: path.to_path_buf() });
    }
    Err(SourceError::UnknownFormat {
        path: path.to_path_buf(),
        reason:
            "expected a .safetensors or .gguf checkpoint, or a diffusers folder containing model_index.json"
                .into(),
    })
}

/// A standalone VAE file: canonical, inside the roots, a `.safetensors` whose framing is sound.
pub(crate) fn resolve_vae(path: &Path, opts: &ResolveOptions) -> Result<PathBuf, SourceError> {
    let canonical = std::fs::canonicalize(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => SourceError::NotFound { path: path.to_path_buf() },
        _ => SourceError::io(path, e),
    })?;
    check_roots(path, &canonical, &opts.model_roots)?;
    let ext = canonical.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).unwrap_or_default();
    if PICKLE_EXTENSIONS.contains(&ext.as_str()) {
        return Err(SourceError::PickleUnsupported { path: path.to_path_buf() });
    }
    if ext != "safetensors" {
        return Err(SourceError::UnknownFormat {
            path: path.to_path_buf(),
            reason: "a VAE must be a .safetensors file".into(),
        });
    }
    check_safetensors_header(&canonical)
        .map_err(|reason| SourceError::InvalidSafetensors { path: path.to_path_buf(), reason })?;
    Ok(canonical)
}

/// Refuses `canonical` unless it lies inside a root. Roots that do not exist confine nothing and are skipped.
fn check_roots(given: &Path, canonical: &Path, roots: &[PathBuf]) -> Result<(), SourceError> {
    if roots.is_empty() {
        return Ok(());
    }
    let inside =
        roots.iter().filter_map(|r| std::fs::canonicalize(r).ok()).any(|root| canonical.starts_with(&root));
    if inside {
        Ok(())
    } else {
        Err(SourceError::OutsideRoots {
            path: given.to_path_buf(),
            roots: roots.iter().map(|r| r.display().to_string()).collect::<Vec<_>>().join(", "),
        })
    }
}

/// The folder or file name the user chose, falling back to the canonical one for arguments like `.`.
fn display_name(given: &Path, canonical: &Path, is_dir: bool) -> String {
    let pick = |p: &Path| -> Option<String> {
        let last = p.components().next_back()?;
        let Component::Normal(_) = last else { return None };
        let s = if is_dir { p.file_name()? } else { p.file_stem()? };
        Some(s.to_string_lossy().into_owned())
    };
    pick(given).or_else(|| pick(canonical)).unwrap_or_else(|| canonical.display().to_string())
}

/// Validates the safetensors framing: an 8-byte little-endian header length, a JSON object header, and every
/// tensor's byte range inside the file. Reads only the header.
pub(crate) fn check_safetensors_header(path: &Path) -> Result<(), String> {
    let mut file = File::open(path).map_err(|e| e.to_string())?;
    let file_len = file.metadata().map_err(|e| e.to_string())?.len();
    if file_len < 8 {
        return Err(format!("the file is only {file_len} bytes long"));
    }
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes).map_err(|e| e.to_string())?;
    let header_len = u64::from_le_bytes(len_bytes);
    if !(2..=MAX_HEADER_BYTES).contains(&header_len) || header_len > file_len - 8 {
        return Err(format!("header length {header_len} does not fit a {file_len}-byte file"));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(|e| e.to_string())?;
    let header: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| format!("the header is not JSON: {e}"))?;
    let tensors = header.as_object().ok_or("the header is not a JSON object")?;
    let data_len = file_len - 8 - header_len;
    let mut count = 0usize;
    for (name, info) in tensors {
        if name == "__metadata__" {
            continue;
        }
        let offsets = info
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .and_then(|o| Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?)))
            .ok_or_else(|| format!("tensor {name:?} has no valid data_offsets"))?;
        if offsets.0 > offsets.1 || offsets.1 > data_len {
            return Err(format!(
                "tensor {name:?} spans bytes {}..{} but the data section is {data_len} bytes (truncated file?)",
                offsets.0, offsets.1
            ));
        }
        count += 1;
    }
    if count == 0 {
        return Err("it holds no tensors".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_safetensors(path: &Path, data_len: usize, claimed_end: usize) {
        let header = format!(
            r#"{{"__metadata__":{{"format":"pt"}},"w":{{"dtype":"F32","shape":[{}],"data_offsets":[0,{claimed_end}]}}}}"#,
            claimed_end / 4
        );
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend(std::iter::repeat_n(0u8, data_len));
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn safetensors_header_check() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.safetensors");
        write_safetensors(&good, 16, 16);
        check_safetensors_header(&good).unwrap();
        let truncated = dir.path().join("t.safetensors");
        write_safetensors(&truncated, 8, 16);
        assert!(check_safetensors_header(&truncated).unwrap_err().contains("truncated"));
        let garbage = dir.path().join("g.safetensors");
        std::fs::write(&garbage, b"this is definitely not a safetensors file").unwrap();
        assert!(check_safetensors_header(&garbage).unwrap_err().contains("header length"));
        let tiny = dir.path().join("tiny.safetensors");
        std::fs::write(&tiny, b"abc").unwrap();
        assert!(check_safetensors_header(&tiny).is_err());
    }

    #[test]
    fn path_shapes() {
        assert!(looks_like_path("/models/x"));
        assert!(looks_like_path("./x"));
        assert!(looks_like_path("x.safetensors"));
        assert!(looks_like_path("org/x.ckpt"));
        assert!(looks_like_path("a/b/c"));
        assert!(!looks_like_path("org/name"));
        assert!(!looks_like_path("org/name@v1.0"));
        assert!(!looks_like_path("org/name@../../x"));
        assert!(looks_like_path("../x"));
    }

    #[test]
    fn display_names() {
        assert_eq!(display_name(Path::new("models/sd15/"), Path::new("/m/sd15"), true), "sd15");
        assert_eq!(display_name(Path::new("."), Path::new("/m/sd15"), true), "sd15");
        assert_eq!(display_name(Path::new("a/dream.safetensors"), Path::new("/b/blob"), false), "dream");
    }
}
