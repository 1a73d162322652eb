//! Loading and configuration failures must name what is wrong (file, field, tensor); the
//! random-weight builder must give runnable networks. Self-contained: no fixtures needed.

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use sdhive_models::{
    load_component, random_var_builder, AutoencoderKL, AutoencoderKLConfig, ClipTextConfig, ClipTextModel,
    IntOrList, UNet2DConditionConfig, UNet2DConditionModel,
};
use std::collections::HashMap;
use std::path::PathBuf;

fn tiny_unet_config() -> UNet2DConditionConfig {
    UNet2DConditionConfig {
        block_out_channels: vec![16, 32],
        down_block_types: vec!["CrossAttnDownBlock2D".into(), "DownBlock2D".into()],
        up_block_types: vec!["UpBlock2D".into(), "CrossAttnUpBlock2D".into()],
        layers_per_block: IntOrList::Int(1),
        norm_num_groups: Some(8),
        cross_attention_dim: IntOrList::Int(24),
        attention_head_dim: Some(IntOrList::Int(2)),
        ..UNet2DConditionConfig::default()
    }
}

fn tiny_vae_config() -> AutoencoderKLConfig {
    AutoencoderKLConfig {
        down_block_types: vec!["DownEncoderBlock2D".into(); 2],
        up_block_types: vec!["UpDecoderBlock2D".into(); 2],
        block_out_channels: vec![8, 16],
        norm_num_groups: 4,
        ..AutoencoderKLConfig::default()
    }
}

/// Every tensor a tiny UNet asks for, as an in-memory map (like a renamed single-file
/// checkpoint).
fn tiny_unet_tensors() -> HashMap<String, Tensor> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    UNet2DConditionModel::new(vb, &tiny_unet_config()).expect("tiny unet from varmap");
    let data = varmap.data().lock().expect("varmap lock");
    data.iter().map(|(k, v)| (k.clone(), v.as_tensor().detach())).collect()
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sdhive-models-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

#[test]
fn missing_tensor_error_names_the_tensor() {
    let mut tensors = tiny_unet_tensors();
    let victim = "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight";
    assert!(tensors.remove(victim).is_some(), "name layout changed");
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let err = UNet2DConditionModel::new(vb, &tiny_unet_config()).expect_err("must fail");
    let msg = err.to_string();
    assert!(msg.contains(victim) && msg.contains("unet"), "{msg}");
}

#[test]
fn shape_mismatch_error_names_the_tensor() {
    let mut tensors = tiny_unet_tensors();
    let victim = "mid_block.resnets.1.conv2.weight";
    tensors.insert(victim.into(), Tensor::zeros((32, 32, 1, 1), DType::F32, &Device::Cpu).expect("zeros"));
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let msg = UNet2DConditionModel::new(vb, &tiny_unet_config()).expect_err("must fail").to_string();
    assert!(msg.contains(victim) && msg.contains("shape"), "{msg}");
}

