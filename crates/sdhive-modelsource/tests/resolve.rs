//! `resolve()` end to end on folders built in the test: a hub cache laid out like huggingface_hub's, local
//! diffusers folders and single files, and model-root confinement against `..` and symlink escapes.

use sdhive_modelsource::{resolve, ModelLocation, ResolveOptions, SourceError};
use std::path::{Path, PathBuf};

const HASH: &str = "c0ffee0123456789abcdef0123456789abcdef01";

fn offline_opts(cache: &Path) -> ResolveOptions {
    ResolveOptions {
        model_roots: Vec::new(),
        hub_cache: cache.to_path_buf(),
        offline: true,
        token: None,
        endpoint: None,
        progress: false,
    }
}

/// The smallest valid safetensors file: one 4-byte tensor.
fn tiny_safetensors() -> Vec<u8> {
    let header = br#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0; 4]);
    bytes
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// A minimal SD-shaped diffusers folder; `skip` names one relative file to leave out.
fn write_diffusers(dir: &Path, skip: Option<&str>) {
    let files: [(&str, Vec<u8>); 10] = [
        (
            "model_index.json",
            br#"{"_class_name": "StableDiffusionPipeline", "safety_checker": [null, null],
                 "scheduler": ["diffusers", "PNDMScheduler"], "text_encoder": ["transformers", "CLIPTextModel"],
                 "tokenizer": ["transformers", "CLIPTokenizer"], "unet": ["diffusers", "UNet2DConditionModel"],
                 "vae": ["diffusers", "AutoencoderKL"]}"#
                .to_vec(),
        ),
        ("scheduler/scheduler_config.json", b"{}".to_vec()),
        ("text_encoder/config.json", b"{}".to_vec()),
        ("text_encoder/model.safetensors", tiny_safetensors()),
        ("tokenizer/vocab.json", b"{}".to_vec()),
        ("tokenizer/merges.txt", b"".to_vec()),
        ("unet/config.json", b"{}".to_vec()),
        ("unet/diffusion_pytorch_model.safetensors", tiny_safetensors()),
        ("vae/config.json", b"{}".to_vec()),
        ("vae/diffusion_pytorch_model.fp16.safetensors", tiny_safetensors()),
    ];
    for (name, bytes) in files {
        if Some(name) != skip {
            write(&dir.join(name), &bytes);
        }
    }
}

/// `models--org--name/refs/main` → `snapshots/<hash>/…`, with snapshot files as symlinks into `blobs/` the way
/// huggingface_hub stores them.
fn write_hub_repo(cache: &Path, id: &str, skip: Option<&str>) -> PathBuf {
    let repo_dir = cache.join(format!("models--{}", id.replace('/', "--")));
    let staging = cache.join("staging");
    write_diffusers(&staging, skip);
    let snapshot = repo_dir.join("snapshots").join(HASH);
    for (i, entry) in walk(&staging).into_iter().enumerate() {
        let rel = entry.strip_prefix(&staging).unwrap();
        let blob = repo_dir.join("blobs").join(format!("blob{i}"));
        write(&blob, &std::fs::read(&entry).unwrap());
        let link = snapshot.join(rel);
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&blob, &link).unwrap();
    }
    std::fs::remove_dir_all(&staging).unwrap();
    write(&repo_dir.join("refs/main"), HASH.as_bytes());
    snapshot
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

#[test]
fn cached_hub_snapshot_resolves_offline() {
    let tmp = tempfile::tempdir().unwrap();
    let snapshot = write_hub_repo(tmp.path(), "org/tiny-sd", None);
    let model = resolve("org/tiny-sd", &offline_opts(tmp.path())).unwrap();
    assert_eq!(model.name, "org/tiny-sd");
    assert_eq!(model.location, ModelLocation::DiffusersDir(snapshot.canonicalize().unwrap()));
    // A revision that is itself the commit hash needs no ref.
    let pinned = resolve(&format!("org/tiny-sd@{HASH}"), &offline_opts(tmp.path())).unwrap();
    assert_eq!(pinned.location, model.location);
}

