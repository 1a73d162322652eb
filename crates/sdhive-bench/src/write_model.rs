//! `sdhive-bench --write-model DIR`: a full-size SD1.5 or SDXL diffusers folder with random weights, so the
//! workers' whole path (loading, text encoders, denoising loop, VAE) can be run and timed at real sizes where no
//! real weights may be downloaded. The networks have the released architectures; the tokenizers, scheduler and
//! `model_index.json` come from a template folder (the test fixtures), and the text encoders' vocabulary is sized
//! to that tokenizer. Weights are f16, as released models usually are.

use crate::Family;
use anyhow::{Context, Result};
use candle_core::{DType, Device};
use sdhive_models::{
    recording_random_var_builder, sd15_unet_config, sd15_vae_config, sdxl_unet_config, sdxl_vae_config,
    AutoencoderKL, ClipActivation, ClipTextConfig, UNet2DConditionModel,
};
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

pub fn write(family: Family, template: &Path, out: &Path) -> Result<()> {
    let t = Instant::now();
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    copy_file(template, out, "model_index.json")?;
    let mut extra = vec!["tokenizer", "scheduler"];
    if family == Family::Sdxl {
        extra.push("tokenizer_2");
    }
    for sub in extra {
        copy_dir(&template.join(sub), &out.join(sub))?;
    }
    let te1 = template_clip(template, "text_encoder")?;
    let clip_l = ClipTextConfig {
        hidden_size: 768,
        intermediate_size: 3072,
        projection_dim: Some(768),
        num_hidden_layers: 12,
        num_attention_heads: 12,
        hidden_act: ClipActivation::QuickGelu,
        ..te1
    };
    write_component(out, "text_encoder", "model.safetensors", &clip_l, |vb| {
        Ok(sdhive_models::ClipTextModel::new(vb, &clip_l, false).map(drop)?)
    })?;
    match family {
        Family::Sd15 => {
            write_unet_vae(out, &sd15_unet_config(), &sd15_vae_config())?;
        }
        Family::Sdxl => {
            let te2 = template_clip(template, "text_encoder_2")?;
            let clip_g = ClipTextConfig {
                hidden_size: 1280,
                intermediate_size: 5120,
                projection_dim: Some(1280),
                num_hidden_layers: 32,
                num_attention_heads: 20,
                hidden_act: ClipActivation::Gelu,
                ..te2
            };
            write_component(out, "text_encoder_2", "model.safetensors", &clip_g, |vb| {
                Ok(sdhive_models::ClipTextModel::new(vb, &clip_g, true).map(drop)?)
            })?;
            write_unet_vae(out, &sdxl_unet_config(), &sdxl_vae_config())?;
        }
    }
    eprintln!("wrote {} in {:.1} s", out.display(), t.elapsed().as_secs_f64());
    Ok(())
}

fn write_unet_vae(
    out: &Path,
    unet: &sdhive_models::UNet2DConditionConfig,
    vae: &sdhive_models::AutoencoderKLConfig,
) -> Result<()> {
    write_component(out, "unet", "diffusion_pytorch_model.safetensors", unet, |vb| {
        Ok(UNet2DConditionModel::new(vb, unet).map(drop)?)
    })?;
    write_component(out, "vae", "diffusion_pytorch_model.safetensors", vae, |vb| {
        Ok(AutoencoderKL::new(vb, vae).map(drop)?)
    })
}

/// The template's text encoder config: its vocabulary size and special token ids match the copied tokenizer.
fn template_clip(template: &Path, sub: &str) -> Result<ClipTextConfig> {
    ClipTextConfig::from_file(&template.join(sub).join("config.json"))
        .with_context(|| format!("reading the template's {sub} config"))
}

/// Builds one network from recorded random weights and writes its config and safetensors.
fn write_component<C: Serialize>(
    out: &Path,
    sub: &str,
    file: &str,
    config: &C,
    build: impl FnOnce(candle_nn::VarBuilder<'static>) -> Result<()>,
) -> Result<()> {
    let dir = out.join(sub);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let json = serde_json::to_string_pretty(config).context("serialising a config")?;
    std::fs::write(dir.join("config.json"), json).with_context(|| format!("writing {sub}/config.json"))?;
    let (vb, recorded) = recording_random_var_builder(DType::F16, &Device::Cpu);
    build(vb).with_context(|| format!("building {sub} with random weights"))?;
    let tensors = recorded.take();
    let params: usize = tensors.values().map(|t| t.elem_count()).sum();
    let path = dir.join(file);
    candle_core::safetensors::save(&tensors, &path).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("{sub}: {} tensors, {:.1} M parameters", tensors.len(), params as f64 / 1e6);
    Ok(())
}

fn copy_file(from_dir: &Path, to_dir: &Path, name: &str) -> Result<()> {
    std::fs::copy(from_dir.join(name), to_dir.join(name))
        .with_context(|| format!("copying {} from {}", name, from_dir.display()))
        .map(drop)
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name()))
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    Ok(())
}
