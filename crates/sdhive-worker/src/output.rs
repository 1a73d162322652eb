//! Where generated images go: the `-o` path for one image, numbered siblings for several, the format its
//! extension names, and the up-front check that the target folder exists and the format is known, so a long
//! generation is not wasted on an unwritable path.

use anyhow::bail;
use sdhive_engine::ImageFormat;
use std::path::{Path, PathBuf};

/// The format `-o`'s extension names: `.png` (and no extension), `.jpg`/`.jpeg`, `.webp`.
pub fn output_format(out: &Path) -> anyhow::Result<ImageFormat> {
    let Some(ext) = out.extension() else { return Ok(ImageFormat::Png) };
    let ext = ext.to_string_lossy();
    match ImageFormat::parse(&ext) {
        Some(format) => Ok(format),
        None => bail!(
            "-o {}: `.{ext}` is not an image format this writes; use .png, .jpg (or .jpeg) or .webp",
            out.display()
        ),
    }
}

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
    output_format(out).map(drop)
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
    fn the_extension_picks_the_format() {
        assert_eq!(output_format(Path::new("a.png")).unwrap(), ImageFormat::Png);
        assert_eq!(output_format(Path::new("a")).unwrap(), ImageFormat::Png);
        assert_eq!(output_format(Path::new("a.JPG")).unwrap(), ImageFormat::Jpeg);
        assert_eq!(output_format(Path::new("a.jpeg")).unwrap(), ImageFormat::Jpeg);
        assert_eq!(output_format(Path::new("a.webp")).unwrap(), ImageFormat::Webp);
        let msg = output_format(Path::new("out.gif")).unwrap_err().to_string();
        assert!(msg.contains("out.gif") && msg.contains(".gif") && msg.contains(".webp"), "{msg}");
        assert!(check_output_path(Path::new("x.tiff")).is_err());
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