#[test]
fn incomplete_snapshot_offline_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    write_hub_repo(tmp.path(), "org/tiny-sd", Some("unet/diffusion_pytorch_model.safetensors"));
    let err = resolve("org/tiny-sd", &offline_opts(tmp.path())).unwrap_err();
    assert!(matches!(err, SourceError::NotCachedOffline { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("org/tiny-sd"), "{msg}");
    assert!(msg.contains("unet/diffusion_pytorch_model.safetensors"), "{msg}");
    assert!(msg.contains(&tmp.path().display().to_string()), "{msg}");
    assert!(msg.contains("local"), "{msg}");
}

#[test]
fn uncached_repo_offline_names_repo_and_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let msg = resolve("org/absent@v2", &offline_opts(tmp.path())).unwrap_err().to_string();
    assert!(msg.contains("org/absent") && msg.contains("v2") && msg.contains("no snapshot"), "{msg}");
}

#[test]
fn repo_ids_that_could_escape_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for bad in ["org/..", "org/na..me", "org/name@../../x", "..x/name", "org/a--b"] {
        let err = resolve(bad, &offline_opts(tmp.path())).unwrap_err();
        assert!(matches!(err, SourceError::InvalidRepoId { .. }), "{bad}: {err:?}");
    }
}

#[test]
fn local_forms_and_their_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = offline_opts(&tmp.path().join("cache"));
    let d = tmp.path();

    write_diffusers(&d.join("mymodel"), None);
    let m = resolve(d.join("mymodel").to_str().unwrap(), &opts).unwrap();
    assert_eq!(m.name, "mymodel");
    assert_eq!(m.location, ModelLocation::DiffusersDir(d.join("mymodel").canonicalize().unwrap()));

    write(&d.join("single.safetensors"), &tiny_safetensors());
    let m = resolve(d.join("single.safetensors").to_str().unwrap(), &opts).unwrap();
    assert_eq!(m.name, "single");
    assert!(matches!(m.location, ModelLocation::SingleFile(_)));

    let missing = d.join("nope.safetensors");
    let err = resolve(missing.to_str().unwrap(), &opts).unwrap_err();
    assert!(matches!(err, SourceError::NotFound { .. }) && err.to_string().contains("nope.safetensors"));

    write(&d.join("old.ckpt"), b"pickle");
    let err = resolve(d.join("old.ckpt").to_str().unwrap(), &opts).unwrap_err();
    assert!(matches!(err, SourceError::PickleUnsupported { .. }), "{err:?}");
    assert!(err.to_string().contains("only .safetensors"));

    write(&d.join("notes.txt"), b"hello");
    let err = resolve(d.join("notes.txt").to_str().unwrap(), &opts).unwrap_err();
    assert!(matches!(err, SourceError::UnknownFormat { .. }) && err.to_string().contains("notes.txt"));

    std::fs::create_dir(d.join("empty")).unwrap();
    let err = resolve(d.join("empty").to_str().unwrap(), &opts).unwrap_err();
    assert!(err.to_string().contains("model_index.json"), "{err}");

    write(&d.join("broken.safetensors"), b"\xff\xff\xff\xff\xff\xff\xff\xffgarbage");
    let err = resolve(d.join("broken.safetensors").to_str().unwrap(), &opts).unwrap_err();
    assert!(matches!(err, SourceError::InvalidSafetensors { .. }) && err.to_string().contains("broken"));

    write_diffusers(&d.join("partial"), Some("vae/diffusion_pytorch_model.fp16.safetensors"));
    write(&d.join("partial/vae/diffusion_pytorch_model.bin"), b"pickle");
    let msg = resolve(d.join("partial").to_str().unwrap(), &opts).unwrap_err().to_string();
    assert!(msg.contains("vae/") && msg.contains("diffusion_pytorch_model.bin"), "{msg}");

    let err = resolve("not-a-model", &opts).unwrap_err();
    assert!(matches!(err, SourceError::NeitherPathNorRepo { .. }), "{err:?}");
}

