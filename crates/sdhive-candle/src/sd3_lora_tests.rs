//! SD3 / SD3.5 LoRAs against diffusers (`golden/sd3_lora.json`, made by `xtask/fixtures/gen_sd3_lora.py`): the
//! diffusers/PEFT file through `load_lora_weights` + `set_adapters` (one multiplier, A1111's te/unet split, the
//! text encoders alone), the kohya/SAI-layout files through diffusers' single-file converter (fused q/k/v split,
//! adaLN halves swapped; SD3.5-medium's second attention). And the guarantees around merging: taking a LoRA out
//! gives the weights and the image back bit for bit, an SAI single file takes LoRAs as its folder does, a LoRA of
//! another family is refused naming it, and the engine applies `<lora:…>` tags and writes their hashes.

use crate::lora::AppliedLoras;
use crate::model::SdModel;
use crate::parity_tests::fixtures;
use crate::sd3::{Sd3Model, Sd3Request};
use crate::sd3_engine::Sd3Engine;
use crate::sd3_tests::{load_model, max_abs, pipeline_request};
use crate::test_device::test_device;
use crate::LoraApplyError;
use candle_core::{DType, Device, Tensor};
use sdhive_engine::{Control, Engine, EngineError, GenerateRequest, LoraUse};
use serde_json::Value;

fn golden_json() -> Value {
    let path = fixtures().join("golden/sd3_lora.json");
    let text = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&text).expect("sd3_lora.json is JSON")
}

fn lora(stem: &str, te: f32, unet: f32) -> LoraUse {
    LoraUse {
        name: stem.to_string(),
        path: fixtures().join("models/Lora").join(format!("{stem}.safetensors")),
        te,
        unet,
        hash: None,
    }
}

/// A case's LoRAs (`"loras": [{"file", "name", "te", "unet"}]`, files under `tests/fixtures/models`).
fn case_loras(case: &Value) -> Vec<LoraUse> {
    let number = |l: &Value, key: &str| l[key].as_f64().unwrap_or_else(|| panic!("loras.{key}")) as f32;
    case["loras"]
        .as_array()
        .expect("loras")
        .iter()
        .map(|l| LoraUse {
            name: l["name"].as_str().expect("name").to_string(),
            path: fixtures().join("models").join(l["file"].as_str().expect("file")),
            te: number(l, "te"),
            unet: number(l, "unet"),
            hash: None,
        })
        .collect()
}

/// The LoRA goldens' request (`gen_sd3_lora`'s pipeline settings).
fn request(prompt: &str) -> Sd3Request {
    pipeline_request(&golden_json()["pipeline"], prompt)
}

fn cpu(t: &Tensor) -> Tensor {
    t.to_device(&Device::Cpu).and_then(|t| t.to_dtype(DType::F32)).expect("to cpu")
}

fn golden(file: &str) -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(fixtures().join("golden").join(file), &Device::Cpu)
        .unwrap_or_else(|e| panic!("golden/{file}: {e} (run xtask/fixtures/gen_sd3_lora.py)"))
}

/// 8-bit values more than one level off the golden's image, and the worst difference.
fn image_off(file: &str, image: &[u8]) -> (usize, u8) {
    let want: Vec<u8> = golden(file)["image_u8"].flatten_all().and_then(|t| t.to_vec1()).expect("image_u8");
    assert_eq!(image.len(), want.len(), "{file}: image size");
    let off = image.iter().zip(&want).filter(|(a, b)| a.abs_diff(**b) > 1).count();
    (off, image.iter().zip(&want).map(|(a, b)| a.abs_diff(*b)).max().unwrap_or(0))
}

