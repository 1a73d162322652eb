//! Where stable-diffusion.cpp finds an SD3-family model's parts. Its loader reads a diffusers folder's `unet/`
//! only, so an SD3 folder is handed over part by part (the MMDiT as `diffusion_model_path`, which sd.cpp renames
//! from diffusers' names, the VAE, CLIP-L, CLIP-G and T5 each as its file); a SAI single file goes in whole, with
//! the text encoders it lacks (SD3.5 files ship none) from the diffusers folder of its name beside it or the folder
//! it lies in, as the candle engine takes them. sd.cpp reads one file per part: a part split into shards is
//! refused naming the file to use instead. SAI's repos also ship the encoders as single files (`text_encoders/`),
//! which are taken first.
//!
//! sd.cpp cannot read a diffusers-named MMDiT: it recognises SD3 by SAI's names only, and its renaming of
//! diffusers' names neither fuses q/k/v nor swaps back the adaLN halves diffusers swapped. A folder's MMDiT is
//! therefore written once in SAI's layout into the cache ([`sai_transformer`]: the same bytes, renamed and fused),
//! which sd.cpp loads as the model file; the VAE and the encoders it reads from the folder as they are.

use sdhive_engine::{MmditShape, ModelShape};
use std::path::{Path, PathBuf};

/// The files one SD3 model loads from; `None` parts are absent (T5 when left out).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sd3Files {
    /// A SAI single file (MMDiT, VAE and whatever encoders it carries).
    pub checkpoint: Option<PathBuf>,
    /// A diffusers folder's MMDiT (diffusers' names: see [`sai_transformer`]).
    pub diffusion_model: Option<PathBuf>,
    pub vae: Option<PathBuf>,
    pub clip_l: Option<PathBuf>,
    pub clip_g: Option<PathBuf>,
    pub t5xxl: Option<PathBuf>,
    /// Elements of every tensor loaded, for the memory plan.
    pub elements: u64,
    /// The MMDiT's attention heads.
    pub heads: u32,
    /// The MMDiT's blocks and hidden width.
    pub blocks: usize,
    pub hidden: usize,
}

impl Sd3Files {
    /// The model's shape for memory planning: every loaded tensor at `bytes_per_weight`, and the MMDiT's
    /// attention over the 2×2 latent patches and the text tokens (CLIP's 77 and T5's first 77, as sd.cpp
    /// chunks them) with its scores materialised, as sd.cpp computes them without flash attention.
    pub fn shape(&self, bytes_per_weight: u64) -> ModelShape {
        ModelShape {
            weights_bytes: self.elements * bytes_per_weight,
            activation_bytes: bytes_per_weight,
            vae_factor: 8,
            first_attention_level: 1,
            heads_at_first_attention: self.heads,
            fused_attention: false,
            score_chunk_elements: None,
            vae_tile_latent: 32,
            mmdit: Some(MmditShape {
                hidden: self.hidden as u32,
                heads: self.heads,
                patch: 2,
                context_tokens: 2 * 77,
            }),
        }
    }
}

/// The folder's `transformer/config.json`.
pub fn transformer_config(dir: &Path) -> Result<serde_json::Value, String> {
    let path = dir.join("transformer").join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn model_index(dir: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("model_index.json")).ok()?;
    serde_json::from_str(&text).ok()
}

/// The diffusers MMDiT file `src` in SAI's layout, converted once into sdhive's cache
/// (`sdcpp/<folder>-<key>.safetensors`, keyed by the file's path, size and modification time; a changed file
/// replaces its old conversion). Written under a temporary name and renamed, so a worker never reads half a file.
pub fn sai_transformer(src: &Path) -> Result<PathBuf, String> {
    sai_transformer_in(src, &cache_root()?)
}

/// sdhive's cache folder, or why there is none.
pub(crate) fn cache_root() -> Result<PathBuf, String> {
    sdhive_catalog::default_cache_dir().ok_or_else(|| {
        "no cache folder for the copies stable-diffusion.cpp reads (set HOME or XDG_CACHE_HOME)".into()
    })
}

