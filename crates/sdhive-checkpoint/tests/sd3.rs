//! SD3 / SD3.5 single files (SAI layout) against the diffusers folders they were made from: every converted tensor
//! bit for bit, the configs, and the errors for files missing a component.
//!
//! Fixtures: `tests/fixtures/models/{sd3,sd35m}.safetensors` and the folders beside them, written by
//! `xtask/fixtures/gen_sd3.py` (which checks the same files with diffusers' `from_single_file`).

mod common;
use common::{assert_msg, bits};

use candle_core::{DType, Device, Tensor};
use sdhive_checkpoint::{load_sd3_single_file_on, CheckpointError, Sd3Converted};
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

const STALE: &str =
    "if the SD3 fixtures were regenerated, rerun `/opt/refpy/bin/python xtask/fixtures/gen_sd3.py`";

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models")
}

fn fixture(name: &str) -> (PathBuf, PathBuf) {
    let file = models_dir().join(format!("{name}.safetensors"));
    let folder = models_dir().join(name);
    assert!(file.is_file() && folder.join("model_index.json").is_file(), "missing fixture {name}; {STALE}");
    (file, folder)
}

fn folder_weights(folder: &Path, component: &str, dtype: DType) -> HashMap<String, Tensor> {
    let dir = folder.join(component);
    let p = ["diffusion_pytorch_model.safetensors", "model.safetensors"]
        .into_iter()
        .map(|n| dir.join(n))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("no weights in {}", dir.display()));
    candle_core::safetensors::load(&p, &Device::Cpu)
        .expect("fixture weights")
        .into_iter()
        .map(|(k, t)| (k, t.to_dtype(dtype).expect("cast")))
        .collect()
}

fn assert_same(what: &str, got: &HashMap<String, Tensor>, want: &HashMap<String, Tensor>) {
    let g: BTreeSet<&String> = got.keys().collect();
    let w: BTreeSet<&String> = want.keys().collect();
    assert_eq!(g, w, "{what}: tensor names differ; {STALE}");
    for (name, wt) in want {
        let gt = &got[name];
        assert_eq!(gt.dtype(), wt.dtype(), "{what}: {name}: dtype");
        assert_eq!(gt.dims(), wt.dims(), "{what}: {name}: shape");
        assert!(bits(gt) == bits(wt), "{what}: {name}: values differ");
    }
}

fn folder_config(folder: &Path, sub: &str) -> Value {
    let name = if sub == "scheduler" { "scheduler_config.json" } else { "config.json" };
    serde_json::from_str(&std::fs::read_to_string(folder.join(sub).join(name)).expect("config"))
        .expect("json")
}

