//! Loads the single-file fixtures (written in the original LDM/SGM layout by
//! xtask/fixtures/gen_single_file.py and proven faithful by diffusers) and holds every converted
//! tensor against the diffusers folder they were made from; then feeds the loader damaged and
//! foreign files and checks the errors name the file and the tensor.
//!
//! sd1.safetensors is float32, the other fixtures float16 (as most published checkpoints are);
//! the loader keeps the stored dtype, so a float16 file is held against the folder's float32
//! weights rounded to float16, bit for bit.

mod common;
use common::{assert_msg, bits};

use candle_core::{DType, Device, Tensor};
use sdhive_checkpoint::{
    load_single_file, CheckpointError, Component, ConfigDir, Converted, Family, Prediction, PredictionSource,
    PredictionType, SingleFile, Variant,
};
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// Printed with failures that a fixture folder regenerated after its single file would cause.
const STALE: &str = "if the diffusers fixture folders were regenerated, rerun \
                     `/opt/refpy/bin/python xtask/fixtures/gen_single_file.py`";

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models")
}

/// A fixture that must exist: a missing fixture fails the test, it never skips it.
fn fixture(name: &str) -> (PathBuf, PathBuf) {
    let file = models_dir().join(format!("{name}.safetensors"));
    let folder = models_dir().join(name);
    assert!(
        file.is_file(),
        "missing fixture {}; run `/opt/refpy/bin/python xtask/fixtures/gen_single_file.py`",
        file.display()
    );
    assert!(
        folder.join("model_index.json").is_file(),
        "missing diffusers fixture folder {}",
        folder.display()
    );
    (file, folder)
}

/// A folder component's weights cast to `dtype`. candle rounds f32 to f16/bf16 to nearest
/// even, as torch's `.half()` that wrote the float16 fixtures does, so the cast is bit-exact.
fn folder_weights(folder: &Path, component: &str, dtype: DType) -> HashMap<String, Tensor> {
    let dir = folder.join(component);
    for name in ["diffusion_pytorch_model.safetensors", "model.safetensors"] {
        let p = dir.join(name);
        if p.is_file() {
            let weights = candle_core::safetensors::load(&p, &Device::Cpu).expect("fixture weights load");
            return cast_floats(weights, |_| dtype);
        }
    }
    panic!("no weights in {}", dir.display());
}

/// Casts every floating-point tensor to the dtype `to` picks for its name; integer buffers
/// (position_ids, EMA counters) keep theirs, as in real half-precision exports.
fn cast_floats(tensors: HashMap<String, Tensor>, to: impl Fn(&str) -> DType) -> HashMap<String, Tensor> {
    tensors
        .into_iter()
        .map(|(k, t)| {
            let t = if t.dtype().is_float() { t.to_dtype(to(&k)).expect("cast") } else { t };
            (k, t)
        })
        .collect()
}

fn folder_config(folder: &Path, component: Component) -> Value {
    let p = folder.join(component.subfolder()).join(component.config_file());
    serde_json::from_str(&std::fs::read_to_string(&p).expect("fixture config")).expect("fixture config json")
}

fn assert_same_weights(what: &str, got: &HashMap<String, Tensor>, want: &HashMap<String, Tensor>) {
    let g: BTreeSet<&String> = got.keys().collect();
    let w: BTreeSet<&String> = want.keys().collect();
    let missing: Vec<_> = w.difference(&g).take(5).collect();
    let extra: Vec<_> = g.difference(&w).take(5).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{what}: name sets differ: missing {missing:?}, extra {extra:?}; {STALE}"
    );
    for (name, wt) in want {
        let gt = &got[name];
        assert_eq!(gt.dtype(), wt.dtype(), "{what}: {name}: dtype");
        assert_eq!(gt.dims(), wt.dims(), "{what}: {name}: shape; {STALE}");
        assert!(bits(gt) == bits(wt), "{what}: {name}: values differ; {STALE}");
    }
}

