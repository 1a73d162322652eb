//! LoRA and textual-inversion parity with diffusers (and with A1111's formulas where diffusers has none): every
//! case of `golden/lora.json` (made by `xtask/fixtures/gen_lora.py`) replayed on the tiny models; and the
//! guarantees around merging: taking LoRAs out gives the weights back bit for bit, the RAM cache's host copy is
//! never changed, and a LoRA that does not fit is refused with the model left as it was.

use crate::cache::HostCache;
use crate::model::SdModel;
use crate::parity_tests::{cases, check_cases, failing_cases, fixtures, run_case};
use crate::residency::Targets;
use crate::test_device::test_device;
use candle_core::{DType, Tensor};
use sdhive_engine::LoraUse;
use serde_json::Value;
use std::collections::HashMap;

fn lora_cases() -> Vec<Value> {
    let text = std::fs::read(fixtures().join("golden/lora.json")).expect("tests/fixtures/golden/lora.json");
    serde_json::from_slice::<Value>(&text).expect("lora.json").as_array().expect("a list of cases").clone()
}

fn lora(file: &str, te: f32, unet: f32) -> LoraUse {
    LoraUse {
        name: file.to_string(),
        path: fixtures().join("models/Lora").join(format!("{file}.safetensors")),
        te,
        unet,
        hash: None,
    }
}

fn load(name: &str) -> SdModel {
    let (dev, dtype) = (&test_device().device, test_device().dtype);
    SdModel::from_diffusers_dir(name, &fixtures().join("models").join(name), dev, dtype)
        .unwrap_or_else(|e| panic!("loading fixture model {name}: {e}"))
}

/// Every LoRA-changeable weight of the model, as stored.
fn weights(model: &SdModel) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    let mut take = |prefix: &str, names: Vec<String>, read: &dyn Fn(&str) -> Tensor| {
        for name in names {
            let t = read(&name);
            let v = t
                .to_dtype(DType::F32)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1())
                .expect("values");
            out.push((format!("{prefix}{name}"), v));
        }
    };
    let mut names: Vec<String> = model.unet.param_shapes().into_keys().collect();
    names.sort();
    take("unet.", names, &|n| model.unet.read_param(n).expect("weight").expect("read"));
    for (i, e) in model.encoders.iter().enumerate() {
        let mut names: Vec<String> = e.model.param_shapes().into_keys().collect();
        names.sort();
        take(&format!("te{i}."), names, &|n| e.model.read_param(n).expect("weight").expect("read"));
    }
    out
}

/// Each case's image and latents match the reference within the pipeline parity's tolerance; the models are
/// shared, so every case also runs on weights another case's LoRAs were merged into and taken out of. The plain
/// cases after them must still match their own goldens.
#[test]
fn every_lora_case_matches_its_reference() {
    let cases = lora_cases();
    assert!(cases.len() >= 9, "expected the LoRA and embedding cases, found {}", cases.len());
    let mut models = HashMap::new();
    let failures = failing_cases(&mut models, &cases);
    assert!(failures.is_empty(), "cases off their reference on {}: {failures:?}", test_device().label);
    check_cases(&mut models, &["sd1_euler", "sdxl_euler"], "after the LoRA cases");
}

/// After a LoRA job, a job without it computes with the weights a fresh load has, bit for bit (the merged
/// weights are put back from copies, not by subtracting).
#[test]
fn taking_loras_out_gives_the_weights_back_bit_for_bit() {
    let fresh = weights(&load("sd1"));
    let mut model = load("sd1");
    model.set_loras(&[lora("sd1_kohya", 1.0, 1.0), lora("sd1_locon", 0.5, 0.5)]).expect("merge");
    let merged = weights(&model);
    let changed = merged.iter().zip(&fresh).filter(|(a, b)| a.1 != b.1).count();
    assert!(changed > 20, "the LoRAs changed only {changed} weights");
    assert!(model.loras.kept_bytes() > 0);
    // Another set: the first is taken out before the second goes in.
    model.set_loras(&[lora("sd1_loha", 1.0, 1.0)]).expect("merge");
    model.set_loras(&[]).expect("take out");
    assert_eq!(model.loras.kept_bytes(), 0);
    let restored = weights(&model);
    for ((name, a), (_, b)) in restored.iter().zip(&fresh) {
        assert!(a == b, "{name} differs from the fresh model's after the LoRAs were taken out");
    }
}

/// On the CPU a placed model shares its tensors with the RAM cache's host copy: a merge must not reach the
/// copy, so the next placement of the same checkpoint is the plain model.
#[test]
fn the_ram_cache_keeps_the_plain_weights() {
    let resolved =
        sdhive_modelsource::resolve(&fixtures().join("models/sd1").to_string_lossy(), &Default::default())
            .expect("fixture model");
    let targets = Targets::all(&candle_core::Device::Cpu, DType::F32);
    let mut cache = HostCache::new(1);
    let fresh = weights(&cache.load(&resolved, &targets).expect("load"));
    {
        let mut model = cache.load(&resolved, &targets).expect("load from the cache");
        model.set_loras(&[lora("sd1_kohya", 1.0, 1.0)]).expect("merge");
        assert_ne!(weights(&model), fresh, "the LoRA changed nothing");
    }
    let again = weights(&cache.load(&resolved, &targets).expect("load from the cache"));
    assert!(again == fresh, "the cached copy kept the merged LoRA");
}