#[test]
fn gguf_checkpoints_resolve_as_single_files_and_other_gguf_files_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = offline_opts(&tmp.path().join("cache"));
    let d = tmp.path();
    let write_gguf = |name: &str, tensors: &[(String, Vec<u64>, u32)]| {
        let refs: Vec<(&str, &[u64], u32)> =
            tensors.iter().map(|(n, s, t)| (n.as_str(), s.as_slice(), *t)).collect();
        sdhive_catalog::gguf::write_for_tests(&d.join(name), None, &refs).unwrap();
        d.join(name)
    };
    let good = write_gguf("v1-5-q8_0.gguf", &sdhive_catalog::gguf::sd_tensors_for_tests("sd1", 4));
    let m = resolve(good.to_str().unwrap(), &opts).unwrap();
    assert_eq!(m.name, "v1-5-q8_0");
    assert_eq!(m.location, ModelLocation::SingleFile(good.canonicalize().unwrap()));
    assert!(m.location.is_gguf());
    let st = d.join("single.safetensors");
    write(&st, &tiny_safetensors());
    assert!(!resolve(st.to_str().unwrap(), &opts).unwrap().location.is_gguf());

    let unet_only = write_gguf("unet.gguf", &[("input_blocks.0.0.weight".into(), vec![3, 3, 4, 320], 1)]);
    let err = resolve(unet_only.to_str().unwrap(), &opts).unwrap_err();
    assert!(matches!(err, SourceError::InvalidGguf { .. }), "{err:?}");
    assert!(err.to_string().contains("unet.gguf") && err.to_string().contains("UNet alone"), "{err}");

    write(&d.join("trunc.gguf"), b"GGUF\x03\0\0\0");
    let err = resolve(d.join("trunc.gguf").to_str().unwrap(), &opts).unwrap_err();
    assert!(err.to_string().contains("trunc.gguf") && err.to_string().contains("truncated"), "{err}");
}

#[test]
fn model_roots_confine_paths_after_canonicalisation() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let outside = tmp.path().join("outside");
    write_diffusers(&root.join("inside"), None);
    write_diffusers(&outside.join("secret"), None);
    std::os::unix::fs::symlink(outside.join("secret"), root.join("link")).unwrap();
    let mut opts = offline_opts(&tmp.path().join("cache"));
    opts.model_roots = vec![root.clone()];

    resolve(root.join("inside").to_str().unwrap(), &opts).unwrap();
    // `..` that comes back into the root is fine; the canonical path decides.
    resolve(root.join("inside/../inside").to_str().unwrap(), &opts).unwrap();

    for escape in [root.join("../outside/secret"), root.join("link"), outside.join("secret")] {
        let err = resolve(escape.to_str().unwrap(), &opts).unwrap_err();
        assert!(matches!(err, SourceError::OutsideRoots { .. }), "{}: {err:?}", escape.display());
        assert!(err.to_string().contains(&root.display().to_string()));
    }

    // Without roots the same symlink is just a path.
    opts.model_roots.clear();
    resolve(root.join("link").to_str().unwrap(), &opts).unwrap();
}

#[test]
fn fixture_sd1_resolves_as_diffusers_dir() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/sd1");
    let tmp = tempfile::tempdir().unwrap();
    let model = resolve(fixture.to_str().unwrap(), &offline_opts(tmp.path())).unwrap();
    assert_eq!(model.name, "sd1");
    assert_eq!(model.location, ModelLocation::DiffusersDir(fixture.canonicalize().unwrap()));
    // The other fixtures exercise two text encoders (SDXL) and the single-file form.
    let models = fixture.parent().unwrap();
    for dir in ["sdxl", "sd2v", "sd1-inpaint"] {
        let m = resolve(models.join(dir).to_str().unwrap(), &offline_opts(tmp.path())).unwrap();
        assert!(matches!(m.location, ModelLocation::DiffusersDir(_)), "{dir}");
    }
    let single =
        resolve(models.join("sd1.safetensors").to_str().unwrap(), &offline_opts(tmp.path())).unwrap();
    assert!(matches!(single.location, ModelLocation::SingleFile(_)));
}