/// Every converted component against the folder's weights in `dtype`.
fn assert_all_weights(name: &str, c: &Converted, folder: &Path, dtype: DType) {
    assert_components(name, c, folder, |_| dtype);
}

/// As [`assert_all_weights`], with a dtype per diffusers component folder.
fn assert_components(name: &str, c: &Converted, folder: &Path, dtype: impl Fn(&str) -> DType) {
    assert_same_weights(&format!("{name} unet"), &c.unet, &folder_weights(folder, "unet", dtype("unet")));
    assert_same_weights(&format!("{name} vae"), &c.vae, &folder_weights(folder, "vae", dtype("vae")));
    assert_same_weights(
        &format!("{name} text_encoder"),
        &c.text_encoder,
        &folder_weights(folder, "text_encoder", dtype("text_encoder")),
    );
    match (&c.text_encoder_2, folder.join("text_encoder_2").is_dir()) {
        (Some(te2), true) => assert_same_weights(
            &format!("{name} text_encoder_2"),
            te2,
            &folder_weights(folder, "text_encoder_2", dtype("text_encoder_2")),
        ),
        (None, false) => {}
        (got, want) => panic!("{name}: text_encoder_2 present {} but folder has it {want}", got.is_some()),
    }
}

/// Name, family, variant and the dtype gen_single_file.py stores the weights in.
const FIXTURES: &[(&str, Family, Variant, DType)] = &[
    ("sd1", Family::Sd1, Variant::Standard, DType::F32),
    ("sd1-inpaint", Family::Sd1, Variant::Inpainting, DType::F16),
    ("sd2v", Family::Sd2, Variant::Standard, DType::F16),
    ("sdxl", Family::Sdxl, Variant::Standard, DType::F16),
];

#[test]
fn with_folder_configs_every_tensor_is_bit_identical() {
    for (name, family, variant, dtype) in FIXTURES {
        let (file, folder) = fixture(name);
        let overrides = ConfigDir::open(&folder).expect("config dir");
        let c = load_single_file(&file, Some(&overrides)).unwrap_or_else(|e| panic!("{name}: {e}; {STALE}"));
        assert_eq!(c.family, *family, "{name}");
        assert_eq!(c.variant, *variant, "{name}");
        assert_all_weights(name, &c, &folder, *dtype);
        // The folder's configs win key by key.
        for comp in Component::ALL {
            let Some(ours) = c.configs.get(comp) else { continue };
            if !folder.join(comp.subfolder()).is_dir() {
                continue;
            }
            assert!(c.overridden.contains(&comp), "{name}: {comp:?} not marked overridden");
            let theirs = folder_config(&folder, comp);
            for (k, v) in theirs.as_object().expect("object") {
                assert_eq!(ours.get(k), Some(v), "{name}: {comp:?}.{k}");
            }
        }
    }
}

/// Structural keys of a folder config that must come out of inference alone.
fn assert_structure(name: &str, comp: Component, ours: &Value, theirs: &Value, keys: &[&str]) {
    let n = theirs["block_out_channels"].as_array().map_or(1, Vec::len);
    let norm = |v: &Value| match v {
        Value::Number(_) if matches!(comp, Component::Unet) => json!(vec![v.clone(); n]),
        other => other.clone(),
    };
    for k in keys {
        let (o, t) = (ours.get(*k).unwrap_or(&Value::Null), theirs.get(*k).unwrap_or(&Value::Null));
        let per_block =
            matches!(*k, "layers_per_block" | "transformer_layers_per_block" | "cross_attention_dim");
        let same = if per_block { norm(o) == norm(t) } else { o == t };
        assert!(same, "{name}: inferred {comp:?}.{k} = {o}, folder has {t}");
    }
}

