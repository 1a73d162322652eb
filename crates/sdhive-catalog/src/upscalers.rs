//! The node's upscaler models (ESRGAN, Real-ESRGAN, SRVGG): `--upscaler-dir` folders and a models dir's `ESRGAN`,
//! `RealESRGAN` and `upscale_models` subfolders, scanned recursively. Safetensors files are listed by their stem
//! (A1111's name); pickles (`.pth`, `.pt`, `.ckpt`, `.bin`) are listed as refused, never opened.

use crate::error::CatalogError;
use crate::networks::walk;
use std::fs;
use std::path::{Path, PathBuf};

/// Where to look for upscaler models.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpscalersConfig {
    pub upscaler_dirs: Vec<PathBuf>,
    /// Models dirs whose `ESRGAN`, `RealESRGAN` or `upscale_models` subfolders (any case) count as upscaler dirs.
    pub models_dirs: Vec<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpscalerFile {
    /// The file's stem: what requests name in `hr_upscaler` / `upscaler_1`.
    pub name: String,
    pub path: PathBuf,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpscalerCatalog {
    pub models: Vec<UpscalerFile>,
    /// Files found but not loadable (pickles), with why.
    pub refused: Vec<(PathBuf, String)>,
}

const PICKLES: [&str; 4] = ["pth", "pt", "ckpt", "bin"];

impl UpscalerCatalog {
    pub fn scan(config: &UpscalersConfig) -> Result<UpscalerCatalog, CatalogError> {
        let mut roots = Vec::new();
        for dir in &config.upscaler_dirs {
            let root = fs::canonicalize(dir).map_err(|e| CatalogError::Dir {
                kind: "upscaler",
                path: dir.clone(),
                source: e,
            })?;
            if !root.is_dir() {
                return Err(CatalogError::NotADir { kind: "upscaler", path: dir.clone() });
            }
            roots.push(root);
        }
        for dir in &config.models_dirs {
            roots.extend(models_subfolders(dir));
        }
        roots.dedup();
        let mut out = UpscalerCatalog::default();
        for root in &roots {
            let mut files = Vec::new();
            walk(root, root, 0, &mut vec![], &mut files);
            for path in files {
                let ext =
                    path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
                let Some(stem) = path.file_stem().map(|s| s.to_string_lossy().into_owned()) else { continue };
                if ext == "safetensors" {
                    out.models.push(UpscalerFile { name: stem, path });
                } else if PICKLES.contains(&ext.as_str()) {
                    out.refused.push((
                        path,
                        "pickled upscaler files are never loaded; convert it to .safetensors \
                         (e.g. with spandrel or chaiNNer)"
                            .into(),
                    ));
                }
            }
        }
        // The first folder given wins a name clash.
        out.models.sort_by(|a, b| a.name.cmp(&b.name));
        out.models.dedup_by(|b, a| a.name == b.name);
        Ok(out)
    }

    /// A model by its name, case-insensitively as A1111 matches upscaler names.
    pub fn find(&self, name: &str) -> Option<&UpscalerFile> {
        self.models
            .iter()
            .find(|m| m.name == name)
            .or_else(|| self.models.iter().find(|m| m.name.eq_ignore_ascii_case(name)))
    }
}

fn models_subfolders(dir: &Path) -> Vec<PathBuf> {
    let Ok(root) = fs::canonicalize(dir) else { return vec![] };
    let Ok(entries) = fs::read_dir(&root) else { return vec![] };
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| {
            matches!(
                e.file_name().to_string_lossy().to_lowercase().as_str(),
                "esrgan" | "realesrgan" | "upscale_models"
            )
        })
        .filter_map(|e| fs::canonicalize(e.path()).ok())
        .filter(|p| p.starts_with(&root) && p.is_dir())
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_safetensors_by_stem_and_refuses_pickles() {
        let dir = tempfile::tempdir().unwrap();
        let models = dir.path().join("models");
        fs::create_dir_all(models.join("ESRGAN/sub")).unwrap();
        fs::create_dir_all(models.join("Lora")).unwrap();
        fs::write(models.join("ESRGAN/4x_foo.safetensors"), b"x").unwrap();
        fs::write(models.join("ESRGAN/sub/RealESRGAN_x2plus.safetensors"), b"x").unwrap();
        fs::write(models.join("ESRGAN/old.pth"), b"x").unwrap();
        fs::write(models.join("Lora/not_an_upscaler.safetensors"), b"x").unwrap();
        let extra = dir.path().join("extra");
        fs::create_dir_all(&extra).unwrap();
        fs::write(extra.join("4x_foo.safetensors"), b"x").unwrap();
        let config = UpscalersConfig { upscaler_dirs: vec![extra.clone()], models_dirs: vec![models] };
        let cat = UpscalerCatalog::scan(&config).unwrap();
        let names: Vec<_> = cat.models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["4x_foo", "RealESRGAN_x2plus"]);
        assert!(cat.find("4X_FOO").unwrap().path.starts_with(fs::canonicalize(&extra).unwrap()));
        assert_eq!(cat.refused.len(), 1);
        assert!(cat.refused[0].1.contains("safetensors"));
        let missing = UpscalersConfig { upscaler_dirs: vec![dir.path().join("nope")], models_dirs: vec![] };
        assert!(UpscalerCatalog::scan(&missing).is_err());
    }
}
