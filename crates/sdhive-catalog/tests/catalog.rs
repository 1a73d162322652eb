//! End-to-end behaviour of the catalogue on model libraries built by each test in a temp folder: what a scan
//! lists, refuses and ignores; hashing and the hash cache; and A1111-compatible checkpoint lookup.

use sdhive_catalog::{gguf, Catalog, CatalogConfig, CatalogError, CheckpointFormat};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Writes a valid safetensors file: one U8 tensor per name, each `bytes_each` long, filled with a pattern so
/// that hashes depend on every byte.
fn write_safetensors_sized(path: &Path, names: &[&str], bytes_each: usize) {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).unwrap();
    }
    let entries: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let (start, end) = (i * bytes_each, (i + 1) * bytes_each);
            format!(r#""{n}":{{"dtype":"U8","shape":[{bytes_each}],"data_offsets":[{start},{end}]}}"#)
        })
        .collect();
    let mut header = format!(r#"{{"__metadata__":{{"format":"pt"}},{}}}"#, entries.join(","));
    // safetensors pads the header with spaces to 8-byte alignment.
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend((0..names.len() * bytes_each).map(|i| (i * 31 % 251) as u8));
    fs::write(path, bytes).unwrap();
}

fn write_safetensors(path: &Path, names: &[&str]) {
    write_safetensors_sized(path, names, 4);
}

const CKPT_KEYS: &[&str] = &[
    "model.diffusion_model.input_blocks.0.0.weight",
    "first_stage_model.decoder.conv_in.weight",
    "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight",
];
const VAE_KEYS: &[&str] = &["encoder.conv_in.weight", "decoder.conv_in.weight"];
const LORA_KEYS: &[&str] = &["lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"];

/// A GGUF with the tensors that make it a checkpoint of `family` (header-sized: zero data).
fn write_sd_gguf(path: &Path, family: &str) {
    gguf::write_sd_for_tests(path, family, 4).unwrap();
}

fn write_file(path: &Path, bytes: &[u8]) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, bytes).unwrap();
}

fn config(models: &[&Path]) -> CatalogConfig {
    CatalogConfig { models_dirs: models.iter().map(|p| p.to_path_buf()).collect(), ..Default::default() }
}

fn names(catalog: &Catalog) -> Vec<&str> {
    catalog.checkpoints.iter().map(|c| c.name.as_str()).collect()
}