#[test]
fn without_overrides_family_and_structure_are_inferred() {
    for (name, family, variant, dtype) in FIXTURES {
        let (file, folder) = fixture(name);
        let c = load_single_file(&file, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(c.family, *family, "{name}");
        assert_eq!(c.variant, *variant, "{name}");
        assert!(c.overridden.is_empty());
        // Names and values follow from the layout alone, configs or not.
        assert_all_weights(name, &c, &folder, *dtype);

        let unet_keys = [
            "in_channels",
            "out_channels",
            "block_out_channels",
            "layers_per_block",
            "down_block_types",
            "up_block_types",
            "cross_attention_dim",
            "transformer_layers_per_block",
            "use_linear_projection",
            "addition_embed_type",
            "addition_time_embed_dim",
            "projection_class_embeddings_input_dim",
            "mid_block_type",
        ];
        assert_structure(
            name,
            Component::Unet,
            &c.configs.unet,
            &folder_config(&folder, Component::Unet),
            &unet_keys,
        );
        let vae_keys = [
            "in_channels",
            "out_channels",
            "latent_channels",
            "block_out_channels",
            "layers_per_block",
            "mid_block_add_attention",
            "use_quant_conv",
            "use_post_quant_conv",
        ];
        assert_structure(
            name,
            Component::Vae,
            &c.configs.vae,
            &folder_config(&folder, Component::Vae),
            &vae_keys,
        );
        let clip_keys = [
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "vocab_size",
            "max_position_embeddings",
        ];
        let te = folder_config(&folder, Component::TextEncoder);
        assert_structure(name, Component::TextEncoder, &c.configs.text_encoder, &te, &clip_keys);
        if let Some(ours) = &c.configs.text_encoder_2 {
            let te2 = folder_config(&folder, Component::TextEncoder2);
            let mut keys = clip_keys.to_vec();
            keys.push("projection_dim");
            assert_structure(name, Component::TextEncoder2, ours, &te2, &keys);
            assert_eq!(ours["architectures"], json!(["CLIPTextModelWithProjection"]));
        }
        let scaling = c.configs.vae["scaling_factor"].as_f64();
        assert_eq!(scaling, Some(if *family == Family::Sdxl { 0.13025 } else { 0.18215 }), "{name}");
    }
}

#[test]
fn family_defaults_fill_what_shapes_cannot_tell() {
    let (file, _) = fixture("sd1");
    let c = SingleFile::open(&file).and_then(|f| f.inspect(None)).expect("inspect sd1");
    assert_eq!(c.configs.unet["attention_head_dim"], json!(8));
    assert_eq!(c.configs.text_encoder["hidden_act"], json!("quick_gelu"));
    assert_eq!(c.configs.scheduler["_class_name"], json!("PNDMScheduler"));
    assert_eq!(c.prediction, Prediction::Unknown);
    assert_eq!(c.configs.scheduler["prediction_type"], json!("epsilon"));
    // LDM's schedule buffers and EMA bookkeeping ride along in SD1 files and are skipped.
    for k in [
        "betas",
        "alphas_cumprod",
        "model_ema.decay",
        "cond_stage_model.transformer.text_model.embeddings.position_ids",
    ] {
        assert!(c.skipped.iter().any(|s| s == k), "{k} not reported as skipped: {:?}", c.skipped);
    }

    let (file, _) = fixture("sd2v");
    let c = SingleFile::open(&file).and_then(|f| f.inspect(None)).expect("inspect sd2v");
    // 64-wide heads: the 32- and 64-channel test blocks get one head each.
    assert_eq!(c.configs.unet["attention_head_dim"], json!([1, 1]));
    assert_eq!(c.configs.text_encoder["hidden_act"], json!("gelu"));
    assert_eq!(c.configs.scheduler["_class_name"], json!("DDIMScheduler"));
    // OpenCLIP-H's final block is in the file but not in the published text encoder.
    assert!(c
        .skipped
        .iter()
        .any(|s| s == "cond_stage_model.model.transformer.resblocks.5.attn.in_proj_weight"));
    assert!(c.skipped.iter().any(|s| s == "cond_stage_model.model.logit_scale"));

    let (file, _) = fixture("sdxl");
    let c = SingleFile::open(&file).and_then(|f| f.inspect(None)).expect("inspect sdxl");
    assert_eq!(c.configs.scheduler["_class_name"], json!("EulerDiscreteScheduler"));
    assert_eq!(c.configs.unet["addition_embed_type"], json!("text_time"));
    assert_eq!(c.configs.text_encoder_2.as_ref().map(|v| v["hidden_act"].clone()), Some(json!("gelu")));
}

#[test]
fn sd2_prediction_hints() {
    let (file, folder) = fixture("sd2v");
    let c = SingleFile::open(&file).and_then(|f| f.inspect(None)).expect("inspect");
    assert_eq!(c.prediction, Prediction::Unknown, "weights alone cannot tell v from epsilon");

    let over = ConfigDir::open(&folder).expect("config dir");
    let c = SingleFile::open(&file).and_then(|f| f.inspect(Some(&over))).expect("inspect");
    assert_eq!(
        c.prediction,
        Prediction::Known { kind: PredictionType::VPrediction, source: PredictionSource::OverrideConfig }
    );

    // A web-UI style sidecar LDM config next to the checkpoint.
    let dir = tempfile::tempdir().expect("tempdir");
    let copy = dir.path().join("model.safetensors");
    std::fs::copy(&file, &copy).expect("copy");
    let yaml = dir.path().join("model.yaml");
    std::fs::write(&yaml, "model:\n  target: ldm.models.diffusion.ddpm.LatentDiffusion\n  params:\n    parameterization: \"v\"\n")
        .expect("yaml");
    let mut c = load_single_file(&copy, None).expect("load with sidecar");
    assert_eq!(
        c.prediction,
        Prediction::Known { kind: PredictionType::VPrediction, source: PredictionSource::SidecarYaml(yaml) }
    );
    assert_eq!(c.configs.scheduler["prediction_type"], json!("v_prediction"));
    assert_eq!(c.configs.unet["sample_size"], json!(96));

    c.set_prediction_type(PredictionType::Epsilon);
    assert_eq!(c.configs.scheduler["prediction_type"], json!("epsilon"));
    assert_eq!(c.prediction.kind(), Some(PredictionType::Epsilon));
}

/// Which diffusers component a checkpoint tensor belongs to, by its LDM/SGM prefix.
fn component_of(key: &str) -> &'static str {
    if key.starts_with("model.diffusion_model.") {
        "unet"
    } else if key.starts_with("first_stage_model.") {
        "vae"
    } else if key.starts_with("conditioner.embedders.1.") {
        "text_encoder_2"
    } else {
        "text_encoder"
    }
}