#[test]
fn folder_errors_name_the_folder_and_file() {
    let dir = temp_dir("empty");
    let msg = load_component(&dir, DType::F32, &Device::Cpu).err().expect("no weights").to_string();
    assert!(msg.contains(&dir.display().to_string()), "{msg}");

    let bad = dir.join("diffusion_pytorch_model.safetensors");
    std::fs::write(&bad, b"definitely not safetensors").expect("write");
    let msg = load_component(&dir, DType::F32, &Device::Cpu).err().expect("corrupt weights").to_string();
    assert!(msg.contains(&bad.display().to_string()), "{msg}");

    // A folder with valid weights but a missing tensor names the file in the error.
    let mut tensors = tiny_unet_tensors();
    tensors.remove("conv_out.bias");
    candle_core::safetensors::save(&tensors, &bad).expect("save");
    std::fs::write(dir.join("config.json"), serde_json::to_string(&tiny_unet_config()).expect("json"))
        .expect("write config");
    let msg = UNet2DConditionModel::from_dir(&dir, DType::F32, &Device::Cpu)
        .expect_err("missing tensor")
        .to_string();
    assert!(msg.contains("conv_out.bias") && msg.contains(&bad.display().to_string()), "{msg}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fp16_variant_file_is_found() {
    let dir = temp_dir("fp16");
    let tensors: HashMap<String, Tensor> =
        tiny_unet_tensors().into_iter().map(|(k, v)| (k, v.to_dtype(DType::F16).expect("f16"))).collect();
    candle_core::safetensors::save(&tensors, dir.join("diffusion_pytorch_model.fp16.safetensors"))
        .expect("save");
    let vb = load_component(&dir, DType::F32, &Device::Cpu).expect("fp16 variant");
    UNet2DConditionModel::new(vb, &tiny_unet_config()).expect("builds from fp16 weights");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn config_errors_name_file_and_field() {
    let dir = temp_dir("config");
    let path = dir.join("config.json");
    std::fs::write(&path, r#"{"block_out_channels": "wide"}"#).expect("write");
    let msg = UNet2DConditionConfig::from_file(&path).expect_err("bad type").to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");

    std::fs::write(&path, r#"{"resnet_time_scale_shift": "scale_shift"}"#).expect("write");
    let msg = UNet2DConditionConfig::from_file(&path).expect_err("unsupported").to_string();
    assert!(msg.contains(&path.display().to_string()) && msg.contains("resnet_time_scale_shift"), "{msg}");

    std::fs::write(&path, r#"{"hidden_act": "relu"}"#).expect("write");
    let msg = ClipTextConfig::from_file(&path).expect_err("unknown act").to_string();
    assert!(msg.contains("relu") && msg.contains(&path.display().to_string()), "{msg}");

    std::fs::write(&path, r#"{"down_block_types": ["DownBlock2D"]}"#).expect("write");
    let msg = AutoencoderKLConfig::from_file(&path).expect_err("bad block").to_string();
    assert!(msg.contains("down_block_types"), "{msg}");

    let missing = dir.join("nope.json");
    let msg = UNet2DConditionConfig::from_file(&missing).expect_err("absent").to_string();
    assert!(msg.contains(&missing.display().to_string()), "{msg}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn random_weights_run_and_stay_finite() {
    let dev = Device::Cpu;
    let unet = UNet2DConditionModel::new(random_var_builder(DType::F32, &dev), &tiny_unet_config())
        .expect("random unet");
    let sample = Tensor::randn(0f32, 1., (1, 4, 8, 8), &dev).expect("sample");
    let ctx = Tensor::randn(0f32, 1., (1, 7, 24), &dev).expect("ctx");
    let out = unet.forward(&sample, 500.0, &ctx, None).expect("forward");
    assert_eq!(out.dims(), &[1, 4, 8, 8]);
    let s = out.abs().and_then(|t| t.sum_all()).and_then(|t| t.to_scalar::<f32>()).expect("sum");
    assert!(s.is_finite() && s > 0.0);

    let vae =
        AutoencoderKL::new(random_var_builder(DType::F32, &dev), &tiny_vae_config()).expect("random vae");
    let img = vae.decode(&Tensor::randn(0f32, 1., (1, 4, 4, 4), &dev).expect("z")).expect("decode");
    assert_eq!(img.dims(), &[1, 3, 8, 8]);

    let clip_cfg = ClipTextConfig {
        vocab_size: 100,
        hidden_size: 16,
        intermediate_size: 32,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        projection_dim: Some(8),
        ..ClipTextConfig::default()
    };
    let clip = ClipTextModel::new(random_var_builder(DType::F32, &dev), &clip_cfg, true).expect("clip");
    let ids = Tensor::new(&[[0u32, 5, 7, 99, 99]], &dev).expect("ids");
    let out = clip.forward(&ids).expect("forward");
    assert_eq!(out.hidden_states.len(), 3);
    assert_eq!(out.text_embeds.expect("projection").dims(), &[1, 8]);
}

#[test]
fn unet_shares_whole_sample_batches() {
    let dev = Device::Cpu;
    let unet = UNet2DConditionModel::new(random_var_builder(DType::F32, &dev), &tiny_unet_config())
        .expect("random unet");
    let ctx = Tensor::randn(0f32, 1., (2, 7, 24), &dev).expect("ctx");
    let one = Tensor::randn(0f32, 1., (1, 4, 8, 8), &dev).expect("sample");
    assert_eq!(unet.forward(&one, 500.0, &ctx, None).expect("shared").dims(), &[2, 4, 8, 8]);
    // Two samples with four contexts (`[negatives…, positives…]`): sample j serves rows j and 2 + j, as the
    // samples repeated would.
    let ctx4 = Tensor::randn(0f32, 1., (4, 7, 24), &dev).expect("ctx");
    let two = Tensor::randn(0f32, 1., (2, 4, 8, 8), &dev).expect("samples");
    let shared = unet.forward(&two, 500.0, &ctx4, None).expect("shared");
    let repeated = Tensor::cat(&[&two, &two], 0).expect("cat");
    let full = unet.forward(&repeated, 500.0, &ctx4, None).expect("repeated");
    let diff = (shared - full).expect("diff").abs().expect("abs").max_all().expect("max");
    assert!(diff.to_scalar::<f32>().expect("scalar") < 1e-4, "shared samples differ from repeated ones");
    let three = Tensor::randn(0f32, 1., (3, 4, 8, 8), &dev).expect("sample");
    let msg = unet.forward(&three, 500.0, &ctx, None).expect_err("3 samples, 2 contexts").to_string();
    assert!(msg.contains("batch 2") && msg.contains("(3)"), "{msg}");
}

#[test]
fn sdxl_unet_requires_added_conditioning() {
    let cfg = UNet2DConditionConfig {
        addition_embed_type: Some("text_time".into()),
        addition_time_embed_dim: Some(4),
        projection_class_embeddings_input_dim: Some(8 + 6 * 4),
        ..tiny_unet_config()
    };
    let dev = Device::Cpu;
    let unet = UNet2DConditionModel::new(random_var_builder(DType::F32, &dev), &cfg).expect("unet");
    let sample = Tensor::zeros((1, 4, 8, 8), DType::F32, &dev).expect("sample");
    let ctx = Tensor::zeros((1, 7, 24), DType::F32, &dev).expect("ctx");
    let msg = unet.forward(&sample, 1.0, &ctx, None).expect_err("needs added").to_string();
    assert!(msg.contains("time_ids"), "{msg}");
}