/// The library most tests use: every kind of entry a scan must tell apart.
fn library(models: &Path) {
    write_safetensors(&models.join("a.safetensors"), CKPT_KEYS);
    write_safetensors(&models.join("a.vae.safetensors"), &["odd.weight"]);
    write_safetensors(&models.join("sub/deep/b.safetensors"), CKPT_KEYS);
    write_file(&models.join("sub/sd15/model_index.json"), br#"{"_class_name":"StableDiffusionPipeline"}"#);
    write_safetensors(&models.join("sub/sd15/unet/diffusion_pytorch_model.safetensors"), CKPT_KEYS);
    write_file(&models.join("old.ckpt"), b"PK\x03\x04 not really a zip");
    write_file(&models.join("emb.pt"), b"\x80\x02 pickle");
    write_safetensors(&models.join("VAE/vae-ft-mse.safetensors"), LORA_KEYS);
    write_safetensors(&models.join("Lora/style.safetensors"), CKPT_KEYS);
    write_safetensors(&models.join("embeddings/e.safetensors"), CKPT_KEYS);
    write_safetensors(&models.join("loose_lora.safetensors"), LORA_KEYS);
    write_safetensors(&models.join("standalone_vae.safetensors"), VAE_KEYS);
    write_file(&models.join("garbage.safetensors"), b"\x10\x00\x00\x00\x00\x00\x00\x00{{{{ not json ....");
    let mut huge = u64::MAX.to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    write_file(&models.join("huge.safetensors"), &huge);
    write_sd_gguf(&models.join("q/m.gguf"), "sd1");
    gguf::write_for_tests(&models.join("llm.gguf"), Some("llama"), &[("blk.0.attn_q.weight", &[64, 64], 1)])
        .unwrap();
    write_file(&models.join("bad.gguf"), b"GGML\x00\x00\x00\x00");
    write_safetensors(&models.join(".hidden.safetensors"), CKPT_KEYS);
    write_safetensors(&models.join(".cache/c.safetensors"), CKPT_KEYS);
    write_file(&models.join("notes.txt"), b"hello");
}

fn sha256sum(path: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .or_else(|_| Command::new("shasum").args(["-a", "256"]).arg(path).output())
        .expect("sha256sum or shasum must be installed");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().split_whitespace().next().unwrap().to_string()
}

#[test]
fn scan_lists_checkpoints_vaes_and_refusals() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    library(&models);
    let catalog = Catalog::scan(&config(&[&models])).unwrap();
    let root = fs::canonicalize(&models).unwrap();

    assert_eq!(names(&catalog), ["a.safetensors", "q/m.gguf", "sub/deep/b.safetensors", "sub/sd15"]);
    let b = &catalog.checkpoints[2];
    assert_eq!(b.model_name, "sub_deep_b");
    assert_eq!(b.name_for_extra(), "b");
    assert_eq!(b.path, root.join("sub/deep/b.safetensors"));
    assert_eq!(b.root, root);
    assert_eq!(b.format, CheckpointFormat::SafeTensors);
    assert_eq!(b.size, fs::metadata(&b.path).unwrap().len());
    assert_eq!(b.sha256, None);
    assert_eq!(b.title(), "sub/deep/b.safetensors");

    let gguf = &catalog.checkpoints[1];
    assert_eq!((gguf.format, gguf.format.name()), (CheckpointFormat::Gguf, "gguf"));

    // A diffusers folder is one entry; the UNet weights inside it are not listed on their own.
    let sd15 = &catalog.checkpoints[3];
    assert_eq!(sd15.format, CheckpointFormat::Diffusers);
    assert_eq!((sd15.model_name.as_str(), sd15.name_for_extra()), ("sub_sd15", "sd15"));
    assert_eq!(sd15.path, root.join("sub/sd15"));
    let inside = fs::metadata(models.join("sub/sd15/model_index.json")).unwrap().len()
        + fs::metadata(models.join("sub/sd15/unet/diffusion_pytorch_model.safetensors")).unwrap().len();
    assert_eq!(sd15.size, inside);

    let vaes: Vec<&str> = catalog.vaes.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(vaes, ["a.vae.safetensors", "standalone_vae.safetensors", "vae-ft-mse.safetensors"]);
    assert_eq!(catalog.vaes[2].path, root.join("VAE/vae-ft-mse.safetensors"));

    let refused: Vec<&str> = catalog.refused.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        refused,
        ["bad.gguf", "emb.pt", "garbage.safetensors", "huge.safetensors", "llm.gguf", "old.ckpt"]
    );
    for r in &catalog.refused {
        assert_eq!(r.path, root.join(&r.name));
    }
    let reason = |name: &str| &catalog.refused.iter().find(|r| r.name == name).unwrap().reason;
    for pickle in ["old.ckpt", "emb.pt"] {
        assert!(reason(pickle).contains("pickle"), "{}", reason(pickle));
        assert!(reason(pickle).contains("safetensors"), "{}", reason(pickle));
    }
    assert!(reason("garbage.safetensors").contains("not a JSON object"), "{}", reason("garbage.safetensors"));
    assert!(reason("huge.safetensors").contains("100 MB"), "{}", reason("huge.safetensors"));
    assert!(reason("bad.gguf").contains("GGUF"), "{}", reason("bad.gguf"));
    assert!(reason("llm.gguf").contains("`llama` model"), "{}", reason("llm.gguf"));
}