#[test]
fn half_precision_tensors_keep_their_stored_dtype() {
    let dir = tempfile::tempdir().expect("tempdir");
    // bfloat16 through every family's renames, q/k/v splits, 1x1-conv squeezes and the
    // OpenCLIP projection transpose: each tensor comes out as stored, rounded like the folder's.
    for (name, _, _, stored) in FIXTURES {
        let (file, folder) = fixture(name);
        let bf16 = save(
            dir.path(),
            &format!("{name}-bf16.safetensors"),
            &cast_floats(load_all(&file), |_| DType::BF16),
        );
        let c = load_single_file(&bf16, None).unwrap_or_else(|e| panic!("{name} bf16: {e}"));
        // The f16 fixtures are already rounded once; the folder goes through the same steps.
        let folder_bf16 = |comp: &str| cast_floats(folder_weights(&folder, comp, *stored), |_| DType::BF16);
        assert_same_weights(&format!("{name} bf16 unet"), &c.unet, &folder_bf16("unet"));
        assert_same_weights(&format!("{name} bf16 vae"), &c.vae, &folder_bf16("vae"));
        assert_same_weights(
            &format!("{name} bf16 text_encoder"),
            &c.text_encoder,
            &folder_bf16("text_encoder"),
        );
        if let Some(te2) = &c.text_encoder_2 {
            assert_same_weights(&format!("{name} bf16 text_encoder_2"), te2, &folder_bf16("text_encoder_2"));
        }
    }

    // Mixed files exist too (an fp16 UNet beside an fp32 VAE, …): nothing is unified.
    let (file, folder) = fixture("sd1");
    let dtype_for = |comp: &str| match comp {
        "unet" => DType::F16,
        "vae" => DType::BF16,
        _ => DType::F32,
    };
    let mixed = cast_floats(load_all(&file), |k| dtype_for(component_of(k)));
    let p = save(dir.path(), "mixed.safetensors", &mixed);
    let c = load_single_file(&p, None).expect("mixed-precision checkpoint");
    assert_components("sd1 mixed", &c, &folder, dtype_for);
}