/// An SDXL LoRA on an SD1 model is refused naming the LoRA, and leaves the model as it was; so does a file that
/// is no LoRA.
#[test]
fn a_lora_that_does_not_fit_is_refused_and_changes_nothing() {
    let fresh = weights(&load("sd1"));
    let mut model = load("sd1");
    model.set_loras(&[lora("sd1_kohya", 1.0, 1.0)]).expect("merge");
    let err =
        model.set_loras(&[lora("sd1_peft", 1.0, 1.0), lora("sdxl_kohya", 1.0, 1.0)]).expect_err("refused");
    let message = err.to_string();
    assert!(matches!(err, crate::LoraApplyError::Invalid { .. }), "{message}");
    assert!(message.contains("sdxl_kohya"), "{message}");
    assert!(weights(&model) == fresh, "a refused set left weights changed");
    let not_lora =
        LoraUse { path: fixtures().join("models/VAE/sd1-alt.safetensors"), ..lora("sd1-alt", 1.0, 1.0) };
    assert!(model.set_loras(&[not_lora]).is_err());
    assert!(weights(&model) == fresh);
}

/// The pipeline cases run with an empty LoRA list after LoRA cases: covered by
/// [`every_lora_case_matches_its_reference`]; here the plain goldens alone, with a LoRA set and unset first on
/// a model that then runs them.
#[test]
fn plain_cases_after_a_lora_was_set_and_unset() {
    let mut model = load("sd1");
    model.set_loras(&[lora("sd1_lokr", 1.0, 0.8)]).expect("merge");
    model.set_loras(&[]).expect("take out");
    let mut models = HashMap::from([("sd1".to_string(), model)]);
    let picked: Vec<&str> = vec!["sd1_euler", "sd1_img2img_ddim"];
    assert!(cases().iter().any(|c| c["case"] == "sd1_euler"));
    check_cases(&mut models, &picked, "after a LoRA was taken out");
}

/// Offloaded networks keep host copies that are built at each use: a LoRA is merged into the copy (new tensors,
/// the cache's untouched) and the images still match; taking it out gives the plain image again.
#[test]
fn loras_on_offloaded_networks_match_their_reference() {
    use crate::residency::ModuleTarget;
    let (dev, dtype) = (&test_device().device, test_device().dtype);
    let targets = Targets {
        unet: ModuleTarget { device: dev.clone(), dtype, offload: false, host_copy: false },
        text: ModuleTarget {
            device: candle_core::Device::Cpu,
            dtype: DType::F32,
            offload: true,
            host_copy: false,
        },
        vae: ModuleTarget { device: dev.clone(), dtype, offload: true, host_copy: false },
    };
    let model = SdModel::from_diffusers_dir_on("sd1", &fixtures().join("models/sd1"), &targets).expect("sd1");
    assert!(model.encoders[0].model.offloaded());
    let mut models = HashMap::from([("sd1".to_string(), model)]);
    let tol = test_device().tolerance;
    for name in ["sd1_lora_te_unet", "sd1_lora_two"] {
        let case = lora_cases().into_iter().find(|c| c["case"] == name).expect("case");
        let r = run_case(&mut models, &case);
        eprintln!("offloaded {name}: latent rel diff {:.2e}, pixels off {}", r.latent_rel, r.pixels_off);
        assert!(r.latent_rel <= tol.latent_rel, "offloaded {name} off its reference");
    }
    check_cases(&mut models, &["sd1_euler"], "offloaded, after the LoRA cases");
}

/// A prompt encoded again comes from the cache; merging a LoRA into the text encoder, or another embedding set,
/// empties it, so the next encoding is the changed encoder's (equal to one made with no cache at all), and taking
/// the LoRA out gives the plain encoding back.
#[test]
fn prompt_encodings_are_kept_until_the_text_encoders_change() {
    use crate::conditioning::encode_pair;
    let mut model = load("sd1");
    let values = |m: &SdModel| -> Vec<f32> {
        let pair = encode_pair(m, "a cat on a red sofa", "blurry", 1).expect("encoding");
        let both = Tensor::cat(&[&pair.positive.context, &pair.negative.context], 0).expect("cat");
        both.to_dtype(DType::F32).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1()).expect("values")
    };
    let plain = values(&model);
    assert_eq!(model.text_cache.len(), 2, "the prompt and the negative prompt are kept");
    assert_eq!(values(&model), plain);
    assert_eq!(model.text_cache.len(), 2, "encoding them again adds nothing");

    model.set_loras(&[lora("sd1_kohya", 1.0, 1.0)]).expect("the LoRA merges");
    let with_lora = values(&model);
    assert_ne!(with_lora, plain, "the LoRA changes the text encoder");
    model.text_cache = Default::default();
    assert_eq!(values(&model), with_lora, "as encoded without a cache");

    model.set_loras(&[]).expect("the LoRA comes out");
    assert_eq!(values(&model), plain);

    let emb = sdhive_engine::EmbeddingUse {
        name: "emb".into(),
        path: fixtures().join("models/embeddings/sd1_emb.safetensors"),
        hash: None,
    };
    encode_pair(&model, "a dog", "", 1).expect("encoding");
    assert_eq!(model.text_cache.len(), 4);
    model.set_embeddings(&[emb]).expect("the embedding loads");
    assert_eq!(values(&model), plain, "an embedding the prompt does not name changes nothing");
    assert_eq!(model.text_cache.len(), 2, "kept anew for the new embedding set");
}