/// The TAESD preview decoders (`serve --preview`) where A1111, ComfyUI and diffusers keep them are neither
/// checkpoints nor VAEs, nor refused: A1111's `VAE-taesd/` and ComfyUI's `vae_approx/` (taesd.py's keys, and
/// `.pth` downloads), diffusers' `taesd/` folder, and an `AutoencoderTiny` weights file anywhere
/// (`decoder.layers.N`).
#[test]
fn taesd_decoders_are_not_listed() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    write_safetensors(&models.join("a.safetensors"), CKPT_KEYS);
    write_safetensors(&models.join("VAE-taesd/taesd_decoder.safetensors"), &["1.weight", "3.conv.0.weight"]);
    write_file(&models.join("VAE-taesd/taesdxl_decoder.pth"), b"\x80\x02 pickle");
    write_safetensors(
        &models.join("vae_approx/taesdxl_decoder.safetensors"),
        &["1.weight", "3.conv.0.weight"],
    );
    write_file(&models.join("vae_approx/taesd_decoder.pth"), b"\x80\x02 pickle");
    let tiny = &["encoder.layers.0.weight", "decoder.layers.0.weight", "decoder.layers.2.conv.0.weight"];
    write_safetensors(&models.join("taesdxl/diffusion_pytorch_model.safetensors"), tiny);
    write_file(&models.join("taesdxl/config.json"), br#"{"_class_name":"AutoencoderTiny"}"#);
    write_safetensors(&models.join("previews/tiny_vae.safetensors"), tiny);
    let catalog = Catalog::scan(&config(&[&models])).unwrap();
    assert_eq!(names(&catalog), ["a.safetensors"]);
    assert!(catalog.vaes.is_empty(), "{:?}", catalog.vaes);
    assert!(catalog.refused.is_empty(), "{:?}", catalog.refused);
}

#[test]
fn truncated_safetensors_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("t.safetensors");
    write_safetensors_sized(&path, CKPT_KEYS, 1000);
    let len = fs::metadata(&path).unwrap().len();
    fs::File::options().write(true).open(&path).unwrap().set_len(len - 10).unwrap();
    let catalog = Catalog::scan(&config(&[tmp.path()])).unwrap();
    assert!(catalog.checkpoints.is_empty());
    assert!(catalog.refused[0].reason.contains("truncated"), "{}", catalog.refused[0].reason);
}

#[test]
fn vae_beside_checkpoint_and_vae_dirs() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    library(&models);
    write_file(&models.join("sub/deep/b.vae.pt"), b"pickle");
    let vae_dir = tmp.path().join("vaes");
    write_safetensors(&vae_dir.join("nested/x.safetensors"), LORA_KEYS);
    write_file(&vae_dir.join("y.pt"), b"pickle");
    let cfg = CatalogConfig { vae_dirs: vec![vae_dir.clone()], ..config(&[&models]) };
    let catalog = Catalog::scan(&cfg).unwrap();

    let a = catalog.find("a.safetensors").unwrap();
    assert_eq!(catalog.vae_beside(a).unwrap().name, "a.vae.safetensors");
    // b.vae.pt is a pickle: never a VAE, never listed.
    let b = catalog.find("sub/deep/b.safetensors").unwrap();
    assert!(catalog.vae_beside(b).is_none());
    assert!(catalog.refused.iter().any(|r| r.name == "sub/deep/b.vae.pt"));

    // Every .safetensors in a VAE dir is a VAE, whatever its tensors; pickles there are skipped.
    let x = catalog.find_vae("x.safetensors").unwrap();
    assert_eq!(x.path, fs::canonicalize(vae_dir.join("nested/x.safetensors")).unwrap());
    assert_eq!(catalog.find_vae("x").unwrap().path, x.path);
    assert_eq!(catalog.find_vae("X").unwrap().path, x.path);
    assert_eq!(catalog.find_vae(x.path.to_str().unwrap()).unwrap().path, x.path);
    assert_eq!(
        catalog.find_vae(vae_dir.join("nested/x.safetensors").to_str().unwrap()).unwrap().path,
        x.path
    );
    assert!(catalog.find_vae("y").is_none());
    assert!(catalog.find_vae("").is_none());
    assert_eq!(catalog.find_vae("vae-ft-mse").unwrap().name, "vae-ft-mse.safetensors");
}