// ------------------------------------------------------------------ damaged and foreign files

fn load_all(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).expect("fixture loads")
}

fn save(dir: &Path, name: &str, tensors: &HashMap<String, Tensor>) -> PathBuf {
    let p = dir.join(name);
    candle_core::safetensors::save(tensors, &p).expect("save");
    p
}

fn err_of(path: &Path) -> CheckpointError {
    match load_single_file(path, None) {
        Ok(c) => panic!("{} loaded as {:?}", path.display(), c.family),
        Err(e) => e,
    }
}

#[test]
fn missing_random_and_foreign_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("nope.safetensors");
    let e = err_of(&missing);
    assert!(matches!(e, CheckpointError::Io { .. }), "{e}");
    assert_msg(&e, &["nope.safetensors"]);

    // Deterministic junk: a xorshift stream.
    let mut x = 0x9e3779b97f4a7c15u64;
    let junk: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let random = dir.path().join("random.safetensors");
    std::fs::write(&random, &junk).expect("write");
    let e = err_of(&random);
    assert!(matches!(e, CheckpointError::NotSafetensors { .. }), "{e}");
    assert_msg(&e, &["random.safetensors", "not a safetensors file"]);

    let tiny = dir.path().join("tiny.safetensors");
    std::fs::write(&tiny, b"abc").expect("write");
    assert!(matches!(err_of(&tiny), CheckpointError::NotSafetensors { .. }));

    let zip = dir.path().join("model.ckpt");
    let mut bytes = b"PK\x03\x04".to_vec();
    bytes.extend_from_slice(&junk[..100]);
    std::fs::write(&zip, bytes).expect("write");
    let e = err_of(&zip);
    assert_msg(&e, &["model.ckpt", "pickle"]);

    // A diffusers component file is safetensors but not a single-file checkpoint.
    let (_, folder) = fixture("sd1");
    let e = err_of(&folder.join("unet/diffusion_pytorch_model.safetensors"));
    assert!(matches!(e, CheckpointError::UnknownLayout { .. }), "{e}");
    assert_msg(&e, &["diffusers layout"]);
}

