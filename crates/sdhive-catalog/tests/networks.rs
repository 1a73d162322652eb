//! The LoRA and embeddings catalogue on folders built by each test: classification by tensor names, refused
//! pickles and non-LoRA files, A1111 names and aliases, the addnet hash against an independent computation, the
//! hash cache, embedding shapes, and confinement to the configured folders.

use sdhive_catalog::{CatalogError, EmbeddingWidth, LoraFormat, NetworkCatalog, NetworksConfig};
use sha2::{Digest, Sha256};
use std::fs;
use std::path::Path;

/// Writes a safetensors file of F32 tensors `(name, shape)` with `metadata`, data filled with a pattern.
fn write_st(path: &Path, tensors: &[(&str, &[u64])], metadata: &[(&str, &str)]) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut offset = 0u64;
    let mut entries = Vec::new();
    for (name, shape) in tensors {
        let bytes = shape.iter().product::<u64>() * 4;
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        entries.push(format!(
            r#""{name}":{{"dtype":"F32","shape":[{}],"data_offsets":[{offset},{}]}}"#,
            dims.join(","),
            offset + bytes
        ));
        offset += bytes;
    }
    let meta: Vec<String> =
        metadata.iter().map(|(k, v)| format!("{}:{}", serde_json::json!(k), serde_json::json!(v))).collect();
    let mut header = format!(r#"{{"__metadata__":{{{}}},{}}}"#, meta.join(","), entries.join(","));
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend((0..offset).map(|i| (i * 7 % 253) as u8));
    fs::write(path, bytes).unwrap();
}

const KOHYA: &[(&str, &[u64])] = &[
    ("lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight", &[4, 32]),
    ("lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight", &[32, 4]),
    ("lora_unet_down_blocks_0_attentions_0_proj_in.alpha", &[]),
];

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn config(lora: &Path, emb: &Path) -> NetworksConfig {
    NetworksConfig {
        lora_dirs: vec![lora.to_path_buf()],
        embeddings_dirs: vec![emb.to_path_buf()],
        ..Default::default()
    }
}

