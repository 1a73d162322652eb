//! SD3's T5 encoder and tokenizer against transformers (float32, CPU): `golden/sd3_t5.safetensors` holds, per
//! prompt of `golden/sd3.json`, the ids `tokenizer_3(prompt, padding="max_length", max_length=32,
//! truncation=True)` gave and `text_encoder_3(ids)[0]` (no attention mask, as diffusers' pipeline), for the
//! tiny `models/sd3/text_encoder_3` written by `xtask/fixtures/gen_sd3.py`. Also the loading paths (sharded
//! index, tied embedding name) and their errors. A missing fixture fails the test.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{fixtures, get, max_diff, sd3_prompts};
use sdhive_models::{T5Config, T5EncoderModel};
use sdhive_tokenizer::T5Tokenizer;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// As the CLIP golden tests: f32 on the CPU against torch's f32.
const TOL: f32 = 1e-4;

fn golden() -> HashMap<String, Tensor> {
    common::golden("sd3_t5.safetensors")
}

fn encoder_dir() -> PathBuf {
    let dir = fixtures().join("models/sd3/text_encoder_3");
    assert!(dir.is_dir(), "fixture folder {} is missing", dir.display());
    dir
}

fn load(dir: &Path) -> T5EncoderModel {
    T5EncoderModel::from_dir(dir, DType::F32, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn prompt_count(g: &HashMap<String, Tensor>) -> usize {
    let n = (0..).take_while(|i| g.contains_key(&format!("ids_{i}"))).count();
    assert!(n >= 2, "too few golden prompts");
    n
}

#[test]
fn hidden_states_match_transformers() {
    let g = golden();
    let enc = load(&encoder_dir());
    let n = prompt_count(&g);
    let mut worst = 0f32;
    for i in 0..n {
        let out = enc.forward(get(&g, &format!("ids_{i}"))).unwrap_or_else(|e| panic!("{e}"));
        let d = max_diff(&format!("hidden_{i}"), &out, get(&g, &format!("hidden_{i}")));
        assert!(d <= TOL && d.is_finite(), "hidden_{i}: max abs diff {d} > {TOL}");
        worst = worst.max(d);
    }
    // All prompts as one batch: every row keeps its own result.
    let ids: Vec<Tensor> = (0..n).map(|i| get(&g, &format!("ids_{i}")).clone()).collect();
    let want: Vec<Tensor> = (0..n).map(|i| get(&g, &format!("hidden_{i}")).clone()).collect();
    let out = enc.forward(&Tensor::cat(&ids, 0).expect("cat")).unwrap_or_else(|e| panic!("{e}"));
    let d = max_diff("batched", &out, &Tensor::cat(&want, 0).expect("cat"));
    assert!(d <= TOL, "batched: max abs diff {d} > {TOL}");
    eprintln!("worst max abs diff {:.3e}", worst.max(d));
}

#[test]
fn token_ids_match_transformers() {
    let g = golden();
    let prompts = sd3_prompts();
    assert_eq!(prompts.len(), prompt_count(&g), "one id row per prompt");
    let tok =
        T5Tokenizer::from_dir(&fixtures().join("models/sd3/tokenizer_3")).unwrap_or_else(|e| panic!("{e}"));
    for (i, prompt) in prompts.iter().enumerate() {
        let want: Vec<i64> =
            get(&g, &format!("ids_{i}")).flatten_all().and_then(|t| t.to_vec1()).expect("ids");
        let got: Vec<i64> =
            tok.encode(prompt, want.len()).expect("encode").into_iter().map(i64::from).collect();
        assert_eq!(got, want, "prompt {i} {prompt:?}");
    }
}

/// The fixture's tensors, by name.
fn fixture_tensors() -> HashMap<String, Tensor> {
    let path = encoder_dir().join("model.safetensors");
    candle_core::safetensors::load(&path, &Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn folder_with(tensors: &HashMap<String, Tensor>) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::copy(encoder_dir().join("config.json"), tmp.path().join("config.json")).expect("config");
    candle_core::safetensors::save(tensors, tmp.path().join("model.safetensors")).expect("save");
    tmp
}

fn same(what: &str, a: &Tensor, b: &Tensor) {
    assert_eq!(max_diff(what, a, b), 0.0, "{what}: must equal the single-file load bit for bit");
}

#[test]
fn sharded_index_and_tied_embedding_load_the_same_weights() {
    let g = golden();
    let ids = get(&g, "ids_0");
    let want = load(&encoder_dir()).forward(ids).expect("forward");

    // Two shards and the index, as SD3 repos ship T5-XXL.
    let tensors = fixture_tensors();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::copy(encoder_dir().join("config.json"), tmp.path().join("config.json")).expect("config");
    let mut weight_map = serde_json::Map::new();
    for (part, chunk) in names.chunks(names.len().div_ceil(2)).enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", part + 1);
        let shard: HashMap<String, Tensor> =
            chunk.iter().map(|n| ((*n).clone(), tensors[*n].clone())).collect();
        candle_core::safetensors::save(&shard, tmp.path().join(&file)).expect("save shard");
        for n in chunk {
            weight_map.insert((*n).clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(tmp.path().join("model.safetensors.index.json"), index.to_string()).expect("index");
    same("sharded", &load(tmp.path()).forward(ids).expect("forward"), &want);

    // The token table under either tied name (transformers writes one of `shared` / `encoder.embed_tokens`).
    let (present, other) = if tensors.contains_key("shared.weight") {
        ("shared.weight", "encoder.embed_tokens.weight")
    } else {
        ("encoder.embed_tokens.weight", "shared.weight")
    };
    let mut renamed = tensors.clone();
    let table = renamed.remove(present).expect("token table");
    renamed.insert(other.to_string(), table);
    let tmp = folder_with(&renamed);
    same("tied name", &load(tmp.path()).forward(ids).expect("forward"), &want);
}

#[test]
fn loading_errors_name_the_tensor_and_file() {
    let tensors = fixture_tensors();
    let missing = "encoder.block.1.layer.1.DenseReluDense.wo.weight";
    let mut cut = tensors.clone();
    assert!(cut.remove(missing).is_some(), "fixture layout changed");
    let tmp = folder_with(&cut);
    let err =
        T5EncoderModel::from_dir(tmp.path(), DType::F32, &Device::Cpu).expect_err("missing").to_string();
    assert!(err.contains(missing) && err.contains("model.safetensors"), "{err}");

    let bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight";
    let mut wrong = tensors.clone();
    wrong.insert(bias.into(), Tensor::zeros((3, 4), DType::F32, &Device::Cpu).expect("zeros"));
    let tmp = folder_with(&wrong);
    let err = T5EncoderModel::from_dir(tmp.path(), DType::F32, &Device::Cpu).expect_err("shape").to_string();
    assert!(err.contains(bias), "{err}");

    let tmp = folder_with(&tensors);
    let config = tmp.path().join("config.json");
    let text = std::fs::read_to_string(&config).expect("config");
    let mut json: serde_json::Value = serde_json::from_str(&text).expect("json");
    json["feed_forward_proj"] = "gated-tanh".into();
    std::fs::write(&config, json.to_string()).expect("write");
    let err = T5EncoderModel::from_dir(tmp.path(), DType::F32, &Device::Cpu).expect_err("act").to_string();
    assert!(err.contains("feed_forward_proj") && err.contains("config.json"), "{err}");

    std::fs::remove_file(tmp.path().join("model.safetensors")).expect("rm");
    std::fs::write(&config, text).expect("write");
    let err =
        T5EncoderModel::from_dir(tmp.path(), DType::F32, &Device::Cpu).expect_err("no weights").to_string();
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn bad_inputs_are_refused() {
    let enc = load(&encoder_dir());
    let vocab = enc.config().vocab_size as u32;
    let ids = Tensor::new(&[[1u32, vocab]], &Device::Cpu).expect("ids");
    let err = enc.forward(&ids).expect_err("id out of range").to_string();
    assert!(err.contains("vocab_size"), "{err}");
    let err =
        enc.forward(&Tensor::new(&[1u32, 2], &Device::Cpu).expect("ids")).expect_err("rank").to_string();
    assert!(err.contains("input_ids"), "{err}");
    let ids = Tensor::new(&[[4u32, 5, 1]], &Device::Cpu).expect("ids");
    let mask = Tensor::new(&[[1u32, 1]], &Device::Cpu).expect("mask");
    let err = enc.forward_masked(&ids, Some(&mask)).expect_err("mask shape").to_string();
    assert!(err.contains("attention_mask"), "{err}");
}

/// With transformers' key mask, what sits in the masked positions cannot reach the kept ones; without it (the
/// pipeline's call) it does.
#[test]
fn attention_mask_hides_padding() {
    let enc = load(&encoder_dir());
    let dev = Device::Cpu;
    let a = Tensor::new(&[[4u32, 36, 8, 10, 1, 0, 0, 0]], &dev).expect("ids");
    let b = Tensor::new(&[[4u32, 36, 8, 10, 1, 57, 15, 34]], &dev).expect("ids");
    let mask = Tensor::new(&[[1u32, 1, 1, 1, 1, 0, 0, 0]], &dev).expect("mask");
    let kept = |t: Tensor| t.narrow(1, 0, 5).expect("narrow");
    let ma = kept(enc.forward_masked(&a, Some(&mask)).expect("forward"));
    let mb = kept(enc.forward_masked(&b, Some(&mask)).expect("forward"));
    assert!(max_diff("masked, other padding", &ma, &mb) < 1e-6);
    // The mask must do something: the unmasked results depend on the padding.
    let ua = kept(enc.forward(&a).expect("forward"));
    let ub = kept(enc.forward(&b).expect("forward"));
    assert!(max_diff("unmasked, other padding", &ua, &ub) > 1e-3);
    assert!(max_diff("masked vs unmasked", &ma, &ua) > 1e-3);
}

/// Half precision on the CPU keeps `wo` in f32 as transformers does; the result stays near the f32 golden.
#[test]
fn f16_stays_close_to_f32() {
    let g = golden();
    let dir = encoder_dir();
    let enc = T5EncoderModel::from_dir(&dir, DType::F16, &Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    for i in 0..prompt_count(&g) {
        let out = enc.forward(get(&g, &format!("ids_{i}"))).expect("forward");
        assert_eq!(out.dtype(), DType::F16);
        let d = max_diff(&format!("f16 hidden_{i}"), &out, get(&g, &format!("hidden_{i}")));
        assert!(d < 2e-2, "f16 hidden_{i}: max abs diff {d}");
    }
    let cfg = T5Config::from_file(&dir.join("config.json")).expect("config");
    assert_eq!(cfg, *enc.config());
}