/// [`sai_transformer`] with the cache in `cache`.
fn sai_transformer_in(src: &Path, cache: &Path) -> Result<PathBuf, String> {
    let dir = cache.join("sdcpp");
    // `<model folder>/transformer/<file>`: named after the model folder.
    let canonical = std::fs::canonicalize(src).map_err(|e| format!("{}: {e}", src.display()))?;
    let stem = canonical
        .parent()
        .and_then(Path::parent)
        .and_then(Path::file_name)
        .map_or_else(|| "sd3".to_string(), |n| n.to_string_lossy().into_owned());
    let out = cached_copy(src, &dir, &stem)?;
    if out.is_file() {
        return Ok(out);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    tracing::info!(
        "{}: writing its MMDiT in SAI's layout for stable-diffusion.cpp to {} (once per file)",
        src.display(),
        out.display()
    );
    let started = std::time::Instant::now();
    let bytes = sdhive_checkpoint::write_sd3_transformer_as_sai(src, &out).map_err(|e| e.to_string())?;
    tracing::info!(
        "wrote {} ({:.1} GB) in {:.1} s",
        out.display(),
        bytes as f64 / 1e9,
        started.elapsed().as_secs_f64()
    );
    // Earlier conversions of a file of that folder name are stale or another folder's; keep only the newest.
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path != out && name.starts_with(&format!("{stem}-")) && name.ends_with(".safetensors") {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    Ok(out)
}

/// Where the cache keeps its copy of `src` made for sd.cpp: `dir/<stem>-<key>.safetensors`, the key a hash of the
/// file's canonical path, size and modification time (a changed file gets another name).
pub(crate) fn cached_copy(src: &Path, dir: &Path, stem: &str) -> Result<PathBuf, String> {
    let fail = |e: std::io::Error| format!("{}: {e}", src.display());
    let meta = std::fs::metadata(src).map_err(fail)?;
    let modified = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let canonical = std::fs::canonicalize(src).map_err(fail)?;
    let key = fnv1a(format!("{}\0{}\0{modified}", canonical.display(), meta.len()).as_bytes());
    Ok(dir.join(format!("{stem}-{key:016x}.safetensors")))
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// The parts of the SD3 diffusers folder `dir`; without `t5`, T5 is left out.
pub fn folder_files(dir: &Path, t5: bool) -> Result<Sd3Files, String> {
    let transformer = one_file(dir, "transformer", "diffusion_pytorch_model", "the MMDiT")?;
    let vae = one_file(dir, "vae", "diffusion_pytorch_model", "the VAE")?;
    let encoders = encoders(dir, t5)?;
    let config = transformer_config(dir)?;
    let mut files = Sd3Files {
        checkpoint: None,
        diffusion_model: Some(transformer),
        vae: Some(vae),
        clip_l: Some(encoders.clip_l),
        clip_g: Some(encoders.clip_g),
        t5xxl: encoders.t5xxl,
        elements: 0,
        heads: config["num_attention_heads"].as_u64().unwrap_or(24) as u32,
        blocks: config["num_layers"].as_u64().unwrap_or(24) as usize,
        hidden: (config["num_attention_heads"].as_u64().unwrap_or(24)
            * config["attention_head_dim"].as_u64().unwrap_or(64)) as usize,
    };
    files.elements = [&files.diffusion_model, &files.vae, &files.clip_l, &files.clip_g, &files.t5xxl]
        .into_iter()
        .flatten()
        .map(|p| elements(p))
        .sum::<Result<u64, String>>()?;
    Ok(files)
}

/// The parts of the SAI single file `file`: the file itself, plus CLIP-L, CLIP-G and (with `t5`) T5 from a
/// diffusers folder when the file lacks them. A T5 inside the file loads with it whatever `t5` says (sd.cpp
/// reads the whole checkpoint).
pub fn single_file_files(file: &Path, t5: bool) -> Result<Sd3Files, String> {
    let parts = sdhive_checkpoint::sd3_file_parts(file).map_err(|e| e.to_string())?;
    if !parts.vae {
        return Err(format!("{}: the checkpoint has no VAE (`first_stage_model.*`)", file.display()));
    }
    if parts.t5 && !t5 {
        tracing::warn!(
            "{}: its T5 loads with it (stable-diffusion.cpp reads the whole file); --no-t5 leaves out only a T5 \
             of its own file",
            file.display()
        );
    }
    let mut files = Sd3Files {
        checkpoint: Some(file.to_path_buf()),
        diffusion_model: None,
        vae: None,
        clip_l: None,
        clip_g: None,
        t5xxl: None,
        elements: parts.elements_without_t5 + parts.t5_elements,
        heads: parts.depth as u32,
        blocks: parts.depth,
        hidden: parts.hidden,
    };
    if parts.clip_l && parts.clip_g {
        return Ok(files);
    }
    if parts.clip_l || parts.clip_g {
        let missing = if parts.clip_l { "CLIP-G (`text_encoders.clip_g.*`)" } else { "CLIP-L" };
        return Err(format!(
            "{}: the checkpoint has one CLIP text encoder but not {missing}",
            file.display()
        ));
    }
    let beside = file.with_extension("");
    let candidates: Vec<PathBuf> = [Some(beside.clone()), file.parent().map(Path::to_path_buf)]
        .into_iter()
        .flatten()
        .filter(|d| d.join("model_index.json").is_file() || d.join("text_encoders").is_dir())
        .collect();
    let Some(dir) = candidates.first() else {
        return Err(format!(
            "{}: the checkpoint has no text encoders (SD3.5 files ship none): put the model's diffusers folder \
             beside it as `{}` (with `text_encoder`, `text_encoder_2`, optionally `text_encoder_3`), or SAI's \
             `text_encoders/` (clip_l, clip_g, t5xxl_fp16 .safetensors) in its folder",
            file.display(),
            beside.display()
        ));
    };
    let encoders = encoders(dir, t5 && !parts.t5)?;
    files.elements += [Some(&encoders.clip_l), Some(&encoders.clip_g), encoders.t5xxl.as_ref()]
        .into_iter()
        .flatten()
        .map(|p| elements(p))
        .sum::<Result<u64, String>>()?;
    files.clip_l = Some(encoders.clip_l);
    files.clip_g = Some(encoders.clip_g);
    files.t5xxl = encoders.t5xxl;
    Ok(files)
}

struct Encoders {
    clip_l: PathBuf,
    clip_g: PathBuf,
    t5xxl: Option<PathBuf>,
}

/// The text encoders in `dir`: SAI's `text_encoders/*.safetensors` where present, else the diffusers
/// subfolders. T5 is absent without `t5`, and where the folder has none (`text_encoder_3` null in
/// `model_index.json`, as diffusers loads such a folder).
fn encoders(dir: &Path, t5: bool) -> Result<Encoders, String> {
    let sai = |name: &str| Some(dir.join("text_encoders").join(name)).filter(|p| p.is_file());
    let clip_l = match sai("clip_l.safetensors") {
        Some(p) => p,
        None => one_file(dir, "text_encoder", "model", "CLIP-L")?,
    };
    let clip_g = match sai("clip_g.safetensors") {
        Some(p) => p,
        None => one_file(dir, "text_encoder_2", "model", "CLIP-G")?,
    };
    let t5xxl = if !t5 {
        None
    } else if let Some(p) = sai("t5xxl_fp16.safetensors").or_else(|| sai("t5xxl.safetensors")) {
        Some(p)
    } else if dir.join("text_encoder_3").is_dir() {
        Some(one_file(dir, "text_encoder_3", "model", "T5").map_err(|e| {
            format!("{e}; or start the worker with --no-t5 (T5's part of the context is then zeros)")
        })?)
    } else {
        let declared = model_index(dir).is_some_and(|v| v["text_encoder_3"][0].is_string());
        if declared {
            return Err(format!(
                "{}: model_index.json names a T5 text encoder but the folder has no `text_encoder_3/`; add it, or \
                 start the worker with --no-t5",
                dir.display()
            ));
        }
        None
    };
    Ok(Encoders { clip_l, clip_g, t5xxl })
}

/// `dir/sub/<stem>.safetensors`, which must be one file: diffusers' shards
/// (`<stem>-00001-of-0000N.safetensors` with an index) are refused naming the part.
fn one_file(dir: &Path, sub: &str, stem: &str, what: &str) -> Result<PathBuf, String> {
    let path = dir.join(sub).join(format!("{stem}.safetensors"));
    if path.is_file() {
        return Ok(path);
    }
    let index = dir.join(sub).join(format!("{stem}.safetensors.index.json"));
    if index.is_file() {
        return Err(format!(
            "{}: {what} is split into shards, which stable-diffusion.cpp cannot read (one file per part); use \
             SAI's single file of the model (with its `text_encoders/` for the encoders)",
            index.display()
        ));
    }
    Err(format!("{}: {what} not found", path.display()))
}

/// Elements of the tensors of the safetensors file at `path`, from its header.
fn elements(path: &Path) -> Result<u64, String> {
    sdhive_checkpoint::tensor_elements(path).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(rel)
    }

    #[test]
    fn folders_hand_over_each_part() {
        let dir = fixture("sd3");
        assert!(sdhive_checkpoint::is_sd3_folder(&dir) && !sdhive_checkpoint::is_sd3_folder(&fixture("sd1")));
        let files = folder_files(&dir, true).unwrap();
        assert_eq!(files.checkpoint, None);
        assert_eq!(files.diffusion_model, Some(dir.join("transformer/diffusion_pytorch_model.safetensors")));
        assert_eq!(files.vae, Some(dir.join("vae/diffusion_pytorch_model.safetensors")));
        assert_eq!(files.clip_l, Some(dir.join("text_encoder/model.safetensors")));
        assert_eq!(files.clip_g, Some(dir.join("text_encoder_2/model.safetensors")));
        assert_eq!(files.t5xxl, Some(dir.join("text_encoder_3/model.safetensors")));
        let no_t5 = folder_files(&dir, false).unwrap();
        assert_eq!(no_t5.t5xxl, None);
        assert!(no_t5.elements > 0 && no_t5.elements < files.elements);
    }

    /// A copy of the sd3 fixture folder in which `edit` moved things around.
    fn edited(edit: impl FnOnce(&Path)) -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        let src = fixture("sd3");
        for entry in walk(&src) {
            let dst = tmp.path().join(entry.strip_prefix(&src).unwrap());
            std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
            std::fs::copy(&entry, &dst).unwrap();
        }
        edit(tmp.path());
        tmp
    }

    fn walk(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
        out
    }

    #[test]
    fn a_folders_mmdit_is_converted_once_into_the_cache() {
        let cache = tempfile::tempdir().unwrap();
        let sai_transformer = |src: &Path| sai_transformer_in(src, cache.path());
        let model = edited(|_| ());
        let src = model.path().join("transformer/diffusion_pytorch_model.safetensors");
        let out = sai_transformer(&src).unwrap();
        assert!(out.starts_with(cache.path().join("sdcpp")), "{}", out.display());
        let parts = sdhive_checkpoint::sd3_file_parts(&out).unwrap();
        assert_eq!(
            parts.depth as u64,
            transformer_config(model.path()).unwrap()["num_layers"].as_u64().unwrap()
        );
        let written = std::fs::metadata(&out).unwrap().modified().unwrap();
        assert_eq!(sai_transformer(&src).unwrap(), out, "the same file maps to the same conversion");
        assert_eq!(std::fs::metadata(&out).unwrap().modified().unwrap(), written, "and is not written again");
        // A changed file gets a new conversion, which replaces the old one.
        let bytes = std::fs::read(&src).unwrap();
        std::fs::remove_file(&src).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&src, &bytes).unwrap();
        let again = sai_transformer(&src).unwrap();
        assert_ne!(again, out);
        assert!(again.is_file() && !out.exists());
    }

    #[test]
    fn shards_and_missing_parts_are_named() {
        let sharded = edited(|d| {
            let t5 = d.join("text_encoder_3");
            std::fs::rename(t5.join("model.safetensors"), t5.join("model-00001-of-00002.safetensors"))
                .unwrap();
            std::fs::write(t5.join("model.safetensors.index.json"), "{}").unwrap();
        });
        let err = folder_files(sharded.path(), true).unwrap_err();
        assert!(err.contains("model.safetensors.index.json") && err.contains("T5 is split"), "{err}");
        assert!(err.contains("--no-t5"), "{err}");
        // Without T5 the shards are never read.
        assert_eq!(folder_files(sharded.path(), false).unwrap().t5xxl, None);

        let no_t5_dir = edited(|d| std::fs::remove_dir_all(d.join("text_encoder_3")).unwrap());
        let err = folder_files(no_t5_dir.path(), true).unwrap_err();
        assert!(err.contains("text_encoder_3") && err.contains("--no-t5"), "{err}");

        let no_vae = edited(|d| std::fs::remove_dir_all(d.join("vae")).unwrap());
        let err = folder_files(no_vae.path(), true).unwrap_err();
        assert!(err.contains("the VAE not found"), "{err}");
    }

    #[test]
    fn sai_text_encoder_files_come_first() {
        let dir = edited(|d| {
            std::fs::create_dir_all(d.join("text_encoders")).unwrap();
            std::fs::copy(
                d.join("text_encoder/model.safetensors"),
                d.join("text_encoders/clip_l.safetensors"),
            )
            .unwrap();
            std::fs::copy(
                d.join("text_encoder_3/model.safetensors"),
                d.join("text_encoders/t5xxl_fp16.safetensors"),
            )
            .unwrap();
        });
        let files = folder_files(dir.path(), true).unwrap();
        assert_eq!(files.clip_l, Some(dir.path().join("text_encoders/clip_l.safetensors")));
        assert_eq!(files.clip_g, Some(dir.path().join("text_encoder_2/model.safetensors")));
        assert_eq!(files.t5xxl, Some(dir.path().join("text_encoders/t5xxl_fp16.safetensors")));
    }

    #[test]
    fn single_files_take_missing_encoders_from_the_folder_beside() {
        // SD3-medium's file carries everything.
        let full = single_file_files(&fixture("sd3.safetensors"), true).unwrap();
        assert_eq!(full.checkpoint, Some(fixture("sd3.safetensors")));
        assert_eq!((full.clip_l.as_ref(), full.t5xxl.as_ref()), (None, None));
        // SD3.5-medium's carries no encoders: they come from `sd35m/`.
        let bare = single_file_files(&fixture("sd35m.safetensors"), true).unwrap();
        let beside = fixture("sd35m");
        assert_eq!(bare.clip_l, Some(beside.join("text_encoder/model.safetensors")));
        assert_eq!(bare.clip_g, Some(beside.join("text_encoder_2/model.safetensors")));
        assert_eq!(bare.t5xxl, Some(beside.join("text_encoder_3/model.safetensors")));
        assert_eq!(single_file_files(&fixture("sd35m.safetensors"), false).unwrap().t5xxl, None);
        // Alone, the file is refused naming the folder it wants.
        let tmp = tempfile::tempdir().unwrap();
        let lone = tmp.path().join("sd35m.safetensors");
        std::fs::copy(fixture("sd35m.safetensors"), &lone).unwrap();
        let err = single_file_files(&lone, true).unwrap_err();
        assert!(
            err.contains("no text encoders") && err.contains(&*tmp.path().join("sd35m").to_string_lossy())
        );
        // SAI's repo layout: the file with `text_encoders/` in its own folder.
        std::fs::create_dir_all(tmp.path().join("text_encoders")).unwrap();
        for (from, to) in [("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")] {
            std::fs::copy(
                beside.join(from).join("model.safetensors"),
                tmp.path().join(format!("text_encoders/{to}.safetensors")),
            )
            .unwrap();
        }
        let sai = single_file_files(&lone, false).unwrap();
        assert_eq!(sai.clip_g, Some(tmp.path().join("text_encoders/clip_g.safetensors")));
        assert!(single_file_files(&fixture("sd1.safetensors"), true).is_err());
    }
}