/// Final latents (relative to their magnitude) and image within the SD3 pipeline parity's tolerance.
fn assert_near_golden(what: &str, file: &str, latents: &Tensor, image: &[u8]) {
    let want = &golden(file)["latents"];
    let rel = max_abs(&(cpu(latents) - want).expect("latent diff")) / max_abs(want).max(1.0);
    let (off, worst) = image_off(file, image);
    let dev = test_device();
    eprintln!("{what} on {}: latents rel {rel:.3e}, {off} values off by > 1 level, worst {worst}", dev.label);
    let tol = dev.tolerance;
    assert!(rel <= tol.latent_rel, "{what}: final latents differ by {rel} (tolerance {})", tol.latent_rel);
    assert!(
        off as f32 <= tol.pixels_off * image.len() as f32,
        "{what}: {off} of {} image values off by more than one level",
        image.len()
    );
}

/// Every LoRA-changeable weight of the model as stored, by network and name.
fn weights(model: &Sd3Model) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    type Read<'a> = &'a dyn Fn(&str) -> Option<candle_core::Result<candle_core::Tensor>>;
    let networks: [(&str, _, Read); 3] = [
        ("transformer", model.transformer.param_shapes(), &|n| model.transformer.read_param(n)),
        ("clip_l", model.clip_l.param_shapes(), &|n| model.clip_l.read_param(n)),
        ("clip_g", model.clip_g.param_shapes(), &|n| model.clip_g.read_param(n)),
    ];
    for (network, shapes, read) in networks {
        let mut names: Vec<String> = shapes.into_keys().collect();
        names.sort();
        for name in names {
            let t = read(&name).expect("slot").expect("read");
            let v = t
                .to_dtype(DType::F32)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1())
                .expect("values");
            out.push((format!("{network}/{name}"), v));
        }
    }
    out
}