fn convert(file: &Path, config: Option<&Path>) -> Sd3Converted {
    load_sd3_single_file_on(file, config, &Device::Cpu).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn sd3_single_file_equals_its_folder_bit_for_bit() {
    let (file, folder) = fixture("sd3");
    let c = convert(&file, Some(&folder));
    assert_same("transformer", &c.transformer, &folder_weights(&folder, "transformer", DType::F32));
    assert_same("vae", &c.vae, &folder_weights(&folder, "vae", DType::F32));
    let te = |w: &Option<HashMap<String, Tensor>>| w.clone().expect("text encoder in the file");
    // The folder's CLIP-L projection is the identity the converter makes (SAI files have none).
    assert_same("text_encoder", &te(&c.text_encoder), &folder_weights(&folder, "text_encoder", DType::F32));
    assert_same(
        "text_encoder_2",
        &te(&c.text_encoder_2),
        &folder_weights(&folder, "text_encoder_2", DType::F32),
    );
    assert_same(
        "text_encoder_3",
        &te(&c.text_encoder_3),
        &folder_weights(&folder, "text_encoder_3", DType::F32),
    );
    assert_eq!(c.overridden.len(), 6, "{:?}", c.overridden);
    assert!(c.skipped.is_empty(), "{:?}", c.skipped);
}

#[test]
fn sd35m_single_file_is_the_folder_in_f16() {
    let (file, folder) = fixture("sd35m");
    let c = convert(&file, Some(&folder));
    assert_same("transformer", &c.transformer, &folder_weights(&folder, "transformer", DType::F16));
    assert_same("vae", &c.vae, &folder_weights(&folder, "vae", DType::F16));
    assert!(c.text_encoder.is_none() && c.text_encoder_2.is_none() && c.text_encoder_3.is_none());
    assert!(c.configs.text_encoder.is_none() && c.configs.text_encoder_3.is_none());
}

/// A config folder holding only the subfolders `keep` (configs copied from `folder`, others empty): what the
/// converter does not find there it infers.
fn partial_config(tmp: &Path, folder: &Path, keep: &[&str]) -> PathBuf {
    let dir = tmp.join(format!("cfg-{}", keep.join("-")));
    for sub in ["text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"] {
        std::fs::create_dir_all(dir.join(sub)).expect("dir");
    }
    for sub in keep {
        std::fs::create_dir_all(dir.join(sub)).expect("dir");
        std::fs::copy(folder.join(sub).join("config.json"), dir.join(sub).join("config.json")).expect("copy");
    }
    dir
}

/// Without configs, what the shapes say must match the folders' configs.
#[test]
fn configs_are_inferred_from_shapes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for name in ["sd3", "sd35m"] {
        let (file, folder) = fixture(name);
        // sd3's tiny 8-wide heads are not visible without a qk norm: its transformer config comes from the folder.
        let keep: &[&str] = if name == "sd3" { &["transformer"] } else { &[] };
        let c = convert(&file, Some(&partial_config(tmp.path(), &folder, keep)));
        assert_eq!(c.overridden, keep, "{name}");
        let want = folder_config(&folder, "transformer");
        for key in [
            "in_channels",
            "out_channels",
            "patch_size",
            "num_layers",
            "attention_head_dim",
            "num_attention_heads",
            "joint_attention_dim",
            "caption_projection_dim",
            "pooled_projection_dim",
            "pos_embed_max_size",
            "dual_attention_layers",
            "qk_norm",
        ] {
            assert_eq!(c.configs.transformer[key], want[key], "{name}: transformer {key}");
        }
        let vae = folder_config(&folder, "vae");
        for key in
            ["latent_channels", "block_out_channels", "layers_per_block", "scaling_factor", "shift_factor"]
        {
            assert_eq!(c.configs.vae[key], vae[key], "{name}: vae {key}");
        }
        assert_eq!(c.configs.vae["use_quant_conv"], false);
        assert_eq!(c.configs.scheduler["shift"], 3.0);
    }
    let (file, folder) = fixture("sd3");
    let c = convert(&file, Some(&partial_config(tmp.path(), &folder, &["transformer"])));
    let t5 = folder_config(&folder, "text_encoder_3");
    let got = c.configs.text_encoder_3.expect("t5 config");
    for key in ["vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads", "feed_forward_proj"] {
        assert_eq!(got[key], t5[key], "t5 {key}");
    }
    for (sub, cfg) in [("text_encoder", c.configs.text_encoder), ("text_encoder_2", c.configs.text_encoder_2)]
    {
        let want = folder_config(&folder, sub);
        let cfg = cfg.expect("clip config");
        for key in ["hidden_size", "intermediate_size", "num_hidden_layers", "projection_dim", "vocab_size"] {
            assert_eq!(cfg[key], want[key], "{sub} {key}");
        }
    }
    let e = err(&file, None);
    assert_msg(&e, &["sd3.safetensors", "width 16", "64-wide", "diffusers folder as config"]);
}

/// Writes `file`'s tensors minus those under `drop` to a temporary single file.
fn without(file: &Path, drop: &[&str], dir: &Path, name: &str) -> PathBuf {
    let tensors: HashMap<String, Tensor> = candle_core::safetensors::load(file, &Device::Cpu)
        .expect("fixture")
        .into_iter()
        .filter(|(k, _)| !drop.iter().any(|d| k.starts_with(d)))
        .collect();
    let out = dir.join(name);
    candle_core::safetensors::save(&tensors, &out).expect("write");
    out
}

fn err(file: &Path, config: Option<&Path>) -> CheckpointError {
    match load_sd3_single_file_on(file, config, &Device::Cpu) {
        Ok(_) => panic!("{} converted", file.display()),
        Err(e) => e,
    }
}

#[test]
fn missing_components_are_named() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (sd3, folder) = fixture("sd3");
    let (sd35m, _) = fixture("sd35m");

    // SD3.5 files ship without text encoders: they must come from the folder, and the error says where.
    let e = err(&sd35m, None);
    assert!(matches!(e, CheckpointError::MissingTextEncoders { .. }), "{e}");
    assert_msg(
        &e,
        &["sd35m.safetensors", "no text encoders", "text_encoders.clip_l", "sd35m", "text_encoder_2"],
    );
    let bare = tmp.path().join("bare");
    std::fs::create_dir_all(bare.join("transformer")).expect("dir");
    std::fs::copy(models_dir().join("sd35m/transformer/config.json"), bare.join("transformer/config.json"))
        .expect("copy");
    let e = err(&sd35m, Some(&bare));
    assert_msg(&e, &["sd35m.safetensors", "bare", "`text_encoder`", "`tokenizer_2`"]);

    let no_g = without(&sd3, &["text_encoders.clip_g."], tmp.path(), "no_g.safetensors");
    let e = err(&no_g, Some(&folder));
    assert!(matches!(e, CheckpointError::MissingComponent { .. }), "{e}");
    assert_msg(&e, &["no_g.safetensors", "CLIP-G", "text_encoders.clip_g.transformer."]);

    let no_vae = without(&sd3, &["first_stage_model."], tmp.path(), "no_vae.safetensors");
    assert_msg(&err(&no_vae, Some(&folder)), &["no_vae.safetensors", "VAE", "first_stage_model."]);

    let no_final =
        without(&sd3, &["model.diffusion_model.final_layer.linear."], tmp.path(), "nf.safetensors");
    assert_msg(&err(&no_final, Some(&folder)), &["nf.safetensors", "final_layer.linear.weight"]);

    let sdxl = models_dir().join("sdxl.safetensors");
    assert_msg(&err(&sdxl, None), &["sdxl.safetensors", "not an SD3/SD3.5 checkpoint"]);

    // A folder that contradicts the file is refused, naming the key.
    let e = err(&sd3, Some(&models_dir().join("sd35m")));
    assert!(matches!(e, CheckpointError::ConfigMismatch(_)), "{e}");
    assert_msg(&e, &["sd35m", "sd3.safetensors"]);
}