#[test]
fn scan_classifies_names_and_refuses() {
    let tmp = tempfile::tempdir().unwrap();
    let (lora, emb) = (tmp.path().join("Lora"), tmp.path().join("emb"));
    write_st(
        &lora.join("styleA.safetensors"),
        KOHYA,
        &[("ss_output_name", "style_a_v1"), ("ss_tag_frequency", r#"{"x": {"cat": 3}}"#)],
    );
    write_st(
        &lora.join("sub/peft.safetensors"),
        &[("unet.down.to_q.lora_A.weight", &[4, 32]), ("unet.down.to_q.lora_B.weight", &[32, 4])],
        &[],
    );
    write_st(
        &lora.join("loha.safetensors"),
        &[("lora_unet_x.hada_w1_a", &[4, 4]), ("lora_unet_x.hada_w1_b", &[4, 4])],
        &[],
    );
    write_st(&lora.join("lokr.safetensors"), &[("lora_unet_x.lokr_w1", &[4, 4])], &[]);
    write_st(
        &lora.join("dora.safetensors"),
        &[("lora_unet_x.lora_down.weight", &[4, 4]), ("lora_unet_x.dora_scale", &[1, 4])],
        &[],
    );
    write_st(&lora.join("ckpt.safetensors"), &[("model.diffusion_model.input_blocks.0.0.weight", &[4])], &[]);
    write_st(&lora.join("other.safetensors"), &[("foo.weight", &[4])], &[]);
    fs::write(lora.join("old.pt"), b"\x80\x02 pickle").unwrap();
    fs::write(lora.join("notes.txt"), b"hi").unwrap();
    fs::write(lora.join("broken.safetensors"), b"\x05\0\0\0\0\0\0\0{").unwrap();

    write_st(&emb.join("EasyNegative.safetensors"), &[("emb_params", &[8, 768])], &[]);
    write_st(&emb.join("xl_neg.safetensors"), &[("clip_l", &[2, 768]), ("clip_g", &[2, 1280])], &[]);
    write_st(&emb.join("learned.safetensors"), &[("<concept>", &[1024])], &[]);
    write_st(&emb.join("many.safetensors"), &[("a", &[768]), ("b", &[768])], &[]);
    fs::write(emb.join("pickled.pt"), b"x").unwrap();

    let cat = NetworkCatalog::scan(&config(&lora, &emb)).unwrap();
    let names: Vec<(&str, &str, LoraFormat, bool)> =
        cat.loras.iter().map(|l| (l.name.as_str(), l.alias.as_str(), l.format, l.dora)).collect();
    assert_eq!(
        names,
        vec![
            ("dora", "dora", LoraFormat::Lora, true),
            ("loha", "loha", LoraFormat::LoHa, false),
            ("lokr", "lokr", LoraFormat::LoKr, false),
            ("peft", "peft", LoraFormat::Peft, false),
            ("styleA", "style_a_v1", LoraFormat::Lora, false),
        ]
    );
    let style = cat.find_lora("styleA").unwrap();
    assert_eq!(style.path, fs::canonicalize(lora.join("styleA.safetensors")).unwrap());
    assert_eq!(style.metadata_json()["ss_tag_frequency"], serde_json::json!({"x": {"cat": 3}}));
    assert_eq!(style.metadata_json()["ss_output_name"], "style_a_v1");
    assert_eq!(cat.find_lora("style_a_v1").unwrap().name, "styleA");
    assert_eq!(cat.find_lora("STYLEA").unwrap().name, "styleA");
    let miss = cat.find_lora("styleB").unwrap_err();
    assert_eq!(miss.closest.first().map(String::as_str), Some("styleA"));
    assert!(miss.to_string().contains("no LoRA `styleB`; closest: styleA"), "{miss}");

    let refused: Vec<(&str, &str)> = cat.refused.iter().map(|r| (r.name.as_str(), r.kind)).collect();
    assert_eq!(
        refused,
        vec![
            ("broken", "lora"),
            ("ckpt", "lora"),
            ("many", "embedding"),
            ("old", "lora"),
            ("other", "lora"),
            ("pickled", "embedding")
        ]
    );
    assert!(cat.refused_lora("old").unwrap().reason.contains("pickle"));
    assert!(cat.refused_lora("ckpt").unwrap().reason.contains("checkpoint"));

    let embs: Vec<(&str, EmbeddingWidth, u64, u64)> =
        cat.embeddings.iter().map(|e| (e.name.as_str(), e.width, e.vectors, e.shape())).collect();
    assert_eq!(
        embs,
        vec![
            ("EasyNegative", EmbeddingWidth::Single(768), 8, 768),
            ("learned", EmbeddingWidth::Single(1024), 1, 1024),
            ("xl_neg", EmbeddingWidth::Pair { clip_l: 768, clip_g: 1280 }, 2, 2048),
        ]
    );
    assert!(cat.embeddings[0].fits(&[768]) && !cat.embeddings[0].fits(&[1024]));
    assert!(cat.embeddings[2].fits(&[768, 1280]) && !cat.embeddings[2].fits(&[768]));
    let found: Vec<&str> = cat
        .embeddings_in("(easynegative:1.2), xl_neg, EasyNegatives, learned_x")
        .into_iter()
        .map(|i| cat.embeddings[i].name.as_str())
        .collect();
    assert_eq!(found, vec!["EasyNegative", "xl_neg"]);
}

#[test]
fn addnet_hash_skips_the_header_and_is_cached_apart_from_the_file_hash() {
    let tmp = tempfile::tempdir().unwrap();
    let (lora, emb) = (tmp.path().join("Lora"), tmp.path().join("emb"));
    fs::create_dir_all(&emb).unwrap();
    let file = lora.join("a.safetensors");
    write_st(&file, KOHYA, &[("ss_output_name", "a")]);
    let bytes = fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let expected = hex(&Sha256::digest(&bytes[8 + n..]));
    let whole = hex(&Sha256::digest(&bytes));
    assert_ne!(expected, whole);

    let cache = tmp.path().join("cache/hashes.json");
    let cfg = NetworksConfig { hash_cache: Some(cache.clone()), ..config(&lora, &emb) };
    let mut cat = NetworkCatalog::scan(&cfg).unwrap();
    assert_eq!(cat.loras[0].sha256, None);
    assert_eq!(cat.ensure_lora_hash(0).unwrap(), expected);
    assert_eq!(cat.loras[0].shorthash(), Some(&expected[..12]));
    let stored: serde_json::Value = serde_json::from_slice(&fs::read(&cache).unwrap()).unwrap();
    let key = format!("addnet:{}", cat.loras[0].path.display());
    assert_eq!(stored[&key]["sha256"], expected.as_str());
    // The plain path key stays free for the whole-file hash the checkpoint catalogue uses.
    assert!(stored.get(cat.loras[0].path.to_str().unwrap()).is_none());

    // A new scan knows it from the cache; a hasher computes the same.
    let cat = NetworkCatalog::scan(&cfg).unwrap();
    assert_eq!(cat.loras[0].sha256.as_deref(), Some(expected.as_str()));
    assert_eq!(cat.hasher().lora_hash(&cat.loras[0].path).unwrap(), expected);

    // An embedding's hash is the whole file's.
    let e = emb.join("neg.safetensors");
    write_st(&e, &[("emb_params", &[2, 768])], &[]);
    let cat = NetworkCatalog::scan(&cfg).unwrap();
    assert_eq!(
        cat.hasher().embedding_hash(&cat.embeddings[0].path).unwrap(),
        hex(&Sha256::digest(fs::read(&e).unwrap()))
    );
}

#[test]
fn models_dir_subfolders_duplicates_and_confinement() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    write_st(&models.join("Lora/a.safetensors"), KOHYA, &[]);
    write_st(&models.join("LyCORIS/deep/b.safetensors"), KOHYA, &[]);
    write_st(&models.join("embeddings/e.safetensors"), &[("emb_params", &[1, 768])], &[]);
    let extra = tmp.path().join("extra");
    write_st(&extra.join("a.safetensors"), KOHYA, &[]);
    let outside = tmp.path().join("outside");
    write_st(&outside.join("secret.safetensors"), KOHYA, &[]);
    #[cfg(unix)]
    std::os::unix::fs::symlink(outside.join("secret.safetensors"), models.join("Lora/link.safetensors"))
        .unwrap();

    let cfg = NetworksConfig {
        lora_dirs: vec![extra.clone()],
        models_dirs: vec![models.clone()],
        ..Default::default()
    };
    let cat = NetworkCatalog::scan(&cfg).unwrap();
    let names: Vec<&str> = cat.loras.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, vec!["a", "b"]);
    // The configured folder comes first, so its `a` wins; the other is refused naming it.
    assert!(cat.loras[0].path.starts_with(fs::canonicalize(&extra).unwrap()));
    let dup = cat.refused.iter().find(|r| r.name == "a").unwrap();
    assert!(dup.reason.contains("another lora named `a`"), "{}", dup.reason);
    assert_eq!(cat.embeddings.len(), 1);
    assert!(cat.find_lora("secret").is_err() && cat.find_lora("link").is_err());

    let missing = tmp.path().join("nope");
    let err =
        NetworkCatalog::scan(&NetworksConfig { lora_dirs: vec![missing.clone()], ..Default::default() })
            .unwrap_err();
    assert!(matches!(err, CatalogError::Dir { kind: "LoRA", .. }), "{err}");
    assert!(err.to_string().contains("nope"));
}