#[test]
fn ensure_hash_matches_sha256sum_and_fills_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    // Over 1 MiB, so the hash streams through several buffer fills.
    write_safetensors_sized(&models.join("big.safetensors"), CKPT_KEYS, 1 << 20);
    write_safetensors(&models.join("vae.safetensors"), VAE_KEYS);
    let cache = tmp.path().join("cache/not/yet/hashes.json");
    let cfg = CatalogConfig { hash_cache: Some(cache.clone()), ..config(&[&models]) };

    let mut catalog = Catalog::scan(&cfg).unwrap();
    assert_eq!(catalog.checkpoints[0].sha256, None);
    assert!(!cache.exists(), "scanning must not hash");
    let path = catalog.checkpoints[0].path.clone();
    let expected = sha256sum(&path);

    let sha = catalog.ensure_hash(0).unwrap().unwrap();
    assert_eq!(sha, expected);
    let ckpt = &catalog.checkpoints[0];
    assert_eq!(ckpt.sha256.as_deref(), Some(expected.as_str()));
    assert_eq!(ckpt.shorthash(), Some(&expected[..10]));
    assert_eq!(ckpt.title(), format!("big.safetensors [{}]", &expected[..10]));
    assert_eq!(catalog.ensure_hash(0).unwrap().unwrap(), expected);
    let vae_sha = catalog.ensure_vae_hash(0).unwrap().unwrap();
    assert_eq!(vae_sha, sha256sum(&catalog.vaes[0].path));

    // The cache file now exists (parents created) and holds both hashes keyed by canonical path.
    let written: serde_json::Value = serde_json::from_slice(&fs::read(&cache).unwrap()).unwrap();
    let entry = &written[path.to_str().unwrap()];
    assert_eq!(entry["sha256"], expected.as_str());
    assert_eq!(entry["size"], fs::metadata(&path).unwrap().len());
    assert_eq!(written.as_object().unwrap().len(), 2);

    // A second scan picks the hash up from the cache.
    let again = Catalog::scan(&cfg).unwrap();
    assert_eq!(again.checkpoints[0].sha256.as_deref(), Some(expected.as_str()));
    assert_eq!(again.vaes[0].sha256.as_deref(), Some(vae_sha.as_str()));

    // With a fake hash under the same size and mtime, scan and ensure_hash return the fake: they read the cache
    // and do not hash.
    let fake = "ab".repeat(32);
    let mut edited = written.clone();
    edited[path.to_str().unwrap()]["sha256"] = fake.clone().into();
    fs::write(&cache, serde_json::to_vec(&edited).unwrap()).unwrap();
    let mut faked = Catalog::scan(&cfg).unwrap();
    assert_eq!(faked.checkpoints[0].sha256.as_deref(), Some(fake.as_str()));
    assert_eq!(faked.ensure_hash(0).unwrap().as_deref(), Some(fake.as_str()));

    // Touching the file invalidates its entry; hashing again gives the true hash and rewrites the entry.
    let mtime = fs::metadata(&path).unwrap().modified().unwrap();
    let file = fs::File::options().write(true).open(&path).unwrap();
    file.set_modified(mtime + Duration::from_secs(5)).unwrap();
    drop(file);
    let mut touched = Catalog::scan(&cfg).unwrap();
    assert_eq!(touched.checkpoints[0].sha256, None);
    assert_eq!(touched.vaes[0].sha256.as_deref(), Some(vae_sha.as_str()));
    assert_eq!(touched.ensure_hash(0).unwrap().unwrap(), expected);
    assert_eq!(Catalog::scan(&cfg).unwrap().checkpoints[0].sha256.as_deref(), Some(expected.as_str()));
}

#[test]
fn ensure_hash_reads_a_cache_written_after_scan() {
    // Two workers on one node share the cache file: the second must not re-hash what the first just hashed.
    let tmp = tempfile::tempdir().unwrap();
    write_safetensors(&tmp.path().join("models/a.safetensors"), CKPT_KEYS);
    let cfg = CatalogConfig {
        hash_cache: Some(tmp.path().join("hashes.json")),
        ..config(&[&tmp.path().join("models")])
    };
    let mut first = Catalog::scan(&cfg).unwrap();
    let mut second = Catalog::scan(&cfg).unwrap();
    first.ensure_hash(0).unwrap();
    let path = first.checkpoints[0].path.to_str().unwrap().to_string();
    let mut cache: serde_json::Value =
        serde_json::from_slice(&fs::read(tmp.path().join("hashes.json")).unwrap()).unwrap();
    let fake = "cd".repeat(32);
    cache[&path]["sha256"] = fake.clone().into();
    fs::write(tmp.path().join("hashes.json"), serde_json::to_vec(&cache).unwrap()).unwrap();
    assert_eq!(second.ensure_hash(0).unwrap().as_deref(), Some(fake.as_str()));
}

