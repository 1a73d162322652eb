//! Where generated images go: the `-o` path for one image, numbered siblings for several, and the up-front
//! check that the target folder exists so a long generation is not wasted on an unwritable path.

use anyhow::bail;
use std::path::{Path, PathBuf};

/// `n == 1` → exactly `out`; otherwise `stem-0.ext`, `stem-1.ext`, … in the same folder.
pub fn output_paths(out: &Path, n: u32) -> Vec<PathBuf> {
    if n == 1 {
        return vec![out.to_path_buf()];
    }
    let stem = out.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let ext = out.extension().map(|e| format!(".{}", e.to_string_lossy())).unwrap_or_default();
    (0..n).map(|i| out.with_file_name(format!("{stem}-{i}{ext}"))).collect()
}

/// Refuses an output path whose folder is missing or which is itself a folder.
pub fn check_output_path(out: &Path) -> anyhow::Result<()> {
    if out.file_name().is_none() || out.is_dir() {
        bail!(
            "-o {}: is a directory; give a file name such as {}",
            out.display(),
            out.join("out.png").display()
        );
    }
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !parent.is_dir() {
        bail!("-o {}: output directory {} does not exist (create it first)", out.display(), parent.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbered_paths_only_for_batches() {
        assert_eq!(output_paths(Path::new("a/out.png"), 1), [PathBuf::from("a/out.png")]);
        assert_eq!(
            output_paths(Path::new("a/out.png"), 3),
            [PathBuf::from("a/out-0.png"), PathBuf::from("a/out-1.png"), PathBuf::from("a/out-2.png")]
        );
        assert_eq!(output_paths(Path::new("img"), 2), [PathBuf::from("img-0"), PathBuf::from("img-1")]);
    }

    #[test]
    fn missing_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        check_output_path(&dir.path().join("x.png")).unwrap();
        check_output_path(Path::new("x.png")).unwrap();
        let msg = check_output_path(&dir.path().join("nope/x.png")).unwrap_err().to_string();
        assert!(msg.contains("does not exist") && msg.contains("nope"), "{msg}");
        assert!(check_output_path(dir.path()).unwrap_err().to_string().contains("is a directory"));
    }
}