#[test]
fn truncated_and_corrupt_headers() {
    let (file, _) = fixture("sd1");
    let bytes = std::fs::read(&file).expect("read");
    let dir = tempfile::tempdir().expect("tempdir");

    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).expect("write");
    let e = err_of(&cut);
    assert!(matches!(e, CheckpointError::Truncated { .. }), "{e}");
    assert_msg(&e, &["cut.safetensors", "truncated"]);

    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let cut_header = dir.path().join("cut_header.safetensors");
    std::fs::write(&cut_header, &bytes[..8 + header_len / 2]).expect("write");
    let e = err_of(&cut_header);
    assert!(matches!(e, CheckpointError::Truncated { .. }), "{e}");

    // Same length, no longer JSON: the header object's closing brace becomes a bracket.
    let mut broken = bytes.clone();
    let close = bytes[8..8 + header_len].iter().rposition(|b| *b == b'}').expect("closing brace");
    broken[8 + close] = b']';
    let bad_json = dir.path().join("bad_json.safetensors");
    std::fs::write(&bad_json, &broken).expect("write");
    let e = err_of(&bad_json);
    assert!(matches!(e, CheckpointError::CorruptHeader { .. }), "{e}");
    assert_msg(&e, &["bad_json.safetensors"]);

    // A header whose declared shape no longer fits the tensor's bytes, named in the error.
    let text = std::str::from_utf8(&bytes[8..8 + header_len]).expect("utf8 header");
    let needle = "\"first_stage_model.decoder.conv_in.bias\":{\"dtype\":\"F32\",\"shape\":[";
    let at = text.find(needle).expect("header has decoder.conv_in.bias") + needle.len();
    let mut patched = bytes.clone();
    // Nudge the last digit of its one dimension: same header length, wrong byte count.
    let end = at + text[at..].find(']').expect("shape closes");
    let last = 8 + end - 1;
    patched[last] = if patched[last] == b'9' { b'8' } else { patched[last] + 1 };
    let bad_shape = dir.path().join("bad_info.safetensors");
    std::fs::write(&bad_shape, &patched).expect("write");
    let e = err_of(&bad_shape);
    assert!(matches!(e, CheckpointError::CorruptHeader { .. }), "{e}");
    assert_msg(&e, &["first_stage_model.decoder.conv_in.bias"]);
}

#[test]
fn unexpected_shapes_name_the_tensor() {
    let (file, _) = fixture("sd1");
    let all = load_all(&file);
    let dir = tempfile::tempdir().expect("tempdir");
    let replaced = |name: &str, t: Tensor| {
        let mut m = all.clone();
        assert!(m.insert(name.to_string(), t).is_some(), "{name} in fixture");
        m
    };

    let q = "first_stage_model.decoder.mid.attn_1.q.weight";
    let c = all[q].dims()[0];
    let p = save(
        dir.path(),
        "vae_q.safetensors",
        &replaced(q, Tensor::zeros((c, c, 3, 3), DType::F32, &Device::Cpu).expect("zeros")),
    );
    let e = err_of(&p);
    assert!(matches!(e, CheckpointError::Shape { .. }), "{e}");
    assert_msg(&e, &["vae_q.safetensors", q]);

    let conv = "model.diffusion_model.input_blocks.1.0.in_layers.2.weight";
    let d = all[conv].dims().to_vec();
    let p = save(
        dir.path(),
        "unet_conv.safetensors",
        &replaced(
            conv,
            Tensor::zeros((d[0] + 1, d[1], d[2], d[3]), DType::F32, &Device::Cpu).expect("zeros"),
        ),
    );
    let e = err_of(&p);
    assert!(matches!(e, CheckpointError::Shape { .. }), "{e}");
    assert_msg(&e, &["unet_conv.safetensors", "model.diffusion_model.input_blocks.1."]);

    let k = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight";
    let d = all[k].dims().to_vec();
    let v = k.replace("to_k", "to_v");
    let mut m = replaced(k, Tensor::zeros((d[0], d[1] + 8), DType::F32, &Device::Cpu).expect("zeros"));
    m.insert(v.clone(), Tensor::zeros((d[0], d[1] + 8), DType::F32, &Device::Cpu).expect("zeros"));
    let p = save(dir.path(), "cross.safetensors", &m);
    let e = err_of(&p);
    assert!(matches!(e, CheckpointError::Shape { .. }), "{e}");
    assert_msg(&e, &["cross.safetensors", "attn2.to_k.weight"]);

    let fused = "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight";
    let d = all[fused].dims().to_vec();
    let p = save(
        dir.path(),
        "clip_q.safetensors",
        &replaced(fused, Tensor::zeros((d[0], d[1] * 2), DType::F32, &Device::Cpu).expect("zeros")),
    );
    let e = err_of(&p);
    assert_msg(&e, &["clip_q.safetensors", fused]);

    // OpenCLIP's fused projection must be [3·hidden, hidden].
    let (file2, _) = fixture("sd2v");
    let mut m = load_all(&file2);
    let key = "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight";
    let d = m[key].dims().to_vec();
    let dt = m[key].dtype();
    m.insert(key.into(), Tensor::zeros((d[0] - 1, d[1]), dt, &Device::Cpu).expect("zeros"));
    let p = save(dir.path(), "in_proj.safetensors", &m);
    let e = err_of(&p);
    assert!(matches!(e, CheckpointError::Shape { .. }), "{e}");
    assert_msg(&e, &["in_proj.safetensors", key]);
}