#[test]
fn corrupt_cache_is_ignored_and_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    write_safetensors(&models.join("a.safetensors"), CKPT_KEYS);
    let cache = tmp.path().join("hashes.json");
    fs::write(&cache, b"{ this is not json").unwrap();
    let cfg = CatalogConfig { hash_cache: Some(cache.clone()), ..config(&[&models]) };
    let mut catalog = Catalog::scan(&cfg).unwrap();
    assert_eq!(catalog.checkpoints[0].sha256, None);
    let sha = catalog.ensure_hash(0).unwrap().unwrap();
    let written: serde_json::Value = serde_json::from_slice(&fs::read(&cache).unwrap()).unwrap();
    assert_eq!(written[catalog.checkpoints[0].path.to_str().unwrap()]["sha256"], sha.as_str());
}

#[test]
fn no_cache_file_keeps_hashes_in_memory() {
    let tmp = tempfile::tempdir().unwrap();
    write_safetensors(&tmp.path().join("a.safetensors"), CKPT_KEYS);
    let mut catalog = Catalog::scan(&config(&[tmp.path()])).unwrap();
    assert!(catalog.ensure_hash(0).unwrap().is_some());
    assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 1, "nothing written beside the models");
    assert!(matches!(catalog.ensure_hash(7), Err(CatalogError::NoSuchCheckpoint { index: 7, len: 1 })));
}

#[test]
fn diffusers_folders_have_no_hash() {
    let tmp = tempfile::tempdir().unwrap();
    write_file(&tmp.path().join("sd15/model_index.json"), b"{}");
    let mut catalog = Catalog::scan(&config(&[tmp.path()])).unwrap();
    assert_eq!(catalog.ensure_hash(0).unwrap(), None);
    assert_eq!(catalog.checkpoints[0].title(), "sd15");
    assert!(catalog.vae_beside(&catalog.checkpoints[0]).is_none());
}

/// a.safetensors and sub/deep/b.safetensors (hashed), two dreamshaper variants (unhashed), and a second root.
fn find_fixture(tmp: &Path) -> (Catalog, String) {
    let models = tmp.join("models");
    write_safetensors(&models.join("a.safetensors"), CKPT_KEYS);
    write_safetensors_sized(&models.join("sub/deep/b.safetensors"), CKPT_KEYS, 8);
    write_safetensors(&models.join("dreamshaper_8.safetensors"), CKPT_KEYS);
    write_safetensors(&models.join("dreamshaper_8_inpainting.safetensors"), CKPT_KEYS);
    write_safetensors(&models.join("SDXL/Juggernaut.safetensors"), CKPT_KEYS);
    let second = tmp.join("more");
    write_safetensors_sized(&second.join("a.safetensors"), CKPT_KEYS, 16);
    let mut catalog = Catalog::scan(&config(&[&models, &second])).unwrap();
    let b = catalog.find_index("sub/deep/b.safetensors").unwrap();
    let sha = catalog.ensure_hash(b).unwrap().unwrap();
    (catalog, sha)
}

#[test]
fn find_like_a1111() {
    let tmp = tempfile::tempdir().unwrap();
    let (catalog, sha) = find_fixture(tmp.path());
    let short = &sha[..10];
    let found = |q: &str| catalog.find(q).map(|c| c.name.as_str()).map_err(|e| e.to_string());
    let b = Ok("sub/deep/b.safetensors");

    assert_eq!(found(&format!("sub/deep/b.safetensors [{short}]")), b, "title");
    assert_eq!(found("sub/deep/b.safetensors"), b, "name");
    assert_eq!(found("sub_deep_b"), b, "model_name");
    assert_eq!(found(&format!("sub_deep_b [{short}]")), b, "model_name [shorthash]");
    assert_eq!(found("b"), b, "name_for_extra");
    assert_eq!(found(&sha), b, "sha256");
    assert_eq!(found(short), b, "shorthash");
    assert_eq!(found(&sha.to_uppercase()), b, "sha256, case-insensitively");
    let path = catalog.find("sub_deep_b").unwrap().path.clone();
    assert_eq!(found(path.to_str().unwrap()), b, "canonical path");
    assert_eq!(found("sub/deep/b.safetensors [0123456789]"), b, "title with a stale hash");
    assert_eq!(found("sub_deep_b [0123456789]"), b, "model_name with a stale hash");
    assert_eq!(found("deep/b"), b, "substring");

    // Substring: the shortest title wins.
    assert_eq!(found("dreamshaper"), Ok("dreamshaper_8.safetensors"));
    assert_eq!(found("inpainting"), Ok("dreamshaper_8_inpainting.safetensors"));
    // Case-insensitive fallback, for aliases and substrings.
    assert_eq!(found("DreamShaper_8_Inpainting"), Ok("dreamshaper_8_inpainting.safetensors"));
    assert_eq!(found("juggernaut"), Ok("SDXL/Juggernaut.safetensors"));
    assert_eq!(found("sdxl_juggernaut"), Ok("SDXL/Juggernaut.safetensors"));

    // The same name in two roots: both listed, the first root's found.
    let roots: Vec<&Path> =
        catalog.checkpoints.iter().filter(|c| c.name == "a.safetensors").map(|c| c.root.as_path()).collect();
    assert_eq!(roots.len(), 2);
    assert_eq!(
        catalog.find("a.safetensors").unwrap().root,
        fs::canonicalize(tmp.path().join("models")).unwrap()
    );
    assert_eq!(catalog.find("a").unwrap().root, roots[0]);
}