/// Each case, on models shared across the cases (so every case also runs on weights other cases' LoRAs were
/// merged into and taken out of), is diffusers' image within the pipeline parity's tolerance.
#[test]
fn every_sd3_lora_case_matches_diffusers() {
    let json = golden_json();
    let cases = json["cases"].as_object().expect("cases");
    assert!(cases.len() >= 5, "expected the peft, te/unet, text-encoder-only and kohya cases");
    let mut models: Vec<(String, Sd3Model, AppliedLoras)> = Vec::new();
    for (name, case) in cases {
        let model = case["model"].as_str().expect("model").trim_start_matches("models/").to_string();
        if !models.iter().any(|(m, _, _)| *m == model) {
            models.push((model.clone(), load_model(&model), AppliedLoras::default()));
        }
        let Some((_, sd3, applied)) = models.iter_mut().find(|(m, _, _)| *m == model) else { unreachable!() };
        applied.set(sd3, &case_loras(case)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(applied.kept_bytes() > 0, "{name}: nothing merged");
        let out = sd3.generate(&request(case["diffusers_prompt"].as_str().expect("diffusers_prompt")));
        let out = out.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_near_golden(name, case["file"].as_str().expect("file"), &out.latents, &out.image.data);
    }
    // After all of them, with the LoRAs taken out: the plain goldens.
    for (model, mut sd3, mut applied) in models {
        applied.set(&mut sd3, &[]).expect("take out");
        let out = sd3.generate(&request(json["cases"]["peft"]["diffusers_prompt"].as_str().expect("prompt")));
        let out = out.expect("plain run");
        let file = format!("sd3_pipe_{model}.safetensors");
        assert_near_golden(&format!("{model} after the LoRA cases"), &file, &out.latents, &out.image.data);
    }
}

/// After a LoRA job, the model computes as a fresh load does, bit for bit: weights, latents and image.
#[test]
fn sd3_taking_loras_out_gives_the_model_back_bit_for_bit() {
    let fresh = load_model("sd3");
    let req = request("a red fox in the snow");
    let want = fresh.generate(&req).expect("plain");
    let mut sd3 = load_model("sd3");
    let mut applied = AppliedLoras::default();
    applied.set(&mut sd3, &[lora("sd3_kohya", 0.7, 0.9), lora("sd3_peft", 1.0, 1.0)]).expect("merge");
    let changed = weights(&sd3).iter().zip(weights(&fresh)).filter(|(a, b)| a.1 != b.1).count();
    assert!(changed > 60, "the LoRAs changed only {changed} weights");
    let with = sd3.generate(&req).expect("with LoRAs");
    assert!(
        max_abs(&(cpu(&with.latents) - cpu(&want.latents)).expect("diff")) > 1e-3,
        "the LoRAs did nothing"
    );
    // Another set first: the first is taken out before the second goes in.
    applied.set(&mut sd3, &[lora("sd3_peft", 0.5, 0.5)]).expect("merge");
    applied.set(&mut sd3, &[]).expect("take out");
    assert_eq!(applied.kept_bytes(), 0);
    for ((name, a), (_, b)) in weights(&sd3).iter().zip(weights(&fresh)) {
        assert!(*a == b, "{name} differs from the fresh model's after the LoRAs were taken out");
    }
    let again = sd3.generate(&req).expect("plain again");
    assert_eq!(max_abs(&(cpu(&again.latents) - cpu(&want.latents)).expect("diff")), 0.0);
    assert_eq!(again.image.data, want.image.data);
}

/// An SAI single file (fused q/k/v in the file, split at load) takes both LoRA layouts exactly as its folder.
#[test]
fn sd3_single_file_takes_loras_as_its_folder() {
    let models = fixtures().join("models");
    let dev = test_device();
    let mut file = Sd3Model::from_single_file(
        &models.join("sd3.safetensors"),
        Some(&models.join("sd3")),
        dev.dtype,
        &dev.device,
        true,
    )
    .unwrap_or_else(|e| panic!("sd3.safetensors: {e}"));
    let mut folder = load_model("sd3");
    let loras = [lora("sd3_kohya", 0.7, 0.9), lora("sd3_peft", 0.4, 1.2)];
    let (mut a, mut b) = (AppliedLoras::default(), AppliedLoras::default());
    a.set(&mut folder, &loras).expect("folder");
    b.set(&mut file, &loras).expect("single file");
    let req = request("a photo of an astronaut riding a horse");
    let (x, y) = (folder.generate(&req).expect("folder"), file.generate(&req).expect("file"));
    assert_eq!(max_abs(&(cpu(&x.latents) - cpu(&y.latents)).expect("diff")), 0.0, "single file vs folder");
    assert_eq!(x.image.data, y.image.data);
    b.set(&mut file, &[]).expect("take out");
    let plain = load_model("sd3").generate(&req).expect("plain");
    assert_eq!(file.generate(&req).expect("file, plain").image.data, plain.image.data);
}

/// An SD1 LoRA on SD3 and an SD3 LoRA on SD1 are refused naming the file and both families; the model keeps no
/// LoRA (a refused set takes out what was merged before, as for SD1/SDXL).
#[test]
fn loras_of_another_family_are_refused_naming_it() {
    let fresh = weights(&load_model("sd3"));
    let mut sd3 = load_model("sd3");
    let mut applied = AppliedLoras::default();
    applied.set(&mut sd3, &[lora("sd3_kohya", 1.0, 1.0)]).expect("merge");
    let err =
        applied.set(&mut sd3, &[lora("sd3_peft", 1.0, 1.0), lora("sd1_kohya", 1.0, 1.0)]).expect_err("SD1");
    let message = err.to_string();
    assert!(matches!(err, LoraApplyError::Invalid { .. }), "{message}");
    assert!(
        message.contains("sd1_kohya")
            && message.contains("SD1.x/SD2.x/SDXL")
            && message.contains("SD3/SD3.5"),
        "{message}"
    );
    assert!(weights(&sd3) == fresh, "a refused set left weights changed");
    assert!(applied.is_empty());

    let dev = test_device();
    let mut sd1 = SdModel::from_diffusers_dir("sd1", &fixtures().join("models/sd1"), &dev.device, dev.dtype)
        .expect("sd1");
    for stem in ["sd3_kohya", "sd3_peft"] {
        let err = sd1.set_loras(&[lora(stem, 1.0, 1.0)]).expect_err("an SD3 LoRA on SD1");
        let message = err.to_string();
        assert!(message.contains(stem) && message.contains("a LoRA for SD3/SD3.5 models"), "{message}");
    }
}

/// Through the engine: `<lora:name:te:unet>` with the structured `LoraUse` the server makes from it gives
/// diffusers' image, the infotext names the LoRA's hash, the next job without it is the plain image bit for bit,
/// and a LoRA that does not fit is a 400 on `loras`.
#[test]
fn sd3_engine_applies_lora_tags_and_writes_their_hashes() {
    let json = golden_json();
    let case = &json["cases"]["peft_te_unet"];
    let dev = test_device();
    let dir = fixtures().join("models/sd3");
    let open =
        || Sd3Engine::load(&dir, "sd3", &dev.device, dev.dtype, true, ("cpu", "test")).expect("sd3 engine");
    let p = &json["pipeline"];
    let job = |prompt: &str, loras: Vec<LoraUse>| GenerateRequest {
        prompt: prompt.into(),
        negative_prompt: p["negative_prompt"].as_str().expect("negative").into(),
        steps: p["num_inference_steps"].as_u64().expect("steps") as u32,
        cfg_scale: p["guidance_scale"].as_f64().expect("guidance") as f32,
        width: Some(64),
        height: Some(64),
        seed: Some(p["seed"].as_u64().expect("seed")),
        n: 1,
        loras,
        ..GenerateRequest::default()
    };
    let go = |engine: &mut Sd3Engine, req: &GenerateRequest| {
        engine.generate(req, &mut |_| Control::Continue).map(|mut out| out.images.remove(0))
    };
    let mut engine = open();
    let loras: Vec<LoraUse> =
        case_loras(case).into_iter().map(|l| LoraUse { hash: Some("0123456789ab".into()), ..l }).collect();
    let tagged = case["prompt"].as_str().expect("prompt");
    assert!(tagged.contains("<lora:sd3_peft:0.4:1.2>"), "{tagged}");
    let image = go(&mut engine, &job(tagged, loras)).expect("LoRA job");
    let (off, worst) = image_off(case["file"].as_str().expect("file"), &image.image.data);
    eprintln!("engine with <lora:sd3_peft:0.4:1.2>: {off} values off by > 1 level, worst {worst}");
    assert!(off as f32 <= dev.tolerance.pixels_off * image.image.data.len() as f32, "{off} values off");
    assert!(image.infotext.contains("Lora hashes: \"sd3_peft: 0123456789ab\""), "{}", image.infotext);
    assert!(image.infotext.starts_with(tagged), "the prompt keeps its tag: {}", image.infotext);

    let plain_prompt = case["diffusers_prompt"].as_str().expect("prompt");
    let after = go(&mut engine, &job(plain_prompt, Vec::new())).expect("plain job");
    let fresh = go(&mut open(), &job(plain_prompt, Vec::new())).expect("fresh engine");
    assert_eq!(after.image.data, fresh.image.data, "a job after a LoRA job differs from a fresh model's");
    assert!(!after.infotext.contains("Lora hashes"), "{}", after.infotext);

    let err = go(&mut engine, &job(plain_prompt, vec![lora("sdxl_kohya", 1.0, 1.0)])).expect_err("SDXL LoRA");
    match err {
        EngineError::Invalid(v) => {
            assert_eq!(v.field, "loras");
            assert!(v.message.contains("sdxl_kohya") && v.message.contains("SD3/SD3.5"), "{}", v.message);
        }
        other => panic!("expected a 400 on loras, got {other}"),
    }
    let again = go(&mut engine, &job(plain_prompt, Vec::new())).expect("plain job after a refusal");
    assert_eq!(again.image.data, fresh.image.data);
}