#[test]
fn missing_components_and_stray_tensors() {
    let (file, _) = fixture("sd1");
    let all = load_all(&file);
    let dir = tempfile::tempdir().expect("tempdir");
    let without = |prefix: &str| -> HashMap<String, Tensor> {
        all.iter().filter(|(k, _)| !k.starts_with(prefix)).map(|(k, v)| (k.clone(), v.clone())).collect()
    };

    let p = save(dir.path(), "no_vae.safetensors", &without("first_stage_model."));
    let e = err_of(&p);
    assert!(matches!(e, CheckpointError::MissingComponent { component: "VAE", .. }), "{e}");
    assert_msg(&e, &["no_vae.safetensors", "first_stage_model."]);

    let p = save(dir.path(), "no_te.safetensors", &without("cond_stage_model."));
    assert!(matches!(err_of(&p), CheckpointError::MissingComponent { component: "text encoder", .. }));

    let p = save(dir.path(), "no_unet.safetensors", &without("model.diffusion_model."));
    assert!(matches!(err_of(&p), CheckpointError::MissingComponent { component: "UNet", .. }));

    let p = save(
        dir.path(),
        "no_conv2.safetensors",
        &without("model.diffusion_model.output_blocks.0.0.out_layers.3.weight"),
    );
    let e = err_of(&p);
    assert!(matches!(e, CheckpointError::MissingTensor { .. }), "{e}");
    assert_msg(&e, &["model.diffusion_model.output_blocks.0.0.out_layers.3.weight"]);

    let mut m = all.clone();
    let stray = "model.diffusion_model.input_blocks.1.0.mystery.weight";
    m.insert(stray.into(), Tensor::zeros(4, DType::F32, &Device::Cpu).expect("zeros"));
    let p = save(dir.path(), "stray.safetensors", &m);
    let e = err_of(&p);
    assert!(matches!(e, CheckpointError::UnexpectedTensor { .. }), "{e}");
    assert_msg(&e, &[stray]);

    // Unrelated top-level tensors are skipped, not errors.
    let mut m = all.clone();
    m.insert(
        "model_ema.diffusion_modelinput_blocks00weight".into(),
        Tensor::zeros(4, DType::F32, &Device::Cpu).expect("zeros"),
    );
    m.insert("some_trainer.step".into(), Tensor::zeros(1, DType::F32, &Device::Cpu).expect("zeros"));
    let p = save(dir.path(), "extra.safetensors", &m);
    let c = load_single_file(&p, None).expect("extra top-level tensors are fine");
    assert!(c.skipped.iter().any(|s| s == "some_trainer.step"));
}

#[test]
fn contradicting_override_configs_are_rejected() {
    let (file, folder) = fixture("sd1");
    let mut unet = folder_config(&folder, Component::Unet);
    unet["block_out_channels"] = json!([64, 128]);
    let over = ConfigDir::new().with(Component::Unet, unet);
    let e = load_single_file(&file, Some(&over)).expect_err("mismatched override");
    assert!(matches!(e, CheckpointError::ConfigMismatch(_)), "{e}");
    assert_msg(&e, &["block_out_channels", "sd1.safetensors"]);

    let mut te = folder_config(&folder, Component::TextEncoder);
    let layers = te["num_hidden_layers"].as_u64().expect("layers");
    te["num_hidden_layers"] = json!(layers + 1);
    let over = ConfigDir::new().with(Component::TextEncoder, te.clone());
    let e = load_single_file(&file, Some(&over)).expect_err("too many layers");
    assert_msg(&e, &["num_hidden_layers"]);

    // Fewer layers than the checkpoint holds: the surplus is dropped, as for SD2.
    te["num_hidden_layers"] = json!(layers - 1);
    let over = ConfigDir::new().with(Component::TextEncoder, te);
    let c = load_single_file(&file, Some(&over)).expect("fewer layers");
    let last = format!("text_model.encoder.layers.{}.mlp.fc1.weight", layers - 1);
    assert!(!c.text_encoder.contains_key(&last));
    assert!(c.text_encoder.contains_key("text_model.encoder.layers.0.mlp.fc1.weight"));
}