#[test]
fn not_found_lists_the_closest_titles() {
    let tmp = tempfile::tempdir().unwrap();
    let (catalog, _) = find_fixture(tmp.path());
    let err = catalog.find("dremshaper").unwrap_err();
    assert_eq!(err.query, "dremshaper");
    assert_eq!(err.closest.len(), 3);
    assert_eq!(err.closest[0], "dreamshaper_8.safetensors");
    assert_eq!(err.closest[1], "dreamshaper_8_inpainting.safetensors");
    let message = err.to_string();
    assert!(
        message.starts_with("no checkpoint `dremshaper`; closest: dreamshaper_8.safetensors, "),
        "{message}"
    );

    assert!(catalog.find("").is_err());
    assert!(catalog.find("   ").is_err());
    assert!(catalog.find("zzz [0123456789]").is_err());

    let empty = tempfile::tempdir().unwrap();
    let none = Catalog::scan(&config(&[empty.path()])).unwrap();
    let err = none.find("anything").unwrap_err();
    assert!(err.closest.is_empty());
    assert!(err.to_string().contains("no checkpoints in the models dirs"), "{err}");
}

#[cfg(unix)]
#[test]
fn symlinks_stay_inside_the_root() {
    use std::os::unix::fs::symlink;
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    let outside = tmp.path().join("outside");
    write_safetensors(&outside.join("secret.safetensors"), CKPT_KEYS);
    write_safetensors(&models.join("real/a.safetensors"), CKPT_KEYS);
    symlink(outside.join("secret.safetensors"), models.join("escape.safetensors")).unwrap();
    symlink(&outside, models.join("escape_dir")).unwrap();
    symlink(models.join("real/a.safetensors"), models.join("alias.safetensors")).unwrap();
    symlink(&models, models.join("real/loop")).unwrap();
    symlink(tmp.path().join("nowhere"), models.join("dangling.safetensors")).unwrap();

    let catalog = Catalog::scan(&config(&[&models])).unwrap();
    assert_eq!(names(&catalog), ["alias.safetensors", "real/a.safetensors"]);
    // A symlink inside the root is listed under its own name but points at the real file.
    assert_eq!(catalog.checkpoints[0].path, fs::canonicalize(models.join("real/a.safetensors")).unwrap());
    assert!(catalog.refused.is_empty());

    // A models dir given through a symlink is canonicalised first, so its own files are inside it.
    let link_root = tmp.path().join("models_link");
    symlink(&models, &link_root).unwrap();
    let via_link = Catalog::scan(&config(&[&link_root])).unwrap();
    assert_eq!(names(&via_link), ["alias.safetensors", "real/a.safetensors"]);
}

#[test]
fn missing_models_dir_is_an_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let missing: PathBuf = tmp.path().join("no-such-models");
    let err = Catalog::scan(&config(&[&missing])).unwrap_err();
    assert!(matches!(err, CatalogError::Dir { .. }), "{err:?}");
    assert!(err.to_string().contains("no-such-models"), "{err}");

    write_file(&tmp.path().join("file"), b"x");
    let err = Catalog::scan(&config(&[&tmp.path().join("file")])).unwrap_err();
    assert!(err.to_string().contains("not a folder"), "{err}");

    let cfg = CatalogConfig { vae_dirs: vec![missing.clone()], ..config(&[tmp.path()]) };
    let err = Catalog::scan(&cfg).unwrap_err();
    assert!(err.to_string().starts_with("VAE dir"), "{err}");
}

