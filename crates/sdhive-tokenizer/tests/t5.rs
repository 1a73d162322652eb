//! The T5 tokenizer against transformers 5's `T5TokenizerFast` and sentencepiece on the SD3 fixture
//! `tokenizer_3/` (`golden/sd3.json`, `t5_tokenizer_cases`, written by `xtask/fixtures/gen_sd3.py`), from
//! `tokenizer.json` and from `spiece.model` alone; and the errors of broken folders. A missing fixture fails.

mod common;

use common::fixture;
use sdhive_tokenizer::{T5Tokenizer, TokenizerError, T5_DEFAULT_MAX_LEN, T5_MAX_LEN};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn tokenizer_dir() -> PathBuf {
    let dir = fixture("models/sd3/tokenizer_3");
    assert!(dir.join("tokenizer.json").is_file(), "{} is missing: generate the SD3 fixtures", dir.display());
    dir
}

fn cases() -> Vec<Value> {
    let path = fixture("golden/sd3.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let golden: Value = serde_json::from_str(&text).expect("sd3.json is JSON");
    let cases = golden["t5_tokenizer_cases"].as_array().expect("t5_tokenizer_cases").clone();
    assert!(cases.len() >= 10, "too few tokenizer cases");
    cases
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("ids").iter().map(|i| u32::try_from(i.as_u64().expect("id")).expect("u32")).collect()
}

/// Every case's `key` ids against the tokenizer's, reported all at once.
fn check(tok: &T5Tokenizer, key: &str, label: &str) -> usize {
    let mut failures = Vec::new();
    let mut checked = 0;
    for case in cases() {
        let Some(want) = case.get(key) else { continue };
        let text = case["text"].as_str().expect("text");
        let got = tok.encode_unpadded(text).expect("encode");
        checked += 1;
        if got != ids(want) {
            failures.push(format!("{text:?}\n  want {:?}\n  got  {got:?}", ids(want)));
        }
    }
    assert!(failures.is_empty(), "{label}:\n{}", failures.join("\n"));
    checked
}

#[test]
fn tokenizer_json_matches_transformers_and_sentencepiece() {
    let tok = T5Tokenizer::from_dir(&tokenizer_dir()).expect("load tokenizer_3");
    assert_eq!((tok.pad_id(), tok.eos_id(), tok.unk_id()), (0, 1, 2));
    let n = check(&tok, "ids", "tokenizer.json vs transformers");
    let m = check(&tok, "spiece_ids", "tokenizer.json vs sentencepiece");
    eprintln!("{n} transformers cases, {m} sentencepiece cases equal");
}

#[test]
fn spiece_model_alone_matches_transformers() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let src = tokenizer_dir();
    for f in ["spiece.model", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), tmp.path().join(f)).expect("copy");
    }
    let tok = T5Tokenizer::from_dir(tmp.path()).expect("load spiece.model");
    let from_json = T5Tokenizer::from_dir(&src).expect("load tokenizer.json");
    assert_eq!(tok.vocab_size(), from_json.vocab_size(), "pieces + sentinels");
    // The sentinel cases included: they must get the ids T5's tokenizer.json gives them.
    check(&tok, "ids", "spiece.model vs transformers");
    check(&tok, "spiece_ids", "spiece.model vs sentencepiece");
}

#[test]
fn fixed_length_layout_truncates_before_eos_and_pads() {
    let tok = T5Tokenizer::from_dir(&tokenizer_dir()).expect("load");
    let text = "x".repeat(400);
    let full = tok.encode_unpadded(&text).expect("encode");
    assert!(full.len() > 40, "the case must need truncation");
    let ids = tok.encode(&text, 32).expect("encode");
    assert_eq!(ids.len(), 32);
    assert_eq!(&ids[..31], &full[..31]);
    assert_eq!(ids[31], tok.eos_id());
    assert_eq!(tok.truncated_pieces(&text, 32).expect("count"), full.len() - 32);

    let short = tok.encode("a photo", T5_DEFAULT_MAX_LEN).expect("encode");
    let unpadded = tok.encode_unpadded("a photo").expect("encode");
    assert_eq!(short.len(), 256);
    assert_eq!(&short[..unpadded.len()], &unpadded[..]);
    assert!(short[unpadded.len()..].iter().all(|&i| i == tok.pad_id()));
    assert_eq!(tok.encode("", T5_MAX_LEN).expect("encode")[..2], [tok.eos_id(), tok.pad_id()]);

    for bad in [0, T5_MAX_LEN + 1] {
        let err = tok.encode("a", bad).expect_err("length outside 1..=512").to_string();
        assert!(err.contains("max_sequence_length"), "{err}");
    }
}

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).expect("write");
}