#[test]
fn prediction_from_metadata_and_marker_tensor() {
    let (file, _) = fixture("sdxl");
    let all = load_all(&file);
    let dir = tempfile::tempdir().expect("tempdir");

    let p = dir.path().join("meta.safetensors");
    let meta: HashMap<String, String> = [("modelspec.prediction_type".to_string(), "v".to_string())].into();
    safetensors::serialize_to_file(all.iter().map(|(k, v)| (k.as_str(), v)), Some(meta), &p).expect("save");
    let c = SingleFile::open(&p).and_then(|f| f.inspect(None)).expect("inspect");
    assert_eq!(c.prediction.kind(), Some(PredictionType::VPrediction));
    assert!(matches!(c.prediction, Prediction::Known { source: PredictionSource::Metadata(_), .. }));

    let mut m = all.clone();
    m.insert("v_pred".into(), Tensor::zeros(0, DType::F32, &Device::Cpu).expect("zeros"));
    let p = save(dir.path(), "marker.safetensors", &m);
    let c = load_single_file(&p, None).expect("load");
    assert_eq!(c.prediction.kind(), Some(PredictionType::VPrediction));
    assert_eq!(c.configs.scheduler["prediction_type"], json!("v_prediction"));
    assert!(c.skipped.iter().any(|s| s == "v_pred"));
}

#[test]
fn a_standalone_vae_file_is_inspected_from_its_header() {
    let vae = models_dir().join("VAE/sd1-alt.safetensors");
    let info = sdhive_checkpoint::inspect_vae_file(&vae).unwrap();
    let loaded = sdhive_checkpoint::load_vae_file_on(&vae, &Device::Cpu).unwrap();
    let conv_in = loaded["decoder.conv_in.weight"].dims().to_vec();
    assert_eq!(info.latent_channels, conv_in[1]);
    assert_eq!(info.block_out_channels.last(), Some(&conv_in[0]));
    // A checkpoint is not a standalone VAE file, nor is a file that is not safetensors.
    let (ckpt, _) = fixture("sd1");
    assert!(
        sdhive_checkpoint::inspect_vae_file(&ckpt).is_ok(),
        "a checkpoint's own VAE is read under its prefix"
    );
    let err = sdhive_checkpoint::inspect_vae_file(models_dir().join("sd1/model_index.json")).unwrap_err();
    assert!(err.to_string().contains("model_index.json"), "{err}");
}

#[test]
fn sd3_checkpoints_are_named_and_sent_to_the_sd3_converter() {
    for name in ["sd3.safetensors", "sd35m.safetensors"] {
        let path = models_dir().join(name);
        let e = err_of(&path);
        assert!(matches!(e, CheckpointError::Unsupported { .. }), "{name}: {e}");
        assert_msg(&e, &[name, "SD3/SD3.5", "joint_blocks", "load_sd3_single_file_on"]);
        assert!(sdhive_checkpoint::is_sd3_file(&path).expect("header"), "{name}");
        let folder = models_dir().join(name.trim_end_matches(".safetensors"));
        let c = sdhive_checkpoint::load_sd3_single_file_on(&path, Some(&folder), &Device::Cpu).expect(name);
        assert!(!c.transformer.is_empty() && !c.vae.is_empty(), "{name}");
    }
    assert!(!sdhive_checkpoint::is_sd3_file(models_dir().join("sdxl.safetensors")).expect("header"));
}