#[test]
fn scan_order_is_deterministic() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["z.safetensors", "m/b.safetensors", "a.safetensors", "B.safetensors"] {
        write_safetensors(&tmp.path().join(name), CKPT_KEYS);
    }
    let catalog = Catalog::scan(&config(&[tmp.path()])).unwrap();
    assert_eq!(names(&catalog), ["B.safetensors", "a.safetensors", "m/b.safetensors", "z.safetensors"]);
}

#[test]
fn gguf_checkpoints_are_named_and_hashed_as_a1111_does_and_refused_where_the_engine_cannot_load_them() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    write_sd_gguf(&models.join("xl/juggernaut-q8_0.gguf"), "sdxl");
    write_sd_gguf(&models.join("v1-5-q8_0.gguf"), "sd1");
    write_safetensors(&models.join("a.safetensors"), CKPT_KEYS);
    // A UNet-only GGUF (ComfyUI-GGUF style) is not a checkpoint any engine here serves.
    gguf::write_for_tests(
        &models.join("unet-only.gguf"),
        None,
        &[("input_blocks.0.0.weight", &[3, 3, 4, 320], 1)],
    )
    .unwrap();
    let mut catalog = Catalog::scan(&config(&[&models])).unwrap();
    assert_eq!(names(&catalog), ["a.safetensors", "v1-5-q8_0.gguf", "xl/juggernaut-q8_0.gguf"]);
    let refused: Vec<(&str, &str)> =
        catalog.refused.iter().map(|r| (r.name.as_str(), r.reason.as_str())).collect();
    assert_eq!(refused.len(), 1);
    assert_eq!(refused[0].0, "unet-only.gguf");
    assert!(refused[0].1.contains("UNet alone"), "{}", refused[0].1);

    // The family is read from the header: sd.cpp's engine reports it, so a wrong reading would show there.
    let family = |name: &str| {
        let path = &catalog.find(name).unwrap().path;
        gguf::read_header(path).unwrap().sd_checkpoint().unwrap().family
    };
    assert_eq!((family("v1-5-q8_0"), family("juggernaut-q8_0")), ("sd1", "sdxl"));

    // A1111's names and hash apply to a GGUF as to any single file: the hash is the sha256 of the file.
    let xl = catalog.find_index("xl_juggernaut-q8_0").unwrap();
    let sha = catalog.ensure_hash(xl).unwrap().unwrap();
    let c = &catalog.checkpoints[xl];
    assert_eq!(sha, sha256sum(&c.path));
    assert_eq!((c.model_name.as_str(), c.name_for_extra()), ("xl_juggernaut-q8_0", "juggernaut-q8_0"));
    assert_eq!(c.title(), format!("xl/juggernaut-q8_0.gguf [{}]", &sha[..10]));
    assert_eq!(catalog.find(&sha[..10]).unwrap().path, c.path);

    // A worker whose engine loads GGUF keeps them; one that does not lists them as refused, saying where they load.
    let mut sdcpp = catalog.clone();
    let all = [CheckpointFormat::Diffusers, CheckpointFormat::SafeTensors, CheckpointFormat::Gguf];
    sdcpp.retain_loadable(&all, "stable-diffusion.cpp");
    assert_eq!(sdcpp.checkpoints.len(), 3);
    catalog
        .retain_loadable(&[CheckpointFormat::Diffusers, CheckpointFormat::SafeTensors], "the candle engine");
    assert_eq!(names(&catalog), ["a.safetensors"]);
    let refused: Vec<&str> = catalog.refused.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(refused, ["unet-only.gguf", "v1-5-q8_0.gguf", "xl/juggernaut-q8_0.gguf"]);
    let reason = &catalog.refused[1].reason;
    assert!(reason.contains("stable-diffusion.cpp") && reason.contains("the candle engine"), "{reason}");
    assert!(catalog.find("v1-5-q8_0").is_err());
}