#[test]
fn broken_folders_name_the_file() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let err = T5Tokenizer::from_dir(tmp.path()).expect_err("empty folder").to_string();
    assert!(err.contains("tokenizer.json") && err.contains("spiece.model"), "{err}");

    write(tmp.path(), "tokenizer.json", "{ not json");
    let err = T5Tokenizer::from_dir(tmp.path()).expect_err("bad json");
    assert!(matches!(err, TokenizerError::Json { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    write(tmp.path(), "tokenizer.json", r#"{"model": {"type": "BPE", "vocab": {}, "merges": []}}"#);
    let err = T5Tokenizer::from_dir(tmp.path()).expect_err("BPE").to_string();
    assert!(err.contains("Unigram") && err.contains("tokenizer.json"), "{err}");

    // A real tokenizer.json whose config names an eos token the vocabulary lacks.
    std::fs::copy(tokenizer_dir().join("tokenizer.json"), tmp.path().join("tokenizer.json")).expect("copy");
    write(tmp.path(), "special_tokens_map.json", r#"{"pad_token": {"content": "<nothing-like-this>"}}"#);
    // Special tokens are added when missing, as transformers does, so a new pad token is accepted...
    let known = T5Tokenizer::from_dir(&tokenizer_dir()).expect("load").vocab_size();
    let tok = T5Tokenizer::from_dir(tmp.path()).expect("unknown pad becomes an added token");
    assert_eq!(tok.pad_id() as usize, known, "added after the vocabulary");
    write(tmp.path(), "special_tokens_map.json", r#"{"eos_token": 7}"#);
    let err = T5Tokenizer::from_dir(tmp.path()).expect_err("eos is a number").to_string();
    assert!(err.contains("special_tokens_map.json") && err.contains("eos_token"), "{err}");

    std::fs::remove_file(tmp.path().join("tokenizer.json")).expect("rm");
    std::fs::remove_file(tmp.path().join("special_tokens_map.json")).expect("rm");
    write(tmp.path(), "spiece.model", "\u{a}\u{5}ab");
    let err = T5Tokenizer::from_dir(tmp.path()).expect_err("truncated protobuf").to_string();
    assert!(err.contains("spiece.model") && err.contains("truncated"), "{err}");
}

/// Real SD3 repos ship tokenizer.json files written by older converters (a `Replace(" {2,}")` beside the
/// charsmap, a lone `Metaspace` pre-tokeniser, which leaves a trailing `▁` piece). transformers 5 rebuilds its
/// own pipeline around the vocabulary and gets the same ids from both files (checked with
/// `AutoTokenizer.from_pretrained` on this rewrite); so must this tokenizer.
#[test]
fn legacy_pipeline_in_tokenizer_json_is_rebuilt_as_transformers_does() {
    let src = tokenizer_dir();
    let text = std::fs::read_to_string(src.join("tokenizer.json")).expect("read");
    let mut json: Value = serde_json::from_str(&text).expect("json");
    let charsmap = json["normalizer"].clone();
    assert_eq!(charsmap["type"], "Precompiled");
    json["normalizer"] = serde_json::json!({"type": "Sequence", "normalizers": [
        charsmap, {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]});
    json["pre_tokenizer"] = serde_json::json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "always", "split": true});
    let tmp = tempfile::tempdir().expect("tempdir");
    write(tmp.path(), "tokenizer.json", &json.to_string());
    std::fs::copy(src.join("tokenizer_config.json"), tmp.path().join("tokenizer_config.json")).expect("copy");
    let tok = T5Tokenizer::from_dir(tmp.path()).expect("load legacy tokenizer.json");
    check(&tok, "ids", "legacy tokenizer.json vs transformers");
}
