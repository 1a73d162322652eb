//! Broken tokenizer folders fail with an error naming the offending file.

use std::path::Path;

use sdhive_tokenizer::{ClipTokenizer, TokenizerError};

const VOCAB: &str = r#"{"a": 0, "b": 1, "a</w>": 2, "b</w>": 3, "ab</w>": 4,
    "<|startoftext|>": 5, "<|endoftext|>": 6}"#;

fn folder(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, body) in files {
        std::fs::write(dir.path().join(name), body).unwrap();
    }
    dir
}

fn err(dir: &Path) -> String {
    ClipTokenizer::from_dir(dir).unwrap_err().to_string()
}

#[test]
fn minimal_folder_loads_and_merges() {
    let dir = folder(&[("vocab.json", VOCAB), ("merges.txt", "#version: 0.2\na b</w>\n")]);
    let tok = ClipTokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.encode("ab ba"), [4, 1, 2]);
    assert_eq!((tok.bos_id(), tok.eos_id(), tok.pad_id()), (5, 6, 6));
    // Unknown byte symbols fall back to the unk token (eos by default).
    assert_eq!(tok.encode("c"), [6]);
}

#[test]
fn missing_files_are_named() {
    let dir = folder(&[("merges.txt", "#version: 0.2\n")]);
    let e = err(dir.path());
    assert!(e.contains("vocab.json"), "{e}");
    let dir = folder(&[("vocab.json", VOCAB)]);
    let e = err(dir.path());
    assert!(e.contains("merges.txt"), "{e}");
}

#[test]
fn corrupt_files_are_named() {
    let dir = folder(&[("vocab.json", "{not json"), ("merges.txt", "#v\n")]);
    let e = ClipTokenizer::from_dir(dir.path()).unwrap_err();
    assert!(matches!(e, TokenizerError::Json { .. }));
    assert!(e.to_string().contains("vocab.json"), "{e}");

    let dir = folder(&[("vocab.json", VOCAB), ("merges.txt", "#version: 0.2\na b c\n")]);
    let e = err(dir.path());
    assert!(e.contains("merges.txt") && e.contains("line 2"), "{e}");

    let dir = folder(&[("vocab.json", r#"{"a": -1}"#), ("merges.txt", "#v\n")]);
    let e = err(dir.path());
    assert!(e.contains("vocab.json"), "{e}");

    let dir = folder(&[
        ("vocab.json", VOCAB),
        ("merges.txt", "#v\n"),
        ("tokenizer_config.json", r#"{"model_max_length": "long"}"#),
    ]);
    let e = err(dir.path());
    assert!(e.contains("tokenizer_config.json") && e.contains("model_max_length"), "{e}");
}

#[test]
fn unknown_special_token_names_its_source() {
    let dir = folder(&[
        ("vocab.json", VOCAB),
        ("merges.txt", "#v\n"),
        ("special_tokens_map.json", r#"{"pad_token": {"content": "<pad>"}}"#),
    ]);
    let e = err(dir.path());
    assert!(e.contains("special_tokens_map.json") && e.contains("<pad>"), "{e}");
}

#[test]
fn special_tokens_map_overrides_tokenizer_config() {
    let dir = folder(&[
        ("vocab.json", VOCAB),
        ("merges.txt", "#v\n"),
        ("tokenizer_config.json", r#"{"pad_token": "<|endoftext|>", "model_max_length": 10}"#),
        ("special_tokens_map.json", r#"{"pad_token": "a"}"#),
    ]);
    let tok = ClipTokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.pad_id(), 0);
    assert_eq!(tok.max_len(), 10);
    assert_eq!(tok.encode_padded("b"), [5, 3, 6, 0, 0, 0, 0, 0, 0, 0]);
}