#[test]
fn file_parts_come_from_the_header() {
    let (sd3, _) = fixture("sd3");
    let parts = sdhive_checkpoint::sd3_file_parts(&sd3).unwrap();
    assert!(parts.vae && parts.clip_l && parts.clip_g && parts.t5, "{parts:?}");
    let (sd35m, _) = fixture("sd35m");
    let bare = sdhive_checkpoint::sd3_file_parts(&sd35m).unwrap();
    assert!(bare.vae && !bare.clip_l && !bare.clip_g && !bare.t5, "{bare:?}");
    assert_eq!(bare.t5_elements, 0);
    let layers = |name: &str| folder_config(&models_dir().join(name), "transformer")["num_layers"].as_u64();
    assert_eq!((parts.depth as u64, bare.depth as u64), (layers("sd3").unwrap(), layers("sd35m").unwrap()));
    // The counts are the header's: every tensor of the file, split at T5.
    let file = safetensors::SafeTensors::read_metadata(&std::fs::read(&sd3).unwrap()).unwrap().1;
    let total: u64 = file.tensors().values().map(|t| t.shape.iter().product::<usize>() as u64).sum();
    assert!(parts.t5_elements > 0);
    assert_eq!(parts.elements_without_t5 + parts.t5_elements, total);
    let not_sd3 = models_dir().join("sd1.safetensors");
    assert!(sdhive_checkpoint::sd3_file_parts(&not_sd3).is_err());
}

/// The MMDiT of a diffusers folder written in SAI's layout is the SAI file's MMDiT, byte for byte: the exact
/// inverse of the conversion (q/k/v fused in order, the adaLN halves swapped back where diffusers swapped them).
#[test]
fn a_folder_transformer_written_in_sais_layout_is_the_files() {
    for name in ["sd3", "sd35m"] {
        let (file, folder) = fixture(name);
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("mmdit.safetensors");
        let src = folder.join("transformer/diffusion_pytorch_model.safetensors");
        let written = sdhive_checkpoint::write_sd3_transformer_as_sai(&src, &out).unwrap();
        let (ours, theirs) = (std::fs::read(&out).unwrap(), std::fs::read(&file).unwrap());
        let ours = safetensors::SafeTensors::deserialize(&ours).unwrap();
        let theirs = safetensors::SafeTensors::deserialize(&theirs).unwrap();
        let mmdit: BTreeSet<String> = theirs
            .names()
            .into_iter()
            .filter(|n| n.starts_with("model.diffusion_model."))
            .map(str::to_string)
            .collect();
        let names: BTreeSet<String> = ours.names().into_iter().map(str::to_string).collect();
        assert_eq!(names, mmdit, "{name}: tensor names");
        let mut bytes = 0;
        for n in &names {
            let (a, b) = (ours.tensor(n).unwrap(), theirs.tensor(n).unwrap());
            assert_eq!(a.shape(), b.shape(), "{name}: {n}");
            bytes += a.data().len() as u64;
            if a.dtype() == b.dtype() {
                assert_eq!(a.data(), b.data(), "{name}: {n}");
            } else {
                // sd35m's file is f16 and its folder f32: compare values.
                let value = |t: &safetensors::tensor::TensorView| {
                    Tensor::from_raw_buffer(
                        t.data(),
                        DType::try_from(t.dtype()).unwrap(),
                        t.shape(),
                        &Device::Cpu,
                    )
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                };
                let (va, vb) = (value(&a), value(&b));
                let worst =
                    va.iter().zip(&vb).map(|(x, y)| (x - y).abs() / y.abs().max(1e-3)).fold(0f32, f32::max);
                assert!(worst < 1e-3, "{name}: {n} differs by {worst} (relative)");
            }
        }
        assert_eq!(written, bytes);
    }
    // A file that is no diffusers MMDiT is refused naming a tensor.
    let tmp = tempfile::tempdir().unwrap();
    let err = sdhive_checkpoint::write_sd3_transformer_as_sai(
        &models_dir().join("sd1/unet/diffusion_pytorch_model.safetensors"),
        &tmp.path().join("x.safetensors"),
    )
    .unwrap_err();
    assert!(err.to_string().contains("unexpected tensor"), "{err}");
}
